"""The fma kernels' activation fake-quant in Pallas: inside the GEMV's loop
(``DSV41_FMA_ACT_QUANT=kernel``) or as one prologue kernel writing the phase layout
(``DSV41_FMA_ACT_QUANT=pallas``, GEMV and fused MoE).

``quant_phases`` must be ``act_quant`` bit for bit (its scale exponent is read from amax's bits
instead of a division), and the GEMV / multi-GEMV with the quant inside must give the
values of the XLA act-quant path: the same quantized activations, products and summation order,
up to how the sums' multiply-adds are contracted. Interpret mode on the CPU; both GPU targets lowered.
"""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ShapeDtypeStruct as S

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, act_quant, quantize_fp8, quantize_mxfp4
from pallas_kernels.moe import pallas_triton as moe_pallas
from pallas_kernels.quantized_matmul import pallas_triton
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma
from pallas_kernels.testing import lower_for

_q8 = jax.jit(quantize_fp8, static_argnames="block")
_q4 = jax.jit(quantize_mxfp4, static_argnames="block")


def run(fn, *args, **kw):
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def hard_rows(rng, rows, k, block):
    """float32 [rows, k]: random blocks over many binades, and blocks whose amax sits exactly on or
    one ulp beside 448 * 2**e and 1.75 * 2**E (where the scale exponent steps), blocks under the
    1e-4 floor, e4m3 ties after scaling, and both signs of zero."""
    x = rng.standard_normal((rows, k)).astype(np.float32) * np.exp2(rng.integers(-24, 24, (rows, 1))).astype(np.float32)
    nb = k // block
    for r in range(rows):
        for b in range(0, nb, 3):
            e = int(rng.integers(-30, 30))
            edge = np.float32(448.0 * 2.0**e)
            pick = rng.integers(0, 4)
            amax = [edge, np.nextafter(edge, np.float32(np.inf)), np.nextafter(edge, np.float32(0)),
                    np.float32(1.75 * 2.0**e) * np.float32(1.0 + 2.0**-23)][pick]
            blk = x[r, b * block:(b + 1) * block]
            blk[:] = blk / np.abs(blk).max() * amax * np.float32(0.9)
            blk[int(rng.integers(block))] = amax * rng.choice([-1, 1])
        x[r, block:2 * block] *= np.float32(1e-7)  # under the 1e-4 floor of the scale
    # e4m3 ties at scale 1 (amax 448): midpoints between neighbouring e4m3 values, and zeros
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    pos = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    x[0, :block] = np.resize(mids, block)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 0.0, -0.0
    return x


@pytest.mark.parametrize("block,phases", [(32, 1), (32, 4), (32, 8), (32, 2), (128, 1), (128, 4)])
def test_quant_phases_is_act_quant_bit_for_bit(block, phases):
    """Every layout the kernels load (1 / 2 / 4 / 8 phases of a block) quantized in the kernel's
    code equals act_quant on the same row, bit for bit, on fresh adversarial rows."""
    rng = np.random.default_rng()
    k = 8 * block
    x = hard_rows(rng, 3, k, block)
    want = np.asarray(jax.jit(lambda x: act_quant(x, block))(jnp.asarray(x)))

    def in_kernel_code(x):
        xr = x.reshape(x.shape[0], k // block, block // phases, phases)
        outs = [jnp.stack(fma.quant_phases([xr[r, ..., j] for j in range(phases)]), axis=-1) for r in range(x.shape[0])]
        return jnp.stack(outs).reshape(x.shape)

    got = np.asarray(jax.jit(in_kernel_code)(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _weights(fmt, rng, n, k, block):  # [n, k]
    wf = jnp.asarray(rng.standard_normal((n, k), np.float32) * np.float32(0.05))
    return _q8(wf, block=(block, block)) if fmt == "fp8" else _q4(wf, block=32)


def _both(monkeypatch, fn):
    """fn() with the act-quant in XLA and in the kernel: both results (fresh traces each)."""
    out = {}
    for where in ("xla", "kernel"):
        monkeypatch.setattr(fma, "ACT_QUANT", where)
        out[where] = fn()
    return out["xla"], out["kernel"]


def assert_same_values(a, b):
    """Equal up to the fp32 rounding of the sums (interpret mode's XLA may contract a multiply-add
    into an FMA differently when the activation is computed in the kernel: 1-ulp differences), far
    tighter than one act-quant flip (an e4m3 step of one activation moves y by ~1e-3 of max|y|):
    |diff| <= 1e-6 max|y| in float32, one bf16 ulp in bf16."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        tol = 2.0**-8 if x.dtype == jnp.bfloat16 else 1e-6
        x, y = np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * float(np.max(np.abs(y))))


@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("fmt,dtype,m,ns,k,block", [
    ("fp8", jnp.bfloat16, 1, (64,), 512, 32), ("fp8", jnp.float32, 3, (128, 64), 1024, 32),
    ("fp8", jnp.float32, 2, (256,), 512, 128), ("fp4", jnp.bfloat16, 4, (64, 32), 512, 32),
    ("fp4", jnp.float32, 1, (96,), 1024, 32),
])
def test_gemv_with_quant_in_kernel_same_values(fmt, dtype, m, ns, k, block, via, monkeypatch):
    """The fma GEMV (one weight and a multi-GEMV over two) with the activation quantized in the
    kernel gives the values of the XLA act-quant path, on adversarial rows, with split K."""
    monkeypatch.setattr(fma, "FMA_DECODE", {"fp4": via, "fp8": via})
    rng = np.random.default_rng()
    x = jnp.asarray(hard_rows(rng, m, k, block)).astype(dtype)
    ws = [_weights(fmt, rng, n, k, block) for n in ns]
    cfg = fma.default_config(m, ns, k, ws[0])
    if "DSV41_FMA_ACT_QUANT" not in __import__("os").environ:
        assert fma.ACT_QUANT == "kernel"  # the default since session 20
    monkeypatch.setattr(fma, "ACT_QUANT", "xla")
    assert fma.act_quant_site(ws[0], block) == "xla"
    monkeypatch.setattr(fma, "ACT_QUANT", "kernel")
    assert fma.act_quant_site(ws[0], block) == "kernel"
    a, b = _both(monkeypatch, lambda: run(pallas_triton.quantized_matmul_multi, x, *[ws], act_block=block,
                                          config=cfg, interpret=True))
    assert_same_values(a, b)


@pytest.mark.parametrize("via", ["e4m3", "f16w"])
@pytest.mark.parametrize("fmt,block,dtype,m,k", [
    ("fp8", 32, jnp.bfloat16, 3, 1280), ("fp8", 32, jnp.float32, 1, 2304), ("fp8", 128, jnp.bfloat16, 2, 1024),
    ("fp4", 32, jnp.bfloat16, 4, 5120), ("fp4", 32, jnp.float32, 2, 256),
])
def test_act_quant_view_is_act_view_of_act_quant(fmt, block, dtype, m, k, via, monkeypatch):
    """The prologue kernel's phases equal act_view(act_quant(x)) bit for bit, for every phase
    layout (1, 2, 4, 8 phases) and K group counts that are not powers of two (40, 72, 160)."""
    monkeypatch.setattr(fma, "FMA_DECODE", {"fp4": via, "fp8": via})
    rng = np.random.default_rng()
    x = jnp.asarray(hard_rows(rng, m, k, block)).astype(dtype)
    w = _weights(fmt, rng, 32, k, block)
    got = run(fma.act_quant_view, x, w, interpret=True)
    want = run(lambda x: fma.act_view(act_quant(x, block), w), x)
    assert len(got) == len(want) == fma._phase_layout(w)[0]
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("fmt,dtype,m,ns,k,block", [
    ("fp8", jnp.bfloat16, 1, (64, 32), 1280, 32), ("fp8", jnp.float32, 2, (256,), 512, 128),
    ("fp4", jnp.bfloat16, 3, (64,), 512, 32),
])
def test_gemv_with_quant_prologue_same_bits(fmt, dtype, m, ns, k, block, monkeypatch):
    """The GEMV with the Pallas prologue gives exactly the XLA act-quant path's bits (the kernel
    reads the same phases)."""
    rng = np.random.default_rng()
    x = jnp.asarray(hard_rows(rng, m, k, block)).astype(dtype)
    ws = [_weights(fmt, rng, n, k, block) for n in ns]
    cfg = fma.default_config(m, ns, k, ws[0])
    out = {}
    for where in ("xla", "pallas"):
        monkeypatch.setattr(fma, "ACT_QUANT", where)
        out[where] = run(pallas_triton.quantized_matmul_multi, x, ws, act_block=block, config=cfg, interpret=True)
    for a, b in zip(out["xla"], out["pallas"], strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize("fmt,dtype,n,bt", [("fp4", jnp.bfloat16, 1, 1), ("fp4", jnp.float32, 5, 2),
                                            ("fp8", jnp.bfloat16, 3, 4)])
def test_moe_fma_with_quant_prologue_same_bits(fmt, dtype, n, bt, monkeypatch):
    """The fma fused MoE with x and h quantized by the prologue kernel gives the XLA path's bits."""
    rng = np.random.default_rng()
    e, i, d, topk = 4, 64, 128, 2

    def w(r, c):
        wf = jnp.asarray(rng.standard_normal((e, r, c), np.float32) * np.float32(0.2))
        return _q8(wf, block=(32, 32)) if fmt == "fp8" else _q4(wf, block=32)

    w1, w2, w3 = w(i, d), w(d, i), w(i, d)
    x = jnp.asarray(hard_rows(rng, n, d, 32)).astype(dtype)
    wts = jnp.asarray(rng.uniform(0.05, 1.0, (n, topk)).astype(np.float32))
    idx = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :topk].astype(np.int32))
    cfg = list(moe_pallas.default_fma_config(w1))
    cfg[1] = bt
    out = {}
    for where in ("xla", "pallas"):
        monkeypatch.setattr(fma, "ACT_QUANT", where)
        out[where] = run(moe_pallas.moe_experts, x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=32,
                         interpret=True, config=tuple(cfg))
    np.testing.assert_array_equal(np.asarray(out["xla"].astype(jnp.float32)),
                                  np.asarray(out["pallas"].astype(jnp.float32)))


def test_act_quant_switch_refuses_unknown_values():
    import subprocess
    import sys

    code = "import dsv41_jax, pallas_kernels.quantized_matmul.pallas_triton_fma"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "DSV41_FMA_ACT_QUANT": "gpu"})
    assert out.returncode != 0 and "DSV41_FMA_ACT_QUANT='gpu'" in out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "DSV41_MOE_ACT_QUANT": "kernel"})
    assert out.returncode != 0 and "DSV41_MOE_ACT_QUANT='kernel': expected one of xla, pallas" in out.stderr


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_quant_in_kernel_lowers(target, monkeypatch):
    """The GEMV (FP8 32 and 128 blocks, MXFP4) lowers for both GPU targets with the quant inside, and
    the XLA act-quant's block-max reduction is gone from the program around the kernel; the fused
    MoE follows DSV41_MOE_ACT_QUANT (its prologue kernel, or XLA's act-quant)."""
    from jax.experimental.pallas import triton as pltriton

    specs = [Fp8Tensor(S((1280, 5120), jnp.float8_e4m3fn), S((40, 160), jnp.float8_e8m0fnu), (32, 32)),
             Fp8Tensor(S((4096, 8192), jnp.float8_e4m3fn), S((32, 64), jnp.float8_e8m0fnu), (128, 128)),
             Fp4Tensor(S((2304, 2560), jnp.uint8), S((2304, 160), jnp.float8_e8m0fnu), 32)]
    for w in specs:
        ab = w.block[0] if isinstance(w, Fp8Tensor) else 32
        cfg = fma.default_config(1, w.shape[0], w.shape[1], w)
        txts = {}
        for where in ("xla", "kernel"):
            monkeypatch.setattr(fma, "ACT_QUANT", where)
            txts[where] = lower_for(target, lambda x, w: pallas_triton.quantized_matmul(x, w, act_block=ab, config=cfg),
                                    S((1, w.shape[1]), jnp.bfloat16), w).as_text()
            assert txts[where].count(pltriton.CUSTOM_CALL_TARGET_NAME) == 1
        assert "stablehlo.reduce" in txts["xla"] and "stablehlo.maximum" in txts["xla"]
        assert "stablehlo.maximum" not in txts["kernel"], "an XLA act-quant is left before the kernel"
    # the prologue kernel: one more launch, no XLA block-max reduction left
    for w in specs:
        ab = w.block[0] if isinstance(w, Fp8Tensor) else 32
        cfg = fma.default_config(4, w.shape[0], w.shape[1], w)
        monkeypatch.setattr(fma, "ACT_QUANT", "pallas")
        txt = lower_for(target, lambda x, w: pallas_triton.quantized_matmul(x, w, act_block=ab, config=cfg),
                        S((4, w.shape[1]), jnp.bfloat16), w).as_text()
        assert txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) == 2 and "stablehlo.maximum" not in txt
    # the fused MoE has no in-kernel act-quant (its fma loops grew 1.8-2.4x with it inside): with
    # DSV41_MOE_ACT_QUANT=xla it keeps XLA's act-quants beside the GEMV's "kernel"
    e, i, d = 8, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32)
    monkeypatch.setattr(fma, "ACT_QUANT", "kernel")
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", "xla")
    cfg = moe_pallas.default_fma_config(w1)
    txt = lower_for(target, lambda x, wt, idx, a, b, c: moe_pallas.moe_experts(
        x, wt, idx, a, b, c, swiglu_limit=10.0, config=cfg),
        S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1, w2, w1).as_text()
    assert txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) == 2 and "stablehlo.maximum" in txt
    monkeypatch.setattr(fma, "ACT_QUANT", "pallas")  # with the prologue: two more launches (x and h)
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", None)
    txt = lower_for(target, lambda x, wt, idx, a, b, c: moe_pallas.moe_experts(
        x, wt, idx, a, b, c, swiglu_limit=10.0, config=cfg),
        S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1, w2, w1).as_text()
    assert txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) == 4
    # DSV41_MOE_ACT_QUANT sets the MoE's site on its own: the prologue beside the GEMV's in-kernel quant
    # (the default since session 21)
    monkeypatch.setattr(fma, "ACT_QUANT", "kernel")
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", None)
    txt = lower_for(target, lambda x, wt, idx, a, b, c: moe_pallas.moe_experts(
        x, wt, idx, a, b, c, swiglu_limit=10.0, config=cfg),
        S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1, w2, w1).as_text()
    assert txt.count(pltriton.CUSTOM_CALL_TARGET_NAME) == 4 and "stablehlo.maximum" not in txt
    monkeypatch.setattr(fma, "ACT_QUANT", "pallas")
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", "xla")
    assert fma.moe_act_quant_site(w1, 32) == "xla" and fma.moe_act_quant_site(w1, 128) == "xla"
    monkeypatch.setattr(fma, "MOE_ACT_QUANT", None)  # unset: follows the GEMV's site, "kernel" -> "pallas"
    assert fma.moe_act_quant_site(w1, 32) == "pallas" and fma.moe_act_quant_site(w1, 128) == "xla"
    monkeypatch.setattr(fma, "ACT_QUANT", "kernel")
    assert fma.moe_act_quant_site(w1, 32) == "pallas" and fma.moe_act_quant_site(w1, 128) == "xla"
    monkeypatch.setattr(fma, "ACT_QUANT", "xla")
    assert fma.moe_act_quant_site(w1, 32) == "xla"


def test_gemv_with_quant_in_kernel_reads_the_raw_bf16_activation(monkeypatch):
    """With the act-quant in the kernel, the bf16 activation goes into the pallas_call as it is: no
    XLA op widens it to float32 first (that was one more kernel before every decode GEMV on the GPU,
    session 20); with the XLA act-quant the kernel reads the fake-quantized float32 phases."""
    rng = np.random.default_rng()
    w = _weights("fp8", rng, 64, 512, 32)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    # unsplit (the default splits this tiny grid, and the split's sum would convert the output)
    cfg = fma.default_config(1, 64, 512, w)[:3] + (1, 4, 3)

    def calls(where):
        monkeypatch.setattr(fma, "ACT_QUANT", where)
        jaxpr = jax.make_jaxpr(lambda x: fma.quantized_matmul_fma(x, w, act_block=32, out_dtype=jnp.bfloat16,
                                                                   config=cfg))(x).jaxpr
        names = [e.primitive.name for e in jaxpr.eqns]
        (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        return names, call.invars[0].aval.dtype

    names, dtype = calls("kernel")
    assert dtype == jnp.bfloat16 and "shift_left" not in names and "convert_element_type" not in names
    names, dtype = calls("xla")
    assert dtype == jnp.float32 and "reduce_max" in names
