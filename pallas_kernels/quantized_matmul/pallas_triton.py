"""Pallas-Triton kernels for ``y = x @ W.T`` with FP8 (e4m3 + e8m0 32x32 blocks for V4.1, 128x128
for V4), MXFP4 or plain weights.

Same numerics as :mod:`.reference`: x is fake-quantized per ``act_block`` along K (DeepSeek's
``act_quant``; the values are exact in bf16), the weight tile is decoded in registers to bf16
(exact: e4m3 or e2m1 times a power of two), and the product accumulates in fp32. Only the fp32
summation order differs from the reference.

Two configurations of one kernel (``shared/spec/pallas_triton.md`` §3: power-of-two blocks, 2-D
dots, no scratch, e4m3fn, packed FP4 decoded with integer ops):

* **weight-streaming GEMV** (1-64 rows): rows padded to 16/32/64 (the smallest MMA tile), a
  64-row weight block per program, K split across programs when there are too few output blocks
  to fill the GPU (partial sums in fp32, added by one small XLA fusion);
* **tiled GEMM** (prefill): 128x128 (or 64) output tiles, K stepped 64 at a time.

Weight tiles:

* FP8: ``data`` [N, K] e4m3 and ``scale`` [ceil(N/B), ceil(K/B)] e8m0 (read as uint8), B = 32
  (V4.1) or 128 (V4). The scale tile [BN/B, BK/B] is expanded to [BN, BK] by broadcast + reshape
  and multiplied in fp32. A tile dim smaller than B (BN = 64 < 128 in the GEMV, BK = 64 < 128 in the
  tiled GEMM) lies inside one block (tiles are powers of two aligned to their size) and loads one
  scale row / column, still as a [1, .] / [., 1] block (no squeezed dims), so every load is in
  bounds, also for a partial last block (N or K not a multiple of B). The activation block equals
  the weight block (32 or 128, the combinations the checkpoints use). The 128x128 variant matches
  the reference in interpret mode and lowers for cuda and rocm, but has not run on a GPU yet
  (``auto_reason`` keeps plain ``auto`` on the reference for it).
* MXFP4: ``data`` [N, K/2] uint8 (element 2k in the low nibble) and ``scale`` [N, K/32] e8m0.
  Each nibble is turned into the bits of an e4m3 byte equal to ``e2m1 * 2**-6`` (sign to bit 7,
  the 3 magnitude bits to bits 4..2), converted by the hardware, then scaled by ``2**(s - 127 + 6)``. Even and odd elements give two [BN, BK/2] tiles; the activation tile is
  split the same way (reshape [BM, BK/2, 2] + unstack) and the product is two dots.

The e8m0 scale ``s`` is decoded as the fp32 with exponent field ``s`` (``s << 23``), i.e. ``2**(s-127)``
exactly for s >= 1 (s = 0 would be 2**-127, a subnormal, read as 0; DeepSeek's weights never use it).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, act_quant, is_quantized
from pallas_kernels.scaled_dot import mx_default, mx_dot

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*", category=DeprecationWarning)

GEMV_MAX_ROWS = 64
FP8_BLOCKS = (32, 128)  # square FP8 weight blocks the kernels read: V4.1 (32x32) and V4 (128x128)
ACT_BLOCKS = (32, 128)  # activation fake-quant blocks (V4.1 / V4); done by XLA before the kernel
# how weight scales are applied in-kernel (read at trace time; the benchmark sweeps them):
# fp8 "expand" (scale tile broadcast to [bn, bk], bf16 dot), "gather" (per-row scale gather on a
# [bn, bk/B, B] view, B = the weight block or bk if smaller), "mma8" (experimental, 32x32 blocks
# only: e4m3 tensor-core dots per 32-wide K block, scales on the partials), "mma8t" (the same with
# the weight tile as the dot's first operand, for decode sizes: weight rows fill the MMA's M
# dimension, the few activation rows its N; experimental); fp4 "expand" / "view3d"; both "mx": the
# activation's e4m3 codes and the weight's codes with their e8m0 scales as stored, one OCP MX dot a
# K tile (pallas_kernels.scaled_dot.mx_dot: tt.dot_scaled, gfx950's block-scaled MFMA, no decode of
# ours; the default on such devices, see default_scale_mode)
SCALE_MODE = {"fp8": "expand", "fp4": "expand"}
MMA8_MODES = ("mma8", "mma8t")
N_SM_DEFAULT = 132


from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: E402,F401  (applies the fix)
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma  # noqa: E402
from pallas_kernels.quantized_matmul import pallas_triton_finish  # noqa: E402
from pallas_kernels import triton_compat  # noqa: E402
from pallas_kernels.deferred_sum import gemv_parts, sum_splits  # noqa: E402

triton_compat.FP8_IMPRECISE_ACC_KERNELS.update(f"qmm_fp8_{m}" for m in MMA8_MODES)
N_SM = 132  # H200; only used to choose the split-K factor (a heuristic, any value is correct)


# --------------------------------------------------------------------------------------------------
# helpers shared with the MoE kernels


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def weight_format(w) -> str:
    if isinstance(w, Fp8Tensor):
        return "fp8"
    if isinstance(w, Fp4Tensor):
        return "fp4"
    return "plain"


def operand_dtype(x_dtype, w) -> jnp.dtype:
    """Dot operand dtype, as the reference: bf16 for quantized weights (exact) and for bf16 x."""
    if is_quantized(w) or x_dtype == jnp.bfloat16:
        return jnp.bfloat16
    return jnp.float32


def weight_operands(w):
    """(data, scale-as-uint8 or None) arrays the kernels read."""
    if isinstance(w, Fp8Tensor):
        return w.data, jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    if isinstance(w, Fp4Tensor):
        data = w.data if w.data.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(w.data, jnp.uint8)
        return data, jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    return jnp.asarray(w), None


def weight_logical_shape(w) -> tuple[int, ...]:
    return tuple(w.shape) if is_quantized(w) else tuple(jnp.shape(w))


def fp8_block(w) -> int:
    """Square block size of an FP8 weight (32 for V4.1, 128 for V4); 32 for other formats (unused)."""
    return int(w.block[0]) if isinstance(w, Fp8Tensor) else 32


def weight_reason(w, *, rows_block: int = 32, k_block: int = 64, packings=("nibbles",)) -> str | None:
    """Shape/format checks common to every weight the kernels stream ([..., N, K] logical);
    ``packings``: the MXFP4 packings the caller's kernels read (the GEMMs here: nibbles only)."""
    shape = weight_logical_shape(w)
    if len(shape) < 2:
        return f"weight must be at least 2-D, got shape {shape}"
    n, k = shape[-2:]
    if isinstance(w, Fp8Tensor):
        if tuple(w.block) not in ((b, b) for b in FP8_BLOCKS):
            return f"FP8 weight blocks must be (32, 32) (V4.1) or (128, 128) (V4), got {w.block}"
        if w.data.dtype != jnp.float8_e4m3fn:
            return f"FP8 weight data must be float8_e4m3fn, got {w.data.dtype}"
        if w.scale.dtype != jnp.float8_e8m0fnu:
            return f"FP8 weight scale must be float8_e8m0fnu, got {w.scale.dtype}"
        b = fp8_block(w)
        want = (-(-n // b), -(-k // b))
        if tuple(w.scale.shape[-2:]) != want:
            return f"FP8 scale shape {tuple(w.scale.shape)} does not match {b}x{b} blocks of [{n}, {k}] (want [..., {want[0]}, {want[1]}])"
    elif isinstance(w, Fp4Tensor):
        if w.block != 32:
            return f"MXFP4 weight block must be 32, got {w.block}"
        if w.scale.dtype != jnp.float8_e8m0fnu:
            return f"FP4 weight scale must be e8m0 (MXFP4), got {w.scale.dtype} (the e4m3-scaled FP4 is a cache format)"
        if w.packing not in packings:
            return (f"MXFP4 weights packed as {w.packing!r} are read here only in packing {', '.join(packings)} "
                    "(the fused MoE reads f16pairs; convert with w.with_packing('nibbles'))")
    else:
        dt = jnp.asarray(w).dtype if not hasattr(w, "dtype") else w.dtype
        if dt not in (jnp.bfloat16, jnp.float32, jnp.float16):
            return f"plain weight dtype must be bf16/f16/f32, got {dt}"
    if n % rows_block:
        return f"weight rows N={n} must be a multiple of {rows_block}"
    if k % k_block:
        return f"reduction dim K={k} must be a multiple of {k_block}"
    return None


def act_block_reason(w, act_block: int) -> str | None:
    """The activation fake-quant block a quantized weight can be used with: FP8 needs act_block equal
    to its (square) weight block (V4.1 32/32, V4 128/128); MXFP4 takes 32 (V4.1) or 128 (V4). K must
    be a multiple of it. None for plain weights (no activation quant)."""
    if not is_quantized(w):
        return None
    if isinstance(w, Fp8Tensor) and act_block != fp8_block(w):
        return (f"act_block must equal the FP8 weight block ({fp8_block(w)}: V4.1 uses 32/32x32, V4 128/128x128), "
                f"got {act_block}")
    if act_block not in ACT_BLOCKS:
        return f"act_block must be 32 (V4.1) or 128 (V4), got {act_block}"
    k = weight_logical_shape(w)[-1]
    if k % act_block:
        return f"reduction dim K={k} must be a multiple of the activation block {act_block}"
    return None


def pick_block(total: int, cap: int) -> int:
    """Largest power of two <= cap dividing total."""
    b = cap
    while b > 1 and total % b:
        b //= 2
    return b


def _expand_cols(t, rep: int):
    """[R, C] -> [R, C*rep], each column repeated ``rep`` times (broadcast + reshape)."""
    r, c = t.shape
    return jnp.broadcast_to(t[:, :, None], (r, c, rep)).reshape(r, c * rep)


def _expand_rows_cols(t, rep_r: int, rep_c: int):
    """[R, C] -> [R*rep_r, C*rep_c] block expansion."""
    r, c = t.shape
    return jnp.broadcast_to(t[:, None, :, None], (r, rep_r, c, rep_c)).reshape(r * rep_r, c * rep_c)


FP4_EXP_SHIFT = 6  # _fp4_decode returns e2m1 * 2**-FP4_EXP_SHIFT


def _fp4_decode(nib):
    """int32 e2m1 codes (0..15) -> float32 ``e2m1 * 2**-6`` (exact).

    The 3 magnitude bits go to bits 4..2 of an e4m3 byte and the sign to bit 7: e4m3 (bias 7)
    then reads ``e2m1 * 2**-6`` for every code (codes 0/1 land on e4m3's subnormals 0 and 2**-7,
    the rest are normal), and the hardware e4m3 -> f32 conversion is exact. Every value is a
    normal f16/f32 afterwards, so no step depends on subnormal support (an fp16-pattern decode
    would put 0.5 on an f16 subnormal)."""
    bits = ((nib & 8) << 4) | ((nib & 7) << 2)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def load_weight_tiles(fmt, w_ref, s_ref, lead, rows, row0, bn, k0, bk, op_dtype, wblock=32):
    """Decode one weight tile to ``op_dtype``.

    ``lead``: tuple of leading (expert) indices; ``rows``: a ``pl.ds`` over N of size ``bn`` starting
    at ``row0`` (a multiple of ``bn``). ``wblock``: the FP8 weight block (32 or 128); ``bn`` and
    ``bk`` are powers of two, so a tile dim is either a multiple of the block or lies inside one
    block. Returns [bn, bk] (one tile) for FP8/plain and the (even, odd) pair of [bn, bk/2] tiles
    for MXFP4.
    """
    if fmt == "fp8":
        wb = wblock
        w = w_ref[(*lead, rows, pl.ds(k0, bk))]
        if SCALE_MODE["fp8"] == "gather":
            # scale row of every weight row gathered by index vector; applied on a [bn, bk/cb, cb] view
            cb = min(bk, wb)  # K columns per scale in this tile
            ridx = (row0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)) // wb
            s = s_ref[(*lead, ridx, pl.ds(k0 // wb, bk // cb))]
            sf = fma.e8m0_f32(s)
            w3 = w.astype(jnp.float32).reshape(bn, bk // cb, cb) * sf[:, :, None]
            return (w3.astype(op_dtype).reshape(bn, bk),)
        srows = pl.ds(row0 // wb, max(bn // wb, 1))
        if bk >= wb:
            s = s_ref[(*lead, srows, pl.ds(k0 // wb, bk // wb))]
            sf = fma.e8m0_f32(s)
            if bn >= wb:
                sf = _expand_rows_cols(sf, wb, wb)
            else:  # fewer rows in the tile than in a block: one scale row
                sf = jnp.broadcast_to(_expand_cols(sf, wb), (bn, bk))
        else:  # the K tile lies inside one block column (128x128 blocks, bk = 64): one scale column
            s = s_ref[(*lead, srows, pl.ds(k0 // wb, 1))]
            sf = fma.e8m0_f32(s)
            sf = _expand_rows_cols(sf, wb, bk) if bn >= wb else jnp.broadcast_to(sf, (bn, bk))
        return ((w.astype(jnp.float32) * sf).astype(op_dtype),)
    if fmt == "fp4":
        b = w_ref[(*lead, rows, pl.ds(k0 // 2, bk // 2))].astype(jnp.int32)
        s = s_ref[(*lead, rows, pl.ds(k0 // 32, bk // 32))]
        if SCALE_MODE["fp4"] == "view3d":
            sf = fma.e8m0_f32(s, FP4_EXP_SHIFT)[:, :, None]
            b3 = b.reshape(bn, bk // 32, 16)
            lo = (_fp4_decode(b3 & 15) * sf).astype(op_dtype).reshape(bn, bk // 2)
            hi = (_fp4_decode(b3 >> 4) * sf).astype(op_dtype).reshape(bn, bk // 2)
            return lo, hi
        sf = _expand_cols(fma.e8m0_f32(s, FP4_EXP_SHIFT), 16)
        lo = (_fp4_decode(b & 15) * sf).astype(op_dtype)
        hi = (_fp4_decode(b >> 4) * sf).astype(op_dtype)
        return lo, hi
    return (w_ref[(*lead, rows, pl.ds(k0, bk))].astype(op_dtype),)


def fp4_word_k_order(x):
    """x [..., K] -> the same values in the K order of :func:`load_fp4_word_tile`'s tiles (an XLA
    permutation inside each group of 8: position 4h + 2a + b holds element 4h + a + 2b, i.e. the
    elements 0, 2, 1, 3, 4, 6, 5, 7). A dot over K is the same sum in any order, so the weight codes
    may be decoded in the order a 32-bit word yields them if the activation is permuted to match."""
    *lead, k = x.shape
    return jnp.swapaxes(x.reshape(*lead, k // 8, 2, 2, 2), -1, -2).reshape(*lead, k)


def load_fp4_word_tile(w_ref, s_ref, lead, rows, bn, k0, bk, op_dtype, packing="nibbles"):
    """One MXFP4 weight tile decoded a 32-bit word at a time (the tensor-core path's "f16w" route):
    ``w_ref`` holds the packed codes as uint32 words [..., N, K/8] (8 codes, element 8q + j in nibble
    j). Nibbles j and j + 4 go into the two f16 halves of a word by one shift-mask-or
    (:func:`pallas_triton_fma.fp4_word_pairs_f32`: e2m1 * 2**-14, exact), then f32, times the e8m0
    scale (with the 2**14), then ``op_dtype`` (exact in bf16), and the four (j, j + 4) pairs are
    interleaved by three 2-way joins into one [bn, bk] tile whose K order is
    :func:`fp4_word_k_order`'s. Returns a 1-tuple: one dot per tile, against the permuted activation.
    ``bk`` must be a multiple of 32 (one scale per 32 elements = 4 words). ``packing``: how the codes
    sit in the words ("nibbles" or "f16pairs", :func:`pallas_triton_fma.fp4_word_pairs_f32`)."""
    pairs = [jnp.stack([lo, hi], axis=-1)  # [bn, bk/8, 2 (h)]
             for lo, hi in _scaled_word_pairs(w_ref, s_ref, lead, rows, k0, bk, op_dtype, packing)]
    a = jnp.stack([pairs[0], pairs[1]], axis=-1)  # [bn, bk/8, h, j in {0, 1}]
    b = jnp.stack([pairs[2], pairs[3]], axis=-1)  # j in {2, 3}
    return (jnp.stack([a, b], axis=-1).reshape(bn, bk),)  # column 8q + 4h + 2(j % 2) + j // 2


def _scaled_word_pairs(w_ref, s_ref, lead, rows, k0, bk, op_dtype, packing):
    """The words of a [bn, bk] MXFP4 tile decoded into four (element j, element j + 4) pairs of
    [bn, bk/8] tiles: e2m1 * 2**-14 (:func:`pallas_triton_fma.fp4_word_pairs_f32`), times the e8m0
    scale with the 2**14, in ``op_dtype`` (exact in bf16). ``op_dtype`` float16 (the MoE's "f16dots"
    reads): the placed codes stay float16 (:func:`pallas_triton_fma.fp4_word_pairs_f16`) and the
    2**(s - 113) multiplies them there (two codes per ``HMUL2``), exact for scale bytes s in [104, 128]
    (below: float16 subnormal rounding, above: overflow; the MoE's ``f16_scale_reason``)."""
    wds = w_ref[(*lead, rows, pl.ds(k0 // 8, bk // 8))]
    s = s_ref[(*lead, rows, pl.ds(k0 // 32, bk // 32))]
    sf = _expand_cols(fma.e8m0_f32(s, 14), 4)  # [bn, bk/8]
    if op_dtype == jnp.float16:
        sf = sf.astype(jnp.float16)
        return [(lo * sf, hi * sf) for lo, hi in fma.fp4_word_pairs_f16(wds, packing)]
    return [((lo * sf).astype(op_dtype), (hi * sf).astype(op_dtype)) for lo, hi in fma.fp4_word_pairs_f32(wds, packing)]


def fp4_phase_k_order(x, bk: int):
    """x [..., K] -> the same values with each K tile of ``bk`` elements laid out by phase: the tile's
    elements 8q + j (j = 0..7) for every q, phase j after phase j - 1 (an XLA transpose inside each
    tile). :func:`load_fp4_phase_tiles` decodes a weight tile into these 8 phases."""
    *lead, k = x.shape
    return jnp.swapaxes(x.reshape(*lead, k // bk, bk // 8, 8), -1, -2).reshape(*lead, k)


def load_fp4_phase_tiles(w_ref, s_ref, lead, rows, bn, k0, bk, op_dtype, packing="nibbles"):
    """One MXFP4 weight tile as 8 phase tiles [bn, bk/8] (phase j: the tile's elements 8q + j), the
    tensor-core kernels' "phases" route: the word decode of :func:`load_fp4_word_tile` (pairs (j,
    j + 4) per word, e2m1 * 2**-14, then f32, times the scale, then ``op_dtype``) without its joins
    into one [bn, bk] tile; the caller runs one dot per phase against the activation's phase tiles
    (:func:`fp4_phase_k_order`). ``bk / 8`` must be at least 16 (Triton's smallest dot K)."""
    pairs = _scaled_word_pairs(w_ref, s_ref, lead, rows, k0, bk, op_dtype, packing)
    return tuple(lo for lo, _ in pairs) + tuple(hi for _, hi in pairs)


def split_even_odd(x):
    """[M, K] -> (x[:, 0::2], x[:, 1::2]) inside a kernel (reshape + 2-way unstack)."""
    m, k = x.shape
    pairs = x.reshape(m, k // 2, 2)
    ev, od = jnp.split(pairs, 2, axis=-1)
    return ev.reshape(m, k // 2), od.reshape(m, k // 2)


def tile_dot(fmt, xt, wts, op_dtype, swap=False):
    """sum_k x[m, k] w[n, k] for decoded weight tiles, fp32 accumulation: [M, N], or with ``swap``
    the weight tile as the dots' first operand and the result [N, M] (on Hopper the wgmma then takes
    the decoded weights from registers; BENCHMARKS.md, issue 6, session 12)."""
    prec = jax.lax.Precision.HIGHEST if op_dtype == jnp.float32 else None
    if isinstance(xt, tuple):  # phase tiles of x and of the weights (the "phases" route)
        pairs = zip(xt, wts)
    elif fmt == "fp4" and len(wts) == 2:  # (even, odd) tiles; the word route returns one tile
        pairs = zip(split_even_odd(xt), wts)
    else:
        pairs = ((xt, wts[0]),)
    out = None
    for x, w in pairs:
        a, b = (w, x) if swap else (x, w)
        d = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        out = d if out is None else out + d
    return out


def act_fake_quant_tile(h, block: int = 32):
    """DeepSeek's act_quant on an in-kernel f32 tile [M, C] (C a multiple of ``block``): per row and
    ``block`` columns, s = 2**ceil(log2(max(amax, 1e-4)/448)), q = e4m3(clip(h/s, +-448)) * s.
    Bit-exact with :func:`dsv41_jax.quant.act_quant` (float32 out); one layout of
    :func:`pallas_triton_fma.quant_phases`."""
    m, c = h.shape
    return fma.quant_phases([h.reshape(m, c // block, block)])[0].reshape(m, c)


# --------------------------------------------------------------------------------------------------
# the matmul kernel


@functools.lru_cache(maxsize=None)
def _config(m: int, n: int, k: int, fmt: str):
    """(bm, bn, bk, splits, num_warps, num_stages) for an [m, k] x [n, k]^T product."""
    if m <= GEMV_MAX_ROWS:
        bm = max(16, next_pow2(m))
        bn = pick_block(n, 64)
        bk = pick_block(k, 256 if bm <= 32 else 128)
        n_blocks = n // bn
        k_steps = k // bk
        splits = 1
        # split K until the grid has about two waves of programs, keeping >= 2 K steps each
        while n_blocks * splits < 2 * N_SM and k_steps % (splits * 2) == 0 and k_steps // (splits * 2) >= 2:
            splits *= 2
        return bm, bn, bk, splits, 4, 3
    bm = 128
    bn = pick_block(n, 128)
    bk = pick_block(k, 64)
    return bm, bn, bk, 1, 8 if bn >= 128 else 4, 3


def _tiled(o_ref, step, *, bm, bn, bk, steps, split, swap=False):
    """The tiled GEMMs' program: output tile (program ids 1, 0) over its K split (program id 2), ``steps``
    K tiles of ``bk`` from ``kbase``; ``step(k0, row0, rows, mrows, acc) -> acc`` adds one K tile's
    product to the fp32 accumulator [bm, bn] ([bn, bm] with ``swap``), which is stored as the split's
    fp32 part or, unsplit, in the output's dtype. All refs are whole arrays (x padded to a multiple of
    bm rows by the wrapper): no partial blocks, no bounds masks, no squeezed block dims. (Partial-block
    masked BlockSpecs and squeezed output blocks gave wrong results on the H200 with jax 0.11.2, see
    BENCHMARKS.md.)"""
    i_n = pl.program_id(0)
    i_m = pl.program_id(1)
    i_s = pl.program_id(2)
    row0 = pl.multiple_of(i_n * bn, bn)
    rows = pl.ds(row0, bn)
    mrows = pl.ds(pl.multiple_of(i_m * bm, bm), bm)
    kbase = i_s * (steps * bk)

    def body(i, acc):
        return step(pl.multiple_of(kbase + i * bk, bk), row0, rows, mrows, acc)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
    out = (rows, mrows) if swap else (mrows, rows)
    if split:
        o_ref[(i_s, *out)] = acc
    else:
        o_ref[out] = acc.astype(o_ref.dtype)


def _mm_kernel(x_ref, w_ref, s_ref, o_ref, *, fmt, bm, bn, bk, steps, op_dtype, split, wblock=32):
    def step(k0, row0, rows, mrows, acc):
        xt = x_ref[mrows, pl.ds(k0, bk)]
        wts = load_weight_tiles(fmt, w_ref, s_ref, (), rows, row0, bn, k0, bk, op_dtype, wblock)
        return acc + tile_dot(fmt, xt, wts, op_dtype)

    _tiled(o_ref, step, bm=bm, bn=bn, bk=bk, steps=steps, split=split)


def unsupported_reason(x, w, *, act_block=32):
    """None if the Pallas kernel supports this call, else a readable reason."""
    shape = weight_logical_shape(w)
    if len(shape) != 2:
        return f"weight must be 2-D [N, K], got shape {shape}"
    if x.shape[-1] != shape[-1]:
        return f"x has K={x.shape[-1]} but the weight has K={shape[-1]}"
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        return f"x dtype must be bf16 or f32, got {x.dtype}"
    reason = weight_reason(w)
    if reason is None:
        reason = act_block_reason(w, act_block)
    if reason is None and isinstance(w, Fp8Tensor) and SCALE_MODE["fp8"] in MMA8_MODES and (fp8_block(w), act_block) != (32, 32):
        reason = (f"the experimental '{SCALE_MODE['fp8']}' FP8 scale mode supports only 32x32 weight blocks with act_block 32 "
                  f"(got {w.block}, act_block {act_block}); use the 'expand' or 'gather' mode")
    return reason


def _mm8_kernel(x8_ref, xs_ref, w_ref, s_ref, o_ref, *, bm, bn, bk, steps, split, swap=False):
    """FP8 weights on the FP8 tensor cores (SCALE_MODE['fp8'] == 'mma8', experimental): x as e4m3
    codes + per-32 power-of-two scales, one e4m3 x e4m3 dot per 32-wide K block, both scales
    applied to the fp32 partial (DeepSeek's promotion scheme). No weight decode at all.

    ``swap`` ('mma8t'): the weight tile [bn, 32] is the dot's first operand (the MMA's M dimension)
    and the activation codes [bm, 32] its N, giving a [bn, bm] partial; ``xs_ref`` is then the
    scales transposed by XLA ([K/32, M]) and the output [N, M]. At decode sizes the weight rows, not
    the padded activation rows, fill the tensor-core tiles, and the loads feed dots, so Triton's
    pipeliner keeps ``stages`` of them in flight (measured slower than the fma GEMV: BENCHMARKS.md)."""
    dims = (((1,), (1,)), ((), ()))

    def step(k0, row0, rows, mrows, acc):
        for j in range(bk // 32):
            kk = k0 + 32 * j
            xt, wt = x8_ref[mrows, pl.ds(kk, 32)], w_ref[rows, pl.ds(kk, 32)]
            sw = fma.e8m0_f32(s_ref[pl.ds(row0 // 32, bn // 32), pl.ds(kk // 32, 1)])  # [bn/32, 1]
            sw = jnp.broadcast_to(sw, (bn // 32, 32))
            if swap:
                part = jax.lax.dot_general(wt, xt, dims, preferred_element_type=jnp.float32)  # [bn, bm]
                acc = acc + part * sw.reshape(bn, 1) * xs_ref[pl.ds(kk // 32, 1), mrows]
            else:
                part = jax.lax.dot_general(xt, wt, dims, preferred_element_type=jnp.float32)  # [bm, bn]
                acc = acc + part * xs_ref[mrows, pl.ds(kk // 32, 1)] * sw.reshape(1, bn)
        return acc

    _tiled(o_ref, step, bm=bm, bn=bn, bk=bk, steps=steps, split=split, swap=swap)


def _mx_kernel(x8_ref, xs_ref, w_ref, s_ref, o_ref, *, fmt, bm, bn, bk, steps, split, wblock=32):
    """SCALE_MODE "mx": per K tile one MX dot (:func:`pallas_kernels.scaled_dot.mx_dot`) of the
    activation's e4m3 codes ``x8`` with their e8m0 scale bytes ``xs`` [M, K/32] and the weight's codes
    (FP8 e4m3 [N, K], or MXFP4 bytes [N, K/2]) with their e8m0 bytes: MXFP4's [N, K/32] as stored,
    FP8's square ``wblock`` blocks [N/wb, K/wb] widened here to one scale per row and 32 columns."""
    def step(k0, row0, rows, mrows, acc):
        xt, xs = x8_ref[mrows, pl.ds(k0, bk)], xs_ref[mrows, pl.ds(k0 // 32, bk // 32)]
        if fmt == "fp4":
            wt, ws = w_ref[rows, pl.ds(k0 // 2, bk // 2)], s_ref[rows, pl.ds(k0 // 32, bk // 32)]
        else:
            wb = wblock
            wt = w_ref[rows, pl.ds(k0, bk)]
            s = s_ref[pl.ds(row0 // wb, max(bn // wb, 1)), pl.ds(k0 // wb, max(bk // wb, 1))]
            ws = _expand_rows_cols(s, min(bn, wb), min(bk, wb) // 32)  # [bn, bk/32]
        return mx_dot(xt, xs, wt, ws, a_format="e4m3", b_format="e2m1" if fmt == "fp4" else "e4m3", acc=acc)

    _tiled(o_ref, step, bm=bm, bn=bn, bk=bk, steps=steps, split=split)


def _mx_act_operands(x2, block=32):
    """act_quant as MX operands: e4m3 codes [M, K] and e8m0 scale bytes [M, K/32] (a coarser
    ``block`` repeated: its scale holds for each of its 32-wide parts)."""
    from dsv41_jax.quant.codecs import as_uint8, e8m0_encode_exponent

    x8, e = _act_quant_exponents(x2, block)
    sb = as_uint8(e8m0_encode_exponent(e))
    return x8, jnp.repeat(sb, block // 32, axis=1) if block > 32 else sb


def default_scale_mode(fmt: str, interpret: bool = False) -> str:
    """The scale mode of ``fmt`` ("fp8" / "fp4") weights: :data:`SCALE_MODE`'s, except "mx" where that
    is left at "expand" and MX dots are the default (:func:`pallas_kernels.scaled_dot.mx_default`:
    gfx950, chosen offline, BENCHMARKS.md issue 6, session 52; no AMD device has run it)."""
    mode = SCALE_MODE[fmt]
    return "mx" if mode == "expand" and mx_default(interpret) else mode


def _act_quant_exponents(x2, block=32):
    """act_quant split into e4m3 codes [M, K] and the int exponents e [M, K/block] of its power-of-two
    scales: codes * 2**e == act_quant(x2) exactly."""
    from dsv41_jax.quant.codecs import E4M3_MAX, e4m3_round, pow2
    from dsv41_jax.quant.fake_quant import fp8_block_scale

    m, k = x2.shape
    xb = x2.astype(jnp.float32).reshape(m, k // block, block)
    e = fp8_block_scale(jnp.max(jnp.abs(xb), axis=-1))
    q = e4m3_round(jnp.clip(xb * pow2(-e[..., None]), -E4M3_MAX, E4M3_MAX)).astype(jnp.float8_e4m3fn)
    return q.reshape(m, k), e


def auto_reason(x, w):
    """Why plain 'auto' dispatch should not pick this kernel on a GPU yet (None: pick it). The FP8
    weight-streaming GEMV (<= 64 rows) has been checked against the reference on an H200 with V4.1's
    32x32 blocks (session 2) and V4's 128x128 blocks with 128-wide activation blocks (session 3,
    ``benchmark.py --check --only fp8-128``: every shape at 1, 8, 64 and 256 rows); the MXFP4 decode
    is not verified, and the tiled prefill configuration is slower than XLA's dequantize + cuBLAS
    (session 18, 4,096 rows on an H200: 0.64-0.80x of XLA's speed at wq_b, wo_b and shared_w2 with
    either weight block; BENCHMARKS.md, Pallas kernels II).
    implementation='pallas' (argument, context or DSV41_KERNELS) still runs every path."""
    if weight_format(w) != "fp8":
        return "only the FP8 GEMV path has been verified on an H200"
    if math.prod(x.shape[:-1]) > GEMV_MAX_ROWS:
        return ("the tiled (prefill) configuration is 0.64-0.80x of XLA's speed on an H200 at 4,096 rows "
                "(BENCHMARKS.md, session 18)")
    return None


def fma_decode_config(m: int, ws) -> tuple | None:
    """The decode-size default for ``m`` rows against the weights ``ws`` (one launch over all of
    them): the vector-unit (fma) configuration, or None where the tensor-core GEMV runs instead
    (``DSV41_DECODE_GEMV`` not fma for qmm, more than ``FMA_MAX_ROWS`` rows, a plain weight, or a
    shape or mix of weights the fma configuration cannot take)."""
    if fma.DECODE_GEMV["qmm"] != "fma" or m > fma.FMA_MAX_ROWS or any(weight_format(w) == "plain" for w in ws):
        return None
    k = weight_logical_shape(ws[0])[1]
    cfg = fma.default_config(m, tuple(weight_logical_shape(w)[0] for w in ws), k, ws[0])
    return cfg if fma.multi_reason(m, list(ws), cfg) is None else None


def fused_gemv_config(x, ws, *, act_block=32) -> tuple | None:
    """The fma configuration that computes ``x @ W.T`` for every W in ``ws`` in one launch, or None
    when this call is not that case: fewer than two weights, ``DSV41_FUSED_GEMV=off``, a weight this
    kernel module cannot take, or no shared fma configuration (:func:`fma_decode_config`); the
    caller then makes one call per weight."""
    if len(ws) < 2 or not fma.FUSED_GEMV:
        return None
    if any(unsupported_reason(x, w, act_block=act_block) is not None for w in ws):
        return None
    return fma_decode_config(math.prod(x.shape[:-1]), ws)


def finish_reason(x, ws, norms) -> str | None:
    """Why the one-launch GEMV cannot hand these outputs to the split-K finish kernel with their
    ``norms`` (None: it can, or no output is normalized)."""
    if norms is None or all(nw is None for nw in norms):
        return None
    widths = [weight_logical_shape(w)[0] for w in ws]
    return pallas_triton_finish.finish_reason((1, math.prod(x.shape[:-1]), sum(widths)), widths, list(norms))


def quantized_matmul_multi(x, ws, *, act_block=32, out_dtype=None, interpret=False, config=None, norms=None,
                           norm_eps=0.0) -> list:
    """``[x @ W.T for W in ws]`` in one fma kernel launch (decode sizes; see :func:`fused_gemv_config`);
    ``norms``: an RMSNorm weight (or None) per output, applied by the split-K finish kernel."""
    config = config or fused_gemv_config(x, ws, act_block=act_block)
    if config is None:
        raise ValueError("quantized_matmul_multi (pallas): these weights cannot share one launch "
                         "(see fused_gemv_config); call quantized_matmul per weight")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead = x.shape[:-1]
    k = x.shape[-1]
    ys = fma.quantized_matmul_fma_multi(x.reshape(-1, k), list(ws), act_block=act_block, out_dtype=out_dtype,
                                        config=tuple(config), interpret=interpret, norms=norms, norm_eps=norm_eps)
    return [y.reshape(*lead, y.shape[-1]) for y in ys]


def quantized_matmul(x, w, *, act_block=32, out_dtype=None, interpret=False, config=None, defer=False):
    """x [..., K] @ W.T -> [..., N] out_dtype. ``defer``: where the fma GEMV runs, its K parts as a
    :class:`~pallas_kernels.deferred_sum.DeferredSum` (the sum left to the consumer); else the array."""
    reason = unsupported_reason(x, w, act_block=act_block)
    if reason is not None:
        raise ValueError(f"quantized_matmul (pallas): {reason}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    fmt = weight_format(w)
    n, k = weight_logical_shape(w)
    lead = x.shape[:-1]
    m = math.prod(lead)
    op = operand_dtype(x.dtype, w)
    x2 = x.reshape(m, k)
    if config is None:
        config = fma_decode_config(m, [w])  # None: the tensor-core GEMV below
    if config is not None and config[0] == "fma":  # vector-unit GEMV for 1-4 rows (pallas_triton_fma)
        y = fma.quantized_matmul_fma(x2, w, act_block=act_block, out_dtype=out_dtype, config=tuple(config),
                                     interpret=interpret, raw=defer)
        return gemv_parts(y, out_dtype, (*lead, n)) if defer else y.reshape(*lead, n)
    xq = (act_quant(x2, act_block) if is_quantized(w) else x2).astype(op)
    bm, bn, bk, splits, warps, stages = config or _config(m, n, k, fmt)
    mp = -(-m // bm) * bm
    if mp != m:  # fused by XLA into the act-quant fusion
        xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
    data, scale = weight_operands(w)
    if scale is None:
        scale = jnp.zeros((1, 1), jnp.uint8)  # unused
    steps = k // bk // splits
    kernel = functools.partial(_mm_kernel, fmt=fmt, bm=bm, bn=bn, bk=bk, steps=steps, op_dtype=op,
                               split=splits > 1, wblock=fp8_block(w))
    operands = (xq, data, scale)
    mode = default_scale_mode(fmt, interpret) if fmt in ("fp8", "fp4") else None
    mma8 = fmt == "fp8" and mode in MMA8_MODES
    transposed = mma8 and SCALE_MODE["fp8"] == "mma8t"
    if mma8:
        from dsv41_jax.quant.codecs import pow2

        x8, e = _act_quant_exponents(x2, act_block)
        xs = pow2(e)  # fp32 power-of-two scales [M, K/act_block]: x8 * xs == act_quant(x2)
        if mp != m:
            x8 = jnp.pad(x8, ((0, mp - m), (0, 0)))
            xs = jnp.pad(xs, ((0, mp - m), (0, 0)), constant_values=1.0)
        kernel = functools.partial(_mm8_kernel, bm=bm, bn=bn, bk=bk, steps=steps, split=splits > 1, swap=transposed)
        operands = (x8, xs.T if transposed else xs, data, scale)
    elif mode == "mx":
        if bk % 64:
            raise ValueError(f"quantized_matmul (pallas): scale mode 'mx' needs K tiles that are multiples of 64 "
                             f"(two MX blocks: one packed MXFP4 byte row of 32), got bk={bk} (config {config})")
        x8, xs = _mx_act_operands(x2, act_block)
        if mp != m:
            x8 = jnp.pad(x8, ((0, mp - m), (0, 0)))
            xs = jnp.pad(xs, ((0, mp - m), (0, 0)), constant_values=127)
        kernel = functools.partial(_mx_kernel, fmt=fmt, bm=bm, bn=bn, bk=bk, steps=steps, split=splits > 1,
                                   wblock=fp8_block(w))
        operands = (x8, xs, data, scale)
    out_rows = (n, mp) if transposed else (mp, n)
    out_shape = (jax.ShapeDtypeStruct((splits, *out_rows), jnp.float32) if splits > 1
                 else jax.ShapeDtypeStruct(out_rows, out_dtype))
    y = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n // bn, mp // bm, splits),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"qmm_{fmt}_{mode}" if mma8 or mode == "mx" else f"qmm_{fmt}",
    )(*operands)
    if splits > 1:
        y = sum_splits(y)  # the K parts in order: the one definition of a split-K sum
    if transposed:
        y = y.T
    return y[:m].astype(out_dtype).reshape(*lead, n)


# --------------------------------------------------------------------------------------------------
# grouped GEMV (V4's wo_a: the activation's G groups, each against its own N rows of the weight)


def grouped_reason(x, w, *, groups: int) -> str | None:
    """None if the grouped fma GEMV takes ``x`` [..., G, K] against ``w`` [G*N, K], else why not."""
    if not isinstance(w, (Fp8Tensor, Fp4Tensor)):
        return f"the grouped GEMV takes FP8 or MXFP4 weights, got {type(w).__name__}"
    n, k = weight_logical_shape(w)
    if x.ndim < 2 or x.shape[-2] != groups or x.shape[-1] != k:
        return f"x must be [..., {groups}, {k}] for a weight [{n}, {k}] in {groups} groups, got {tuple(x.shape)}"
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        return f"x dtype must be bf16 or f32, got {x.dtype}"
    if n % groups:
        return f"the weight's {n} rows do not split into {groups} groups"
    m = math.prod(x.shape[:-2])
    if m > fma.GROUPED_MAX_ROWS:
        return f"the grouped GEMV takes at most {fma.GROUPED_MAX_ROWS} rows per group, got {m}"
    if fma.grouped_config(m, w, groups) is None:
        return f"no fma configuration divides a group's {n // groups} rows and K={k} in blocks of {fma.group_size(w)}"
    return None


def grouped_auto_reason(x, w):
    """Why 'auto' dispatch should not pick the grouped GEMV on a GPU (None: pick it): the FP8 case is
    checked against the reference on an H200 (``benchmark.py --grouped``); MXFP4 is not."""
    return None if weight_format(w) == "fp8" else "only the FP8 grouped GEMV has been verified on an H200"


def grouped_matmul(x, w, *, groups: int, out_dtype=None, interpret=False, config=None):
    """x [..., G, K] bf16/f32, w FP8/MXFP4 [G*N, K] -> [..., G, N] out_dtype (default x.dtype), no
    activation fake-quant (:func:`pallas_triton_fma.quantized_matmul_fma_grouped`)."""
    reason = grouped_reason(x, w, groups=groups)
    if reason is not None:
        raise ValueError(f"grouped_matmul (pallas): {reason}")
    lead = x.shape[:-2]
    m = math.prod(lead)
    k = x.shape[-1]
    cfg = tuple(config) if config is not None else fma.grouped_config(m, w, groups)
    y = fma.quantized_matmul_fma_grouped(x.reshape(m, groups, k), w, out_dtype=jnp.dtype(out_dtype or x.dtype),
                                         config=cfg, interpret=interpret)
    return y.reshape(*lead, groups, -1)
