"""Pallas-Triton kernel: the router's selection in one launch per call.

XLA runs the selection after the router's logits as two kernels per MoE layer at decode: the
scores plus bias (a loop fusion, ~1.1 us on the H200) and ``jax.lax.top_k`` as a sort of the [N, E]
scores (~3.9 us for E = 96; session 21's batch-1 profile: 0.30 ms per step over 40 layers in the
"route" part, the logits' reduction included). Here one program per token row loads its E logits
(E padded to a power of two inside the program, the pad at -inf), computes the scores, picks the
top-k of ``scores + bias`` by k rounds of (argmax, the lowest index on ties; mask it out) -- the
order and tie rule of ``jax.lax.top_k`` -- gathers the weights, normalises them and writes [1, k] of
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

# Diagnostics for the irreproducibility seen with this kernel in the model (session 22-23), read at
# trace time: DSV41_ROUTE_MAX_ROWS=N leaves calls with more than N token rows to the reference (e.g.
# 2: the kernel at decode only, prompt chunks on XLA); DSV41_ROUTE_WARPS=W sets the warps per program.
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
    """Why plain 'auto' does not pick this kernel on a GPU (None: pick it). On the H200 (session 22)
    it passed its check (indices equal, weights within 16 f32 ulps of the reference) and took
    2.36 µs against XLA's 6.39 µs (E = 96), -0.033 ms per 7-layer decode step. But with it the
    model's greedy tokens changed from run to run within one process (3 distinct outputs in 3
    runs of 256 tokens), while the same runs without it were identical every time, so 'auto' keeps
    the reference until that is explained (``benchmark --check`` now repeats each call to catch it)."""
    del z
    return ("greedy decoding was not reproducible run to run with it on the H200 (session 22); "
            "DSV41_KERNELS=auto,moe_route=pallas runs it")


def _kernel(z_ref, b_ref, w_ref, i_ref, *, e, ep, kp, topk, score_func, gate_temp, norm, scale):
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, ep), 1)
    valid = cols < e
    # the reference's own formulas; the pad at -inf scores 0 (and the softmax's pad adds 0)
    s = scores(jnp.where(valid, z_ref[...], -jnp.inf), score_func=score_func, gate_temp=gate_temp)
    sel = jnp.where(valid, s + b_ref[...], -jnp.inf)
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
    row, [1, E] padded to a power of two in registers (blocks larger than the arrays: Pallas masks
    the loads and stores at the edges)."""
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
        in_specs=[pl.BlockSpec((1, ep), lambda r: (r, 0)), pl.BlockSpec((1, ep), lambda r: (0, 0))],
        out_specs=[pl.BlockSpec((1, kp), lambda r: (r, 0)), pl.BlockSpec((1, kp), lambda r: (r, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, topk), jnp.float32), jax.ShapeDtypeStruct((n, topk), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_route_select",
    )(z, bias.astype(jnp.float32).reshape(1, e))
    return w, idx
