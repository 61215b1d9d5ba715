"""mHC Pallas-Triton kernels: interpret-mode parity with the reference on fresh random inputs (every
element), shape-support reasons, and cross-lowering for cuda (H200) and rocm (gfx950) at the real
V4.1 shapes (hc = 4, D = 5120)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mhc import api, pallas_triton, reference
from pallas_kernels.testing import lower_for

HC = 4
KW = dict(norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)


def inputs(seed, t, d, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (t, HC, d), dtype) * 2
    fn = jax.random.normal(ks[1], ((2 + HC) * HC, HC * d), jnp.float32) * 0.05
    scale = jax.random.uniform(ks[2], (3,), jnp.float32, 0.5, 2.0)
    base = jax.random.normal(ks[3], ((2 + HC) * HC,), jnp.float32)
    f = jax.random.normal(ks[4], (t, d), dtype)
    return x, fn, scale, base, f


# hc_mixes: all fp32 in both; the projection's products are exact in the kernel (fp32 FMAs, or
# three bf16 pieces of fn against bf16 x), only the summation order differs: atol 2e-6 on values
# in [0, 2]. (config: (rows per program, K block, K splits[, split-kernel warps]); None = the default
# for that T.)
@pytest.mark.parametrize("t,dtype,config,d", [
    (1, jnp.bfloat16, None, 256),          # decode: one row per program, split K, two kernels
    (3, jnp.float32, (1, 128, 4), 256),
    (5, jnp.bfloat16, (16, 128, 1), 256),  # dot path, rows padded to 16, one fused kernel
    (20, jnp.float32, (16, 128, 2), 256),  # dot path, two row tiles, split K
    # splits that are not a power of two (the split kernel sums them in power-of-two groups: 4 x 5,
    # 2 x 5) and a 1-warp split kernel (the config's 4th entry)
    (1, jnp.bfloat16, (1, 64, 20, 1), 320),
    (2, jnp.float32, (1, 64, 10, 2), 320),
])
def test_mixes_parity_interpret(t, dtype, config, d):
    x, fn, scale, base, _ = inputs(np.random.randint(1 << 30), t, d, dtype)
    out = pallas_triton.hc_mixes(x, fn, scale, base, interpret=True, config=config, **KW)
    ref = reference.hc_mixes(x, fn, scale, base, **KW)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


# collapse / expand: fp32 multiply-add of the same terms, another order, then rounding to the
# output dtype: one ulp of the output (bf16: up to 2^-7 relative, 7 stored mantissa bits; f32 ~1e-6).
# (2^-8 flaked: 2.5 vs 2.484375, one bf16 ulp at 2.48, is 0.63 % apart.)
@pytest.mark.parametrize("t,dtype", [(1, jnp.bfloat16), (6, jnp.float32), (16, jnp.bfloat16)])
def test_collapse_expand_parity_interpret(t, dtype):
    x, fn, scale, base, f = inputs(np.random.randint(1 << 30), t, 256, dtype)
    pre, post, comb = reference.hc_mixes(x, fn, scale, base, **KW)
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 2e-6
    yc = api.hc_collapse(x, pre, implementation="interpret")
    rc = reference.hc_collapse(x, pre)
    assert yc.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(yc, np.float32), np.asarray(rc, np.float32), rtol=tol, atol=tol)
    ye = api.hc_expand(f, x, post, comb, implementation="interpret")
    re_ = reference.hc_expand(f, x, post, comb)
    assert ye.dtype == f.dtype and ye.shape == x.shape
    np.testing.assert_allclose(np.asarray(ye, np.float32), np.asarray(re_, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("t,dtype", [(1, jnp.bfloat16), (6, jnp.float32), (16, jnp.bfloat16)])
def test_expand_collapse_parity_interpret(t, dtype):
    """The fused expansion + next collapse equals hc_expand then hc_collapse of its (rounded) output;
    the streams within one output ulp of the reference (as hc_expand), the collapse within one ulp
    of the reference collapse of the kernel's own streams."""
    x, fn, scale, base, f = inputs(np.random.randint(1 << 30), t, 256, dtype)
    pre, post, comb = reference.hc_mixes(x, fn, scale, base, **KW)
    pre_next = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(np.random.randint(1 << 30)), pre.shape)) + 0.1
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 2e-6
    h, y = api.hc_expand_collapse(f, x, post, comb, pre_next, implementation="interpret")
    hr, yr = reference.hc_expand_collapse(f, x, post, comb, pre_next)
    assert h.dtype == y.dtype == f.dtype and h.shape == x.shape and y.shape == f.shape
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(hr, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(reference.hc_collapse(h, pre_next), np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(yr, np.float32), rtol=2 * tol, atol=2 * tol)
    assert "pre" in pallas_triton.expand_collapse_reason(f, x, post, comb, pre_next[:, :2])


@pytest.mark.parametrize("t,dtype,d", [(1, jnp.bfloat16, 256), (3, jnp.float32, 192), (8, jnp.bfloat16, 128)])
def test_expand_collapse_mixes_parity_interpret(t, dtype, d):
    """Expansion + next collapse + the next site's mixes in two kernels: the streams equal
    hc_expand_collapse's bit for bit (the same operations); the collapse too, up to isolated one-step
    flips of its final rounding: the two kernels are separate programs, and XLA:CPU (interpret mode)
    may contract the collapse's multiply-adds into FMAs in one and not in the other, which moves an
    fp32 sum that lies at a rounding boundary (session 31: 2 of 40 draws at 8 rows, bf16, one element
    of 1,024 each, the same at the commit before that session's changes); the mixes those of hc_mixes
    on the kernel's own streams within the mixes tolerance (fp32 products, another summation order;
    D = 192: 3 K splits, summed by the split kernel in power-of-two groups)."""
    x, fn, scale, base, f = inputs(np.random.randint(1 << 30), t, d, dtype)
    _, post, comb = reference.hc_mixes(x, fn, scale, base, **KW)
    key = jax.random.PRNGKey(np.random.randint(1 << 30))
    pre_next = jax.nn.sigmoid(jax.random.normal(key, (t, HC))) + 0.1
    fn_next = jax.random.normal(jax.random.fold_in(key, 1), fn.shape, jnp.float32) * 0.05
    h, y, mixes = api.hc_expand_collapse_mixes(f, x, post, comb, pre_next, fn_next, scale, base,
                                               implementation="interpret", **KW)
    h2, y2 = pallas_triton.hc_expand_collapse(f, x, post, comb, pre_next, interpret=True)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h2, np.float32))
    got, want = np.asarray(y, np.float32), np.asarray(y2, np.float32)
    step = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-23  # one step of the output's rounding, relative
    assert y.dtype == y2.dtype and np.mean(got != want) <= 0.01, np.mean(got != want)
    np.testing.assert_allclose(got, want, rtol=step, atol=0)
    for a, b in zip(mixes, reference.hc_mixes(h, fn_next, scale, base, **KW)):
        assert a.shape == b.shape and a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)
    # prefill sizes are refused with the reason; the api then composes the two dispatched ops
    xl, _, _, _, fl = inputs(1, 9, 128, dtype)
    pl_ = jnp.full((9, HC), 0.5)
    cl = jnp.full((9, HC, HC), 0.25)
    assert "decode sizes" in pallas_triton.expand_mix_reason(fl, xl, pl_, cl, pl_, fn_next[:, : HC * 128])
    out = api.hc_expand_collapse_mixes(fl, xl, pl_, cl, pl_, fn_next[:, : HC * 128], scale, base, **KW)
    ref = reference.hc_expand_collapse_mixes(fl, xl, pl_, cl, pl_, fn_next[:, : HC * 128], scale, base, **KW)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("t,d", [(1, 640), (3, 192), (8, 128)])
def test_expand_collapse_mixes_with_the_next_norm_interpret(t, d):
    """``y_norm=(weight, eps)``: the collapse comes back RMS-normalized (the expansion kernel's
    per-column-block sums of squares, the split kernel's extra programs), within one bf16 ulp of
    rms_norm(hc_expand_collapse's collapse) with random weights; streams and mixes as without it
    (bit for bit). D = 640: 10 sum-of-squares splits, 5 norm programs of 128 columns per row."""
    x, fn, scale, base, f = inputs(np.random.randint(1 << 30), t, d, jnp.bfloat16)
    _, post, comb = reference.hc_mixes(x, fn, scale, base, **KW)
    key = jax.random.PRNGKey(np.random.randint(1 << 30))
    pre_next = jax.nn.sigmoid(jax.random.normal(key, (t, HC))) + 0.1
    fn_next = jax.random.normal(jax.random.fold_in(key, 1), fn.shape, jnp.float32) * 0.05
    w = jax.random.uniform(jax.random.fold_in(key, 2), (d,), jnp.float32, 0.2, 3.0).astype(jnp.bfloat16)
    args = (f, x, post, comb, pre_next, fn_next, scale, base)
    h, y, mixes = api.hc_expand_collapse_mixes(*args, y_norm=(w, 1e-6), implementation="interpret", **KW)
    h0, y0, mixes0 = api.hc_expand_collapse_mixes(*args, implementation="interpret", **KW)
    want = np.asarray(reference.rms_norm(y0, w, 1e-6), np.float32)
    got = np.asarray(y, np.float32)
    assert y.dtype == y0.dtype and y.shape == y0.shape
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-6)) <= 2.0**-7  # one bf16 ulp
    assert np.mean(got == want) > 0.9 and np.max(np.abs(got - np.asarray(y0, np.float32))) > 0.1  # normalized
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h0, np.float32))
    for a, b in zip(mixes, mixes0):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "norm weight" in pallas_triton.expand_mix_reason(*args[:6], (w[:-64], 1e-6))
    # the composition (prefill sizes, or the reference) applies the model's rms_norm to the collapse
    ref = reference.hc_expand_collapse_mixes(*args, y_norm=(w, 1e-6), **KW)
    np.testing.assert_array_equal(np.asarray(ref[1], np.float32),
                                  np.asarray(reference.rms_norm(reference.hc_expand_collapse(*args[:5])[1], w, 1e-6),
                                             np.float32))


def test_api_routes_and_reasons():
    x, fn, scale, base, _ = inputs(0, 2, 256, jnp.bfloat16)
    assert pallas_triton.unsupported_reason(x, fn) is None
    assert "hc = 4" in pallas_triton.unsupported_reason(jnp.ones((2, 2, 256)), jnp.ones((8, 512)))
    assert "fn must be" in pallas_triton.unsupported_reason(x, fn[:, :512])
    assert "multiple of 64" in pallas_triton.collapse_reason(jnp.ones((2, 4, 96)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="cannot run this shape"):
        api.hc_mixes(x, fn[:, :512], scale, base, implementation="interpret", **KW)
    pre, post, comb = api.hc_mixes(x, fn, scale, base, implementation="interpret", **KW)
    assert pre.shape == (2, HC) and post.shape == (2, HC) and comb.shape == (2, HC, HC)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_cross_lowering_real_shapes(target):
    from jax.experimental.pallas import triton as pltriton

    name = pltriton.CUSTOM_CALL_TARGET_NAME
    for t in (1, 8, 64, 4096):
        mix = lambda x, fn, s, b: pallas_triton.hc_mixes(x, fn, s, b, **KW)
        txt = lower_for(target, mix, S((t, HC, 5120), jnp.bfloat16), S((24, HC * 5120), jnp.float32),
                        S((3,), jnp.float32), S((24,), jnp.float32)).as_text()
        assert 1 <= txt.count(name) <= 2  # one or two kernels for the mixes
        txt = lower_for(target, pallas_triton.hc_collapse, S((t, HC, 5120), jnp.bfloat16), S((t, HC), jnp.float32)).as_text()
        assert txt.count(name) == 1
        txt = lower_for(target, pallas_triton.hc_expand, S((t, 5120), jnp.bfloat16), S((t, HC, 5120), jnp.bfloat16),
                        S((t, HC), jnp.float32), S((t, HC, HC), jnp.float32)).as_text()
        assert txt.count(name) == 1
        txt = lower_for(target, pallas_triton.hc_expand_collapse, S((t, 5120), jnp.bfloat16),
                        S((t, HC, 5120), jnp.bfloat16), S((t, HC), jnp.float32), S((t, HC, HC), jnp.float32),
                        S((t, HC), jnp.float32)).as_text()
        assert txt.count(name) == 1
        if t <= pallas_triton.MIX_FUSED_MAX_T:
            f = lambda *a: pallas_triton.hc_expand_collapse_mixes(*a, **KW)  # noqa: E731
            txt = lower_for(target, f, S((t, 5120), jnp.bfloat16), S((t, HC, 5120), jnp.bfloat16),
                            S((t, HC), jnp.float32), S((t, HC, HC), jnp.float32), S((t, HC), jnp.float32),
                            S((24, HC * 5120), jnp.float32), S((3,), jnp.float32), S((24,), jnp.float32)).as_text()
            assert txt.count(name) == 2
            fn_norm = lambda *a: pallas_triton.hc_expand_collapse_mixes(*a, y_norm_eps=1e-6, **KW)  # noqa: E731
            txt = lower_for(target, fn_norm, S((t, 5120), jnp.bfloat16), S((t, HC, 5120), jnp.bfloat16),
                            S((t, HC), jnp.float32), S((t, HC, HC), jnp.float32), S((t, HC), jnp.float32),
                            S((24, HC * 5120), jnp.float32), S((3,), jnp.float32), S((24,), jnp.float32),
                            S((5120,), jnp.bfloat16)).as_text()
            assert txt.count(name) == 2
    for cfg in ((1, 128, 160, 1), (1, 128, 80, 2), (1, 256, 40, 1)):  # splits in power-of-two groups
        mix = lambda x, fn, s, b, cfg=cfg: pallas_triton.hc_mixes(x, fn, s, b, config=cfg, **KW)
        txt = lower_for(target, mix, S((1, HC, 5120), jnp.bfloat16), S((24, HC * 5120), jnp.float32),
                        S((3,), jnp.float32), S((24,), jnp.float32)).as_text()
        assert txt.count(name) == 2


def test_benchmark_check_covers_v4_widths_in_interpret_mode(monkeypatch):
    """The GPU ``--check`` runs every model width (V4.1 5120, V4-Flash 4096, V4-Pro 7168); its code
    path here on a small width, kernels in interpret mode."""
    import functools

    import pallas_kernels.mhc.benchmark as bm

    assert set(bm.CHECK_DIMS) == {5120, 4096, 7168}
    for name in ("hc_mixes", "hc_collapse", "hc_expand", "hc_expand_collapse", "hc_expand_collapse_mixes"):
        monkeypatch.setattr(bm.pallas_triton, name, functools.partial(getattr(pallas_triton, name), interpret=True))
    lines = []
    monkeypatch.setattr(bm, "log", lambda *a: lines.append(" ".join(map(str, a))))
    assert bm.check(dims=(256,), tokens=(1, 3))
    # 6 checks at T = 1 and 3 (both decode sizes), among them the fused op with the next site's norm
    assert sum(s.startswith("PASS") and "D=256" in s for s in lines) == 12
    assert sum(s.startswith("PASS hc_expand_collapse_mixes + norm") for s in lines) == 2


def test_reference_sinkhorn_unrolled_on_gpu(monkeypatch):
    """The reference's Sinkhorn rounds are a loop on a CPU (compile time) and unrolled on a GPU (a
    while loop there syncs with the host every iteration); both give the same mixes."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 64), jnp.float32)
    fn = jax.random.normal(jax.random.PRNGKey(1), (24, 256), jnp.float32) * 0.05
    scale, base = jnp.array([1.0, 0.5, 2.0]), jax.random.normal(jax.random.PRNGKey(2), (24,))
    f = lambda *a: reference.hc_mixes(*a, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)  # noqa: E731
    cpu = jax.jit(f).lower(x, fn, scale, base).as_text()
    want = jax.jit(f)(x, fn, scale, base)
    monkeypatch.setattr(reference.jax, "default_backend", lambda: "gpu")
    g = lambda *a: reference.hc_mixes(*a, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)  # noqa: E731
    gpu = jax.jit(g).lower(x, fn, scale, base).as_text()
    assert "stablehlo.while" in cpu and "stablehlo.while" not in gpu
    for a, b in zip(jax.jit(g)(x, fn, scale, base), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_mixes_refuses_a_split_that_leaves_k_blocks_out():
    """A K split that does not divide the width into whole blocks is refused with the reason (it
    silently dropped the last K blocks on the H200: (1, 64, 128) at width 20480, session 8)."""
    x, fn, scale, base, _ = inputs(np.random.randint(1 << 30), 1, 320, jnp.bfloat16)  # width 1280 = 20 x 64
    with pytest.raises(ValueError, match="must split into 8 parts of whole 64-wide K blocks"):
        pallas_triton.hc_mixes(x, fn, scale, base, interpret=True, config=(1, 64, 8), **KW)
    out = pallas_triton.hc_mixes(x, fn, scale, base, interpret=True, config=(1, 64, 4), **KW)
    for a, b in zip(out, reference.hc_mixes(x, fn, scale, base, **KW)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tiles,order", [("stream", "uses"), ("whole", "uses"), ("whole", "loads")])
def test_expansion_kernel_variants_give_the_default_outputs(monkeypatch, tiles, order):
    """The expansion kernel's ways of writing (``EXPAND_MIX``: one load per stream or whole tiles, loads
    beside their uses or all first). With one load per stream the operations are the same in the same
    order: streams, collapse (normalized) and mix partials equal the default's bit for bit. Whole
    tiles pick each stream by a masked sum, which the compiler may contract with the multiply-add
    differently: within one bf16 step of the streams (on the H200 their bits differed too, session
    27; here 1 of 2048 elements in one draw of session 28's CI). (The warp count does not reach
    interpret mode; on the H200 the 2- and 4-warp variants gave the same bits, session 27.)"""
    x, fn, scale, base, f = inputs(np.random.randint(1 << 30), 2, 256, jnp.bfloat16)
    _, post, comb = reference.hc_mixes(x, fn, scale, base, **KW)
    key = jax.random.PRNGKey(np.random.randint(1 << 30))
    pre_next = jax.nn.sigmoid(jax.random.normal(key, (2, HC))) + 0.1
    w = jax.random.uniform(jax.random.fold_in(key, 2), (256,), jnp.float32, 0.2, 3.0).astype(jnp.bfloat16)
    args = (f, x, post, comb, pre_next, fn, scale, base)
    want = api.hc_expand_collapse_mixes(*args, y_norm=(w, 1e-6), implementation="interpret", **KW)
    monkeypatch.setitem(pallas_triton.EXPAND_MIX, "tiles", tiles)
    monkeypatch.setitem(pallas_triton.EXPAND_MIX, "order", order)
    got = api.hc_expand_collapse_mixes(*args, y_norm=(w, 1e-6), implementation="interpret", **KW)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if tiles == "stream":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-6 * float(np.max(np.abs(b))))
    for target in ("cuda", "rocm"):  # and each lowers for both vendors
        txt = lower_for(target, lambda *a: pallas_triton.hc_expand_collapse_mixes(*a, y_norm_eps=1e-6, **KW),
                        *(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in args + (w,))).as_text()
        assert txt.count("hc_expand_mix") >= 1
