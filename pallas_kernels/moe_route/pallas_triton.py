"""Pallas-Triton kernel: the router's selection in one launch per call.

XLA runs the selection after the router's logits as two kernels per MoE layer at decode: the
scores plus bias (a loop fusion, ~1.1 us on the H200) and ``jax.lax.top_k`` as a sort of the [N, E]
scores (~3.9 us for E = 96; session 21's batch-1 profile: 0.30 ms per step over 40 layers in the
"route" part, the logits' reduction included). Here one program per token row loads its E logits
(E padded to a power of two inside the program, the pad at -inf), computes the scores, picks the
top-k of ``scores + bias`` by k rounds of (argmax, the lowest index on ties; mask it out) -- the
order and tie rule of ``jax.lax.top_k`` -- gathers the weights, normalises them and writes its k picks of
each output as scalars. The logits stay an XLA reduction: at E = 384 the gate is 3.9 MB of bf16, a stream one
program could not read quickly.

Numerics: the scores are the reference's own function (:func:`.reference.scores`, traced into the
kernel); the normalising sum adds the k weights in order, the softmax sums over E in the kernel's
order. Weights agree with the reference to a few f32 ulps; the indices are the same unless two
biased scores are within that of each other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)

from pallas_kernels.quantized_matmul.pallas_triton import next_pow2

from .reference import SCORE_FUNCS, scores

__all__ = ["route_select", "unsupported_reason", "auto_reason"]

MAX_EXPERTS = 4096  # one program holds a row of scores in registers


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
    return None


def auto_reason(z) -> str | None:
    """Why plain 'auto' does not pick this kernel on a GPU (None: pick it). On the H200 (session 25)
    this form passed ``benchmark`` at every size (N = 1 ... 4096, E = 96 and 384: equal to the
    reference, 50 identical calls bit-identical), 2.3-3.5 µs against XLA's 6.5-10 µs up to 64 rows;
    with it the batch-1 protocol ran at 126.21 tok/s against 122.36 (session 24), every run the
    same greedy output, as the 7-layer probe with the kernel on prompt chunks too."""
    del z
    return None


def _kernel(z_ref, b_ref, w_ref, i_ref, *, e, ep, topk, score_func, gate_temp, norm, scale):
    r = pl.program_id(0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (ep,), 0)
    valid = cols < e
    # the row's E logits and the bias, gathered at in-bounds offsets of the flat arrays (the pad
    # lanes re-read column E - 1 and are replaced below): no block reaches past the row
    safe = jnp.minimum(cols, e - 1)
    z = z_ref[r * e + safe]
    b = b_ref[safe]
    # the reference's own formulas; the pad at -inf scores 0 (and the softmax's pad adds 0)
    s = scores(jnp.where(valid, z, -jnp.inf), score_func=score_func, gate_temp=gate_temp)
    sel = jnp.where(valid, s + b, -jnp.inf)
    picks, weights = [], []
    for _ in range(topk):  # k rounds: the largest, at its lowest index (lax.top_k's order and ties)
        # one (value, index) reduction: Pallas-Triton's argmax keeps the lower index on ties
        i = jnp.argmax(sel, axis=0).astype(jnp.int32)
        hit = cols == i
        weights.append(jnp.sum(jnp.where(hit, s, 0.0)))
        picks.append(i)
        sel = jnp.where(hit, -jnp.inf, sel)
    if norm and topk > 1:
        total = weights[0]
        for w in weights[1:]:
            total = total + w
        inv = 1.0 / (total + 1e-20)
        weights = [w * inv for w in weights]
    # 2 k scalar stores into the flat [N * topk] outputs: each address is written once, by its row
    for t in range(topk):
        w_ref[r * topk + t] = weights[t] * scale
        i_ref[r * topk + t] = picks[t]


def route_select(z, bias, *, topk: int, score_func: str, gate_temp: float, norm_topk_prob: bool,
                 route_scale: float, interpret: bool = False, num_warps: int | None = None):
    """z [N, E] f32, bias [E] -> (weights [N, topk] f32, indices [N, topk] int32): one program per
    row, its E scores padded to a power of two in registers. No block reaches past its array: the
    logits, the bias and the outputs are whole flat arrays (memory space ANY); each program gathers
    its row at in-bounds offsets and writes its k picks as scalars, and the [N * topk] outputs are
    reshaped (a bitcast) here. Before session 24 the outputs were [1, kp] blocks on [N, topk]
    arrays, which jax >= 0.12 masks at the edges but jax 0.11.2 (the H200's) does not: each
    program's pad columns landed in the next row's first columns, a race that made the H200 results
    differ call to call and the model's greedy decoding irreproducible (sessions 22-24). Session 24's
    fix wrote [N, kp] and sliced it in XLA, which at decode cost two device copies per layer
    (0.07 ms per batch-1 step, session 25's profile)."""
    reason = unsupported_reason(z, bias, topk, score_func)
    if reason is not None:
        raise ValueError(f"moe_route (pallas): {reason}")
    n, e = z.shape
    ep = next_pow2(max(e, 2))
    if num_warps is None:
        num_warps = 1 if ep <= 512 else 4
    kernel = functools.partial(_kernel, e=e, ep=ep, topk=topk, score_func=score_func,
                               gate_temp=float(gate_temp), norm=bool(norm_topk_prob), scale=float(route_scale))
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    w, idx = pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[anyspec, anyspec],
        out_specs=[anyspec, anyspec],
        out_shape=[jax.ShapeDtypeStruct((n * topk,), jnp.float32), jax.ShapeDtypeStruct((n * topk,), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_route_select",
    )(z.reshape(n * e), bias.astype(jnp.float32).reshape(e))
    return w.reshape(n, topk), idx.reshape(n, topk)
