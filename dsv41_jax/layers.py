"""Small shared building blocks: RMSNorm and the linear layer (dispatching on the weight format)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import grouped_matmul, quantized_matmul, quantized_matmul_multi

from .quant import is_quantized


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``w * x * rsqrt(mean(x²) + eps)`` with fp32 statistics, cast back to x.dtype (eps 1e-20 in V4.1)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def weight_of(node):
    """A linear's weight node: an Fp8Tensor / Fp4Tensor, or the array of ``{"weight": array}``."""
    return node if is_quantized(node) else node["weight"]


def linear(x: jax.Array, node, *, act_block: int = 32, out_dtype=None, path: str | None = None,
           defer: bool = False) -> jax.Array:
    """DeepSeek's ``linear()``: FP8/FP4 weights get the FP8 activation fake-quant per ``act_block``;
    plain weights are a plain matmul. fp32 accumulation, output in ``out_dtype`` (default x.dtype).
    ``path``: the weight's name in the partition-rule table (``"attn.wq_b"``); under a mesh with
    ``tp`` the Pallas kernel then runs on each device's shard (``sharding.tensor_parallel``).
    ``defer``: the output may be a :class:`pallas_kernels.deferred_sum.DeferredSum` (the decode
    GEMV's K parts) for a consumer that sums them (the mHC expansion); never under ``tp``."""
    w = weight_of(node)
    if path is not None:
        from sharding.tensor_parallel import tp_linear

        y = tp_linear(x, w, path=path, act_block=act_block, out_dtype=out_dtype)
        if y is not None:
            return y
    return quantized_matmul(x, w, act_block=act_block, out_dtype=out_dtype, defer=defer)


def linear_multi(x: jax.Array, nodes, *, act_block: int = 32, out_dtype=None, paths=None, norms=None,
                 norm_eps: float = 0.0) -> list:
    """``[linear(x, node) for node in nodes]`` (same values) for linear layers that read the same input:
    at decode sizes one kernel launch computes them all (``quantized_matmul_multi``). ``paths``: each
    weight's partition-rule name, as for :func:`linear`; under a ``tp`` mesh weights with a path keep
    their own tensor-parallel calls. ``norms``: per layer an RMSNorm node (``{"weight": [N]}``) or
    None; that output is then ``norm(linear(x, node), norms[j], norm_eps)`` (on the GPU at decode sizes
    normalized by the GEMV's split-K finish kernel)."""
    norms = list(norms) if norms is not None else [None] * len(nodes)
    paths = list(paths) if paths is not None else [None] * len(nodes)
    if any(p is not None for p in paths):
        from sharding.tensor_parallel import tp_active

        if tp_active():
            ys = [linear(x, n, act_block=act_block, out_dtype=out_dtype, path=p) for n, p in zip(nodes, paths)]
            return [y if nn is None else norm(y, nn, norm_eps) for y, nn in zip(ys, norms)]
    return quantized_matmul_multi(x, [weight_of(n) for n in nodes], act_block=act_block, out_dtype=out_dtype,
                                  norms=[None if nn is None else nn["weight"] for nn in norms], norm_eps=norm_eps)


def grouped_linear(x: jax.Array, node, *, groups: int) -> jax.Array:
    """The grouped low-rank output projection (``wo_a``): x [..., G, K] against the weight's G
    row groups, ``y[..., g, :] = x[..., g, :] @ W_g.T`` -> [..., G, N] in x.dtype, fp32 accumulation,
    **no** activation fake-quant (DeepSeek's einsum with the dequantized weight). Decode sizes run
    one Pallas launch over every group (``grouped_matmul``)."""
    return grouped_matmul(x, weight_of(node), groups=groups)


def norm(x, node, eps):
    return rms_norm(x, node["weight"], eps)
