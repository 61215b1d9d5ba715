"""window_kv_write Pallas-Triton kernel (decode: RMSNorm, RoPE, FP8 (1, 32) quantization and the
ring store of one token per row in one launch): interpret-mode equality with the reference on fresh
random inputs (every byte of the ring), idle rows untouched, shape-support reasons, dispatch, the
model's decode on the op, cross-lowering for cuda (H200) and rocm (gfx950), and the benchmark."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp8Tensor, quantize_fp8
from pallas_kernels import dispatch
from pallas_kernels.testing import fake_device_time, lower_for
from pallas_kernels.window_kv import api, pallas_triton, reference

_q8 = jax.jit(lambda x: quantize_fp8(x, (1, 32)))


def _case(rng, b, w=16, d=512, r=64, spread=2.0):
    kv = jnp.asarray(rng.standard_normal((b, d)) * spread, jnp.bfloat16)
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.bfloat16)
    ang = jnp.asarray(rng.uniform(0, 1000, (b, r // 2)), jnp.float32)
    ring = _q8(jnp.asarray(rng.standard_normal((b, w, d)), jnp.float32))
    return kv, nw, ang, ring


def _bytes(t: Fp8Tensor):
    return (np.asarray(jax.lax.bitcast_convert_type(t.data, jnp.uint8)),
            np.asarray(jax.lax.bitcast_convert_type(t.scale, jnp.uint8)))


@pytest.mark.parametrize("b,w,d,r", [(1, 128, 512, 64), (4, 16, 512, 64), (3, 8, 128, 32)])
def test_equals_the_reference_interpret(b, w, d, r):
    """Every ring byte equal to the reference's (on the CPU both round the same way); the written
    slot changed, every other slot and idle rows (slot >= W) untouched."""
    rng = np.random.default_rng()
    kv, nw, ang, ring = _case(rng, b, w, d, r)
    slot = np.asarray(rng.integers(0, w, b), np.int32)
    if b > 1:
        slot[1] = w  # idle
    slot = jnp.asarray(slot)
    got = jax.jit(lambda *a: pallas_triton.window_kv_write(*a, eps=1e-6, interpret=True))(kv, nw, ang, ring, slot)
    want = jax.jit(lambda *a: reference.window_kv_write(*a, eps=1e-6))(kv, nw, ang, ring, slot)
    (gd, gs), (wd, ws), (od, os_) = _bytes(got), _bytes(want), _bytes(ring)
    np.testing.assert_array_equal(gd, wd)
    np.testing.assert_array_equal(gs, ws)
    for i, s in enumerate(np.asarray(slot)):
        keep = np.ones(w, bool)
        if s < w:
            keep[s] = False
            assert not np.array_equal(gd[i, s], od[i, s])
        np.testing.assert_array_equal(gd[i, keep], od[i, keep])
        np.testing.assert_array_equal(gs[i, keep], os_[i, keep])


def test_tiny_and_large_values_and_a_zero_block():
    """Values spanning many binades (e4m3 subnormals after scaling), and a 32-block of zeros before
    the norm's weight (amax clamps at 1e-4): bytes equal to the reference's."""
    rng = np.random.default_rng()
    kv, nw, ang, ring = _case(rng, 2, 8, 512, 64)
    k = np.asarray(kv, np.float32) * np.exp2(rng.integers(-20, 8, (2, 512)))
    nwf = np.asarray(nw, np.float32)
    nwf[64:96] = 0.0
    kv, nw = jnp.asarray(k, jnp.bfloat16), jnp.asarray(nwf, jnp.bfloat16)
    slot = jnp.asarray([3, 7], jnp.int32)
    got = jax.jit(lambda *a: pallas_triton.window_kv_write(*a, eps=1e-6, interpret=True))(kv, nw, ang, ring, slot)
    want = jax.jit(lambda *a: reference.window_kv_write(*a, eps=1e-6))(kv, nw, ang, ring, slot)
    for g, wv in zip(_bytes(got), _bytes(want)):
        np.testing.assert_array_equal(g, wv)


def test_unsupported_reasons_and_dispatch(monkeypatch):
    rng = np.random.default_rng()
    kv, nw, ang, ring = _case(rng, 2, 8, 512, 64)
    slot = jnp.asarray([1, 2], jnp.int32)
    assert pallas_triton.unsupported_reason(kv, nw, ang, ring, slot) is None
    assert "[B, D]" in pallas_triton.unsupported_reason(kv[None], nw, ang, ring, slot)
    assert "block (1, 32)" in pallas_triton.unsupported_reason(kv, nw, ang, Fp8Tensor(ring.data, ring.scale, (32, 32)), slot)
    assert "angles shape" in pallas_triton.unsupported_reason(kv, nw, ang[:, :24], ring, slot)
    assert "slot shape" in pallas_triton.unsupported_reason(kv, nw, ang, ring, slot[:1])
    assert pallas_triton.auto_reason(kv) is None  # measured on the H200 (session 22): 'auto' picks it
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    picked, interp = dispatch.choose("window_kv_write", None, api._kernel,
                                     lambda k: k.unsupported_reason(kv, nw, ang, ring, slot), lambda k: k.auto_reason(kv))
    assert picked is pallas_triton and interp is False
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"window_kv_write \(pallas\): slot shape"):
        pallas_triton.window_kv_write(kv, nw, ang, ring, slot[:1], eps=1e-6, interpret=True)
    calls = []
    real = pallas_triton.window_kv_write
    monkeypatch.setattr(pallas_triton, "window_kv_write", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = api.window_kv_write(kv, nw, ang, ring, slot, eps=1e-6)  # auto on the CPU: the reference
    assert calls == []
    b = api.window_kv_write(kv, nw, ang, ring, slot, eps=1e-6, implementation="interpret")
    assert calls == [1]
    for x, y in zip(_bytes(a), _bytes(b)):
        np.testing.assert_array_equal(x, y)
    assert dispatch.parse_kernels_env("window_kv_write=pallas") == ("auto", {"window_kv_write": "pallas"})


def test_model_decode_on_the_op(monkeypatch):
    """The tiny V4.1 model's decode steps with the op in interpret mode: the same tokens and logits
    as with the reference (the op replaces norm -> RoPE -> quantize -> scatter at S = 1 with the
    FP8 window). The dispatch is resolved when a step is traced, so the caches are cleared between
    the two runs."""
    import os

    from dsv41_jax.engine import Engine, Request
    from dsv41_jax.model import Model
    from dsv41_jax.options import RunOptions

    fix = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v41_tiny_a")
    model = Model.from_checkpoint(fix)
    opts = RunOptions(dtype="bfloat16")  # kv_cache_dtype "reference": the FP8 window ring
    assert opts.quantized_kv
    prompt = list(range(5, 17))

    def run():
        jax.clear_caches()
        eng = Engine(model, batch_size=1, max_seq_len=64, opts=opts, prefill_chunk=8, stop_ids=())
        return eng.generate([Request(prompt, max_new_tokens=5)], return_logits=True)[0]

    want = run()
    calls = []
    real = pallas_triton.window_kv_write
    monkeypatch.setattr(pallas_triton, "window_kv_write", lambda *a, **k: calls.append(k["interpret"]) or real(*a, **k))
    monkeypatch.setenv("DSV41_KERNELS", "reference,window_kv_write=interpret")
    got = run()
    assert calls and all(calls)
    assert got.output_ids == want.output_ids
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("b", [1, 3, 64])  # 3: a slot block that is not a power of two
def test_cross_lowering(target, b):
    S = jax.ShapeDtypeStruct
    w, d, r = 128, 512, 64
    ring = Fp8Tensor(S((b, w, d), jnp.float8_e4m3fn), S((b, w, d // 32), jnp.float8_e8m0fnu), (1, 32))
    text = lower_for(target, lambda *a: pallas_triton.window_kv_write(*a, eps=1e-6),
                     S((b, d), jnp.bfloat16), S((d,), jnp.bfloat16), S((b, r // 2), jnp.float32), ring,
                     S((b,), jnp.int32)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "scatter" not in text


def test_benchmark_checks_then_times(monkeypatch, capsys, tmp_path):
    import functools
    import json

    import pallas_kernels.benchmarking as bm
    from pallas_kernels.window_kv import benchmark

    monkeypatch.setattr(bm, "device_time_op", fake_device_time(3e-6))
    monkeypatch.setattr(pallas_triton, "window_kv_write", functools.partial(pallas_triton.window_kv_write, interpret=True))
    assert benchmark.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "B=  1 PASS bytes equal 1.00000" in out and "window_kv_write check: ALL PASS" in out
    rows = json.loads((tmp_path / "window_kv_write.json").read_text())["rows"]
    assert rows[0]["ok"] and rows[0]["xla_us"] == 3.0
