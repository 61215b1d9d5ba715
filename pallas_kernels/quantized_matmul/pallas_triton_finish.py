"""The split-K finish of the fused decode GEMV (:func:`pallas_triton_fma.quantized_matmul_fma_multi`)
when some of its outputs are RMS-normalized next: one small kernel sums the K parts, rounds each
output to its dtype and applies the norm, where XLA ran three kernels per layer at batch 1.

Why (issue 8, session 26 profile of the batch-1 step, H200): after the ``wq_a`` + ``wkv`` GEMV
(10 K parts, [10, B, 1280 + 512] f32) XLA ran the sum of squares of q as a one-block reduction
(``input_reduce_fusion`` f32[], 3.1 µs), then the normalization (1.4 µs), then the kv slice
(1.1 µs): 5.6 µs per layer, 0.22 ms per step.

Measured on the H200 (session 26, ``quantized_matmul.benchmark --finish``, device time of the GEMV +
what follows it, µs):

    rows | XLA sum + norm + slice | finish, 4 warps | finish, 8 warps (default) | 1 / 2 warps
       1 | 10.35 (3 XLA kernels)  |  9.02           |  8.15                     | 11.26 / 10.19
       2 | 10.03                  | 12.68           |  9.84                     | 11.61 / 11.54
       4 | 13.57                  | 16.27           | 13.40                     | 15.15 / 15.28

The kernel's time is the latency of its loads (70 chunk loads per row, a few in flight per thread
at a time); 8 warps halve what each thread waits on. With 4 warps the batch-1 step went from
8.215 to 8.132-8.137 ms (two processes). Here each program takes one activation row: it
sums the K parts in order (part 0 first), rounds to ``out_dtype`` as the reference's GEMM
output, and for a normalized output computes ``w * y * rsqrt(mean(y^2) + eps)`` in float32 from
the rounded values, then rounds again (:func:`dsv41_jax.layers.rms_norm`). Columns go in chunks of
the largest power of two (at most :data:`MAX_CHUNK`) dividing the output's width, because Triton
blocks are powers of two and 1280 is not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_CHUNK = 512  # columns per load
MIN_CHUNK = 16  # narrower chunks: the width is not worth a kernel of its own


def chunk_of(width: int) -> int:
    """The largest power of two <= MAX_CHUNK dividing ``width``."""
    c = MAX_CHUNK
    while c > 1 and width % c:
        c //= 2
    return c


def finish_reason(parts_shape, widths, norm_weights) -> str | None:
    """Why :func:`split_finish` cannot take these operands (None: it can)."""
    if len(parts_shape) != 3:
        return f"the K parts must be [splits, rows, N], got shape {tuple(parts_shape)}"
    if sum(widths) != parts_shape[2]:
        return f"the output widths {tuple(widths)} do not add up to N={parts_shape[2]}"
    if len(norm_weights) != len(widths):
        return f"{len(norm_weights)} norm weights for {len(widths)} outputs"
    for j, (w, nw) in enumerate(zip(widths, norm_weights)):
        if chunk_of(w) < MIN_CHUNK:
            return f"output {j}: width {w} is not a multiple of {MIN_CHUNK}"
        if nw is not None and tuple(nw.shape) != (w,):
            return f"output {j}: norm weight of shape {tuple(nw.shape)}, expected ({w},)"
    return None


def _finish_kernel(*refs, splits, widths, normed, eps):
    """Program r: row r of every output."""
    nn = sum(normed)
    p_ref = refs[0]
    w_refs = list(refs[1:1 + nn])
    o_refs = refs[1 + nn:]
    r = pl.program_id(0)
    off = 0
    for j, width in enumerate(widths):
        o_ref = o_refs[j]
        cb = chunk_of(width)
        ys = []
        for c in range(width // cb):
            cols = pl.ds(off + c * cb, cb)
            acc = p_ref[0, r, cols]
            for s in range(1, splits):
                acc = acc + p_ref[s, r, cols]
            ys.append(acc.astype(o_ref.dtype))
        if normed[j]:
            w_ref = w_refs.pop(0)
            yf = [y.astype(jnp.float32) for y in ys]
            ss = functools.reduce(lambda a, b: a + b, [jnp.sum(y * y) for y in yf])
            rs = jax.lax.rsqrt(ss / width + eps)
            ys = [(w_ref[pl.ds(c * cb, cb)].astype(jnp.float32) * (y * rs)).astype(o_ref.dtype)
                  for c, y in enumerate(yf)]
        for c, y in enumerate(ys):
            o_ref[r, pl.ds(c * cb, cb)] = y
        off += width


FINISH_WARPS = 8  # warps per program (one program per row; the table above)


def split_finish(parts, widths, norm_weights, *, eps: float, out_dtype, interpret=False) -> list:
    """parts [S, M, N] float32 (the GEMV's K parts; N = sum of ``widths``) -> one [M, width_j]
    ``out_dtype`` array per output: ``y_j = round(sum_s parts[s, :, cols_j])``, and where
    ``norm_weights[j]`` is not None, ``round(w_j * y_j * rsqrt(mean(y_j^2) + eps))`` instead."""
    widths = tuple(int(w) for w in widths)
    norm_weights = list(norm_weights)
    reason = finish_reason(parts.shape, widths, norm_weights)
    if reason is not None:
        raise ValueError(f"split_finish (pallas): {reason}")
    splits, m, _ = parts.shape
    normed = tuple(nw is not None for nw in norm_weights)
    out_dtype = jnp.dtype(out_dtype)
    return list(pl.pallas_call(
        functools.partial(_finish_kernel, splits=splits, widths=widths, normed=normed, eps=float(eps)),
        out_shape=tuple(jax.ShapeDtypeStruct((m, w), out_dtype) for w in widths),
        grid=(m,),
        compiler_params=pltriton.CompilerParams(num_warps=FINISH_WARPS, num_stages=1),
        interpret=interpret,
        name="qmm_split_finish",
    )(parts.astype(jnp.float32), *[nw for nw in norm_weights if nw is not None]))
