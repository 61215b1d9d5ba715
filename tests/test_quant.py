"""Quantizers and formats on hand-computed cases (attention.md §2.3, model.md §10.4)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.quant import (
    Fp4Tensor,
    act_quant,
    bf16_round,
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    e8m0_decode,
    fake_quant_fp4_e4m3,
    fake_quant_fp8,
    fake_quant_mxfp4,
    pack_nibbles,
    quantize_fp4_e4m3,
    quantize_fp8,
    quantize_mxfp4,
    unpack_nibbles,
)

# One jitted program per quantizer (and shape): eagerly, each of a quantizer's jnp ops compiled on its
# own, nearly all of this module's time. (The model runs them jitted too.)
e2m1_encode, e2m1_decode, e4m3_round, bf16_round, e8m0_decode, pack_nibbles, unpack_nibbles = map(
    jax.jit, (e2m1_encode, e2m1_decode, e4m3_round, bf16_round, e8m0_decode, pack_nibbles, unpack_nibbles))
act_quant, fake_quant_fp8, fake_quant_mxfp4, fake_quant_fp4_e4m3, quantize_fp8, quantize_mxfp4, quantize_fp4_e4m3 = (
    jax.jit(f, static_argnums=1) for f in (act_quant, fake_quant_fp8, fake_quant_mxfp4, fake_quant_fp4_e4m3,
                                           quantize_fp8, quantize_mxfp4, quantize_fp4_e4m3))
_deq = jax.jit(lambda t: t.dequantize())
_scale_f32 = jax.jit(lambda t: t.scale_f32())

TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
TIES_RNE = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)


def test_e2m1_ties_round_to_even_code():
    got = np.asarray(e2m1_decode(e2m1_encode(jnp.asarray(TIES))))
    np.testing.assert_array_equal(got, TIES_RNE)
    np.testing.assert_array_equal(np.asarray(e2m1_decode(e2m1_encode(-jnp.asarray(TIES)))), -TIES_RNE)


def test_e2m1_saturates_and_rounds_near_values():
    x = jnp.asarray([7.0, 100.0, -9.0, 0.26, 0.74, 2.4, 2.6, 4.9, 5.1, 1e-9])
    np.testing.assert_array_equal(np.asarray(e2m1_decode(e2m1_encode(x))), [6, 6, -6, 0.5, 0.5, 2, 3, 4, 6, 0])


def test_e2m1_every_code_round_trips():
    codes = jnp.arange(16, dtype=jnp.uint8)
    vals = e2m1_decode(codes)
    back = e2m1_encode(vals)
    # -0 (code 8) encodes as +0 (code 0); every other code is exact
    np.testing.assert_array_equal(np.asarray(e2m1_decode(back)), np.asarray(vals))


def test_packed_mxfp4_byte_0x71():
    vals = e2m1_decode(unpack_nibbles(jnp.asarray([0x71], jnp.uint8)))
    np.testing.assert_array_equal(np.asarray(vals), [0.5, 6.0])  # low nibble first
    scale = jnp.asarray(np.array([[130]], np.uint8).view(ml_dtypes.float8_e8m0fnu))  # 2**3
    t = Fp4Tensor(data=jnp.full((1, 16), 0x71, jnp.uint8), scale=scale, block=32)
    np.testing.assert_array_equal(np.asarray(_deq(t))[0, :2], [4.0, 48.0])
    # int8 storage (checkpoint I8) decodes the same
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(jnp.asarray([0x71], jnp.uint8).view(jnp.int8))), [1, 7])


def test_pack_unpack_round_trip():
    codes = jnp.asarray(np.random.default_rng(3).integers(0, 16, (5, 64), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(pack_nibbles(codes))), np.asarray(codes))


def test_e8m0_decode_every_byte():
    """Every e8m0 byte decodes to ml_dtypes' float8_e8m0fnu value: 2**(b - 127), byte 0 the subnormal
    2**-127 (not 0), byte 255 NaN; from uint8 bytes and from float8_e8m0fnu alike."""
    b = np.arange(256, dtype=np.uint8)
    want = b.view(jnp.float8_e8m0fnu).astype(np.float32)
    for x in (jnp.asarray(b), jnp.asarray(b).view(jnp.float8_e8m0fnu)):
        got = np.asarray(jax.jit(e8m0_decode)(x))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got[:255], want[:255])
        assert np.isnan(got[255]) and np.isnan(want[255])
    assert np.asarray(e8m0_decode(jnp.asarray([0], jnp.uint8)))[0] == 2.0**-127 > 0


@pytest.mark.parametrize("k", [-3, 0, 4])
def test_fp8_power_of_two_amax_gives_exact_scale(k):
    # amax = 448 * 2**k -> scale 2**k, so the max element is exactly 448 in e4m3
    x = np.linspace(-1, 1, 32, dtype=np.float32) * 448 * 2.0**k
    q = quantize_fp8(jnp.asarray(x)[None], (1, 32))
    assert float(e8m0_decode(q.scale)[0, 0]) == 2.0**k
    np.testing.assert_array_equal(np.asarray(_deq(q))[0, [0, -1]], [-448 * 2.0**k, 448 * 2.0**k])


def test_fp8_scale_rounds_up_and_ties_are_rne():
    # amax 449 -> 449/448 > 1 -> scale 2; 17 is a tie between 16 and 18 at scale 1 -> 16 (even)
    x = np.zeros(32, np.float32) + 3.0
    x[0] = 449.0
    fq = np.asarray(fake_quant_fp8(jnp.asarray(x)))
    assert fq[0] == 448.0  # scale 2; 449/2 = 224.5 -> e4m3 224 (step 16 in [128, 256)) -> 448
    y = np.full(32, 3.0, np.float32)
    y[0], y[1], y[2] = 448.0, 17.0, 19.0
    fy = np.asarray(fake_quant_fp8(jnp.asarray(y)))
    np.testing.assert_array_equal(fy[:3], [448.0, 16.0, 20.0])


def test_fp8_tiny_values_use_the_amax_floor():
    x = jnp.full((32,), 1e-7, jnp.float32)
    # amax floored at 1e-4 -> scale 2**ceil(log2(1e-4/448)) = 2**-22; 1e-7/2**-22 = 0.419 -> e4m3 0.40625
    got = float(fake_quant_fp8(x)[0])
    assert got == pytest.approx(0.40625 * 2.0**-22, rel=0)


def test_e4m3_saturates_instead_of_nan():
    np.testing.assert_array_equal(np.asarray(e4m3_round(jnp.asarray([1000.0, -1e9, 464.0]))), [448, -448, 448])


def _near_ties(grid, rng, n):
    """Fresh values around every midpoint of a positive value grid (both signs), the midpoints
    themselves, the grid points, and random magnitudes across the grid's range."""
    mids = (grid[:-1] + grid[1:]) / 2
    around = mids * (1 + rng.uniform(-2.0**-12, 2.0**-12, (n, mids.size)))
    x = np.concatenate([around.ravel(), mids, grid, rng.standard_normal(1 << 16) * grid[-1] / 8,
                        rng.standard_normal(1 << 12) * grid[1] * 4])
    return np.concatenate([x, -x]).astype(np.float32)


def test_e4m3_round_is_bitwise_ml_dtypes_rne_on_ties_subnormals_and_saturation():
    rng = np.random.default_rng()
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    grid = np.unique(codes[np.isfinite(codes) & (codes >= 0)])  # 0, subnormals 2**-9.., .., 448
    x = np.concatenate([_near_ties(grid, rng, 16), [0.0, -0.0, 1e-30, -1e-30, 2.0**-10, 3 * 2.0**-10, 449.0, 480.0,
                                                   -500.0, 3e38]]).astype(np.float32)
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(e4m3_round(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # signed zeros too
    assert np.isnan(np.asarray(e4m3_round(jnp.asarray([np.nan], jnp.float32)))).all()


def test_bf16_round_is_bitwise_ml_dtypes_rne():
    rng = np.random.default_rng()
    grid = np.arange(128, 256, dtype=np.float64) / 128 * 2.0**rng.integers(-130, 120)  # one binade of bf16 values
    x = np.concatenate([_near_ties(grid, rng, 8), rng.standard_normal(1 << 14) * 1e-39,  # subnormals
                        [np.inf, -np.inf, 3.39e38, -3.39e38, 0.0, -0.0]]).astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(bf16_round(jnp.asarray(x))).view(np.uint32), want.view(np.uint32))
    assert np.isnan(np.asarray(bf16_round(jnp.asarray([np.nan], jnp.float32)))).all()


def test_exact_f32_widens_bf16_bit_for_bit():
    """``exact_f32`` of a bf16 array equals the upcast bit for bit (normals over the whole range,
    subnormals, signed zeros, infinities, NaN payloads); float32 input passes through."""
    from dsv41_jax.quant.codecs import exact_f32

    rng = np.random.default_rng()
    bits = rng.integers(0, 1 << 16, 1 << 15, dtype=np.uint32).astype(np.uint16)  # every kind of pattern
    bits = np.concatenate([bits, np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x807F], np.uint16)])
    x = bits.view(ml_dtypes.bfloat16)
    got = np.asarray(exact_f32(jnp.asarray(x))).view(np.uint32)
    np.testing.assert_array_equal(got, x.astype(np.float32).view(np.uint32))
    assert got.dtype == np.uint32 and got.shape == bits.shape
    xf = rng.standard_normal(64).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(exact_f32(jnp.asarray(xf))), xf)


@pytest.mark.parametrize("fn", ["e4m3_round", "act_quant", "fake_quant_fp8", "fake_quant_fp4_e4m3"])
def test_fake_quant_has_no_fp8_convert_round_trip_for_xla_gpu_to_drop(fn):
    """XLA's GPU compiler drops an f32 -> f8 -> f32 convert pair inside a fusion (excess precision):
    on the H200 (session 17) ``x.astype(float8_e4m3fn).astype(float32)`` returned x unrounded, so the
    fake-quants must not be written that way. The lowered programs hold no f8 type at all."""
    import dsv41_jax.quant as q

    f = getattr(q, fn)
    x = jnp.asarray(np.random.default_rng().standard_normal((4, 128)), jnp.float32)
    text = (jax.jit(f) if fn == "e4m3_round" else jax.jit(f, static_argnums=1)).lower(
        *((x,) if fn == "e4m3_round" else (x, 32 if fn != "fake_quant_fp4_e4m3" else 16))).as_text()
    assert "f8e4m3" not in text.lower(), fn


@pytest.mark.parametrize("mult,expect", list(zip(TIES, TIES_RNE)))
def test_mxfp4_ties_at_multiples_of_the_scale(mult, expect):
    # block amax 6*2**2 = 24 -> scale exactly 4; x = mult * scale
    x = np.full(32, 0.1, np.float32)
    x[0] = 24.0
    x[1] = mult * 4.0
    x[2] = -mult * 4.0
    fq = np.asarray(fake_quant_mxfp4(jnp.asarray(x)))
    assert fq[0] == 24.0
    assert fq[1] == expect * 4.0 and fq[2] == -expect * 4.0
    q = quantize_mxfp4(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(_deq(q)), fq)


def test_mxfp4_scale_rounds_up_and_saturates():
    x = np.full(32, 1.0, np.float32)
    x[0] = 6.5  # 6.5/6 > 1 -> scale 2; 6.5/2 = 3.25 -> 3 -> 6
    fq = np.asarray(fake_quant_mxfp4(jnp.asarray(x)))
    assert fq[0] == 6.0 and fq[1] == 1.0


@pytest.mark.parametrize("mult,expect", list(zip(TIES, TIES_RNE)))
def test_fp4_e4m3_scale_ties(mult, expect):
    # amax 12 -> scale e4m3(12/6) = 2 exactly
    x = np.full(16, 0.3, np.float32)
    x[0] = 12.0
    x[1] = mult * 2.0
    fq = np.asarray(fake_quant_fp4_e4m3(jnp.asarray(x)))
    assert fq[0] == 12.0 and fq[1] == expect * 2.0
    q = quantize_fp4_e4m3(jnp.asarray(x))
    assert q.scale.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(_deq(q)), fq)


def _np_q4e4(x):
    """Q4e4 (attention.md §2.3) in numpy float64, where ``/`` is IEEE division: exact ties of x / s
    and of amax / 6 stay ties. float32 [..., 16k] -> dequantized float32."""
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, 16)
    a = np.maximum(np.abs(xb).max(-1, keepdims=True), 6 * 2.0**-9)
    s = (a / 6).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    v = np.clip(xb / s, -6, 6)
    mag = np.abs(v)
    code = (mag[..., None] > TIES).sum(-1) + ((mag[..., None] == TIES) & (np.arange(1, 8) % 2 == 0)).sum(-1)
    y = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[code] * np.where(np.signbit(v), -1, 1)
    return (y * s).astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("amax", [1432.0, 22.625, 1.3671875, 178.0, 13.0 * 6])
def test_fp4_e4m3_ties_under_scales_that_are_not_powers_of_two(amax):
    """x / s exactly on an e2m1 decision point with an e4m3 scale s that is not a power of two (240,
    3.75, 0.234375, 30, 13): ties to the even code. Session 35 found about 3 in 10,000 random bf16
    values off here: XLA turns ``x / broadcast(s)`` into ``x * (1 / s)``, and 300 * (1 / 240) is
    1.2500001, which rounds up to 1.5 instead of to the even 1.0 (cross-checked against a CPU port of
    DeepSeek's V4.1 kernels)."""
    s = float(e4m3_round(jnp.float32(amax / 6)))
    assert s != 2.0 ** np.round(np.log2(s))
    x = np.full(16, 0.0, np.float32)
    x[0] = amax
    x[1:8], x[8:15] = TIES * s, -TIES * s
    assert np.all(x[1:15] / s == np.concatenate([TIES, -TIES]))  # the ties are exact in float32
    want = np.concatenate([[6.0], TIES_RNE, -TIES_RNE, [0.0]]) * s
    want[0] = _np_q4e4(x)[0]
    fq = np.asarray(fake_quant_fp4_e4m3(jnp.asarray(x)))
    np.testing.assert_array_equal(fq, want)
    np.testing.assert_array_equal(np.asarray(_deq(quantize_fp4_e4m3(jnp.asarray(x)))), want)


def test_fp4_e4m3_scale_rounds_exact_quotient_ties_to_even():
    """amax / 6 exactly on an e4m3 midpoint (normal and subnormal ranges): the scale is the neighbour
    with the even code, as e4m3(amax / 6) with IEEE division gives (amax * (1 / 6), which XLA
    computes for amax / 6, lies up to an ulp off the tie)."""
    e4m3 = np.array(sorted({float(v) for v in np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                            .astype(np.float32) if np.isfinite(v) and v > 0}), np.float32)
    mids = ((e4m3[:-1] + e4m3[1:]) / 2)
    mids = mids[mids >= 2.0**-9]  # above the amax floor's scale
    amax = (mids * 6).astype(np.float32)
    assert np.all(amax / np.float32(6) == mids)
    got = np.asarray(_scale_f32(quantize_fp4_e4m3(jnp.asarray(np.repeat(amax[:, None], 16, 1)))))[:, 0]
    want = mids.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # RNE: ties to the even code
    np.testing.assert_array_equal(got, want)
    # and away from the ties (an ulp either side of each amax), the nearest value
    for nudged in (np.nextafter(amax, np.inf), np.nextafter(amax, 0)):
        got = np.asarray(_scale_f32(quantize_fp4_e4m3(jnp.asarray(np.repeat(nudged[:, None], 16, 1)))))[:, 0]
        np.testing.assert_array_equal(got, (nudged.astype(np.float64) / 6).astype(np.float32)
                                      .astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_fp4_e4m3_matches_ieee_division_on_random_bf16():
    """Random bf16 blocks over 30 binades, every block's quantization against the float64 numpy
    definition, bit for bit (before session 35: ~3e-4 of the values differed)."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((512, 256)) * 2.0 ** rng.integers(-20, 10, (512, 1))).astype(ml_dtypes.bfloat16)
    x = x.astype(np.float32)
    want = _np_q4e4(x)
    np.testing.assert_array_equal(np.asarray(fake_quant_fp4_e4m3(jnp.asarray(x, jnp.bfloat16))).astype(np.float32), want)
    np.testing.assert_array_equal(np.asarray(_deq(quantize_fp4_e4m3(jnp.asarray(x)))), want)


def test_fp4_e4m3_scale_is_round_to_nearest_so_values_can_saturate():
    # amax 6.9 -> 6.9/6 = 1.15 -> e4m3 1.125; 6.9/1.125 = 6.13 -> saturates at 6 -> 6.75
    x = np.full(16, 0.5, np.float32)
    x[0] = 6.9
    q = quantize_fp4_e4m3(jnp.asarray(x))
    assert float(_scale_f32(q)[0]) == 1.125
    assert float(_deq(q)[0]) == 6.75


def test_fp4_e4m3_tiny_values_use_the_floor():
    x = jnp.full((16,), 1e-6, jnp.float32)
    q = quantize_fp4_e4m3(x)
    assert float(_scale_f32(q)[0]) == 2.0**-9  # amax floor 6*2**-9 -> scale 2**-9
    assert float(_deq(q)[0]) == 0.0  # 1e-6/2**-9 = 5e-4 -> 0


def test_fp8_weight_blocks_32x32_dequantize_and_partial_edge_blocks():
    rng = np.random.default_rng(0)  # numpy: jax.random compiled each draw on its own
    w = jnp.asarray(rng.standard_normal((70, 100), np.float32) * np.exp(rng.standard_normal((70, 1), np.float32)))
    q = quantize_fp8(w)
    assert q.scale.shape == (3, 4) and q.scale.dtype == jnp.float8_e8m0fnu
    deq = np.asarray(_deq(q))
    # each 32x32 block: relative error below the e4m3 half-ulp (2**-4) of its amax
    for bi in range(3):
        for bj in range(4):
            blk = np.asarray(w)[bi * 32 : (bi + 1) * 32, bj * 32 : (bj + 1) * 32]
            err = np.abs(deq[bi * 32 : (bi + 1) * 32, bj * 32 : (bj + 1) * 32] - blk).max()
            assert err <= np.abs(blk).max() * 2.0**-4
    # manual dequantization from the raw bytes
    s = np.asarray(q.scale).view(np.uint8).astype(np.int32) - 127
    manual = np.asarray(q.data).astype(np.float32) * np.ldexp(1.0, np.repeat(np.repeat(s, 32, 0), 32, 1)[:70, :100])
    np.testing.assert_array_equal(manual, deq)


def test_quantized_forms_equal_fake_quant_on_random_data():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 128), np.float32) * 5)
    np.testing.assert_array_equal(np.asarray(_deq(quantize_fp8(x, (1, 32)))), np.asarray(fake_quant_fp8(x)))
    np.testing.assert_array_equal(np.asarray(_deq(quantize_mxfp4(x))), np.asarray(fake_quant_mxfp4(x)))
    np.testing.assert_array_equal(np.asarray(_deq(quantize_fp4_e4m3(x))), np.asarray(fake_quant_fp4_e4m3(x)))
    # bf16 input gives bf16 output with the same values (all representable)
    xb = np.asarray(x).astype(jnp.bfloat16)  # RNE, as XLA's convert
    np.testing.assert_array_equal(np.asarray(fake_quant_fp8(jnp.asarray(xb))).astype(np.float32),
                                  np.asarray(fake_quant_fp8(jnp.asarray(xb.astype(np.float32)))))


def test_act_quant_is_fp8_per_32_along_k():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 64), np.float32))
    y = act_quant(x, 32)
    for b in range(2):
        blk = np.asarray(x)[:, b * 32 : (b + 1) * 32]
        e = np.ceil(np.log2(np.maximum(np.abs(blk).max(1), 1e-4) / 448))
        scaled = np.asarray(y)[:, b * 32 : (b + 1) * 32] / np.ldexp(1.0, e.astype(int))[:, None]
        # values / scale are e4m3 numbers
        np.testing.assert_array_equal(scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), scaled)


def test_as_uint8_bitcasts_one_byte_dtypes():
    """codecs.as_uint8: the bytes of uint8 / int8 / float8 / e8m0 arrays unchanged, bit for bit; a wider
    dtype is refused by name."""
    from dsv41_jax.quant.codecs import as_uint8

    raw = np.random.default_rng().integers(0, 255, 64, dtype=np.uint8)  # 255 (e8m0 NaN) left out
    for dt in (jnp.uint8, jnp.int8, jnp.float8_e4m3fn, jnp.float8_e8m0fnu):
        x = jax.lax.bitcast_convert_type(jnp.asarray(raw), dt)
        np.testing.assert_array_equal(np.asarray(as_uint8(x)), raw)
    with pytest.raises(ValueError, match="one-byte dtype, got bfloat16"):
        as_uint8(jnp.zeros(4, jnp.bfloat16))
