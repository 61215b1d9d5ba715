"""The fma gate/up kernel's K split (the fma config's 9th entry) and its finish
(:mod:`pallas_kernels.moe.gate_up_finish`): interpret-mode parity with the reference and with the
unsplit kernel on fresh random inputs, the finish kernel equal bit for bit to its XLA twin followed
by the act-quant view, refusal of splits that do not divide the K steps, and cuda / rocm lowering at
the real V4.1 expert shapes (the finish replaces the h act-quant prologue: still one launch there)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ShapeDtypeStruct as S

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, act_quant, quantize_mxfp4
from pallas_kernels.moe import gate_up_finish, pallas_triton, reference
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma
from pallas_kernels.testing import assert_split_close, jit_call as run, lower_for, random_moe_case

E, I, D, K = 8, 64, 256, 3  # D = 8 groups of 32: with kg_a 1 the gate/up kernel runs 8 K steps

_q4 = jax.jit(quantize_mxfp4, static_argnames="block")
_reference = jax.jit(reference.moe_experts, static_argnames=("swiglu_limit", "act_block", "path"))


def make(fmt, seed, n, dtype):
    return random_moe_case(fmt, seed, n, dtype, experts=E, inter=I, dim=D, topk=K)


def config(w1, bt, splits):
    cfg = list(pallas_triton.default_fma_config(w1))
    cfg[1], cfg[3] = bt, 1  # one K group per step: 8 steps to split
    return tuple(cfg) + (splits,)


# Same tolerance as test_moe's fma parity: same products, fp32 sums in another order (each split's
# sum, then the splits in order), g / u / h rounded to x.dtype and h to FP8 as in the reference.
@pytest.mark.parametrize("site", ["pallas", "xla"])
@pytest.mark.parametrize("fmt,n,bt,splits,dtype,limit", [
    ("fp4", 1, 1, 2, jnp.bfloat16, 1.0), ("fp4", 1, 1, 8, jnp.float32, 1.0), ("fp4", 2, 1, 4, jnp.bfloat16, 0.0),
    ("fp4", 9, 4, 2, jnp.float32, 1.0), ("fp8", 1, 1, 4, jnp.float32, 1.0), ("fp8", 6, 2, 2, jnp.bfloat16, 1.0),
])
def test_split_parity_interpret(fmt, n, bt, splits, dtype, limit, site, monkeypatch):
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", site)  # the finish as the prologue kernel, or XLA ops
    x, wts, idx, w1, w2, w3 = make(fmt, np.random.randint(1 << 30), n, dtype)
    y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=limit, interpret=True,
            config=config(w1, bt, splits))
    y1 = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=limit, interpret=True,
             config=config(w1, bt, 1))
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=limit)
    assert yr.shape == (n, D)
    assert_split_close(y, y1, yr, 2.0**-7 if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype,limit", [(jnp.bfloat16, 1.0), (jnp.float32, 0.0)])
@pytest.mark.parametrize("splits", [1, 3])
def test_finish_kernel_is_its_xla_twin_then_the_act_quant_view(splits, dtype, limit):
    """Bit for bit: the finish kernel's phases equal ``act_view(act_quant(finish_reference(...)))``,
    on partial sums spread over several binades (so the clamp, the rounding to ``dtype`` and the
    per-group FP8 scales all act)."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    rows, i_dim = 5, 128
    parts = rng.standard_normal((splits, 2, rows, i_dim)).astype(np.float32)
    parts *= np.exp2(rng.integers(-6, 3, size=(1, 1, rows, i_dim // 32, 1))).repeat(32, -1).reshape(1, 1, rows, i_dim)
    parts = jnp.asarray(parts)
    wts = jnp.asarray(rng.uniform(0.05, 1.0, rows).astype(np.float32))
    w1 = _q4(jnp.asarray(rng.standard_normal((2, 16, i_dim), np.float32)))
    got = run(gate_up_finish.finish_act_quant_view, parts, wts, w1, x_dtype=dtype, limit=limit, interpret=True)
    h = jax.jit(gate_up_finish.finish_reference, static_argnums=(2, 3))(parts, wts, dtype, limit)
    want = fma.act_view(act_quant(h, 32), w1)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_partials_sum_to_the_unsplit_gate_up():
    """The split kernel's stored partials, added over the splits, are the unsplit kernel's gate / up
    sums before the activation (float32 x: exact up to the sum order; checked to 1e-6)."""
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), 1, jnp.float32)
    got = {}

    def spy(parts, weights, x_dtype, limit):
        got["parts"] = parts
        return real(parts, weights, x_dtype, limit)

    real = pallas_triton.finish_reference
    import unittest.mock as mock

    with mock.patch.object(pallas_triton, "finish_reference", spy), mock.patch.dict(pallas_triton.DEBUG, {"return_h": True}):
        # eager (not jitted), so the spy sees the concrete partials
        pallas_triton.moe_experts(x, wts, idx, w1, w2, w3, swiglu_limit=0.0, interpret=True, config=config(w1, 1, 4))
    parts = np.asarray(got["parts"])
    assert parts.shape == (4, 2, K, I)
    xq = np.asarray(act_quant(x, 32), np.float64)
    wd1 = np.asarray(w1.dequantize(jnp.float32), np.float64)
    wd3 = np.asarray(w3.dequantize(jnp.float32), np.float64)
    for s, e in enumerate(np.asarray(idx)[0]):
        g = parts[:, 0, s].sum(0)
        u = parts[:, 1, s].sum(0)
        np.testing.assert_allclose(g, wd1[e] @ xq[0], rtol=1e-6, atol=1e-6 * np.abs(g).max())
        np.testing.assert_allclose(u, wd3[e] @ xq[0], rtol=1e-6, atol=1e-6 * np.abs(u).max())


def test_split_reasons():
    _, _, _, w1, _, _ = make("fp4", 0, 1, jnp.float32)
    assert pallas_triton.fma_reason(w1, config(w1, 1, 8)) is None
    assert pallas_triton.fma_splits(config(w1, 1, 8)) == 8
    assert pallas_triton.fma_splits(pallas_triton.default_fma_config(w1)) == 1
    r = pallas_triton.fma_reason(w1, config(w1, 1, 3))
    assert "K split (3) must divide its 8 K steps" in r, r
    assert "K split (0)" in pallas_triton.fma_reason(w1, config(w1, 1, 0))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_split_cross_lowering_real_shapes(target):
    """At the real expert shapes with 2 and 5 splits of the 10 K steps: the gate/up kernel, the finish
    (in place of the h act-quant prologue) and the down kernel; the x prologue as before."""
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32)
    for splits in (2, 5):
        cfg = pallas_triton.default_fma_config(w1) + (splits,)
        assert pallas_triton.fma_reason(w1, cfg) is None
        txt = lower_for(target, lambda x, w, idx, a, b, c: pallas_triton.moe_experts(
            x, w, idx, a, b, c, swiglu_limit=10.0, config=cfg),
            S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1, w2, w1).as_text()
        for name in ("moe_gate_up_fma_fp4", "moe_gate_up_finish", "moe_down_fma_fp4", "fma_act_quant"):
            assert txt.count(f'name = "{name}"') == 1, (splits, name)


def test_fp8_experts_take_the_split_too():
    """FP8 32x32 experts (V4.1's alternative format) lower with a split as well."""
    e, i, d = 16, 2304, 5120
    w1 = Fp8Tensor(S((e, i, d), jnp.float8_e4m3fn), S((e, i // 32, d // 32), jnp.float8_e8m0fnu), (32, 32))
    w2 = Fp8Tensor(S((e, d, i), jnp.float8_e4m3fn), S((e, d // 32, i // 32), jnp.float8_e8m0fnu), (32, 32))
    cfg = pallas_triton.default_fma_config(w1) + (2,)
    assert pallas_triton.fma_reason(w1, cfg) is None, pallas_triton.fma_reason(w1, cfg)
    txt = lower_for("cuda", lambda x, w, idx, a, b, c: pallas_triton.moe_experts(
        x, w, idx, a, b, c, swiglu_limit=10.0, config=cfg),
        S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1, w2, w1).as_text()
    assert txt.count('name = "moe_gate_up_finish"') == 1


def test_default_split_rule(monkeypatch):
    """``GATE_UP_SPLIT`` (DSV41_MOE_SPLITS) reaches the dispatch's config where the gate/up grid is
    small: one token (6 blocks x 144 programs) takes it, 8 tokens (48 blocks) do not, and a split that
    does not divide the 10 K steps is not taken."""
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32)

    def lowered(n):
        return lower_for("cuda", lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=10.0),
                         S((n, d), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32), w1, w2, w1).as_text()

    monkeypatch.setitem(fma.DECODE_GEMV, "moe", "fma")
    for splits, n, want in ((1, 1, False), (2, 1, True), (5, 1, True), (3, 1, False), (2, 8, False)):
        monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "splits", splits)
        assert ('name = "moe_gate_up_finish"' in lowered(n)) == want, (splits, n)
    assert pallas_triton.group_pairs_count(1, 6, 384, 1) == 6
    assert pallas_triton.group_pairs_count(8, 6, 384, 1) == 48 + 48


def test_splits_variable_is_checked():
    for bad in ("0", "-2", "two", "5,32", "5,32,0", "2,24,4", "2,16,3"):
        with pytest.raises(ValueError, match="DSV41_MOE_SPLITS"):
            pallas_triton._parse_splits(bad)
    assert pallas_triton._parse_splits("") == {"splits": pallas_triton.DEFAULT_SPLITS, "bi": None, "warps": None}
    assert pallas_triton.DEFAULT_SPLITS == 2
    assert pallas_triton._parse_splits(" 5 ") == {"splits": 5, "bi": None, "warps": None}
    assert pallas_triton._parse_splits("5, 32, 8") == {"splits": 5, "bi": 32, "warps": 8}


def test_down_variable_is_checked():
    for bad in ("-2", "two", "64", "64,8,2,1", "64,8,0", "64,0", "48,4", "64,6", "48,4,3"):
        with pytest.raises(ValueError, match="DSV41_MOE_DOWN"):
            pallas_triton._parse_down(bad)
    assert pallas_triton.DEFAULT_DOWN == (64, 4)
    d = pallas_triton.DEFAULT_DOWN_SPLITS
    assert pallas_triton._parse_down("") == {"bd": 64, "warps": 4, "splits": d}
    assert pallas_triton._parse_down(" 32, 8 ") == {"bd": 32, "warps": 8, "splits": d}
    assert pallas_triton._parse_down("64,4,3") == {"bd": 64, "warps": 4, "splits": 3}
    assert pallas_triton._parse_down("0") == {"bd": 16, "warps": 4, "splits": 1}


def test_split_rows_and_warps_reach_the_gate_up_kernel(monkeypatch):
    """With S,BI,W the split config has BI rows per gate/up program and W gate/up warps (10th
    entry); the down kernel takes DOWN_TILE's rows and warps (DSV41_MOE_DOWN), split or not, and the
    MXFP4 gate/up kernel 32 rows per program on large grids (16 on small ones, split or not)."""
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 64, 8, 4, 3, 2, 4, 3)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(8, 6)) == ("fma", 1, 32, 16, 64, 8, 4, 3)
    # the split rule counts the grid at 16 rows: 4 tokens (48 blocks x 144 programs) stay unsplit, on 32 rows
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(4, 6)) == ("fma", 1, 32, 16, 64, 8, 4, 3)
    # a small grid without the split keeps 16 gate/up rows: V4's 128-wide activation blocks at one
    # token, the split turned off, or no routing shape given
    # (the down split still applies there: DOWN_TILE, tests/pallas_kernels/test_moe_down_split.py)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6), act_block=128) == ("fma", 1, 16, 16, 64, 8, 4, 3, 1, 4, 3)
    assert pallas_triton.default_fma_config(w1, 1.0) == ("fma", 1, 16, 16, 64, 8, 4, 3)
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "splits", 1)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 64, 8, 4, 3, 1, 4, 3)
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "splits", 2)
    monkeypatch.setattr(pallas_triton, "DOWN_TILE", pallas_triton._parse_down("0"))
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 16, 8, 4, 3, 2, 4)  # "0": no down split
    monkeypatch.setattr(pallas_triton, "DOWN_TILE", pallas_triton._parse_down("32,2,1"))  # the gate/up kernel keeps 4 warps
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(8, 6)) == ("fma", 1, 32, 16, 32, 8, 2, 3, 1, 4)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 32, 8, 2, 3, 2, 4)
    monkeypatch.setattr(pallas_triton, "DOWN_TILE", pallas_triton._parse_down(""))
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "splits", 5)
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "bi", 32)
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "warps", 8)
    cfg = pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6))
    assert cfg == ("fma", 1, 32, 16, 64, 8, 4, 3, 5, 8, 3), cfg
    assert pallas_triton.fma_gate_up_warps(cfg) == 8 and pallas_triton.fma_gate_up_warps(cfg[:8]) == 4
    txt = lower_for("cuda", lambda x, w, idx, a, b, c: pallas_triton.moe_experts(
        x, w, idx, a, b, c, swiglu_limit=10.0, config=cfg),
        S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1,
        Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32), w1).as_text()
    assert txt.count('name = "moe_gate_up_finish"') == 1
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "bi", 7)  # does not divide I: the gate/up split is not taken
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 64, 8, 4, 3, 1, 4, 3)


def test_split_parity_with_other_rows_and_warps_interpret():
    """A split config with 32 rows per gate/up program and 2 gate/up warps (10th entry) against the
    reference, tiny V4.1-like shapes."""
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), 1, jnp.bfloat16)
    cfg = config(w1, 1, 4)
    cfg = cfg[:2] + (32,) + cfg[3:] + (2,)
    y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=1.0, interpret=True, config=cfg)
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yr), rtol=2.0**-7, atol=2.0**-7 * float(np.max(np.abs(yr))))


@pytest.mark.parametrize("order,warps", [("loads", 4), ("loads", 1), ("uses", 2)])
def test_finish_kernel_variants_give_the_default_bits(order, warps, monkeypatch):
    """``FINISH`` variants (load order, warps) give the default's outputs bit for bit (interpret
    mode) and lower for cuda and rocm; with "loads" every load comes before the first float add in the
    Triton IR (the real shapes: 2 splits, 6 rows, I = 2304); with "uses" not."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    parts = jnp.asarray(rng.standard_normal((2, 2, 3, 128)).astype(np.float32))
    wts = jnp.asarray(rng.uniform(0.05, 1.0, 3).astype(np.float32))
    w1 = _q4(jnp.asarray(rng.standard_normal((2, 16, 128), np.float32)))
    kw = dict(x_dtype=jnp.bfloat16, limit=1.0, interpret=True)
    want = run(gate_up_finish.finish_act_quant_view, parts, wts, w1, **kw)
    monkeypatch.setitem(gate_up_finish.FINISH, "order", order)
    monkeypatch.setitem(gate_up_finish.FINISH, "warps", warps)
    got = run(gate_up_finish.finish_act_quant_view, parts, wts, w1, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    from pallas_kernels import inspect_sass

    e, i, d = 384, 2304, 5120
    wf = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    fn = lambda p, w: gate_up_finish.finish_act_quant_view(p, w, wf, x_dtype=jnp.bfloat16, limit=10.0)  # noqa: E731
    specs = (S((2, 2, 6, i), jnp.float32), S((6,), jnp.float32))
    (k,) = inspect_sass.triton_kernels(fn, *specs)  # (before lower_for: a cached lowering is not captured)
    for target in ("cuda", "rocm"):
        lower_for(target, fn, *specs)
    assert k["name"] == "moe_gate_up_finish" and k["num_warps"] == warps
    lines = k["ttir"].splitlines()
    first_add = min(j for j, line in enumerate(lines) if "arith.addf" in line)  # the first split sum
    loads = [j for j, line in enumerate(lines) if "tt.load" in line and "tt.store" not in lines[j + 1]]
    assert len(loads) >= 8 * 2 * 2 + 1  # 8 phases x (gate, up) x 2 splits, the routing weight
    # "loads": every partial-sum load before the first sum; "uses": the phases' loads interleaved
    assert all(j < first_add for j in loads) == (order == "loads")


def test_default_split_only_where_its_finish_is_the_prologue_kernel(monkeypatch):
    """The default split is taken only where h's act-quant is the prologue kernel (V4.1's 32-wide
    activation blocks on MXFP4 experts): not with V4's 128-wide blocks, nor under
    DSV41_MOE_ACT_QUANT=xla (there the finish would be XLA ops, not measured)."""
    e, i, d = 256, 2048, 4096
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "splits", 2)
    assert len(pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6), act_block=32)) == 10
    assert len(pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6), act_block=128)) == 8
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", "xla")
    assert len(pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6), act_block=32)) == 8


def test_fp8_experts_keep_their_split_rule():
    """FP8 experts (32 x 32 blocks) keep 32 rows, split or not, and count their grid at 32 rows: the
    configs of session 28 (one token split; 3 and 8 tokens not)."""
    e, i, d = 384, 2304, 5120
    w1 = Fp8Tensor(S((e, i, d), jnp.float8_e4m3fn), S((e, i // 32, d // 32), jnp.float8_e8m0fnu), (32, 32))
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 32, 16, 32, 8, 4, 3, 2, 4)
    for n in (3, 8):
        assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(n, 6)) == ("fma", 1, 32, 16, 32, 8, 4, 3)
