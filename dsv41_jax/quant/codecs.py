"""Element-level codecs, all exact (no approximations), all in jnp so they run under jit.

Formats (``shared/spec/attention.md`` top, §2.3; ``model.md`` §10.4):

* ``e8m0`` (``ue8m0``): one byte ``b``, value ``2**(b - 127)``. Stored as ``jnp.float8_e8m0fnu``.
* ``e4m3`` (OCP ``float8_e4m3fn``): max ±448, no infinities; rounding is round-to-nearest-even.
  :func:`e4m3_round` clamps to ±448 first (saturating, like ``cvt.rn.satfinite``; XLA's f32 ->
  e4m3fn conversion turns out-of-range values into NaN) and rounds on the bit pattern (XLA's GPU
  compiler drops an f32 -> e4m3 -> f32 convert pair inside a fusion).
* ``e2m1`` (OCP FP4): codes 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign. Rounding is RNE with
  ties to the *even code*: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (the reference
  and the hardware; DeepGEMM's test quantizer rounds ties down and is not followed).
* Packed FP4: two codes per byte, element ``2k`` in the **low** nibble, ``2k+1`` in the high one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# Decision points between magnitude codes k and k+1.
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
# value by 4-bit code (sign in bit 3; -0.0 at code 8)
E2M1_LUT16 = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def e8m0_decode(scale: jax.Array) -> jax.Array:
    """e8m0 scales (float8_e8m0fnu or raw uint8 bytes) -> float32 powers of two."""
    if scale.dtype == jnp.float8_e8m0fnu:
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    # byte b -> 2**(b - 127), built as float32 bits: b in the exponent field (b >= 1), byte 0 the
    # subnormal 2**-127 (jnp.ldexp flushed it to 0), byte 255 NaN (as float8_e8m0fnu / ml_dtypes).
    # A few integer ops instead of jnp.ldexp's ~60 per call (HLO size, compile time).
    u = scale.astype(jnp.uint32)
    bits = jnp.where(u == 0, jnp.uint32(0x00400000), jnp.where(u == 255, jnp.uint32(0x7FC00000), u << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def as_uint8(x: jax.Array) -> jax.Array:
    """The bytes of a one-byte array (uint8, int8, float8 codes or e8m0 scales) as uint8 (a bitcast)."""
    if x.dtype.itemsize != 1:
        raise ValueError(f"as_uint8: expected a one-byte dtype, got {x.dtype}")
    return x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)


def e8m0_encode_exponent(exponent: jax.Array) -> jax.Array:
    """Unbiased integer exponent e (scale = 2**e) -> float8_e8m0fnu byte ``e + 127``."""
    b = jnp.clip(exponent + 127, 0, 254).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(b, jnp.float8_e8m0fnu)


def ceil_pow2_exponent(a: jax.Array, divisor: float = 1.0) -> jax.Array:
    """Exponent e with 2**e = 2**ceil(log2(a / divisor)) for positive normal float32 ``a`` and a
    positive constant ``divisor``, read from the bit pattern as the reference kernel does, without
    the division. With a = m_a 2**E and divisor = m_d 2**k (m in [1, 2)): e = E - k, plus one
    where m_a > m_d. That equals ceil_pow2 of the correctly rounded quotient (for m_a just above
    m_d the quotient is at least 1 + 2**-23 / m_d, more than half an ulp above 1), and does not
    depend on how a backend divides (XLA may multiply by a rounded reciprocal; a Triton kernel's
    f32 division need not be correctly rounded). Also used inside Pallas kernels
    (``pallas_triton_fma.quant_phases``)."""
    m_d, k = np.frexp(np.float32(divisor))  # divisor = m_d * 2**k with m_d in [0.5, 1)
    d_bits = int(np.float32(m_d * 2.0).view(np.uint32)) & 0x7FFFFF  # the mantissa field of m_d * 2 in [1, 2)
    bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127 - (int(k) - 1)
    mant = bits & 0x7FFFFF
    return exp + (mant > d_bits).astype(jnp.int32)


def pow2(e: jax.Array) -> jax.Array:
    """float32 ``2**e`` for integer exponents, built in the exponent field: exact for e in
    [-126, 127] (clipped there). Multiplying by it is ``jnp.ldexp`` wherever the product stays a
    normal number (every block scale here: FP8's e >= -22 with values <= 448 * 2**e, MXFP4's e >= -126)
    at a handful of integer ops instead of ldexp's ~60 (HLO size, fusions)."""
    e = jnp.clip(jnp.asarray(e, jnp.int32), -126, 127)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def e4m3_round(x: jax.Array) -> jax.Array:
    """Round float32 values to the nearest e4m3fn value (RNE, saturating at ±448); float32 out.

    Computed on the float32 bit pattern, not as ``x.astype(float8_e4m3fn).astype(float32)``: XLA's
    GPU compiler removes such a convert round trip inside a fusion (``SimplifyFPConversions``, on by
    default with ``xla_allow_excess_precision``), which made every activation fake-quant a no-op on
    the GPU (measured on the H200 in session 17: all of 1,056,766 values came back unrounded; the
    CPU backend keeps the converts). Normals (|x| >= 2**-6): add half an e4m3 ulp (2**19 in the
    bit pattern, minus one, plus the kept lowest mantissa bit for ties to even) and clear the 20
    dropped mantissa bits; the carry into the exponent is the correct rounding up. Subnormals
    (spacing 2**-9): ``round(x * 2**9) * 2**-9``, exact scalings around an RNE round. NaN stays NaN."""
    x = jnp.clip(x.astype(jnp.float32), -E4M3_MAX, E4M3_MAX)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    up = bits + jnp.uint32(0x7FFFF) + ((bits >> 20) & jnp.uint32(1))
    normal = jax.lax.bitcast_convert_type(up & jnp.uint32(0xFFF00000), jnp.float32)
    sub = jnp.round(x * 512.0) * (1.0 / 512.0)
    y = jnp.where(jnp.abs(x) < 2.0**-6, sub, normal)
    return jnp.where(jnp.isnan(x), x, y)


def bf16_round(x: jax.Array) -> jax.Array:
    """Round float32 values to the nearest bfloat16 value (RNE); float32 out. The bit-pattern
    equivalent of ``x.astype(bfloat16).astype(float32)``, which XLA's GPU compiler may drop inside
    a fusion (see :func:`e4m3_round`); use it where the reference's bf16 rounding is part of the
    numerics. Infinities stay, NaN stays NaN."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    up = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
    y = jax.lax.bitcast_convert_type(up & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isnan(x), x, y)


def round_to_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to ``dtype`` (bfloat16 or float32), returned in float32: the reference's
    ``.to(dtype).float()``, kept by XLA's GPU compiler (:func:`bf16_round`)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return bf16_round(x)
    if jnp.dtype(dtype) == jnp.float32:
        return x.astype(jnp.float32)
    raise ValueError(f"round_to_dtype: dtype must be bfloat16 or float32, got {jnp.dtype(dtype)}")


def exact_f32(x: jax.Array) -> jax.Array:
    """``x`` as float32 with its own rounding kept: for a bfloat16 array the upcast followed by
    :func:`bf16_round` (a no-op on values that really are bf16); other dtypes a plain upcast.

    Why: XLA's GPU compiler may hand a bf16 value's consumer the producer's unrounded float32
    instead (excess precision: the f32 -> bf16 -> f32 convert pair inside a fusion is removed, as
    for :func:`e4m3_round`). Where that value feeds a quantizer, every FP8/FP4 rounding decision is
    then taken on a different value than the reference's: one bf16 ulp moves about 1 in 30 e4m3
    roundings by a step (session 18, H200: the MoE reference at decode sizes 1.7e-2 from the
    kernels, which round in-kernel). Every quantizer's input and the SwiGLU's upcast of the bf16
    GEMM outputs go through this.

    A bfloat16 array is widened by its bit pattern (the 16 bits placed in the upper half of a
    float32), which equals the rounded upcast bit for bit (NaN payloads too) and cannot be folded
    into the producer's float32. Unlike :func:`bf16_round` of the upcast it needs no NaN select;
    that select split the XLA act-quant fusions of the decode step (session 20 profile: 751 kernels
    in the attention part instead of 624)."""
    if x.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(jnp.float32)


def e2m1_encode(x: jax.Array) -> jax.Array:
    """float32 values (already divided by the scale) -> e2m1 codes (uint8 0..15), RNE, saturating."""
    return e2m1_encode_scaled(x, 1.0)


def e2m1_encode_scaled(x: jax.Array, s: jax.Array) -> jax.Array:
    """e2m1 codes of ``clip(x / s, ±6)`` (RNE, ties to the even code) for finite positive scales ``s``
    broadcasting against ``x``, decided without dividing: ``|x|`` against each decision point times
    ``s``. Those products are exact (a decision point has at most 3 significant bits, an e4m3 scale
    4), so exact ties stay ties. ``e2m1_encode(x / s)`` is not exact under XLA: its algebraic
    simplifier turns a division by a broadcast (a scale per block) into a multiplication by the
    reciprocal, which moved about 3 in 10,000 bf16 values across a tie of the e4m3-scaled FP4
    quantizer (session 35; an XLA rewrite, on the CPU and the GPU alike)."""
    x = x.astype(jnp.float32)
    s = jnp.asarray(s, jnp.float32)
    a = jnp.abs(x)
    code = jnp.zeros(jnp.broadcast_shapes(x.shape, s.shape), jnp.uint8)
    for k, bound in enumerate(_E2M1_BOUNDS):
        # between code k and k+1: round up above the bound, and on the bound when k+1 is even
        t = s * bound
        up = (a > t) | ((a == t) & ((k + 1) % 2 == 0))
        code = code + up.astype(jnp.uint8)
    sign = (jnp.signbit(x) & (code > 0)).astype(jnp.uint8)
    return code | (sign << 3)


def e4m3_round_quotient(a: jax.Array, d: float) -> jax.Array:
    """``e4m3_round(a / d)`` exactly, for a positive constant ``d`` with few significant bits (6):
    ``a / d`` under XLA is ``a * (1 / d)`` (see :func:`e2m1_encode_scaled`), off by up to an ulp,
    which decides the rounding when the true quotient is an e4m3 midpoint. The approximate quotient
    is snapped to the grid of e4m3 values and midpoints (one more mantissa bit; 2**-10 steps below
    2**-6); where that point ``m`` is a midpoint, the sign of ``a - d·m`` (an exact product, and a
    subtraction that keeps the sign) says on which side the true quotient lies, and ``m`` itself is
    rounded (ties to even) when it is the quotient."""
    a = a.astype(jnp.float32)
    q = a / d
    bits = jax.lax.bitcast_convert_type(q, jnp.uint32)
    normal = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x40000)) & jnp.uint32(0xFFF80000), jnp.float32)
    m = jnp.where(jnp.abs(q) < 2.0**-6, jnp.round(q * 1024.0) * (1.0 / 1024.0), normal)
    is_mid = e4m3_round(m) != m
    side = jnp.sign(a - m * d)  # -1, 0 or 1: the true quotient below, on or above m
    return e4m3_round(jnp.where(is_mid, m + side * jnp.abs(m) * 2.0**-10, q))


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """e2m1 codes (uint8 0..15) -> float32 values."""
    return jnp.asarray(E2M1_LUT16)[codes.astype(jnp.int32) & 0xF]


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """[..., 2n] codes -> [..., n] uint8 bytes, element 2k in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing FP4 needs an even last dimension, got shape {codes.shape}")
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """[..., n] bytes (uint8 or int8) -> [..., 2n] uint8 codes, low nibble first."""
    if packed.dtype == jnp.int8:
        packed = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ------------------------------------------------------------------------------------------------
# MXFP4 "f16pairs" packing: the same codes, re-laid inside each 32-bit word for the GPU decode.
#
# The checkpoint's layout ("nibbles") holds 8 codes per little-endian 32-bit word, code j (element
# 8q + j) in bits 4j..4j+3, sign on top. The fma kernels decode codes j and j + 4 together, into
# the two float16 halves of one word: sign to bit 15 (31), magnitude to bits 9..11 (25..27), which
# gives e2m1 * 2**-14 exactly. From nibbles that takes two shifts and two masks per pair (code 3's
# sign needs no shift: 15 integer ops per 8 codes), because a nibble's sign sits directly above its
# magnitude while float16's sits three bits higher. "f16pairs" stores pair p = (j, j + 4) with its
# sign at bit F16PAIRS_SIGN[p] (+16 for code j + 4) and its magnitude from bit F16PAIRS_MAG[p], so
# that pair 0 is in place (one mask), pair 1 needs one shift and pairs 2 and 3 two: 11 ops per 8
# codes. (No arrangement gives every pair a single shift: the 4-bit pattern {0, 1, 2, 6} does not
# tile 16 bit positions; 11 is the minimum over all arrangements, shared shifts counted.) The sm_90
# loop of the fused MoE's gate/up kernel goes from 602 to 538 instructions per K step.
F16PAIRS_SIGN = (15, 7, 0, 8)
F16PAIRS_MAG = (9, 1, 4, 12)
# per packing, pair p's (sign bits, lowest magnitude bits) in a word, +16 for code p + 4: the one
# table the repack and the kernels' word decode (pallas_triton_fma.fp4_word_pairs_f32) read
FP4_WORD_BITS = {"nibbles": ((3, 7, 11, 15), (0, 4, 8, 12)), "f16pairs": (F16PAIRS_SIGN, F16PAIRS_MAG)}
FP4_PACKINGS = tuple(FP4_WORD_BITS)


def le_words(packed: jax.Array) -> jax.Array:
    """[..., 4n] uint8 -> [..., n] uint32 little-endian words (an XLA bitcast)."""
    if packed.shape[-1] % 4:
        raise ValueError(f"32-bit words need a last dimension that is a multiple of 4 bytes (8 codes), "
                         f"got shape {tuple(packed.shape)}")
    *lead, nb = packed.shape
    return jax.lax.bitcast_convert_type(packed.reshape(*lead, nb // 4, 4), jnp.uint32)


def _fp4_bytes(words: jax.Array) -> jax.Array:
    *lead, nw = words.shape
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*lead, nw * 4)


def _move_codes(words: jax.Array, src: str, dst: str) -> jax.Array:
    """Every code of ``words`` from its bits in packing ``src`` to those in ``dst``."""
    (src_sign, src_mag), (dst_sign, dst_mag) = FP4_WORD_BITS[src], FP4_WORD_BITS[dst]
    out = jnp.zeros_like(words)
    for j in range(8):
        p, h = j % 4, 16 * (j // 4)
        sign = (words >> np.uint32(src_sign[p] + h)) & np.uint32(1)
        mag = (words >> np.uint32(src_mag[p] + h)) & np.uint32(7)
        out = out | (sign << np.uint32(dst_sign[p] + h)) | (mag << np.uint32(dst_mag[p] + h))
    return out


def repack_f16pairs(packed: jax.Array) -> jax.Array:
    """Nibble-packed FP4 bytes [..., 4n] uint8 -> the same codes in the "f16pairs" layout (uint8,
    same shape; each 4-byte group re-laid as one word)."""
    packed = jax.lax.bitcast_convert_type(packed, jnp.uint8) if packed.dtype == jnp.int8 else packed
    return _fp4_bytes(_move_codes(le_words(packed), "nibbles", "f16pairs"))


def unpack_f16pairs(packed: jax.Array) -> jax.Array:
    """The inverse of :func:`repack_f16pairs`: "f16pairs" bytes -> nibble-packed bytes."""
    return _fp4_bytes(_move_codes(le_words(packed), "f16pairs", "nibbles"))
