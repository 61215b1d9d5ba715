"""A Pallas-Triton kernel that only reads: the measured streaming ceiling beside the byte floors.

The weight-streaming targets (issue 6: FP8 GEMV >= 75 % of HBM, MoE <= 40 us at one token) are
fractions of the H200's datasheet bandwidth (4.8 TB/s), and the byte floor of every benchmark row is
bytes / 4.8 TB/s. What a kernel of this toolchain can stream at a given size is a different number:
the ramp of a one-wave grid, the tail, and the loads a program keeps in flight all cost time that
no arithmetic causes. This kernel measures that number. It walks a weight's uint32 words exactly as
the fma GEMV walks them (:mod:`pallas_kernels.quantized_matmul.pallas_triton_fma`: programs of
``bn`` rows, ``kg`` K groups per step, the K steps split over ``splits`` programs, the same warps and
stages) and does one integer add per word, so the time is the loads' alone; other tilings give the
best a read of those bytes reaches. Each program writes its rows' word sums (mod 2**32), which
:func:`reference` reproduces exactly, so no load can be dropped by the compiler unnoticed.

Not a model op: only benchmarks use it (``quantized_matmul.benchmark --read-ceiling``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def unsupported_reason(shape, config) -> str | None:
    """Why :func:`stream_read` cannot walk words of ``shape`` [N, G, C] with ``config`` (None: it can)."""
    if len(shape) != 3:
        return f"words must be [N, groups, words per group], got shape {tuple(shape)}"
    n, groups, c = shape
    bn, kg, splits, warps, stages = config
    if min(bn, kg, splits, warps, stages) < 1:
        return f"config {config}: every entry must be >= 1"
    if n % bn:
        return f"N={n} must be a multiple of bn={bn}"
    if groups % (kg * splits):
        return f"{groups} groups must split into {splits} x (a multiple of kg={kg})"
    if c & (c - 1) or bn & (bn - 1) or kg & (kg - 1):
        return f"bn={bn}, kg={kg} and the {c} words per group must be powers of two (Triton block shapes)"
    return None


def _read_kernel(w_ref, o_ref, *, bn, kg, steps):
    i_n = pl.program_id(0)
    i_s = pl.program_id(1)
    row0 = pl.multiple_of(i_n * bn, bn)
    gbase = i_s * (steps * kg)

    def body(i, acc):
        g0 = pl.multiple_of(gbase + i * kg, kg)
        return acc + w_ref[pl.ds(row0, bn), pl.ds(g0, kg), :]

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, kg, w_ref.shape[2]), jnp.uint32))
    o_ref[i_s, pl.ds(row0, bn)] = jnp.sum(jnp.sum(acc, axis=2), axis=1)


def stream_read(words, config, *, interpret=False):
    """words [N, G, C] uint32, config (bn, kg, splits, warps, stages) -> [splits, N] uint32: for each
    K part (``G / splits`` groups) and row, the sum of its words mod 2**32, read in the fma GEMV's
    tile walk (one launch, grid N/bn x splits)."""
    reason = unsupported_reason(words.shape, config)
    if reason is not None:
        raise ValueError(f"stream_read: {reason}")
    if words.dtype != jnp.uint32:
        raise ValueError(f"stream_read: words must be uint32, got {words.dtype}")
    n, groups, _ = words.shape
    bn, kg, splits, warps, stages = config
    return pl.pallas_call(
        functools.partial(_read_kernel, bn=bn, kg=kg, steps=groups // kg // splits),
        out_shape=jax.ShapeDtypeStruct((splits, n), jnp.uint32),
        grid=(n // bn, splits),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="stream_read",
    )(words)


def reference(words, splits: int):
    """:func:`stream_read`'s result in XLA: [splits, N] uint32 word sums (mod 2**32) per K part."""
    n, groups, c = words.shape
    return jnp.sum(words.reshape(n, splits, groups // splits * c), axis=2, dtype=jnp.uint32).T


def words_of(w):
    """An FP8 or MXFP4 weight's codes as the [N, G, C] uint32 words the fma GEMV reads: its
    ``weight_view`` under the word route (G = K groups of one scale, C = words per group)."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    with fma.use_decode_route("f16w"):
        return fma.weight_view(w)[0]


def gemv_walk(fma_config) -> tuple:
    """The read config that walks a weight as the fma GEMV config ("fma", bn, kg, splits, warps,
    stages) does."""
    _, bn, kg, splits, warps, stages = fma_config
    return (bn, kg, splits, warps, stages)


def variants(shape, walk) -> list:
    """Read configs around ``walk`` for words of ``shape``: the walk itself, then other stages, warps,
    row tiles, step widths and K splits (each only where :func:`unsupported_reason` allows it)."""
    bn, kg, splits, warps, stages = walk
    n, groups, _ = shape
    cands = [walk, (bn, kg, splits, warps, 1), (bn, kg, splits, warps, 4), (bn, kg, splits, 8, stages),
             (bn, kg, splits, 2, stages), (2 * bn, kg, splits, 8, stages), (bn, 2 * kg, splits, warps, stages),
             (bn, 2 * kg, splits, 8, stages), (bn // 2, kg, splits, warps, stages)]
    steps = groups // kg
    cands += [(bn, kg, s, warps, stages) for s in (2 * splits, 4 * splits) if steps % s == 0
              and (n // bn) * s <= 16 * 132]
    out = []
    for c in cands:
        if c not in out and c[0] >= 1 and unsupported_reason(shape, c) is None:
            out.append(c)
    return out
