"""RoPE / YaRN tables (attention.md §2.2) against an independent float64 formula."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import get_preset
from dsv41_jax.rope import apply_rope, layer_frequencies, rope_angles, rope_frequencies


def yarn64(dim, base, orig, factor, bf, bs):
    i = np.arange(dim // 2, dtype=np.float64)
    f = base ** (-2 * i / dim)
    if orig:
        corr = lambda r: dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa: E731
        lo, hi = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), dim - 1)
        ramp = np.clip((i - lo) / max(hi - lo, 1e-3), 0, 1)
        f = f * (1 - ramp) + f / factor * ramp
    return f


def test_v41_ramp_bounds():
    cfg = get_preset("v41-flash")
    f = layer_frequencies(cfg, 20).astype(np.float64)
    plain = 160000.0 ** (-2 * np.arange(32) / 64)
    np.testing.assert_allclose(f[:16], plain[:16], rtol=1e-6)  # pairs 0-15 unchanged (lo = 15)
    np.testing.assert_allclose(f[25:], plain[25:] / 16, rtol=1e-6)  # pairs 25-31 divided by 16 (hi = 25)
    assert np.all(f[16:25] < plain[16:25]) and np.all(f[16:25] > plain[16:25] / 16)


@pytest.mark.parametrize("layer,base,orig", [(0, 10000.0, 0), (1, 10000.0, 0), (5, 160000.0, 65536), (39, 160000.0, 65536)])
@pytest.mark.parametrize("pos", [0, 1, 65535, 1048575])
def test_angles_at_positions(layer, base, orig, pos):
    cfg = get_preset("v41-flash")
    ang = np.asarray(rope_angles(jnp.asarray([pos]), layer_frequencies(cfg, layer)))[0].astype(np.float64)
    want = pos * yarn64(64, base, orig, 16.0, 32, 1)
    # float32 table: angle = f32(pos) * f32(freq); relative error of a few ulp
    np.testing.assert_allclose(ang, want, rtol=3e-7, atol=0)
    c, s = np.cos(ang), np.sin(ang)
    assert np.all(np.abs(c * c + s * s - 1) < 1e-12)


def test_ratio0_layers_have_no_yarn_and_dspark_stages_too():
    cfg = get_preset("v41-flash")
    plain = rope_frequencies(64, 10000.0, 0, 16.0, 32, 1)
    for l in (0, 1, 40, 41, 42):
        np.testing.assert_array_equal(layer_frequencies(cfg, l), plain)


def test_apply_rope_interleaved_last_dims_and_inverse():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4, 64)).astype(np.float32))
    freqs = rope_frequencies(16, 10000.0, 0, 16.0, 32, 1)
    ang = rope_angles(jnp.asarray([[0, 5, 9], [1, 2, 3]]), freqs)
    y = apply_rope(x, ang)
    np.testing.assert_array_equal(np.asarray(y[..., :48]), np.asarray(x[..., :48]))  # nope dims untouched
    # pair (x[48], x[49]) is rotated by the angle of pair 0 (interleaved, GPT-J style)
    a = np.asarray(ang)[1, 2, 0]
    x0, x1 = np.asarray(x)[1, 2, 0, 48], np.asarray(x)[1, 2, 0, 49]
    np.testing.assert_allclose(np.asarray(y)[1, 2, 0, 48:50], [x0 * np.cos(a) - x1 * np.sin(a), x0 * np.sin(a) + x1 * np.cos(a)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(apply_rope(y, ang, inverse=True)), np.asarray(x), atol=1e-5)
