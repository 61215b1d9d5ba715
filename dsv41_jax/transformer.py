"""The V4.1-Flash backbone as pure functions (``shared/spec/model.md`` §3.2, §4).

``forward_step(params, cache, tokens, lengths, engram_rows, cfg=, opts=)`` runs a chunk of tokens
for every sequence of a batch from that sequence's cache position: prefill (from 0 or any later
position, any chunk size), decode (S = 1) and multi-token verification are all this one function.

Delayed ("single-pass") mHC: each sub-layer computes its (pre, post, comb) from the stream it sees,
but collapses with the ``pre`` of the sub-layer before it (layer 0's attention: one-hot stream 0);
the final collapse uses the last FFN's ``pre``; there is no ``hc_head``.

V4 (``cfg.is_v4``, ``model.md`` §3.1): each site collapses with the ``pre`` it computed from its own
input stream, and the final streams are reduced by ``hc_head`` (sigmoid weights) before the norm.
The token ids reach the MoE (hash routing in the first ``n_hash_layers`` layers).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels.mhc import hc_collapse, hc_expand, hc_expand_collapse, hc_expand_collapse_mixes, hc_mixes

from .attention import attention
from .config import ModelConfig
from .engram import engram, gather_rows
from .layers import norm
from .moe import moe
from .options import RunOptions
from .quant import bf16_round

_HI = jax.lax.Precision.HIGHEST
# V4.1: each mHC expansion fused with the next site's collapse and mixes (hc_expand_collapse_mixes /
# hc_expand_collapse; fewer kernels per site on a GPU). DSV41_MHC_FUSED_COLLAPSE=off restores the
# separate ops (A/B measurements).
FUSE_EXPAND_COLLAPSE = os.environ.get("DSV41_MHC_FUSED_COLLAPSE", "on").lower() != "off"
# ... and, where the mixes are fused too, the next site's input RMSNorm (attn_norm / ffn_norm) done
# inside those kernels (hc_expand_collapse_mixes(y_norm=...): two XLA kernels fewer per site on a
# GPU). On by default since session 20: 7-layer batch-1 probe on the H200, 1.990 -> 1.969 ms of
# device time per step (-2 kernels per layer); DSV41_MHC_FUSED_NORM=off restores the separate norm.
FUSE_NEXT_NORM = os.environ.get("DSV41_MHC_FUSED_NORM", "on").lower() != "off"
# ... and the sums that end the layer output before the fused expansion -- wo_b's split-K parts, the
# MoE's slot rows + the shared expert's w2 parts -- done inside the expansion kernel
# (pallas_kernels.deferred_sum; one XLA kernel fewer per site on a GPU). DSV41_DEFER_SUMS: "on" (both
# sites; the default), "attn" (wo_b's only), "off" (XLA sums both). H200, session 27: wo_b's sum
# (1.23 us) left the step with the attention-side kernel unchanged (-0.051 ms per 40-layer step);
# on the FFN side the expansion kernel first grew from 5.26 to 6.73 us, as much as the XLA kernel it
# replaced (1.49 us), until its loads were all issued first (mhc EXPAND_MIX): then 3.82 us on both
# sides (7-layer probe 1.820 ms per step "off" -> 1.785 with both sums and that kernel).
DEFER_SUMS = os.environ.get("DSV41_DEFER_SUMS", "on").lower()
if DEFER_SUMS not in ("on", "attn", "off"):
    raise ValueError(f"DSV41_DEFER_SUMS={DEFER_SUMS!r}: expected on, attn or off")


def _mixes(p, site, h, cfg):
    return hc_mixes(h, p[f"hc_{site}_fn"], p[f"hc_{site}_scale"], p[f"hc_{site}_base"], norm_eps=cfg.norm_eps,
                    hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)


def _next_norm(node, cfg):
    """``y_norm`` for hc_expand_collapse_mixes: the next site's RMSNorm, when it is fused (FUSE_NEXT_NORM)."""
    return (node["weight"], cfg.norm_eps) if FUSE_NEXT_NORM else None


def hc_head(h, fn, scale, base, cfg):
    """V4's final reduction (``model.md`` §4.4): w = sigmoid(mix * scale + base) + hc_eps, y = sum_i w_i h_i."""
    B, S, hc, D = h.shape
    xf = h.astype(jnp.float32).reshape(B, S, hc * D)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.norm_eps)
    mix = jnp.einsum("bsk,jk->bsj", xf, fn.astype(jnp.float32), precision=_HI) * r
    w = jax.nn.sigmoid(mix * scale.astype(jnp.float32) + base.astype(jnp.float32)) + cfg.hc_eps
    return jnp.sum(w[..., None] * h.astype(jnp.float32), axis=2).astype(h.dtype)


def block(p, h, pre, l, cfg, opts, cache_layers, pos0, lengths, shared, aux=None, tokens=None, *,
          entry=None, collapse_next: bool = False, next_p=None):
    """One layer. h [B,S,hc,D]; pre [B,S,hc] (the previous site's; unused in V4). Returns (h, ffn_pre,
    cache_layers, shared, entry of the next layer or None).

    V4.1 collapses a site's input with the *previous* site's ``pre``, known before the expansion
    that produces the input runs, so an expansion, the next collapse and the next site's mix
    coefficients are one op (:func:`hc_expand_collapse_mixes`; on a GPU at decode sizes two kernels
    instead of four, else :func:`hc_expand_collapse` + :func:`hc_mixes`): always for the FFN site,
    and for the next layer's attention site when ``collapse_next`` (its mixes too when its params
    ``next_p`` are given). Then the fifth element is ``(collapsed input, mixes or None, normed)``
    (``normed``: the input already went through the next site's RMSNorm inside the fused op,
    :data:`FUSE_NEXT_NORM`); it comes back as ``entry`` of the next layer. V4 collapses with the
    site's own ``pre`` and keeps the separate ops."""
    fuse = not cfg.is_v4 and FUSE_EXPAND_COLLAPSE
    mix_kw = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    x_in, mixes, normed = entry if entry is not None else (None, None, False)
    residual = h
    with jax.named_scope("attn_mhc"):
        attn_pre, attn_post, attn_comb = mixes if mixes is not None else _mixes(p, "attn", h, cfg)
        x = x_in if x_in is not None else hc_collapse(h, attn_pre if cfg.is_v4 else pre)
        x = x if normed else norm(x, p["attn_norm"], cfg.norm_eps)
        if aux is not None and cfg.is_v4:  # V4 collapses with the site's own pre (speculative rollback reads it)
            aux.setdefault("attn_pre", {})[l] = attn_pre
    with jax.named_scope("attention"):
        # fused: wo_b's split-K sum is left to the expansion kernel (deferred_sum)
        x, cache_layers, shared = attention(p["attn"], x, l, cfg, opts, cache_layers, pos0, lengths, shared,
                                            defer=fuse and DEFER_SUMS != "off")
    with jax.named_scope("attn_mhc"):
        ffn_norm = _next_norm(p["ffn_norm"], cfg) if fuse else None  # not None: the fused op applies it
        if fuse:
            h, x_ffn, ffn_mixes = hc_expand_collapse_mixes(x, residual, attn_post, attn_comb, attn_pre, p["hc_ffn_fn"],
                                                           p["hc_ffn_scale"], p["hc_ffn_base"], y_norm=ffn_norm,
                                                           **mix_kw)
        else:
            h = hc_expand(x, residual, attn_post, attn_comb)
    residual = h
    with jax.named_scope("ffn_mhc"):
        if fuse:
            ffn_pre, ffn_post, ffn_comb = ffn_mixes
        else:
            ffn_pre, ffn_post, ffn_comb = _mixes(p, "ffn", h, cfg)
            x_ffn = hc_collapse(h, ffn_pre if cfg.is_v4 else attn_pre)
        x = x_ffn if ffn_norm is not None else norm(x_ffn, p["ffn_norm"], cfg.norm_eps)
    # the FFN expansion fused with the next layer's collapse and mixes; then the MoE's output sums
    # (slots, shared expert) are left to that kernel (deferred_sum)
    fuse_next = fuse and collapse_next and next_p is not None
    defer = fuse_next and DEFER_SUMS == "on"
    with jax.named_scope("moe"):
        if aux is not None:
            x, routing = moe(p["ffn"], x, l, cfg, return_routing=True, tokens=tokens, defer=defer)
            aux.setdefault("routing", {})[l] = routing
            aux.setdefault("comb", {})[l] = (attn_comb, ffn_comb)
        else:
            x = moe(p["ffn"], x, l, cfg, tokens=tokens, defer=defer)
    with jax.named_scope("ffn_mhc"):
        if fuse_next:
            attn_norm = _next_norm(next_p["attn_norm"], cfg)
            h, x_next, next_mixes = hc_expand_collapse_mixes(x, residual, ffn_post, ffn_comb, ffn_pre, next_p["hc_attn_fn"],
                                                             next_p["hc_attn_scale"], next_p["hc_attn_base"],
                                                             y_norm=attn_norm, **mix_kw)
            return h, ffn_pre, cache_layers, shared, (x_next, next_mixes, attn_norm is not None)
        if fuse and collapse_next:
            h, x_next = hc_expand_collapse(x, residual, ffn_post, ffn_comb, ffn_pre)
            return h, ffn_pre, cache_layers, shared, (x_next, None, False)
        h = hc_expand(x, residual, ffn_post, ffn_comb)
    return h, ffn_pre, cache_layers, shared, None


def last_rows(x, lengths):
    """x [B, S, ...] -> [B, ...]: each row's last real position ``lengths[b] - 1`` (clipped into
    0..S-1, so a row with no real position gives position 0)."""
    last = jnp.clip(lengths.astype(jnp.int32) - 1, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def lm_logits(y, norm_p, head_p, lengths, cfg: ModelConfig, logits_mode: str):
    """Final norm and fp32 LM head on the collapsed stream y [B,S,D]: every position ("all") or
    each row's last real token ("last", [B,V])."""
    if logits_mode == "last":
        y = last_rows(y, lengths)
    y = norm(y, norm_p, cfg.norm_eps)
    return head_matmul(y, head_p["weight"])


def head_matmul(y, w):
    """fp32 logits ``y @ w.T`` as the reference's fp32 head, without an fp32 copy of a bf16 ``w``
    (1.3 GB for V4.1: converting it would write 2.6 GB and read it back at every step): a bf16 y
    is one bf16 x bf16 dot with fp32 accumulation (every product is exact in fp32); an fp32 y is
    split into three bf16 parts (hi + mid + lo == y exactly, 24 mantissa bits) dotted in one
    pass over ``w``. Equal to the fp32 dot up to the fp32 summation order."""
    if w.dtype != jnp.bfloat16:
        return jnp.einsum("...d,vd->...v", y.astype(jnp.float32), w.astype(jnp.float32), precision=_HI)
    if y.dtype == jnp.bfloat16:
        return jnp.einsum("...d,vd->...v", y, w, preferred_element_type=jnp.float32)
    # bf16_round, not a bf16 round trip: XLA's GPU compiler folds convert(convert(y, bf16), f32) to y
    # inside a fusion, which made r = 0 and the head a bf16 one (found in session 17)
    yf = y.astype(jnp.float32)
    hi = bf16_round(yf)
    r = yf - hi
    mid = bf16_round(r)
    lo = r - mid
    parts = jnp.einsum("p...d,vd->p...v", jnp.stack([hi, mid, lo]).astype(jnp.bfloat16), w,
                       preferred_element_type=jnp.float32)
    return parts[0] + (parts[1] + parts[2])


def forward_step(params, cache, tokens, lengths, engram_ids=None, engram_rows=None, *, cfg: ModelConfig,
                 opts: RunOptions, logits_mode: str = "all", return_aux: bool = False):
    """Run ``tokens`` [B,S] (the first ``lengths[b]`` of row b are real) from ``cache["pos"]``.

    Engram rows come either from ``engram_ids`` {str(layer): int32 [B,S,n_cols]} gathered here from
    the device tables in ``params``, or pre-gathered in ``engram_rows`` {str(layer): Fp8Tensor}.
    ``logits_mode``: "all" -> [B,S,V]; "last" -> [B,V] at each row's last real token.
    Returns (logits f32, new cache[, aux]).
    """
    dtype = opts.compute_dtype
    B, S = tokens.shape
    pos0 = cache["pos"]
    lengths = lengths.astype(jnp.int32)
    with jax.named_scope("embed"):
        e = jnp.take(params["embed"]["weight"], tokens, axis=0).astype(dtype)
    h = jnp.broadcast_to(e[:, :, None, :], (B, S, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, S, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    cache_layers = dict(cache["layers"])
    shared: dict = {}
    aux: dict | None = {"features": [], "engram_gate": {}} if return_aux else None
    entry = None  # (attention-input collapse, its mixes or None, normed) when the previous layer fused them
    for l in range(cfg.n_layers):
        p = params["layers"][str(l)]
        if l in cfg.engram_layer_ids:
            with jax.named_scope("engram"):
                if engram_rows is not None:
                    rows = engram_rows[str(l)]
                else:
                    rows = gather_rows(p["engram"]["embed"], engram_ids[str(l)])
                if aux is not None:
                    h, gate = engram(p["engram"], h, rows, cfg, return_gate=True)
                    aux["engram_gate"][l] = gate
                else:
                    h = engram(p["engram"], h, rows, cfg)
            entry = None
        if aux is not None:
            if l in cfg.dspark_target_layer_ids:
                aux["features"].append(jnp.mean(h, axis=2))
            aux.setdefault("pre", {})[l] = pre
        # the next collapse fused into this layer's last expansion unless Engram changes h in between
        nxt = l + 1 not in cfg.engram_layer_ids
        next_p = params["layers"][str(l + 1)] if l + 1 < cfg.n_layers else None
        h, pre, cache_layers, shared, entry = block(p, h, pre, l, cfg, opts, cache_layers, pos0, lengths, shared,
                                                    aux, tokens=tokens, entry=entry, collapse_next=nxt, next_p=next_p)
        if aux is not None:
            aux.setdefault("resid", []).append(h)
            aux.setdefault("pre_out", []).append(pre)
    if aux is not None and cfg.is_v4:
        aux["hidden"] = h  # the final streams (V4: before hc_head; what the MTP block consumes)
    with jax.named_scope("head"):
        if cfg.has_hc_head:
            y = hc_head(h, params["hc_head_fn"], params["hc_head_scale"], params["hc_head_base"], cfg)
        else:
            y = entry[0] if entry is not None else hc_collapse(h, pre)
        logits = lm_logits(y, params["norm"], params["head"], lengths, cfg, logits_mode)
    new_cache = {"pos": pos0 + lengths, "layers": cache_layers}
    if return_aux:
        aux["shared"] = shared
        return logits, new_cache, aux
    return logits, new_cache


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "logits_mode", "return_aux"), donate_argnames=("cache",))
def forward_step_jit(params, cache, tokens, lengths, engram_ids=None, engram_rows=None, *, cfg, opts,
                     logits_mode="all", return_aux=False):
    return forward_step(params, cache, tokens, lengths, engram_ids, engram_rows, cfg=cfg, opts=opts,
                        logits_mode=logits_mode, return_aux=return_aux)
