"""pallas_kernels.testing.draw_until_logits_agree: the redraw rule of the model tests that compare a
kernel path's logits with the reference path's (a rounding flip is drawn again, a wrong kernel is
not hidden)."""

import numpy as np
import pytest

from pallas_kernels.testing import draw_until_logits_agree


def _draws(moved):
    """A ``draw`` whose i-th call returns (i, ref, out) with out moved by ``moved[i]`` of ref's scale
    at one element (fresh random logits per call)."""
    calls = []

    def draw():
        i = len(calls)
        calls.append(i)
        ref = np.random.default_rng().standard_normal((2, 1, 64)).astype(np.float32)
        out = ref.copy()
        out[0, 0, 3] += moved[i] * float(np.max(np.abs(ref)))
        return i, ref, out

    return draw, calls


def test_a_moved_draw_is_drawn_again_and_the_agreeing_one_returned():
    draw, calls = _draws([3.4e-2, 1e-1, 1e-3, 5.0])
    i, ref, out = draw_until_logits_agree(draw)
    assert i == 2 and calls == [0, 1, 2] and not np.array_equal(ref, out)


def test_every_draw_moved_fails_naming_the_draws():
    draw, calls = _draws([2.1e-3] * 3)
    with pytest.raises(AssertionError, match="differed on 3 draws in a row"):
        draw_until_logits_agree(draw, tries=3)
    assert calls == [0, 1, 2]


def test_a_non_finite_logit_fails_at_once():
    draw, calls = _draws([np.nan, 0.0])
    with pytest.raises(AssertionError):
        draw_until_logits_agree(draw)
    assert calls == [0]
