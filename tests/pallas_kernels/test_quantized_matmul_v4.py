"""quantized_matmul with V4's FP8 layout (e4m3 weights with 128x128 e8m0 block scales, activation
fake-quant per 128): interpret-mode parity with the reference on fresh random inputs (every element,
GEMV and tiled configurations, V4-like shapes scaled down), shape-support reasons, the 'auto' gate,
cross-lowering for cuda (H200) and rocm (gfx950) at the real V4-Flash / V4-Pro projection shapes,
and a smoke run of the benchmark's ``--check`` list in interpret mode.

The 32x32 (V4.1) path is covered by test_quantized_matmul.py and is unchanged."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp8Tensor, quantize_fp8, quantize_mxfp4
from pallas_kernels import dispatch
from pallas_kernels.quantized_matmul import api, pallas_triton, reference
from pallas_kernels.testing import assert_close as check_close, lower_for



B = 128  # V4's FP8 weight block and activation block

# Tolerances (as test_quantized_matmul.py): the kernel forms exactly the reference's products
# (fake-quantized x and decoded W are exact in bf16, bf16 x bf16 products exact in fp32) and differs
# only in the fp32 summation order, i.e. at most about one ulp of the output after rounding:
# bf16 rtol 2^-7, f32 rtol 1e-5, plus an absolute term relative to max|y| for elements near zero.


# Inputs come from numpy (fresh every run) and the weights are quantized by one jitted program per
# shape; kernel and reference calls run as one jitted program each (eager, every small jnp op of the
# builders, the kernels' glue and the reference compiled on its own). Kernel calls get a fresh jax.jit
# each (``run``): SCALE_MODE (monkeypatched) and the dispatch context are read at trace time.
_q8 = jax.jit(quantize_fp8, static_argnames="block")
_q4 = jax.jit(quantize_mxfp4, static_argnames="block")
_reference = jax.jit(reference.quantized_matmul, static_argnames=("act_block", "out_dtype"))


def run(fn, *args, **kw):
    """``fn(*args, **kw)`` as one freshly traced jitted program (``kw``: static arguments)."""
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def make_weight(seed, n, k, block=B):
    """Random weight whose 128x128 blocks span many binades (a per-block factor 2^-6..2^6), so a scale
    read from the wrong block row or column changes the result by a power of two. ``seed`` None: fresh."""
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((n, k), np.float32) * np.float32(0.05)
    e = rng.integers(-6, 7, (-(-n // block), -(-k // block)))
    f = np.exp2(np.repeat(np.repeat(e, block, 0), block, 1)[:n, :k].astype(np.float32))
    return _q8(jnp.asarray(wf * f), block=(block, block))


# V4-Flash projections scaled down by 8-32 (K and N multiples of 128): wq_a [1024, 4096] -> [256, 512],
# wq_b [32768, 1024] -> [1024, 256], wo_b [4096, 8192] -> [256, 1024], wkv [512, 4096] -> [128, 512];
# N = 160 / 224 are not multiples of the 64-row GEMV tile (nor of 128: the last weight block is
# partial, scale rows = ceil(N / 128)): the config picks 32-row tiles, each inside one block row.
CASES = [(1, 256, 512), (1, 1024, 256), (1, 160, 256), (8, 256, 1024), (8, 224, 384), (64, 128, 512),
         (64, 1024, 256), (64, 160, 256), (256, 256, 512), (256, 160, 256), (256, 224, 384)]  # (M, N, K)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,n,k", CASES)
def test_parity_interpret_fp8_128(m, n, k, dtype):
    """GEMV (M = 1, 8, 64: 16/16/64-row tiles, 64-row weight tiles inside one 128-row block, K tiles
    of 128-256 = 1-2 block columns, split-K) and tiled (M = 256: 128x128 output tiles, K stepped 64,
    i.e. half a block column per step). The f32 cases spread x over many binades too."""
    rng = np.random.default_rng()  # fresh inputs every run
    x = rng.standard_normal((m, k), np.float32) * np.float32(3)
    if dtype == jnp.float32:
        x = x * np.exp2(rng.integers(-20, 20, (m, k))).astype(np.float32)
    x = jnp.asarray(x.astype(np.dtype(dtype)))
    w = make_weight(None, n, k)
    assert pallas_triton.unsupported_reason(x, w, act_block=B) is None
    y = run(api.quantized_matmul, x, w, act_block=B, implementation="interpret")
    check_close(y, _reference(x, w, act_block=B))


def test_configs_cover_both_scale_tilings():
    """The parity cases above hit every scale-tile layout: tile rows < block (one scale row) and
    >= block, tile K < block (one scale column) and >= block."""
    seen = set()
    for m, n, k in CASES:
        bm, bn, bk, splits, _, _ = pallas_triton._config(m, n, k, "fp8")
        assert n % bn == 0 and k % (bk * splits) == 0
        # every scale load in bounds: the last tile's scale rows / columns end inside the scale array
        assert (n - bn) // B + max(bn // B, 1) <= -(-n // B) and (k - bk) // B + max(bk // B, 1) <= -(-k // B)
        seen.add((bn >= B, bk >= B, splits > 1))
    # (tile rows >= block, tile K >= block, split-K)
    assert {(False, True, False), (False, True, True), (True, False, False), (False, False, False)} <= seen, seen


@pytest.mark.parametrize("mode", ["gather", "expand", "mx"])
def test_scale_modes_split_k_leading_dims(mode, monkeypatch):
    """Explicit configs: 32-row tiles with 2 K splits of 2 steps of 64 (both K tiles inside one block
    column), and 256-row tiles with K tiles of 256 (two block columns); leading dims, f32 output.
    "mx": the 128-wide scales widened to MX's 32 (activation and weight alike)."""
    monkeypatch.setitem(pallas_triton.SCALE_MODE, "fp8", mode)
    x = jnp.asarray(np.random.default_rng().standard_normal((2, 3, 512), np.float32).astype(jnp.bfloat16))
    w = make_weight(None, 384, 512)
    yr = _reference(x, w, act_block=B, out_dtype=jnp.float32)
    for cfg in [(16, 32, 64, 2, 4, 3), (16, 128, 256, 1, 4, 3), (16, 256, 128, 2, 4, 3)]:
        if 384 % cfg[1]:
            continue
        y = run(pallas_triton.quantized_matmul, x, w, act_block=B, out_dtype=jnp.float32, interpret=True, config=cfg)
        check_close(y, yr)


def test_unsupported_reasons_and_dispatch():
    x = jnp.ones((2, 256), jnp.bfloat16)
    w = make_weight(0, 128, 256)
    assert pallas_triton.unsupported_reason(x, w, act_block=B) is None
    # act_block must equal the weight block (the only pairings in the checkpoints)
    r = pallas_triton.unsupported_reason(x, w, act_block=32)
    assert "act_block must equal the FP8 weight block (128" in r
    assert "act_block must equal the FP8 weight block (32" in pallas_triton.unsupported_reason(
        x, _q8(jnp.ones((128, 256))), act_block=B)
    # K not a multiple of the 128 activation block
    w_k = _q8(jnp.ones((128, 192)), block=(B, B))
    assert "multiple of the activation block 128" in pallas_triton.unsupported_reason(jnp.ones((1, 192)), w_k, act_block=B)
    # N not a multiple of 32 (the smallest row tile)
    w_n = _q8(jnp.ones((48, 256)), block=(B, B))
    assert "multiple of 32" in pallas_triton.unsupported_reason(x, w_n, act_block=B)
    # other block shapes
    assert "(32, 32) (V4.1) or (128, 128) (V4)" in pallas_triton.unsupported_reason(
        x, _q8(jnp.ones((128, 256)), block=(64, 64)), act_block=64)
    assert "(32, 32) (V4.1) or (128, 128) (V4)" in pallas_triton.unsupported_reason(
        x, _q8(jnp.ones((128, 256)), block=(1, 128)), act_block=B)
    # scale array inconsistent with the block
    bad = Fp8Tensor(w.data, w.scale[:, :1], (B, B))
    assert "does not match 128x128 blocks" in pallas_triton.unsupported_reason(x, bad, act_block=B)
    # MXFP4 takes V4's act_block 128 too (the act-quant is an XLA op before the kernel)
    w4 = _q4(jnp.ones((64, 256)))
    assert pallas_triton.unsupported_reason(x, w4, act_block=B) is None
    assert "act_block must be 32 (V4.1) or 128 (V4)" in pallas_triton.unsupported_reason(x, w4, act_block=64)
    # explicit implementation raises the reason; context / env fall back to the reference
    with pytest.raises(ValueError, match="cannot run this shape.*multiple of 32"):
        api.quantized_matmul(x, w_n, act_block=B, implementation="interpret")
    with dispatch.use_implementation("interpret"):
        y = run(api.quantized_matmul, x, w_n, act_block=B)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(_reference(x, w_n, act_block=B), np.float32))


def test_mma8_rejects_128_blocks(monkeypatch):
    monkeypatch.setitem(pallas_triton.SCALE_MODE, "fp8", "mma8")
    x = jnp.ones((2, 256), jnp.bfloat16)
    w = make_weight(0, 128, 256)
    r = pallas_triton.unsupported_reason(x, w, act_block=B)
    assert "'mma8'" in r and "only 32x32" in r
    with pytest.raises(ValueError, match="mma8"):
        pallas_triton.quantized_matmul(x, w, act_block=B, interpret=True)
    assert pallas_triton.unsupported_reason(x, _q8(jnp.ones((128, 256)))) is None  # 32x32 still allowed


def test_auto_gate_on_gpu_takes_the_gemv_for_128(monkeypatch):
    """V4's 128x128 GEMV passed --check on an H200 (session 3): plain 'auto' on a GPU takes it at
    decode sizes and keeps the reference for the (untimed) tiled prefill configuration."""
    x = jnp.ones((2, 256), jnp.bfloat16)
    w = make_weight(1, 128, 256)
    yr = _reference(jnp.ones((65, 256), jnp.bfloat16), w, act_block=B)
    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve(None) == "pallas"
    assert pallas_triton.auto_reason(x, w) is None
    assert "tiled" in pallas_triton.auto_reason(jnp.ones((65, 256), jnp.bfloat16), w)
    seen = []
    monkeypatch.setattr(pallas_triton, "quantized_matmul", lambda x, w, **k: seen.append(k.get("act_block")) or "kernel")
    assert api.quantized_matmul(x, w, act_block=B) == "kernel"
    assert seen == [B]
    y = run(api.quantized_matmul, jnp.ones((65, 256), jnp.bfloat16), w, act_block=B)  # prefill size: the reference
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(yr, np.float32))


S = jax.ShapeDtypeStruct
# (name, N, K): V4-Flash (D 4096, q_lora 1024, 64 heads x 512, o 8 x 1024, index 64 x 128, shared
# expert 2048) and V4-Pro (D 7168, q_lora 1536, 128 heads, o 16 x 1024, shared expert 3072)
V4_PROJECTIONS = [("flash wq_a", 1024, 4096), ("flash wq_b", 32768, 1024), ("flash wkv", 512, 4096),
                  ("flash wo_b", 4096, 8192), ("flash idx_wq_b", 8192, 1024), ("flash shared_w13", 2048, 4096),
                  ("flash shared_w2", 4096, 2048), ("pro wq_a", 1536, 7168), ("pro wq_b", 65536, 1536),
                  ("pro wo_b", 7168, 16384), ("pro shared_w13", 3072, 7168), ("pro shared_w2", 7168, 3072)]


def fp8_128_spec(n, k):
    return Fp8Tensor(S((n, k), jnp.float8_e4m3fn), S((-(-n // B), -(-k // B)), jnp.float8_e8m0fnu), (B, B))


def _lower(target, m, w):
    from jax.experimental.pallas import triton as pltriton

    k = w.shape[-1]
    txt = lower_for(target, lambda x, w: pallas_triton.quantized_matmul(x, w, act_block=B),
                    S((m, k), jnp.bfloat16), w).as_text()
    assert txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) >= 1


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("name,n,k", V4_PROJECTIONS)
def test_cross_lowering_fp8_128_real_shapes(target, name, n, k):
    for m in (1, 8, 64, 4096):
        _lower(target, m, fp8_128_spec(n, k))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_cross_lowering_fp8_128_gather_and_partial_block(target, monkeypatch):
    _lower(target, 1, fp8_128_spec(160, 512))  # partial last block row, 32-row tiles
    _lower(target, 4096, fp8_128_spec(160, 512))
    monkeypatch.setitem(pallas_triton.SCALE_MODE, "fp8", "gather")
    for m in (1, 64, 4096):
        _lower(target, m, fp8_128_spec(4096, 8192))


def test_benchmark_check_list_runs_in_interpret_mode(monkeypatch):
    """The GPU ``--check`` includes the V4 128x128 cases (expand, gather and mx; mma8 reported as SKIP
    with its reason). Run that code path here on a tiny shape in interpret mode."""
    import pallas_kernels.quantized_matmul.benchmark as bm

    assert bm.CHECK_FP8_V4 and all(n % B == 0 and k % B == 0 for _, n, k in bm.CHECK_FP8_V4)
    monkeypatch.setattr(bm, "CHECK_FP8", [])
    monkeypatch.setattr(bm, "CHECK_FP4", [])
    monkeypatch.setattr(bm, "CHECK_PLAIN", (64, 128))
    monkeypatch.setattr(bm, "CHECK_FP8_V4", [("tiny", 160, 256)])
    monkeypatch.setattr(bm.pallas_triton, "quantized_matmul",
                        functools.partial(pallas_triton.quantized_matmul, interpret=True))
    lines = []
    monkeypatch.setattr(bm, "log", lambda *a: lines.append(" ".join(map(str, a))))
    assert bm.check(with_mma8=True)
    v4 = [s for s in lines if "fp8-128" in s]
    assert sum(s.startswith("PASS") for s in v4) == 12  # 4 row counts x expand/gather/mx
    assert sum(s.startswith("PASS") and "mode=mx" in s for s in v4) == 4
    assert sum(s.startswith("SKIP") and "mma8" in s for s in v4) == 4
    lines.clear()  # --only picks cases by label; mma8 runs only when asked for
    assert bm.check(only="fp8-128")
    assert len(lines) == 13 and all("fp8-128" in s for s in lines[:-1]) and not any("mma8" in s for s in lines)
    lines.clear()  # comma-separated label parts: either
    assert bm.check(only="fp8-128,plain")
    assert len(lines) == 15 and sum("plain" in s for s in lines) == 2
