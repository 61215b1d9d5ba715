"""DSpark draft model of V4.1-Flash (``shared/spec/model.md`` §8, ``attention.md`` §10).

Three extra blocks (``params["mtp"]["0".."2"]``, layer ids ``n_layers + k``: SWA-only attention
with RoPE base ``rope_theta`` and no YaRN, delayed mHC, their own MoE) draft a block of
``gamma = dspark_block_size`` tokens in one parallel pass, conditioned on the target's features.

Two pure functions, both jit-able and batched with per-sequence positions:

* :func:`dspark_update` – "the main model committed tokens at positions ``pos .. pos+len-1``":
  ``main_x = main_norm(main_proj(concat(features)))`` for those positions and, for every stage,
  ``store(RoPE(kv_norm(wkv(main_x))))`` written into that stage's sliding-window ring (slot
  ``position % W``). Prefill (any chunking) and decode (1 token, or the ``1 + accepted`` tokens of a
  verification step) are the same call. ``features`` is ``aux["features"]`` of
  :func:`dsv41_jax.transformer.forward_step` (mean over streams at the input of each
  ``dspark_target_layer_ids`` layer).
* :func:`dspark_draft` – with the rings holding main positions ``0 .. P-1`` (``P = dcache["pos"]``)
  and ``anchor`` the token at position ``P``: the block ``[anchor, noise x (gamma-1)]`` at positions
  ``P .. P+gamma-1`` runs through the stages. Each block query attends to the ring slots holding
  positions ``max(0, P-W) .. P-1`` plus all ``gamma`` block tokens (bidirectional, no causal mask).
  The last stage's pre collapses the streams (``y``), the shared ``head(norm(y))`` gives base logits,
  slot k adds the Markov bias ``W2 · W1[prev]`` of the previous token (the anchor for slot 0) and
  samples draft k+1 (predicting position ``P+1+k``) sequentially; the confidence logit of slot k is
  ``proj([y_k ; W1[prev_k]])`` (raw, before any sigmoid).

Relation to DeepSeek's ``forward_spec``: its decode call at ``start_pos = p`` is ``dspark_update``
with the one token at ``p`` followed by ``dspark_draft`` with ``P = p + 1``; its prefill call
(``start_pos = 0``) is ``dspark_update`` alone. We also allow drafting right after a prefill and after
multi-token commits (the generalisation a speculative loop needs; the math is unchanged).

Caches: ``init_dspark_cache`` – ``{"pos": [B] int32, "stages": {str(k): {"window": ring}}}``; the
ring is FP8 (e4m3 + e8m0 per 32, all dims) in ``reference`` KV mode like the backbone's, plain
otherwise. It lives next to (not inside) the backbone cache of :mod:`dsv41_jax.cache`;
:meth:`dsv41_jax.drafters.Drafter.reset_row` empties one row (continuous batching).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mhc import hc_collapse, hc_expand, hc_mixes
from pallas_kernels.sparse_attention import sparse_attention

from .attention import concat_rows, cache_store, update_ring
from .cache import fp8_rows
from .config import ModelConfig
from .layers import grouped_linear, linear, norm
from .moe import moe
from .options import RunOptions
from .quant import dequantize
from .rope import apply_rope, layer_frequencies, rope_angles
from .sampling import draft_pick

_HI = jax.lax.Precision.HIGHEST


def init_dspark_cache(cfg: ModelConfig, batch: int, opts: RunOptions) -> dict:
    """Empty DSpark stage rings (``window_size`` slots per stage) and ``pos`` = 0."""
    W, dh = cfg.window_size, cfg.head_dim
    stages = {}
    for k in range(cfg.n_mtp_layers):
        ring = fp8_rows((batch, W, dh)) if opts.quantized_kv else jnp.zeros((batch, W, dh), opts.kv_dtype)
        stages[str(k)] = {"window": ring}
    return {"pos": jnp.zeros((batch,), jnp.int32), "stages": stages}


def main_x(params, features, cfg: ModelConfig, dtype):
    """``main_norm(main_proj(concat(features)))`` -> [B,S,D]. ``features``: list of [B,S,D]."""
    p0 = params["mtp"]["0"]
    f = jnp.concatenate([a.astype(dtype) for a in features], axis=-1)
    x = linear(f, p0["main_proj"], act_block=cfg.fp8_block_size)
    return norm(x, p0["main_norm"], cfg.norm_eps)


def _stage_kv(pa, x, positions, layer: int, cfg: ModelConfig):
    kv = norm(linear(x, pa["wkv"], act_block=cfg.fp8_block_size), pa["kv_norm"], cfg.norm_eps)
    return apply_rope(kv, rope_angles(positions, layer_frequencies(cfg, layer)))


def dspark_update(params, dcache, features, lengths, *, cfg: ModelConfig, opts: RunOptions):
    """Insert the main positions ``dcache["pos"][b] + i`` (``i < lengths[b]``) into every stage's ring.
    ``features``: list of [B,S,D] (``aux["features"]``). Returns the new DSpark cache."""
    dtype = opts.compute_dtype
    pos0 = dcache["pos"]
    lengths = lengths.astype(jnp.int32)
    mx = main_x(params, features, cfg, dtype)
    S = mx.shape[1]
    positions = pos0[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    stages = {}
    for k in range(cfg.n_mtp_layers):
        layer = cfg.n_layers + k
        kv = cache_store(_stage_kv(params["mtp"][str(k)]["attn"], mx, positions, layer, cfg), "window", opts)
        ring = dcache["stages"][str(k)]["window"]
        stages[str(k)] = {"window": update_ring(ring, kv, pos0, lengths, cfg.window_size)}
    return {"pos": pos0 + lengths, "stages": stages}


def _mixes(p, site, h, cfg):
    return hc_mixes(h, p[f"hc_{site}_fn"], p[f"hc_{site}_scale"], p[f"hc_{site}_base"], norm_eps=cfg.norm_eps,
                    hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)


def stage_key_indices(P, window: int, block: int):
    """[B, window + block] indices into concat(ring [window], block rows [block]) of the keys every
    query of a stage's block sees, in the order of DeepSeek's ``get_dspark_topk_idxs``: the ring's
    filled slots 0 .. min(P, window) - 1 (slot order; P = the block's first position, so the ring
    holds positions < P), then the block's rows, then -1. The order decides bf16 bits where the
    sparse attention rounds by blocks of 64 keys (``--attention-rounding kernel_blocks``): the block's
    rows start right after the filled slots there, not at slot ``window`` (before session 38 they
    did, with -1 between, which put other keys in the 64-key blocks while P < window)."""
    n = jnp.minimum(P, window)[:, None]  # [B, 1] filled ring slots
    c = jnp.arange(window + block, dtype=jnp.int32)[None, :]
    return jnp.where(c < n, c, jnp.where(c < n + block, window + c - n, -1)).astype(jnp.int32)


def _stage_attention(pa, x, ring, P, layer: int, cfg: ModelConfig, opts: RunOptions):
    """Block queries [B,G,D] at positions P..P+G-1 over the ring (positions < P) + the block."""
    B, G, _ = x.shape
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    act = cfg.fp8_block_size
    positions = P[:, None] + jnp.arange(G, dtype=jnp.int32)[None, :]
    ang = rope_angles(positions, layer_frequencies(cfg, layer))
    qr = norm(linear(x, pa["wq_a"], act_block=act), pa["q_norm"], cfg.norm_eps)
    q = apply_rope(linear(qr, pa["wq_b"], act_block=act, path="attn.wq_b").reshape(B, G, H, Dh), ang)
    kv_blk = cache_store(_stage_kv(pa, x, positions, layer, cfg), "window", opts)
    kv = concat_rows(ring, kv_blk)
    idx = jnp.broadcast_to(stage_key_indices(P, W, G)[:, None, :], (B, G, W + G))
    o = sparse_attention(q, kv, idx, pa["attn_sink"], scale=Dh ** -0.5, running_max_block=opts.running_max_block)
    o = apply_rope(o, ang, inverse=True)
    Gr, Lo = cfg.o_groups, cfg.o_lora_rank
    o = grouped_linear(o.reshape(B, G, Gr, -1).astype(x.dtype), pa["wo_a"], groups=Gr)
    return linear(o.reshape(B, G, Gr * Lo), pa["wo_b"], act_block=act, path="attn.wo_b")


def _stage(p, h, pre, layer, ring, P, cfg, opts):
    residual = h
    attn_pre, attn_post, attn_comb = _mixes(p, "attn", h, cfg)
    x = norm(hc_collapse(h, pre), p["attn_norm"], cfg.norm_eps)
    x = _stage_attention(p["attn"], x, ring, P, layer, cfg, opts)
    h = hc_expand(x, residual, attn_post, attn_comb)
    residual = h
    ffn_pre, ffn_post, ffn_comb = _mixes(p, "ffn", h, cfg)
    x = norm(hc_collapse(h, attn_pre), p["ffn_norm"], cfg.norm_eps)
    x = moe(p["ffn"], x, layer, cfg)
    return hc_expand(x, residual, ffn_post, ffn_comb), ffn_pre


def draft_hidden(params, dcache, anchor, *, cfg: ModelConfig, opts: RunOptions):
    """The stages over the block ``[anchor, noise...]``: the collapsed hidden ``y`` [B,gamma,D]."""
    dtype = opts.compute_dtype
    G = cfg.dspark_block_size
    B = anchor.shape[0]
    ids = jnp.full((B, G), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(anchor.astype(jnp.int32))
    e = jnp.take(params["embed"]["weight"], ids, axis=0).astype(dtype)
    h = jnp.broadcast_to(e[:, :, None, :], (B, G, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, G, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    P = dcache["pos"]
    for k in range(cfg.n_mtp_layers):
        h, pre = _stage(params["mtp"][str(k)], h, pre, cfg.n_layers + k, dcache["stages"][str(k)]["window"], P,
                        cfg, opts)
    return hc_collapse(h, pre)


def _f32(a):
    return dequantize(a, jnp.float32)


def dspark_draft(params, dcache, anchor, keys=None, temperature=None, *, cfg: ModelConfig, opts: RunOptions):
    """Draft ``gamma`` tokens after ``anchor`` [B] (the token at position ``dcache["pos"]``).

    ``keys`` None: greedy (argmax); else uint32 [B, 2] raw keys and ``temperature`` (scalar or [B]):
    draft k is Gumbel-max sampled from ``softmax(logits_k / T)`` with key ``fold_in(keys[b], k)``.
    Returns ``(ids [B, gamma+1] int32 (column 0 = anchor), logits [B, gamma, V] f32 (Markov bias
    included, not temperature-scaled), confidence [B, gamma] f32 raw logits)``."""
    G = cfg.dspark_block_size
    pl = params["mtp"][str(cfg.n_mtp_layers - 1)]
    y = draft_hidden(params, dcache, anchor, cfg=cfg, opts=opts)
    head = _f32(params["head"]["weight"])
    base = jnp.einsum("bgd,vd->bgv", norm(y, pl["norm"], cfg.norm_eps).astype(jnp.float32), head, precision=_HI)
    w1 = pl["markov_head"]["embed"]["weight"]
    w2 = _f32(pl["markov_head"]["head"]["weight"])
    wc = _f32(pl["confidence_head"]["proj"]["weight"])  # [1, D + r]
    prev = anchor.astype(jnp.int32)
    out, logits, conf = [prev], [], []
    for k in range(G):
        me = jnp.take(w1, prev, axis=0)  # [B, r] (stored dtype, as the reference's embedding)
        lg = base[:, k] + jnp.einsum("br,vr->bv", me.astype(jnp.float32), w2, precision=_HI)
        hid = jnp.concatenate([y[:, k].astype(jnp.float32), me.astype(jnp.float32)], -1)
        conf.append(jnp.einsum("bi,oi->bo", hid, wc, precision=_HI)[:, 0])
        nxt = draft_pick(lg, keys, temperature, k)
        logits.append(lg)
        out.append(nxt)
        prev = nxt
    return jnp.stack(out, 1), jnp.stack(logits, 1), jnp.stack(conf, 1)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"), donate_argnames=("dcache",))
def dspark_update_jit(params, dcache, features, lengths, *, cfg, opts):
    return dspark_update(params, dcache, features, lengths, cfg=cfg, opts=opts)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def dspark_draft_jit(params, dcache, anchor, keys=None, temperature=None, *, cfg, opts):
    return dspark_draft(params, dcache, anchor, keys, temperature, cfg=cfg, opts=opts)
