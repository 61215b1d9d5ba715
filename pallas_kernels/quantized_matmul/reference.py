"""Pure-jnp definition of DeepSeek's ``linear()`` (``shared/spec/model.md`` §2, §10.5).

* Quantized weight (FP8 or FP4): the activation is quantized to FP8 e4m3 with a ue8m0 scale per
  ``act_block`` elements along K (real FP8 activations in the reference kernels); the GEMM
  accumulates ``sum s_a s_w q_a q_w`` in fp32. Here: fake-quantize x, dequantize W (both exact in
  bf16), one dot with fp32 accumulation — equal up to summation order.
* Plain weight: an ordinary matmul with fp32 accumulation.
The result is cast to ``out_dtype`` (default: x.dtype), as the reference's bf16 GEMM output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.quant import act_quant, is_quantized


def _operand_dtype(x):
    return jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32


def quantized_matmul(x, w, *, act_block=32, out_dtype=None):
    out_dtype = out_dtype or x.dtype
    op = _operand_dtype(x)
    if is_quantized(w):
        xq = act_quant(x, act_block).astype(op)
        wf = w.dequantize(op)
    else:
        xq = x.astype(op)
        wf = jnp.asarray(w).astype(op)
    y = jnp.einsum("...k,nk->...n", xq, wf, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def grouped_matmul(x, w, *, groups, out_dtype=None):
    """V4's grouped low-rank projection (``wo_a``): x [..., G, K], w [G*N, K] (group-major rows) ->
    [..., G, N] with ``y[..., g, :] = x[..., g, :] @ W_g.T``. No activation fake-quant: the reference
    dequantizes the weight (exact in bf16) and multiplies the activation as it is, fp32 accumulation."""
    out_dtype = out_dtype or x.dtype
    op = _operand_dtype(x)
    wf = w.dequantize(op) if is_quantized(w) else jnp.asarray(w).astype(op)
    wf = wf.reshape(groups, wf.shape[0] // groups, wf.shape[1])
    y = jnp.einsum("...gk,gnk->...gn", x.astype(op), wf, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def rms_norm(y, weight, eps):
    """The model's RMSNorm (:func:`dsv41_jax.layers.rms_norm`, imported here when called: that module
    imports this package) on a GEMM output, as ``quantized_matmul_multi``'s ``norms`` apply it."""
    from dsv41_jax.layers import rms_norm as model_rms_norm

    return model_rms_norm(y, weight, eps)
