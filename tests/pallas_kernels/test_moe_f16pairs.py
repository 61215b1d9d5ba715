"""The MoE and GEMV kernels on MXFP4 weights packed as "f16pairs" (``dsv41_jax.quant.codecs``): the
same codes decoded with 11 integer ops per word instead of 15, so every result is bit-identical to
the nibble-packed weights' through the same kernel (the same f32 values in the same order), and
within the parity tolerance of the reference. Interpret mode, and the cuda / rocm lowerings."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp4Tensor, quantize_mxfp4
from pallas_kernels.moe import pallas_triton
from pallas_kernels.testing import lower_for

from test_moe import D, I, _moe_launches, _reference, make, run


def _packed(ws, packing="f16pairs"):
    return [w.with_packing(packing) for w in ws]


def _check(y, yr, dtype):
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    assert np.all(np.isfinite(y)) and np.std(y) > 0
    np.testing.assert_allclose(y, yr, rtol=tol, atol=tol * float(np.max(np.abs(yr))))


# fma kernels: the dispatch's own config (one token: the gate/up and down K splits where they
# divide), and 4-row blocks at 9 tokens
@pytest.mark.parametrize("n,bt,dtype", [(1, None, jnp.bfloat16), (2, None, jnp.float32), (9, 4, jnp.bfloat16)])
def test_fma_moe_bit_identical_to_nibbles(n, bt, dtype):
    x, wts, idx, *ws = make("fp4", np.random.randint(1 << 30), n, dtype)
    cfg = pallas_triton.default_fma_config(ws[0], routing_shape=(n, idx.shape[1]))
    if bt is not None:
        cfg = cfg[:1] + (bt,) + cfg[2:]
    kw = dict(swiglu_limit=1.0, interpret=True, config=cfg)
    y0 = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    wp = _packed(ws)
    txt = str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **kw))(x, wts, idx, *wp))
    assert "moe_gate_up_fma_fp4" in txt
    y1 = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *wp, **kw))
    np.testing.assert_array_equal(y1, y0)
    _check(y1, np.asarray(_reference(x, wts, idx, *wp, swiglu_limit=1.0)), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tensor_core_moe_reads_f16pairs_as_words(dtype, monkeypatch):
    """The tensor-core kernels read f16pairs experts with the word route whatever DSV41_MMA_FP4 says
    (the byte route reads nibbles): bit-identical to nibble experts on the word route, and within
    tolerance of the byte route and the reference."""
    x, wts, idx, *ws = make("fp4", np.random.randint(1 << 30), 40, dtype)
    kw = dict(swiglu_limit=1.0, interpret=True, config=(16, 32, 64, 32, 32, 4))
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "f16w")
    yw = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "bytes")
    yb = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    wp = _packed(ws)
    txt = str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **kw))(x, wts, idx, *wp))
    assert "moe_gate_up_fp4" in txt and "uint32" in txt  # tensor-core kernels, reading words
    yp = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *wp, **kw))
    np.testing.assert_array_equal(yp, yw)
    yr = np.asarray(_reference(x, wts, idx, *ws, swiglu_limit=1.0))
    _check(yp, yb, dtype)
    _check(yp, yr, dtype)


def test_word_route_tiling_for_f16pairs():
    """The tensor-core default tiling of f16pairs experts at decode-like sizes takes 64-wide K tiles
    (the word route at 256 was twice as slow); the byte route keeps 256."""
    assert pallas_triton._config(300, 384, 2304, 5120)[2::2] == (256, 256)
    assert pallas_triton._config(300, 384, 2304, 5120, words_only=True)[2::2] == (64, 64)
    assert pallas_triton._config(24576, 96, 2304, 5120, words_only=True) == pallas_triton._config(24576, 96, 2304, 5120)


def test_mixed_packings_are_refused():
    x, wts, idx, w1, w2, w3 = make("fp4", 0, 1, jnp.float32)
    wp = w1.with_packing("f16pairs")
    reason = pallas_triton.unsupported_reason(x, wts, idx, wp, w2, w3)
    assert reason == "w1, w2, w3 must share one MXFP4 packing, got ['f16pairs', 'nibbles', 'nibbles']"
    from pallas_kernels.moe import api

    with pytest.raises(ValueError, match="share one MXFP4 packing"):
        api.moe_experts(x, wts, idx, wp, w2, w3, swiglu_limit=1.0, implementation="interpret")


def test_fma_gemv_bit_identical_to_nibbles():
    """The fma GEMV kernel decodes f16pairs weights too (bit-identical); the quantized_matmul
    dispatch, whose other kernels read nibbles only, says so and falls back to the reference under
    auto / a context, which dequantizes either packing alike."""
    from pallas_kernels import dispatch
    from pallas_kernels.quantized_matmul import api as qapi
    from pallas_kernels.quantized_matmul import pallas_triton as qmm
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    rng = np.random.default_rng()
    w = jax.jit(quantize_mxfp4)(jnp.asarray(rng.standard_normal((64, 256), np.float32)))
    x = jnp.asarray(rng.standard_normal((2, 256), np.float32).astype(jnp.bfloat16))
    cfg = fma.default_config(2, 64, 256, w)
    f = lambda x, w: fma.quantized_matmul_fma(x, w, act_block=32, out_dtype=jnp.float32, config=cfg, interpret=True)  # noqa: E731
    wp = w.with_packing("f16pairs")
    y0, y1 = np.asarray(jax.jit(f)(x, w)), np.asarray(jax.jit(f)(x, wp))
    np.testing.assert_array_equal(y1, y0)
    assert np.std(y1) > 0
    assert "packed as 'f16pairs'" in qmm.unsupported_reason(x, wp)
    with pytest.raises(ValueError, match="f16pairs"):
        qapi.quantized_matmul(x, wp, implementation="interpret")
    with dispatch.use_implementation("interpret"):
        yf = np.asarray(jax.jit(lambda x, w: qapi.quantized_matmul(x, w))(x, wp))
    yr = np.asarray(jax.jit(lambda x, w: qapi.quantized_matmul(x, w, implementation="reference"))(x, w))
    np.testing.assert_array_equal(yf, yr)
    with pytest.raises(ValueError, match="packing"):
        fma.quantized_matmul_fma_multi(x, [w, wp], act_block=32, out_dtype=jnp.float32, config=cfg, interpret=True)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_f16pairs_lowering_real_shapes(target):
    """V4.1's experts packed as f16pairs lower for both GPU targets: the fma kernels at 1 and 8 tokens
    and the tensor-core kernels at 300 (the dispatch's choices), two MoE launches each."""
    from jax import ShapeDtypeStruct as S

    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32, "f16pairs")
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32, "f16pairs")
    for n, fma_path in ((1, True), (8, True), (300, False)):
        txt = lower_for(target, lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=10.0),
                        S((n, d), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32), w1, w2, w1).as_text()
        assert _moe_launches(txt) == 2 and ("moe_gate_up_fma_fp4" in txt) == fma_path, n


def test_model_step_on_f16pairs_experts_gives_the_same_logits(monkeypatch):
    """One decode step of the tiny model (its first 3 layers, each with the fused MoE; 64-wide
    experts, so the fused MoE takes them) with its routed experts repacked: the MoE kernels
    (interpret mode) receive f16pairs experts and the logits equal those of the nibble experts bit
    for bit."""
    import functools

    from dsv41_jax import Model, transformer
    from dsv41_jax.cache import init_cache
    from tiny_short import tiny_short
    from dsv41_jax.options import RunOptions
    from dsv41_jax.params import init_params
    from dsv41_jax.quant import with_fp4_packing
    from pallas_kernels import dispatch

    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, impl, *a, **k: choose(
        op, impl if op == "moe_experts" else "reference", *a, **k))
    seen = []
    real = pallas_triton._moe_fma
    monkeypatch.setattr(pallas_triton, "_moe_fma", lambda *a, **k: seen.append(a[3].packing) or real(*a, **k))
    cfg = tiny_short(n_layers=3, moe_inter_dim=64)
    params = init_params(cfg, np.random.randint(1 << 30))
    opts = RunOptions(dtype="bfloat16")
    toks = jnp.asarray(np.random.default_rng().integers(3, 5000, (1, 1)), jnp.int32)
    ids = Model(cfg, params).engram_ids(np.asarray(toks), np.zeros((1, 1), np.int32))

    def logits(p):
        step = jax.jit(functools.partial(transformer.forward_step, cfg=cfg, opts=opts))
        with dispatch.use_implementation("interpret"):
            out, _ = step(p, init_cache(cfg, 1, 16, opts), toks, jnp.asarray([1], jnp.int32), ids)
        return np.asarray(out, np.float32)

    want = logits(params)
    assert seen and set(seen) == {"nibbles"}
    seen.clear()
    got = logits(with_fp4_packing(params, "f16pairs", only=lambda name, node: ".experts." in f".{name}."))
    assert seen and set(seen) == {"f16pairs"}
    assert np.std(want) > 0
    np.testing.assert_array_equal(got, want)


def test_sass_case_takes_the_packing():
    from pallas_kernels.inspect_sass import _cases

    _, _, _, _, w1, w2, _ = _cases("moe", 1, 16, None, "f16pairs")
    assert w1.packing == w2.packing == "f16pairs"
    assert I and D  # the shared shapes of test_moe


def test_model_step_takes_the_phase_route(monkeypatch):
    """A batch-8 decode step of the tiny model (its first 3 layers, each with the fused MoE) with
    128-wide experts (16 pairs over 8 experts: 2 rows per expert, so the dispatch picks the tensor-core kernels, and their
    128-wide K tiles the phase route under DSV41_MMA_FP4=auto), experts packed as f16pairs (the GPU default): its logits agree
    with the same step on the reference MoE."""
    import functools

    from dsv41_jax import Model, transformer
    from dsv41_jax.cache import init_cache
    from tiny_short import tiny_short
    from dsv41_jax.options import RunOptions
    from dsv41_jax.params import init_params
    from dsv41_jax.quant import with_fp4_packing
    from pallas_kernels import dispatch

    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "auto")
    choose = dispatch.choose
    moe_impl = {"impl": "interpret"}
    monkeypatch.setattr(dispatch, "choose", lambda op, impl, *a, **k: choose(
        op, moe_impl["impl"] if op == "moe_experts" else "reference", *a, **k))
    reads = []
    real = pallas_triton.fp4_read_for
    monkeypatch.setattr(pallas_triton, "fp4_read_for", lambda *a: reads.append(real(*a)) or reads[-1])
    cfg = tiny_short(n_layers=3, dim=128, moe_inter_dim=128)
    params = with_fp4_packing(init_params(cfg, np.random.randint(1 << 30)), "f16pairs",
                              only=lambda name, node: ".experts." in f".{name}.")
    opts = RunOptions(dtype="bfloat16")
    b = 8
    toks = jnp.asarray(np.random.default_rng().integers(3, 5000, (b, 1)), jnp.int32)
    ids = Model(cfg, params).engram_ids(np.asarray(toks), np.zeros((b, 1), np.int32))

    def logits(impl):
        moe_impl["impl"] = impl
        step = jax.jit(functools.partial(transformer.forward_step, cfg=cfg, opts=opts))
        with dispatch.use_implementation("interpret"):
            out, _ = step(params, init_cache(cfg, b, 16, opts), toks, jnp.full((b,), 1, jnp.int32), ids)
        return np.asarray(out, np.float32)

    got = logits("interpret")
    assert reads and set(reads) == {"phases"}
    want = logits("reference")
    assert np.std(want) > 0
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * float(np.std(want)))
