"""Pure-jnp definition of the decode-time window KV write (``shared/spec/attention.md``: the KV
latent's RMSNorm, RoPE on its last ``rope_dim`` dims, FP8 e4m3 with a ue8m0 scale per 32 values,
written into ring slot ``pos % W``): exactly the model's path, composed from its own functions."""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.layers import rms_norm
from dsv41_jax.quant import Fp8Tensor, quantize_fp8
from dsv41_jax.rope import apply_rope


def window_kv_write(kv_lat, norm_weight, angles, ring: Fp8Tensor, slot, *, eps: float):
    """kv_lat [B, D] (one token per row, bf16), norm_weight [D], angles [B, R/2] f32 (the token's
    RoPE angles), ring: Fp8Tensor (data [B, W, D] e4m3, scale [B, W, D/32] e8m0, block (1, 32)),
    slot [B] int32 (a slot >= W leaves that row's ring unchanged: an idle row) -> the new ring."""
    kv = apply_rope(rms_norm(kv_lat, norm_weight, eps), angles)
    token = quantize_fp8(kv, (1, 32))
    b = jnp.arange(kv_lat.shape[0])

    def put(a, r):
        return a.at[b, slot].set(r.astype(a.dtype), mode="drop")
    return Fp8Tensor(data=put(ring.data, token.data), scale=put(ring.scale, token.scale), block=ring.block)
