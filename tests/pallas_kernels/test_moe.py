"""Fused MoE Pallas-Triton kernels: interpret-mode parity with the reference on fresh random inputs
(every element), grouping invariants, shape-support reasons, and cross-lowering for cuda (H200) and
rocm (gfx950) at the real V4.1 expert shapes (E=384, I=2304, D=5120, top-6); V4 formats (act_block
128, FP8 128x128 experts) at V4-Flash shapes (E=256, I=2048, D=4096)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, quantize_fp8, quantize_mxfp4
from pallas_kernels.moe import api, pallas_triton, reference
from pallas_kernels.testing import lower_for



E, I, D, K = 8, 64, 128, 3


# Inputs come from numpy (fresh unless a test fixes the seed) and the weights are quantized by one
# jitted program per shape; every kernel and reference call runs as one jitted program. Eager, each
# of the dozens of small jnp ops in the input builders, the dispatch glue and the reference compiled
# on its own (most of this module's time). Kernel calls get a fresh jax.jit each (``run``): switches
# that tests monkeypatch (MMA_FP4, GRID_ORDER, FMA_DECODE, ...) are read at trace time.
_q8 = jax.jit(quantize_fp8, static_argnames="block")
_q4 = jax.jit(quantize_mxfp4, static_argnames="block")
_reference = jax.jit(reference.moe_experts, static_argnames=("swiglu_limit", "act_block", "path"))


def run(fn, *args, **kw):
    """``fn(*args, **kw)`` as one freshly traced jitted program (``kw``: static arguments)."""
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def routed(rng, n, n_exp, dtype, d):
    """x [n, d] in ``dtype``, routing weights [n, K] in [0.05, 1), K distinct experts per token."""
    x = jnp.asarray(rng.standard_normal((n, d), np.float32).astype(np.dtype(dtype)))
    wts = jnp.asarray(rng.uniform(0.05, 1.0, (n, K)).astype(np.float32))
    idx = jnp.asarray(np.argsort(rng.random((n, n_exp)), axis=1)[:, :K].astype(np.int32))
    return x, wts, idx


def make(fmt, seed, n, dtype):
    rng = np.random.default_rng(seed)
    x, wts, idx = routed(rng, n, E, dtype, D)

    def w(shape):
        wf = rng.standard_normal(shape, np.float32) * np.float32(0.2)
        if fmt == "plain":
            return jnp.asarray(wf.astype(np.dtype(dtype)))
        return _q8(jnp.asarray(wf)) if fmt == "fp8" else _q4(jnp.asarray(wf))

    return x, wts, idx, w((E, I, D)), w((E, D, I)), w((E, I, D))


# Tolerance: same products as the reference, fp32 sums in another order. g, u, h and the per-pair
# down-projection outputs are rounded to x.dtype (and h to FP8) exactly as in the reference, so a
# rare rounding flip can move one term by one ulp of bf16 / one e4m3 step; the slot sum is fp32.
# rtol/atol relative to max|y|: bf16 x 2^-7, f32 x 1e-5.
@pytest.mark.parametrize("fmt,n,dtype,limit", [
    ("fp4", 1, jnp.bfloat16, 1.0), ("fp4", 6, jnp.bfloat16, 1.0), ("fp4", 40, jnp.float32, 1.0),
    ("fp8", 6, jnp.bfloat16, 1.0), ("fp8", 40, jnp.float32, 0.0),
    ("plain", 6, jnp.float32, 1.0), ("plain", 40, jnp.bfloat16, 0.0),
])
def test_parity_interpret(fmt, n, dtype, limit):
    seed = np.random.randint(1 << 30)
    x, wts, idx, w1, w2, w3 = make(fmt, seed, n, dtype)
    y = run(api.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=limit, implementation="interpret")
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=limit)
    assert y.shape == (n, D) and y.dtype == jnp.float32
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    y, yr = np.asarray(y), np.asarray(yr)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, yr, rtol=tol, atol=tol * float(np.max(np.abs(yr))))


def test_decode_grouping_is_the_inputs():
    """One-row blocks at 1-2 tokens: block_expert is the indices themselves (a negative one, an
    expert on another device under expert parallelism, stays negative and its block is skipped),
    the weights themselves, and literal constants; no op computes them (not even an iota: XLA runs
    one as a kernel of its own before a custom call)."""
    idx = jnp.asarray([[5, -1, 17, 3, 60, 2], [9, 8, 7, -1, -1, 0]], jnp.int32)
    wts = jnp.asarray(np.random.default_rng().uniform(size=(2, 6)), jnp.float32)
    be, bp, btok, bw = pallas_triton.group_pairs(idx, wts, n_exp=64, bt=1)
    np.testing.assert_array_equal(be, np.asarray(idx).reshape(-1))
    np.testing.assert_array_equal(bw, np.asarray(wts).reshape(-1))
    np.testing.assert_array_equal(bp, np.arange(12))
    np.testing.assert_array_equal(btok, np.arange(12) // 6)
    jx = jax.make_jaxpr(lambda i, w: pallas_triton.group_pairs(i, w, n_exp=64, bt=1))(idx, wts).jaxpr
    assert not [e for e in jx.eqns if e.primitive.name in ("select_n", "gather", "scatter", "sort", "iota")]


@pytest.mark.parametrize("n,bt", [(1, 16), (2, 16), (40, 16), (300, 64)])
def test_grouping_invariants(n, bt):
    rng = np.random.default_rng()
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.uniform(size=(n, K)).astype(np.float32)
    be, bp, btok, bw = (np.asarray(a) for a in run(pallas_triton.group_pairs, jnp.asarray(idx), jnp.asarray(wts),
                                                   n_exp=E, bt=bt))
    p = n * K
    real = bp[bp < p]
    assert sorted(real.tolist()) == list(range(p))  # every (token, slot) pair exactly once
    for b in range(be.shape[0]):
        rows = bp[b * bt:(b + 1) * bt]
        valid = rows < p
        if be[b] < 0:
            assert not valid.any()
            continue
        assert np.all(idx.reshape(-1)[rows[valid]] == be[b])  # one expert per block
        np.testing.assert_array_equal(btok[b * bt:(b + 1) * bt][valid], rows[valid] // K)
        np.testing.assert_array_equal(bw[b * bt:(b + 1) * bt][valid], wts.reshape(-1)[rows[valid]])
        assert np.all(bw[b * bt:(b + 1) * bt][~valid] == 0)


def test_unsupported_reasons_and_dispatch():
    x, wts, idx, w1, w2, w3 = make("fp8", 0, 2, jnp.bfloat16)
    assert pallas_triton.unsupported_reason(x, wts, idx, w1, w2, w3) is None
    assert "share one format" in pallas_triton.unsupported_reason(x, wts, idx, w1, w2, quantize_mxfp4(jnp.ones((E, I, D))))
    assert "[E, D, I]" in pallas_triton.unsupported_reason(x, wts, idx, w1, w1, w3)
    assert "act_block" in pallas_triton.unsupported_reason(x, wts, idx, w1, w2, w3, 128)
    bad = quantize_fp8(jnp.ones((E, 48, D)))
    with pytest.raises(ValueError, match="cannot run this shape"):
        api.moe_experts(x, wts, idx, bad, quantize_fp8(jnp.ones((E, D, 48))), bad, swiglu_limit=1.0,
                        implementation="interpret")


@pytest.mark.parametrize("n,dtype,act_block,config", [
    (40, jnp.float32, 32, (16, 32, 64, 32, 32, 4)), (40, jnp.bfloat16, 32, (16, 32, 64, 32, 32, 4)),
    (300, jnp.float32, 32, (64, 64, 128, 64, 64, 4)),   # 64-row blocks, 128-wide K tiles
])
def test_mma_fp4_word_route_interpret(n, dtype, act_block, config, monkeypatch):
    """DSV41_MMA_FP4=f16w (the tensor-core kernels decode MXFP4 a 32-bit word at a time, one tile in a
    permuted K order, x and h permuted to match): the byte route's result and the reference's within
    the parity tolerance (the same exact products, fp32 sums in another order)."""
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "bytes")
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), n, dtype)
    kw = dict(swiglu_limit=1.0, act_block=act_block, interpret=True, config=config)
    yb = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, **kw))
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "f16w")
    txt = str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **kw))(x, wts, idx, w1, w2, w3))
    assert "uint32" in txt  # the kernels read words
    yw = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, **kw))
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=act_block))
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    scale = float(np.max(np.abs(yr)))
    np.testing.assert_allclose(yw, yb, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(yw, yr, rtol=tol, atol=tol * scale)
    with pytest.raises(ValueError, match="multiples of 32"):
        pallas_triton.moe_experts(x, wts, idx, w1, w2, w3, **{**kw, "config": (16, 16, 64, 16, 16, 2)})


def phase_case(rng, packing, dtype):
    """The phase-route tests' inputs: 40 tokens over 4 MXFP4 experts (I = D = 256, 256-wide K tiles
    possible), fresh random; returns x, weights, indices, the nibble experts and the same in ``packing``."""
    e, i, d, n = 4, 256, 256, 40
    x, wts, idx = routed(rng, n, e, dtype, d)
    w1, w3 = (_q4(jnp.asarray(rng.standard_normal((e, i, d), np.float32) * np.float32(0.2))) for _ in range(2))
    w2 = _q4(jnp.asarray(rng.standard_normal((e, d, i), np.float32) * np.float32(0.2)))
    return x, wts, idx, (w1, w2, w3), [w.with_packing(packing) for w in (w1, w2, w3)]


@pytest.mark.parametrize("packing,dtype,act_block", [("nibbles", jnp.bfloat16, 32), ("f16pairs", jnp.float32, 32),
                                                     ("f16pairs", jnp.bfloat16, 128)])  # 128: V4's activation blocks
def test_mma_fp4_phase_route_interpret(packing, dtype, act_block, monkeypatch):
    """DSV41_MMA_FP4=phases (under auto the default at K tiles >= 128): each 256-wide K tile decoded
    into 8 phase tiles, one dot per phase against x / h laid out by phase (no joins): the word route's
    result within the parity tolerance (the same products, fp32 sums in another order), f16pairs
    bit-identical to nibbles, 8 dots per weight tile, also with V4's 128-wide activation blocks; with
    K tiles below 128 (phase dots of K < 16) the kernels take the word route."""
    x, wts, idx, (w1, w2, w3), ws = phase_case(np.random.default_rng(), packing, dtype)
    kw = dict(swiglu_limit=1.0, interpret=True, config=(16, 32, 256, 32, 256, 4), act_block=act_block)
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "f16w")
    yw = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    assert str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **kw))(x, wts, idx, *ws)).count("dot_general") == 3
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "phases")
    assert str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **kw))(x, wts, idx, *ws)).count("dot_general") == 24
    yp = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    yn = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, **kw))
    np.testing.assert_array_equal(yp, yn)
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=act_block))
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    for y in (yw, yr):
        np.testing.assert_allclose(yp, y, rtol=tol, atol=tol * float(np.max(np.abs(yr))))
    narrow = {**kw, "config": (16, 32, 64, 32, 64, 4)}
    assert str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **narrow))(x, wts, idx, *ws)).count("dot_general") == 3
    assert not pallas_triton.mma_fp4_phases(64, 256) and pallas_triton.mma_fp4_phases(128, 256)


@pytest.mark.parametrize("packing,bk,read,swap", [("nibbles", 256, "f16phases", 0), ("f16pairs", 256, "f16phases", 1),
                                                  ("f16pairs", 64, "f16words", 0)])
def test_mma_fp4_f16_dots_interpret(packing, bk, read, swap, monkeypatch):
    """DSV41_MMA_FP4=f16dots: the phase route (256-wide K tiles) and the word route (64-wide) with
    float16 dot operands (weights scaled in float16, x and h rows as float16 times a power of two per
    row) give the bf16 reads' result bit for bit on these inputs (the same products, scaled by powers
    of two), within the parity tolerance of the reference; fresh random inputs whose scales lie inside
    the exact window, one row of x 2**-6 smaller than the rest; also with the weight tile as the dots'
    first operand (``swap``). ``f16_scale_reason`` accepts these experts and names a scale outside
    the window."""
    rng = np.random.default_rng()
    x, wts, idx, (w1, w2, w3), ws = phase_case(rng, packing, jnp.bfloat16)
    x = x.at[3].multiply(2.0**-6)
    assert all(pallas_triton.f16_scale_reason(w) is None for w in ws)
    kw = dict(swiglu_limit=1.0, interpret=True, config=(16, 32, bk, 32, bk, 4, 3, swap))
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "phases")  # bf16 phases, or words at 64-wide tiles
    assert pallas_triton.fp4_read_for(jnp.bfloat16, packing, bk, bk) == read[3:]
    yp = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "f16dots")
    assert pallas_triton.fp4_read_for(jnp.bfloat16, packing, bk, bk) == read
    assert pallas_triton.fp4_read_for(jnp.float32, packing, bk, bk) == read[3:]  # bf16 activations only
    jaxpr = str(jax.make_jaxpr(lambda *a: pallas_triton.moe_experts(*a, **kw))(x, wts, idx, *ws))
    assert jaxpr.count("dot_general") == (24 if bk >= 128 else 3) and "f16" in jaxpr
    yf = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    np.testing.assert_array_equal(yf, yp)
    assert np.abs(yf[3]).max() > 0  # the small row survives its own scaling
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=32))
    np.testing.assert_allclose(yf, yr, rtol=2.0**-7, atol=2.0**-7 * float(np.max(np.abs(yr))))
    big = _q4(jnp.asarray(rng.standard_normal((2, 32, 64), np.float32) * np.float32(300.0)))
    assert "use DSV41_MMA_FP4=auto" in pallas_triton.f16_scale_reason(big)
    # all-zero codes above the window are refused too: their float16 factor 2**(s - 113) is inf there
    s129 = jnp.full(big.scale.shape, 129, jnp.uint8)
    zero = Fp4Tensor(data=jnp.zeros_like(big.data), scale=jax.lax.bitcast_convert_type(s129, jnp.float8_e8m0fnu))
    assert "span [129, 129]" in pallas_triton.f16_scale_reason(zero)
    from pallas_kernels.quantized_matmul.pallas_triton_fma import e8m0_f32
    assert np.isnan(float(jnp.float16(0.0) * e8m0_f32(jnp.uint8(129), 14).astype(jnp.float16)))


@pytest.mark.parametrize("act_block", [32, 128])  # 128: V4's activation blocks
def test_auto_reads_f16_exact_experts_in_float16_with_swap(act_block, monkeypatch):
    """Under the default route ("auto") experts marked ``f16_exact`` (``mark_f16_exact``: every scale in
    the window) take the float16 phase read with the weight tile as the dots' first operand (session
    44: 1.7-8.2 % faster on the H200), at the decode tiling only; unmarked experts, float32 activations,
    the word read (64-wide K tiles) and a forced "phases" keep bf16 operands; scales outside the window
    are not marked; repacking keeps the mark. The marked experts' result equals the unmarked ones' bit
    for bit (the same products; interpret mode) on fresh random inputs, also with V4's activation
    blocks of 128."""
    rng = np.random.default_rng()
    x, wts, idx, (w1, w2, w3), ws = phase_case(rng, "f16pairs", jnp.bfloat16)
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "auto")
    marked = [pallas_triton.mark_f16_exact(w) for w in ws]
    assert all(w.f16_exact for w in marked) and not any(w.f16_exact for w in ws)
    assert marked[0].with_packing("nibbles").f16_exact and not pallas_triton.experts_f16_exact(marked[0], ws[1])
    big = _q4(jnp.asarray(rng.standard_normal((2, 32, 64), np.float32) * np.float32(300.0)))
    assert not pallas_triton.mark_f16_exact(big).f16_exact
    p = idx.shape[0] * idx.shape[1]
    plain = pallas_triton.default_tiling(p, 4, ws[0])
    assert len(plain) == 6 and plain[2::2] == (256, 256)
    assert pallas_triton.default_tiling(p, 4, marked[0]) == (*plain, 3, 1)
    assert pallas_triton.default_tiling(p, 4, marked[0], jnp.float32) == plain
    assert pallas_triton.default_tiling(p, 4, marked[0], f16_exact=False) == plain
    read = pallas_triton.fp4_read_for
    assert read(jnp.bfloat16, "f16pairs", 256, 256, True) == "f16phases"
    assert read(jnp.bfloat16, "f16pairs", 256, 256) == "phases" and read(jnp.float32, "f16pairs", 256, 256, True) == "phases"
    assert read(jnp.bfloat16, "f16pairs", 64, 64, True) == "words"
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "phases")
    assert read(jnp.bfloat16, "f16pairs", 256, 256, True) == "phases"
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "auto")
    reads = []
    monkeypatch.setattr(pallas_triton, "fp4_read_for", lambda *a: reads.append(read(*a)) or reads[-1])
    kw = dict(swiglu_limit=1.0, interpret=True, act_block=act_block)
    yf = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *marked, **kw))
    yp = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, *ws, **kw))
    assert "f16phases" in reads and reads[-1] == "phases"
    np.testing.assert_array_equal(yf, yp)
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=act_block))
    np.testing.assert_allclose(yf, yr, rtol=2.0**-7, atol=2.0**-7 * float(np.max(np.abs(yr))))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_mma_fp4_phase_route_lowers(target, monkeypatch):
    """The phase route at V4.1's shapes (300 tokens over 384 experts: the tensor-core decode tiling,
    256-wide K tiles) lowers for both GPU targets, with either packing, and in float16 (f16dots)."""
    from jax import ShapeDtypeStruct as S

    e, i, d, n = 384, 2304, 5120, 300
    for route, packing in (("phases", "nibbles"), ("phases", "f16pairs"), ("f16dots", "f16pairs")):
        monkeypatch.setitem(pallas_triton.MMA_FP4, "route", route)
        w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32, packing)
        w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32, packing)
        txt = lower_for(target, lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=10.0),
                        S((n, d), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32), w1, w2, w1).as_text()
        assert _moe_launches(txt) == 2 and "moe_gate_up_fp4" in txt


@pytest.mark.parametrize("fmt,dtype,route", [("fp4", jnp.bfloat16, "f16w"), ("fp4", jnp.float32, "bytes"),
                                              ("fp8", jnp.bfloat16, "auto"), ("plain", jnp.float32, "auto")])
def test_swapped_operands_interpret(fmt, dtype, route, monkeypatch):
    """An 8th config entry of 1 makes the weight tile the dots' first operand (outputs [bi, bt] /
    [bd, bt], transposed before the stores): the same products, fp32 sums perhaps in another order
    (XLA's f32 dots on the CPU), so the unswapped kernels' result to 1e-6 of max|y|, and the
    reference's within the parity tolerance."""
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", route)
    x, wts, idx, w1, w2, w3 = make(fmt, np.random.randint(1 << 30), 40, dtype)
    cfg = (16, 32, 64, 64, 32, 4, 2)
    kw = dict(swiglu_limit=1.0, interpret=True)
    ys = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, config=cfg + (1,), **kw))
    y0 = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, config=cfg, **kw))
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0))
    np.testing.assert_allclose(ys, y0, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(y0))))
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(ys, yr, rtol=tol, atol=tol * float(np.max(np.abs(yr))))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_grid_orders_agree_interpret(fmt, monkeypatch):
    """GRID_ORDER 'rows' (weight-row tiles fastest, the default) and 'blocks' launch the same programs
    in another order: identical outputs; a block count beyond the grid's second dimension is refused
    with the way out named."""
    x, wts, idx, w1, w2, w3 = make(fmt, np.random.randint(1 << 30), 40, jnp.bfloat16)
    kw = dict(swiglu_limit=1.0, interpret=True, config=(16, 32, 64, 64, 32, 4))
    ys = {}
    for order in ("rows", "blocks"):
        monkeypatch.setitem(pallas_triton.GRID_ORDER, "order", order)
        ys[order] = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, **kw))
    np.testing.assert_array_equal(ys["rows"], ys["blocks"])
    monkeypatch.setitem(pallas_triton.GRID_ORDER, "order", "rows")
    monkeypatch.setattr(pallas_triton, "MAX_GRID_Y", 4)
    with pytest.raises(ValueError, match=r"blocks exceed the grid's second dimension \(4\).*config bt"):
        pallas_triton.moe_experts(x, wts, idx, w1, w2, w3, **kw)


def test_tensor_core_config_wider_than_the_experts_is_refused():
    x, wts, idx, w1, w2, w3 = make("fp4", 5, 8, jnp.bfloat16)
    i_dim = w1.data.shape[1]
    with pytest.raises(ValueError, match=rf"I={i_dim} is not a multiple of its tile {2 * i_dim}"):
        pallas_triton.moe_experts(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, interpret=True,
                                  config=(16, 2 * i_dim, 64, 32, 32, 4))


def test_fp4_word_k_order_matches_the_word_tile():
    """fp4_word_k_order is the permutation load_fp4_word_tile's joins produce: position 4h + 2a + b of
    each group of 8 holds element 4h + a + 2b."""
    from pallas_kernels.quantized_matmul.pallas_triton import fp4_word_k_order

    x = jnp.arange(32)[None, :]
    got = np.asarray(fp4_word_k_order(x))[0]
    want = [8 * q + 4 * h + a + 2 * b for q in range(4) for h in range(2) for a in range(2) for b in range(2)]
    np.testing.assert_array_equal(got, want)


def test_mma_fp4_switch_refuses_unknown_routes():
    assert pallas_triton._parse_mma_fp4("") == "auto" and pallas_triton._parse_mma_fp4("f16w") == "f16w"
    with pytest.raises(ValueError, match="DSV41_MMA_FP4='f16': expected one of auto, bytes, f16w"):
        pallas_triton._parse_mma_fp4("f16")


def test_mma_fp4_auto_route(monkeypatch):
    """DSV41_MMA_FP4=auto (the default): words for bf16 activations with K tiles <= 64 (the prefill
    tilings), phases with K tiles >= 128 (the decode tiling: 1.6x faster than bytes on the H200,
    session 34), bytes for mixed widths and for float32 activations (not timed there) unless the
    experts are packed as f16pairs; a forced f16w applies to every dtype (in float32 both routes were
    ~3e-3 from the GPU reference and 4e-4 from each other, session 12)."""
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "auto")
    words, read = pallas_triton.mma_fp4_words, pallas_triton.fp4_read_for
    assert words(jnp.bfloat16, 64, 64) and words(jnp.bfloat16, 32, 64) and words(jnp.bfloat16, 256, 256)
    assert not words(jnp.bfloat16, 64, 128) and not words(jnp.float32, 64, 64) and not words(jnp.float32, 256, 256)
    assert read(jnp.bfloat16, "nibbles", 64, 64) == "words" and read(jnp.bfloat16, "nibbles", 256, 128) == "phases"
    assert read(jnp.bfloat16, "nibbles", 64, 128) == "bytes" and read(jnp.float32, "nibbles", 256, 256) == "bytes"
    assert read(jnp.float32, "f16pairs", 256, 256) == "phases" and read(jnp.float32, "f16pairs", 64, 128) == "words"
    cfg = pallas_triton._config(4096 * 6, 96, 2304, 5120)
    assert read(jnp.bfloat16, "nibbles", cfg[2], cfg[4]) == "words"  # the prefill chunk over 96 experts
    for packing in ("nibbles", "f16pairs"):  # the decode tiling: 256-wide K tiles, phases, either packing
        cfg = pallas_triton.default_tiling(300 * 6, 384, fp4(384, 2304, 5120).replace(packing=packing))
        assert cfg[2::2] == (256, 256) and read(jnp.bfloat16, packing, cfg[2], cfg[4]) == "phases"
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "f16w")
    assert words(jnp.float32, 256, 256) and words(jnp.float32, 64, 64)
    assert read(jnp.bfloat16, "nibbles", 256, 256) == "words" and pallas_triton.words_need_narrow_tiles()
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "bytes")
    assert not words(jnp.bfloat16, 64, 64) and read(jnp.bfloat16, "f16pairs", 256, 256) == "words"
    assert pallas_triton.words_need_narrow_tiles()
    # with the phases ruled out, f16pairs experts take the word route's 64-wide K tiles; nibbles keep 256
    assert pallas_triton.default_tiling(300 * 6, 384, fp4(384, 2304, 5120).replace(packing="f16pairs"))[2::2] == (64, 64)
    assert pallas_triton.default_tiling(300 * 6, 384, fp4(384, 2304, 5120))[2::2] == (256, 256)


S = jax.ShapeDtypeStruct
RE, RI, RD, RK = 384, 2304, 5120, 6


def fp4(e, r, c):
    return Fp4Tensor(S((e, r, c // 2), jnp.uint8), S((e, r, c // 32), jnp.float8_e8m0fnu), 32)


def fp8(e, r, c):
    return Fp8Tensor(S((e, r, c), jnp.float8_e4m3fn), S((e, r // 32, c // 32), jnp.float8_e8m0fnu), (32, 32))


@pytest.mark.parametrize("config", [(16, 16, 64, 16, 32, 2), (16, 32, 128, 32, 64, 4, 2)])
def test_tune_configs_interpret(config):
    """The benchmark's sweep configurations (small tiles, an explicit pipelining depth as a 7th
    entry) give the reference's result."""
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), 2, jnp.bfloat16)
    y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=1.0, interpret=True, config=config)
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0))
    np.testing.assert_allclose(np.asarray(y), yr, rtol=2.0**-7, atol=2.0**-7 * float(np.max(np.abs(yr))))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_tune_configs_lower(target):
    """Every configuration of ``benchmark.py --tune`` lowers at the real decode shape."""
    from pallas_kernels.moe.benchmark import TUNE_CONFIGS, TUNE_CONFIGS_PREFILL

    assert len(TUNE_CONFIGS) >= 8 and len(TUNE_CONFIGS_PREFILL) >= 6
    swapped = [(64, 128, 64, 128, 64, 4, 3, 1), (64, 256, 64, 256, 64, 8, 3, 1)]  # weight tile as first operand
    for n, cfgs in ((1, TUNE_CONFIGS), (2048, TUNE_CONFIGS_PREFILL + swapped)):
        for cfg in cfgs:
            lower_for(target, lambda x, w, i, a, b, c, cfg=cfg: pallas_triton.moe_experts(
                x, w, i, a, b, c, swiglu_limit=10.0, config=cfg),
                S((n, RD), jnp.bfloat16), S((n, RK), jnp.float32), S((n, RK), jnp.int32),
                fp4(RE, RI, RD), fp4(RE, RD, RI), fp4(RE, RI, RD))


def _moe_launches(txt):
    """Triton calls in a lowered MoE other than its act-quant prologue kernels (``fma_act_quant``,
    which the decode path adds before each of its two kernels under DSV41_MOE_ACT_QUANT=pallas; with
    the gate/up K split the second is ``moe_gate_up_finish``)."""
    from jax.experimental.pallas import triton as pltriton

    return (txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) - txt.count('name = "fma_act_quant"')
            - txt.count('name = "moe_gate_up_finish"'))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_cross_lowering_real_shapes(target):

    for mk, ns in ((fp4, (1, 8, 64, 2048)), (fp8, (8,))):
        for n in ns:
            txt = lower_for(target, lambda x, w, i, a, b, c: pallas_triton.moe_experts(x, w, i, a, b, c, swiglu_limit=10.0),
                            S((n, RD), jnp.bfloat16), S((n, RK), jnp.float32), S((n, RK), jnp.int32),
                            mk(RE, RI, RD), mk(RE, RD, RI), mk(RE, RI, RD)).as_text()
            assert _moe_launches(txt) == 2  # gate/up + down
            if n <= 8:  # the decode (fma) path: the act-quant prologue for x and h (DSV41_MOE_ACT_QUANT default);
                # at one token h's is the split gate/up's finish (pallas_triton.GATE_UP_SPLIT)
                split = n == 1 and pallas_triton.GATE_UP_SPLIT["splits"] > 1
                assert txt.count('name = "fma_act_quant"') == (1 if split else 2), n
                assert txt.count('name = "moe_gate_up_finish"') == (1 if split else 0), n
    # the word route of the tensor-core kernels lowers too (gate/up + down, words read as uint32)
    from unittest import mock

    with mock.patch.dict(pallas_triton.MMA_FP4, {"route": "f16w"}):
        txt = lower_for(target, lambda x, w, i, a, b, c: pallas_triton.moe_experts(x, w, i, a, b, c, swiglu_limit=10.0),
                        S((2048, RD), jnp.bfloat16), S((2048, RK), jnp.float32), S((2048, RK), jnp.int32),
                        fp4(RE, RI, RD), fp4(RE, RD, RI), fp4(RE, RI, RD)).as_text()
    assert _moe_launches(txt) == 2
    # a prefill chunk over 96 experts (256 rows per expert): the 128-row tiling
    assert pallas_triton._config(4096 * RK, 96, RI, RD)[0] == 128
    txt = lower_for(target, lambda x, w, i, a, b, c: pallas_triton.moe_experts(x, w, i, a, b, c, swiglu_limit=10.0),
                    S((4096, RD), jnp.bfloat16), S((4096, RK), jnp.float32), S((4096, RK), jnp.int32),
                    fp4(96, RI, RD), fp4(96, RD, RI), fp4(96, RI, RD)).as_text()
    assert _moe_launches(txt) == 2


# --------------------------------------------------------------------------------------------------
# V4 formats: activation fake-quant per 128 (MXFP4 experts, the released V4 checkpoints) and FP8
# experts with 128x128 blocks (the kernels' FP8 path with V4's block; Flash-Base's float32 scales are
# not an Fp8Tensor and stay on the reference). I and D are multiples of 128.

VI, VD = 128, 256


def make_v4(fmt, seed, n, dtype):
    rng = np.random.default_rng(seed)
    x, wts, idx = routed(rng, n, E, dtype, VD)

    def w(shape):
        # per-128-block factors 2^-3..2^3 so a scale taken from the wrong block shows
        e_, r, c = shape
        f = rng.integers(-3, 4, (e_, r // 128, c // 128))
        f = np.exp2(np.repeat(np.repeat(f, 128, 1), 128, 2).astype(np.float32))
        wf = jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(0.2) * f)
        return _q8(wf, block=(128, 128)) if fmt == "fp8" else _q4(wf)

    return (x, wts, idx, w((E, VI, VD)), w((E, VD, VI)), w((E, VI, VD)))


# Same tolerance as test_parity_interpret. n = 1 / 6: 16-row blocks (64-row weight tiles inside one
# 128-row block, K tiles of 256 / 128); n = 300: 64-row blocks (128-row tiles, K stepped 64 = half a
# block column per step).
@pytest.mark.parametrize("fmt,n,dtype", [
    ("fp8", 1, jnp.bfloat16), ("fp8", 6, jnp.float32), ("fp8", 300, jnp.bfloat16),
    ("fp4", 6, jnp.bfloat16), ("fp4", 40, jnp.float32),
])
def test_parity_interpret_v4_act_block_128(fmt, n, dtype):
    seed = np.random.randint(1 << 30)
    x, wts, idx, w1, w2, w3 = make_v4(fmt, seed, n, dtype)
    assert pallas_triton.unsupported_reason(x, wts, idx, w1, w2, w3, 128) is None
    y = run(api.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=10.0, act_block=128, implementation="interpret")
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=10.0, act_block=128)
    assert y.shape == (n, VD) and y.dtype == jnp.float32
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    y, yr = np.asarray(y), np.asarray(yr)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, yr, rtol=tol, atol=tol * float(np.max(np.abs(yr))))


def test_v4_reasons_and_auto_gate(monkeypatch):
    x, wts, idx, w1, w2, w3 = make_v4("fp8", 0, 2, jnp.bfloat16)
    assert "act_block must equal the FP8 weight block (128" in pallas_triton.unsupported_reason(x, wts, idx, w1, w2, w3, 32)
    x4, wts4, idx4, a, b, c = make_v4("fp4", 0, 2, jnp.bfloat16)
    assert pallas_triton.unsupported_reason(x4, wts4, idx4, a, b, c, 128) is None
    assert "act_block must be 32 (V4.1) or 128 (V4)" in pallas_triton.unsupported_reason(x4, wts4, idx4, a, b, c, 64)
    # the api passes act_block to the support check: an explicit call with a bad one raises the reason
    with pytest.raises(ValueError, match="act_block"):
        api.moe_experts(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=32, implementation="interpret")
    # plain 'auto' on a GPU takes the kernel for V4's formats too (they passed --check on an H200)
    assert pallas_triton.auto_reason(w1, 128) is None
    assert pallas_triton.auto_reason(a, 128) is None
    assert pallas_triton.auto_reason(quantize_mxfp4(jnp.ones((E, 64, 128))), 32) is None  # V4.1
    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    monkeypatch.setattr(api.dispatch.jax, "default_backend", lambda: "gpu")
    seen = []
    monkeypatch.setattr(pallas_triton, "moe_experts", lambda *a, **k: seen.append(k["act_block"]) or "kernel")
    assert api.moe_experts(x4, wts4, idx4, a, b, c, swiglu_limit=10.0, act_block=128) == "kernel"
    assert seen == [128]


V4E, V4I, V4D = 256, 2048, 4096  # V4-Flash experts, top-6


def fp8_128(e, r, c):
    return Fp8Tensor(S((e, r, c), jnp.float8_e4m3fn), S((e, r // 128, c // 128), jnp.float8_e8m0fnu), (128, 128))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_cross_lowering_v4_shapes(target):

    for mk, ns in ((fp4, (1, 8, 2048)), (fp8_128, (8, 2048))):
        for n in ns:
            txt = lower_for(target, lambda x, w, i, a, b, c: pallas_triton.moe_experts(x, w, i, a, b, c, swiglu_limit=10.0,
                                                                                       act_block=128),
                            S((n, V4D), jnp.bfloat16), S((n, RK), jnp.float32), S((n, RK), jnp.int32),
                            mk(V4E, V4I, V4D), mk(V4E, V4D, V4I), mk(V4E, V4I, V4D)).as_text()
            assert _moe_launches(txt) == 2


def test_prefill_blocking_float32_exact_interpret():
    """Prefill sizes (hundreds of rows per expert: 128-row token blocks, the default there, and
    64-row ones) in float32 agree with the reference to fp32 rounding -- so the bf16 differences at
    such sizes (a few elements by one e4m3 step of h) are rounding-order flips, not a blocking fault."""
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), 512, jnp.float32)
    assert pallas_triton._config(512 * K, E, I, D)[0] == 128
    yr = np.asarray(_reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0))
    y = np.asarray(run(api.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=1.0, implementation="interpret"))
    np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(yr))))
    y = np.asarray(run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=1.0, interpret=True,
                       config=(64, 64, 64, 64, 64, 4)))
    np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(yr))))


def test_benchmark_check_v41_runs_in_interpret_mode(monkeypatch):
    """The GPU ``--check`` for V4.1 (MXFP4 at decode sizes, the prefill blocking in bf16 and float32,
    FP8 experts) and V4 (act_block 128 MXFP4, FP8 128x128: :func:`check_v4`, called by ``check``), on
    small shapes in interpret mode: every row passes. The V4.1 rows run top-2, the V4 rows top-6 (once
    each: a separate test ran ``check_v4`` again at top-6, while this one ran it at top-2)."""
    import functools

    import pallas_kernels.moe.benchmark as bm

    for name, v in (("E", 8), ("I", 64), ("D", 128), ("TOPK", 2), ("CHECK_PREFILL_TOKENS", 512),
                    ("V4_SHAPE", (8, 128, 256))):
        monkeypatch.setattr(bm, name, v)
    monkeypatch.setattr(bm.pallas_triton, "moe_experts", functools.partial(pallas_triton.moe_experts, interpret=True))
    lines = []
    monkeypatch.setattr(bm, "log", lambda *a: lines.append(" ".join(map(str, a))))
    check_v4, v4_lines = bm.check_v4, []

    def check_v4_top6(key):
        start = len(lines)
        monkeypatch.setattr(bm, "TOPK", 6)
        try:
            return check_v4(key)
        finally:
            monkeypatch.setattr(bm, "TOPK", 2)
            v4_lines.extend(lines[start:])

    monkeypatch.setattr(bm, "check_v4", check_v4_top6)
    assert bm.check(), lines
    assert sum("prefill blocking" in s and s.startswith("PASS") for s in lines) == 2, lines
    assert sum(s.startswith("PASS moe mxfp4 f16pairs f16_exact=True tokens=300") for s in lines) == 1, lines
    assert len(v4_lines) == 5 and all(s.startswith("PASS moe v4 ") for s in v4_lines), v4_lines
    assert sum(s.startswith("PASS moe v4 mxfp4 act128") for s in v4_lines) == 4, v4_lines


# The vector-unit ("fma") decode kernels: same products as the reference, fp32 sums in another
# order (the per-32 power-of-two weight scale multiplies a partial sum), same tolerance as
# test_parity_interpret. 1-, 2- and 4-row blocks; the clamp is active (limit 1.0 with weights * 0.2).
@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("fmt,n,bt,dtype,limit", [
    ("fp4", 1, 1, jnp.bfloat16, 1.0), ("fp4", 2, 1, jnp.float32, 1.0), ("fp4", 6, 2, jnp.float32, 0.0),
    ("fp4", 9, 4, jnp.bfloat16, 1.0), ("fp8", 1, 1, jnp.float32, 1.0), ("fp8", 6, 4, jnp.bfloat16, 1.0),
])
def test_fma_parity_interpret(fmt, n, bt, dtype, limit, via, monkeypatch):
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    monkeypatch.setattr(pallas_triton_fma, "FMA_DECODE", {"fp4": via, "fp8": via})  # both weight decode routes
    seed = np.random.randint(1 << 30)
    x, wts, idx, w1, w2, w3 = make(fmt, seed, n, dtype)
    cfg = list(pallas_triton.default_fma_config(w1))
    cfg[1] = bt
    y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=limit, interpret=True, config=tuple(cfg))
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=limit)
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    y, yr = np.asarray(y), np.asarray(yr)
    assert np.all(np.isfinite(y)) and y.shape == (n, D)
    np.testing.assert_allclose(y, yr, rtol=tol, atol=tol * float(np.max(np.abs(yr))))


def test_fma_parity_interpret_v4_act_block_128():
    """V4's MXFP4 experts with 128-wide activation blocks and FP8 128x128 experts in the fma kernels."""
    for fmt in ("fp4", "fp8"):
        x, wts, idx, w1, w2, w3 = make_v4(fmt, np.random.randint(1 << 30), 1, jnp.float32)
        cfg = pallas_triton.default_fma_config(w1)
        y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=10.0, act_block=128, interpret=True,
                config=cfg)
        yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=10.0, act_block=128)
        np.testing.assert_allclose(np.asarray(y), np.asarray(yr), rtol=1e-5, atol=1e-5 * float(np.max(np.abs(yr))))


def test_fma_reasons():
    x, wts, idx, w1, w2, w3 = make("plain", 0, 1, jnp.float32)
    assert "FP8 or MXFP4" in pallas_triton.fma_reason(w1, ("fma", 1, 16, 4, 16, 2, 4, 3))
    _, _, _, f1, _, _ = make("fp4", 0, 1, jnp.float32)
    assert "at most 4 rows" in pallas_triton.fma_reason(f1, ("fma", 8, 16, 4, 16, 2, 4, 3))
    assert "multiple of its row tile" in pallas_triton.fma_reason(f1, ("fma", 1, 128, 4, 16, 2, 4, 3))
    assert "steps of 8 groups" in pallas_triton.fma_reason(f1, ("fma", 1, 16, 8, 16, 2, 4, 3))  # D=128: 4 groups
    with pytest.raises(ValueError, match="fma"):
        pallas_triton.moe_experts(x, wts, idx, *make("fp4", 0, 1, jnp.float32)[3:], swiglu_limit=1.0,
                                  interpret=True, config=("fma", 1, 16, 8, 16, 2, 4, 3))


@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_fma_cross_lowering_real_shapes(target, via, monkeypatch):
    from jax import ShapeDtypeStruct as S

    from pallas_kernels.quantized_matmul import pallas_triton_fma

    monkeypatch.setattr(pallas_triton_fma, "FMA_DECODE", {"fp4": via, "fp8": via})

    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32)
    for n, bt in ((1, 1), (8, 2)):
        cfg = list(pallas_triton.default_fma_config(w1))
        cfg[1] = bt
        txt = lower_for(target, lambda x, w, idx, a, b, c: pallas_triton.moe_experts(
            x, w, idx, a, b, c, swiglu_limit=10.0, config=tuple(cfg)),
            S((n, d), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32), w1, w2, w1).as_text()
        assert _moe_launches(txt) == 2


def test_decode_gemv_switch_moe(monkeypatch):
    """With DECODE_GEMV moe=fma the fused MoE takes the fma kernels while the rows per expert stay
    within FMA_MOE_MAX_ROWS_PER_EXPERT for the tensor-core read of the default tiling: "phases" (the
    default for bf16 at decode tilings) 1.5, so over 384 experts 96 tokens (1.5 rows) fma, 128 (2 rows)
    tensor cores, and over 96 experts 32 tokens (192 pairs, 2 rows) tensor cores although within
    FMA_MOE_MAX_PAIRS; with the phase route ruled out (DSV41_MMA_FP4=bytes) the old rule: fma up to
    FMA_MOE_MAX_PAIRS pairs, beyond while rows <= 2 (bytes, nibbles) or 4 (words, f16pairs); float32
    activations read bytes (nibbles). FP8 experts: the pair limit alone."""
    from jax import ShapeDtypeStruct as S

    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "moe", "fma")
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "auto")
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32)
    assert fma.FMA_MOE_MAX_PAIRS == 256
    assert pallas_triton.FMA_MOE_MAX_ROWS_PER_EXPERT == {"phases": 1.5, "f16phases": 1.5, "bytes": 2.0, "words": 4.0,
                                                         "f16words": 4.0}
    wp = w1.replace(packing="f16pairs")
    w96 = Fp4Tensor(S((96, i, d // 2), jnp.uint8), S((96, i, d // 32), jnp.float8_e8m0fnu), 32)
    auto = ((1, w1, True), (43, w1, True), (96, w1, True), (96, wp, True), (128, w1, False), (128, wp, False),
            (16, w96, True), (31, w96, False), (32, w96, False), (32, w96.replace(packing="f16pairs"), False))
    for n, a, want in auto:
        assert pallas_triton.takes_fma(a, n * 6) == want, (n, a.packing, a.shape)
    assert pallas_triton.takes_fma(w96, 32 * 6, jnp.float32)  # float32 reads bytes: the pair limit
    f8 = Fp8Tensor(S((e, i, d), jnp.float8_e4m3fn), S((e, i // 32, d // 32), jnp.float8_e8m0fnu), (32, 32))
    assert pallas_triton.takes_fma(f8, 256) and not pallas_triton.takes_fma(f8, 257)
    for n, want in ((1, True), (96, True), (128, False)):  # the dispatch follows it
        txt = lower_for("cuda", lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=10.0),
                        S((n, d), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32), w1, w2, w1).as_text()
        assert ("moe_gate_up_fma_fp4" in txt) == want, n
    monkeypatch.setitem(pallas_triton.MMA_FP4, "route", "bytes")
    forced = ((42, w1, True), (43, w1, True), (128, w1, True), (200, w1, False), (200, wp, True), (300, wp, False),
              (42, w96, True), (43, w96, False))
    for n, a, want in forced:
        assert pallas_triton.takes_fma(a, n * 6) == want, (n, a.packing, a.shape)
    assert pallas_triton.default_fma_config(w1, 1.0)[1] == 1
    assert pallas_triton.default_fma_config(w1, 2.5)[1] == 1  # one-row blocks measured faster at 2 and 4
    assert pallas_triton.default_fma_config(w1, 4.0)[1] == 1
    assert pallas_triton.default_fma_config(w1, 5.0)[1] == 4


@pytest.mark.parametrize("n", [1, 2, 7])
def test_negative_index_means_no_expert(n):
    """index -1 (expert parallelism: a pair routed to another shard) contributes nothing, in the
    reference and in both kernel families (tensor-core and fma), with and without the sort path;
    equal to the reference with those pairs' weights set to 0 and any valid expert in their place."""
    seed = np.random.randint(1 << 30)
    x, wts, idx, w1, w2, w3 = make("fp4", seed, n, jnp.float32)
    drop = np.random.default_rng(seed + 1).random(idx.shape) < 0.5
    drop[0, 0] = True
    if n == 7:
        drop[3] = True  # one token with no expert at all
    idx_neg = jnp.asarray(np.where(drop, -1, np.asarray(idx)))
    want = _reference(x, jnp.asarray(np.where(drop, 0.0, np.asarray(wts)).astype(np.float32)), idx, w1, w2, w3,
                      swiglu_limit=1.0)
    got_ref = _reference(x, wts, idx_neg, w1, w2, w3, swiglu_limit=1.0)
    np.testing.assert_array_equal(np.asarray(got_ref), np.asarray(want))
    for cfg in (None, pallas_triton.default_fma_config(w1)):
        y = run(pallas_triton.moe_experts, x, wts, idx_neg, w1, w2, w3, swiglu_limit=1.0, interpret=True, config=cfg)
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))
        if n == 7:
            assert not np.any(np.asarray(y)[3])
