"""Fused routed-expert MoE in Pallas-Triton: grouped gate/up GEMM + clamped SwiGLU + routing weight
+ FP8 act-quant of h, then the grouped down GEMM; two kernel launches plus a few small XLA ops for
the grouping and the final sum over slots.

Grouping (XLA, tiny): the N*k (token, slot) pairs are sorted by expert and laid out in blocks of
``bt`` rows; every block belongs to one expert (``block_expert``, -1 for an unused block) and
lists the pairs in it (``block_pair``; padding points at a dummy pair). The number of blocks is
static: ``min(E, N*k) + ceil(N*k / bt)``. For one or two tokens the sort is skipped and every pair
is its own block (each of a token's experts is distinct).

Kernel A, grid (blocks, I / bi): gathers the block's token rows of the act-quantized x by an index
vector, streams W1[e] and W3[e] rows [bi, D] (MXFP4/FP8/plain, decoded in registers as in
:mod:`pallas_kernels.quantized_matmul.pallas_triton`), then in registers: g, u rounded to x.dtype,
``u = clip(u, -L, L)``, ``g = min(g, L)``, ``h = silu(g) * u * w_route``, h rounded to x.dtype and
stored as bf16 rows of H [blocks * bt, I]; one XLA op fake-quantizes H per 32 (``act_quant``; the
in-kernel variant is wrong on the H200, see ``DEBUG``).

Kernel B, grid (blocks, D / bd): H rows x W2[e] rows [bd, I], rounded to x.dtype (the reference's
GEMM output) and stored to the pair's row of Y [N*k + 1, D]. XLA then sums the k slots in fp32.

Unused blocks skip all loads (``pl.when``). Numerics equal the reference up to fp32 summation order.

Formats: V4.1 (MXFP4 or FP8 32x32 experts, act_block 32) and V4 (MXFP4 experts with act_block 128;
FP8 experts with 128x128 blocks, read as in the quantized matmul: a 64-row tile or 64-wide K step
inside a 128 block uses one scale row / column). The act-quant of x and h is an XLA op, so the
activation block does not reach the kernels. The V4 variants match the reference in interpret mode
and lower for cuda and rocm but have not run on a GPU (``auto_reason`` keeps plain ``auto`` on the
reference for them).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import FP4_PACKINGS, Fp4Tensor, act_quant, fp4_packing, is_quantized
from pallas_kernels.deferred_sum import expert_slots
from pallas_kernels.moe.gate_up_finish import finish_act_quant_view, finish_reference, swiglu_h
from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma
from pallas_kernels.quantized_matmul.pallas_triton import (
    act_block_reason,
    act_fake_quant_tile,
    fp4_phase_k_order,
    fp4_word_k_order,
    fp8_block,
    load_fp4_phase_tiles,
    load_fp4_word_tile,
    load_weight_tiles,
    operand_dtype,
    pick_block,
    tile_dot,
    weight_format,
    weight_logical_shape,
    weight_operands,
    weight_reason,
)


# Debugging switches (read at trace time). ``act_quant_in_kernel``: fake-quantize h per 32 inside
# kernel A (``act_fake_quant_tile``) instead of as one XLA op between the kernels. On the H200
# (jax 0.11.2) the in-kernel version gave 3e-2 errors while every h row before it matched the
# reference (BENCHMARKS.md, fused MoE), so the default is the XLA op. ``return_h``: return kernel
# A's rows (h, block_pair) instead of y.
DEBUG = {"act_quant_in_kernel": False, "return_h": False}

# Launch order of the tensor-core kernels' programs. "rows": the weight-row tiles of one block vary
# fastest (grid (I/bi, blocks) and (D/bd, blocks)), so the programs running together read the same
# gathered activation rows and one expert's weights, which L2 then serves; "blocks": the blocks vary
# fastest (grid (blocks, I/bi), the kernels up to session 11), so at prefill sizes every weight-row
# tile re-reads the rows of hundreds of blocks from HBM. Read at trace time.
GRID_ORDER = {"order": "rows"}

MMA_FP4_ROUTES = ("auto", "bytes", "f16w", "phases", "f16dots")


def _parse_mma_fp4(text: str) -> str:
    via = text.strip() or "auto"
    if via not in MMA_FP4_ROUTES:
        raise ValueError(f"DSV41_MMA_FP4={text!r}: expected one of {', '.join(MMA_FP4_ROUTES)}")
    return via


# How the tensor-core MoE kernels (prefill sizes, and decode sizes where :func:`takes_fma` says no)
# decode MXFP4 experts into dot operands (read at trace time; DSV41_MMA_FP4):
# * "bytes": each packed byte's two nibbles -> e4m3 bit patterns -> f32 -> x scale -> bf16, as
#   (even, odd) tiles with two dots per K step; sm_90 SASS of the gate/up loop: 17.5 instructions
#   per code (session 7);
# * "f16w": the codes read as uint32 words, two codes per shift-mask-or into f16 halves (the fma
#   kernels' route), one [bt, bk] tile in a permuted K order and one dot per K step, the activation
#   and h permuted to match by XLA (:func:`load_fp4_word_tile`); half the SASS per K step;
# * "phases": the word decode without the joins -- each K tile decoded into 8 phase tiles [bn, bk/8]
#   (element 8q + j in phase j) and one dot per phase against the activation's phase tiles (x and h
#   laid out per tile by phase by XLA, :func:`fp4_phase_k_order`). Needs K tiles of at least 128 (16
#   per phase dot); where a tiling has smaller ones the kernels take "f16w" instead. On the H200
#   (session 34, BENCHMARKS.md) at the decode tiling (256-wide K tiles, 384 experts): 64 tokens
#   5,514 (bytes) -> 3,354 us (3,181 on f16pairs experts, whose word route took 6,860), 256 tokens
#   8,375 -> 5,073 us (4,824 on f16pairs, words 10,411); at the prefill tiling (64-wide K tiles, 4096
#   tokens over 96 experts) 128-wide tiles with phases (13.3-19.2 ms) lose to 64-wide words (10.0).
# * "f16dots" (forced): the word and phase routes with float16 dot operands (reads "f16words"
#   and "f16phases"). The decoded codes stay in float16 as the word decode places them (e2m1 *
#   2**-14) and are multiplied there by 2**(s - 113), so a tile holds the weight's own values e2m1 *
#   2**(s - 127): exact for e8m0 scale bytes s in [104, 128] (2**-23 .. 2**1; :func:`f16_scale_reason`
#   checks an expert tensor), no float32 round trip and no bf16 repack. The activation and h rows go
#   in as float16 times a power of two per row (:func:`f16_rows`: the row's largest value below
#   2**15; exact for blocks whose scale is at most 21 binades below the row's largest) and the
#   kernels multiply each accumulated row back. bf16 activations only (others keep the bf16 reads).
#   The default tiling takes the weight tile as the dots' first operand with float16 phase reads
#   (:func:`default_tiling`): on the H200 (session 44, BENCHMARKS.md issue 6), the whole MoE at the
#   decode tiling, phases -> f16dots + swap: 32 tokens over 96 experts 1,026.7 -> 943.0 us, 64 over 96
#   1,159.6 -> 1,064.1, 128 over 384 4,197.0 -> 4,126.8, 256 over 384 4,776.4 -> 4,686.7 (float16
#   operands without swap: -2 % over 96 experts, +1 % over 384; swap alone +2 %).
# * "auto" (default): "f16w" for bf16 activations with K tiles of at most 64, "phases" for K tiles of
#   at least 128, else "bytes" (:func:`mma_fp4_words`, :func:`mma_fp4_phases`); "f16phases" instead
#   of "phases" for bf16 activations where all three expert tensors are marked ``f16_exact``
#   (:func:`mark_f16_exact`, which the Engine applies to its routed experts; the word route keeps
#   bf16 operands: its float16 form is not timed at the prefill tiling yet); with float32
#   activations "bytes" (not timed there), and experts packed as f16pairs take "phases" where the
#   tiles allow it, else "f16w". On the H200 (session 9): the prefill tilings (64-wide K tiles) 13.50
#   -> 10.87 ms and 14.56 -> 11.94 ms at 4096 tokens over 96 experts with words. Session 9 found the
#   word route 2.96e-3 from the GPU reference in float32 and refused it there; session 12 measured
#   both routes on the same inputs: bytes 2.98e-3, words 2.96e-3 from the GPU reference, 4.0e-4 from
#   each other -- the FP8 act-quant of h turns ulp differences (sums in another order, Triton's exp
#   vs XLA's) into FP8 steps, the same for both routes (BENCHMARKS.md, issue 6, session 12), so
#   forcing f16w or phases is allowed for every dtype.
MMA_FP4 = {"route": _parse_mma_fp4(os.environ.get("DSV41_MMA_FP4", ""))}


@contextlib.contextmanager
def use_mma_fp4(route):
    """Within the block the tensor-core kernels trace with MXFP4 decode ``route`` (None: as it is);
    ``MMA_FP4`` is restored after it, also on errors."""
    saved = dict(MMA_FP4)
    if route is not None:
        MMA_FP4["route"] = _parse_mma_fp4(route)
    try:
        yield
    finally:
        MMA_FP4.update(saved)


def unsupported_reason(x, weights, indices, w1, w2, w3, act_block=32):
    if x.ndim != 2:
        return f"x must be [N, D], got shape {x.shape}"
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        return f"x dtype must be bf16 or f32, got {x.dtype}"
    if indices.ndim != 2 or weights.shape != indices.shape or indices.shape[0] != x.shape[0]:
        return f"weights {weights.shape} / indices {indices.shape} must both be [N, k] with N = {x.shape[0]}"
    fmts = {weight_format(w) for w in (w1, w2, w3)}
    if len(fmts) != 1:
        return f"w1, w2, w3 must share one format, got {sorted(fmts)}"
    s1, s2, s3 = (weight_logical_shape(w) for w in (w1, w2, w3))
    if len(s1) != 3 or s1 != s3:
        return f"w1 and w3 must both be [E, I, D], got {s1} and {s3}"
    e, i, d = s1
    if s2 != (e, d, i):
        return f"w2 must be [E, D, I] = {(e, d, i)}, got {s2}"
    if d != x.shape[1]:
        return f"x has D={x.shape[1]} but the experts have D={d}"
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        r = weight_reason(w, packings=FP4_PACKINGS) or act_block_reason(w, act_block)
        if r is not None:
            return f"{name}: {r}"
    packings = [getattr(w, "packing", None) for w in (w1, w2, w3)]
    if len(set(packings)) != 1:
        return f"w1, w2, w3 must share one MXFP4 packing, got {packings}"
    return None


def auto_reason(w1=None, act_block=32):
    """Plain 'auto' picks the fused MoE (h act-quantized by XLA between the two kernels) for every
    format it has matched the reference with on an H200 (BENCHMARKS.md): V4.1's MXFP4 experts at 1,
    8, 64, 300 tokens and FP8 32x32 at 8 (session 2); V4's act_block 128 with MXFP4 experts at 1, 8,
    64, 300 and FP8 128x128 experts at 8 (session 3). Nothing is gated any more; the function stays
    the one place a format found wrong on a GPU would be turned off."""
    del w1, act_block
    return None


def rows_per_expert(n_pairs: int, n_exp: int) -> float:
    """The expected rows per expert of ``n_pairs`` (token, slot) pairs spread over ``n_exp`` experts
    (at most one expert per pair): what picks the kernels and their tiling."""
    return n_pairs / max(1, min(n_exp, n_pairs))


def _config(n_pairs: int, n_exp: int, i: int, d: int, words_only: bool = False):
    """(bt, bi, bk_a, bd, bk_b, warps). From 256 rows per expert on (prefill chunks over few experts:
    the benchmark's 96 experts at 4096 tokens), 128-row blocks with 64-wide tiles: 13.45 ms against
    15.98 ms for the 64-row default, the fastest of 8 tilings on the H200 (session 8, BENCHMARKS.md).
    The same tiling from 64 rows per expert on (a 4096-token chunk over the real 384 experts): 16.89
    against 17.70 ms for (64, 128, 64, 128, 64, 4) with GRID_ORDER 'rows' (session 12) -- one
    half-empty block per expert costs less than ~1.5 fuller ones, each decoding the expert's weights.
    8 warps rather than 4 (session 12): 10.16 vs 10.52 ms at 96 experts, 16.67 vs 16.95 ms at 384 (the
    gate/up kernel gains 0.5 ms, the down kernel loses 0.1-0.2). ``words_only``: the tiling for the
    word route, the only one that reads experts packed as "f16pairs"."""
    rows = rows_per_expert(n_pairs, n_exp)
    if rows >= 64:
        return 128, pick_block(i, 64), pick_block(d, 64), pick_block(d, 64), pick_block(i, 64), 8
    bt = 16 if rows <= 16 else 32 if rows <= 32 else 64
    bi = pick_block(i, 64 if bt <= 32 else 128)
    bd = pick_block(d, 64 if bt <= 32 else 128)
    # 256-wide K tiles for the bytes and phase routes; the word route takes 64 (session 10, 32 tokens
    # over 96 experts: 2,315-2,630 us against 4,451 for bytes at 256), so f16pairs experts take 64
    # where a forced route rules the phases out (``words_only``)
    wide = 256 if bt <= 32 and not words_only else 64
    bk_a = pick_block(d, wide)
    bk_b = pick_block(i, wide)
    return bt, bi, bk_a, bd, bk_b, 4


def group_pairs_count(n: int, k: int, n_exp: int, bt: int) -> int:
    """The number of blocks :func:`group_pairs` makes for ``n`` tokens x ``k`` slots over ``n_exp``
    experts in blocks of ``bt`` rows."""
    p = n * k
    return p if n <= 2 else min(n_exp + 1, p) + -(-p // bt)


def group_pairs(indices, weights, n_exp: int, bt: int):
    """Blocks of ``bt`` (token, slot) pairs sharing an expert.

    Returns (block_expert [nb] int32, negative = unused; block_pair [nb*bt] int32, P = padding;
    block_token [nb*bt] int32 (0 for padding); block_weight [nb*bt] f32 (0 for padding)).
    A pair whose index is negative has no expert: it lands in an unused block (its output row is
    never written; :func:`~pallas_kernels.deferred_sum.slot_sum` drops it). The kernels skip every block whose expert is
    negative.
    """
    n, k = indices.shape
    p = n * k
    flat_e = indices.reshape(p).astype(jnp.int32)
    flat_w = weights.reshape(p).astype(jnp.float32)
    if n <= 2 and bt == 1:
        # decode: each pair its own one-row block. The arrays are the inputs as they are and
        # literal constants, so XLA runs no kernel for them (a select fusion per MoE layer before:
        # ~1.5 us at batch 1 on the H200, session 21's profile; then an iota, which XLA computes
        # with a kernel of its own before a custom call: 39 x 0.9 us per step, session 25's
        # profile); a negative index stays negative.
        block_pair = np.arange(p, dtype=np.int32)
        return flat_e, jnp.asarray(block_pair), jnp.asarray(block_pair // k), flat_w
    if n <= 2:  # each pair its own block, no sort (a token's experts are distinct)
        nb = group_pairs_count(n, k, n_exp, bt)
        block_expert = jnp.where(flat_e < 0, -1, flat_e)
        slot0 = (jnp.arange(nb * bt) % bt) == 0
        block_pair = jnp.where(slot0, jnp.arange(nb * bt) // bt, p).astype(jnp.int32)
    else:
        # pairs without an expert (index < 0) go to an extra bucket n_exp whose blocks are unused
        flat_b = jnp.where(flat_e < 0, n_exp, flat_e)
        nb = group_pairs_count(n, k, n_exp, bt)
        counts = jnp.zeros((n_exp + 1,), jnp.int32).at[flat_b].add(1)
        nblk = (counts + bt - 1) // bt
        blk_start = jnp.cumsum(nblk) - nblk
        pos_start = jnp.cumsum(counts) - counts
        order = jnp.argsort(flat_b, stable=True).astype(jnp.int32)
        se = flat_b[order]
        rank = jnp.arange(p, dtype=jnp.int32) - pos_start[se]
        blk = blk_start[se] + rank // bt
        row = blk * bt + rank % bt
        block_pair = jnp.full((nb * bt,), p, jnp.int32).at[row].set(order)
        block_expert = jnp.full((nb,), -1, jnp.int32).at[blk].set(jnp.where(se == n_exp, -1, se))
    valid = block_pair < p
    safe = jnp.minimum(block_pair, p - 1)
    block_token = jnp.where(valid, safe // k, 0).astype(jnp.int32)
    block_weight = jnp.where(valid, flat_w[safe], 0.0)
    return block_expert, block_pair, block_token, block_weight


def mma_fp4_words(x_dtype, bk_a: int, bk_b: int) -> bool:
    """Whether the tensor-core kernels read MXFP4 experts as words (``MMA_FP4``, see above) for
    activations of ``x_dtype`` and K tiles ``bk_a`` (gate/up) / ``bk_b`` (down)."""
    route = MMA_FP4["route"]
    if route == "auto":
        return x_dtype == jnp.bfloat16 and bk_a % 32 == 0 and bk_b % 32 == 0 and (
            max(bk_a, bk_b) <= 64 or mma_fp4_phases(bk_a, bk_b))
    return route in ("f16w", "phases", "f16dots")


def mma_fp4_phases(bk_a: int, bk_b: int) -> bool:
    """Whether the word-reading tensor-core kernels take the "phases" route: ``MMA_FP4`` "phases" or
    "auto", and both K tiles at least 128 wide (one dot of K >= 16 per phase)."""
    return MMA_FP4["route"] in ("auto", "phases", "f16dots") and min(bk_a, bk_b) >= 128


def fp4_read_for(x_dtype, packing: str, bk_a: int, bk_b: int, f16_exact: bool = False) -> str:
    """How the tensor-core kernels read MXFP4 experts of ``packing`` with K tiles ``bk_a`` / ``bk_b``
    under ``MMA_FP4``: "bytes", "words" or "phases", or with bf16 activations "f16words" /
    "f16phases" (float16 dot operands) under "f16dots", and "f16phases" under "auto" for experts
    checked ``f16_exact`` (:func:`mark_f16_exact`). Experts packed as "f16pairs" are read as words
    whatever the route (the bytes route reads nibbles)."""
    if packing != "f16pairs" and not mma_fp4_words(x_dtype, bk_a, bk_b):
        return "bytes"
    read = "phases" if mma_fp4_phases(bk_a, bk_b) else "words"
    route = MMA_FP4["route"]
    f16 = route == "f16dots" or (route == "auto" and f16_exact and read == "phases")
    return "f16" + read if f16 and x_dtype == jnp.bfloat16 else read


def experts_f16_exact(*ws) -> bool:
    """Whether every expert tensor of ``ws`` is marked ``f16_exact`` (:func:`mark_f16_exact`)."""
    return all(getattr(w, "f16_exact", False) for w in ws)


PHASE_READS = ("phases", "f16phases")  # reads with 8 phase dots per K tile (x laid out by phase)
F16_READS = ("f16words", "f16phases")  # reads with float16 dot operands ("f16dots")
F16_SCALE_WINDOW = (104, 128)  # e8m0 scale bytes whose weights are exact float16 numbers (see MMA_FP4)


def f16_scale_reason(w) -> str | None:
    """Why MXFP4 expert tensor ``w`` cannot take the "f16dots" route exactly (None: it can): a scale
    outside :data:`F16_SCALE_WINDOW`. Two reductions on the scales' device (a load-time check,
    outside any jit), two integers to the host. Blocks whose codes are all zero are refused as well:
    above the window their float16 factor 2**(s - 113) overflows to inf and 0 * inf is NaN (below it
    they would be exact, but one bound for both sides keeps the check to the scales)."""
    s = jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    lo, hi = int(jnp.min(s)), int(jnp.max(s))
    if lo < F16_SCALE_WINDOW[0] or hi > F16_SCALE_WINDOW[1]:
        return (f"MXFP4 scale bytes span [{lo}, {hi}]; the float16 dots (f16dots) are exact for "
                f"[{F16_SCALE_WINDOW[0]}, {F16_SCALE_WINDOW[1]}] (2**-23 .. 2**1): use DSV41_MMA_FP4=auto")
    return None


def mark_f16_exact(w):
    """MXFP4 expert tensor ``w`` marked ``f16_exact`` where :func:`f16_scale_reason` passes (the
    default route then reads it with float16 dot operands), else ``w`` unmarked: a check on the
    device, outside any jit. Other tensors are returned as they are."""
    if not isinstance(w, Fp4Tensor) or w.block != 32 or w.scale.dtype != jnp.float8_e8m0fnu:
        return w
    return w.replace(f16_exact=f16_scale_reason(w) is None)


def f16_rows(a):
    """Activation rows [R, K] (bf16 values) -> (float16 rows a * 2**(15 - e), float32 [R] 2**(e - 15)),
    e the exponent just above the row's largest magnitude: every row below 2**15 in float16, so an
    act-quantized block's e4m3 values are exact unless its scale lies more than 21 binades below the
    row's largest block scale (then its smallest values round to multiples of 2**-24 of the scaled
    row: under 2**-39 of its largest value). Powers of two: the kernels' row sums times the factor are
    the bf16 rows' sums, in another order."""
    af = a.astype(jnp.float32)
    _, e = jnp.frexp(jnp.max(jnp.abs(af), axis=-1))
    return (af * jnp.ldexp(jnp.float32(1.0), 15 - e)[..., None]).astype(jnp.float16), jnp.ldexp(jnp.float32(1.0), e - 15)


def words_need_narrow_tiles() -> bool:
    """Whether experts read as words (f16pairs) need the word route's 64-wide K tiles: when
    ``MMA_FP4`` rules the phase route out (a forced "bytes" or "f16w"), 256-wide word tiles would
    take the joins that made them 2x slower (session 10)."""
    return MMA_FP4["route"] not in ("auto", "phases", "f16dots")


def default_tiling(n_pairs: int, n_route: int, w1, x_dtype=jnp.bfloat16, f16_exact: bool | None = None) -> tuple:
    """The tensor-core kernels' default (bt, bi, bk_a, bd, bk_b, warps) for ``n_pairs`` (token, slot)
    pairs spread over ``n_route`` experts of ``w1``'s shapes and packing (f16pairs experts take the
    word route's 64-wide K tiles where :func:`words_need_narrow_tiles`), for ``x_dtype`` activations;
    where the kernels then read the experts as float16 phases, with (stages 3, swap 1) after it: the
    weight tile as the dots' first operand (session 44). ``f16_exact``: whether all three expert
    tensors are marked (None: ``w1``'s mark)."""
    _, i_dim, d = weight_logical_shape(w1)
    cfg = _config(n_pairs, n_route, i_dim, d, words_only=fp4_packing(w1) == "f16pairs" and words_need_narrow_tiles())
    if weight_format(w1) == "fp4":
        exact = experts_f16_exact(w1) if f16_exact is None else f16_exact
        if fp4_read_for(x_dtype, fp4_packing(w1), cfg[2], cfg[4], exact) == "f16phases":
            return (*cfg, 3, 1)
    return cfg


def _x_tile(x_ref, rows, k0, bk, fp4_read: str):
    """The activation tile of ``rows`` x [k0, k0+bk): one [rows, bk] tile, or for ``fp4_read``
    "phases" the 8 phase tiles [rows, bk/8] of a tile laid out by :func:`fp4_phase_k_order` (one load
    each)."""
    if fp4_read not in PHASE_READS:
        return x_ref[rows, pl.ds(k0, bk)]
    return tuple(x_ref[rows, pl.ds(k0 + j * (bk // 8), bk // 8)] for j in range(8))


def _weight_tile(fmt, fp4_read, w_ref, s_ref, e, rows, row0, bn, k0, bk, op_dtype, wblock, packing="nibbles"):
    """A weight tile as the dots take it; MXFP4 by ``fp4_read``: "bytes" (nibble pairs of bytes),
    "words" (one tile from 32-bit words) or "phases" (8 phase tiles from words), in float16 for
    :data:`F16_READS`."""
    if fmt == "fp4" and fp4_read != "bytes":
        load = load_fp4_phase_tiles if fp4_read in PHASE_READS else load_fp4_word_tile
        return load(w_ref, s_ref, (e,), rows, bn, k0, bk, jnp.float16 if fp4_read in F16_READS else op_dtype, packing)
    return load_weight_tiles(fmt, w_ref, s_ref, (e,), rows, row0, bn, k0, bk, op_dtype, wblock)


def _block_and_tile(rows_first: bool):
    """(block, weight-row tile) of this program in the grid :func:`_grid` built."""
    if rows_first:
        return pl.program_id(1), pl.program_id(0)
    return pl.program_id(0), pl.program_id(1)


MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


def _grid(nb: int, tiles: int, rows_first: bool) -> tuple[int, int]:
    if rows_first:
        if nb > MAX_GRID_Y:
            raise ValueError(f"moe_experts (pallas): {nb} blocks exceed the grid's second dimension ({MAX_GRID_Y}); "
                             f"use larger row blocks (config bt) or pallas_triton.GRID_ORDER['order'] = 'blocks'")
        return tiles, nb
    return nb, tiles


def _gate_up_kernel(be_ref, tok_ref, wt_ref, x_ref, *refs,
                    fmt, bt, bi, bk, steps, op_dtype, x_dtype, limit, quant, wblock=32, act_block=32,
                    fp4_read="bytes", swap=False, rows_first=True, packing="nibbles"):
    # "f16phases" / "f16words": x's row factors (f16_rows) follow x
    xf_ref, w1_ref, s1_ref, w3_ref, s3_ref, h_ref = refs if len(refs) == 6 else (None, *refs)
    b, j = _block_and_tile(rows_first)
    e = be_ref[b]
    row0 = pl.multiple_of(j * bi, bi)
    rows = pl.ds(row0, bi)
    hrows = pl.ds(pl.multiple_of(b * bt, bt), bt)

    @pl.when(e >= 0)
    def _():
        tok = tok_ref[hrows]

        def body(i, carry):
            g, u = carry
            k0 = pl.multiple_of(i * bk, bk)
            xt = _x_tile(x_ref, tok, k0, bk, fp4_read)
            w1t = _weight_tile(fmt, fp4_read, w1_ref, s1_ref, e, rows, row0, bi, k0, bk, op_dtype, wblock, packing)
            w3t = _weight_tile(fmt, fp4_read, w3_ref, s3_ref, e, rows, row0, bi, k0, bk, op_dtype, wblock, packing)
            return g + tile_dot(fmt, xt, w1t, op_dtype, swap), u + tile_dot(fmt, xt, w3t, op_dtype, swap)

        z = jnp.zeros((bi, bt) if swap else (bt, bi), jnp.float32)
        g, u = jax.lax.fori_loop(0, steps, body, (z, z))
        if swap:
            g, u = g.T, u.T
        if xf_ref is not None:
            xf = xf_ref[tok][:, None]
            g, u = g * xf, u * xf
        g = g.astype(x_dtype).astype(jnp.float32)
        u = u.astype(x_dtype).astype(jnp.float32)
        if limit > 0:
            u = jnp.clip(u, -limit, limit)
            g = jnp.minimum(g, limit)
        h = g * jax.nn.sigmoid(g) * u * wt_ref[hrows][:, None]
        h = h.astype(x_dtype).astype(jnp.float32)
        if quant:
            h = act_fake_quant_tile(h, act_block)
        h_ref[hrows, rows] = h.astype(h_ref.dtype)


def _down_kernel(be_ref, pair_ref, h_ref, *refs, fmt, bt, bd, bk, steps, op_dtype, wblock=32,
                 fp4_read="bytes", swap=False, rows_first=True, packing="nibbles"):
    hf_ref, w2_ref, s2_ref, y_ref = refs if len(refs) == 4 else (None, *refs)  # float16 reads: h's row factors
    b, j = _block_and_tile(rows_first)
    e = be_ref[b]
    row0 = pl.multiple_of(j * bd, bd)
    rows = pl.ds(row0, bd)
    hrows = pl.ds(pl.multiple_of(b * bt, bt), bt)

    @pl.when(e >= 0)
    def _():
        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            ht = _x_tile(h_ref, hrows, k0, bk, fp4_read)
            wt = _weight_tile(fmt, fp4_read, w2_ref, s2_ref, e, rows, row0, bd, k0, bk, op_dtype, wblock, packing)
            return acc + tile_dot(fmt, ht, wt, op_dtype, swap)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bd, bt) if swap else (bt, bd), jnp.float32))
        if swap:
            acc = acc.T
        if hf_ref is not None:
            acc = acc * hf_ref[hrows][:, None]
        y_ref[pair_ref[hrows], rows] = acc.astype(y_ref.dtype)


def _gate_up_fma_kernel(be_ref, tok_ref, wt_ref, *refs, fmt, bt, bi, kg, steps, g, x_dtype, limit, splits=1,
                        route=None, f16=False):
    """Kernel A on the vector units (``"fma"`` configs): the block's ``bt`` rows share each decoded
    w1 / w3 tile; one fused multiply-add per weight element and row (:mod:`pallas_triton_fma`). Each
    step's x groups are loaded once for both tiles. With ``splits > 1`` (grid axis 2) a program
    runs ``steps`` of the K steps of its split and stores the fp32 gate / up sums to
    ``[splits, 2, rows, I]``; :mod:`gate_up_finish` then adds the splits and applies the activation.
    ``f16`` (an :func:`fma.f16acc_for` mode, default False): x is the float16 view and each word's
    products are summed in float16 (``fma.F16ACC``, opt-in).

    The activation fake-quant stays an XLA op before the kernel even with
    ``DSV41_FMA_ACT_QUANT=kernel``: done here (``fma.quant_phases``) it took the sm_90 loop from 596
    to 1,053 instructions per K step and 5 to 4 programs per SM, and kernel B's from 186 to 449
    (session 18, ``inspect_sass moe``): with 16 weight rows per program the per-program repetition
    costs far more than the two XLA kernels it saves."""
    x_refs = refs[:-5]
    w1_ref, s1_ref, w3_ref, s3_ref, out_ref = refs[-5:]
    b = pl.program_id(0)
    j = pl.program_id(1)
    split = pl.program_id(2) if splits > 1 else 0  # (program ids outside pl.when: interpret mode)
    step0 = split * steps
    e = be_ref[b]
    row0 = pl.multiple_of(j * bi, bi)

    @pl.when(e >= 0)
    def _():
        toks = [tok_ref[b * bt + r] for r in range(bt)]

        def load(i):
            g0 = pl.multiple_of((i + step0) * kg, kg)
            return (fma.load_tile(fmt, w1_ref, s1_ref, (e,), row0, bi, g0, kg, g),
                    fma.load_tile(fmt, w3_ref, s3_ref, (e,), row0, bi, g0, kg, g))

        def compute(i, tiles, carry):
            gs, us = carry
            g0 = pl.multiple_of((i + step0) * kg, kg)
            xs = fma.load_x(x_refs, toks, g0, kg, f16=bool(f16))
            pg = fma.partials(fmt, tiles[0], xs, route, f16)
            pu = fma.partials(fmt, tiles[1], xs, route, f16)
            return tuple(a + p for a, p in zip(gs, pg)), tuple(a + p for a, p in zip(us, pu))

        z = tuple(jnp.zeros((bi, kg), jnp.float32) for _ in range(bt))
        gs, us = fma.k_loop(steps, load, compute, (z, z))
        for r in range(bt):
            gr, ur = jnp.sum(gs[r], axis=1), jnp.sum(us[r], axis=1)
            if splits > 1:
                out_ref[split, 0, b * bt + r, pl.ds(row0, bi)] = gr
                out_ref[split, 1, b * bt + r, pl.ds(row0, bi)] = ur
            else:
                h = swiglu_h(gr, ur, wt_ref[b * bt + r], x_dtype, limit)
                out_ref[b * bt + r, pl.ds(row0, bi)] = h.astype(out_ref.dtype)


def _down_fma_kernel(be_ref, pair_ref, *refs, fmt, bt, bd, kg, steps, g, splits=1, route=None, f16=False):
    """Kernel B on the vector units: the block's ``bt`` h rows share each decoded w2 tile. With
    ``splits > 1`` (grid axis 2) a program runs ``steps`` of the K steps of its split and stores its
    fp32 sums to ``y[split]`` (:func:`_slots_out`: added in order and rounded by XLA, or with
    ``defer`` by the mHC expansion kernel). ``f16``: as kernel A's (h in the float16 view)."""
    h_refs = refs[:-3]
    w2_ref, s2_ref, y_ref = refs[-3:]
    b = pl.program_id(0)
    j = pl.program_id(1)
    split = pl.program_id(2) if splits > 1 else 0  # (program ids outside pl.when: interpret mode)
    step0 = split * steps
    e = be_ref[b]
    row0 = pl.multiple_of(j * bd, bd)

    @pl.when(e >= 0)
    def _():
        hrows = [b * bt + r for r in range(bt)]

        def load(i):
            return fma.load_tile(fmt, w2_ref, s2_ref, (e,), row0, bd, pl.multiple_of((i + step0) * kg, kg), kg, g)

        def compute(i, tile, accs):
            parts = fma.tile_partials(fmt, tile, h_refs, hrows, pl.multiple_of((i + step0) * kg, kg), kg, route=route,
                                      f16=f16)
            return tuple(a + p for a, p in zip(accs, parts))

        accs = fma.k_loop(steps, load, compute, tuple(jnp.zeros((bd, kg), jnp.float32) for _ in range(bt)))
        for r in range(bt):
            acc = jnp.sum(accs[r], axis=1)
            if splits > 1:
                y_ref[split, pair_ref[b * bt + r], pl.ds(row0, bd)] = acc
            else:
                y_ref[pair_ref[b * bt + r], pl.ds(row0, bd)] = acc.astype(y_ref.dtype)


def fma_reason(w1, config) -> str | None:
    """Why an ``"fma"`` config cannot run these experts (None: it can)."""
    _, bt, bi, kg_a, bd, kg_b = config[:6]
    if weight_format(w1) not in ("fp8", "fp4"):
        return "the fma MoE kernels take FP8 or MXFP4 experts only"
    if bt > fma.FMA_MAX_ROWS:
        return f"the fma MoE kernels take blocks of at most {fma.FMA_MAX_ROWS} rows, got {bt}"
    _, i_dim, d = weight_logical_shape(w1)
    g = fma.group_size(w1)
    if weight_format(w1) == "fp8" and max(bi, bd) > g:
        return f"FP8 rows per program (bi={bi}, bd={bd}) must be <= the weight block {g}"
    for name, total, blk in (("I", i_dim, bi), ("D", d, bd)):
        if total % blk:
            return f"{name}={total} must be a multiple of its row tile {blk}"
    for name, kdim, kg in (("D", d, kg_a), ("I", i_dim, kg_b)):
        if kdim % g or (kdim // g) % kg:
            return f"reduction dim {name}={kdim} must split into steps of {kg} groups of {g}"
    splits = fma_splits(config)
    if splits < 1 or (d // g // kg_a) % splits:
        return (f"the gate/up K split ({splits}) must divide its {d // g // kg_a} K steps "
                f"(D={d}, {kg_a} groups of {g} per step)")
    dsplits = fma_down_splits(config)
    if dsplits < 1 or (i_dim // g // kg_b) % dsplits:
        return (f"the down K split ({dsplits}) must divide its {i_dim // g // kg_b} K steps "
                f"(I={i_dim}, {kg_b} groups of {g} per step)")
    return None


def fma_splits(config) -> int:
    """The gate/up kernel's K splits of an ``"fma"`` config: its optional 9th entry, else 1."""
    return int(config[8]) if len(config) > 8 else 1


def fma_down_splits(config) -> int:
    """The down kernel's K splits of an ``"fma"`` config: its optional 11th entry, else 1."""
    return int(config[10]) if len(config) > 10 else 1


def with_down_splits(config, splits: int) -> tuple:
    """``config`` (an ``"fma"`` config) with ``splits`` down K splits: the 11-entry form, the gate/up
    split and warps kept (1 and the config's warps where absent)."""
    cfg = tuple(config[:8]) + (fma_splits(config), fma_gate_up_warps(config))
    return cfg + (int(splits),)


def fma_gate_up_warps(config) -> int:
    """The gate/up kernel's warps of an ``"fma"`` config: its optional 10th entry, else the config's
    warps (7th entry, also the down kernel's)."""
    return int(config[9]) if len(config) > 9 else int(config[6])


def _env_ints(text: str, default: tuple) -> list[int]:
    """A comma-separated list of integers from an environment variable (``default`` when empty; []
    when some entry is not an integer, for the caller's error)."""
    if not text.strip():
        return list(default)
    try:
        return [int(t.strip()) for t in text.split(",")]
    except ValueError:
        return []


def _parse_splits(text: str) -> dict:
    """``DSV41_MOE_SPLITS``: "S" (K splits) or "S,BI,W" (also the gate/up kernel's rows per program
    and warps while split)."""
    vals = _env_ints(text, (DEFAULT_SPLITS,))
    if len(vals) not in (1, 3) or min(vals) < 1 or any(v & (v - 1) for v in vals[1:]):
        raise ValueError(f"DSV41_MOE_SPLITS={text!r}: expected S or S,BI,W (positive integers: the gate/up "
                         "kernel's K splits, and its rows per program and warps while split, powers of two)")
    return {"splits": vals[0], "bi": vals[1] if len(vals) == 3 else None, "warps": vals[2] if len(vals) == 3 else None}


# The default: 2 splits (16 rows per program, 4 warps). H200, session 28 (BENCHMARKS.md, issue 6):
# at one token the gate/up kernel 38.6 -> 36.2 us and the finish 2.7 us in place of the 1.8 us
# act-quant prologue; batch-1 protocol 134.66 -> 135.43 tok/s (device time per step 7.826 -> 7.783
# ms). 5 splits with 32 rows per program were faster in isolation (65.9 against 68.5 us for the
# whole MoE) but not in the model (134.51 tok/s: its finish takes 3.5 us). DSV41_MOE_SPLITS=1: none.
DEFAULT_SPLITS = 2

# K splits of the fma gate/up kernel where its grid is small (read at trace time; DSV41_MOE_SPLITS):
# the default config takes ``splits`` (and, if set, ``bi`` rows per program and ``warps`` for the
# gate/up kernel, else 16 rows and 4 warps) when the gate/up grid at 16 rows per program (blocks x
# I/16 programs) has fewer than ``below`` programs and the split divides its K steps
# (:mod:`gate_up_finish`).
GATE_UP_SPLIT = {**_parse_splits(os.environ.get("DSV41_MOE_SPLITS", "")), "below": 2048}


def _parse_down(text: str) -> dict:
    """``DSV41_MOE_DOWN``: "BD,W" or "BD,W,S", the MXFP4 down kernel's output rows per program and
    warps in the default fma configs, and its K splits where the grid is small (as the gate/up split:
    one or two tokens; default :data:`DEFAULT_DOWN_SPLITS`); "0": 16 rows, the config's 4 warps, no
    split (the default before session 29)."""
    vals = _env_ints(text, DEFAULT_DOWN)
    if vals == [0]:
        return {"bd": 16, "warps": 4, "splits": 1}
    if len(vals) not in (2, 3) or min(vals) < 1 or any(v & (v - 1) for v in vals[:2]):
        raise ValueError(f"DSV41_MOE_DOWN={text!r}: expected BD,W or BD,W,S (BD and W powers of two: the MXFP4 "
                         "down kernel's output rows per program and warps; S its K splits on small grids) "
                         "or 0 (16 rows, 4 warps, no split)")
    return {"bd": vals[0], "warps": vals[1], "splits": vals[2] if len(vals) == 3 else DEFAULT_DOWN_SPLITS}


# The MXFP4 down kernel's tile: 64 output rows per program on 4 warps. H200, session 29
# (BENCHMARKS.md, issue 6), the down kernel inside the whole MoE, against 16 rows on 4 warps (the
# default until then): one token (2-split gate/up), 384 experts 24.18 -> 21.85 us, 96 experts
# 24.23 -> 22.87; 8 tokens (384 experts) 141.65 -> 119.35. 64 rows on 8 warps: 22.26 / 24.52 / 138.3;
# 128 rows 23.3-23.9 at one token, 128.4 at 8; 32 rows on 2 warps 122.0 at 8.
DEFAULT_DOWN = (64, 4)

# The MXFP4 down kernel's K splits on small grids (one or two tokens: the gate/up split's rule): 3
# of its 9 K steps each (I = 2304, 8 groups of 32 per step); the fp32 sums are added in order by
# the mHC expansion kernel where the MoE output is deferred, else by XLA. H200, session 31
# (BENCHMARKS.md, issue 6), whole MoE at one token, 96 experts: down 22.90 -> 19.03 us (65.97 ->
# 62.45 us for the MoE with an XLA sum of the splits); 384 experts 21.93 -> 18.94; two tokens
# 37.76 -> 33.33. 9 splits: the same down time, a slower sum. Batch-1 protocol (XLA sum) 136.78 ->
# 139.45 tok/s. Where 3 does not divide the K steps (V4-Flash: 4 steps of 16 groups) there is no
# split; session 32 timed V4-Flash's 2 and 4 splits within 1 % of none.
DEFAULT_DOWN_SPLITS = 3

# Read at trace time (DSV41_MOE_DOWN).
DOWN_TILE = _parse_down(os.environ.get("DSV41_MOE_DOWN", ""))


def default_fma_config(w1, rows_per_expert: float = 1.0, routing_shape: tuple[int, int] | None = None,
                       act_block: int = 32) -> tuple:
    """("fma", bt, bi, kg_a, bd, kg_b, warps, stages[, splits, gate/up warps[, down splits]]): one-row blocks up to 4
    expected rows per expert (pairs / min(experts, pairs)), 4-row blocks beyond. On the H200 (session
    9, 96 experts) one-row blocks beat 2-row ones at 2 rows per expert (1.41 vs 1.51 ms) and 4-row
    ones at 4 (2.75 vs 3.20). With ``routing_shape`` (the indices' [N, k]) the gate/up K split of
    :data:`GATE_UP_SPLIT` is added where the gate/up grid is small and its finish is the h
    act-quant prologue kernel (``act_block`` one K group of the experts, as V4.1's; measured there
    only: elsewhere the finish would be XLA ops). MXFP4 tiles (session 29): the gate/up kernel 32
    rows per program where its grid is large (8 tokens), else 16 (split or not); the down kernel
    :data:`DOWN_TILE` (``DSV41_MOE_DOWN``), with its K splits (11th entry) on small grids where
    they divide its K steps (MXFP4 experts only)."""
    n_exp, i_dim, d = weight_logical_shape(w1)
    g = fma.group_size(w1)
    fp4 = weight_format(w1) == "fp4"
    bt = 1 if rows_per_expert <= 4 else 4
    sp = GATE_UP_SPLIT
    # "small": the gate/up grid at 16 rows per program (FP8 experts: at their min(32, G)) has fewer
    # than sp["below"] programs (one or two tokens); unknown routing counts as small (16 rows, as
    # before session 29)
    base_rows = 16 if fp4 else min(32, g)
    small = routing_shape is None or group_pairs_count(*routing_shape, n_exp, bt) * (i_dim // base_rows) < sp["below"]
    # MXFP4 gate/up on a large grid: 32 rows per program (8 tokens, 384 experts, H200 session 29:
    # 246.8 -> 238.0 us against 16 rows; 8 K groups per step or 8 warps slower). Small grids keep 16:
    # at 32 rows the cubin needs 212 registers (2 programs per SM), too few programs for one token.
    bi = 32 if fp4 and not small else base_rows

    def kg_for(kdim):
        kg = 1
        while kg * 2 * g <= 512 and (kdim // g) % (kg * 2) == 0:
            kg *= 2
        return kg

    bd, warps = (DOWN_TILE["bd"], DOWN_TILE["warps"]) if fp4 else (bi, 4)
    cfg = ("fma", bt, pick_block(i_dim, bi), kg_for(d), pick_block(d, bd), kg_for(i_dim), warps, 3)
    if warps != 4:  # the gate/up kernel keeps 4 warps (10th entry)
        cfg = cfg + (1, 4)
    if small and routing_shape is not None and sp["splits"] > 1 and fma.moe_act_quant_site(w1, act_block) == "pallas":
        split = cfg[:2] + (sp["bi"] or pick_block(i_dim, base_rows),) + cfg[3:8] + (sp["splits"], sp["warps"] or 4)
        cfg = split if fma_reason(w1, split) is None else cfg  # e.g. a split that does not divide the K steps
    dsplits = DOWN_TILE["splits"] if fp4 else 1
    if small and routing_shape is not None and dsplits > 1:
        down = with_down_splits(cfg, dsplits)
        cfg = down if fma_reason(w1, down) is None else cfg
    return cfg


def _slots_out(y, indices, defer: bool, rows_dtype=None):
    """The kernels' per-pair rows y ([R, D], or a split down kernel's fp32 sums [S, R, D] whose
    in-order sum is rounded to ``rows_dtype``) summed over each token's slots, or with ``defer``
    handed on unsummed (:func:`pallas_kernels.deferred_sum.expert_slots`)."""
    rows = expert_slots(y, indices, rows_dtype=rows_dtype)
    return rows if defer else rows.value()


def _moe_fma(x, weights, indices, w1, w2, w3, *, limit, act_block, interpret, cfg, defer=False):
    reason = fma_reason(w1, cfg)
    if reason is not None:
        raise ValueError(f"moe_experts (pallas, fma): {reason}")
    _, bt, bi, kg_a, bd, kg_b, warps, stages = cfg[:8]
    splits = fma_splits(cfg)
    n, k = indices.shape
    n_exp, i_dim, d = weight_logical_shape(w1)
    fmt = weight_format(w1)
    route = fma.fp4_route(w1) if fmt == "fp4" else None
    g = fma.group_size(w1)
    p = n * k
    block_expert, block_pair, block_token, block_weight = group_pairs(indices, weights, n_exp, bt)
    nb = block_expert.shape[0]
    # "pallas": one Pallas launch per act-quant instead of two XLA ones (fma.moe_act_quant_site)
    prologue = fma.moe_act_quant_site(w1, act_block) == "pallas"
    f16 = fma.f16acc_for(w1, act_block, interpret)  # the float16-product route (fma.F16ACC): False, "on", "ptx", "gcn"

    def view(a):  # an activation (x, or h unsplit) as the kernels read it
        if prologue:
            return fma.act_quant_view(a, w1, interpret=interpret, f16=bool(f16))
        return fma.act_view16(a, w1) if f16 else fma.act_view(act_quant(a, act_block), w1)

    xs = view(x)
    (d1, s1), (d2, s2), (d3, s3) = (fma.weight_view(w) for w in (w1, w2, w3))
    params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    a_params = pltriton.CompilerParams(num_warps=fma_gate_up_warps(cfg), num_stages=stages)
    a_out = (jax.ShapeDtypeStruct((splits, 2, nb * bt, i_dim), jnp.float32) if splits > 1
             else jax.ShapeDtypeStruct((nb * bt, i_dim), x.dtype))
    h = pl.pallas_call(
        functools.partial(_gate_up_fma_kernel, fmt=fmt, bt=bt, bi=bi, kg=kg_a, steps=d // g // kg_a // splits, g=g,
                          x_dtype=x.dtype, limit=limit, splits=splits, route=route, f16=f16),
        out_shape=a_out,
        grid=(nb, i_dim // bi, splits) if splits > 1 else (nb, i_dim // bi),
        compiler_params=a_params,
        interpret=interpret,
        name=f"moe_gate_up_fma_{fmt}",
    )(block_expert, block_token, block_weight, *xs, d1, s1, d3, s3)
    if splits > 1 and (DEBUG["return_h"] or not prologue):  # the split's finish as XLA ops
        h = finish_reference(h, block_weight, x.dtype, limit)
    if DEBUG["return_h"]:  # as the tensor-core path: h after its act-quant
        return act_quant(h, act_block), block_pair
    if splits > 1 and prologue:  # the split's finish is the down kernel's act-quant prologue
        hs = finish_act_quant_view(h, block_weight, w1, x_dtype=x.dtype, limit=limit, interpret=interpret,
                                   f16=bool(f16))
    else:
        hs = view(h)
    dsplits = fma_down_splits(cfg)
    y = pl.pallas_call(
        functools.partial(_down_fma_kernel, fmt=fmt, bt=bt, bd=bd, kg=kg_b, steps=i_dim // g // kg_b // dsplits, g=g,
                          splits=dsplits, route=route, f16=f16),
        out_shape=(jax.ShapeDtypeStruct((dsplits, p + 1, d), jnp.float32) if dsplits > 1
                   else jax.ShapeDtypeStruct((p + 1, d), x.dtype)),
        grid=(nb, d // bd, dsplits) if dsplits > 1 else (nb, d // bd),
        compiler_params=params,
        interpret=interpret,
        name=f"moe_down_fma_{fmt}",
    )(block_expert, block_pair, *hs, d2, s2)
    return _slots_out(y, indices, defer, rows_dtype=x.dtype if dsplits > 1 else None)


# MXFP4 experts take the fma kernels while the expected rows per expert (pairs / min(experts, pairs))
# stay at most this, keyed by how the tensor-core kernels would read them at their default tiling
# (:func:`fp4_read_for`); for "bytes" and "words" also at any size up to FMA_MOE_MAX_PAIRS pairs.
# H200, fma (the dispatch's config) against the tensor-core default, µs, nibbles / f16pairs:
# * "phases" (session 34, BENCHMARKS.md issue 6), 384 experts: 64 tokens (1 row per expert) fma 2,634
#   / 2,328 against 3,354 / 3,181; 96 tokens (1.5 rows) 3,894 / 3,426 against 4,084 / 3,878; 128
#   tokens (2 rows) 5,148 / 4,521 against 4,472 / 4,248; 192 (3 rows) 7,669 / 6,712 against 4,860
#   / 4,618; 96 experts: 32 tokens (2 rows, 192 pairs) 1,339 / 1,179 against 1,079 / 1,037. So the
#   pair limit does not apply: the tensor cores win from 2 rows per expert at any size.
# * "bytes" (nibbles) and "words" (f16pairs under a forced DSV41_MMA_FP4), session 33, 384 experts:
#   128 tokens (2 rows) 5.14 / 4.51 ms against 7.30 / 9.11; 256 tokens (4 rows) 10.16 / 8.88
#   against 8.28 / 10.32. Session 9, 96 experts, 384 pairs (4 rows): fma 2.75 against 2.40 (bytes).
# FP8 experts keep the pair limit alone (not measured).
FMA_MOE_MAX_ROWS_PER_EXPERT = {"phases": 1.5, "f16phases": 1.5, "bytes": 2.0, "words": 4.0, "f16words": 4.0}


def takes_fma(w1, pairs: int, x_dtype=jnp.bfloat16, routed_experts: int | None = None, tiling=None) -> bool:
    """Whether the default dispatch runs ``pairs`` (token, slot) pairs of ``x_dtype`` activations
    over experts ``w1`` on the fma kernels (else the tensor-core ones): FP8 and plain experts up to
    ``fma.FMA_MOE_MAX_PAIRS`` pairs; MXFP4 experts while the rows per expert stay within
    :data:`FMA_MOE_MAX_ROWS_PER_EXPERT` for the tensor-core kernels' read, and (unless that read is
    "phases") up to the pair limit. ``routed_experts``: see :func:`moe_experts`; ``tiling``: the
    tensor-core kernels' :func:`default_tiling` where the caller has it."""
    if weight_format(w1) != "fp4":
        return pairs <= fma.FMA_MOE_MAX_PAIRS
    n_route = max(weight_logical_shape(w1)[0], routed_experts or 0)
    cfg = tiling or default_tiling(pairs, n_route, w1, x_dtype)
    read = fp4_read_for(x_dtype, fp4_packing(w1), cfg[2], cfg[4], experts_f16_exact(w1))
    if read not in PHASE_READS and pairs <= fma.FMA_MOE_MAX_PAIRS:
        return True
    return rows_per_expert(pairs, n_route) <= FMA_MOE_MAX_ROWS_PER_EXPERT[read]


def moe_experts(x, weights, indices, w1, w2, w3, *, swiglu_limit, act_block=32, interpret=False, config=None,
                defer=False, routed_experts=None):
    """The routed experts' output [N, D] float32; ``defer``: as the kernels' unsummed slot rows
    (a :class:`~pallas_kernels.deferred_sum.DeferredSum`). ``routed_experts``: how many experts the
    pairs are spread over where ``w1`` holds a shard of them and the other shards' pairs come as -1
    (expert parallelism's psum path): the expected rows per local expert, which pick the kernels and
    the tiling, are then pairs / routed_experts, not pairs / local experts. The result does not
    depend on it."""
    reason = unsupported_reason(x, weights, indices, w1, w2, w3, act_block)
    if reason is not None:
        raise ValueError(f"moe_experts (pallas): {reason}")
    n, k = indices.shape
    n_exp, i_dim, d = weight_logical_shape(w1)
    n_route = max(n_exp, routed_experts or 0)  # the experts the pairs spread over (the rows-per-expert estimate)
    fmt = weight_format(w1)
    p = n * k
    limit = float(swiglu_limit or 0.0)
    # the tensor-core kernels' default tiling, which also decides fma against them
    f16_exact = experts_f16_exact(w1, w2, w3)
    tiling = default_tiling(p, n_route, w1, x.dtype, f16_exact) if config is None else None
    if config is None and fmt != "plain" and fma.DECODE_GEMV["moe"] == "fma" and takes_fma(w1, p, x.dtype, n_route,
                                                                                           tiling):
        cand = default_fma_config(w1, rows_per_expert(p, n_route), routing_shape=(n, k), act_block=act_block)
        if fma_reason(w1, cand) is None:  # else the tensor-core kernels below
            config = cand
    if config is not None and config[0] == "fma":  # vector-unit decode kernels (no tensor cores)
        return _moe_fma(x, weights, indices, w1, w2, w3, limit=limit, act_block=act_block, interpret=interpret,
                        cfg=tuple(config), defer=defer)
    quant = is_quantized(w1)
    op = operand_dtype(x.dtype, w1)
    packing = fp4_packing(w1)  # w2, w3 alike (unsupported_reason)
    cfg = tuple(config or tiling)
    bt, bi, bk_a, bd, bk_b, warps = cfg[:6]
    stages = cfg[6] if len(cfg) > 6 else 3  # optional 7th entry: software-pipelining stages
    # optional 8th: 1 = weight tile as the dots' first operand (tile_dot's swap; measured 10-40 % slower
    # with MXFP4 on the H200, BENCHMARKS.md issue 6 session 12: an option, not a default)
    swap = bool(cfg[7]) if len(cfg) > 7 else False
    rows_first = GRID_ORDER["order"] == "rows"  # read once: the grids and the kernels' program ids agree
    for name, total, blk in (("I", i_dim, bi), ("D", d, bd), ("D (gate/up K)", d, bk_a), ("I (down K)", i_dim, bk_b)):
        if blk > total or total % blk:
            raise ValueError(f"moe_experts (pallas): config {cfg}: {name}={total} is not a multiple of its tile {blk}")
    block_expert, block_pair, block_token, block_weight = group_pairs(indices, weights, n_exp, bt)
    nb = block_expert.shape[0]
    xq = (act_quant(x, act_block) if quant else x).astype(op)
    d1, s1 = weight_operands(w1)
    d2, s2 = weight_operands(w2)
    d3, s3 = weight_operands(w3)
    fp4_read = fp4_read_for(x.dtype, packing, bk_a, bk_b, f16_exact) if fmt == "fp4" else "bytes"
    words = fp4_read != "bytes"
    if words:  # packed codes as uint32 words; the activation in the words' K order (fused into act_quant)
        if bk_a % 32 or bk_b % 32:
            raise ValueError(f"moe_experts (pallas): the word decode (DSV41_MMA_FP4=f16w, or experts packed as "
                             f"f16pairs) needs K tiles that are multiples of 32, got bk_a={bk_a}, bk_b={bk_b} "
                             f"(config {cfg})")
        d1, d2, d3 = (fma._words(t) for t in (d1, d2, d3))
        xq = fp4_phase_k_order(xq, bk_a) if fp4_read in PHASE_READS else fp4_word_k_order(xq)
    f16 = fp4_read in F16_READS
    x_ops = f16_rows(xq) if f16 else (xq,)
    if s1 is None:
        s1 = s2 = s3 = jnp.zeros((1, 1, 1), jnp.uint8)
    params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    in_kernel = quant and DEBUG["act_quant_in_kernel"]
    if in_kernel and bi % act_block:
        raise ValueError(f"moe_experts (pallas): DEBUG act_quant_in_kernel needs I tiles (bi={bi}) that are "
                         f"multiples of act_block {act_block}")

    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, fmt=fmt, bt=bt, bi=bi, bk=bk_a, steps=d // bk_a, op_dtype=op,
                          x_dtype=x.dtype, limit=limit, quant=in_kernel, wblock=fp8_block(w1), act_block=act_block,
                          fp4_read=fp4_read, swap=swap, rows_first=rows_first, packing=packing),
        # h leaves kernel A in x.dtype (the reference act-quantizes h.astype(x.dtype)); only the
        # in-kernel act-quant may store bf16 (its e4m3 values are exact there). Storing f32 h as bf16
        # before the XLA act_quant double-rounded and broke f32 parity.
        out_shape=jax.ShapeDtypeStruct((nb * bt, i_dim), op if in_kernel else x.dtype),
        grid=_grid(nb, i_dim // bi, rows_first),
        compiler_params=params,
        interpret=interpret,
        name=f"moe_gate_up_{fmt}",
    )(block_expert, block_token, block_weight, *x_ops, d1, s1, d3, s3)
    if quant and not in_kernel:
        h = act_quant(h, act_block).astype(op)
    if DEBUG["return_h"]:
        return h, block_pair
    if words:  # the down GEMM's K is I: h in the words' K order (an XLA permutation after act_quant)
        h = fp4_phase_k_order(h, bk_b) if fp4_read in PHASE_READS else fp4_word_k_order(h)
    h_ops = f16_rows(h) if f16 else (h,)

    y = pl.pallas_call(
        functools.partial(_down_kernel, fmt=fmt, bt=bt, bd=bd, bk=bk_b, steps=i_dim // bk_b, op_dtype=op,
                          wblock=fp8_block(w1), fp4_read=fp4_read, swap=swap, rows_first=rows_first, packing=packing),
        out_shape=jax.ShapeDtypeStruct((p + 1, d), x.dtype),
        grid=_grid(nb, d // bd, rows_first),
        compiler_params=params,
        interpret=interpret,
        name=f"moe_down_{fmt}",
    )(block_expert, block_pair, *h_ops, d2, s2)
    return _slots_out(y, indices, defer)
