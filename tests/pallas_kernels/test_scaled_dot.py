"""pallas_kernels.scaled_dot.mx_dot: the MX (OCP microscaling) dot inside Pallas-Triton kernels --
its CPU form against a float64 numpy decode, its refusals, and its lowering to one tt.dot_scaled for
cuda and rocm; the lightning indexer's "mx" read as gfx950's default."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import scaled_dot
from pallas_kernels.inspect_sass import triton_kernels
from pallas_kernels.scaled_dot import mx_dot


@pytest.mark.parametrize("a_format,b_format,k", [("e2m1", "e2m1", 128), ("e4m3", "e2m1", 64), ("e2m1", "e4m3", 256)])
def test_mx_dot_in_a_kernel_equals_the_float64_decode(a_format, b_format, k):
    """In interpret mode (the CPU's form) every output element equals the float64 dot of the decoded
    operands to float32 summation (fresh random codes, all 16 e2m1 codes in both nibbles, scales over
    40 binades; the products are exact in float32, so the bound is the sum's own rounding)."""
    rng = np.random.default_rng()
    m, n = 64, 32
    a, asc = scaled_dot.random_operand(rng, m, k, a_format, (107, 147))
    b, bsc = scaled_dot.random_operand(rng, n, k, b_format, (107, 147))
    got = np.asarray(scaled_dot.probe_kernel(m, n, a_format, b_format, interpret=True)(a, asc, b, bsc), np.float64)
    da, db = scaled_dot.decode_host(a, asc, a_format), scaled_dot.decode_host(b, bsc, b_format)
    want = da @ db.T
    bound = (np.abs(da) @ np.abs(db).T) * k * 2.0**-24
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("case,match", [
    (dict(k_b=96), "a holds K=128 elements a row and b K=96"),
    (dict(k_a=48, k_b=48), "K=48 is not a multiple of the MX block of 32"),
    (dict(scale_a=(8, 3)), r"a_scale: expected uint8\[8, 4\]"),
    (dict(a_format="e3m2"), "a_format='e3m2': expected one of e2m1, e4m3"),
    (dict(b_dtype=jnp.int8), "b: expected a 2-D uint8 array for e2m1"),
])
def test_mx_dot_refuses_what_it_cannot_take(case, match):
    k_a, k_b = case.get("k_a", 128), case.get("k_b", 128)
    a = jnp.zeros((8, k_a // 2), jnp.uint8)
    b = jnp.zeros((4, k_b // 2), case.get("b_dtype", jnp.uint8))
    asc = jnp.zeros(case.get("scale_a", (8, max(k_a // 32, 1))), jnp.uint8)
    bsc = jnp.zeros((4, max(k_b // 32, 1)), jnp.uint8)
    with pytest.raises(ValueError, match=match):
        mx_dot(a, asc, b, bsc, a_format=case.get("a_format", "e2m1"))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("a_format", ["e2m1", "e4m3"])
def test_mx_dot_lowers_to_one_dot_scaled(target, a_format):
    """Inside a kernel the op is one ``tt.dot_scaled`` (MXFP4 operands packed along K, both scales),
    and the module passes the MLIR verifier (``lower_for``) for cuda and rocm."""
    assert scaled_dot.TRITON_RULE
    a_spec = ((64, 64), jnp.uint8) if a_format == "e2m1" else ((64, 128), jnp.float8_e4m3fn)
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in (a_spec, ((64, 4), jnp.uint8), ((32, 64), jnp.uint8),
                                                      ((32, 4), jnp.uint8))]
    [k] = triton_kernels(scaled_dot.probe_kernel(64, 32, a_format, "e2m1"), *specs, target=target)
    ops = [line for line in k["ttir"].splitlines() if "tt.dot_scaled" in line]
    assert len(ops) == 1 and f"lhs = {a_format} rhs = e2m1" in ops[0], ops


def test_has_mx_dot_by_device(monkeypatch):
    from pallas_kernels.lightning_indexer import pallas_triton as ix

    class Dev:
        def __init__(self, kind, cc=""):
            self.device_kind, self.compute_capability = kind, cc

    has = scaled_dot.has_mx_dot
    assert has(Dev("AMD Instinct MI355X")) and has(Dev("AMD Instinct MI350X")) and has(Dev("", "gfx950"))
    assert not has(Dev("AMD Instinct MI300X", "gfx942")) and not has(Dev("NVIDIA H200", "9.0"))
    assert not has() and not scaled_dot.mx_default()  # this CPU, DSV41_MX_DOT=auto
    assert ix.default_fp4_read() == ix.default_fp4_read(interpret=True) == ix.DEFAULTS["fp4_read"] == "phases"
    monkeypatch.setattr(scaled_dot, "MX_DOT", "on")  # DSV41_MX_DOT=on: everywhere but interpret mode
    assert ix.default_fp4_read() == "mx" and ix.default_fp4_read(interpret=True) == "phases"
    monkeypatch.setattr(scaled_dot, "MX_DOT", "off")
    monkeypatch.setattr(scaled_dot, "has_mx_dot", lambda device=None: True)
    assert not scaled_dot.mx_default()


@pytest.mark.parametrize("mx_device", [True, False])
def test_indexer_takes_the_mx_read_on_gfx950(monkeypatch, mx_device):
    """A lightning_indexer call that names no read lowers (rocm) its score kernel to tt.dot_scaled where
    the device has MX matrix instructions (gfx950), and to the phase dots elsewhere; interpret mode keeps
    the default read (its values: test_lightning_indexer's every-code test, ``mx`` rows)."""
    from dsv41_jax.quant import Fp4Tensor
    from pallas_kernels.lightning_indexer import pallas_triton as ix

    sd = jax.ShapeDtypeStruct
    b, s, hi, di, nc = 1, 1, 32, 128, 1280
    specs = [Fp4Tensor(sd((b, s, hi, di // 2), jnp.uint8), sd((b, s, hi, di // 32), jnp.float8_e8m0fnu), block=32),
             sd((b, s, hi), jnp.float32),
             Fp4Tensor(sd((b, nc, di // 2), jnp.uint8), sd((b, nc, di // 32), jnp.float8_e8m0fnu), block=32),
             sd((b, s), jnp.int32)]
    monkeypatch.setattr(scaled_dot, "has_mx_dot", lambda device=None: mx_device)
    monkeypatch.setattr(scaled_dot, "probe_passed", lambda device=None: True)  # the device's Triton takes the op
    assert ix.default_fp4_read(interpret=True) == "phases"

    def f(q, w, k, v):
        return ix.lightning_indexer(q, w, k, v, top_k=512).topk

    kernels = triton_kernels(f, *specs, target="rocm")
    scores = [k for k in kernels if k["name"].startswith("indexer_block_maxima")]
    assert scores and all(("tt.dot_scaled" in k["ttir"]) == mx_device for k in scores), [k["name"] for k in kernels]
    # a prefill chunk (4,096 rows): the tile score kernel reads q and the keys as stored on gfx950
    pre = [sd((b, 4096, hi, di // 2), jnp.uint8), sd((b, 4096, hi, di // 32), jnp.float8_e8m0fnu)]
    specs_pre = [Fp4Tensor(*pre, block=32), sd((b, 4096, hi), jnp.float32), specs[2], sd((b, 4096), jnp.int32)]
    [k] = [k for k in triton_kernels(f, *specs_pre, target="rocm") if k["name"].startswith("indexer_prefill_scores")]
    assert k["name"] == ("indexer_prefill_scores_mx" if mx_device else "indexer_prefill_scores")
    assert ("tt.dot_scaled" in k["ttir"]) == mx_device


def test_mx_dot_accumulates_into_acc():
    """``acc`` is the dot's accumulator operand: the result is acc + the dot (the reference here; on the
    GPU tt.dot_scaled's C operand), and a wrong accumulator shape is refused."""
    rng = np.random.default_rng()
    a, asc = scaled_dot.random_operand(rng, 16, 64, "e2m1", (120, 134))
    b, bsc = scaled_dot.random_operand(rng, 16, 64, "e4m3", (120, 134))
    acc = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)
    got = np.asarray(mx_dot(a, asc, b, bsc, b_format="e4m3", acc=acc), np.float64)
    want = np.asarray(acc, np.float64) + scaled_dot.decode_host(a, asc, "e2m1") @ scaled_dot.decode_host(b, bsc, "e4m3").T
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"acc: expected float32\[16, 16\], got float32\[16, 8\]"):
        mx_dot(a, asc, b, bsc, b_format="e4m3", acc=acc[:, :8])


@pytest.mark.parametrize("mx_device", [True, False])
def test_prefill_gemm_takes_the_mx_mode_on_gfx950(monkeypatch, mx_device):
    """A tiled FP8 GEMM (wq_b at 4,096 rows) lowers (rocm) to the MX kernel -- one tt.dot_scaled a K tile,
    e4m3 x e4m3 -- where the device has MX matrix instructions, and to the bf16 "expand" kernel elsewhere;
    a scale mode named in SCALE_MODE other than "expand" is kept either way."""
    from dsv41_jax.quant import Fp8Tensor
    from pallas_kernels.quantized_matmul import pallas_triton as qmm

    monkeypatch.setattr(scaled_dot, "has_mx_dot", lambda device=None: mx_device)
    monkeypatch.setattr(scaled_dot, "probe_passed", lambda device=None: True)  # the device's Triton takes the op
    sd = jax.ShapeDtypeStruct
    w = Fp8Tensor(sd((32768, 1280), jnp.float8_e4m3fn), sd((1024, 40), jnp.float8_e8m0fnu), block=(32, 32))
    [k] = triton_kernels(lambda x, w: qmm.quantized_matmul(x, w), sd((4096, 1280), jnp.bfloat16), w, target="rocm")
    assert k["name"] == ("qmm_fp8_mx" if mx_device else "qmm_fp8")
    assert ("lhs = e4m3 rhs = e4m3" in k["ttir"]) == mx_device
    monkeypatch.setitem(qmm.SCALE_MODE, "fp8", "gather")
    assert qmm.default_scale_mode("fp8") == "gather" and qmm.default_scale_mode("fp4") == ("mx" if mx_device else "expand")


def test_probe_passes_in_interpret_mode_even_inside_a_trace(monkeypatch):
    """``probe`` runs every format pair the kernels use (q x k, FP8 and MXFP4 GEMMs) in a kernel and checks
    each element against the decoded dot; on the CPU (interpret mode) all agree. Called while a jitted
    function is traced (as ``mx_default`` is, from a kernel's dispatch) it still evaluates eagerly:
    nothing of it enters the traced program."""
    assert scaled_dot.probe(interpret=True) is None
    seen = []

    def f(x):
        seen.append(scaled_dot.probe(interpret=True))
        return x + 1.0

    jaxpr = jax.make_jaxpr(f)(1.0)
    assert seen == [None] and len(jaxpr.eqns) == 1, jaxpr


def test_probe_names_a_wrong_result_and_a_compile_failure(monkeypatch):
    """A Triton that reads MXFP4 nibbles high first, or one that decodes e2m1's +-0.5 (the one subnormal
    code) as 0, or applies a block's scale to the next block, or fails to compile the op, fails the probe,
    which names the format pair, the device and the worst element (or the error); the operands' own
    decode passes (the bound leaves room for an accumulator below float32, PROBE_REL_BOUND)."""
    real = scaled_dot.probe_kernel

    def flawed(flaw):
        def kernel(m, n, a_format, b_format, *, interpret=False):
            call = real(m, n, a_format, b_format, interpret=interpret)

            def wrong(a, asc, b, bsc):
                if flaw == "high_first" and a_format == "e2m1":
                    a = (a >> 4) | (a << 4)
                if flaw == "no_subnormal" and b_format == "e2m1":
                    lo, hi = b & 15, b >> 4
                    lo, hi = (jnp.where((v & 7) == 1, v & 8, v) for v in (lo, hi))
                    b = lo | (hi << 4)
                if flaw == "scale_shift":
                    asc = jnp.roll(asc, 1, axis=1)
                return call(a, asc, b, bsc)
            return wrong
        return kernel

    for flaw, pair in (("high_first", "e2m1 x e2m1"), ("no_subnormal", "e2m1 x e2m1"), ("scale_shift", "e2m1 x e2m1"),
                       ("none", None)):
        monkeypatch.setattr(scaled_dot, "probe_kernel", flawed(flaw))
        reason = scaled_dot.probe(interpret=True)
        if pair is None:
            assert reason is None, reason
        else:
            assert reason and reason.startswith(f"mx_dot {pair} on cpu:") and "the decoded operands' dot gives" in reason, \
                (flaw, reason)

    def no_dot_scaled(*a, **k):
        def call(*args):
            raise RuntimeError("failed to legalize operation 'tt.dot_scaled'\nmore lines")
        return call

    monkeypatch.setattr(scaled_dot, "probe_kernel", no_dot_scaled)
    reason = scaled_dot.probe(interpret=True)
    assert reason.endswith("RuntimeError: failed to legalize operation 'tt.dot_scaled'"), reason


def test_mx_default_probes_an_mx_device_once_and_falls_back_with_a_warning(monkeypatch):
    """Under DSV41_MX_DOT=auto an MX device takes MX dots only if the probe passed (once per device,
    cached); a failed probe warns once with its reason and the variable, and the decode routes stay.
    ``on`` skips the probe, interpret mode and ``off`` never use MX dots."""
    from pallas_kernels.lightning_indexer import pallas_triton as ix

    calls = []
    result = {"reason": "mx_dot e2m1 x e2m1 on rocm:gfx950: RuntimeError: no tt.dot_scaled"}
    monkeypatch.setattr(scaled_dot, "has_mx_dot", lambda device=None: True)
    monkeypatch.setattr(scaled_dot, "probe", lambda device=None, **k: calls.append(device) or result["reason"])
    monkeypatch.setattr(scaled_dot, "_PROBED", {})
    with pytest.warns(RuntimeWarning, match="MX dots disabled on this device.*no tt.dot_scaled.*DSV41_MX_DOT=on"):
        assert not scaled_dot.mx_default()
    assert ix.default_fp4_read() == "phases" and not scaled_dot.mx_default() and len(calls) == 1  # cached
    monkeypatch.setattr(scaled_dot, "_PROBED", {})
    result["reason"] = None
    assert scaled_dot.mx_default() and ix.default_fp4_read() == "mx" and len(calls) == 2
    assert not scaled_dot.mx_default(interpret=True)
    monkeypatch.setattr(scaled_dot, "MX_DOT", "on")
    monkeypatch.setattr(scaled_dot, "_PROBED", {})
    assert scaled_dot.mx_default() and len(calls) == 2  # forced: not probed
    monkeypatch.setattr(scaled_dot, "MX_DOT", "off")
    assert not scaled_dot.mx_default() and len(calls) == 2
