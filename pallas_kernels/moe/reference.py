"""Pure-jnp definition of the routed experts (``shared/spec/model.md`` §5.3-5.4).

Per (token n, slot s) with expert e = indices[n, s] and routing weight w = weights[n, s]:
``g = linear(x, W1_e)``, ``u = linear(x, W3_e)`` (bf16 GEMM outputs, then f32);
``u = clip(u, -L, L)``, ``g = min(g, L)`` when L = swiglu_limit > 0; ``h = w * silu(g) * u`` (f32);
``y[n] += linear(h.astype(x.dtype), W2_e)`` accumulated in f32. ``linear`` is
:func:`pallas_kernels.quantized_matmul.reference.quantized_matmul` (activation fake-quant for
quantized experts).

A negative index means "no expert": that (token, slot) pair contributes nothing (expert
parallelism marks the pairs routed to other shards this way, so the kernels skip their weights).

Two evaluation orders with identical results: for few (token, slot) pairs the experts' weights are
gathered per pair; otherwise every expert runs once over all tokens with per-token coefficients
(tokens that did not pick it get h = 0, which contributes exactly 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.quant import exact_f32
from pallas_kernels.quantized_matmul.reference import quantized_matmul


def _swiglu(g, u, limit):
    # the bf16 GEMM outputs' own values (exact_f32): XLA's GPU compiler otherwise kept the dots' f32
    # sums here, and h's FP8 act-quant turned that into 1.7e-2 against the kernels (session 18)
    g = exact_f32(g)
    u = exact_f32(u)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def _take(w, e):
    return jax.tree.map(lambda a: a[e], w)


def _one_expert(x, coef, w1, w2, w3, limit, act_block):
    g = quantized_matmul(x, w1, act_block=act_block)
    u = quantized_matmul(x, w3, act_block=act_block)
    h = _swiglu(g, u, limit) * coef[:, None]
    # each expert's down projection is a GEMM with output in x.dtype, accumulated in f32 by the caller
    return exact_f32(quantized_matmul(h.astype(x.dtype), w2, act_block=act_block))


def moe_experts(x, weights, indices, w1, w2, w3, *, swiglu_limit, act_block=32, path=None):
    n, k = indices.shape
    n_exp = jax.tree.leaves(w1)[0].shape[0]
    if path is None:
        path = "gather" if n * k * 4 <= n_exp else "scan"
    weights = jnp.where(indices >= 0, weights.astype(jnp.float32), 0.0)  # index < 0: no expert
    if path == "gather":
        def per_pair(xv, wv, e):
            return _one_expert(xv[None], wv[None], _take(w1, e), _take(w2, e), _take(w3, e),
                               swiglu_limit, act_block)[0]
        ys = jax.vmap(jax.vmap(per_pair, in_axes=(None, 0, 0)), in_axes=(0, 0, 0))(x, weights, jnp.maximum(indices, 0))
        return jnp.sum(jnp.where((indices >= 0)[:, :, None], ys, 0.0), axis=1)

    def step(acc, e):
        coef = jnp.sum(jnp.where(indices == e, weights, 0.0), axis=1)
        y = _one_expert(x, coef, _take(w1, e), _take(w2, e), _take(w3, e), swiglu_limit, act_block)
        return acc + y, None

    y, _ = jax.lax.scan(step, jnp.zeros((n, x.shape[-1]), jnp.float32), jnp.arange(n_exp))
    return y
