"""The fused MoE's opt-in float16-product route (``pallas_triton_fma.F16ACC``, ``DSV41_FMA_F16ACC``):
the activation's float16 view equals DeepSeek's fake-quant bit for bit (values and scales), the
prologue and finish kernels equal their XLA twin, the word arithmetic equals a float16 emulation in
numpy bit for bit, the whole MoE stays within a stated tolerance of the reference in interpret mode
(fresh random inputs, every element), and the kernels lower for cuda (portable and PTX forms) and
rocm (portable and gfx9 assembly forms) at the real V4.1 expert shapes. Bad flag values are refused by name."""

import os

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ShapeDtypeStruct as S

from dsv41_jax.quant import Fp4Tensor, act_quant
from pallas_kernels.moe import gate_up_finish, pallas_triton, reference
from pallas_kernels.moe import benchmark as moe_benchmark
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma
from pallas_kernels.testing import jit_call as run, lower_for, random_moe_case

E, I, D, K = 8, 64, 256, 3

_reference = jax.jit(reference.moe_experts, static_argnames=("swiglu_limit", "act_block", "path"))


def make(seed, n, dtype, packing="f16pairs"):
    x, wts, idx, *ws = random_moe_case("fp4", seed, n, dtype, experts=E, inter=I, dim=D, topk=K)
    return (x, wts, idx, *[w.with_packing(packing) for w in ws])


def _word_halves(words):
    """uint32 pair words -> (low, high) float16 halves as float32 (numpy)."""
    w = np.asarray(words, np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return lo, hi


def _activation(rng, m, k, dtype):
    """Rows with blocks of very different sizes: plain normals, blocks scaled by 2**-30 (below the
    quantizer's 1e-4 amax floor), by 2**12, and a block holding one large value among tiny ones (its
    small entries land on e4m3 subnormals)."""
    x = rng.standard_normal((m, k), np.float32)
    x[:, 32:64] *= np.float32(2.0**-30)
    x[:, 64:96] *= np.float32(2.0**12)
    x[:, 96:128] *= np.float32(2.0**-14)
    x[:, 96] = np.float32(300.0)
    return jnp.asarray(x.astype(np.dtype(dtype)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_f16_view_is_the_fake_quant(dtype):
    """lo/hi halves times the block scale = act_view(act_quant(x)) bit for bit, |q * 2**7| <= 57,344."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    x = _activation(rng, 3, D, dtype)
    w = make(1, 1, jnp.float32)[3]
    *pairs, scale = jax.jit(lambda x: fma.act_view16(x, w))(x)
    want = jax.jit(lambda x: fma.act_view(act_quant(x, 32), w))(x)  # 8 phases [M, K/32, 4] f32
    assert len(pairs) == 4 and all(p.dtype == jnp.uint32 and p.shape == (3, D // 32, 4) for p in pairs)
    assert scale.shape == (3, D // 32) and scale.dtype == jnp.float32
    sc = np.asarray(scale)[..., None]
    for j, p in enumerate(pairs):
        lo, hi = _word_halves(p)
        assert np.max(np.abs(lo)) <= 448 * 128 and np.max(np.abs(hi)) <= 448 * 128
        np.testing.assert_array_equal(lo * sc, np.asarray(want[j]))
        np.testing.assert_array_equal(hi * sc, np.asarray(want[j + 4]))
    assert np.count_nonzero(np.asarray(want[0])) > 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prologue_kernel_is_its_xla_twin(dtype):
    rng = np.random.default_rng(np.random.randint(1 << 30))
    x = _activation(rng, 2, D, dtype)
    w = make(2, 1, jnp.float32)[3]
    got = run(fma.act_quant_view, x, w, interpret=True, f16=True)
    want = jax.jit(lambda x: fma.act_view16(x, w))(x)
    assert len(got) == len(want) == 5
    for g, wnt in zip(got, want):
        assert g.dtype == wnt.dtype and g.shape == wnt.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt))


@pytest.mark.parametrize("splits,dtype", [(2, jnp.bfloat16), (3, jnp.float32)])
def test_finish_kernel_f16_is_its_xla_twin(splits, dtype):
    rng = np.random.default_rng(np.random.randint(1 << 30))
    rows = 4
    parts = jnp.asarray(rng.standard_normal((splits, 2, rows, I), np.float32) * np.float32(0.7))
    wts = jnp.asarray(rng.uniform(0.05, 1.0, rows).astype(np.float32))
    w1 = make(3, 1, jnp.float32)[3]
    got = run(gate_up_finish.finish_act_quant_view, parts, wts, w1, x_dtype=dtype, limit=1.0, interpret=True, f16=True)
    h = jax.jit(lambda p, w: gate_up_finish.finish_reference(p, w, dtype, 1.0))(parts, wts)
    want = jax.jit(lambda h: fma.act_view16(h, w1))(h)
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt))


def _f16_chains(words, xwords):
    """numpy float16 emulation of ``fma.f16x2_dot4``: per half, products added in order j = 0..3,
    each add rounded to float16; then lo + hi in float32."""
    los, his = zip(*(_word_halves(w) for w in words))
    xlos, xhis = zip(*(_word_halves(x) for x in xwords))
    lo = hi = None
    for j in range(4):
        pl_ = (los[j].astype(np.float16) * xlos[j][None].astype(np.float16))
        ph = (his[j].astype(np.float16) * xhis[j][None].astype(np.float16))
        lo, hi = (pl_, ph) if lo is None else ((lo + pl_).astype(np.float16), (hi + ph).astype(np.float16))
    return lo.astype(np.float32) + hi.astype(np.float32)


def test_word_arithmetic_matches_a_float16_emulation():
    """Placed MXFP4 words (every code, random) against activation pair words of q * 2**7 values
    (random e4m3 values, subnormals included): the portable form equals numpy's float16 chains bit for
    bit, every product is exact, and the result is within 4 float16 roundings of the float64 sum."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    bn, kg = 16, 8
    raw = jnp.asarray(rng.integers(0, 1 << 32, (bn, kg, 4), dtype=np.uint64).astype(np.uint32))
    words = jax.jit(lambda r: fma.fp4_placed_words(r, "f16pairs"))(raw)
    q = rng.standard_normal((8, kg, 4)).astype(np.float32) * np.float32(60.0)
    q[:, :2] *= np.float32(2.0**-12)  # e4m3 subnormals
    qe = np.asarray(jnp.asarray(q).astype(jnp.float8_e4m3fn).astype(jnp.float32)) * np.float32(128.0)
    xw = [np.asarray(fma.f16_pair_word(jnp.asarray(qe[j], jnp.float16), jnp.asarray(qe[j + 4], jnp.float16)))
          for j in range(4)]
    got = np.asarray(jax.jit(lambda *a: fma.f16x2_dot4(a[:4], a[4:]))(*words, *xw))
    want = _f16_chains([np.asarray(w) for w in words], xw)
    np.testing.assert_array_equal(got, want)
    los, his = zip(*(_word_halves(w) for w in words))
    xl, xh = zip(*(_word_halves(x) for x in xw))
    exact = sum(los[j].astype(np.float64) * xl[j][None] + his[j].astype(np.float64) * xh[j][None] for j in range(4))
    mag = sum(np.abs(los[j].astype(np.float64) * xl[j][None]) + np.abs(his[j].astype(np.float64) * xh[j][None])
              for j in range(4))
    assert np.all(np.abs(got - exact) <= 4 * 2.0**-11 * mag + 2.0**-24)
    assert np.count_nonzero(got) > bn * kg  # not a degenerate draw


# Tolerance of the route: products exact, each word's two chains of four rounded to float16 (11
# bits), so h moves by ~1e-4 relative and some of its FP8 roundings flip (one e4m3 step of one h
# entry), which the down projection spreads over the whole output row (at I = 64 one flip is a
# large share of a row): max error <= 3e-2 of max|y| and mean error <= 1e-2. Session 51's CPU probe
# over 180 draws of these cases (seeds 0-59): max error 1.0e-4 .. 1.76e-2 (4 draws above session 50's
# 1e-2 bound, which this test then failed on now and then), mean error at most 4.1e-3 (one token,
# where one flip moves 9 % of the row's elements by over 1 %, so no per-element share is asserted);
# the H100 benchmark at the real shapes: 3.4e-3 at 1 token, 6.5e-3 at 8. A wrong scale or pairing
# is off by O(max|y|).
@pytest.mark.parametrize("n,dtype,packing", [(1, jnp.bfloat16, "f16pairs"), (2, jnp.float32, "f16pairs"),
                                             (9, jnp.bfloat16, "f16pairs"), (1, jnp.float32, "nibbles")])
def test_moe_f16acc_within_tolerance_of_the_reference(n, dtype, packing, monkeypatch):
    x, wts, idx, *ws = make(np.random.randint(1 << 30), n, dtype, packing)
    cfg = pallas_triton.default_fma_config(ws[0], routing_shape=(n, idx.shape[1]))
    kw = dict(swiglu_limit=1.0, interpret=True, config=cfg)
    assert _views_built(monkeypatch, "on", x, wts, idx, ws) == [True, True]  # the float16 view reached the kernels
    monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc("on"))
    y = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw), np.float64)
    yr = np.asarray(_reference(x, wts, idx, *ws, swiglu_limit=1.0), np.float64)
    scale = float(np.max(np.abs(yr)))
    assert np.all(np.isfinite(y)) and np.std(y) > 0
    assert np.max(np.abs(y - yr)) <= 3e-2 * scale and np.mean(np.abs(y - yr)) <= 1e-2 * scale
    # the assembly modes in interpret mode run their portable twin: the same values
    for mode in ("ptx", "gcn"):
        monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc(mode))
        np.testing.assert_array_equal(np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw), np.float64), y)


def _views_built(monkeypatch, mode, x, wts, idx, ws):
    """The ``f16`` arguments the MoE passed to its two view-writing kernels under ``mode``."""
    seen = []

    def spy(real):
        def wrapped(*a, **k):
            seen.append(bool(k.get("f16", False)))
            return real(*a, **k)
        return wrapped

    monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc(mode))
    monkeypatch.setattr(fma, "act_quant_view", spy(fma.act_quant_view))
    monkeypatch.setattr(pallas_triton, "finish_act_quant_view", spy(pallas_triton.finish_act_quant_view))
    txt = str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, swiglu_limit=1.0, interpret=True))(x, wts, idx, *ws))
    assert "moe_gate_up_fma_fp4" in txt and "moe_down_fma_fp4" in txt
    monkeypatch.undo()
    return seen


def test_off_is_the_float32_route(monkeypatch):
    """With the flag off (the default) both views are the float32 phases; "on" builds both as the
    float16 view; V4's 128-element activation blocks keep the float32 route."""
    x, wts, idx, *ws = make(5, 1, jnp.bfloat16)
    assert _views_built(monkeypatch, "off", x, wts, idx, ws) == [False, False]
    assert _views_built(monkeypatch, "on", x, wts, idx, ws) == [True, True]
    monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc("on"))
    assert fma.f16acc_for(ws[0], 32) == "on" and fma.f16acc_for(ws[0], 128) is False


@pytest.mark.parametrize("target,mode", [("cuda", "on"), ("cuda", "ptx"), ("rocm", "on"), ("rocm", "gcn")])
def test_f16acc_cross_lowering_real_shapes(target, mode, monkeypatch):
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32, "f16pairs")
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32, "f16pairs")
    monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc(mode))
    for n in (1, 8):
        txt = lower_for(target, lambda x, w, idx, a, b, c: pallas_triton.moe_experts(
            x, w, idx, a, b, c, swiglu_limit=10.0),
            S((n, d), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32), w1, w2, w1).as_text()
        for name in ("moe_gate_up_fma_fp4", "moe_down_fma_fp4"):
            assert txt.count(f'name = "{name}"') == 1, (n, name)


def test_asm_forms_in_the_kernel_source(monkeypatch):
    """"ptx" writes the f16x2 multiply-adds as inline PTX, "gcn" as gfx9 ``v_pk_fma_f16``; "on" neither."""
    from pallas_kernels.inspect_sass import triton_kernels

    x, wts, idx, *ws = make(6, 1, jnp.bfloat16)
    specs = [S(a.shape, a.dtype) if not isinstance(a, Fp4Tensor) else a for a in (x, wts, idx)]
    found = {}
    for mode, target in (("on", "cuda"), ("on", "rocm"), ("ptx", "cuda"), ("gcn", "rocm")):
        monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc(mode))
        # a new function per mode: jax.jit caches the trace of one function object (the flag is read
        # at trace time)
        fn = lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=1.0)  # noqa: E731
        ks = [k for k in triton_kernels(fn, *specs, *ws, target=target) if "fma_fp4" in k["name"]]
        found[mode, target] = [sum(k["ttir"].count(op) for k in ks) for op in ("fma.rn.f16x2", "v_pk_fma_f16")]
    assert found["on", "cuda"] == found["on", "rocm"] == [0, 0], found
    assert found["ptx", "cuda"][0] > 0 and found["ptx", "cuda"][1] == 0, found
    assert found["gcn", "rocm"][1] > 0 and found["gcn", "rocm"][0] == 0, found


@pytest.mark.parametrize("mode,version,ok", [("ptx", "rocm 7.0", False), ("gcn", "cuda 13000", False),
                                             ("ptx", "cuda 13000", True), ("gcn", "rocm 7.0", True)])
def test_asm_refused_on_the_other_vendor(mode, version, ok, monkeypatch):
    class Client:
        platform_version = version

    class Dev:
        client = Client()

    w1 = make(7, 1, jnp.float32)[3]
    monkeypatch.setattr(fma, "F16ACC", fma._parse_f16acc(mode))
    monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
    if ok:
        assert fma.f16acc_for(w1, 32) == mode
    else:
        with pytest.raises(ValueError, match=f"DSV41_FMA_F16ACC={mode} is inline.*DSV41_FMA_F16ACC=on"):
            fma.f16acc_for(w1, 32)
    assert fma.f16acc_for(w1, 32, interpret=True) == "on"
    assert fma.f16acc_for(w1, 128) is False  # V4's activation blocks: the float32 route


def test_flag_values_are_checked():
    assert fma._parse_f16acc("") == {"mode": "off"} and fma._parse_f16acc(" PTX ") == {"mode": "ptx"}
    with fma.use_f16acc(True):
        assert fma.F16ACC == {"mode": "on"}
        with fma.use_f16acc("gcn"):
            assert fma.F16ACC == {"mode": "gcn"}
        assert fma.F16ACC == {"mode": "on"}
    assert fma.F16ACC == fma._parse_f16acc(os.environ.get("DSV41_FMA_F16ACC", ""))  # restored
    with pytest.raises(ValueError, match="DSV41_FMA_F16ACC='fast'.*off, on, ptx, gcn"):
        fma._parse_f16acc("fast")
    assert moe_benchmark.f16acc_modes("off,ptx") == ("off", "ptx")
    with pytest.raises(ValueError, match="--f16acc"):
        moe_benchmark.f16acc_modes("off,half")


def test_float16_rows_are_named_not_inferred():
    """The tile arithmetic takes the float16 view because the caller says so (``f16``), not from its
    rows' entry count; FP8 tiles, non-word MXFP4 routes and rows that are not the view refuse it by
    name. (The default route's Triton IR is the same as before the flag, checked at the change.)"""
    rows = [[jnp.zeros((2, 4), jnp.uint32)] * 4 + [jnp.ones((2,), jnp.float32)]]
    with pytest.raises(ValueError, match="MXFP4 weights only"):
        fma.partials("fp8", (None, None), rows, f16="on")
    with pytest.raises(ValueError, match="word route .* got route 'e4m3'"):
        fma.partials("fp4", (None, None), rows, route="e4m3", f16="ptx")
    with pytest.raises(ValueError, match=r"rows of \[8\] entries"):
        fma.partials("fp4", (None, None), [[None] * 8], route="f16pairs", f16="on")
