"""sparse_attention Pallas-Triton kernel: interpret-mode parity with the reference on fresh random
inputs (every output element), shape-support reasons, dispatch, and cross-lowering for cuda (H200)
and rocm (gfx950) at the real V4.1 decode / verify / prefill shapes."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, exact_in_bf16, quantize_fp4_e4m3, quantize_fp8
from pallas_kernels.sparse_attention import api, pallas_triton, pallas_triton_two_pass, reference
from pallas_kernels.testing import lower_for

# Tolerances. Dequantized keys are exact in bf16 and bf16 x bf16 products are exact in fp32, so the
# logits agree to fp32 summation order. Both cast the unnormalised exp(l - m) to q.dtype and divide
# at the end; both take m as a running maximum, the kernel over its own key blocks (block_k, split
# across programs), the reference over DeepSeek's 64, so in bf16 the weights of blocks before the
# maximum may round differently (2^-8 relative each) -> output error up to ~1 bf16 ulp of the scale. f32: P is not rounded, only summation order differs.
TOL = {jnp.bfloat16: (2.0**-6, 2.0**-7), jnp.float32: (2e-5, 2e-6)}

# jit the helpers (eager quantizers / reference dispatch hundreds of tiny ops)
_q8 = jax.jit(lambda x: quantize_fp8(x, (1, 32)))
_q4 = jax.jit(lambda x: quantize_fp4_e4m3(x, 16))


@jax.jit
def _ref(q, kv, widx, sink, ck, cidx, scale):
    return reference.sparse_attention(q, kv, widx, sink, scale=scale, comp_kv=ck, comp_idx=cidx)


def _kernel(q, kv, widx, sink, ck, cidx, scale, **cfg):
    """The flash kernel unless ``cfg`` names a method (decode-sized calls of up to
    ``TWO_PASS_AUTO_ROWS`` rows would otherwise take the two-pass kernels, tested on their own)."""
    cfg.setdefault("method", "flash")
    f = jax.jit(lambda *a: pallas_triton.sparse_attention(*a[:4], scale=scale, comp_kv=a[4], comp_idx=a[5],
                                                          interpret=True, **cfg))
    return f(q, kv, widx, sink, ck, cidx)


def make_case(seed=None, *, b=2, s=2, h=16, d=64, nw=40, nc=100, kw=20, kc=40, dtype=jnp.bfloat16, quant=True):
    """Random inputs from numpy (a fixed ``seed`` or fresh ones); the stores quantized by one jitted
    program each. (jax.random compiled each of its draws on its own: most of a test's time.)"""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, h, d), np.float32).astype(dtype))  # RNE as XLA's convert
    kvf = rng.standard_normal((b, nw, d), np.float32)
    ckf = rng.standard_normal((b, nc, d), np.float32)
    kv = _q8(jnp.asarray(kvf)) if quant else jnp.asarray(kvf.astype(dtype))
    ck = _q4(jnp.asarray(ckf)) if quant else jnp.asarray(ckf.astype(dtype))
    widx = rng.integers(-1, nw, (b, s, kw), dtype=np.int32)  # about 1 in nw picks is -1
    cidx = rng.integers(-1, nc, (b, s, kc), dtype=np.int32)
    widx[rng.random(widx.shape) < 0.2] = -1  # more -1 padding
    # row (0, 0): no valid key at all -> output 0; row (1, s-1): compressed picks only
    widx[0, 0] = -1
    if b > 1:
        widx[1, s - 1] = -1
    cidx[0, 0] = -1
    sink = jnp.asarray(rng.standard_normal((h,), np.float32))
    return q, kv, jnp.asarray(widx), sink, ck, jnp.asarray(cidx)


def check_close(o, r):
    assert o.shape == r.shape and o.dtype == r.dtype
    rtol, atol_rel = TOL[jnp.dtype(r.dtype).type]
    of, rf = np.asarray(o, np.float32), np.asarray(r, np.float32)
    assert np.all(np.isfinite(of))
    np.testing.assert_allclose(of, rf, rtol=rtol, atol=atol_rel * float(np.max(np.abs(rf))))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("quant", [True, False], ids=["fp8win_fp4comp", "plain"])
def test_parity_interpret(dtype, quant):
    seed = int(quant) * 2 + int(dtype == jnp.float32)
    q, kv, widx, sink, ck, cidx = make_case(seed, dtype=dtype, quant=quant)
    scale = q.shape[-1] ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale)
    o = _kernel(q, kv, widx, sink, ck, cidx, scale, block_k=16)
    check_close(o, r)
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)  # no valid key -> 0


def test_every_fp4_code_and_scale_of_the_compressed_cache(monkeypatch):
    """The kernel's FP4 decode of the compressed cache (32-bit words into f16 pairs, since session
    38) over every packed byte value (all 16 codes in both nibbles, -0 included) and e4m3
    scales from subnormal to 2**8, in float32 against the reference's dequantization: equal to the
    tolerance below. Compressed keys only (no window), so every output comes from decoded rows.
    Tolerance: 1e-4 of the largest output. The scales reach 2**8, so logits reach ~1e3 and fp32
    summation order moves single elements by up to 1.3e-5 of the largest (30 draws, session 46);
    the element-wise f32 parity bound (rtol 2e-5) failed ~1 draw in 7 under jax 0.12.1. A wrong
    decode (the swap below) is off by >= 1.25 of the largest."""

    def close(o, r):
        o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(o)) and np.abs(o - r).max() <= 1e-4 * np.abs(r).max(), np.abs(o - r).max()

    rng = np.random.default_rng()
    b, s, h, d, nc, kc = 1, 3, 16, 64, 96, 64
    data = rng.integers(0, 256, (b, nc, d // 2), dtype=np.uint8)
    data.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    scale = rng.choice(np.r_[1:8, 8:0x70].astype(np.uint8), (b, nc, d // 16)).view(jnp.float8_e4m3fn)
    ck = Fp4Tensor(jnp.asarray(data), jnp.asarray(scale), 16)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    kv = jnp.zeros((b, 8, d), jnp.float32)
    widx = jnp.full((b, s, 8), -1, jnp.int32)
    cidx = jnp.asarray(np.stack([rng.permutation(nc)[:kc] for _ in range(s)])[None].astype(np.int32))
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    scale_ = d ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale_)
    close(_kernel(q, kv, widx, sink, ck, cidx, scale_), r)
    # a decode that swaps codes j and j + 4 of every word fails the same comparison
    real = pallas_triton.fp4_word_pairs_f32
    monkeypatch.setattr(pallas_triton, "fp4_word_pairs_f32", lambda w: [(hi, lo) for lo, hi in real(w)])
    with pytest.raises(AssertionError):
        close(_kernel(q, kv, widx, sink, ck, cidx, scale_), r)


@pytest.mark.parametrize("d_split,quant,dtype,num_splits", [
    (2, True, jnp.bfloat16, 1), (4, True, jnp.bfloat16, 2), (2, False, jnp.float32, 2)])
def test_column_split_interpret(d_split, quant, dtype, num_splits):
    """d_split > 1: each program accumulates D / d_split output columns (logits over all of D): the
    reference's result at the parity tolerance, with and without flash-decoding splits, every
    column block of every head block written (D = 128: blocks of 64 / 32)."""
    q, kv, widx, sink, ck, cidx = make_case(None, d=128, dtype=dtype,
                                            quant=quant)
    scale = q.shape[-1] ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale)
    o = _kernel(q, kv, widx, sink, ck, cidx, scale, block_k=16, d_split=d_split, num_splits=num_splits)
    check_close(o, r)
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)  # no valid key -> 0
    with pytest.raises(ValueError, match="d_split=8 must divide D=128 into column blocks that are multiples of 32"):
        _kernel(q, kv, widx, sink, ck, cidx, scale, d_split=8)



@pytest.mark.parametrize("rows,nsp,h,d", [(2, 16, 64, 512), (3, 4, 16, 64), (1, 2, 8, 32)])
def test_pallas_combine_equals_the_xla_combine(rows, nsp, h, d):
    """The Pallas combine merges random partials like the XLA combine (f32 to summation order; bf16
    to one rounding), with empty splits (m = -inf, l = 0) and a row whose splits are all empty (0)."""
    rng = np.random.default_rng()  # fresh inputs from numpy (jax.random compiled every draw on its own)
    acc = rng.standard_normal((rows, nsp, h, d), np.float32) * 3
    m = rng.standard_normal((rows, nsp, h), np.float32) * 4
    l = rng.uniform(0.5, 40.0, (rows, nsp, h)).astype(np.float32)
    empty = rng.random((rows, nsp, h)) < 0.3
    empty[0, :, 0] = True  # row 0, head 0: no key
    m, l = np.where(empty, -np.inf, m).astype(np.float32), np.where(empty, 0.0, l).astype(np.float32)
    acc = np.where(empty[..., None], 0.0, acc).astype(np.float32)
    sink = rng.standard_normal((h,), np.float32)
    acc, m, l, sink = (jnp.asarray(a) for a in (acc, m, l, sink))
    want = np.asarray(jax.jit(pallas_triton._xla_combine)(acc, m, l, sink))  # the op's XLA combine
    got = np.asarray(jax.jit(lambda *a: pallas_triton.combine_splits(*a, jnp.float32, interpret=True))(acc, m, l, sink))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    assert np.all(got[0, 0] == 0.0)
    got16 = jax.jit(lambda *a: pallas_triton.combine_splits(*a, jnp.bfloat16, interpret=True))(acc, m, l, sink)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got16, np.float32), want, rtol=2.0**-7, atol=2.0**-8 * np.abs(want).max())


def test_op_with_the_pallas_combine_matches_the_reference():
    """combine="pallas": the whole op (flash-decoding splits merged by the Pallas combine) against the
    reference; a split count that is not a power of two falls back to the XLA combine; a bad name
    is refused."""
    q, kv, widx, sink, ck, cidx = make_case(None, d=128)
    scale = q.shape[-1] ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale)
    o = _kernel(q, kv, widx, sink, ck, cidx, scale, block_k=16, num_splits=2, combine="pallas")
    check_close(o, r)
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)
    assert "not a power of two" in pallas_triton.combine_reason(3, 64, 512)
    assert pallas_triton.combine_reason(16, 64, 512) is None
    with pytest.raises(ValueError, match="combine='tree'"):
        _kernel(q, kv, widx, sink, ck, cidx, scale, combine="tree")

@pytest.mark.parametrize("num_splits,d_split,dtype", [(2, 1, jnp.bfloat16), (4, 2, jnp.bfloat16), (4, 1, jnp.float32)],
                         ids=["2splits", "4splits_2cols", "4splits_f32"])
def test_op_with_the_in_kernel_combine_matches_the_reference(num_splits, d_split, dtype):
    """combine="kernel": the last split program of each (row, head / column block) merges the splits
    inside the attention kernel. Against the reference (rows with no valid key give 0), against the
    XLA combine of the same partials (f32: to summation order), and one Triton call with no XLA
    combine left after it; the counters are a zeroed input aliased to an output."""
    q, kv, widx, sink, ck, cidx = make_case(None, d=128, dtype=dtype)
    scale = q.shape[-1] ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale)
    cfg = dict(block_k=16, num_splits=num_splits, d_split=d_split)
    o = _kernel(q, kv, widx, sink, ck, cidx, scale, combine="kernel", **cfg)
    check_close(o, r)
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)
    ox = _kernel(q, kv, widx, sink, ck, cidx, scale, combine="xla", **cfg)
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(o), np.asarray(ox), rtol=1e-6, atol=1e-7)
    else:  # the same f32 merge, then one bf16 rounding: at most one bf16 ulp apart
        of, xf = np.asarray(o, np.float32), np.asarray(ox, np.float32)
        np.testing.assert_allclose(of, xf, rtol=2.0**-7, atol=1e-6)
    jx = jax.make_jaxpr(lambda *a: pallas_triton.sparse_attention(
        *a[:4], scale=scale, comp_kv=a[4], comp_idx=a[5], interpret=True, combine="kernel", **cfg))(
        q, kv, widx, sink, ck, cidx).jaxpr
    calls = [e for e in jx.eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1 and not [e for e in jx.eqns if e.primitive.name == "dot_general"]
    assert calls[0].params["input_output_aliases"], "the counters must be aliased in -> out"
    # 3 splits (not a power of two: the [splits, heads] tiles of m and l): the XLA combine instead
    o3 = _kernel(q, kv, widx, sink, ck, cidx, scale, combine="kernel", block_k=16, num_splits=3)
    check_close(o3, r)


def test_in_kernel_combine_counts_with_one_scalar_atomic():
    """The split counter as lowered for the GPU: one scalar ``tt.atomic_rmw`` per program (one thread
    performs it and Triton broadcasts the old value), not a tensor atomic. The [1]-tensor form ran
    on the H200 with non-finite outputs (session 23). And the diagnostic outputs: after one call
    every counter holds the split count; counters passed in are used."""
    import re

    from pallas_kernels.inspect_sass import triton_kernels

    q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=1, d=128)
    cfg = dict(block_k=16, num_splits=4, d_split=2)
    (k,) = triton_kernels(lambda *a: pallas_triton.sparse_attention(
        *a[:4], scale=0.1, comp_kv=a[4], comp_idx=a[5], combine="kernel", **cfg), q, kv, widx, sink, ck, cidx)
    atomics = re.findall(r"tt\.atomic_rmw [^\n]*", k["ttir"])
    assert len(atomics) == 1 and "tensor<" not in atomics[0], atomics
    f = jax.jit(lambda *a, cnt=None: pallas_triton.sparse_attention(
        *a[:4], scale=0.1, comp_kv=a[4], comp_idx=a[5], interpret=True, combine="kernel", counters=cnt,
        return_partials=True, **cfg))
    o, (acc, m, l, counts, ob) = f(q, kv, widx, sink, ck, cidx)
    slots = 1 * 1 * 2  # rows x head blocks x column blocks
    np.testing.assert_array_equal(np.asarray(counts), np.full(slots, 4))
    o2, parts2 = f(q, kv, widx, sink, ck, cidx, cnt=jnp.full((slots,), 4, jnp.int32))  # nobody is last
    np.testing.assert_array_equal(np.asarray(parts2[3]), np.full(slots, 8))
    np.testing.assert_array_equal(np.asarray(parts2[0]), np.asarray(acc))  # the partials are still written


@pytest.mark.parametrize("combine", ["kernel", "pallas"])
def test_merge_in_groups_matches_the_loop(monkeypatch, combine):
    """MERGE_GROUP > 1 unrolls the merge of the splits and loads each group of partials before adding
    them (session 24: one split at a time took 13.4 µs at 16 splits on the H200); the splits are
    still added in order 0..P-1, so the result is the one-at-a-time loop's up to FMA contraction
    (f32 and bf16, 8 splits: two groups of 4, and groups of 3 that leave a remainder). In the
    lowered Triton IR the loop is gone and the merge's 8 accumulator loads are straight-line code."""
    import re

    from pallas_kernels.inspect_sass import triton_kernels

    for dtype in (jnp.float32, jnp.bfloat16):
        q, kv, widx, sink, ck, cidx = make_case(None, d=128, dtype=dtype)
        cfg = dict(block_k=8, num_splits=8, d_split=2, combine=combine)
        outs = {}
        for g in (1, 4, 3):
            monkeypatch.setattr(pallas_triton, "MERGE_GROUP", g)
            outs[g] = _kernel(q, kv, widx, sink, ck, cidx, 0.125, **cfg)
        check_close(outs[4], _ref(q, kv, widx, sink, ck, cidx, 0.125))
        outs = {g: np.asarray(o, np.float32) for g, o in outs.items()}
        # same order of additions; XLA on the CPU (interpret mode) may contract the unrolled
        # multiply-adds into FMAs differently from the loop's: a few f32 ulps, one bf16 rounding
        tol = dict(rtol=2.0**-20, atol=1e-7) if dtype == jnp.float32 else dict(rtol=2.0**-7, atol=1e-6)
        np.testing.assert_allclose(outs[4], outs[1], **tol)
        np.testing.assert_allclose(outs[3], outs[1], **tol)
    if combine == "kernel":
        q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=1, d=128)
        def lowered(group):  # a new function each time: the trace reads MERGE_GROUP
            monkeypatch.setattr(pallas_triton, "MERGE_GROUP", group)
            (kern,) = triton_kernels(lambda *a: pallas_triton.sparse_attention(
                *a[:4], scale=0.1, comp_kv=a[4], comp_idx=a[5], combine="kernel", block_k=16, num_splits=8,
                d_split=2), q, kv, widx, sink, ck, cidx)
            return kern

        k, k1 = lowered(4), lowered(1)
        loops = lambda t: len(re.findall(r"scf\.for", t))  # noqa: E731
        assert loops(k["ttir"]) == loops(k1["ttir"]) - 1  # the merge's loop is unrolled
        assert len(re.findall(r"tt\.load", k["ttir"])) > len(re.findall(r"tt\.load", k1["ttir"])) + 6


def test_in_kernel_combine_is_the_env_default_when_asked(monkeypatch):
    """DSV41_SPARSE_COMBINE picks the combine for calls that do not name one; a bad value fails at
    import with the variable's name."""
    import subprocess
    import sys

    monkeypatch.setattr(pallas_triton, "COMBINE", "kernel")
    q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=1, d=128)
    jx = jax.make_jaxpr(lambda *a: pallas_triton.sparse_attention(
        *a[:4], scale=0.1, comp_kv=a[4], comp_idx=a[5], interpret=True, num_splits=2, block_k=16))(
        q, kv, widx, sink, ck, cidx).jaxpr
    assert [e.primitive.name for e in jx.eqns].count("pallas_call") == 1
    assert not [e for e in jx.eqns if e.primitive.name == "dot_general"]  # no XLA combine after it
    out = subprocess.run([sys.executable, "-c", "import dsv41_jax, pallas_kernels.sparse_attention.pallas_triton"],
                         capture_output=True, text=True,
                         env={**__import__("os").environ, "DSV41_SPARSE_COMBINE": "tree"})
    assert out.returncode != 0 and "DSV41_SPARSE_COMBINE='tree': expected one of xla, pallas, kernel" in out.stderr


def test_default_config_splits_columns_by_grid():
    """Batch-1 decode (one program per flash-decoding split) takes eight column blocks with 4 warps
    (H200, session 13: 28.6 -> 16.7 us); 6, 8 and 32 rows (16, 16 and 4 key splits) two with 4 warps
    (H100, session 55: 46.5 -> 27.7 us at batch 8, 132.5 -> 64.4-64.7 at 32); batch 64 (2 splits),
    prefill rows, tiny head counts and a D whose eighth is not a multiple of 32 keep one column block."""
    cfg = pallas_triton.default_config(1, 64, 128, 512, "cuda")
    assert (cfg["d_split"], cfg["num_warps"], cfg["num_splits"]) == (8, 4, 16)
    for rows, splits in [(6, 16), (8, 16), (32, 4)]:
        cfg = pallas_triton.default_config(rows, 64, 128, 512, "cuda")
        assert (cfg["d_split"], cfg["num_warps"], cfg["num_splits"]) == (2, 4, splits), (rows, cfg)
    for rows, h, d in [(64, 64, 512), (2048, 64, 512), (1, 4, 512), (8, 16, 512), (1, 64, 128)]:
        cfg = pallas_triton.default_config(rows, h, 128, 512, "cuda", d)
        assert cfg["d_split"] == 1, (rows, h, d, cfg)
    assert pallas_triton.default_config(64, 64, 128, 512, "cuda")["num_warps"] == 8
    # a caller's d_split is kept, with its measured warps (one column block at batch 1: 8 warps, as before)
    assert pallas_triton.default_config(1, 64, 128, 512, "cuda", 512, 1)["num_warps"] == 8
    assert [pallas_triton.default_config(64, 64, 128, 512, "cuda", 512, 4)[k] for k in ("d_split", "num_warps")] == [4, 4]
    # prefill chunks (from KERNEL_BLOCKS_MIN_ROWS rows): DeepSeek's 64-key blocks, one split; decode 32
    rows_min = pallas_triton.KERNEL_BLOCKS_MIN_ROWS
    assert [pallas_triton.default_config(r, 64, 128, 512, "cuda")["block_k"] for r in (1, 64, rows_min - 1)] == [32] * 3
    for rows in (rows_min, 4096):
        cfg = pallas_triton.default_config(rows, 64, 128, 512, "cuda")
        assert (cfg["block_k"], cfg["num_splits"]) == (64, 1), cfg
    q, kv, widx, sink, ck, cidx = make_case(3, d=128)
    with pytest.raises(ValueError, match="d_split=0 must divide D=128"):
        _kernel(q, kv, widx, sink, ck, cidx, q.shape[-1] ** -0.5, d_split=0)


def test_splits_verify_rows_and_window_only():
    """Flash-decoding splits (jnp merge with the sink), S = 6 verify rows, odd list lengths (padding to
    the split granularity), and a window-only call (comp_kv=None)."""
    q, kv, widx, sink, ck, cidx = make_case(7, b=1, s=6, h=16, kw=37, kc=51)
    scale = q.shape[-1] ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale)
    o = _kernel(q, kv, widx, sink, ck, cidx, scale, block_k=16, num_splits=2)
    check_close(o, r)
    r = jax.jit(lambda *a: reference.sparse_attention(*a, scale=scale))(q, kv, widx, sink)
    o = jax.jit(lambda *a: pallas_triton.sparse_attention(*a, scale=scale, interpret=True, block_k=16))(q, kv, widx, sink)
    check_close(o, r)


def test_api_routes_and_reasons():
    q, kv, widx, sink, ck, cidx = make_case(3, b=1, s=1)
    scale = q.shape[-1] ** -0.5
    # auto on CPU = reference; explicit interpret = the kernel; both agree
    r = jax.jit(lambda *a: api.sparse_attention(*a[:4], scale=scale, comp_kv=a[4], comp_idx=a[5]))(
        q, kv, widx, sink, ck, cidx)
    o = jax.jit(lambda *a: api.sparse_attention(*a[:4], scale=scale, comp_kv=a[4], comp_idx=a[5],
                                                implementation="interpret"))(q, kv, widx, sink, ck, cidx)
    check_close(o, r)
    # unsupported shape: a readable reason, raised for an explicit "pallas"
    q_bad = jnp.zeros((1, 1, 16, 48), jnp.bfloat16)
    kv_bad = jnp.zeros((1, 8, 48), jnp.bfloat16)
    idx = jnp.zeros((1, 1, 4), jnp.int32)
    reason = pallas_triton.unsupported_reason(q_bad, kv_bad, idx)
    assert reason is not None and "power of two" in reason
    with pytest.raises(ValueError, match="power of two"):
        api.sparse_attention(q_bad, kv_bad, idx, sink, scale=1.0, implementation="pallas")
    # ...and the auto path falls back to the reference with that shape
    jax.jit(lambda *a: api.sparse_attention(*a, scale=1.0))(q_bad, kv_bad, idx, jnp.zeros((16,)))
    # fp8 window of the wrong block
    kv8 = jax.jit(lambda x: quantize_fp8(x, (32, 32)))(jnp.ones((1, 64, 64)))
    assert "block" in pallas_triton.unsupported_reason(q, kv8, widx)
    # compressed codes in another layout than nibbles: refused (the kernel decodes nibbles)
    assert "'f16pairs'" in pallas_triton.unsupported_reason(q, kv, widx, ck.with_packing("f16pairs"), cidx)



def test_auto_picks_by_the_measured_rules(monkeypatch):
    """'auto' on a GPU at decode (DSV41_SPARSE_DECODE "auto", the default): up to
    TWO_PASS_AUTO_ROWS = 8 rows over V4.1's stores take the kernel, which runs the two passes (the
    model gained 1.1 % at batch 1, session 47, and 0.6 % at batch 8 with session 55's tiles, H100);
    9 rows keep the XLA reference (batch 32 and 64 not run in the model); V4's plain stores keep it
    at batch 1 too (not measured); with "flash" batch 1 keeps it (the flash kernel was slower in the
    model, session 15). The dispatch passes the stores."""
    q, kv, widx, sink, ck, cidx = make_case(4, b=1, s=1)
    assert pallas_triton.DECODE_METHOD == "auto" and pallas_triton.auto_reason(q, kv, ck) is None
    assert pallas_triton.takes_two_pass(q, kv, widx, ck, cidx)
    assert pallas_triton.TWO_PASS_AUTO_ROWS == 8
    q8, kv8, widx8, _, ck8, cidx8 = make_case(5, b=8, s=1)
    assert pallas_triton.auto_reason(q8, kv8, ck8, kv_idx=widx8, comp_idx=cidx8) is None
    assert pallas_triton.takes_two_pass(q8, kv8, widx8, ck8, cidx8)
    q9, kv9, widx9, sink9, ck9, cidx9 = make_case(6, b=3, s=3)  # 9 rows
    assert "9 query row(s)" in pallas_triton.auto_reason(q9, kv9, ck9)
    assert not pallas_triton.takes_two_pass(q9, kv9, widx9, ck9, cidx9)
    qp, kvp, widxp, _, ckp, cidxp = make_case(7, b=1, s=1, quant=False)
    assert "1 query row(s)" in pallas_triton.auto_reason(qp, kvp, ckp)
    assert not pallas_triton.takes_two_pass(qp, kvp, widxp, ckp, cidxp)
    # a batch-1 list longer than the two-pass kernels take (an HCA layer near 1M tokens): the
    # reference, not the flash kernel they would fall back to
    long_list = SD((1, 1, 64 * pallas_triton_two_pass.MAX_BLOCKS), jnp.int32)
    assert pallas_triton.auto_reason(q, kv, ck, kv_idx=widx, comp_idx=cidx) is None
    assert "two-pass kernels do not take" in pallas_triton.auto_reason(q, kv, ck, kv_idx=widx, comp_idx=long_list)
    monkeypatch.setattr(pallas_triton, "DECODE_METHOD", "flash")
    assert "slower in the model" in pallas_triton.auto_reason(q, kv, ck)
    monkeypatch.setattr(pallas_triton, "DECODE_METHOD", "auto")
    # the dispatch under plain 'auto' as on a GPU (resolved to the kernel in interpret mode)
    from pallas_kernels import dispatch

    monkeypatch.setattr(dispatch, "resolve", lambda implementation=None, op=None: "interpret")
    asked, calls = [], []
    reason, kernel = pallas_triton.auto_reason, pallas_triton.sparse_attention
    monkeypatch.setattr(pallas_triton, "auto_reason", lambda *a, **k: asked.append((a, k)) or reason(*a, **k))
    monkeypatch.setattr(pallas_triton, "sparse_attention", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    for args in ((q, kv, widx, sink, ck, cidx), (q9, kv9, widx9, sink9, ck9, cidx9)):
        jx = str(jax.make_jaxpr(lambda *a: api.sparse_attention(*a[:4], scale=0.125, comp_kv=a[4], comp_idx=a[5]))(*args))
        assert ("sparse_attention_pv" in jx) == (args[0] is q)
        o = jax.jit(lambda *a: api.sparse_attention(*a[:4], scale=0.125, comp_kv=a[4], comp_idx=a[5]))(*args)
        check_close(o, _ref(*args, 0.125))
    a, k = asked[0]  # the stores and the lists
    assert q9.shape not in calls and q.shape in calls and isinstance(a[2], Fp4Tensor)
    assert (k["kv_idx"].shape, k["comp_idx"].shape) == (widx.shape, cidx.shape)


SD = jax.ShapeDtypeStruct


def _real_specs(b, s, nw, nc, kw, kc, dtype=jnp.bfloat16):
    h, d = 64, 512
    return (
        SD((b, s, h, d), dtype),
        Fp8Tensor(SD((b, nw, d), jnp.float8_e4m3fn), SD((b, nw, d // 32), jnp.float8_e8m0fnu), block=(1, 32)),
        SD((b, s, kw), jnp.int32),
        SD((h,), jnp.float32),
        Fp4Tensor(SD((b, nc, d // 2), jnp.uint8), SD((b, nc, d // 16), jnp.float8_e4m3fn), block=16),
        SD((b, s, kc), jnp.int32),
    )


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 128, (1 << 20) + 3, 128, 512),   # decode, batch 1, 1M-entry ratio-1 cache (split path)
        (64, 1, 128, 65536, 128, 512),          # decode, batch 64 (no split)
        (4, 6, 133, 262144, 134, 512),          # speculative verify: 1 + 5 rows, window + chunk
        (1, 2048, 2176, 1 << 20, 2176, 512),    # prefill chunk of 2048 tokens at 1M context
    ],
    ids=["decode_b1_1M", "decode_b64_64K", "verify_s6", "prefill_2048_1M"],
)
def test_cross_lowering(target, shape):
    def f(q, kv, widx, sink, ck, cidx):
        return pallas_triton.sparse_attention(q, kv, widx, sink, scale=512 ** -0.5, comp_kv=ck, comp_idx=cidx)

    text = lower_for(target, f, *_real_specs(*shape)).as_text()
    assert "triton" in text
    if shape[1] > 1:  # prefill / verify: DeepSeek's 64-key blocks shifted by a per-row window width
        text = lower_for(target, lambda *a: pallas_triton.sparse_attention(
            *a[:4], scale=512 ** -0.5, comp_kv=a[4], comp_idx=a[5], block_k=64, num_splits=1, window_width=a[6]),
            *_real_specs(*shape), SD((shape[0],), jnp.int32)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
    if shape[1] == 1:  # decode: the column-split variant lowers too
        lower_for(target, lambda *a: pallas_triton.sparse_attention(*a[:4], scale=512 ** -0.5, comp_kv=a[4],
                                                                    comp_idx=a[5], d_split=4), *_real_specs(*shape))
        text = lower_for(target, lambda *a: pallas_triton.sparse_attention(*a[:4], scale=512 ** -0.5, comp_kv=a[4],
                                                                           comp_idx=a[5], combine="pallas"),
                         *_real_specs(*shape)).as_text()
        if shape[0] == 1:  # batch 1 splits the keys: the Pallas combine is a second Triton call
            assert text.count("__gpu$xla.gpu.triton") == 2, text.count("__gpu$xla.gpu.triton")
        # the in-kernel combine (the counter atomics and the last program's merge) lowers too
        text = lower_for(target, lambda *a: pallas_triton.sparse_attention(*a[:4], scale=512 ** -0.5, comp_kv=a[4],
                                                                           comp_idx=a[5], combine="kernel"),
                         *_real_specs(*shape)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1


def test_cross_lowering_f32_plain():
    h, d = 64, 512
    specs = (SD((2, 1, h, d), jnp.float32), SD((2, 128, d), jnp.float32), SD((2, 1, 128), jnp.int32), SD((h,), jnp.float32))
    for target in ("cuda", "rocm"):
        lower_for(target, lambda q, kv, i, s: pallas_triton.sparse_attention(q, kv, i, s, scale=0.04), *specs)


def test_reference_bf16_logits_equal_float32_logits():
    """With bf16 q and keys exact in bf16 (FP8 window, FP4 compressed), the reference takes bf16 rows
    and one bf16 dot with fp32 accumulation; the same keys as float32 stores take the fp32 path. The
    two agree within the output's bf16 rounding (the logits differ only in fp32 summation order)."""
    q, kv, widx, sink, ck, cidx = make_case(None, d=128)
    kv32, ck32 = jax.jit(lambda a, b: (a.dequantize(jnp.float32), b.dequantize(jnp.float32)))(kv, ck)
    assert exact_in_bf16(kv) and exact_in_bf16(ck) and not exact_in_bf16(kv32)
    low = _ref(q, kv, widx, sink, ck, cidx, 0.1)
    full = _ref(q, kv32, widx, sink, ck32, cidx, 0.1)
    def dots(*args):
        jx = jax.make_jaxpr(lambda *a: reference.sparse_attention(*a[:4], scale=0.1, comp_kv=a[4], comp_idx=a[5]))(*args)
        return [[str(v.aval.dtype) for v in e.invars] for e in jx.jaxpr.eqns if e.primitive.name == "dot_general"]

    assert dots(q, kv, widx, sink, ck, cidx)[0] == ["bfloat16", "bfloat16"]  # logits: bf16 x bf16
    assert dots(q, kv32, widx, sink, ck32, cidx)[0] == ["float32", "float32"]
    check_close(low, full)
    assert np.array_equal(np.asarray(low[0, 0], np.float32), np.zeros_like(np.asarray(low[0, 0], np.float32)))


def test_site_benchmark_runs_and_checks_each_variant(monkeypatch):
    """benchmark.site (the model's decode site by device time) on the CPU: the kernel in interpret
    mode, the profiler timing replaced by a stub; every variant is checked against the XLA site."""
    import functools

    import pallas_kernels.benchmarking as bm
    from pallas_kernels.sparse_attention import benchmark

    monkeypatch.setattr(bm, "device_time_op", lambda fn, args, shared=(), reps=5, kernels=None: 1e-5)
    monkeypatch.setattr(pallas_triton, "sparse_attention",
                        functools.partial(pallas_triton.sparse_attention, interpret=True))
    lines = []
    rows = benchmark.site(lines.append, contexts=(700,), batches=(1,),
                          variants=benchmark.SITE_VARIANTS[:1] + benchmark.SITE_VARIANTS[2:4], reps=1)
    assert [r["variant"] for r in rows] == ["xla", "pallas combine", "pallas in-kernel combine"], lines
    assert rows[0]["rel_err"] == 0.0 and all(0.0 < r["rel_err"] < 2e-2 for r in rows[1:]) and all(r["ok"] for r in rows)


def test_rounding_benchmark_runs_each_variant(monkeypatch):
    """benchmark.site with the --rounding variants (the XLA reference's two roundings, the Pallas
    kernel in 64-key blocks) on the CPU, timing stubbed: each runs and is checked against the first."""
    import functools

    import pallas_kernels.benchmarking as bm
    from pallas_kernels.sparse_attention import benchmark

    monkeypatch.setattr(bm, "device_time_op", lambda fn, args, shared=(), reps=5, kernels=None: 1e-5)
    monkeypatch.setattr(pallas_triton, "sparse_attention",
                        functools.partial(pallas_triton.sparse_attention, interpret=True))
    lines = []
    rows = benchmark.site(lines.append, contexts=(700,), batches=(1,), variants=benchmark.ROUNDING_VARIANTS, reps=1)
    assert [r["variant"] for r in rows] == [v for v, _ in benchmark.ROUNDING_VARIANTS], lines
    assert all(r["ok"] for r in rows), lines


def _deepseek_sparse_attn(q, kv, idx, sink, scale, block=64):
    """DeepSeek's sparse_attn_kernel in numpy: the index list in blocks of ``block`` keys, fp32
    logits, a running maximum m, the unnormalised exp(l - m) cast to bf16 for each block's P.V, the
    fp32 accumulator and sum rescaled by exp(m_old - m_new) from block to block, the sink added to
    the sum and the division at the end."""
    q, kv = np.asarray(q, np.float32), np.asarray(kv, np.float32)
    rows = kv[np.arange(kv.shape[0])[:, None, None], np.maximum(idx, 0)]  # [B,S,K,D]
    l = np.einsum("bshd,bskd->bshk", q, rows) * np.float32(scale)
    l = np.where((idx >= 0)[:, :, None, :], l, -np.inf).astype(np.float32)
    m = np.full(l.shape[:-1] + (1,), -np.inf, np.float32)
    den = np.zeros_like(m)
    acc = np.zeros(q.shape, np.float32)
    for k0 in range(0, l.shape[-1], block):
        lb = l[..., k0:k0 + block]
        m_new = np.maximum(m, lb.max(-1, keepdims=True))
        m_safe = np.where(np.isfinite(m_new), m_new, 0).astype(np.float32)
        alpha = np.exp(m - m_safe).astype(np.float32)
        e = np.exp(lb - m_safe).astype(np.float32)
        w = np.asarray(jnp.asarray(e).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        pv = np.einsum("bshk,bskd->bshd", w, rows[:, :, k0:k0 + block].astype(np.float64)).astype(np.float32)
        den = (den * alpha + e.sum(-1, keepdims=True)).astype(np.float32)
        acc = (acc * alpha + pv).astype(np.float32)
        m = m_new
    m_safe = np.where(np.isfinite(m), m, 0).astype(np.float32)
    den = den + np.exp(np.asarray(sink, np.float32)[None, None, :, None] - m_safe)
    return np.asarray(jnp.asarray((acc / den).astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("keys", [1, 2, 40])
def test_reference_casts_the_unnormalised_weights_as_deepseeks_kernel(keys):
    """bf16: the reference's P.V weights are exp(l - m) cast to bf16 (1.0 for the largest logit), the
    fp32 sum divided by the denominator at the end, as DeepSeek's kernel does. Before session 35 it cast
    the normalised probability, bf16(1 / den) at one key: ~2**-9 off in every output, which the
    cross-check against DeepSeek's V4.1 code on the CPU traced as the first layer's main difference.
    At 1 key the result is bit-exact (the weight is exp(0) = 1); at 2, every element but the rare one
    where XLA's and numpy's fp32 exp differ by an ulp across a bf16 rounding boundary of the second
    weight (session 47: 1 of 3,072 elements one bf16 ulp off, 0.09912 against 0.09961, failed the old
    exact bound in 2 of 22 runs of this file); at 40, almost every element (fp32 exp and summation
    order)."""
    rng = np.random.default_rng()
    b, s, h, d, n = 2, 3, 8, 64, 48
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, n, d)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(h) * 2, jnp.float32)
    idx = np.stack([np.stack([rng.permutation(n)[:keys] for _ in range(s)]) for _ in range(b)]).astype(np.int32)
    got = np.asarray(reference.sparse_attention(q, kv, jnp.asarray(idx), sink, scale=d ** -0.5), np.float32)
    want = _deepseek_sparse_attn(q, kv, idx, sink, d ** -0.5)
    if keys == 1:
        np.testing.assert_array_equal(got, want)
    elif keys == 2:
        rel = np.abs(got - want) / np.abs(want).max(axis=-1, keepdims=True)
        assert np.max(rel) <= 2.0 ** -6 and np.sum(got != want) <= 3, np.sum(got != want)
    else:
        # almost every element equal; the rest within 2**-6 of their head's largest element: XLA's and
        # numpy's exp can differ by an fp32 ulp, which flips a weight's bf16 rounding (2**-8 of that
        # key's term). Session 46: worst 2**-7.7, at least 99.5 % equal over 100 draws; the bound
        # before (one ulp of each element) failed ~1 draw in 20. The old normalised cast is ~2**-9
        # off in every element, so the share of equal elements is what catches it
        rel = np.abs(got - want) / np.abs(want).max(axis=-1, keepdims=True)
        assert np.max(rel) <= 2.0 ** -6 and np.mean(got == want) > 0.97


def _decode_list_case(b, s=2, h=16, d=64, nw=128, nc=1024, kc=512):
    """V4.1's decode lists at a small width: a 128-slot window ring (row 0's still filling: -1 slots
    first), then 512 sorted compressed picks (row b-1's last query sees fewer: -1 at the end): ten
    blocks of 64. Key scales grow along the compressed cache, so later blocks hold larger logits and
    the running maximum rises block by block, as over a real context. Returns the inputs and
    DeepSeek's loop's output on them."""
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    win = jnp.asarray(rng.standard_normal((b, nw, d)) * 1.5, jnp.bfloat16)
    comp = jnp.asarray(rng.standard_normal((b, nc, d)) * np.linspace(0.5, 3, nc)[None, :, None], jnp.bfloat16)
    widx = np.broadcast_to(np.arange(nw, dtype=np.int32), (b, s, nw)).copy()
    widx[0, :, :37] = -1
    cidx = np.sort(np.stack([np.stack([rng.permutation(nc)[:kc] for _ in range(s)]) for _ in range(b)]), -1)
    cidx = cidx.astype(np.int32)
    cidx[b - 1, s - 1, -100:] = -1
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    want = _deepseek_sparse_attn(q, np.concatenate([np.asarray(win, np.float32), np.asarray(comp, np.float32)], 1),
                                 np.concatenate([widx, np.where(cidx >= 0, cidx + nw, -1)], -1), sink, d ** -0.5)
    return q, win, jnp.asarray(widx), sink, comp, jnp.asarray(cidx), want


@pytest.mark.parametrize("pv_parts", [3, 2])
def test_reference_emulates_the_kernels_running_maximum(pv_parts):
    """bf16 over V4.1's decode lists (:func:`_decode_list_case`): the kernel rounds each block's
    weights relative to the running maximum, and the reference emulates that. Measured on the CPU:
    with the row's maximum instead, 14-19 % of the outputs differed from the kernel by up to 2 bf16
    ulps (40 draws); with the emulation, at most 0.3 % by one ulp (median 0.02 % with 3
    parts, 0.07 % with 2: fp32 summation order, and the 2 parts' 2**-17 weight error)."""
    q, win, widx, sink, comp, cidx, want = _decode_list_case(2)
    kw = dict(scale=64 ** -0.5, comp_kv=comp, comp_idx=cidx)
    got = np.asarray(reference.sparse_attention(q, win, widx, sink, running_max_block=64, pv_parts=pv_parts, **kw),
                     np.float32)
    row_max = np.asarray(reference.sparse_attention(q, win, widx, sink, running_max_block=None, **kw), np.float32)
    # one bf16 ulp of each row's largest element: fp32 summation order (and the 2 parts' 2**-17
    # weight error) show most in outputs that cancel, so not of each element
    mag = np.abs(want).max(-1, keepdims=True)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(mag, 1e-30))) - 7)
    assert np.max(np.abs(got - want) / ulp) <= 1.0
    assert np.mean(got != want) <= 1e-2, np.mean(got != want)
    assert np.mean(row_max != want) > 5e-2  # the emulation is what makes the difference


def _prefill_list_case(widths, s=3, h=16, d=64, nw=128, nc=256, kc=160):
    """Prefill lists of prompts shorter than the window: row b's window list holds ``widths[b]``
    entries (positions 0..t of query t, then -1) and -1 up to our fixed ``nw`` slots, then ``kc``
    sorted compressed picks (-1 at the end of some). DeepSeek's list is ``widths[b]`` window entries
    wide (``get_window_topk_idxs``: ``min(L, window)``), so its 64-key blocks hold other keys than
    ours. Returns the inputs and DeepSeek's loop's output on its own lists."""
    rng = np.random.default_rng()
    b = len(widths)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    win = jnp.asarray(rng.standard_normal((b, nw, d)) * 1.5, jnp.bfloat16)
    comp = jnp.asarray(rng.standard_normal((b, nc, d)) * np.linspace(0.5, 3, nc)[None, :, None], jnp.bfloat16)
    widx = np.full((b, s, nw), -1, np.int32)
    for i, w in enumerate(widths):
        for t in range(s):
            n = max(1, w - (s - 1 - t))  # query t of the last s positions of a w-token prompt
            widx[i, t, :n] = np.arange(n)
    cidx = np.sort(np.stack([np.stack([rng.permutation(nc)[:kc] for _ in range(s)]) for _ in range(b)]), -1)
    cidx = cidx.astype(np.int32)
    cidx[:, 0, -37:] = -1
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    store = np.concatenate([np.asarray(win, np.float32), np.asarray(comp, np.float32)], 1)
    want = np.concatenate([
        _deepseek_sparse_attn(q[i:i + 1], store[i:i + 1],
                              np.concatenate([widx[i:i + 1, :, :w], np.where(cidx[i:i + 1] >= 0, cidx[i:i + 1] + nw, -1)],
                                             -1), sink, d ** -0.5)
        for i, w in enumerate(widths)])
    return q, win, jnp.asarray(widx), sink, comp, jnp.asarray(cidx), want


# DeepSeek's window widths for prompts of 1, 37, 64, 100 and 128 tokens (128: the whole window list)
_PREFILL_WIDTHS = (1, 37, 64, 100, 128)


def test_reference_emulates_deepseeks_blocks_for_prompts_shorter_than_the_window():
    """A prompt shorter than the 128-token window: DeepSeek's prefill window list is as wide as the
    prompt, so its compressed entries, and its 64-key blocks, start earlier than in our fixed
    128-slot list. With ``window_width`` the emulation runs its blocks over DeepSeek's list: the bf16
    outputs equal the transcription's but for fp32 summation order (as over decode lists); without it
    they round other blocks and differ more often."""
    q, win, widx, sink, comp, cidx, want = _prefill_list_case(_PREFILL_WIDTHS)
    kw = dict(scale=64 ** -0.5, comp_kv=comp, comp_idx=cidx, running_max_block=64)
    got = np.asarray(reference.sparse_attention(q, win, widx, sink, window_width=jnp.asarray(_PREFILL_WIDTHS), **kw),
                     np.float32)
    mag = np.abs(want).max(-1, keepdims=True)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(mag, 1e-30))) - 7)
    assert np.max(np.abs(got - want) / ulp) <= 1.0
    assert np.mean(got != want) <= 1e-2, np.mean(got != want)
    fixed = np.asarray(reference.sparse_attention(q, win, widx, sink, **kw), np.float32)
    short = np.asarray(_PREFILL_WIDTHS) < 128
    assert np.mean(fixed[short] != want[short]) > 5e-2  # the width is what makes the difference
    np.testing.assert_array_equal(fixed[~short], got[~short])  # the full width changes nothing


def test_window_width_ignores_the_window_entries_beyond_it():
    """Window entries at or beyond ``window_width`` are not DeepSeek's keys: they are ignored even
    where the list holds a valid index there (row max and emulation alike)."""
    q, win, widx, sink, comp, cidx, _ = _prefill_list_case((40, 90))
    filled = jnp.asarray(np.broadcast_to(np.arange(128, dtype=np.int32), widx.shape))  # every slot valid
    for block in (None, 64):
        kw = dict(scale=64 ** -0.5, comp_kv=comp, comp_idx=cidx, running_max_block=block,
                  window_width=jnp.asarray([40, 90]))
        a = reference.sparse_attention(q, win, filled, sink, **kw)
        cut = jnp.where(jnp.arange(128)[None, None, :] < jnp.asarray([40, 90])[:, None, None], filled, -1)
        b_ = reference.sparse_attention(q, win, cut, sink, **kw)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))


def test_running_max_factors_edge_cases():
    """Blocks before the first valid key (running maximum -inf) get factor 0 and a finite key max;
    a row with no valid key at all gets all-zero factors; blocks from the row maximum's on get 1."""
    l = jnp.asarray([[-jnp.inf, -jnp.inf, 1.0, 3.0, 2.0, -jnp.inf],
                     [-jnp.inf] * 6,
                     [5.0, 1.0, 2.0, 0.0, -1.0, 7.0]], jnp.float32)
    m = jnp.asarray([[3.0], [0.0], [7.0]], jnp.float32)
    mk, f = reference.running_max_factors(l, m, 2)
    np.testing.assert_array_equal(np.asarray(mk), [[0, 0, 3, 3, 3, 3], [0] * 6, [5, 5, 5, 5, 7, 7]])
    np.testing.assert_array_equal(np.asarray(f[0]), [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(f[1]), [0] * 6)
    np.testing.assert_allclose(np.asarray(f[2]), np.exp([-2, -2, -2, -2, 0, 0]), rtol=1e-7)
    p = jnp.asarray(np.random.default_rng().standard_normal((10, 10, 10)) * 1e3, jnp.float32)
    parts = reference.split_bf16(p, 3).astype(jnp.float32)  # [10, 3, 10, 10]
    np.testing.assert_array_equal(np.asarray(parts[:, 2] + parts[:, 1] + parts[:, 0]), np.asarray(p))


def test_kernel_with_64_key_blocks_is_deepseeks_loop():
    """The Pallas kernel (interpret mode) with 64-key blocks and one split over V4.1's decode lists
    (:func:`_decode_list_case`): its online softmax is DeepSeek's block loop, so bf16 outputs equal
    the transcription's but for fp32 summation order (measured 0-0.05 % of the elements); the
    default tiling (32-key blocks, flash-decoding splits) rounds differently (18-24 %)."""
    q, win, widx, sink, comp, cidx, want = _decode_list_case(1)
    got = np.asarray(_kernel(q, win, widx, sink, comp, cidx, 64 ** -0.5, block_k=64, num_splits=1), np.float32)
    assert np.mean(got != want) <= 1e-2, np.mean(got != want)
    default = np.asarray(_kernel(q, win, widx, sink, comp, cidx, 64 ** -0.5), np.float32)
    assert np.mean(default != want) > 5e-2


def test_kernel_walks_deepseeks_blocks_for_prompts_shorter_than_the_window():
    """The Pallas kernel (interpret mode, 64-key blocks, one split) with ``window_width``: its blocks
    are DeepSeek's over a prompt shorter than the window (:func:`_prefill_list_case`), one block holding
    the end of the window list and the start of the compressed one; bf16 outputs equal the
    transcription's but for fp32 summation order. Without the width it rounds other blocks."""
    q, win, widx, sink, comp, cidx, want = _prefill_list_case(_PREFILL_WIDTHS)
    got = np.asarray(_kernel(q, win, widx, sink, comp, cidx, 64 ** -0.5, block_k=64, num_splits=1,
                             window_width=jnp.asarray(_PREFILL_WIDTHS)), np.float32)
    assert np.mean(got != want) <= 1e-2, np.mean(got != want)
    fixed = np.asarray(_kernel(q, win, widx, sink, comp, cidx, 64 ** -0.5, block_k=64, num_splits=1), np.float32)
    short = np.asarray(_PREFILL_WIDTHS) < 128
    assert np.mean(fixed[short] != want[short]) > 5e-2
    with pytest.raises(ValueError, match="window_width.*num_splits=2 must be 1"):
        _kernel(q, win, widx, sink, comp, cidx, 64 ** -0.5, block_k=64, num_splits=2, window_width=5)


# ------------------------------------------------------------------------------------------------
# the two-pass decode kernels (pallas_triton_two_pass): parity with the reference's default numerics
# (row maximum), the dispatch switch (DSV41_SPARSE_DECODE / method), refused configs, cuda / rocm lowering

SMALL = dict(bk1=16, bk2=32, dc=32, dv=32)  # several key blocks and column blocks at the tiny shapes


def _two_pass(q, kv, widx, sink, ck, cidx, scale, config=SMALL):
    f = jax.jit(lambda *a: pallas_triton_two_pass.sparse_attention(*a[:4], scale=scale, comp_kv=a[4], comp_idx=a[5],
                                                                   interpret=True, config=config))
    return f(q, kv, widx, sink, ck, cidx)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("quant", [True, False], ids=["fp8win_fp4comp", "plain"])
@pytest.mark.parametrize("stage", [True, False], ids=["staged_values", "gathered_values"])
def test_two_pass_parity_interpret(dtype, quant, stage):
    """B 2 x S 2 rows over a 20-entry window list and a 40-entry compressed list (padded to the key
    blocks), ~20 % -1 entries, a row with no valid key (-> 0) and a row with compressed keys only;
    pass 2 reading pass 1's decoded rows (the default) or gathering and decoding its own."""
    q, kv, widx, sink, ck, cidx = make_case(None, dtype=dtype, quant=quant)
    scale = q.shape[-1] ** -0.5
    r = _ref(q, kv, widx, sink, ck, cidx, scale)
    o = _two_pass(q, kv, widx, sink, ck, cidx, scale, config={**SMALL, "stage_values": stage})
    check_close(o, r)
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)  # no valid key -> 0
    assert np.any(np.asarray(o[1, 1], np.float32) != 0.0)  # compressed picks only


def test_two_pass_load_groups_do_not_change_the_sums():
    """``group`` only moves pass 2's loads ahead of its arithmetic and ``stage_values`` only where its
    values come from: groups of 1, 2 (a remainder over the 3 key blocks) and 4, staged or gathered,
    give the same bits; and 3 key blocks of pass 1 (not a power of two) leave
    unwritten rows in the padded block-maxima array, which pass 2 must mask (a wrong row maximum
    would move every weight). One key split for both (the gathering form has no other): with the
    staged form's default 3 splits, XLA's sum of the splits at -O0 rounded one element of 1 in ~40
    draws one bf16 ulp away from the in-kernel sum (session 51, a fresh-clone CI run; seed 33 of
    make_case) -- the splits' own test is test_two_pass_key_splits."""
    q, kv, widx, sink, ck, cidx = make_case(None, dtype=jnp.bfloat16)
    outs = [np.asarray(_two_pass(q, kv, widx, sink, ck, cidx, 0.125,
                                 config={**SMALL, "bk1": 32, "group": g, "stage_values": st, "split": 64}), np.float32)
            for g in (1, 2, 4) for st in (True, False)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    check_close(jnp.asarray(outs[0], jnp.bfloat16), _ref(q, kv, widx, sink, ck, cidx, 0.125))


@pytest.mark.parametrize("split", [1, 2, 64], ids=["three_splits", "two_splits_padded", "one_split"])
def test_two_pass_key_splits(split):
    """Pass 2 over key splits: each split's fp32 sums, added in XLA without rescaling (every split
    uses the row maximum). The 3 key blocks of 32 (window 20 -> 32, compressed 40 -> 64) run in 3
    splits, in 2 (the second with a padded block of -1 entries: its weights must be 0) or in 1;
    every form within the reference's tolerance, and the splits agree with the one-split form to
    the fp32 summation order. The no-valid-key row stays 0."""
    q, kv, widx, sink, ck, cidx = make_case(None, dtype=jnp.bfloat16)
    r = _ref(q, kv, widx, sink, ck, cidx, 0.125)
    o = _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config={**SMALL, "split": split})
    check_close(o, r)
    one = np.asarray(_two_pass(q, kv, widx, sink, ck, cidx, 0.125, config={**SMALL, "split": 64}), np.float32)
    np.testing.assert_allclose(np.asarray(o, np.float32), one, rtol=2 ** -7, atol=1e-3 * np.abs(one).max())
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)


def test_two_pass_looped_pass1_gives_the_same_bits():
    """``p1_loop``: pass-1 programs that walk 4 key blocks of one list (q loaded once, the next
    block's loads issued ahead) give the one-block programs' bits, and so do 2-block programs under
    gathered values (which test_two_pass_load_groups_do_not_change_the_sums ties to the staged ones):
    every block's dot is the same computation. bk1 16 and bk2 64 put the window list (20 -> 64) and
    the compressed one (40 -> 64) in 4 blocks each. Which count a call takes where a list's blocks do
    not divide by the one asked: :func:`pass1_loop`'s cases. Fresh inputs, within the reference's
    tolerance."""
    q, kv, widx, sink, ck, cidx = make_case(None, dtype=jnp.bfloat16)
    cfg = {**SMALL, "bk2": 64, "split": 64}
    one = np.asarray(_two_pass(q, kv, widx, sink, ck, cidx, 0.125, config=cfg), np.float32)
    for extra in ({"p1_loop": 4}, {"p1_loop": 2, "stage_values": False}):
        got = _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config={**cfg, **extra})
        np.testing.assert_array_equal(np.asarray(got, np.float32), one, err_msg=str(extra))
    check_close(got, _ref(q, kv, widx, sink, ck, cidx, 0.125))
    loop = pallas_triton_two_pass.pass1_loop
    assert loop(8, [4, 4]) == 4 and loop(4, [2, 4]) == 2 and loop(4, [4, 20]) == 4 and loop(4, [4, 18]) == 2
    for bad in (3, 0, 2.0):
        with pytest.raises(ValueError, match="p1_loop"):
            _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config={**SMALL, "p1_loop": bad})


def test_two_pass_skipping_empty_blocks_gives_the_same_bits():
    """``skip_empty``: key blocks whose entries are all -1 are not computed (pass 1 writes -inf logits
    and zero staged rows; pass 2 skips a block whose pass-1 maxima are all -inf). Lists as the model's
    short contexts have them (the compressed list's valid entries first, ascending, then -1 padding;
    the window's tail -1 in some rows), a row with no valid key, a row whose first blocks are empty,
    and a pass-2 block half of which is empty (bk1 16, bk2 32): the default's bits, staged over 1 and
    several key splits and gathered, and within the reference's tolerance. With p1_loop it is refused."""
    q, kv, widx, sink, ck, cidx = make_case(None, dtype=jnp.bfloat16, kc=96)
    rng = np.random.default_rng()
    w, c = np.array(widx), np.array(cidx)
    for r in range(c.shape[0]):
        for t in range(c.shape[1]):
            n = int(rng.integers(1, 40))  # valid compressed entries: 1-39 of 96 (3 pass-2 blocks of 32 at most 2 live)
            c[r, t] = np.concatenate([np.sort(rng.choice(100, n, replace=False)), -np.ones(96 - n, np.int64)])
    w[0, 1, 5:] = -1  # window: its second block of 16 empty
    c[0, 0] = -1  # row (0, 0): no valid key at all (its window is -1 too, make_case)
    w[1, 0] = -1  # row (1, 0): compressed picks only
    widx, cidx = jnp.asarray(w), jnp.asarray(c)
    for extra in ({"split": 64}, {"split": 1}, {"stage_values": False}):
        cfg = {**SMALL, **extra}
        base = np.asarray(_two_pass(q, kv, widx, sink, ck, cidx, 0.125, config=cfg), np.float32)
        got = _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config={**cfg, "skip_empty": True})
        np.testing.assert_array_equal(np.asarray(got, np.float32), base, err_msg=str(extra))
    assert not np.asarray(got[0, 0], np.float32).any()  # no valid key: 0
    check_close(got, _ref(q, kv, widx, sink, ck, cidx, 0.125))
    with pytest.raises(ValueError, match="skip_empty with p1_loop"):
        _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config={**SMALL, "skip_empty": True, "p1_loop": 2})
    # the empty blocks are really skipped: compressed row 0 (what a -1 entry reads) made NaN, the valid
    # entries whole blocks that never list row 0 -- staged, 16 or 32 of 96 (whole pass-1 blocks: a
    # pass-2 block may be half empty, its empty half staged as zeros); gathered, 32 (pass 2 gathers a
    # live block's -1 entries as row 0, as without skipping). Computed, an empty block stages or
    # gathers NaN rows that pass 2 weighs by 0 (NaN); skipped, the output is the store's without the NaN.
    nan_ck = Fp4Tensor(data=ck.data, scale=ck.scale.at[:, 0].set(jnp.nan), block=ck.block)
    for extra, sizes in (({"split": 64}, (16, 32)), ({"stage_values": False}, (32,))):
        for r in range(c.shape[0]):
            for t in range(c.shape[1]):
                n = int(rng.choice(sizes))
                c[r, t] = np.concatenate([np.sort(rng.choice(np.arange(1, 100), n, replace=False)), -np.ones(96 - n)])
        cidx = jnp.asarray(c)
        cfg = {**SMALL, **extra}
        assert np.isnan(np.asarray(_two_pass(q, kv, widx, sink, nan_ck, cidx, 0.125, config=cfg), np.float32)).any()
        got = _two_pass(q, kv, widx, sink, nan_ck, cidx, 0.125, config={**cfg, "skip_empty": True})
        base = _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config=cfg)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(base, np.float32), err_msg=str(extra))


def test_two_pass_gathering_pass2_over_all_64_heads():
    """Pass 2 gathering and decoding its own values for all 64 heads of a row at once (``bh`` 64, the
    ``--tiles`` candidate that decodes each value element once), after a looped pass 1: within the
    reference's tolerance on fresh inputs, the no-valid-key row 0."""
    q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=2, h=64, d=64, dtype=jnp.bfloat16)
    cfg = {**SMALL, "bk2": 64, "stage_values": False, "bh": 64, "pv_warps": 8, "p1_loop": 2}
    o = _two_pass(q, kv, widx, sink, ck, cidx, 0.125, config=cfg)
    check_close(o, _ref(q, kv, widx, sink, ck, cidx, 0.125))
    assert np.all(np.asarray(o[0, 0], np.float32) == 0.0)


def test_two_pass_key_split_choice():
    """``split=None``: the fewest blocks per program that reach ``pv_programs`` programs, spread
    evenly, or an even split of at least half as many splits where that count would pad the last
    split; an explicit split is kept (cut to the list); the gathering form refuses several splits."""
    ks = pallas_triton_two_pass.key_splits
    cfg = dict(pallas_triton_two_pass.DEFAULTS)
    # the defaults at V4.1's shapes (64 heads in blocks of 16, D 512 in 2 column blocks of dv 256, 10
    # key blocks; session 55): batch 1 10 splits of one block, 6 verify rows 5 of 2, batch 8 2 of 5,
    # batch 32 and 64 one split
    assert (cfg["pv_programs"], 512 // cfg["dv"], 64 // cfg["bh"]) == (256, 2, 4)
    assert [ks(r, 4, 2, 10, cfg) for r in (1, 6, 8, 32, 64)] == [1, 2, 5, 10, 10]
    cfg["pv_programs"] = 512  # the rule at sessions 49-54's 512 programs and 8 column blocks of 64
    assert ks(1, 4, 8, 10, cfg) == 1  # batch 1, V4.1's 640 keys: 32 programs x 10 splits
    assert ks(8, 4, 8, 10, cfg) == 5  # batch 8: 256 programs x 2 splits
    # 6 verify rows (192 programs): 3 splits would take 4, 4 and 2 blocks padded to 4 (12 blocks of
    # work); 2 even splits of 5 instead. Batch 4 likewise (4 splits of 3 -> 2 of 5).
    assert ks(6, 4, 8, 10, cfg) == 5 and ks(4, 4, 8, 10, cfg) == 5
    assert ks(3, 4, 8, 10, cfg) == 2  # 96 programs: 5 even splits of 2, the ceil rule's own
    assert ks(8, 4, 8, 3, cfg) == 3  # batch 8 over an HCA list (3 blocks): one split, not 2 of 2 padded
    # no divisor of 7 blocks within half of 4 splits: the ceil rule's 4 splits of 2, the last padded
    assert ks(4, 4, 8, 7, cfg) == 2
    assert ks(1, 4, 8, 10, {**cfg, "pv_programs": 256}) == 2 and ks(8, 4, 8, 10, {**cfg, "pv_programs": 256}) == 10
    assert ks(1, 4, 8, 3, cfg) == 1  # a window-sized list
    assert ks(1, 4, 8, 10, {**cfg, "split": 4}) == 4 and ks(1, 4, 8, 3, {**cfg, "split": 4}) == 3
    q, kv, widx, sink, ck, cidx = make_case(0, b=1, s=1, h=16, d=64)
    with pytest.raises(ValueError, match="split=1 over .* staged"):
        pallas_triton_two_pass.sparse_attention(q, kv, widx, sink, scale=0.125, comp_kv=ck, comp_idx=cidx,
                                                config=dict(SMALL, split=1, stage_values=False))
    with pytest.raises(ValueError, match="pv_warps=3"):
        pallas_triton_two_pass.sparse_attention(q, kv, widx, sink, scale=0.125, comp_kv=ck, comp_idx=cidx,
                                                config=dict(pv_warps=3))


def test_two_pass_default_tiles_window_only_and_padded_heads():
    """The default config (bk1 32, bk2 64; dc 512 and dv 256 cut to D: 128) at D = 128 with 8 heads
    (padded to the 16-row P.V tile) and 6 query rows; a layer without a compressed list (window only)."""
    q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=6, h=8, d=128, nw=70, nc=300, kw=70, kc=130)
    scale = 128 ** -0.5
    check_close(_two_pass(q, kv, widx, sink, ck, cidx, scale, config=None), _ref(q, kv, widx, sink, ck, cidx, scale))
    win_only = jax.jit(lambda *a: reference.sparse_attention(*a, scale=scale))(q, kv, widx, sink)
    got = jax.jit(lambda *a: pallas_triton_two_pass.sparse_attention(*a, scale=scale, interpret=True))(q, kv, widx, sink)
    check_close(got, win_only)


def test_two_pass_rounds_at_the_row_maximum():
    """Row (0, 1)'s last compressed key aligned with its queries, so its logit is the row's maximum
    and lies in the last key block. The reference (default) and the two passes round every weight
    to bf16 relative to it: the outputs agree to one bf16 ulp of each element (fp32 summation
    order). The flash kernel's running maximum rounds the earlier blocks relative to smaller maxima:
    14-205 ulps off on these inputs (session 46), so it would fail this bound."""
    q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=2, h=16, d=64, kw=20, kc=40)
    cidx = cidx.at[0, 1, -1].set(7)
    q = (q.astype(jnp.float32).at[0, 1].add(0.5 * ck.dequantize(jnp.float32)[0, 7])).astype(jnp.bfloat16)
    r = np.asarray(_ref(q, kv, widx, sink, ck, cidx, 0.125), np.float32)

    def ulps(o):
        u = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(r), 2.0 ** -12 * np.abs(r).max()))) - 7)
        return float((np.abs(np.asarray(o, np.float32) - r) / u).max())

    assert ulps(_two_pass(q, kv, widx, sink, ck, cidx, 0.125)) <= 1.0
    assert ulps(_kernel(q, kv, widx, sink, ck, cidx, 0.125, block_k=16, num_splits=1)) > 4.0  # the bound bites


def test_two_pass_dispatch_switch(monkeypatch):
    """DSV41_SPARSE_DECODE=two_pass: 'auto' takes the kernel for every decode row count over V4.1's stores and the
    kernel runs the two passes (two Triton calls named logits / pv); "flash" keeps the reference at
    batch 1 and the flash kernel for a forced 'pallas'; a call with its own tiling keeps the flash
    kernel; bad names are refused."""
    q, kv, widx, sink, ck, cidx = make_case(None, b=1, s=1, h=16, d=64)
    q2 = jnp.concatenate([q, q], axis=1)
    monkeypatch.setattr(pallas_triton, "DECODE_METHOD", "flash")
    assert "batch-1 decode" in pallas_triton.auto_reason(q, kv, ck)
    assert not pallas_triton.takes_two_pass(q, kv, widx, ck, cidx)
    monkeypatch.setattr(pallas_triton, "DECODE_METHOD", "two_pass")
    assert pallas_triton.auto_reason(q, kv, ck) is None and pallas_triton.auto_reason(q2, kv, ck) is None
    rows = jnp.zeros((1, pallas_triton_two_pass.MAX_ROWS + 1, 16, 64), jnp.bfloat16)
    assert pallas_triton.auto_reason(rows, kv, ck) is not None  # above MAX_ROWS: the measured rules

    def names(**kw):
        jx = str(jax.make_jaxpr(lambda *a: pallas_triton.sparse_attention(
            *a[:4], scale=0.125, comp_kv=a[4], comp_idx=a[5], interpret=True, **kw))(q, kv, widx, sink, ck, cidx))
        return [n for n in ("sparse_attention_logits", "sparse_attention_pv", "sparse_attention_sink") if n in jx]

    assert names() == ["sparse_attention_logits", "sparse_attention_pv"]
    assert names(block_k=16) == names(method="flash") == ["sparse_attention_sink"]
    o = jax.jit(lambda *a: api.sparse_attention(*a[:4], scale=0.125, comp_kv=a[4], comp_idx=a[5],
                                                implementation="interpret"))(q, kv, widx, sink, ck, cidx)
    check_close(o, _ref(q, kv, widx, sink, ck, cidx, 0.125))
    with pytest.raises(ValueError, match="method='fast'"):
        pallas_triton.sparse_attention(q, kv, widx, sink, scale=0.125, method="fast")
    with pytest.raises(ValueError, match="takes no flash tiling"):
        pallas_triton.sparse_attention(q, kv, widx, sink, scale=0.125, method="two_pass", block_k=16)
    monkeypatch.setattr(pallas_triton, "DECODE_METHOD", "flash")  # an explicit method needs no switch
    assert names(method="two_pass") == ["sparse_attention_logits", "sparse_attention_pv"]
    with pytest.raises(ValueError, match="two-pass.*16 rows"):
        pallas_triton_two_pass.sparse_attention(q, kv, widx, sink, scale=0.125, config=dict(bh=8))


@pytest.mark.parametrize("cfg,match", [
    (dict(bk1=24), "powers of two"),
    (dict(bk1=64, bk2=32), "multiple of bk1"),
    (dict(dv=16), "dv=16"),
    (dict(bh=8), "16 rows"),
])
def test_two_pass_refused_configs(cfg, match):
    q, kv, widx, sink, ck, cidx = make_case(0, b=1, s=1, h=16, d=64)
    with pytest.raises(ValueError, match=match):
        pallas_triton_two_pass.sparse_attention(q, kv, widx, sink, scale=0.125, comp_kv=ck, comp_idx=cidx, config=cfg)
    assert "power-of-two tile" in pallas_triton_two_pass.two_pass_reason(
        SD((1, 1, 96, 64), jnp.bfloat16), kv, widx, ck, cidx)
    long_list = SD((1, 1, 64 * pallas_triton_two_pass.MAX_BLOCKS), jnp.int32)  # + the compressed list
    assert "unrolled over at most" in pallas_triton_two_pass.two_pass_reason(q, kv, widx, ck, long_list)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("shape", [(1, 1, 128, 5121, 128, 512), (8, 1, 128, 65536, 128, 512),
                                   (1, 6, 133, 262144, 134, 512)], ids=["decode_b1", "decode_b8", "verify_s6"])
def test_two_pass_cross_lowering(target, shape):
    text = lower_for(target, lambda *a: pallas_triton.sparse_attention(
        *a[:4], scale=512 ** -0.5, comp_kv=a[4], comp_idx=a[5], method="two_pass"), *_real_specs(*shape)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    # pass 1 reads the window and compressed lists from their own refs: no concatenated copy (an XLA
    # kernel of 2.5 us at batch 1); the pads only where a list is not a whole number of key blocks
    assert "concatenate" not in text and ("stablehlo.pad" in text) == (shape[4] % 64 != 0)
    if shape[0] == 1 and shape[1] == 1:  # pass 2 gathering its own values lowers too
        text = lower_for(target, lambda *a: pallas_triton_two_pass.sparse_attention(
            *a[:4], scale=512 ** -0.5, comp_kv=a[4], comp_idx=a[5], config=dict(stage_values=False)),
            *_real_specs(*shape)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2
    if shape[0] == 8:  # pass 1 walking 4 blocks a program (window 4 blocks of 32, compressed 16); empty blocks skipped
        for cfg in (dict(p1_loop=4), dict(skip_empty=True), dict(skip_empty=True, stage_values=False)):
            text = lower_for(target, lambda *a: pallas_triton_two_pass.sparse_attention(
                *a[:4], scale=512 ** -0.5, comp_kv=a[4], comp_idx=a[5], config=cfg), *_real_specs(*shape)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 2, cfg


def test_tiles_variants_flag_filters_by_name(monkeypatch, tmp_path):
    """``--tiles --variants "=two-pass;loops"``: XLA's reference first, then the variants whose names
    contain a word (``=``: equal it; semicolons between words, as names hold commas), in
    TILE_VARIANTS' order; a word no name contains exits naming the variants."""
    from pallas_kernels.sparse_attention import benchmark

    picked = benchmark.tile_variants("=two-pass, pass 1 loops 2 blocks; =two-pass unstaged;column block, 8")
    assert [n for n, _ in picked] == ["xla", "two-pass unstaged", "two-pass, pass 1 loops 2 blocks",
                                      "flash, 1 column block, 8 warps"]
    assert benchmark.tile_variants(None) == benchmark.TILE_VARIANTS
    seen = []
    monkeypatch.setattr(benchmark, "op_table", lambda log, cases, variants, reps: seen.append(variants) or [])
    benchmark.main(["--tiles", "--variants", "=two-pass unstaged;=two-pass", "--out", str(tmp_path)])
    assert [n for n, _ in seen[0]] == ["xla", "two-pass", "two-pass unstaged"]
    with pytest.raises(SystemExit, match="--variants nope: no --tiles variant"):
        benchmark.main(["--tiles", "--variants", "loops;nope", "--out", str(tmp_path)])


def test_tiles_contexts_flag_and_short_context_lists(monkeypatch, tmp_path):
    """``--tiles --contexts 96,65536``: every decode size at each context, in that order; a context
    below the 512 picks (the model's short prompts) lists all its entries ascending, then -1 padding;
    a size that is not a positive integer is an argparse error naming it."""
    from pallas_kernels.sparse_attention import benchmark

    seen, op_table = [], benchmark.op_table
    monkeypatch.setattr(benchmark, "op_table", lambda log, cases, variants, reps: seen.append(cases) or [])
    benchmark.main(["--tiles", "--contexts", "96,65536", "--variants", "=two-pass", "--out", str(tmp_path)])
    sizes = [(b, s) for _, b, s in benchmark.TILE_CASES]
    assert list(seen[0]) == [(96, b, s) for b, s in sizes] + [(65536, b, s) for b, s in sizes]
    for bad in ("0", "96,x", ""):
        with pytest.raises(SystemExit):
            benchmark.main(["--tiles", "--contexts", bad, "--out", str(tmp_path)])
    b, s, nc, kc = 2, 3, 96, 512
    cidx = np.asarray(benchmark._table_rep_jit()(jax.random.PRNGKey(5), b, s, nc, 128, kc, 4, 64)[4])
    assert cidx.shape == (b, s, kc)
    assert (cidx[..., :nc] == np.arange(nc)).all() and (cidx[..., nc:] == -1).all()
    full = np.asarray(benchmark._table_rep_jit()(jax.random.PRNGKey(5), b, s, 8192, 128, kc, 4, 64)[4])
    assert (np.diff(full, axis=-1) > 0).all() and full.min() >= 0 and full.max() < 8192
    # the table builds a short context's inputs and floors (the listed entries only) and runs XLA's
    # reference on them (tiny shapes; the device timings themselves stubbed: profiling is slow on a CPU)
    from pallas_kernels import benchmarking
    monkeypatch.setattr(benchmarking, "device_time_op", lambda *a, **k: 1e-6)
    monkeypatch.setattr(benchmark, "checked_device_time", lambda fn, args, shared, y0, reps: (
        2e-6, [], float(np.linalg.norm(np.asarray(jax.jit(fn)(*args[0], *shared), np.float32) - y0)
                        / np.linalg.norm(y0))))
    rows = op_table(lambda m: None, ((24, 2, 1),), variants=(("xla", None),), reps=1, kw=16, kc=32, h=4, d=64)
    assert rows[0]["variants"]["xla"] == dict(us=2.0, kernels=0, rel_err=0.0, ok=True)
    assert rows[0]["bytes"] == benchmark.floor_bytes(2, 1, h=4, d=64, kw=16, kc=24) < benchmark.floor_bytes(
        2, 1, h=4, d=64, kw=16, kc=32)


def test_tile_variants_take_every_decode_case():
    """``--tiles`` (session 55's sweep): every variant accepts every case at V4.1's real shapes (64
    heads x 512, 128 window + 512 compressed picks; traced abstractly, nothing runs), and the
    "session 54 tiles" variant names the three tiles the defaults changed."""
    from pallas_kernels.sparse_attention import benchmark
    from pallas_kernels.sparse_attention import pallas_triton_two_pass as tp

    names = [n for n, _ in benchmark.TILE_VARIANTS]
    assert names[:3] == [n for n, _ in benchmark.TABLE_VARIANTS] and len(set(names)) == len(names)
    assert {b * s for _, b, s in benchmark.TILE_CASES} == {1, 6, 8, 32, 64}
    old = dict(benchmark.TILE_VARIANTS)["two-pass, session 54 tiles"]["two_pass"]
    assert {k: tp.DEFAULTS[k] for k in old} == dict(dv=256, group=1, pv_programs=256)
    for nc, b, s in benchmark.TILE_CASES:
        specs = _real_specs(b, s, 128, nc, 128, 512)
        q, win, widx, sink, ck, cidx = specs
        for name, cfg in benchmark.TILE_VARIANTS[1:]:
            out = jax.eval_shape(benchmark.table_op(cfg, 512 ** -0.5), q, win, widx, sink, cidx, ck)
            assert (out.shape, out.dtype) == ((b, s, 64, 512), jnp.bfloat16), (name, b, s)


def test_op_table_runs_and_checks_each_variant(monkeypatch):
    """benchmark.op_table (``--table``: the op alone by device time, the issue-5 table) on the CPU:
    the kernels in interpret mode, the profiler timing stubbed; each variant is checked against the
    XLA output (the flash and two-pass kernels within the bf16 tolerance, the reference exactly), and
    the table's floors are the op's bytes at 4.8 TB/s and its dot FLOPs at 989 TFLOP/s."""
    import functools

    import pallas_kernels.benchmarking as bm
    from pallas_kernels.sparse_attention import benchmark
    from pallas_kernels.sparse_attention import pallas_triton_two_pass as tp

    monkeypatch.setattr(bm, "device_time_op", lambda fn, args, shared=(), reps=5, kernels=None: 1e-5)
    monkeypatch.setattr(pallas_triton, "sparse_attention", functools.partial(pallas_triton.sparse_attention, interpret=True))
    monkeypatch.setattr(tp, "sparse_attention", functools.partial(tp.sparse_attention, interpret=True))
    lines = []
    rows = benchmark.op_table(lines.append, cases=((1100, 2, 1), (600, 1, 6)), reps=2)
    assert [(r["context"], r["batch"], r["seq"]) for r in rows] == [(1100, 2, 1), (600, 1, 6)]
    for r in rows:
        v = r["variants"]
        assert list(v) == ["xla", "pallas flash", "two-pass"], lines
        assert v["xla"]["rel_err"] == 0.0 and all(0.0 < v[n]["rel_err"] < 2e-2 for n in ("pallas flash", "two-pass")), lines
        assert all(x["ok"] for x in v.values()) and r["floor_us"] == benchmark.floor_bytes(r["batch"], r["seq"]) / 4.8e6
        assert r["flop_floor_us"] == 4 * r["batch"] * r["seq"] * 64 * 640 * 512 / 989e6
    assert lines[-1].startswith("| 600 | 1 × 6 |"), lines[-3:]
    # a context under the 512 picks (once refused) is listed whole with -1 padding since session 58:
    # test_tiles_contexts_flag_and_short_context_lists
