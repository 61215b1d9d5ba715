"""Sampler unit tests (no model): greedy, top-k / top-p filtering, temperature, reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.sampling import SamplingParams, filter_logits, request_keys, sample, sample_traced


def _draw(logits, sp, n, request=0):
    """n samples of one row via the batched sampler (steps 0..n-1 as a batch)."""
    g, uk, up = sp.static_key(logits.shape[-1])
    lg = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, logits.shape[-1]))
    keys = request_keys(jnp.int32(sp.seed), jnp.full((n,), request), jnp.arange(n))
    return np.asarray(sample(lg, keys, sp.temperature, sp.top_k, sp.top_p, greedy=g, use_top_k=uk, use_top_p=up))


def test_greedy_is_argmax():
    lg = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    out = sample(jnp.asarray(lg), None, 0.0, 0, 1.0, greedy=True, use_top_k=False, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(out), lg.argmax(-1))


def test_top_k_and_top_p_masks():
    lg = jnp.asarray([[4.0, 3.0, 2.0, 1.0, 0.0]])
    f = np.asarray(filter_logits(lg, 2, 1.0, use_top_k=True, use_top_p=False))
    assert np.isfinite(f).tolist() == [[True, True, False, False, False]]
    p = np.asarray(jax.nn.softmax(lg))[0]
    # nucleus: smallest prefix whose mass reaches top_p
    f = np.asarray(filter_logits(lg, 0, float(p[0] + p[1] * 0.5), use_top_k=False, use_top_p=True))
    assert np.isfinite(f).tolist() == [[True, True, False, False, False]]
    f = np.asarray(filter_logits(lg, 0, float(p[0] * 0.5), use_top_k=False, use_top_p=True))
    assert np.isfinite(f).tolist() == [[True, False, False, False, False]]  # the top token always stays
    f = np.asarray(filter_logits(lg, 3, 0.999, use_top_k=True, use_top_p=True))
    assert np.isfinite(f).sum() == 3


def test_samples_stay_in_the_allowed_set_and_follow_temperature():
    lg = np.array([2.0, 1.5, 1.0, -1.0, -3.0, 0.5], np.float32)
    s = _draw(lg, SamplingParams(temperature=1.0, top_k=3, seed=1), 400)
    assert set(s.tolist()) <= {0, 1, 2} and len(set(s.tolist())) == 3
    s = _draw(lg, SamplingParams(temperature=1.0, top_p=0.5, seed=2), 200)
    assert set(s.tolist()) <= {0, 1}
    # empirical frequencies at T=1 match the softmax
    s = _draw(lg, SamplingParams(temperature=1.0, seed=3), 4000)
    freq = np.bincount(s, minlength=6) / len(s)
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(lg)), atol=0.03)
    # a tiny temperature is (almost) greedy, a big one flattens
    assert (_draw(lg, SamplingParams(temperature=1e-3, seed=4), 100) == 0).all()
    hot = np.bincount(_draw(lg, SamplingParams(temperature=50.0, seed=5), 3000), minlength=6) / 3000
    assert hot.min() > 0.1


def test_keys_depend_on_seed_request_and_step_only():
    lg = np.zeros(1000, np.float32)
    sp = SamplingParams(temperature=1.0, seed=7)
    a = _draw(lg, sp, 20, request=3)
    np.testing.assert_array_equal(a, _draw(lg, sp, 20, request=3))
    assert (a != _draw(lg, sp, 20, request=4)).any()
    assert (a != _draw(lg, SamplingParams(temperature=1.0, seed=8), 20, request=3)).any()
    # the same (request, step) in a different batch position / batch size gives the same token
    g, uk, up = sp.static_key(1000)
    keys = request_keys(jnp.int32(7), jnp.asarray([9, 3, 3]), jnp.asarray([0, 5, 2]))
    out = np.asarray(sample(jnp.zeros((3, 1000)), keys, 1.0, 0, 1.0, greedy=g, use_top_k=uk, use_top_p=up))
    assert out[1] == a[5] and out[2] == a[2]


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5), dict(seed=-1)])
def test_invalid_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_traced_sampler_matches_specialised():
    lg = jnp.asarray(np.random.default_rng(1).normal(size=(4, 300)).astype(np.float32) * 3)
    keys = request_keys(jnp.int32(5), jnp.arange(4), jnp.zeros(4, jnp.int32))
    f = jax.jit(sample_traced)
    for sp in [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
               SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, top_k=40, top_p=0.9)]:
        g, uk, up = sp.static_key(300)
        want = sample(lg, keys, sp.temperature, sp.top_k, sp.top_p, greedy=g, use_top_k=uk, use_top_p=up)
        got = f(lg, keys, jnp.float32(sp.temperature), jnp.int32(sp.top_k), jnp.float32(sp.top_p))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
