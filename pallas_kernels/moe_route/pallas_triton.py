"""Pallas-Triton kernel: the router's selection in one launch per call.

XLA runs the selection after the router's logits as two kernels per MoE layer at decode: the
scores plus bias (a loop fusion, ~1.1 us on the H200) and ``jax.lax.top_k`` as a sort of the [N, E]
scores (~3.9 us for E = 96; session 21's batch-1 profile: 0.30 ms per step over 40 layers in the
"route" part, the logits' reduction included). Here one program per token row loads its E logits
(E padded to a power of two inside the program, the pad at -inf), computes the scores, picks the
top-k of ``scores + bias`` by k rounds of (argmax, the lowest index on ties; mask it out) -- the
order and tie rule of ``jax.lax.top_k`` -- gathers the weights, normalises them and writes [1, kp] of
each output. The logits stay an XLA reduction: at E = 384 the gate is 3.9 MB of bf16, a stream one
program could not read quickly.

Numerics: the scores are the reference's own function (:func:`.reference.scores`, traced into the
kernel); the normalising sum adds the k weights in order, the softmax sums over E in the kernel's
order. Weights agree with the reference to a few f32 ulps; the indices are the same unless two
biased scores are within that of each other.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)

from pallas_kernels.quantized_matmul.pallas_triton import next_pow2

from .reference import SCORE_FUNCS, scores

__all__ = ["route_select", "unsupported_reason", "auto_reason"]

MAX_EXPERTS = 4096  # one program holds a row of scores in registers

# Diagnostics, read at trace time (they located the multi-row race fixed in session 24: with the
# kernel at decode only the model was reproducible, with it on prompt chunks too it was not):
# DSV41_ROUTE_MAX_ROWS=N leaves calls with more than N token rows to the reference (e.g. 2: the
# kernel at decode only, prompt chunks on XLA); DSV41_ROUTE_WARPS=W sets the warps per program.
MAX_ROWS_ENV, WARPS_ENV = "DSV41_ROUTE_MAX_ROWS", "DSV41_ROUTE_WARPS"


def unsupported_reason(z, bias, topk: int, score_func: str) -> str | None:
    """None when the kernel supports these inputs, else a readable reason."""
    if z.ndim != 2:
        return f"router logits must be [N, E], got shape {tuple(z.shape)}"
    n, e = z.shape
    if z.dtype != jnp.float32:
        return f"router logits dtype {z.dtype} is not float32"
    if bias is None or tuple(bias.shape) != (e,):
        return f"bias shape {None if bias is None else tuple(bias.shape)} does not match E={e}"
    if score_func not in SCORE_FUNCS:
        return f"score_func {score_func!r} is not one of {', '.join(SCORE_FUNCS)}"
    if e > MAX_EXPERTS:
        return f"E={e} experts exceed the {MAX_EXPERTS} one program holds"
    if not 1 <= topk <= e:
        return f"topk={topk} must be in [1, E={e}]"
    if n < 1:
        return "no token rows"
    limit = os.environ.get(MAX_ROWS_ENV)
    if limit and n > int(limit):
        return f"{n} token rows exceed {MAX_ROWS_ENV}={limit}"
    return None


def auto_reason(z) -> str | None:
    """Why plain 'auto' does not pick this kernel on a GPU (None: pick it). On the H200 it takes
    2.4 µs against XLA's 6.6 µs (E = 96), and with it at decode only the batch-1 protocol ran at
    125.67 tok/s against 122.36, reproducibly (session 24). Its earlier form was wrong on the H200
    with more than one row (its [1, kp] output blocks on [N, topk] arrays, unmasked under jax 0.11.2:
    see :func:`route_select`), which is what made greedy decoding irreproducible in sessions 22-23.
    The fixed form has not yet been run on a GPU, so 'auto' keeps the reference until
    ``benchmark --check`` and a reproducibility probe pass with it."""
    del z
    return ("the fix of its multi-row race (session 24) has not been checked on a GPU yet; "
            "DSV41_KERNELS=auto,moe_route=pallas runs it")


def _kernel(z_ref, b_ref, w_ref, i_ref, *, e, ep, kp, topk, score_func, gate_temp, norm, scale):
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, ep), 1)
    valid = cols < e
    # the row's E logits and the bias, gathered at in-bounds columns (the pad lanes re-read column
    # E - 1 and are replaced below): a [1, ep] block on an [N, E] array would read past the row, and
    # jax 0.11.2 does not mask that (see route_select)
    safe = jnp.minimum(cols, e - 1)
    row = jnp.full((1, ep), pl.program_id(0), jnp.int32)
    z = z_ref[row, safe]
    b = b_ref[jnp.zeros((1, ep), jnp.int32), safe]
    # the reference's own formulas; the pad at -inf scores 0 (and the softmax's pad adds 0)
    s = scores(jnp.where(valid, z, -jnp.inf), score_func=score_func, gate_temp=gate_temp)
    sel = jnp.where(valid, s + b, -jnp.inf)
    kcols = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    picks, weights = [], []
    for _ in range(topk):  # k rounds: the largest, at its lowest index (lax.top_k's order and ties)
        # one (value, index) reduction: Pallas-Triton's argmax keeps the lower index on ties
        i = jnp.argmax(sel, axis=1).astype(jnp.int32)[:, None]  # [1, 1]
        hit = cols == i
        weights.append(jnp.sum(jnp.where(hit, s, 0.0), axis=1, keepdims=True))
        picks.append(i)
        sel = jnp.where(hit, -jnp.inf, sel)
    if norm and topk > 1:
        total = weights[0]
        for w in weights[1:]:
            total = total + w
        inv = 1.0 / (total + 1e-20)
        weights = [w * inv for w in weights]
    w_out = jnp.zeros((1, kp), jnp.float32)
    i_out = jnp.zeros((1, kp), jnp.int32)
    for t in range(topk):
        w_out = jnp.where(kcols == t, weights[t] * scale, w_out)
        i_out = jnp.where(kcols == t, picks[t], i_out)
    w_ref[...] = w_out
    i_ref[...] = i_out


def route_select(z, bias, *, topk: int, score_func: str, gate_temp: float, norm_topk_prob: bool,
                 route_scale: float, interpret: bool = False, num_warps: int | None = None):
    """z [N, E] f32, bias [E] -> (weights [N, topk] f32, indices [N, topk] int32): one program per
    row, [1, E] padded to a power of two in registers. Every block divides its array: the logits and
    the bias are read whole (memory space ANY) with in-bounds gathers, and the outputs are written
    [N, kp] (kp = topk rounded up to a power of two) and sliced to [N, topk] here. Before session 24
    they were [1, kp] blocks on [N, topk] arrays, which jax >= 0.12 masks at the edges but jax 0.11.2
    (the H200's) does not: each program's pad columns landed in the next row's first columns, a
    race that made the H200 results differ call to call (zeros in columns 0-1 of random rows) and
    the model's greedy decoding irreproducible (sessions 22-24)."""
    reason = unsupported_reason(z, bias, topk, score_func)
    if reason is not None:
        raise ValueError(f"moe_route (pallas): {reason}")
    n, e = z.shape
    ep, kp = next_pow2(max(e, 2)), next_pow2(max(topk, 2))
    if num_warps is None:
        num_warps = int(os.environ.get(WARPS_ENV) or (1 if ep <= 512 else 4))
    kernel = functools.partial(_kernel, e=e, ep=ep, kp=kp, topk=topk, score_func=score_func,
                               gate_temp=float(gate_temp), norm=bool(norm_topk_prob), scale=float(route_scale))
    w, idx = pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((1, kp), lambda r: (r, 0)), pl.BlockSpec((1, kp), lambda r: (r, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, kp), jnp.float32), jax.ShapeDtypeStruct((n, kp), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_route_select",
    )(z, bias.astype(jnp.float32).reshape(1, e))
    return (w, idx) if kp == topk else (w[:, :topk], idx[:, :topk])
