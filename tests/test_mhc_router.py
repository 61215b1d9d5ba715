"""mHC and router invariants (model.md §4, §5, §15)."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import get_preset
from dsv41_jax.moe import route
from pallas_kernels.mhc.reference import hc_collapse, hc_expand, hc_mixes

HC, D = 4, 64


def _mixes(x, fn, scale, base):
    return hc_mixes(x, fn, scale, base, norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)


def test_hc_split_at_zero_logits():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, HC, D))
    pre, post, comb = _mixes(x, jnp.zeros((24, HC * D)), jnp.ones(3), jnp.zeros(24))
    np.testing.assert_allclose(np.asarray(pre), 0.5 + 1e-6, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(post), 1.0, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(comb), 0.25, atol=2e-6)


def test_comb_is_doubly_stochastic_after_the_schedule():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(k[0], (50, HC, D))
    fn = jax.random.normal(k[1], (24, HC * D)) / 16
    base = 0.5 * jax.random.normal(k[2], (24,))
    scale = jax.random.uniform(k[3], (3,), minval=0.5, maxval=1.5) * 3
    pre, post, comb = _mixes(x, fn, scale, base)
    c = np.asarray(comb)
    np.testing.assert_allclose(c.sum(axis=-2), 1.0, atol=1e-5)  # ends on a column normalisation
    np.testing.assert_allclose(c.sum(axis=-1), 1.0, atol=2e-2)  # rows: close, not exact (truncated schedule)
    assert np.all(c > 0) and np.all((np.asarray(post) > 0) & (np.asarray(post) < 2))
    assert np.all((np.asarray(pre) > 1e-6) & (np.asarray(pre) < 1 + 1e-6))


def test_sinkhorn_schedule_is_exactly_twenty_rounds():
    # a sharply peaked comb is not converged after 20 rounds: the exact count matters
    x = jnp.ones((1, HC, D))
    fn = jnp.zeros((24, HC * D))
    base = jnp.zeros(24).at[8:].set(jnp.asarray(np.random.default_rng(0).normal(size=16) * 6))
    c20 = np.asarray(_mixes(x, fn, jnp.ones(3), base)[2])
    c21 = np.asarray(hc_mixes(x, fn, jnp.ones(3), base, norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=21)[2])
    assert np.abs(c20 - c21).max() > 1e-7


def test_first_collapse_returns_the_embedding_and_expand_mixes_sources():
    e = jax.random.normal(jax.random.PRNGKey(2), (5, D))
    h = jnp.broadcast_to(e[:, None], (5, HC, D))
    one_hot = jnp.zeros((5, HC)).at[:, 0].set(1.0)
    np.testing.assert_array_equal(np.asarray(hc_collapse(h, one_hot)), np.asarray(e))
    pre = jnp.full((5, HC), 0.3)
    np.testing.assert_allclose(np.asarray(hc_collapse(h, pre)), 1.2 * np.asarray(e), rtol=1e-6)
    # comb[j, k]: row j = source stream, column k = destination
    res = jax.random.normal(jax.random.PRNGKey(3), (5, HC, D))
    comb = jnp.zeros((5, HC, HC)).at[:, 2, 0].set(1.0)  # stream 2 -> stream 0
    out = hc_expand(jnp.zeros((5, D)), res, jnp.zeros((5, HC)), comb)
    np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(res[:, 2]))
    np.testing.assert_array_equal(np.asarray(out[:, 1:]), 0)


def test_router_weights_sum_to_route_scale_and_bias_only_selects():
    cfg = get_preset("tiny")
    k = jax.random.split(jax.random.PRNGKey(4), 3)
    x = jax.random.normal(k[0], (32, cfg.dim))
    gate = {"weight": jax.random.normal(k[1], (8, cfg.dim)) / 8, "bias": jnp.zeros(8)}
    w, idx = route(gate, x, cfg, 2)
    np.testing.assert_allclose(np.asarray(w.sum(-1)), cfg.route_scale, rtol=1e-6)
    # a large bias on expert 5 forces its selection, but its weight still comes from the unbiased score
    gate_b = {**gate, "bias": jnp.zeros(8).at[5].set(100.0)}
    wb, idxb = route(gate_b, x, cfg, 2)
    assert np.all((np.asarray(idxb) == 5).any(-1))
    z = np.asarray(x) @ np.asarray(gate["weight"]).T / cfg.gate_temp
    s = np.sqrt(np.log1p(np.exp(z)))
    for n in range(32):
        sel = np.asarray(idxb[n])
        np.testing.assert_allclose(np.asarray(wb[n]), s[n, sel] / s[n, sel].sum() * cfg.route_scale, rtol=1e-5)
    assert not np.array_equal(np.asarray(idx), np.asarray(idxb))
