"""Pallas-Triton lightning indexer: FP4 scores, masks, block maxima and a streaming exact top-k.

``score[b,s,j] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,j])`` (fp32; q, k MXFP4 decoded exactly in the
kernel), ``-inf`` where ``j >= visible[b,s]`` or where the candidate-block mask excludes j; the result
is the top-k positions in ascending order, -1 padded.

The [S, Nc] score matrix is never written to HBM. The pipeline (all rows R = B*S independent):

1. **Score kernel** (grid ``(B, S // rows_per_program, ceil(Nc / tile_n))``): streams the key cache
   once per block of query rows, decodes packed MXFP4 keys with integer ops in registers, computes
   the scores ``chunk`` keys at a time (two 2-D dots in the even/odd basis: the low nibbles are the
   even columns, the high nibbles the odd ones), applies the masks and writes only the **group
   maxima** over ``g0`` consecutive positions: ``g0 = block_size`` (these are exactly the
   ``block_scores`` of the hierarchical indexer) for decode-sized row counts, ``g0 = block_size²``
   for large row counts (prefill), i.e. 1/8 or 1/64 of the score matrix.
2. **Hierarchical exact selection.** If x is among the top-k scores, the maximum of its group is
   ≥ x, hence among the top-k group maxima (up to exact ties at the k-th value). So:
   top-k groups → the k·g0 candidate positions → top-k of those. Above the kernel's level, group
   maxima of groups (factor ``block_size``) are formed with a jnp max until a row fits one select
   program (≤ ``select_max`` entries), and the selection descends level by level; every step
   handles at most ``k · block_size`` candidates (4,096 at k = 512).
3. **Candidate score kernel** (grid ``(R, k·g0 / cand_tile)``): gathers the candidate keys by
   index vector and recomputes their exact scores (the same code as 1).
4. **Select kernel** (grid ``(R,)``): exact k-th largest value by a 32-step bisection on the
   order-preserving uint32 image of the f32 scores (compare + count over the row held in
   registers; no sort exists in the Triton lowering), then the selection mask (all > threshold,
   plus the earliest ties) is compacted with a prefix sum and scattered: the output comes out
   **sorted by position** for free, -1 padded.

Ties: exactly equal scores at the k-th value are broken toward lower positions within a candidate
list; a tie at a group level can drop such an exactly-tied element (only then can the result
differ from ``lax.top_k`` + sort, which the reference uses).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp4Tensor
from pallas_kernels.scaled_dot import mx_default, mx_dot

from dsv41_jax.quant.codecs import as_uint8, le_words
from pallas_kernels.quantized_matmul.pallas_triton_fma import (
    e8m0_f32,
    fp4_byte_decode_f32,
    fp4_word_pairs_f16,
    fp4_word_pairs_f32,
)

from .reference import IndexerResult
from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)

__all__ = ["lightning_indexer", "unsupported_reason", "index_block_maxima", "select_topk", "DEFAULTS"]

_NEG_INF = float("-inf")

DEFAULTS = dict(
    tile_n=1024,        # keys per score-kernel program
    chunk=128,          # keys per inner step (dot N dimension)
    rows_per_program=8,  # query rows sharing one pass over a key tile (prefill)
    cand_tile=256,      # candidates per candidate-score program
    select_max=16384,   # entries one select program holds
    # score and candidate kernels: 4 warps (one warpgroup for the keys-first wgmmas). H100, session 39
    # (BENCHMARKS.md, issue 5), whole decode pipeline against 8 warps: x0.82 / 0.93 at 64K entries x
    # batch 1 / 8, x1.09 / 0.74 at 256K, x0.82 (0.89 in a second call) / 0.76 at 1M
    score_warps=4,
    select_warps=8,
    select_early_exit=True,  # the select's bisection stops once exactly k values are at or above it
    num_stages=2,
    maxima_budget_bytes=64 << 20,  # store g0 = block_size maxima while R * Nc/bs * 4 <= this
    # MXFP4 q and keys both: "phases" (32-bit words, 8 phase dots in bf16), "f16phases" (the same
    # words, 8 phase dots in float16 with each row's largest block scale factored out) or "bytes"
    # (see _load_rows)
    fp4_read="phases",
    dot_order="keys",  # the score dots' first operand: "keys" ([N, HI] logits) or "q" ([HI, N]; see _scores)
    # decode rows over caches of at most select_max entries: "direct" (every entry's score from the
    # score kernel, one select over the row: 2 launches) or "pipeline" (block maxima, a select of
    # blocks, rescoring of their entries, a select of those: 5-6 launches). Session 46, H100: direct
    # 9.6 / 14.1 / 23.6 us against the pipeline's 24.4 / 23.8 / 24.3 at 1,280 / 5,121 / 16,384 x 1
    # (the reference 30.7 / 67.4 / 75.4); +1.3 % batch-1 decode in the model
    decode_path="direct",
)
FP4_READS = ("phases", "f16phases", "bytes", "mx")
DECODE_PATHS = ("pipeline", "direct")
# DSV41_INDEXER_DECODE=pipeline (read at import) makes "pipeline" the default decode path again, and
# 'auto' then keeps the XLA reference below DECODE_MIN_ENTRIES: for A/B runs of the model (bench)
DEFAULTS["decode_path"] = os.environ.get("DSV41_INDEXER_DECODE", DEFAULTS["decode_path"]).lower()
if DEFAULTS["decode_path"] not in DECODE_PATHS:
    raise ValueError(f"DSV41_INDEXER_DECODE={DEFAULTS['decode_path']!r}: expected one of {', '.join(DECODE_PATHS)}")
WORD_READS = ("phases", "f16phases")  # the routes that read the codes as 32-bit words
DOT_ORDERS = ("keys", "q")


def default_fp4_read(interpret: bool = False) -> str:
    """The MXFP4 read a call that names none takes: "mx" where MX dots are the default
    (:func:`pallas_kernels.scaled_dot.mx_default`: gfx950; BENCHMARKS.md issue 5, session 52, offline:
    the score loop 411 -> 156 instructions per work-item and step, 119 -> 71 VGPRs, 3 -> 5 waves per
    SIMD; on sm_90 Triton's own upcast makes it 856 -> 1,126), else ``DEFAULTS["fp4_read"]``; interpret
    mode: always the latter."""
    return "mx" if mx_default(interpret) else DEFAULTS["fp4_read"]


class MxRows(NamedTuple):
    """Rows of an MXFP4 store as :func:`pallas_kernels.scaled_dot.mx_dot` takes them (``fp4_read="mx"``):
    the packed codes [N, d2] uint8 and their e8m0 scales [N, d2/16] uint8."""

    data: jax.Array
    scale: jax.Array


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _logical_shape(x):
    return tuple(x.shape) if not isinstance(x, Fp4Tensor) else tuple(x.shape)


def unsupported_reason(q, weights, keys, visible, *, top_k, candidate_blocks=None, block_size=8) -> str | None:
    qs, ks = _logical_shape(q), _logical_shape(keys)
    if len(qs) != 4 or len(ks) != 3:
        return f"q must be [B,S,HI,DI] and keys [B,Nc,DI], got {qs} and {ks}"
    b, s, hi, di = qs
    if ks[0] != b or ks[2] != di:
        return f"keys shape {ks} does not match q {qs}"
    if not _is_pow2(hi) or hi < 16:
        return f"HI={hi} indexer heads must be a power of two >= 16 (dot M dimension)"
    if not _is_pow2(di) or di < 64:
        return f"DI={di} must be a power of two >= 64 (DI/2 is a dot K dimension)"
    for name, x in (("q", q), ("keys", keys)):
        if isinstance(x, Fp4Tensor):
            if x.block != 32 or x.scale.dtype == jnp.float8_e4m3fn:
                return f"{name} must be MXFP4 (block 32, e8m0 scales), got block {x.block}, scale {x.scale.dtype}"
            if x.packing != "nibbles":
                return f"{name} codes are packed as {x.packing!r}; the kernels decode the nibble layout"
        elif x.dtype not in (jnp.float32, jnp.bfloat16):
            return f"{name} dtype {x.dtype} is not f32, bf16 or MXFP4"
    if tuple(weights.shape) != (b, s, hi):
        return f"weights shape {tuple(weights.shape)} is not {(b, s, hi)}"
    if tuple(visible.shape) != (b, s):
        return f"visible shape {tuple(visible.shape)} is not {(b, s)}"
    if not _is_pow2(block_size) or not 2 <= block_size <= 64:
        return f"block_size={block_size} must be a power of two in [2, 64]"
    if top_k < 1:
        return f"top_k={top_k} must be >= 1"
    if _next_pow2(top_k) * block_size > DEFAULTS["select_max"]:
        return f"top_k={top_k} x block_size={block_size} candidates exceed one select program ({DEFAULTS['select_max']})"
    if candidate_blocks is not None:
        nb = -(-ks[1] // block_size)
        if tuple(candidate_blocks.shape) != (b, s, nb):
            return f"candidate_blocks shape {tuple(candidate_blocks.shape)} is not {(b, s, nb)}"
    return None


# ------------------------------------------------------------------------------------------------
# in-kernel helpers


def _grid2(rows, cols):
    shape = (rows.shape[0], cols.shape[0])
    return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)


def _load_rows(data_ref, scale_ref, rows, d2, fp4, cdt, read=None):
    """Rows ``rows`` ([N] int32, in range) of an MXFP4 ([N, d2] bytes + [N, d2/16] e8m0) or plain
    ([N, 2*d2]) store -> (tiles, row_scale): a list of tiles that :func:`_scores` pairs up with q's,
    and None or a float32 [N] factor of each row (below). MXFP4 by ``read``:

    * None or "bytes": (even columns, odd columns), each [N, d2] in ``cdt``. Each nibble goes to an
      e4m3 bit pattern that reads ``e2m1 * 2**-6`` and the hardware e4m3 conversion
      (``fp4_byte_decode_f32``, the fused MoE's "e4m3" route); the 2**6 rides on the scale's exponent
      (BENCHMARKS.md, issue 5, session 13: 3,697 -> 902 instructions per 128-key step of the score
      kernel).
    * "phases" (MXFP4 stored as 32-bit words [N, d2/4], 8 codes each, element 8w + j in nibble j):
      8 phase tiles [N, d2/4] in ``cdt``, phase j holding elements 8w + j. One shift-mask-or puts
      codes j and j + 4 of a word into the two float16 halves of a word (``fp4_word_pairs_f32``:
      e2m1 * 2**-14, exact), then f32 times the e8m0 scale (with the 2**14), then ``cdt`` (exact in
      bf16): the fused MoE's word decode, without joining the phases back (one dot per phase
      instead). Offline sm_90 SASS: see BENCHMARKS.md, issue 5, session 38.
    * "f16phases": the same 8 phase tiles, left in float16 (``fp4_word_pairs_f16``, no float32
      round trip) and multiplied there by ``2**(s - t + 14)``, where s is the block's scale
      exponent and t the row's largest one (at least 1): the tile holds ``e2m1 * 2**(s - t)`` and
      ``row_scale`` is ``2**(t - 127)``, which :func:`_scores` applies to the finished score (a
      power of two commutes with the relu and with every rounding after the dot). Exact wherever
      s >= t - 23 (a block at most 2**23 below the row's largest; below that its values round to
      f16 subnormals or 0, an error under 2**-24 of the row's largest element, smaller than the
      fp32 sum's own rounding of that element).
    * "mx": the codes and scales as stored (:class:`MxRows`), which :func:`_scores` hands to one
      ``tt.dot_scaled`` (:func:`pallas_kernels.scaled_dot.mx_dot`): gfx950's block-scaled MFMA
      (``v_mfma_scale_f32_32x32x64_f8f6f4``, offline) with no decode instruction of ours; on sm_90
      Triton's own upcast to bf16 and a bf16 dot.

    Every route's values are exact on the sm_90 / CDNA tensor cores (f16 and bf16 products of e2m1
    values in fp32): the dots differ only in fp32 summation order."""
    if fp4 and read == "mx":  # the codes and scales as stored: one MX dot (tt.dot_scaled) decodes them
        return [MxRows(data_ref[_grid2(rows, jnp.arange(d2, dtype=jnp.int32))],
                       scale_ref[_grid2(rows, jnp.arange(d2 // 16, dtype=jnp.int32))])], None
    if fp4 and read in WORD_READS:
        nw = d2 // 4
        w = data_ref[_grid2(rows, jnp.arange(nw, dtype=jnp.int32))]  # [N, d2/4] uint32, whole rows
        s = scale_ref[_grid2(rows, jnp.arange(d2 // 16, dtype=jnp.int32))]  # [N, d2/16] e8m0 bytes
        n, nb = s.shape
        if read == "f16phases":
            s = s.astype(jnp.int32)
            top = jnp.maximum(jnp.max(s, axis=1), 1)  # [N]
            # 2**(s - top + 14) in f16: exact, or 0 below 2**-24 (exponent field clamped at 0)
            sc = e8m0_f32(jnp.maximum(s - top[:, None] + 127, -14), 14).astype(jnp.float16)
            pairs, out, row_scale = fp4_word_pairs_f16(w), jnp.float16, e8m0_f32(top)
        else:
            sc, pairs, out, row_scale = e8m0_f32(s, 14), fp4_word_pairs_f32(w), cdt, None  # [N, d2/16]
        sc = jnp.broadcast_to(sc[:, :, None], (n, nb, 4)).reshape(n, nw)
        return [(lo * sc).astype(out) for lo, _ in pairs] + [(hi * sc).astype(out) for _, hi in pairs], row_scale
    half = jnp.arange(d2, dtype=jnp.int32)
    if fp4:
        b = data_ref[_grid2(rows, half)].astype(jnp.int32)  # whole rows: contiguous along the row
        lo, hi, shift = fp4_byte_decode_f32(b)
        sc = e8m0_f32(scale_ref[_grid2(rows, jnp.arange(d2 // 16, dtype=jnp.int32))], shift)  # [N, d2/16]
        sc = jnp.broadcast_to(sc[:, :, None], (sc.shape[0], d2 // 16, 16)).reshape(sc.shape[0], d2)
        return [(lo * sc).astype(cdt), (hi * sc).astype(cdt)], None
    return [data_ref[_grid2(rows, 2 * half)].astype(cdt), data_ref[_grid2(rows, 2 * half + 1)].astype(cdt)], None


def _scores(q_tiles, k_tiles, w, keys_first=True, k_scale=None):
    """sum_h w_h relu(q_h . k_j) for matching lists of [HI, c] and [N, c] tiles -> [N] f32, times
    ``k_scale`` [N] where the key tiles carry a row factor (:func:`_load_rows`; q's is in ``w``). With
    ``keys_first`` (``dot_order="keys"``, the default) the keys are the dots' first operand ([N, HI]
    logits): on sm_90 the N = 128-key chunk makes each dot a Hopper wgmma with the decoded keys taken
    from registers (offline SASS: 640 -> 482 instructions per score step and 83 -> 80 registers, 3
    programs per SM instead of 2, against q first, whose [HI, N] dots are mma.sync HMMAs; session 38,
    not timed: the register-operand wgmma of the fused MoE's prefill was slower, session 12)."""
    prec = jax.lax.Precision.HIGHEST if getattr(q_tiles[0], "dtype", None) == jnp.float32 else None
    l = None
    for qt, kt in zip(q_tiles, k_tiles, strict=True):
        a, b = (kt, qt) if keys_first else (qt, kt)
        if isinstance(a, MxRows):
            d = mx_dot(a.data, a.scale, b.data, b.scale)
        else:
            d = jnp.dot(a, b.T, preferred_element_type=jnp.float32, precision=prec)
        l = d if l is None else l + d
    if keys_first:
        out = jnp.sum(jnp.maximum(l, 0.0) * w[None, :], axis=1)
    else:
        out = jnp.sum(jnp.maximum(l, 0.0) * w[:, None], axis=0)
    return out if k_scale is None else out * k_scale


def _row_inputs(qd_ref, qs_ref, w, heads, d2, q_fp4, cdt, read):
    """One query row's decoded q tiles and its head weights, q's row factor (if any) folded into them:
    relu(c x) = c relu(x) for c > 0, a power of two."""
    q_t, q_scale = _load_rows(qd_ref, qs_ref, heads, d2, q_fp4, cdt, read)
    return q_t, (w if q_scale is None else w * q_scale)


# ------------------------------------------------------------------------------------------------
# 1. score kernel -> group maxima


def _score_kernel(*refs, q_fp4, k_fp4, has_cb, hi, d2, nc, s_rows, tile_n, chunk, g0, bs, cdt, read, keys_first):
    it = iter(refs)
    qd_ref = next(it)
    qs_ref = next(it) if q_fp4 else None
    w_ref, vis_ref = next(it), next(it)
    kd_ref = next(it)
    ks_ref = next(it) if k_fp4 else None
    cb_ref = next(it) if has_cb else None
    o_ref = next(it)

    t = pl.program_id(2)
    heads = jnp.arange(hi, dtype=jnp.int32)
    local = jnp.arange(chunk, dtype=jnp.int32)

    def row_inputs(r):
        """Query row r's decoded q tiles, head weights and visibility."""
        return (*_row_inputs(qd_ref, qs_ref, w_ref[pl.ds(r * hi, hi)], r * hi + heads, d2, q_fp4, cdt, read),
                vis_ref[pl.ds(r, 1)])

    # decode (one query row per program): q decoded, its weights and visibility read, once -- not
    # again for every key chunk (no synchronous global load left in the chunk loop)
    once = row_inputs(0) if s_rows == 1 else None

    def chunk_body(c, _):
        pos = t * tile_n + c * chunk + local
        inb = pos < nc
        k_t, k_scale = _load_rows(kd_ref, ks_ref, jnp.where(inb, pos, 0), d2, k_fp4, cdt, read)

        def row_body(r, _):
            q_t, w, vis = once if once is not None else row_inputs(r)
            sc = _scores(q_t, k_t, w, keys_first, k_scale)
            ok = inb & (pos < vis)
            if has_cb:
                ok = ok & (cb_ref[jnp.full((chunk,), r, jnp.int32), pos // bs] != 0)
            sc = jnp.where(ok, sc, _NEG_INF)
            gm = sc if g0 == 1 else jnp.max(sc.reshape(chunk // g0, g0), axis=1)
            o_ref[pl.ds(r, 1), pl.ds(c * (chunk // g0), chunk // g0)] = gm[None, :]
            return 0

        jax.lax.fori_loop(0, s_rows, row_body, 0)
        return 0

    jax.lax.fori_loop(0, tile_n // chunk, chunk_body, 0)


def _prep(q, keys, weights, visible, candidate_blocks, block_size, fp4_read="phases"):
    """The kernels' operands. With MXFP4 q and keys and ``fp4_read`` "phases" or "f16phases" their
    codes are passed as little-endian 32-bit words (an XLA bitcast) for :func:`_load_rows`' word
    decode (``read``: the route the kernels take, None for the byte decode or plain operands)."""
    b, s, hi, di = _logical_shape(q)
    nc = _logical_shape(keys)[1]
    q_fp4, k_fp4 = isinstance(q, Fp4Tensor), isinstance(keys, Fp4Tensor)
    if q_fp4 and k_fp4:
        cdt = jnp.bfloat16
    else:
        dts = [x.dtype for x in (q, keys) if not isinstance(x, Fp4Tensor)]
        cdt = jnp.float32 if any(d == jnp.float32 for d in dts) else jnp.bfloat16

    # word reads: MXFP4 q and keys, phase dots of K >= 16
    read = fp4_read if q_fp4 and k_fp4 and (fp4_read not in WORD_READS or di % 128 == 0) else None
    read = None if read == "bytes" else read

    def codes(x):
        if read in WORD_READS:
            return le_words(as_uint8(x))
        return as_uint8(x) if read == "mx" else x

    if q_fp4:
        qa = (codes(q.data.reshape(b * s * hi, di // 2)), as_uint8(q.scale).reshape(b * s * hi, di // 32))
    else:
        qa = (q.reshape(b * s * hi, di),)
    ka = (codes(keys.data), as_uint8(keys.scale)) if k_fp4 else (keys,)
    w = weights.astype(jnp.float32).reshape(b * s * hi)
    vis = visible.astype(jnp.int32).reshape(b * s)
    cb = None
    if candidate_blocks is not None:
        cb = candidate_blocks.astype(jnp.int8).reshape(b * s, -1)
    return dict(b=b, s=s, hi=hi, di=di, nc=nc, q_fp4=q_fp4, k_fp4=k_fp4, cdt=cdt, qa=qa, ka=ka, w=w, vis=vis, cb=cb,
                read=read)


def index_block_maxima(p, *, g0, interpret, cfg):
    """Score kernel: masked group maxima over g0 positions, [B*S, NT*tile_n/g0] f32 (-inf padded);
    g0 = 1: every position's masked score."""
    b, s, hi, di, nc = p["b"], p["s"], p["hi"], p["di"], p["nc"]
    d2 = di // 2
    tile_n = min(cfg["tile_n"], max(cfg["chunk"], _next_pow2(nc)))
    # enough programs to fill the GPU (~2 waves of 132 SMs) when there are few query rows
    while tile_n > cfg["chunk"] and b * max(1, s // cfg["rows_per_program"]) * (-(-nc // tile_n)) < 264:
        tile_n //= 2
    chunk = min(cfg["chunk"], tile_n)
    chunk = max(chunk, g0)
    tile_n = max(tile_n, chunk)
    nt = -(-nc // tile_n)
    sq = min(cfg["rows_per_program"], s)
    while s % sq:
        sq -= 1
    ns = s // sq
    rows = b * s

    args, specs = [], []
    # q: [rows*hi, ...] block of sq*hi rows
    for a in p["qa"]:
        args.append(a)
        specs.append(pl.BlockSpec((sq * hi, a.shape[-1]), lambda i, j, t: (i * ns + j, 0)))
    args += [p["w"], p["vis"]]
    specs += [pl.BlockSpec((sq * hi,), lambda i, j, t: (i * ns + j,)), pl.BlockSpec((sq,), lambda i, j, t: (i * ns + j,))]
    for a in p["ka"]:
        args.append(a)
        specs.append(pl.BlockSpec((None, a.shape[1], a.shape[2]), lambda i, j, t: (i, 0, 0)))
    has_cb = p["cb"] is not None
    if has_cb:
        args.append(p["cb"])
        specs.append(pl.BlockSpec((sq, p["cb"].shape[1]), lambda i, j, t: (i * ns + j, 0)))
    out_w = tile_n // g0
    kernel = functools.partial(
        _score_kernel, q_fp4=p["q_fp4"], k_fp4=p["k_fp4"], has_cb=has_cb, hi=hi, d2=d2, nc=nc, s_rows=sq,
        tile_n=tile_n, chunk=chunk, g0=g0, bs=cfg["block_size"], cdt=p["cdt"], read=p["read"],
        keys_first=cfg["dot_order"] == "keys",
    )
    return pl.pallas_call(
        kernel,
        grid=(b, ns, nt),
        in_specs=specs,
        out_specs=pl.BlockSpec((sq, out_w), lambda i, j, t: (i * ns + j, t)),
        out_shape=jax.ShapeDtypeStruct((rows, nt * out_w), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg["score_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="indexer_block_maxima",
    )(*args)


# ------------------------------------------------------------------------------------------------
# 3. candidate score kernel


def _cand_kernel(*refs, q_fp4, k_fp4, has_cb, hi, d2, nc, tile, bs, cdt, read, keys_first):
    it = iter(refs)
    qd_ref = next(it)
    qs_ref = next(it) if q_fp4 else None
    w_ref, vis_ref, pos_ref = next(it), next(it), next(it)
    kd_ref = next(it)
    ks_ref = next(it) if k_fp4 else None
    cb_ref = next(it) if has_cb else None
    o_ref = next(it)

    c = pl.program_id(1)
    heads = jnp.arange(hi, dtype=jnp.int32)
    pos = pos_ref[pl.ds(c * tile, tile)]
    ok = (pos >= 0) & (pos < nc) & (pos < vis_ref[...])
    safe = jnp.where(ok, pos, 0)
    k_t, k_scale = _load_rows(kd_ref, ks_ref, safe, d2, k_fp4, cdt, read)
    q_t, w = _row_inputs(qd_ref, qs_ref, w_ref[...], heads, d2, q_fp4, cdt, read)
    sc = _scores(q_t, k_t, w, keys_first, k_scale)
    if has_cb:
        ok = ok & (cb_ref[safe // bs] != 0)
    o_ref[pl.ds(c * tile, tile)] = jnp.where(ok, sc, _NEG_INF)


def candidate_scores(p, pos, *, interpret, cfg):
    """Exact masked scores at candidate positions ``pos`` [R, C] (-1 = none) -> [R, C] f32."""
    s, hi, di, nc = p["s"], p["hi"], p["di"], p["nc"]
    rows, cn = pos.shape
    tile = min(cfg["cand_tile"], cn)
    args, specs = [], []
    for a in p["qa"]:
        args.append(a)
        specs.append(pl.BlockSpec((hi, a.shape[-1]), lambda r, c: (r, 0)))
    args += [p["w"], p["vis"], pos]
    specs += [pl.BlockSpec((hi,), lambda r, c: (r,)), pl.BlockSpec((1,), lambda r, c: (r,)),
              pl.BlockSpec((None, cn), lambda r, c: (r, 0))]
    for a in p["ka"]:
        args.append(a)
        specs.append(pl.BlockSpec((None, a.shape[1], a.shape[2]), lambda r, c: (r // s, 0, 0)))
    has_cb = p["cb"] is not None
    if has_cb:
        args.append(p["cb"])
        specs.append(pl.BlockSpec((None, p["cb"].shape[1]), lambda r, c: (r, 0)))
    kernel = functools.partial(_cand_kernel, q_fp4=p["q_fp4"], k_fp4=p["k_fp4"], has_cb=has_cb, hi=hi, d2=di // 2,
                               nc=nc, tile=tile, bs=cfg["block_size"], cdt=p["cdt"], read=p["read"],
                               keys_first=cfg["dot_order"] == "keys")
    return pl.pallas_call(
        kernel,
        grid=(rows, cn // tile),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, cn), lambda r, c: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, cn), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg["score_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="indexer_candidate_scores",
    )(*args)


# ------------------------------------------------------------------------------------------------
# 4. select kernel: exact top-k by bisection, output compacted in ascending order


def _select_kernel(v_ref, o_ref, *, n, np2, k, kp, early_exit):
    idx = jnp.arange(np2, dtype=jnp.int32)
    inr = idx < n
    v = v_ref[...]
    valid = inr & (v > _NEG_INF)  # NaN and -inf are never picked
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    skey = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order == float order
    ukey = jax.lax.bitcast_convert_type(skey, jnp.uint32) ^ jnp.uint32(0x80000000)
    # Every valid value has ukey > 0x007FFFFF (-inf's image) and every candidate threshold is >= 1, so
    # zeroing the invalid lanes once keeps them out of every count, and nothing below reads v again:
    # only this one [np2] array stays live through the loop (keeping v and the mask as well made the
    # compiler recompute the mask in every step: 254 registers, FSETP per element, at 16,384 entries).
    ukey_v = jnp.where(valid, ukey, jnp.uint32(0))

    def step(state):
        i, t, _ = state
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        cnt = jnp.sum((ukey_v >= cand).astype(jnp.int32))
        # (the flag stays a traced value without the early exit: a literal False in the loop's yield
        # fails the Triton lowering, 'Operand 3 of operation scf.yield must be a Value')
        return i + 1, jnp.where(cnt >= k, cand, t), (cnt == k) & jnp.bool_(early_exit)

    # With ``early_exit`` the bisection stops at the first threshold with exactly k values at or above
    # it: those k are the top-k (no tie straddles it), and the remaining low bits would only add zeros.
    # With distinct random f32 scores this comes when the bisection reaches the first bit in which the
    # k-th and (k+1)-th largest differ: 19 of the 32 steps on average (12-25) for top-512 of 4,096 or
    # 16,384 normal values (numpy count, BENCHMARKS.md issue 5, session 39).
    _, t, _ = jax.lax.while_loop(lambda st: (st[0] < 32) & ~st[2], step,
                                 (jnp.int32(0), jnp.uint32(0), jnp.bool_(False)))
    # t == 0 only when fewer than k values are valid (every candidate is >= 1): then all valid ones are
    # above it and no lane is a tie (the zeroed invalid lanes equal 0)
    gt = ukey_v > t
    n_gt = jnp.sum(gt.astype(jnp.int32))
    tie = (ukey_v == t) & (t > 0)
    tie_rank = jnp.cumsum(tie.astype(jnp.int32))
    sel = gt | (tie & (tie_rank <= k - n_gt))
    # A permutation: the selected entries first (in position order), then the rest. Every lane has
    # its own target (no two lanes write one address; interpret mode needs that too); targets
    # beyond the k padded output slots are masked off, the others get the index or -1.
    # (one prefix sum: lane i has i + 1 - cs[i] unselected lanes at or before it)
    n_sel = jnp.sum(sel.astype(jnp.int32))
    cs = jnp.cumsum(sel.astype(jnp.int32))
    target = jnp.where(sel, cs - 1, n_sel + idx - cs)
    pltriton.store(o_ref.at[target], jnp.where(sel, idx, -1), mask=target < kp)


def select_topk(vals, k, *, interpret=False, num_warps=8, early_exit=True):
    """Per row of ``vals`` [R, N] f32: the indices of the k largest finite values, ascending, -1 padded
    -> [R, k] int32. ``early_exit``: the bisection stops at the first threshold with exactly k values
    at or above it (False: always 32 steps; the same result)."""
    rows, n = vals.shape
    kp = _next_pow2(k)
    np2 = max(_next_pow2(n), kp)
    if np2 != n:
        vals = jnp.pad(vals, ((0, 0), (0, np2 - n)), constant_values=_NEG_INF)
    kernel = functools.partial(_select_kernel, n=n, np2=np2, k=k, kp=kp, early_exit=early_exit)
    out = pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, np2), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, kp), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, kp), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="indexer_select_topk",
    )(vals)
    return out[:, :k]


def _take(a, idx, fill):
    """take_along_axis on the last axis with -1 -> ``fill``."""
    got = jnp.take_along_axis(a, jnp.maximum(idx, 0), axis=-1)
    return jnp.where(idx >= 0, got, fill)


def topk_hierarchical(vals, k, *, factor, select_max, interpret, num_warps, early_exit=True):
    """Indices (into the last axis of ``vals`` [R, N]) of the top-k finite values, ascending, -1 padded.
    Rows longer than ``select_max`` go through group maxima over ``factor`` entries."""
    rows, n = vals.shape
    if n <= select_max:
        return select_topk(vals, k, interpret=interpret, num_warps=num_warps, early_exit=early_exit)
    pad = -n % factor
    if pad:
        vals = jnp.pad(vals, ((0, 0), (0, pad)), constant_values=_NEG_INF)
    parent = jnp.max(vals.reshape(rows, -1, factor), axis=-1)
    sel_p = topk_hierarchical(parent, k, factor=factor, select_max=select_max, interpret=interpret,
                              num_warps=num_warps, early_exit=early_exit)  # [R, k]
    child = jnp.where(sel_p[:, :, None] >= 0, sel_p[:, :, None] * factor + jnp.arange(factor, dtype=jnp.int32), -1)
    child = child.reshape(rows, -1)  # [R, k*factor] ascending
    cv = _take(vals, child, _NEG_INF)
    sel = select_topk(cv, k, interpret=interpret, num_warps=num_warps, early_exit=early_exit)
    return _take(child, sel, -1)


# ------------------------------------------------------------------------------------------------
# entry point


def lightning_indexer(q, weights, keys, visible, *, top_k, candidate_blocks=None, block_size=8,
                      want_block_scores=False, interpret=False, config=None) -> IndexerResult:
    reason = unsupported_reason(q, weights, keys, visible, top_k=top_k, candidate_blocks=candidate_blocks,
                                block_size=block_size)
    if reason is not None:
        raise ValueError(f"lightning_indexer (pallas): {reason}")
    if is_prefill(q) and prefill_reason(q, keys, config) is None:
        return _prefill_indexer(q, weights, keys, visible, top_k=top_k, candidate_blocks=candidate_blocks,
                                block_size=block_size, want_block_scores=want_block_scores, interpret=interpret,
                                config=config)
    cfg = dict(DEFAULTS, fp4_read=default_fp4_read(interpret))
    cfg.update(config or {})
    cfg["block_size"] = block_size
    for key, choices in (("fp4_read", FP4_READS), ("dot_order", DOT_ORDERS), ("decode_path", DECODE_PATHS)):
        if cfg[key] not in choices:
            raise ValueError(f"lightning_indexer (pallas): {key}={cfg[key]!r}; expected one of {', '.join(choices)}")
    p = _prep(q, keys, weights, visible, candidate_blocks, block_size, cfg["fp4_read"])
    b, s, nc = p["b"], p["s"], p["nc"]
    rows = b * s
    nb = -(-nc // block_size)
    if _takes_direct(cfg, nc):
        return _direct(p, top_k=top_k, nb=nb, want_block_scores=want_block_scores, interpret=interpret, cfg=cfg)
    small = rows * nb * 4 <= cfg["maxima_budget_bytes"]
    g0 = block_size if (want_block_scores or small or nc <= block_size * block_size) else block_size * block_size
    gmax = index_block_maxima(p, g0=g0, interpret=interpret, cfg=cfg)  # [R, >= ceil(nc/g0)]
    ng = -(-nc // g0)
    gmax_v = gmax[:, :ng]
    sel_g = topk_hierarchical(gmax_v, top_k, factor=block_size, select_max=cfg["select_max"], interpret=interpret,
                              num_warps=cfg["select_warps"], early_exit=cfg["select_early_exit"])  # [R, k] group ids
    kp = _next_pow2(top_k)
    if kp != top_k:
        sel_g = jnp.pad(sel_g, ((0, 0), (0, kp - top_k)), constant_values=-1)
    cand = jnp.where(sel_g[:, :, None] >= 0, sel_g[:, :, None] * g0 + jnp.arange(g0, dtype=jnp.int32), -1)
    cand = cand.reshape(rows, kp * g0)
    cs = candidate_scores(p, cand, interpret=interpret, cfg=cfg)
    sel = topk_hierarchical(cs, top_k, factor=block_size, select_max=cfg["select_max"], interpret=interpret,
                            num_warps=cfg["select_warps"], early_exit=cfg["select_early_exit"])
    topk = _take(cand, sel, -1).reshape(b, s, top_k)
    block_scores = None
    if want_block_scores:
        block_scores = gmax[:, :nb].reshape(b, s, nb)
    return IndexerResult(topk.astype(jnp.int32), block_scores)


def _takes_direct(cfg, nc: int) -> bool:
    """Whether decode rows over ``nc`` entries take ``decode_path`` "direct" under ``cfg``: it is
    asked for and one select program holds the row."""
    return cfg["decode_path"] == "direct" and _next_pow2(nc) <= cfg["select_max"]


def _direct(p, *, top_k, nb, want_block_scores, interpret, cfg) -> IndexerResult:
    """``decode_path`` "direct" (rows over at most ``select_max`` entries): the score kernel writes
    every entry's masked score (group size 1), one select program per row picks the top-k of them
    (ascending, -1 padded), and the block maxima, where wanted, are an XLA max over those scores.
    Two launches where the pipeline runs five or six, at the price of N scores per row in HBM
    (4 bytes each: 64 KB at the select's 16,384)."""
    b, s = p["b"], p["s"]
    bs = cfg["block_size"]
    sc = index_block_maxima(p, g0=1, interpret=interpret, cfg=cfg)  # [R, W >= Nc], -inf beyond Nc
    if sc.shape[1] < nb * bs:  # (tiles narrower than a block: only with hand-set configs)
        sc = jnp.pad(sc, ((0, 0), (0, nb * bs - sc.shape[1])), constant_values=_NEG_INF)
    topk = select_topk(sc, top_k, interpret=interpret, num_warps=cfg["select_warps"],
                       early_exit=cfg["select_early_exit"])
    block_scores = None
    if want_block_scores:
        block_scores = jnp.max(sc[:, :nb * bs].reshape(b * s, nb, bs), axis=-1).reshape(b, s, nb)
    return IndexerResult(topk.reshape(b, s, top_k).astype(jnp.int32), block_scores)


PREFILL_MIN_ROWS = 64  # query rows per sequence from which the tile score kernel runs


def is_prefill(q) -> bool:
    return _logical_shape(q)[1] >= PREFILL_MIN_ROWS


def _prefill_config(config):
    """The tile kernel's entries of a ``config`` (which may also hold the streaming kernel's)."""
    from . import pallas_triton_prefill as pf

    return {k: v for k, v in (config or {}).items() if k in pf.PREFILL_DEFAULTS}


def prefill_reason(q, keys, config=None):
    from . import pallas_triton_prefill as pf

    return pf.unsupported_reason(_logical_shape(q), _logical_shape(keys), {**pf.PREFILL_DEFAULTS, **_prefill_config(config)})


PREFILL_SCORE_BUDGET = 2 << 30  # bytes of [B, rows, Nc] f32 scores one prefill step holds


def _prefill_indexer(q, weights, keys, visible, *, top_k, candidate_blocks, block_size, want_block_scores,
                     interpret, config):
    """Prefill chunks: the tile score kernel writes the masked scores of a block of query rows once;
    the candidate mask and block maxima are the reference's functions, the top-k is
    ``topk_by_groups`` over those block maxima (the reference's positions, ties included). Rows go
    in blocks of at most PREFILL_SCORE_BUDGET bytes of scores (one block up to a 4096-row chunk
    against 131,072 entries; a 1M-entry cache takes 512 rows at a time), one block after another
    (``lax.map``), so the score matrix of a whole long prefill chunk never exists at once."""
    from . import pallas_triton_prefill as pf
    from . import reference as ref

    cfg = _prefill_config(config)
    budget = (config or {}).get("prefill_score_budget", PREFILL_SCORE_BUDGET)
    b, s = visible.shape
    nc = _logical_shape(keys)[1]

    def one(q, w, vis, cb):
        sc = pf.index_scores(q, w, keys, vis, interpret=interpret, config=cfg)
        if cb is not None:
            sc = jnp.where(ref.expand_blocks(cb, block_size, nc), sc, _NEG_INF)
        bmax = ref.block_max(sc, block_size)
        return pf.topk_by_groups(sc, top_k, block_size, bmax), (bmax if want_block_scores else None)

    rb = s
    while rb > 16 and b * rb * nc * 4 > budget:
        rb = _next_pow2(rb) // 2
    if rb >= s:
        return IndexerResult(*one(q, weights, visible, candidate_blocks))
    nblk = -(-s // rb)
    pad = nblk * rb - s

    def blocks(x):  # [B, S, ...] -> [nblk, B, rb, ...], padded rows see nothing (visible 0)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nblk, rb, *x.shape[2:]), 1, 0)

    qb = jax.tree.map(blocks, q)
    cbb = None if candidate_blocks is None else blocks(candidate_blocks)
    topk, bmax = jax.lax.map(lambda a: one(*a), (qb, blocks(weights), blocks(visible), cbb))

    def unblock(x):
        return None if x is None else jnp.moveaxis(x, 0, 1).reshape(b, nblk * rb, *x.shape[3:])[:, :s]

    return IndexerResult(unblock(topk), unblock(bmax))


DECODE_MIN_ENTRIES = 2048  # with decode_path "pipeline": entries from which 'auto' takes it for decode


def auto_reason(q, keys):
    """Why plain 'auto' dispatch does not pick this kernel on a GPU (None: pick it). Prefill chunks
    (>= PREFILL_MIN_ROWS query rows) take the tile score kernel (5.5-8.5x faster than XLA at a 64K
    prompt). Decode-sized calls with MXFP4 keys (V4.1's stores) take the kernel at every cache size:
    the direct path (the default ``decode_path``, 2 launches) up to ``select_max`` entries, 2.2-4.8x
    faster than the XLA reference at 1,280-16,384 entries x batch 1 and 8 on an H100 (session 46),
    and the streaming pipeline above (1.04-2.1x faster than the reference from 4K to 1M entries;
    BENCHMARKS.md, issue 5, sessions 13-14). With ``DSV41_INDEXER_DECODE=pipeline`` the pipeline
    serves every size and 'auto' keeps the reference below DECODE_MIN_ENTRIES, where the two measured
    level (session 14). Decode over plain float keys (V4 keeps them fake-quantized in bf16) runs the
    kernel's strided even/odd loads, not timed on a GPU, so it keeps the reference."""
    if is_prefill(q):
        return None
    if not isinstance(keys, Fp4Tensor):
        return "decode over plain float keys is not timed on a GPU (BENCHMARKS.md, issue 5)"
    nc = _logical_shape(keys)[1]
    if nc < DECODE_MIN_ENTRIES and not _takes_direct(DEFAULTS, nc):
        return (f"decode over {nc} compressed entries (< DECODE_MIN_ENTRIES = {DECODE_MIN_ENTRIES}): the XLA "
                "reference measured as fast on the H200 (BENCHMARKS.md, issue 5, session 14)")
    return None
