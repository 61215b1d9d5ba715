"""Fake-quantizers (quantize, then dequantize back into the input dtype), block-wise along the last
dimension, with the exact scale rules of DeepSeek's kernels (``shared/spec/attention.md`` §2.3):

* ``Q8`` (:func:`fake_quant_fp8`): ``a = max(amax, 1e-4)``, ``s = 2**ceil(log2(a/448))`` (ue8m0),
  ``y = e4m3(clip(x/s, ±448))``. Used for the window KV (block 32, all 512 dims in V4.1) and for
  every activation entering an FP8/FP4 GEMM (:func:`act_quant`, block 32 in V4.1, 128 in V4).
* ``Q4e8`` (:func:`fake_quant_mxfp4`): ``a = max(amax, 6·2**-126)``, ``s = 2**ceil(log2(a/6))``,
  ``y = e2m1(clip(x/s, ±6))``. Indexer q and k, block 32.
* ``Q4e4`` (:func:`fake_quant_fp4_e4m3`): ``a = max(amax, 6·2**-9)``, ``s = e4m3(a/6)`` (round to
  nearest, not ceil: |x/s| may exceed 6 and then saturates), ``y = e2m1(clip(x/s, ±6))``.
  V4.1's compressed KV, block 16.

Every dequantized value is exactly representable in bf16, so writing it back loses nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .codecs import (E2M1_MAX, E4M3_MAX, ceil_pow2_exponent, e2m1_decode, e2m1_encode, e2m1_encode_scaled,
                     e4m3_round, e4m3_round_quotient, exact_f32, pow2)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantization block {block}")
    # the bf16 input's own value even where XLA's GPU compiler kept its producer's f32 (exact_f32)
    return exact_f32(x).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_block_scale(amax: jax.Array) -> jax.Array:
    """ue8m0 scale exponent for FP8 e4m3 blocks with absolute maximum ``amax`` (float32)."""
    return ceil_pow2_exponent(jnp.maximum(amax, 1e-4), E4M3_MAX)


def mxfp4_block_scale(amax: jax.Array) -> jax.Array:
    """ue8m0 scale exponent for MXFP4 blocks."""
    return ceil_pow2_exponent(jnp.maximum(amax, E2M1_MAX * 2.0**-126), E2M1_MAX)


def fp4_e4m3_block_scale(amax: jax.Array) -> jax.Array:
    """float32 e4m3-valued scale for FP4 blocks with an e4m3 scale (round to nearest)."""
    return e4m3_round_quotient(jnp.maximum(amax, E2M1_MAX * 2.0**-9), E2M1_MAX)


def fake_quant_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """Q8: FP8 e4m3 with a power-of-two scale per ``block`` elements of the last dim."""
    xb = _blocks(x, block)
    e = fp8_block_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True))
    y = e4m3_round(xb * pow2(-e))  # x / 2**e is exact
    return (y * pow2(e)).reshape(x.shape).astype(x.dtype)


def fake_quant_mxfp4(x: jax.Array, block: int = 32) -> jax.Array:
    """Q4e8: FP4 e2m1 with a power-of-two (e8m0) scale per ``block`` elements."""
    xb = _blocks(x, block)
    e = mxfp4_block_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True))
    y = e2m1_decode(e2m1_encode(jnp.clip(xb * pow2(-e), -E2M1_MAX, E2M1_MAX)))
    return (y * pow2(e)).reshape(x.shape).astype(x.dtype)


def fake_quant_fp4_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """Q4e4: FP4 e2m1 with an e4m3 scale per ``block`` elements."""
    xb = _blocks(x, block)
    s = fp4_e4m3_block_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True))
    y = e2m1_decode(e2m1_encode_scaled(xb, s))  # RNE of clip(x / s, ±6), without dividing
    return (y * s).reshape(x.shape).astype(x.dtype)


def act_quant(x: jax.Array, block: int = 32) -> jax.Array:
    """The activation fake-quant the reference applies before every FP8/FP4-weight GEMM: real FP8
    e4m3 activations with a ue8m0 scale per ``block`` elements along K. The GEMM's result equals
    ``act_quant(x) @ dequant(W).T`` up to fp32 summation order."""
    return fake_quant_fp8(x, block)
