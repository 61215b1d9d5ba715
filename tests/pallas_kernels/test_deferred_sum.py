"""Layer outputs handed on unsummed (``pallas_kernels.deferred_sum``): the producers' deferred results
have the values of their summed ones, the mHC expansion kernel sums them itself to the same streams,
collapse and mixes, and the kernel refuses pieces that do not fit."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import quantize_fp8
from pallas_kernels.deferred_sum import DeferredSum, expert_slots, gemv_parts, materialize, moe_output
from pallas_kernels.mhc import api as mhc_api
from pallas_kernels.mhc import pallas_triton as mhc_kernel
from pallas_kernels.mhc import reference as mhc_reference
from pallas_kernels.moe import api as moe_api
from pallas_kernels.quantized_matmul import api as qmm_api

HC = 4
IMPL = "interpret"  # .gpu scripts set "pallas" to run these checks on a GPU
KW = dict(norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)


def _exact_parts(key, p, t, d):
    """K parts whose sums are exact in float32 in any order (multiples of 2**-12 below 2**11: 23 bits),
    with more bits than bf16 keeps, so the rounding to bf16 is exercised but not the summation order."""
    return jax.random.randint(key, (p, t, d), -(1 << 22), 1 << 22).astype(jnp.float32) * 2.0**-12


def _slots(key, t, k, d, n_missing):
    """Slot rows [t*k + 1, d] bf16 and index [t, k] with ``n_missing`` slots without an expert, whose
    rows (never written by the MoE kernel) hold NaN: they must count as 0."""
    rows = jax.random.normal(key, (t * k + 1, d), jnp.float32).astype(jnp.bfloat16)
    index = np.array(jax.random.randint(jax.random.fold_in(key, 1), (t, k), 0, 8))
    flat = index.reshape(-1)
    flat[np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30))).choice(t * k, n_missing, False)] = -1
    rows = jnp.where(jnp.asarray(flat >= 0)[:, None], rows[: t * k], jnp.nan)
    rows = jnp.concatenate([rows, jnp.full((1, d), jnp.nan, jnp.bfloat16)])
    return rows, jnp.asarray(index, jnp.int32)


def _split_slots(key, t, k, d, n_missing, splits=3):
    """A split-K down kernel's slot rows: fp32 sums [splits, t*k + 1, d] whose float32 sums are exact
    in any order (rounded to bf16 afterwards), NaN in the rows of slots without an expert and in the
    spare row."""
    parts = _exact_parts(key, splits, t * k + 1, d)
    index = np.array(jax.random.randint(jax.random.fold_in(key, 1), (t, k), 0, 8))
    flat = index.reshape(-1)
    flat[np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30))).choice(t * k, n_missing, False)] = -1
    ok = jnp.asarray(np.concatenate([flat >= 0, [False]]))
    return jnp.where(ok[None, :, None], parts, jnp.nan), jnp.asarray(index, jnp.int32)


def _site_inputs(key, t, d):
    ks = jax.random.split(key, 6)
    x = (jax.random.normal(ks[0], (t, HC, d), jnp.float32) * 2).astype(jnp.bfloat16)
    fn = jax.random.normal(ks[1], ((2 + HC) * HC, HC * d), jnp.float32) * 0.05
    scale = jax.random.uniform(ks[2], (3,), jnp.float32, 0.5, 2.0)
    base = jax.random.normal(ks[3], ((2 + HC) * HC,), jnp.float32)
    _, post, comb = mhc_reference.hc_mixes(x, fn, scale, base, **KW)
    pre_next = jax.nn.sigmoid(jax.random.normal(ks[4], (t, HC))) + 0.1
    fn_next = jax.random.normal(ks[5], fn.shape, jnp.float32) * 0.05
    return x, post, comb, pre_next, fn_next, scale, base


@pytest.mark.parametrize("t,d,kind", [(1, 256, "gemv"), (3, 192, "gemv"), (1, 256, "moe"), (2, 128, "moe"),
                                      (1, 128, "experts"), (1, 256, "moe_split"), (2, 128, "moe_split")])
def test_expansion_kernel_sums_the_pieces(t, d, kind):
    """With f as a DeferredSum the expansion kernel gives the streams, collapse (normalized or not)
    and mixes it gives on f's value, bit for bit (inputs whose float32 sums are exact in any order).
    The routed experts alone are a float32 value: there the interpreted kernel's float32 expansion may
    contract another multiply-add (one float32 ulp; bf16 rounding hides it in the other cases)."""
    key = jax.random.PRNGKey(np.random.randint(1 << 30))
    x, post, comb, pre_next, fn_next, scale, base = _site_inputs(key, t, d)
    k = 3
    if kind == "gemv":
        f = gemv_parts(_exact_parts(jax.random.fold_in(key, 7), 4, t, d), jnp.bfloat16, (t, d))
    elif kind == "moe":
        rows, index = _slots(jax.random.fold_in(key, 8), t, k, d, n_missing=1)
        shared = gemv_parts(_exact_parts(jax.random.fold_in(key, 7), 3, t, d), jnp.bfloat16, (t, d))
        f = moe_output(expert_slots(rows, index), shared, jnp.bfloat16, (t, d))
        assert isinstance(f, DeferredSum) and f.parts is not None and f.expert_rows is not None
    elif kind == "moe_split":  # the down kernel's split-K sums, each row summed and rounded first
        rows, index = _split_slots(jax.random.fold_in(key, 8), t, k, d, n_missing=1)
        shared = gemv_parts(_exact_parts(jax.random.fold_in(key, 7), 3, t, d), jnp.bfloat16, (t, d))
        f = moe_output(expert_slots(rows, index, rows_dtype=jnp.bfloat16), shared, jnp.bfloat16, (t, d))
        assert isinstance(f, DeferredSum) and f.row_splits == 3 and f.rows_dtype == jnp.bfloat16
    else:  # the routed experts alone: a float32 value (the slots' sum is not rounded)
        rows, index = _slots(jax.random.fold_in(key, 8), t, k, d, n_missing=2)
        f = expert_slots(rows, index)
        x = x.astype(jnp.float32)
    value = materialize(f)
    assert value.shape == f.shape and value.dtype == f.dtype and bool(jnp.all(jnp.isfinite(value)))
    w = jax.random.uniform(jax.random.fold_in(key, 9), (d,), jnp.float32, 0.2, 3.0).astype(x.dtype)
    for y_norm in (None, (w, 1e-6)):
        got = mhc_api.hc_expand_collapse_mixes(f, x, post, comb, pre_next, fn_next, scale, base, y_norm=y_norm,
                                               implementation=IMPL, **KW)
        want = mhc_api.hc_expand_collapse_mixes(value, x, post, comb, pre_next, fn_next, scale, base, y_norm=y_norm,
                                                implementation=IMPL, **KW)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype
            if kind == "experts":
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)
            else:
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # the reference path (and prefill sizes) materialize f first: the reference's own result
    ref = mhc_api.hc_expand_collapse_mixes(f, x, post, comb, pre_next, fn_next, scale, base,
                                           implementation="reference", **KW)
    want = mhc_reference.hc_expand_collapse_mixes(value, x, post, comb, pre_next, fn_next, scale, base, **KW)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_expansion_kernel_refuses_pieces_that_do_not_fit():
    key = jax.random.PRNGKey(0)
    x, post, comb, pre_next, fn_next, _, _ = _site_inputs(key, 2, 128)
    wrong_parts = gemv_parts(jnp.ones((4, 2, 64), jnp.float32), jnp.bfloat16, (2, 128))
    assert "K parts must be [P, 2, 128]" in mhc_kernel.expand_mix_reason(wrong_parts, x, post, comb, pre_next, fn_next)
    rows, index = _slots(key, 1, 3, 128, 0)  # one token's slots for a two-row site
    wrong_slots = DeferredSum(parts=None, expert_rows=rows, expert_index=index, dtype=jnp.dtype(jnp.float32),
                              shape=(2, 128))
    assert "do not fit" in mhc_kernel.expand_mix_reason(wrong_slots, x, post, comb, pre_next, fn_next)
    with pytest.raises(ValueError, match="K parts must be"):
        mhc_api.hc_expand_collapse_mixes(wrong_parts, x, post, comb, pre_next, fn_next, *_site_inputs(key, 2, 128)[5:],
                                         implementation=IMPL, **KW)
    with pytest.raises(ValueError, match="go together"):
        DeferredSum(parts=None, expert_rows=rows, expert_index=None, dtype=jnp.dtype(jnp.float32), shape=(1, 128))
    split_rows, split_index = _split_slots(key, 1, 3, 128, 0)
    with pytest.raises(ValueError, match="need rows_dtype"):
        DeferredSum(parts=None, expert_rows=split_rows, expert_index=split_index, dtype=jnp.dtype(jnp.float32),
                    shape=(1, 128))
    wrong_split = expert_slots(split_rows, split_index, rows_dtype=jnp.bfloat16)
    assert "do not fit" in mhc_kernel.expand_mix_reason(
        DeferredSum(parts=None, expert_rows=split_rows, expert_index=split_index, dtype=jnp.dtype(jnp.float32),
                    shape=(2, 128), rows_dtype=jnp.dtype(jnp.bfloat16)), x, post, comb, pre_next, fn_next)
    assert wrong_split.row_splits == 3 and expert_slots(rows, index).row_splits == 0


def test_producers_defer_to_the_same_values():
    """The decode GEMV (fma, split K) and the fused MoE (interpret) hand back DeferredSums whose values
    are their summed outputs, bit for bit; paths that cannot defer return the array."""
    from dsv41_jax.quant import quantize_mxfp4

    rng = np.random.default_rng()
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    x = jax.random.normal(key, (1, 1, 2048), jnp.float32).astype(jnp.bfloat16)
    w = quantize_fp8(jax.random.normal(jax.random.fold_in(key, 1), (256, 2048), jnp.float32) * 0.05)
    y = qmm_api.quantized_matmul(x, w, implementation=IMPL)
    d = qmm_api.quantized_matmul(x, w, implementation=IMPL, defer=True)
    assert isinstance(d, DeferredSum) and d.shape == y.shape and d.parts.shape[0] > 1  # the K split
    np.testing.assert_array_equal(np.asarray(materialize(d), np.float32), np.asarray(y, np.float32))
    # the reference path, and more rows than the decode GEMV takes: the array
    assert not isinstance(qmm_api.quantized_matmul(x, w, implementation="reference", defer=True), DeferredSum)
    x9 = jnp.tile(x, (9, 1, 1))
    assert not isinstance(qmm_api.quantized_matmul(x9, w, implementation=IMPL, defer=True), DeferredSum)

    E, D, I, N, k = 4, 128, 64, 2, 3
    ks = jax.random.split(jax.random.fold_in(key, 2), 5)
    w1, w3 = (quantize_mxfp4(jax.random.normal(kk, (E, I, D), jnp.float32) * 0.1) for kk in ks[:2])
    w2 = quantize_mxfp4(jax.random.normal(ks[2], (E, D, I), jnp.float32) * 0.1)
    xm = jax.random.normal(ks[3], (N, D), jnp.float32).astype(jnp.bfloat16)
    idx = jnp.asarray([[0, 2, -1], [3, 1, 2]], jnp.int32)
    wts = jax.random.uniform(ks[4], (N, k), jnp.float32, 0.1, 1.0)
    kw = dict(swiglu_limit=7.0, implementation=IMPL)
    summed = moe_api.moe_experts(xm, wts, idx, w1, w2, w3, **kw)
    slots = moe_api.moe_experts(xm, wts, idx, w1, w2, w3, defer=True, **kw)
    assert isinstance(slots, DeferredSum) and slots.expert_index.shape == (N, k)
    np.testing.assert_array_equal(np.asarray(materialize(slots)), np.asarray(summed))
    assert not isinstance(moe_api.moe_experts(xm, wts, idx, w1, w2, w3, swiglu_limit=7.0, implementation="reference",
                                              defer=True), DeferredSum)
    # I = 192: 3 down K steps, which the default down split (3) divides at these small grids
    w1s, w3s = (quantize_mxfp4(jax.random.normal(kk, (E, 192, D), jnp.float32) * 0.1) for kk in ks[:2])
    w2s = quantize_mxfp4(jax.random.normal(ks[2], (E, D, 192), jnp.float32) * 0.1)
    split_summed = moe_api.moe_experts(xm, wts, idx, w1s, w2s, w3s, **kw)
    split_slots = moe_api.moe_experts(xm, wts, idx, w1s, w2s, w3s, defer=True, **kw)
    from pallas_kernels.moe import pallas_triton as moe_kernel

    assert split_slots.row_splits == moe_kernel.DEFAULT_DOWN_SPLITS == 3 and split_slots.rows_dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(materialize(split_slots)), np.asarray(split_summed))
    # the MoE output: deferred only when both pieces are; the same value either way
    shared = gemv_parts(_exact_parts(ks[0], 2, N, D), jnp.bfloat16, (N, D))
    out = moe_output(slots, shared, jnp.bfloat16, (1, N, D))
    assert isinstance(out, DeferredSum) and out.shape == (1, N, D)
    plain = moe_output(summed, materialize(shared), jnp.bfloat16, (1, N, D))
    assert not isinstance(plain, DeferredSum) and plain.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(materialize(out), np.float32), np.asarray(plain, np.float32))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_expansion_kernel_with_deferred_pieces_lowers(target):
    """The real decode shapes (D = 5120; wo_b's 4 parts; the MoE's 6 slot rows, or their 3 split-K
    down sums, + 3 w2 parts) lower for both vendors, one expansion kernel and one split kernel each,
    no XLA sum before them."""
    from jax.experimental.pallas import triton as pltriton

    from pallas_kernels.testing import lower_for

    S = jax.ShapeDtypeStruct
    d, t, k = 5120, 1, 6
    site = (S((t, HC, d), jnp.bfloat16), S((t, HC), jnp.float32), S((t, HC, HC), jnp.float32), S((t, HC), jnp.float32),
            S((24, HC * d), jnp.float32), S((3,), jnp.float32), S((24,), jnp.float32), S((d,), jnp.bfloat16))

    def run(parts, rows, index, *a):
        f = DeferredSum(parts=parts, expert_rows=rows, expert_index=index, dtype=jnp.dtype(jnp.bfloat16), shape=(t, d))
        return mhc_kernel.hc_expand_collapse_mixes(f, *a, y_norm_eps=1e-6, **KW)

    def run_split(parts, rows, index, *a):
        f = DeferredSum(parts=parts, expert_rows=rows, expert_index=index, dtype=jnp.dtype(jnp.bfloat16), shape=(t, d),
                        rows_dtype=jnp.dtype(jnp.bfloat16))
        return mhc_kernel.hc_expand_collapse_mixes(f, *a, y_norm_eps=1e-6, **KW)

    for n_parts, pieces, fn in ((4, (None, None), lambda p, *a: run(p, None, None, *a)),
                                (3, (S((t * k + 1, d), jnp.bfloat16), S((t, k), jnp.int32)), run),
                                (3, (S((3, t * k + 1, d), jnp.float32), S((t, k), jnp.int32)), run_split)):
        args = (S((n_parts, t, d), jnp.float32),) + tuple(a for a in pieces if a is not None) + site
        txt = lower_for(target, fn, *args).as_text()
        assert txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) == 2 and "stablehlo.reduce" not in txt


def test_gemv_parts_value_adds_the_parts_in_order():
    """A split-K GEMV's value is ``dtype(((p0 + p1) + p2) + ...)``, the order the kernels that take the
    parts use (``sum_splits``): parts with wide magnitudes (so that the order matters) give exactly
    the sequential sum's bits, before and after the rounding; and the tensor-core GEMM's split sum is
    the same definition (its K parts added in order)."""
    rng = np.random.default_rng()
    p = (rng.standard_normal((5, 3, 64)) * np.float32(2.0) ** rng.integers(-12, 12, (5, 3, 64))).astype(np.float32)
    seq = p[0].copy()
    for i in range(1, 5):
        seq = (seq + p[i]).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(lambda a: gemv_parts(a, dtype, (3, 64)).value())(jnp.asarray(p))
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(jnp.asarray(seq).astype(dtype).astype(jnp.float32)))
    import inspect

    from pallas_kernels.quantized_matmul import pallas_triton as qmm

    src = inspect.getsource(qmm.quantized_matmul)
    assert "sum_splits(y)" in src and "jnp.sum(y, axis=0)" not in src
