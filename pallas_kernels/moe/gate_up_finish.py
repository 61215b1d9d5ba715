"""The fused MoE's gate/up epilogue, and its split-K finish.

The gate/up kernel ends each (pair, I-row) with the reference's rounding and activation:
``g, u`` (fp32 sums) rounded to the activation dtype, ``u = clip(u, -L, L)``, ``g = min(g, L)``,
``h = silu(g) * u * w_route`` rounded to the activation dtype. :func:`swiglu_h` is that arithmetic,
written once for the kernel's epilogue, the split finish kernel and its XLA twin.

With a K split (the fma config's 9th entry, ``splits > 1``) the gate/up programs store their fp32
partial sums instead, ``parts [splits, 2, rows, I]`` (index 0: the w1 / gate sums, 1: the w3 / up
sums), and one small kernel after them adds the splits in order (``s = 0, 1, ...``), applies
:func:`swiglu_h` and fake-quantizes h per K group into the phase layout the down kernel reads: it
replaces the act-quant prologue that ran there anyway (``fma.act_quant_view``), so the split costs
no extra launch. Why split: at one token the unsplit gate/up grid is 6 x 144 programs of 10 K steps
on 132 SMs x 5 resident programs (1.31 waves; BENCHMARKS.md, issue 6, session 28).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.deferred_sum import sum_splits
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma


def swiglu_h(g, u, w, x_dtype, limit: float):
    """fp32 gate / up sums ``g``, ``u`` and the routing weight ``w`` (broadcastable) -> fp32 h, its
    value rounded to ``x_dtype`` (the reference's rounding of each GEMM output and of h)."""
    g = g.astype(x_dtype).astype(jnp.float32)
    u = u.astype(x_dtype).astype(jnp.float32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return (g * jax.nn.sigmoid(g) * u * w).astype(x_dtype).astype(jnp.float32)


def finish_reference(parts, weights, x_dtype, limit: float):
    """XLA finish: ``parts [S, 2, R, I]`` f32, ``weights [R]`` f32 -> h [R, I] in ``x_dtype``."""
    g = sum_splits([parts[s, 0] for s in range(parts.shape[0])])
    u = sum_splits([parts[s, 1] for s in range(parts.shape[0])])
    return swiglu_h(g, u, weights[:, None], x_dtype, limit).astype(x_dtype)


# How the finish kernel is written (read at trace time): "order" "uses" loads each phase's partial
# sums right before using them, "loads" issues every load of the program before the first
# arithmetic (as the mHC expansion kernel's EXPAND_MIX, session 27); "warps" per program. The two
# orders give the same bits. H200, session 29, inside the one-token MoE (384 experts; BENCHMARKS.md,
# issue 6): uses/4 2.74 us, loads/4 2.72, uses/2 2.49, loads/2 2.50, uses/1 2.23, loads/1 2.25 (same
# bits each). One warp per program is the default since session 29 (session 28's: 4).
FINISH = {"order": "uses", "warps": 1}


def _finish_view_kernel(p_ref, wt_ref, *out_refs, splits, rows, nph, per, nb, x_dtype, limit, f16=False):
    """Program (r, c): row r, K groups [c*nb, +nb) of the partials [S * 2 * R, I/G, G] (row
    ``(2 s + t) R + r``: split s, t = 0 gate / 1 up) -> h, then its act-quant per group, stored as
    the ``nph`` phases (as ``fma._act_quant_view_kernel``)."""
    r = pl.program_id(0)
    b0 = pl.multiple_of(pl.program_id(1) * nb, nb)
    cols = fma.phase_cols(nph, per)
    w = wt_ref[r]

    def load(c):
        return ([p_ref[2 * s * rows + r, pl.ds(b0, nb), c] for s in range(splits)],
                [p_ref[(2 * s + 1) * rows + r, pl.ds(b0, nb), c] for s in range(splits)])

    loaded = [load(c) for c in cols] if FINISH["order"] == "loads" else None
    phases = []
    for i, c in enumerate(cols):
        gl, ul = loaded[i] if loaded is not None else load(c)
        phases.append(swiglu_h(sum_splits(gl), sum_splits(ul), w, x_dtype, limit))
    fma.store_view(out_refs, r, b0, nb, fma.quant_phases(phases, f16=f16), f16)


def finish_act_quant_view(parts, weights, w, *, x_dtype, limit: float, interpret=False, f16=False):
    """``fma.act_quant_view(finish_reference(parts, weights, ...), w)`` in one Pallas launch:
    ``parts [S, 2, R, I]`` f32, ``weights [R]`` f32 -> the act-quantized h as the down kernel's
    phases (float32; with ``f16`` the float16 view of ``fma.F16ACC``)."""
    splits, two, rows, i_dim = parts.shape
    if two != 2:
        raise ValueError(f"finish_act_quant_view: parts must be [splits, 2, rows, I], got {parts.shape}")
    g = fma.group_size(w)
    nph, per = fma._phase_layout(w)
    groups = i_dim // g
    nb = fma.view_groups_per_program(groups)
    outs = pl.pallas_call(
        functools.partial(_finish_view_kernel, splits=splits, rows=rows, nph=nph, per=per, nb=nb, x_dtype=x_dtype,
                          limit=float(limit), f16=f16),
        out_shape=fma.view_shapes(rows, groups, nph, per, f16),
        grid=(rows, groups // nb),
        compiler_params=pltriton.CompilerParams(num_warps=FINISH["warps"], num_stages=1),
        interpret=interpret,
        name="moe_gate_up_finish",
    )(parts.reshape(splits * 2 * rows, groups, g), weights.astype(jnp.float32))
    return tuple(outs)
