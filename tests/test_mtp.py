"""V4's MTP block (model.md §7) on the tiny V4 model: the fixture's backbone weights (HF exports no
MTP) plus a random MTP block in the official layout (``mtp.0.*``). No external reference exists for
MTP (transformers leaves it out), so these tests pin its composition by hand and its cache."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.cache import init_cache, init_mtp_cache
from dsv41_jax.checkpoint import load_checkpoint, read_official
from dsv41_jax.mtp import mtp_forward_jit, mtp_input
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params, official_shapes
from dsv41_jax.transformer import forward_step_jit, hc_head
from tiny_short import cut_params, cut_v4_layers

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v4_tiny_a")
F32 = RunOptions(dtype="float32", kv_cache_dtype="float32", hadamard=False)
CAP = 64


def v4_with_mtp(n_layers: int | None = None):
    """(cfg, params): the v4_tiny_a fixture's backbone plus one random MTP block (mtp.0.*).
    ``n_layers``: keep only the backbone's first layers (the fixture's ratios are 0, 4, 8, 4, 8: at 3
    a sliding, a CSA layer with its own indexer and an HCA layer, every V4 layer kind once)."""
    cfg0, params = load_checkpoint(FIX)
    params = dict(params)
    if n_layers is not None:
        cfg0, params = cut_v4_layers(cfg0, n_layers), cut_params(params, n_layers)
    cfg = cfg0.replace(n_mtp_layers=1, compress_ratios=cfg0.compress_ratios + (0,))
    params["mtp"] = init_params(cfg, seed=5)["mtp"]
    return cfg, params


@pytest.fixture(scope="module")
def model():
    return v4_with_mtp()


@pytest.fixture(scope="module")
def ids():
    fx = read_official(os.path.join(FIX, "fixture.safetensors"))
    return np.asarray(fx["input_ids"])[:, :41]


@pytest.fixture(scope="module")
def main_run(model, ids):
    cfg, params = model
    B, S = ids.shape
    logits, _, aux = forward_step_jit(params, init_cache(cfg, B, CAP, F32), jnp.asarray(ids, jnp.int32),
                                      jnp.full((B,), S, jnp.int32), cfg=cfg, opts=F32, return_aux=True)
    return np.asarray(logits), aux


def test_mtp_layout_official_names(model):
    cfg, _ = model
    names = official_shapes(cfg)
    mtp = {n for n in names if n.startswith("mtp.")}
    for n in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
              "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale",
              "mtp.0.attn.wq_a.weight", "mtp.0.attn.attn_sink", "mtp.0.ffn.gate.bias", "mtp.0.hc_attn_fn",
              "mtp.0.ffn.experts.7.w2.weight", "mtp.0.ffn.shared_experts.w1.weight"):
        assert n in mtp, n
    assert not any(".compressor." in n or ".indexer." in n or "tid2eid" in n for n in mtp)  # ratio 0, not hashed
    assert names["mtp.0.e_proj.weight"].shape == (cfg.dim, cfg.dim)
    assert names["mtp.0.hc_head_fn"].shape == (cfg.hc_mult, cfg.hc_mult * cfg.dim)


def test_hidden_is_the_pre_hc_head_stream(model, main_run):
    """aux["hidden"] = the last layer's output streams, and head(norm(hc_head(hidden))) = the logits."""
    cfg, params = model
    logits, aux = main_run
    h = aux["hidden"]
    assert h.shape == (2, 41, cfg.hc_mult, cfg.dim)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(aux["resid"][-1]))
    y = hc_head(h, params["hc_head_fn"], params["hc_head_scale"], params["hc_head_base"], cfg)
    y = np.asarray(y, np.float64)
    y = y / np.sqrt((y * y).mean(-1, keepdims=True) + cfg.norm_eps) * np.asarray(params["norm"]["weight"], np.float64)
    ref = y @ np.asarray(params["head"]["weight"], np.float64).T
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)


def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def test_input_composition_by_hand(model, main_run, ids):
    """X = e_proj(enorm(embed[next])) broadcast over the 4 streams + h_proj(hnorm(h)) per stream."""
    cfg, params = model
    _, aux = main_run
    p = params["mtp"]["0"]
    h = np.asarray(aux["hidden"][:, :-1], np.float64)
    nxt = ids[:, 1:]
    got = np.asarray(mtp_input(p, params["embed"]["weight"], aux["hidden"][:, :-1], jnp.asarray(nxt), cfg,
                               jnp.float32))
    e = _rms(np.asarray(params["embed"]["weight"], np.float64)[nxt], p["enorm"]["weight"], cfg.norm_eps)
    e = e @ np.asarray(p["e_proj"]["weight"], np.float64).T
    hh = _rms(h, p["hnorm"]["weight"], cfg.norm_eps) @ np.asarray(p["h_proj"]["weight"], np.float64).T
    ref = e[:, :, None, :] + hh
    assert got.shape == (2, 40, cfg.hc_mult, cfg.dim)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    # the 4 streams differ only through h_proj(hnorm(h_i)): the token part is shared
    np.testing.assert_allclose(got[:, :, 1] - got[:, :, 0], hh[:, :, 1] - hh[:, :, 0], atol=2e-5)


def _mtp_full(cfg, params, hidden, nxt):
    B, S = nxt.shape
    return mtp_forward_jit(params, init_mtp_cache(cfg, B, CAP, F32), hidden, jnp.asarray(nxt, jnp.int32),
                           jnp.full((B,), S, jnp.int32), cfg=cfg, opts=F32, return_aux=True)


def test_forward_shapes_and_dependence(model, main_run, ids):
    """Logits [B,S,V] and a cache at pos S; the output depends on both the streams and the next tokens,
    causally (position t sees only hidden/tokens at positions <= t)."""
    cfg, params = model
    _, aux = main_run
    hid, nxt = aux["hidden"][:, :-1], ids[:, 1:]
    lg, cache, maux = _mtp_full(cfg, params, hid, nxt)
    lg = np.asarray(lg)
    assert lg.shape == (2, 40, cfg.vocab_size) and np.isfinite(lg).all()
    assert list(np.asarray(cache["pos"])) == [40, 40]
    assert set(cache["layers"]) == {str(cfg.n_layers)} and cache["layers"]["5"]["window"].shape == (2, 16, 64)
    assert maux["output"].shape == (2, 40, cfg.hc_mult, cfg.dim)
    nxt2 = nxt.copy()
    nxt2[:, 30] = (nxt2[:, 30] + 1) % cfg.vocab_size
    lg2 = np.asarray(_mtp_full(cfg, params, hid, nxt2)[0])
    np.testing.assert_array_equal(lg2[:, :30], lg[:, :30])  # causal
    assert np.abs(lg2[:, 30] - lg[:, 30]).max() > 1e-3
    # hnorm makes each stream scale-free: scaling h_t changes nothing (up to rounding) ...
    lg3 = np.asarray(_mtp_full(cfg, params, hid.at[:, 20].multiply(1.5), nxt)[0])
    np.testing.assert_allclose(lg3, lg, atol=1e-5, rtol=0)
    # ... but changing its direction does, from position 20 on only
    noise = jax.random.normal(jax.random.PRNGKey(0), hid[:, 20].shape) * jnp.std(hid[:, 20])
    lg4 = np.asarray(_mtp_full(cfg, params, hid.at[:, 20].add(noise), nxt)[0])
    np.testing.assert_array_equal(lg4[:, :20], lg[:, :20])
    assert np.abs(lg4[:, 20] - lg[:, 20]).max() > 1e-3


def test_cached_chunks_match_full(model, main_run, ids):
    """Chunked MTP steps (its own window cache, irregular chunks, then single tokens) = one pass."""
    cfg, params = model
    _, aux = main_run
    hid, nxt = aux["hidden"][:, :-1], ids[:, 1:]
    full = np.asarray(_mtp_full(cfg, params, hid, nxt)[0])
    cache = init_mtp_cache(cfg, 2, CAP, F32)
    pos = [0, 0]
    for lens in [(5, 8), (8, 3), (8, 8), (1, 8), (8, 2), (3, 1), (1, 1), (1, 1)]:
        h = np.zeros((2, 8, cfg.hc_mult, cfg.dim), np.float32)
        t = np.zeros((2, 8), np.int32)
        for b in range(2):
            h[b, :lens[b]] = np.asarray(hid[b, pos[b]:pos[b] + lens[b]])
            t[b, :lens[b]] = nxt[b, pos[b]:pos[b] + lens[b]]
        # jitted: every chunk is [2, 8], one program (op by op, the 8 chunks took 6 s)
        lg, cache = mtp_forward_jit(params, cache, jnp.asarray(h), jnp.asarray(t), jnp.asarray(lens), cfg=cfg,
                                    opts=F32, logits_mode="last")
        for b in range(2):
            pos[b] += lens[b]
            np.testing.assert_allclose(np.asarray(lg[b]), full[b, pos[b] - 1], atol=1e-4, rtol=0)
    assert pos == [35, 32]


def test_v41_has_no_mtp():
    from dsv41_jax.config import get_preset

    cfg = get_preset("tiny")
    assert not cfg.has_mtp
    with pytest.raises(ValueError):
        init_mtp_cache(cfg, 1, 16, F32)
