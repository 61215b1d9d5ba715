"""Pallas-Triton lightning-indexer scores for prefill chunks: one tensor-core tile kernel.

``score[b,s,j] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,j])`` for a whole prefill chunk (S query rows)
against the key cache, ``-inf`` where ``j >= visible[b,s]``; the caller applies the candidate-block
mask and takes the top-k (``reference.topk_by_groups``: the reference's positions, ties included).

Why a kernel: the XLA reference scores one head (or a few) at a time, and at prefill sizes each head
writes and re-reads an [S, Nc] f32 intermediate (a 4096-row chunk against the 65,536 entries of a
ratio-1 layer at a 64K prompt: 1 GiB per head, 32 heads per layer). Here every program holds one
[block_s, block_n] tile of the result in registers and loops over the heads: per head one
[block_s, D] x [D, block_n] tensor-core dot, the ReLU and the weight, accumulated in fp32; the
[S, Nc] matrix is written once. Tiles wholly past the causal limit of their rows skip the dots
(on average half of a long prompt's tiles).

Operands are dequantized outside the kernel (MXFP4 q and k are bf16 numbers exactly, so the dots
are bf16 x bf16 with fp32 accumulation: the reference's products, summed in another order); float32
operands that are not exact in bf16 run the dots in IEEE fp32 (``Precision.HIGHEST``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp4Tensor, dequantize, exact_in_bf16
from dsv41_jax.quant.codecs import as_uint8

from .reference import topk_by_groups  # noqa: F401  (re-exported: the prefill path's top-k)

from pallas_kernels.scaled_dot import mx_default, mx_dot
from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)

__all__ = ["PREFILL_DEFAULTS", "index_scores", "topk_by_groups", "unsupported_reason"]

_NEG_INF = float("-inf")

# Measured on the H200 (BENCHMARKS.md, issue 5, session 11): 64 x 128 tiles with 4 warps beat 128 x 128
# / 8 warps, 64 x 64, 128 x 64 and 32 x 128 by 1.2-1.8x; 3 stages ~2 % over 2. num_stages None =
# Pallas's platform default (3 on CUDA, 1 on ROCm).
# mx: MXFP4 q and keys as stored into one MX dot a head (pallas_kernels.scaled_dot.mx_dot; None = where
# MX dots are the default, scaled_dot.mx_default: gfx950), else dequantized to bf16 by XLA first.
PREFILL_DEFAULTS = dict(block_s=64, block_n=128, num_warps=4, num_stages=None, mx=None)


def unsupported_reason(q_shape, k_shape, cfg) -> str | None:
    b, s, hi, di = q_shape
    if k_shape[0] != b or k_shape[2] != di:
        return f"keys {tuple(k_shape)} do not match q {tuple(q_shape)} (expected [B={b}, Nc, DI={di}])"
    if di % 16 or di < 16 or di & (di - 1):
        return f"index head dim {di} is not a power of two >= 16 (tensor-core dot K)"
    if hi & (hi - 1):
        return f"{hi} index heads: not a power of two (Triton block widths)"
    for name in ("block_s", "block_n"):
        v = cfg[name]
        if v < 16 or v & (v - 1):
            return f"{name}={v} is not a power of two >= 16"
    return None


def _kernel(*refs, hi, di, nc, block_n, prec, mx):
    if mx:  # MXFP4 codes [.., di/2] and e8m0 scale bytes [.., di/32] of q (per head) and of the keys
        q_ref, qs_ref, w_ref, vis_ref, k_ref, ks_ref, o_ref = refs
    else:
        q_ref, w_ref, vis_ref, k_ref, o_ref = refs
    j = pl.program_id(2)
    vis = vis_ref[...]  # [block_s]
    start = j * block_n
    active = jnp.max(vis) > start  # some row of the tile sees its first key: the dots are needed

    @pl.when(active)
    def _():
        k = k_ref[...]  # [block_n, di] (mx: [block_n, di/2] codes)
        ks = ks_ref[...] if mx else None

        def head(h, acc):
            wh = w_ref[:, pl.ds(h, 1)]  # [block_s, 1]
            if mx:
                l = mx_dot(q_ref[:, pl.ds(h * (di // 2), di // 2)], qs_ref[:, pl.ds(h * (di // 32), di // 32)], k, ks)
            else:
                qh = q_ref[:, pl.ds(h * di, di)]  # [block_s, di]
                l = jnp.dot(qh, k.T, preferred_element_type=jnp.float32, precision=prec)
            return acc + jnp.maximum(l, 0.0) * wh

        acc = jax.lax.fori_loop(0, hi, head, jnp.zeros(o_ref.shape, jnp.float32))
        pos = start + jnp.arange(block_n, dtype=jnp.int32)
        ok = (pos[None, :] < vis[:, None]) & (pos[None, :] < nc)
        o_ref[...] = jnp.where(ok, acc, _NEG_INF)

    @pl.when(jnp.logical_not(active))
    def _():
        o_ref[...] = jnp.full(o_ref.shape, _NEG_INF, jnp.float32)


def index_scores(q, weights, keys, visible, *, interpret=False, config=None):
    """q [B,S,HI,DI] (Fp4Tensor or float), weights [B,S,HI], keys [B,Nc,DI] (Fp4Tensor or float),
    visible [B,S] int32 -> causally masked scores [B,S,Nc] f32."""
    cfg = dict(PREFILL_DEFAULTS)
    cfg.update(config or {})
    b, s, hi, di = q.shape
    nc = keys.shape[1]
    reason = unsupported_reason(q.shape, keys.shape, cfg)
    if reason is not None:
        raise ValueError(f"lightning_indexer prefill scores (pallas): {reason}")
    mx = isinstance(q, Fp4Tensor) and isinstance(keys, Fp4Tensor) and di % 64 == 0 and (
        mx_default(interpret) if cfg["mx"] is None else bool(cfg["mx"]))
    w = weights.astype(jnp.float32)
    vis = visible.astype(jnp.int32)
    bs = min(cfg["block_s"], max(16, 1 << max(0, (s - 1).bit_length())))
    bn = cfg["block_n"]
    sp, np_ = -(-s // bs) * bs, -(-nc // bn) * bn

    def pad_rows(x, n, to, value=0):  # dim 1 of x padded from n to ``to`` rows
        return x if to == n else jnp.pad(x, ((0, 0), (0, to - n)) + ((0, 0),) * (x.ndim - 2), constant_values=value)

    if mx:  # codes and scales as stored (padded codes are 0, padded scales 2**0)
        qa = [pad_rows(as_uint8(q.data).reshape(b, s, hi * di // 2), s, sp),
              pad_rows(as_uint8(q.scale).reshape(b, s, hi * di // 32), s, sp, 127)]
        ka = [pad_rows(as_uint8(keys.data), nc, np_), pad_rows(as_uint8(keys.scale), nc, np_, 127)]
        prec = None
    else:
        low = exact_in_bf16(q) and exact_in_bf16(keys)
        cdt = jnp.bfloat16 if low else jnp.float32
        prec = None if low else jax.lax.Precision.HIGHEST
        qa = [pad_rows((dequantize(q, cdt) if isinstance(q, Fp4Tensor) else q.astype(cdt)).reshape(b, s, hi * di), s, sp)]
        ka = [pad_rows(dequantize(keys, cdt) if isinstance(keys, Fp4Tensor) else keys.astype(cdt), nc, np_)]
    # padded rows see nothing (visible 0): all -inf, sliced off below
    w, vis = pad_rows(w, s, sp), pad_rows(vis, s, sp)
    kernel = functools.partial(_kernel, hi=hi, di=di, nc=nc, block_n=bn, prec=prec, mx=mx)
    q_specs = [pl.BlockSpec((None, bs, a.shape[-1]), lambda i, r, j: (i, r, 0)) for a in qa]
    k_specs = [pl.BlockSpec((None, bn, a.shape[-1]), lambda i, r, j: (i, j, 0)) for a in ka]
    out = pl.pallas_call(
        kernel,
        grid=(b, sp // bs, np_ // bn),
        in_specs=[
            *q_specs,
            pl.BlockSpec((None, bs, hi), lambda i, r, j: (i, r, 0)),
            pl.BlockSpec((None, bs), lambda i, r, j: (i, r)),
            *k_specs,
        ],
        out_specs=pl.BlockSpec((None, bs, bn), lambda i, r, j: (i, r, j)),
        out_shape=jax.ShapeDtypeStruct((b, sp, np_), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="indexer_prefill_scores_mx" if mx else "indexer_prefill_scores",
    )(*qa, w, vis, *ka)
    return out[:, :s, :nc]


