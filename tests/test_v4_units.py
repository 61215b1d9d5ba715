"""V4 building blocks against direct numpy transcriptions of the spec (attention.md §2.4, §3.2, §5.2;
model.md §4.4, §5.2): the overlapping compressor with ``ape`` under any chunking, the KV storage
rounding, the Hadamard rotation, hash routing and ``hc_head``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.attention import _store_v4, compress, hadamard, head_rms_norm
from dsv41_jax.config import get_preset
from dsv41_jax.moe import route
from dsv41_jax.options import RunOptions
from dsv41_jax.quant.fake_quant import fake_quant_fp8
from dsv41_jax.transformer import hc_head

CFG = get_preset("v4-flash").replace(dim=32, head_dim=16, rope_head_dim=8, dtype="bf16", expert_dtype=None)

# The units under test as one jitted program each (as in the model): eagerly, each of their jnp ops
# compiled on its own, most of this module's time.
_compress = jax.jit(compress, static_argnums=(5, 6, 7), static_argnames="overlap")
_store = jax.jit(_store_v4, static_argnums=(1, 2, 3))
_fq8 = jax.jit(fake_quant_fp8, static_argnums=1)
_route = jax.jit(route, static_argnums=(2, 3))
_hc_head = jax.jit(hc_head, static_argnums=4)


def _compress_ref(x, wkv, wgate, ape, normw, m, overlap, eps):
    """attention.md §5.2 literally: entry j of every complete block of the whole sequence x [T, D]."""
    a = x @ wkv.T
    z = x @ wgate.T + ape[np.arange(len(x)) % m]
    d = a.shape[1] // (2 if overlap else 1)
    out = []
    for j in range(len(x) // m):
        cur = slice(j * m, (j + 1) * m)
        if overlap:
            va, za = a[cur, d:], z[cur, d:]
            if j > 0:
                prev = slice((j - 1) * m, j * m)
                va, za = np.concatenate([a[prev, :d], va]), np.concatenate([z[prev, :d], za])
        else:
            va, za = a[cur], z[cur]
        w = np.exp(za - za.max(0))
        c = (w / w.sum(0) * va).sum(0)
        out.append(c / np.sqrt((c * c).mean() + eps) * normw)
    return np.array(out)


@pytest.mark.parametrize("m,overlap", [(4, True), (8, False)])
def test_compressor_any_chunking_matches_spec(m, overlap):
    rng = np.random.default_rng(0)
    T, D, d = 45, 32, 16
    C = (2 if overlap else 1) * d
    x = rng.standard_normal((T, D)).astype(np.float32)
    p = {"wkv": {"weight": jnp.asarray(rng.standard_normal((C, D)) / 6, jnp.float32)},
         "wgate": {"weight": jnp.asarray(rng.standard_normal((C, D)) / 6, jnp.float32)},
         "ape": jnp.asarray(rng.standard_normal((m, C)), jnp.float32),
         "norm": {"weight": jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)}}
    ref = _compress_ref(x.astype(np.float64), *(np.asarray(v, np.float64) for v in (
        p["wkv"]["weight"], p["wgate"]["weight"], p["ape"], p["norm"]["weight"])), m, overlap, 1e-6)
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    lead = m if overlap else 0
    lc = {"state_kv": jnp.asarray(np.zeros((1, lead + m, C), np.float32)),
          "state_score": jnp.asarray(np.full((1, lead + m, C), -np.inf, np.float32))}
    got = np.full((T // m, d), np.nan)
    pos = 0
    for n in (3, 1, 9, 4, 7, 2, 11, 8):  # chunks crossing block boundaries at every offset
        chunk = np.zeros((1, 12, D), np.float32)
        chunk[0, :n] = x[pos:pos + n]
        lat, idx, ok, st = _compress(p, jnp.asarray(chunk), lc, jnp.array([pos]), jnp.array([n]), m, CFG, opts,
                                     overlap=overlap)
        lc = {**lc, **st}
        for j, v in zip(np.asarray(idx[0]), np.asarray(ok[0])):
            if v:
                got[j] = np.asarray(lat[0])[list(np.asarray(idx[0])).index(j)]
        pos += n
    assert pos == T
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)


def test_kv_storage_rounding():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 512)) * 3, jnp.float32)
    ref = np.asarray(_store(x, "window", RunOptions(dtype="float32", kv_cache_dtype="reference"), 64))
    xn = np.asarray(x)
    np.testing.assert_array_equal(ref[..., 448:], xn[..., 448:].astype(jnp.bfloat16).astype(np.float32))  # RNE
    np.testing.assert_array_equal(ref[..., :448], np.asarray(_fq8(jnp.asarray(xn[..., :448]), 64)))
    assert not np.array_equal(ref[..., :448], xn[..., :448])
    plain = _store(x, "window", RunOptions(dtype="float32", kv_cache_dtype="float32"), 64)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(x))


def test_hadamard_rotation():
    rng = np.random.default_rng(2)
    e = np.eye(128, dtype=np.float32)
    h = np.asarray(hadamard(jnp.asarray(e)))
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-6)  # orthonormal
    np.testing.assert_allclose(h[0], np.full(128, 128 ** -0.5), atol=1e-7)  # Sylvester order: first row all +
    h2 = np.array([[1, 1], [1, -1]], np.float64)
    hs = h2
    for _ in range(6):
        hs = np.kron(h2, hs)
    np.testing.assert_allclose(h, hs / np.sqrt(128), atol=1e-7)
    q, k = rng.standard_normal((2, 128)).astype(np.float32)
    assert abs(float(hadamard(jnp.asarray(q)) @ hadamard(jnp.asarray(k))) - float(q @ k)) < 1e-4


def test_head_rms_norm_has_no_weight():
    q = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 3, 16)) * 5, jnp.float32)
    y = np.asarray(head_rms_norm(q, 1e-6))
    np.testing.assert_allclose((y * y).mean(-1), 1.0, atol=1e-4)


def test_hash_routing_uses_tid2eid_and_unbiased_scores():
    rng = np.random.default_rng(4)
    E, D, V, k = 8, 32, 50, 3
    gate = {"weight": jnp.asarray(rng.standard_normal((E, D)), jnp.float32),
            "tid2eid": jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(V)]), jnp.int32)}
    x = jnp.asarray(rng.standard_normal((6, D)), jnp.float32)
    toks = jnp.asarray([0, 5, 7, 49, 5, 1])
    w, idx = _route(gate, x, CFG, k, toks)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(gate["tid2eid"])[np.asarray(toks)])
    s = np.sqrt(np.log1p(np.exp(np.asarray(x, np.float64) @ np.asarray(gate["weight"], np.float64).T)))
    sel = np.take_along_axis(s, np.asarray(idx), 1)
    np.testing.assert_allclose(np.asarray(w), sel / sel.sum(1, keepdims=True) * CFG.route_scale, rtol=1e-5)
    with pytest.raises(ValueError):
        route(gate, x, CFG, k)


def test_hc_head_formula():
    rng = np.random.default_rng(5)
    h = rng.standard_normal((2, 3, 4, 32)).astype(np.float32)
    fn, base, scale = rng.standard_normal((4, 128)) / 10, rng.standard_normal(4), np.array([0.7])
    y = np.asarray(_hc_head(jnp.asarray(h), jnp.asarray(fn, jnp.float32), jnp.asarray(scale, jnp.float32),
                           jnp.asarray(base, jnp.float32), CFG))
    xf = h.reshape(2, 3, 128).astype(np.float64)
    mix = xf @ fn.T / np.sqrt((xf * xf).mean(-1, keepdims=True) + CFG.norm_eps)
    w = 1 / (1 + np.exp(-(mix * scale[0] + base))) + CFG.hc_eps
    np.testing.assert_allclose(y, (w[..., None] * h).sum(2), atol=1e-5)
