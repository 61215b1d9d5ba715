"""Pallas-Triton kernel: the decode-time window KV write in one launch per layer.

At batch-1 decode XLA runs this path as five kernels per layer on the H200 (session 21's profile:
the RMS sum, the norm + RoPE + block amax, the ue8m0 scales, the FP8 data scattered into the ring,
the scales scattered; ~6.5 us per layer together, ~0.26 ms per step). Here one program per row
does all of it and stores the token's 512 bytes and 16 scale bytes into the ring in place (the
ring is aliased in -> out).

Per row, on a [D] vector (no reshapes of non-power-of-two parts): RMSNorm in f32, rounded to
bf16 (the reference's ``rms_norm`` output dtype); RoPE pairs (2i, 2i+1) of the last ``R`` dims,
each element's partner loaded as a second vector (index ``i ^ 1``), with the cos / sin XLA already
computed for the reference's ``apply_rope``, rounded to bf16; then the (1, 32) FP8 quantization:
``e = ceil(log2(max(amax, 1e-4) / 448))`` from amax's bits (``fp8_block_scale``, as the reference),
``q = e4m3(clip(x * 2**-e, ±448))`` by the hardware convert (RNE, as ``e4m3_round``).

Numerics: identical formulas; the RMS sum over D may add in another order than XLA's reduction,
so an element can land one bf16 ulp away, and after the FP8 rounding one e4m3 step away
(tests: dequantized rows within one e4m3 step, nearly all bytes equal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp8Tensor
from dsv41_jax.quant.codecs import E4M3_MAX, pow2
from dsv41_jax.quant.fake_quant import fp8_block_scale
from pallas_kernels.quantized_matmul.pallas_triton import next_pow2
from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)

__all__ = ["window_kv_write", "unsupported_reason", "auto_reason"]


def unsupported_reason(kv_lat, norm_weight, angles, ring, slot) -> str | None:
    """None when the kernel supports these inputs, else a readable reason."""
    if kv_lat.ndim != 2:
        return f"kv_lat must be [B, D] (one token per row), got shape {tuple(kv_lat.shape)}"
    b, d = kv_lat.shape
    if not isinstance(ring, Fp8Tensor) or tuple(ring.block) != (1, 32):
        return "the window ring must be an Fp8Tensor with block (1, 32) (V4.1's quantized window)"
    if ring.data.dtype != jnp.float8_e4m3fn or ring.data.ndim != 3 or ring.data.shape[0] != b or ring.data.shape[2] != d:
        return f"ring data {ring.data.dtype} {tuple(ring.data.shape)} is not e4m3 [B={b}, W, D={d}]"
    if next_pow2(d) != d or d < 64:
        return f"D={d} must be a power of two >= 64"
    if angles.ndim != 2 or angles.shape[0] != b or 2 * angles.shape[1] > d or next_pow2(angles.shape[1]) != angles.shape[1]:
        return f"angles shape {tuple(angles.shape)} is not [B={b}, R/2] with R/2 a power of two and R <= D"
    if tuple(norm_weight.shape) != (d,):
        return f"norm weight shape {tuple(norm_weight.shape)} is not [D={d}]"
    if tuple(slot.shape) != (b,):
        return f"slot shape {tuple(slot.shape)} is not [B={b}]"
    return None


def auto_reason(kv_lat) -> str | None:
    """Why plain 'auto' does not pick this kernel on a GPU (None: pick it). Picked: on the H200
    (session 22) its ring bytes equal the XLA reference's (``benchmark --check``), it takes 6.99 µs
    against XLA's 10.48 µs (7 kernels) in isolation, the 7-layer decode probe ran 0.036 ms per step
    faster with it, and its greedy tokens were bit-identical to the reference path's over three
    256-token runs."""
    del kv_lat
    return None


def _kernel(x_ref, w_ref, cos_ref, sin_ref, slot_ref, data_in, scale_in, data_ref, scale_ref, *, d, r, w, eps):
    del data_in, scale_in  # the same buffers as data_ref / scale_ref (aliased)
    b = pl.program_id(0)
    slot = slot_ref[b]

    @pl.when(slot < w)
    def _():
        cols = jnp.arange(d, dtype=jnp.int32)
        x = x_ref[cols].astype(jnp.float32)  # [D]
        xp = x_ref[cols ^ 1].astype(jnp.float32)  # each element's RoPE partner
        inv = jax.lax.rsqrt(jnp.sum(x * x) * (1.0 / d) + eps)
        y = (w_ref[cols].astype(jnp.float32) * (x * inv)).astype(jnp.bfloat16).astype(jnp.float32)
        yp = (w_ref[cols ^ 1].astype(jnp.float32) * (xp * inv)).astype(jnp.bfloat16).astype(jnp.float32)
        pair = jnp.clip((cols - (d - r)) // 2, 0, r // 2 - 1)
        c, s = cos_ref[pair], sin_ref[pair]
        even = (cols & 1) == 0
        a = jnp.where(even, y, yp)  # the pair's (a, b) = (x[2i], x[2i+1])
        bb = jnp.where(even, yp, y)
        rot = jnp.where(even, a * c - bb * s, a * s + bb * c).astype(jnp.bfloat16).astype(jnp.float32)
        v = jnp.where(cols >= d - r, rot, y).reshape(d // 32, 32)
        e = fp8_block_scale(jnp.max(jnp.abs(v), axis=1, keepdims=True))  # [D/32, 1]
        q = jnp.clip(v * pow2(-e), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
        data_ref[b, slot, pl.ds(0, d)] = q.reshape(d)
        scale_ref[b, slot, pl.ds(0, d // 32)] = jnp.clip(e + 127, 0, 254).astype(jnp.uint8).reshape(d // 32)


def window_kv_write(kv_lat, norm_weight, angles, ring: Fp8Tensor, slot, *, eps: float, interpret: bool = False):
    """See :func:`pallas_kernels.window_kv.reference.window_kv_write`; one program per row."""
    reason = unsupported_reason(kv_lat, norm_weight, angles, ring, slot)
    if reason is not None:
        raise ValueError(f"window_kv_write (pallas): {reason}")
    bsz, d = kv_lat.shape
    w = ring.data.shape[1]
    r = 2 * angles.shape[1]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # the reference's apply_rope computes the same
    scale_u8 = jax.lax.bitcast_convert_type(ring.scale, jnp.uint8)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    data, scale = pl.pallas_call(
        functools.partial(_kernel, d=d, r=r, w=w, eps=float(eps)),
        grid=(bsz,),
        in_specs=[pl.BlockSpec((None, d), lambda i: (i, 0)), pl.BlockSpec((d,), lambda i: (0,)),
                  pl.BlockSpec((None, r // 2), lambda i: (i, 0)), pl.BlockSpec((None, r // 2), lambda i: (i, 0)),
                  pl.BlockSpec((bsz,), lambda i: (0,)), any_spec, any_spec],
        out_specs=[any_spec, any_spec],
        out_shape=[jax.ShapeDtypeStruct(ring.data.shape, ring.data.dtype),
                   jax.ShapeDtypeStruct(scale_u8.shape, jnp.uint8)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="window_kv_write",
    )(kv_lat, norm_weight, cos, sin, slot.astype(jnp.int32), ring.data, scale_u8)
    return Fp8Tensor(data=data, scale=jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu), block=ring.block)
