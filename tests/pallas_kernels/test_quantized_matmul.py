"""quantized_matmul Pallas-Triton kernel: interpret-mode parity with the reference on fresh random
inputs (every element), shape-support reasons, dispatch fallback, and cross-lowering for cuda (H200)
and rocm (gfx950) at the real V4.1 projection shapes."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, quantize_fp8, quantize_mxfp4
from pallas_kernels import dispatch
from pallas_kernels.quantized_matmul import api, pallas_triton, reference
from pallas_kernels.testing import assert_close as check_close, lower_for



# Tolerances. The kernel forms exactly the same products as the reference (fake-quantized x and
# decoded W are exact in bf16; bf16 x bf16 products are exact in fp32) and differs only in the fp32
# summation order: |diff| <= ~K * 2^-24 * sum|x w|. After rounding to the output dtype that is at
# most one ulp of the output: bf16 rtol 2^-7, f32 rtol 1e-5 (plus an absolute term relative to the
# output scale for elements near zero).


# Inputs come from numpy (fresh every run) and the weights are quantized by one jitted program per
# shape; every kernel and reference call runs as one jitted program. Eager, each of the many small jnp
# ops of the input builders, the kernels' glue and the references compiled on its own (most of this
# module's time). Kernel calls get a fresh jax.jit each (``run``): the switches that tests monkeypatch
# (DECODE_GEMV, FMA_DECODE, SCALE_MODE, ...) and the dispatch context are read at trace time.
_q8 = jax.jit(quantize_fp8, static_argnames="block")
_q4 = jax.jit(quantize_mxfp4, static_argnames="block")
_reference = jax.jit(reference.quantized_matmul, static_argnames=("act_block", "out_dtype"))
_reference_grouped = jax.jit(reference.grouped_matmul, static_argnames=("groups", "out_dtype"))


def run(fn, *args, **kw):
    """``fn(*args, **kw)`` as one freshly traced jitted program (``kw``: static arguments)."""
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def activations(rng, shape, dtype):
    """N(0, 9) activations in ``dtype``; in float32 also spread over many binades (x 2^-20..2^19)."""
    x = rng.standard_normal(shape, np.float32) * np.float32(3)
    if np.dtype(dtype) == np.float32:
        x = x * np.exp2(rng.integers(-20, 20, shape)).astype(np.float32)
    return jnp.asarray(x.astype(np.dtype(dtype)))


def quantized(fmt, wf, block=32):
    return _q8(jnp.asarray(wf), block=(block, block)) if fmt == "fp8" else _q4(jnp.asarray(wf))


def make_weight(fmt, rng, n, k, dtype=jnp.float32):
    wf = rng.standard_normal((n, k), np.float32) * np.float32(0.05)
    if fmt in ("fp8", "fp4"):
        return quantized(fmt, wf)
    return jnp.asarray(wf.astype(np.dtype(dtype)))


@pytest.mark.parametrize("fmt,dtype,m,n,k,decode_gemv", [
    ("fp8", jnp.bfloat16, 3, 128, 256, "fma"), ("fp8", jnp.bfloat16, 3, 128, 256, "mma"),
    ("fp8", jnp.float32, 130, 256, 256, "fma"),
    ("fp4", jnp.bfloat16, 3, 128, 256, "fma"), ("fp4", jnp.bfloat16, 3, 128, 256, "mma"),
    ("fp4", jnp.float32, 130, 256, 256, "fma"),
    ("plain", jnp.bfloat16, 3, 128, 256, "fma"), ("plain", jnp.float32, 3, 128, 256, "fma"),
])
def test_parity_interpret(fmt, dtype, m, n, k, decode_gemv, monkeypatch):
    """GEMV (3 rows: the vector-unit fma kernel for quantized weights by default, or the tensor-core
    kernel with rows padded to 16) and tiled (130 rows: two 128-row tiles) configurations. The f32
    cases also spread the activation over many binades (fake-quant scales far from 1)."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    monkeypatch.setitem(pallas_triton_fma.DECODE_GEMV, "qmm", decode_gemv)
    rng = np.random.default_rng()  # fresh inputs every run
    x = activations(rng, (m, k), dtype)
    w = make_weight(fmt, rng, n, k, dtype)
    y = run(api.quantized_matmul, x, w, implementation="interpret")
    check_close(y, _reference(x, w))


@pytest.mark.parametrize("fmt,mode", [("fp8", "gather"), ("fp8", "mma8"), ("fp8", "mma8t"), ("fp4", "view3d"),
                                      ("fp8", "mx"), ("fp4", "mx")])
def test_split_k_leading_dims_scale_modes(fmt, mode, monkeypatch):
    monkeypatch.setitem(pallas_triton.SCALE_MODE, fmt, mode)
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((2, 3, 256), np.float32).astype(jnp.bfloat16))
    w = make_weight(fmt, rng, 64, 256)
    # 2 N blocks x 2 K splits x 2 K steps each, f32 output
    y = run(pallas_triton.quantized_matmul, x, w, out_dtype=jnp.float32, interpret=True, config=(16, 32, 64, 2, 4, 3))
    check_close(y, _reference(x, w, out_dtype=jnp.float32))


@pytest.mark.parametrize("m,bm", [(1, 16), (5, 16), (20, 16), (1, 8), (11, 8)])
def test_mma8t_decode_rows(m, bm, monkeypatch):
    """The swapped FP8 tensor-core GEMV (weight tile as the dot's first operand) at decode sizes:
    one row, rows padded to the 16- or 8-row tile, two row tiles; bf16 output, no K split, 64-row
    tiles."""
    monkeypatch.setitem(pallas_triton.SCALE_MODE, "fp8", "mma8t")
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((m, 512), np.float32).astype(jnp.bfloat16))
    w = make_weight("fp8", rng, 128, 512)
    y = run(pallas_triton.quantized_matmul, x, w, interpret=True, config=(bm, 64, 128, 1, 4, 3))
    assert y.shape == (m, 128) and y.dtype == jnp.bfloat16
    check_close(y, _reference(x, w))
    w128 = _q8(jnp.asarray(rng.standard_normal((128, 512), np.float32)), block=(128, 128))
    with pytest.raises(ValueError, match="'mma8t'.*only 32x32"):
        pallas_triton.quantized_matmul(x, w128, act_block=128, interpret=True, config=(16, 64, 128, 1, 4, 3))


def test_unsupported_reasons_and_dispatch():
    x = jnp.ones((2, 256), jnp.bfloat16)
    w_bad_n = _q8(jnp.ones((48, 256)))
    assert "multiple of 32" in pallas_triton.unsupported_reason(x, w_bad_n)
    w = _q8(jnp.ones((64, 256)))
    assert "act_block" in pallas_triton.unsupported_reason(x, w, act_block=128)
    assert "K=" in pallas_triton.unsupported_reason(jnp.ones((2, 128), jnp.bfloat16), w)
    assert pallas_triton.unsupported_reason(x, w) is None
    assert "multiple of 64" in pallas_triton.unsupported_reason(jnp.ones((1, 96)), jnp.ones((32, 96)))
    with pytest.raises(ValueError, match="cannot run this shape"):
        api.quantized_matmul(x, w_bad_n, implementation="interpret")
    # not explicit (context / env / auto): falls back to the reference
    with dispatch.use_implementation("interpret"):
        y = run(api.quantized_matmul, x, w_bad_n)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(_reference(x, w_bad_n), np.float32))


PROJECTIONS = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
               ("idx_wq_b", 4096, 1280), ("shared_w13", 2304, 5120), ("shared_w2", 5120, 2304),
               ("engram_wkv", 25600, 6144), ("dspark_main_proj", 5120, 15360)]
S = jax.ShapeDtypeStruct


def fp8_spec(n, k):
    return Fp8Tensor(S((n, k), jnp.float8_e4m3fn), S((n // 32, k // 32), jnp.float8_e8m0fnu), (32, 32))


def fp4_spec(n, k):
    return Fp4Tensor(S((n, k // 2), jnp.uint8), S((n, k // 32), jnp.float8_e8m0fnu), 32)


def _lower(target, m, w, dtype=jnp.bfloat16):
    k = w.shape[-1]
    txt = lower_for(target, lambda x, w: pallas_triton.quantized_matmul(x, w), S((m, k), dtype), w).as_text()
    assert pallas_triton_call_count(txt) >= 1


def pallas_triton_call_count(txt):
    from jax.experimental.pallas import triton as pltriton
    return txt.count(pltriton.CUSTOM_CALL_TARGET_NAME)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("name,n,k", PROJECTIONS)
def test_cross_lowering_fp8_real_shapes(target, name, n, k):
    for m in (1, 64, 4096):
        _lower(target, m, fp8_spec(n, k))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_cross_lowering_fp4_and_plain(target):
    for m in (1, 4096):
        _lower(target, m, fp4_spec(2304, 5120))
        _lower(target, m, fp4_spec(5120, 2304))
        _lower(target, m, S((1024, 4096), jnp.bfloat16))  # wo_a group, dequantized to bf16


def test_auto_gate_on_gpu(monkeypatch):
    """Plain 'auto' on a GPU keeps the reference for paths not yet verified on an H200."""
    x = jnp.ones((2, 256), jnp.bfloat16)
    w4, w8 = _q4(jnp.ones((64, 256))), _q8(jnp.ones((64, 256)))
    yr = _reference(x, w4)
    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve(None) == "pallas"
    assert pallas_triton.auto_reason(x, w4) is not None
    assert pallas_triton.auto_reason(jnp.ones((65, 256), jnp.bfloat16), w8) is not None
    assert pallas_triton.auto_reason(x, w8) is None
    txt = str(jax.make_jaxpr(api.quantized_matmul)(x, w4))  # the reference: no kernel in the program
    assert "pallas_call" not in txt
    y = run(api.quantized_matmul, x, w4)  # would need a GPU if it took the Pallas path
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(yr, np.float32))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_cross_lowering_experimental_modes(target, monkeypatch):
    """The opt-in scale modes lower for both targets at real shapes too."""
    for fmt, mode, spec in (("fp8", "gather", fp8_spec(5120, 8192)), ("fp8", "mma8", fp8_spec(5120, 8192)),
                            ("fp8", "mma8t", fp8_spec(5120, 8192)),
                            ("fp4", "view3d", fp4_spec(2304, 5120)), ("fp8", "mx", fp8_spec(5120, 8192)),
                            ("fp4", "mx", fp4_spec(2304, 5120))):
        monkeypatch.setitem(pallas_triton.SCALE_MODE, fmt, mode)
        for m in (1, 4096):
            _lower(target, m, spec)


@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("fmt,dtype,m,n,k,block", [
    ("fp8", jnp.bfloat16, 1, 64, 512, 32), ("fp8", jnp.float32, 3, 128, 1024, 32),
    ("fp8", jnp.float32, 2, 256, 512, 128), ("fp4", jnp.bfloat16, 1, 64, 512, 32),
    ("fp4", jnp.float32, 4, 96, 1024, 32),
])
def test_fma_gemv_parity_interpret(fmt, dtype, m, n, k, block, via, monkeypatch):
    """The vector-unit GEMV ("fma" configs: default, split K, 2 warps) against the reference, every
    element, with both weight decode routes (DSV41_FMA_DECODE); f32 cases spread x over many binades."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma
    from pallas_kernels.quantized_matmul.pallas_triton_fma import default_config

    monkeypatch.setattr(pallas_triton_fma, "FMA_DECODE", {"fp4": via, "fp8": via})
    rng = np.random.default_rng()
    x = activations(rng, (m, k), dtype)
    w = quantized(fmt, rng.standard_normal((n, k), np.float32) * np.float32(0.05), block)
    yr = _reference(x, w, act_block=block)
    base = default_config(m, n, k, w)
    ran = 0
    for cfg in (base, base[:3] + (1,) + base[4:], base[:3] + (2,) + base[4:], base[:4] + (2, 3)):
        try:
            y = run(pallas_triton.quantized_matmul, x, w, act_block=block, interpret=True, config=cfg)
        except ValueError as e:  # a split that does not divide this K
            assert "must split" in str(e)
            continue
        check_close(y, yr)
        ran += 1
    assert ran >= 2


@pytest.mark.parametrize("n,k,splits", [
    (4096, 1280, 5),   # idx_wq_b: 128 blocks of 5 steps < 132 SMs -> one step per program (640 programs)
    (1280, 5120, 10),  # wq_a: 40 blocks, 20 steps -> 10 splits of 2 steps (400 programs), not 20 of one
    (32768, 1280, 1),  # wq_b: 1,024 blocks already fill the GPU
    (5120, 2304, 3),   # shared_w2: 160 blocks x 3 splits of 3 steps (480 programs)
    (5120, 8192, 4),   # wo_b
])
def test_fma_default_k_splits(n, k, splits):
    """default_config's K split at one row (H200 session 32: fewer than 2 steps per program only when
    the grid would otherwise have fewer programs than SMs)."""
    from pallas_kernels.quantized_matmul.pallas_triton_fma import default_config

    w = fp8_spec(n, k)
    assert default_config(1, n, k, w) == ("fma", 32, 8, splits, 4, 3)


def test_fma_fill_sms_switch(monkeypatch):
    """DSV41_FMA_FILL_SMS=off restores the session-31 rule (two K steps per program at least):
    idx_wq_b back on 128 programs; anything but on / off is refused at import."""
    import subprocess
    import sys

    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setattr(fma, "FILL_SMS", "off")
    assert fma.default_config(1, 4096, 1280, fp8_spec(4096, 1280)) == ("fma", 32, 8, 1, 4, 3)
    assert fma.default_config(1, 1280, 5120, fp8_spec(1280, 5120)) == ("fma", 32, 8, 10, 4, 3)
    r = subprocess.run([sys.executable, "-c", "import pallas_kernels.quantized_matmul.pallas_triton_fma"],
                       env={**__import__("os").environ, "DSV41_FMA_FILL_SMS": "maybe"}, capture_output=True, text=True)
    assert r.returncode != 0 and "DSV41_FMA_FILL_SMS='maybe': expected on or off" in r.stderr


@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_fma_gemv_cross_lowering(target, via, monkeypatch):
    from pallas_kernels.quantized_matmul import pallas_triton_fma
    from pallas_kernels.quantized_matmul.pallas_triton_fma import default_config

    monkeypatch.setattr(pallas_triton_fma, "FMA_DECODE", {"fp4": via, "fp8": via})

    for w in (fp8_spec(1280, 5120), fp8_spec(32768, 1280), fp8_spec(5120, 8192), fp4_spec(2304, 5120),
              Fp8Tensor(S((4096, 8192), jnp.float8_e4m3fn), S((32, 64), jnp.float8_e8m0fnu), (128, 128))):
        for m in (1, 4):
            cfg = default_config(m, *w.shape, w)
            ab = w.block[0] if isinstance(w, Fp8Tensor) else 32
            txt = lower_for(target, lambda x, w: pallas_triton.quantized_matmul(x, w, act_block=ab, config=cfg),
                            S((m, w.shape[1]), jnp.bfloat16), w).as_text()
            assert pallas_triton_call_count(txt) == 1


def test_decode_gemv_switch(monkeypatch):
    """DSV41_DECODE_GEMV chooses the decode-size default per op; the fma GEMV takes <= 4 rows only."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    assert fma._parse_decode_gemv("fma") == {"qmm": "fma", "moe": "fma"}
    assert fma._parse_decode_gemv("qmm=fma,moe=mma") == {"qmm": "fma", "moe": "mma"}
    with pytest.raises(ValueError, match="DSV41_DECODE_GEMV"):
        fma._parse_decode_gemv("qmm=fast")
    w = fp8_spec(1280, 5120)
    for mode in ("mma", "fma"):
        monkeypatch.setitem(fma.DECODE_GEMV, "qmm", mode)
        for m, want in ((1, mode == "fma"), (4, mode == "fma"), (8, False)):
            txt = lower_for("cuda", lambda x, w: pallas_triton.quantized_matmul(x, w), S((m, 5120), jnp.bfloat16),
                            w).as_text()
            assert ("qmm_fma_fp8" in txt) == want, (mode, m)


def test_fp4_byte_decode_every_byte():
    """Route "e4m3": the fma kernels' two-nibbles-per-byte MXFP4 decode equals the per-nibble decode
    of the tensor-core kernels and the e2m1 table (times 2**-6), for all 256 byte values (both signs
    of zero included)."""
    from dsv41_jax.quant.codecs import E2M1_LUT16
    from pallas_kernels.quantized_matmul.pallas_triton_fma import fp4_byte_decode_f32

    b = jnp.arange(256, dtype=jnp.int32)
    lo, hi, shift = fp4_byte_decode_f32(b)
    lo, hi = np.asarray(lo), np.asarray(hi)
    assert shift == 6
    table = E2M1_LUT16 * np.float32(2.0**-shift)
    np.testing.assert_array_equal(lo, table[np.arange(256) & 15])
    np.testing.assert_array_equal(hi, table[np.arange(256) >> 4])
    np.testing.assert_array_equal(np.signbit(lo), (np.arange(256) & 8) > 0)
    np.testing.assert_array_equal(np.signbit(hi), np.arange(256) >= 128)
    np.testing.assert_array_equal(lo, np.asarray(pallas_triton._fp4_decode(b & 15)))
    np.testing.assert_array_equal(hi, np.asarray(pallas_triton._fp4_decode(b >> 4)))


def test_word_decodes_every_code():
    """Route "f16w": every e2m1 nibble value at every nibble position of a uint32 word, and every
    non-NaN e4m3 byte at every byte position, decode to the table value times the route's power of
    two, in the element order of act_view's phases (nibble j = element 8q + j, byte j = 4q + j)."""
    from dsv41_jax.quant.codecs import E2M1_LUT16
    from pallas_kernels.quantized_matmul.pallas_triton_fma import fp4_word_pairs_f32, fp8_word_pairs_f32

    rng = np.random.default_rng()
    nib = np.stack([np.roll(np.arange(16), s) for s in range(16)])[:, :8]  # every value at every position
    nib = np.concatenate([nib, rng.integers(0, 16, (64, 8))])
    words = np.zeros(len(nib), np.uint32)
    for j in range(8):
        words |= nib[:, j].astype(np.uint32) << (4 * j)
    pairs = fp4_word_pairs_f32(jnp.asarray(words))
    table = E2M1_LUT16 * np.float32(2.0**-14)
    for j, (lo, hi) in enumerate(pairs):
        np.testing.assert_array_equal(np.asarray(lo), table[nib[:, j]])
        np.testing.assert_array_equal(np.asarray(hi), table[nib[:, j + 4]])
    # the XLA word view is little-endian: byte t of a group = bits 8t.. of word t // 4
    packed = jnp.asarray(rng.integers(0, 256, (3, 16)), jnp.uint8)
    wv = np.asarray(__import__("pallas_kernels.quantized_matmul.pallas_triton_fma", fromlist=["_words"])._words(packed))
    assert wv.shape == (3, 4) and wv.dtype == np.uint32
    np.testing.assert_array_equal(wv & 0xFF, np.asarray(packed)[:, ::4])

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F])
    byt = np.stack([rng.permutation(codes)[:4] for _ in range(len(codes))])
    byt[:, 0] = codes
    byt[:, 3] = codes[::-1]
    words = np.zeros(len(byt), np.uint32)
    for j in range(4):
        words |= byt[:, j].astype(np.uint32) << (8 * j)
    (a0, a2), (a1, a3) = fp8_word_pairs_f32(jnp.asarray(words))
    e4 = lambda c: np.asarray(jnp.asarray(c.astype(np.uint8)).view(jnp.float8_e4m3fn).astype(jnp.float32))  # noqa: E731
    for j, got in enumerate((a0, a1, a2, a3)):
        np.testing.assert_array_equal(np.asarray(got), e4(byt[:, j]) * np.float32(2.0**-8))


def test_fma_decode_switch():
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    assert fma._parse_fma_decode("") == {"fp4": "f16w", "fp8": "e4m3"}  # the defaults
    assert fma._parse_fma_decode("f16w") == {"fp4": "f16w", "fp8": "f16w"}
    assert fma._parse_fma_decode("fp4=e4m3") == {"fp4": "e4m3", "fp8": "e4m3"}
    assert fma._parse_fma_decode("fp8=f16w,fp4=e4m3") == {"fp4": "e4m3", "fp8": "f16w"}
    for bad in ("fp32", "f16", "fp6=f16w"):
        with pytest.raises(ValueError, match="DSV41_FMA_DECODE"):
            fma._parse_fma_decode(bad)


def test_fma_default_falls_back_where_it_cannot_run(monkeypatch):
    """If the fma GEMV's default configuration cannot take a call (here: a default forced to 64-row
    programs, beyond the 32-wide FP8 block), the decode path is the tensor-core GEMV, still equal to
    the reference, instead of an error."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    monkeypatch.setattr(fma, "default_config", lambda m, n, k, w: ("fma", 64, 1, 1, 4, 3))
    rng = np.random.default_rng()
    w = _q8(jnp.asarray(rng.normal(size=(64, 256)) * 0.05, jnp.float32))
    assert "bn=64" in fma.unsupported_reason(1, w, fma.default_config(1, 64, 256, w))
    x = jnp.asarray(rng.normal(size=(2, 256)), jnp.float32)
    txt = str(jax.make_jaxpr(lambda x, w: pallas_triton.quantized_matmul(x, w, interpret=True))(x, w))
    assert "qmm_fp8" in txt and "qmm_fma" not in txt
    check_close(run(pallas_triton.quantized_matmul, x, w, interpret=True), _reference(x, w))


@pytest.mark.parametrize("fmt,dtype,m,ns,k,block", [
    ("fp8", jnp.float32, 1, (64, 96, 32), 512, 32), ("fp8", jnp.bfloat16, 3, (128, 64), 1024, 32),
    ("fp8", jnp.float32, 2, (256, 128), 512, 128), ("fp4", jnp.float32, 4, (96, 32), 512, 32),
])
def test_fma_multi_gemv_parity_interpret(fmt, dtype, m, ns, k, block):
    """One launch for several weights that read the same input (wq_a + wkv, the shared expert's w1 +
    w3) equals one reference call per weight, every element of every output, with and without split K."""
    from pallas_kernels.quantized_matmul.pallas_triton_fma import default_config

    rng = np.random.default_rng()
    x = activations(rng, (1, m, k), dtype)
    ws = [quantized(fmt, rng.standard_normal((n, k), np.float32) * np.float32(0.05), block) for n in ns]
    yrs = [_reference(x, w, act_block=block) for w in ws]
    base = pallas_triton.fused_gemv_config(x, ws, act_block=block)
    assert base == default_config(m, ns, k, ws[0])
    for cfg in (base, base[:3] + (1,) + base[4:]):
        ys = run(pallas_triton.quantized_matmul_multi, x, ws, act_block=block, interpret=True, config=cfg)
        assert [y.shape for y in ys] == [(1, m, n) for n in ns]
        for y, yr in zip(ys, yrs):
            check_close(y, yr)
            assert y.dtype == x.dtype


def test_multi_gemv_dispatch(monkeypatch):
    """api.quantized_matmul_multi: one fma launch where every weight fits (the pallas path), one call per
    weight where they cannot share it (another K, a plain weight, more than 4 rows, DSV41_FUSED_GEMV=off,
    DSV41_DECODE_GEMV=mma)
    and on the reference path (the kernels in interpret mode here); the values equal per-weight calls either way."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(2, 256)), jnp.float32)
    w1 = _q8(jnp.asarray(rng.normal(size=(64, 256)) * 0.05, jnp.float32))
    w2 = _q8(jnp.asarray(rng.normal(size=(96, 256)) * 0.05, jnp.float32))
    w_other_k = _q8(jnp.asarray(rng.normal(size=(64, 512)) * 0.05, jnp.float32))
    plain = jnp.asarray(rng.normal(size=(64, 256)) * 0.05, jnp.float32)

    def kernels(fn, *a):
        txt = str(jax.make_jaxpr(fn)(*a))
        return txt.count("pallas_call"), txt

    with dispatch.use_implementation("interpret"):
        n, txt = kernels(lambda x, a, b: api.quantized_matmul_multi(x, [a, b]), x, w1, w2)
        assert n == 1 and "qmm_fma_fp8_x2" in txt
        ys = run(api.quantized_matmul_multi, x, [w1, w2])
        for y, w in zip(ys, (w1, w2)):
            check_close(y, _reference(x, w))
        assert pallas_triton.fused_gemv_config(x, [w1, plain]) is None
        assert pallas_triton.fused_gemv_config(jnp.zeros((8, 256)), [w1, w2]) is None  # > 4 rows
        assert "does not share" in fma.multi_reason(2, [w1, w_other_k], fma.default_config(2, (64, 64), 256, w1))
        n, _ = kernels(lambda x, a, b: api.quantized_matmul_multi(x, [a, b]), x, w1, plain)
        assert n == 2  # one kernel per weight (the plain one: the tensor-core kernel, as forced here)
        monkeypatch.setattr(fma, "FUSED_GEMV", False)  # DSV41_FUSED_GEMV=off: one fma launch per weight
        n, txt = kernels(lambda x, a, b: api.quantized_matmul_multi(x, [a, b]), x, w1, w2)
        assert n == 2 and "qmm_fma_fp8_x2" not in txt and "qmm_fma_fp8" in txt
        monkeypatch.setattr(fma, "FUSED_GEMV", True)
        monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "mma")
        n, txt = kernels(lambda x, a, b: api.quantized_matmul_multi(x, [a, b]), x, w1, w2)
        assert n == 2 and "qmm_fma" not in txt
    with dispatch.use_implementation("reference"):
        n, _ = kernels(lambda x, a, b: api.quantized_matmul_multi(x, [a, b]), x, w1, w2)
        assert n == 0
        for y, w in zip(run(api.quantized_matmul_multi, x, [w1, w2]), (w1, w2)):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(_reference(x, w)))


@pytest.mark.parametrize("dtype,m,splits,widths", [
    (jnp.bfloat16, 1, 10, (1280, 512)), (jnp.bfloat16, 3, 4, (96, 32)), (jnp.float32, 2, 1, (48, 64)),
])
def test_split_finish_interpret(dtype, m, splits, widths):
    """The split-K finish kernel: outputs without a norm are the K parts summed in order (part 0
    first) and rounded, bit for bit; normalized outputs equal the model's rms_norm of those rounded
    sums within one ulp of the output (the sum of squares in another order)."""
    from dsv41_jax.layers import rms_norm
    from pallas_kernels.quantized_matmul.pallas_triton_finish import split_finish

    rng = np.random.default_rng()
    n = sum(widths)
    parts = rng.standard_normal((splits, m, n), np.float32) * np.exp2(rng.integers(-6, 6, (splits, m, n)))
    parts = parts.astype(np.float32)
    nw = jnp.asarray((rng.uniform(0.5, 1.5, widths[0])).astype(np.float32)).astype(jnp.bfloat16)
    eps = 1e-6
    for normed in (True, False):
        norms = [nw if normed else None, None]
        outs = jax.jit(lambda p, w: split_finish(p, widths, [w if normed else None, None], eps=eps, out_dtype=dtype,
                                                 interpret=True))(jnp.asarray(parts), nw)
        acc = parts[0].copy()
        for s_ in range(1, splits):
            acc = acc + parts[s_]  # float32, in order
        ys = np.split(np.asarray(jnp.asarray(acc).astype(dtype)), np.cumsum(widths)[:-1], axis=-1)
        for j, (o, y) in enumerate(zip(outs, ys)):
            assert o.shape == (m, widths[j]) and o.dtype == dtype
            if norms[j] is None:
                np.testing.assert_array_equal(np.asarray(o), y)
            else:
                check_close(o, rms_norm(jnp.asarray(y), norms[j], eps))


def test_split_finish_reasons():
    """Shapes the finish kernel refuses, each with the reason named."""
    from pallas_kernels.quantized_matmul.pallas_triton_finish import finish_reason, split_finish

    w = jnp.ones((64,), jnp.float32)
    assert finish_reason((2, 1, 72), (64, 8), [w, None]) == "output 1: width 8 is not a multiple of 16"
    assert "do not add up" in finish_reason((2, 1, 100), (64, 32), [w, None])
    assert "expected (32,)" in finish_reason((2, 1, 96), (64, 32), [None, w])
    assert "2 norm weights for 1 outputs" in finish_reason((2, 1, 64), (64,), [w, None])
    with pytest.raises(ValueError, match="split_finish .pallas.: output 1: width 8"):
        split_finish(jnp.ones((2, 1, 72)), (64, 8), [w, None], eps=1e-6, out_dtype=jnp.bfloat16)


@pytest.mark.parametrize("dtype,m,ns,k", [(jnp.bfloat16, 1, (160, 64), 512), (jnp.float32, 3, (96, 32), 1024)])
def test_multi_gemv_norms(monkeypatch, dtype, m, ns, k):
    """api.quantized_matmul_multi with ``norms`` (wq_a's q_norm): on the kernel path one GEMV launch and
    one finish kernel, no XLA reduction, and the values equal the reference path's (per-weight
    reference calls, then the model's rms_norm) within an ulp; the reference path runs no kernel."""
    from dsv41_jax.layers import rms_norm
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    rng = np.random.default_rng()
    x = activations(rng, (1, m, k), dtype)
    ws = [quantized("fp8", rng.standard_normal((n, k), np.float32) * np.float32(0.05)) for n in ns]
    nw = jnp.asarray(rng.uniform(0.5, 1.5, ns[0]).astype(np.float32))
    eps = 1e-6
    want = [rms_norm(_reference(x, ws[0]), nw, eps), _reference(x, ws[1])]

    def fn(x, a, b, w):  # traced afresh in each dispatch context (a jit cache would keep the first)
        return api.quantized_matmul_multi(x, [a, b], norms=[w, None], norm_eps=eps)
    def outside_kernels(jaxpr):
        """Primitive names of the program outside its pallas_calls."""
        names = []
        for eqn in jaxpr.eqns:
            names.append(eqn.primitive.name)
            if eqn.primitive.name != "pallas_call":  # pjit / custom_jvp bodies
                for v in eqn.params.values():
                    sub = getattr(v, "jaxpr", v)
                    if hasattr(sub, "eqns"):
                        names += outside_kernels(sub)
        return names

    with dispatch.use_implementation("interpret"):
        closed = jax.make_jaxpr(lambda *a: fn(*a))(x, *ws, nw)
        prims = outside_kernels(closed.jaxpr)
        assert prims.count("pallas_call") == 2 and "qmm_split_finish" in str(closed)
        assert not {"reduce_sum", "rsqrt", "slice"} & set(prims), prims
        for y, yr in zip(run(fn, x, *ws, nw), want):
            assert y.shape == yr.shape and y.dtype == dtype
            check_close(y, yr)
    with dispatch.use_implementation("reference"):
        assert outside_kernels(jax.make_jaxpr(lambda *a: fn(*a))(x, *ws, nw).jaxpr).count("pallas_call") == 0
        for y, yr in zip(run(fn, x, *ws, nw), want):  # the same ops, fused by XLA in another program
            check_close(y, yr)
        with pytest.raises(ValueError, match="1 norm weights for 2 weights"):
            api.quantized_matmul_multi(x, ws, norms=[nw])


def test_multi_gemv_norms_auto(monkeypatch):
    """Under ``auto`` on a GPU the finish kernel follows every one-launch GEMV with norms (1-4 rows;
    measured at least as fast as XLA's sum + norm at 1, 2 and 4 rows with 8 warps, session 26), with
    8 warps; with the GEMMs on the reference (DSV41_KERNELS) neither kernel runs."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma
    from pallas_kernels.quantized_matmul.pallas_triton_finish import split_finish

    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    rng = np.random.default_rng()
    ws = [quantized("fp8", rng.standard_normal((n, 512), np.float32) * np.float32(0.05)) for n in (160, 64)]
    nw = jnp.ones((160,), jnp.bfloat16)

    def jaxpr(m):
        x = jax.ShapeDtypeStruct((m, 512), jnp.bfloat16)
        return str(jax.make_jaxpr(lambda x, a, b, w: api.quantized_matmul_multi(x, [a, b], norms=[w, None]))(
            x, *ws, nw))

    for m in (1, 2, 4):
        txt = jaxpr(m)
        assert txt.count("name=qmm_fma_fp8_x2") == 1 and txt.count("name=qmm_split_finish") == 1, m
    fin = str(jax.make_jaxpr(lambda p, w: split_finish(p, (64, 32), [w, None], eps=1e-6, out_dtype=jnp.bfloat16))(
        jnp.ones((2, 1, 96)), jnp.ones((64,))))
    assert "num_warps=8" in fin
    monkeypatch.setenv("DSV41_KERNELS", "quantized_matmul=reference")
    assert "pallas_call" not in jaxpr(1)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_fma_multi_gemv_cross_lowering(target):
    """V4.1-Flash's wq_a + wkv (1280 and 512 rows, K = 5120) and shared expert w1 + w3 (2304 rows each)
    lower to one Triton call for both vendors."""
    pairs = ((fp8_spec(1280, 5120), fp8_spec(512, 5120)), (fp8_spec(2304, 5120), fp8_spec(2304, 5120)))
    for ws in pairs:
        for m in (1, 4):
            x = S((1, m, 5120), jnp.bfloat16)
            cfg = pallas_triton.fused_gemv_config(x, ws)
            txt = lower_for(target, lambda x, a, b: pallas_triton.quantized_matmul_multi(x, [a, b], config=cfg),
                            x, *ws).as_text()
            assert pallas_triton_call_count(txt) == 1
    # wq_a + wkv with q_norm: the GEMV's K parts and the split-K finish kernel
    ws, nw = pairs[0], S((1280,), jnp.bfloat16)
    for m in (1, 4):
        x = S((1, m, 5120), jnp.bfloat16)
        txt = lower_for(target, lambda x, a, b, w: pallas_triton.quantized_matmul_multi(
            x, [a, b], norms=[w, None], norm_eps=1e-6), x, *ws, nw).as_text()
        assert pallas_triton_call_count(txt) == 2 and "qmm_split_finish" in txt


def test_use_decode_route_restores_on_errors():
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    before = dict(fma.FMA_DECODE)
    with pytest.raises(RuntimeError):
        with fma.use_decode_route("e4m3"):
            assert fma.FMA_DECODE == {"fp4": "e4m3", "fp8": "e4m3"}
            raise RuntimeError("inside")
    assert fma.FMA_DECODE == before
    assert fma.checked_routes(None) == [None] and fma.checked_routes(["f16w"]) == ["f16w"]


# grouped GEMV (wo_a): y[..., g, :] = x[..., g, :] @ W_g.T, no activation fake-quant. Same exact
# products as the reference's dequantized bf16 / f32 dot; only the fp32 summation order differs.
@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("fmt,dtype,lead,groups,n,k,block", [
    ("fp8", jnp.bfloat16, (1, 1), 8, 64, 256, 32),   # batch-1 decode
    ("fp8", jnp.float32, (2, 3), 4, 96, 512, 32),    # 6 rows per group (spec verify / batch), f32
    ("fp8", jnp.bfloat16, (8,), 2, 128, 512, 128),   # V4's 128x128 blocks, 8 rows
    ("fp4", jnp.float32, (1, 2), 4, 32, 256, 32),
])
def test_grouped_gemv_parity_interpret(fmt, dtype, lead, groups, n, k, block, via, monkeypatch):
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setattr(fma, "FMA_DECODE", {"fp4": via, "fp8": via})
    rng = np.random.default_rng()
    x = activations(rng, (*lead, groups, k), dtype)  # f32: values over many binades: no fake-quant may creep in
    w = quantized(fmt, rng.standard_normal((groups * n, k), np.float32) * np.float32(0.05), block)
    ref = _reference_grouped(x, w, groups=groups)
    assert ref.shape == (*lead, groups, n) and ref.dtype == dtype
    m = int(np.prod(lead))
    base = fma.grouped_config(m, w, groups)
    for cfg in (base, base[:3] + (1,) + base[4:]):  # default (split K) and one K part
        y = run(pallas_triton.grouped_matmul, x, w, groups=groups, interpret=True, config=cfg)
        assert y.shape == ref.shape and y.dtype == dtype
        check_close(y, ref)
    # the groups are not mixed up: each group's output depends on its own rows only
    x2 = np.array(x)
    x2[..., 0, :] *= -1
    y2 = np.asarray(run(pallas_triton.grouped_matmul, jnp.asarray(x2), w, groups=groups, interpret=True))
    ref = np.asarray(ref)
    check_close(y2[..., 1:, :], ref[..., 1:, :])
    check_close(y2[..., 0, :], -ref[..., 0, :])


def test_grouped_gemv_dispatch_and_reasons():
    """api.grouped_matmul: the kernel for quantized weights up to 8 rows per group, the reference for
    more rows and plain weights (identical values there); clear reasons for shapes it cannot take."""
    rng = np.random.default_rng()
    w = _q8(jnp.asarray(rng.normal(size=(4 * 64, 256)) * 0.05, jnp.float32))
    x = jnp.asarray(rng.normal(size=(1, 2, 4, 256)).astype(jnp.bfloat16))
    count = lambda fn, *a: str(jax.make_jaxpr(fn)(*a)).count("pallas_call")  # noqa: E731
    with dispatch.use_implementation("interpret"):
        assert count(lambda x, w: api.grouped_matmul(x, w, groups=4), x, w) == 1
        check_close(run(api.grouped_matmul, x, w, groups=4), _reference_grouped(x, w, groups=4))
        x9 = jnp.asarray(rng.normal(size=(9, 4, 256)), jnp.float32)  # 9 rows: the reference
        assert count(lambda x, w: api.grouped_matmul(x, w, groups=4), x9, w) == 0
        plain = run(lambda w: w.dequantize(jnp.float32), w)
        np.testing.assert_array_equal(np.asarray(run(api.grouped_matmul, x9, plain, groups=4)),
                                      np.asarray(_reference_grouped(x9, plain, groups=4)))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 4, 256\]"):
        api.grouped_matmul(x[..., :128], w, groups=4, implementation="interpret")
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        api.grouped_matmul(jnp.zeros((1, 3, 256), jnp.bfloat16), w, groups=3, implementation="interpret")
    assert "at most 8 rows" in pallas_triton.grouped_reason(x9, w, groups=4)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_grouped_gemv_cross_lowering(target):
    """V4.1-Flash's wo_a (8 groups x 1024 rows, K = 4096, FP8 32x32) and V4-Flash's (8 x 1024, K = 4096,
    128x128 blocks) at 1 and 8 rows per group: one Triton call for both vendors."""
    ws = (fp8_spec(8192, 4096),
          Fp8Tensor(S((8192, 4096), jnp.float8_e4m3fn), S((64, 32), jnp.float8_e8m0fnu), (128, 128)))
    for w in ws:
        for m in (1, 8):
            txt = lower_for(target, lambda x, w: pallas_triton.grouped_matmul(x, w, groups=8),
                            S((m, 1, 8, 4096), jnp.bfloat16), w).as_text()
            assert pallas_triton_call_count(txt) == 1 and "qmm_fma_fp8_grouped" in txt
