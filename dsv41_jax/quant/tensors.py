"""Pytree types that keep quantized data and scales together, so weights and caches stay packed
in memory and are only dequantized (a block at a time) where they are used.

* :class:`Fp8Tensor` – e4m3 ``data`` with one e8m0 ``scale`` per ``block = (rows, cols)`` block of
  the last two dims. Linear weights use (32, 32) in V4.1 (128x128 in V4) and map onto the
  checkpoint's ``X.weight`` / ``X.scale``; row-wise data (the window KV cache, Engram table rows)
  use (1, 32).
* :class:`Fp4Tensor` – e2m1 codes packed two per byte in ``data`` (uint8, low nibble first) with one
  scale per ``block`` elements of the last dim: e8m0 for MXFP4 (experts, indexer keys; block 32),
  e4m3 for V4.1's compressed KV (block 16). ``packing`` "f16pairs" holds the same codes re-laid
  inside each 32-bit word for the GPU kernels' decode (:func:`~dsv41_jax.quant.codecs.repack_f16pairs`;
  the engine repacks the routed experts when the MoE kernels run); checkpoints hold "nibbles".

Leading dims (experts, batch, ...) are free. Both are ``flax.struct`` dataclasses: ``data`` and
``scale`` are leaves; ``block`` is static metadata.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from .codecs import (E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e2m1_encode_scaled, e4m3_round, e8m0_decode,
                     e8m0_encode_exponent, pow2)
from .codecs import FP4_PACKINGS, exact_f32, pack_nibbles, repack_f16pairs, unpack_f16pairs, unpack_nibbles
from .fake_quant import fp4_e4m3_block_scale, fp8_block_scale, mxfp4_block_scale


@struct.dataclass
class Fp8Tensor:
    data: jax.Array  # float8_e4m3fn [..., R, C]
    scale: jax.Array  # float8_e8m0fnu [..., ceil(R/br), ceil(C/bc)]
    block: tuple[int, int] = struct.field(pytree_node=False, default=(32, 32))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def scale_f32(self) -> jax.Array:
        """Scales expanded to the data's shape, float32."""
        br, bc = self.block
        s = e8m0_decode(self.scale)
        r, c = self.data.shape[-2:]
        s = jnp.repeat(jnp.repeat(s, br, axis=-2)[..., :r, :], bc, axis=-1)[..., :c]
        return s

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.data.astype(jnp.float32) * self.scale_f32()).astype(dtype)


@struct.dataclass
class Fp4Tensor:
    data: jax.Array  # uint8 [..., C/2]
    scale: jax.Array  # float8_e8m0fnu or float8_e4m3fn [..., C/block]
    block: int = struct.field(pytree_node=False, default=32)
    # "nibbles" (the checkpoint's) or "f16pairs" (codecs.repack_f16pairs): how codes sit in ``data``
    packing: str = struct.field(pytree_node=False, default="nibbles")
    # True only once checked: every e8m0 block scale lies in the window where the MoE kernels' float16
    # dot operands hold the weights exactly (pallas_kernels.moe.pallas_triton.mark_f16_exact; the
    # Engine checks its routed experts at construction), so the default route may read them in float16.
    # Kept by repacking (same codes and scales); checkpoints do not store it.
    f16_exact: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self):
        if self.packing not in FP4_PACKINGS:
            raise ValueError(f"Fp4Tensor packing must be one of {', '.join(FP4_PACKINGS)}, got {self.packing!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (unpacked) shape."""
        return (*self.data.shape[:-1], self.data.shape[-1] * 2)

    def nibble_data(self) -> jax.Array:
        """``data`` in the checkpoint's nibble layout (un-repacked where ``packing`` is "f16pairs")."""
        return _relaid(self.data, self.packing, "nibbles")

    def with_packing(self, packing: str) -> "Fp4Tensor":
        """The same codes in ``packing`` (self where it already is)."""
        if packing not in FP4_PACKINGS:
            raise ValueError(f"Fp4Tensor packing must be one of {', '.join(FP4_PACKINGS)}, got {packing!r}")
        if packing == self.packing:
            return self
        return self.replace(data=_relaid(self.data, self.packing, packing), packing=packing)

    def scale_f32(self) -> jax.Array:
        if self.scale.dtype == jnp.float8_e4m3fn:
            return self.scale.astype(jnp.float32)
        return e8m0_decode(self.scale)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        vals = e2m1_decode(unpack_nibbles(self.nibble_data()))
        vals = vals.reshape(*vals.shape[:-1], vals.shape[-1] // self.block, self.block)
        out = vals * self.scale_f32()[..., None]
        return out.reshape(self.shape).astype(dtype)


def is_quantized(x) -> bool:
    return isinstance(x, (Fp8Tensor, Fp4Tensor))


def exact_in_bf16(x) -> bool:
    """Whether every (dequantized) value of ``x`` is a bf16 number: FP8 e4m3 (3 mantissa bits) or
    e2m1 (1 bit) times a power-of-two or e4m3 scale has at most 5 significant bits, and a bf16 array
    is one already; float32 arrays are not. A bf16 x bf16 dot with fp32 accumulation over such
    values has the fp32 products exactly (only the summation order differs from an fp32 GEMM)."""
    return is_quantized(x) or x.dtype == jnp.bfloat16


def dequantize(x, dtype=jnp.float32) -> jax.Array:
    """Dequantize a quantized tensor, or cast a plain array."""
    if is_quantized(x):
        return x.dequantize(dtype)
    return jnp.asarray(x).astype(dtype)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    n = x.shape[axis]
    pad = -n % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def quantize_fp8(x: jax.Array, block: tuple[int, int] = (32, 32)) -> Fp8Tensor:
    """Quantize to FP8 e4m3 with ue8m0 block scales exactly as DeepSeek's weight format: per block,
    ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, ``q = e4m3(clip(x / s, ±448))``. Edge blocks may be
    partial (scale shape ``ceil``)."""
    br, bc = block
    x = exact_f32(jnp.asarray(x))
    if x.ndim < 2:
        raise ValueError(f"quantize_fp8 needs at least 2 dims, got shape {x.shape}")
    r, c = x.shape[-2:]
    xp = _pad_to(_pad_to(x, -2, br), -1, bc)
    nr, nc = xp.shape[-2] // br, xp.shape[-1] // bc
    xb = xp.reshape(*x.shape[:-2], nr, br, nc, bc)
    amax = jnp.max(jnp.abs(xb), axis=(-3, -1))  # [..., nr, nc]
    e = fp8_block_scale(amax)
    ef = jnp.repeat(jnp.repeat(e, br, axis=-2), bc, axis=-1)[..., :r, :c]
    q = e4m3_round(jnp.clip(x * pow2(-ef), -E4M3_MAX, E4M3_MAX)).astype(jnp.float8_e4m3fn)
    return Fp8Tensor(data=q, scale=e8m0_encode_exponent(e), block=(br, bc))


def quantize_mxfp4(x: jax.Array, block: int = 32) -> Fp4Tensor:
    """MXFP4: e2m1 codes (RNE) with a ue8m0 scale per ``block`` elements of the last dim."""
    x = exact_f32(jnp.asarray(x))
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the MXFP4 block {block}")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    e = mxfp4_block_scale(jnp.max(jnp.abs(xb), axis=-1))
    codes = e2m1_encode(jnp.clip(xb * pow2(-e[..., None]), -E2M1_MAX, E2M1_MAX))
    return Fp4Tensor(data=pack_nibbles(codes.reshape(x.shape)), scale=e8m0_encode_exponent(e), block=block)


def quantize_fp4_e4m3(x: jax.Array, block: int = 16) -> Fp4Tensor:
    """FP4 e2m1 with an e4m3 scale per ``block`` elements (V4.1 compressed KV)."""
    x = exact_f32(jnp.asarray(x))
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the FP4 block {block}")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = fp4_e4m3_block_scale(jnp.max(jnp.abs(xb), axis=-1))
    codes = e2m1_encode_scaled(xb, s[..., None])  # RNE of clip(x / s, ±6), without dividing
    return Fp4Tensor(data=pack_nibbles(codes.reshape(x.shape)), scale=s.astype(jnp.float8_e4m3fn), block=block)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def _is_fp4(x) -> bool:
    return isinstance(x, Fp4Tensor)


def fp4_packing(w) -> str:
    """``w``'s FP4 packing: its ``packing`` for an :class:`Fp4Tensor`, "nibbles" (the checkpoint
    layout) for anything else."""
    return w.packing if isinstance(w, Fp4Tensor) else "nibbles"


def dotted_path(path) -> str:
    """A pytree key path as dotted names (``layers.0.ffn.experts.w1``)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def with_fp4_packing(tree, packing: str, *, only=None, donate: bool = False):
    """``tree`` with every :class:`Fp4Tensor` node (for which ``only(path, node)`` holds, where given;
    ``path`` the dotted key path) in ``packing``; other nodes as they are. One jitted program per
    shape; a device array keeps its sharding. ``donate``: the converted nodes' old ``data`` buffers
    are given to the new ones (converting a model's experts in place, without a second copy; any
    other reference to the old arrays is then unusable)."""
    def conv(path, node):
        if not _is_fp4(node) or node.packing == packing:
            return node
        if only is not None and not only(dotted_path(path), node):
            return node
        sharding = getattr(node.data, "sharding", None)
        data = _repack_data_jit(node.packing, packing, donate)(node.data)
        if sharding is not None and getattr(data, "sharding", None) != sharding:
            data = jax.device_put(data, sharding)
        return node.replace(data=data, packing=packing)

    return jax.tree_util.tree_map_with_path(conv, tree, is_leaf=_is_fp4)


def _relaid(data, src: str, dst: str):
    """Packed FP4 ``data`` in packing ``src`` -> the same codes in packing ``dst``."""
    if src == dst:
        return data
    return repack_f16pairs(data) if dst == "f16pairs" else unpack_f16pairs(data)


@functools.cache
def _repack_data_jit(src: str, dst: str, donate: bool):
    return jax.jit(functools.partial(_relaid, src=src, dst=dst), donate_argnums=(0,) if donate else ())
