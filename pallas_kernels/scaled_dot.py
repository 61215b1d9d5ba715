"""Microscaled (OCP MX) dot products inside Pallas-Triton kernels: ``mx_dot``.

``mx_dot(a, a_scale, b, b_scale, a_format=, b_format=)`` is ``jnp.dot(dq(a), dq(b).T)`` in float32,
where ``dq`` decodes MX operands: ``a`` [M, K] of one of :data:`FORMATS` (``"e2m1"``: MXFP4 codes,
two a byte, stored [M, K/2] uint8 with element 2i in the low nibble of byte i, the layout of
``dsv41_jax.quant.Fp4Tensor``; ``"e4m3"``: [M, K] float8_e4m3fn) times its e8m0 block scales
``a_scale`` [M, K/32] uint8 (2**(s - 127), one per 32 consecutive K elements); ``b`` likewise,
given as rows [N, K(/2)] with scales [N, K/32].

Inside a Pallas-Triton kernel it lowers to one ``tt.dot_scaled``: Triton's own MX dot, which on
gfx950 (MI350X, the target) and sm_100 is the hardware's block-scaled MFMA / MMA, and on sm_90 is
decomposed by Triton into an upcast to bf16 (exact for e2m1 and e4m3 times a power of two in
bf16's range) and a bf16 dot. Everywhere else (interpret mode on the CPU, plain XLA) it runs
:func:`reference`: the operands decoded to float32 and one float32 dot at HIGHEST precision, which
equals the hardware's result up to the float32 summation order (every product of two MX elements
is exact in float32).

Scales must be finite: e8m0 255 is MX's NaN, and Triton's sm_90 upcast does not reproduce it;
callers pass scales of real data (the quantizers write 0..254).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from dsv41_jax.quant.codecs import E2M1_LUT16, e2m1_decode, e8m0_decode, unpack_nibbles

FORMATS = ("e2m1", "e4m3")
BLOCK = 32  # MX block: elements of K sharing one e8m0 scale

# Devices with a block-scaled MX matrix instruction: gfx950 (MI350X / MI355X, v_mfma_scale_f32_*_f8f6f4).
MX_DEVICE_MARKS = ("gfx950", "mi350", "mi355")
# Where the kernels take MX dots by default (DSV41_MX_DOT, read at import): "auto" (on devices with MX
# matrix instructions, has_mx_dot), "off" (nowhere: each kernel's decode route) or "on" (everywhere,
# for A/B runs: on sm_90 Triton lowers the MX dot to its own upcast and a bf16 dot).
MX_DOT_CHOICES = ("auto", "off", "on")
MX_DOT = os.environ.get("DSV41_MX_DOT", "auto").lower()
if MX_DOT not in MX_DOT_CHOICES:
    raise ValueError(f"DSV41_MX_DOT={MX_DOT!r}: expected one of {', '.join(MX_DOT_CHOICES)}")


def has_mx_dot(device=None) -> bool:
    """Whether ``device`` (default: JAX's first) has a block-scaled MX matrix instruction
    (:data:`MX_DEVICE_MARKS` in its kind or compute capability)."""
    dev = device or jax.devices()[0]
    text = f"{getattr(dev, 'device_kind', '')} {getattr(dev, 'compute_capability', '')}".lower()
    return any(m in text for m in MX_DEVICE_MARKS)


def mx_default(interpret: bool = False) -> bool:
    """Whether kernels that can take MX dots do so by default (:data:`MX_DOT`); never in interpret mode,
    where every kernel keeps its decode route (the MX dot there is the float32 reference). Under "auto"
    a device with MX matrix instructions must also pass :func:`probe` (once per device): a Triton that
    cannot compile ``tt.dot_scaled``, or computes it wrongly, leaves the decode routes in place with a
    warning instead of failing or corrupting the model's first kernel."""
    if interpret or MX_DOT == "off":
        return False
    if MX_DOT == "on":
        return True
    if not has_mx_dot():
        return False
    return probe_passed()


# The operand formats the kernels give mx_dot (the indexer's q x k, the FP8 GEMM, the MXFP4 GEMM), each
# at K = 256 (8 MX blocks) with a 64 x 32 output: the probe's cases.
PROBE_CASES = (("e2m1", "e2m1"), ("e4m3", "e4m3"), ("e4m3", "e2m1"))
PROBE_SHAPE = (64, 32, 256)  # M, N, K
# The probe's bound on |kernel - exact| per output element, relative to that element's sum of |a_k b_k|.
# It checks the formats' semantics (nibble order, code tables, where each scale applies): on the probe's
# operands, e2m1's +-0.5 read as 0 (the subtlest flaw tests/pallas_kernels/test_scaled_dot.py injects) is
# off by at least 2**-4 of that sum at its worst element (300 draws). It does not check the accumulator's
# precision, which MX hardware need not keep at float32 (Hopper's FP8 MMA keeps about 14 bits, DeepSeek-V3's
# report, section 3.3.2); float32 accumulation is within K * 2**-24 of the sum.
PROBE_REL_BOUND = 2.0**-10
_PROBED: dict = {}  # device -> probe's reason (None: passed)


def probe_kernel(m: int, n: int, a_format: str, b_format: str, *, interpret: bool = False):
    """A one-program Pallas-Triton kernel holding one ``mx_dot`` ([m, n] float32 out): the probe's and
    the tests' smallest use of the op."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def kern(a_ref, as_ref, b_ref, bs_ref, o_ref):
        o_ref[...] = mx_dot(a_ref[...], as_ref[...], b_ref[...], bs_ref[...], a_format=a_format, b_format=b_format)

    def call(a, a_scale, b, b_scale):
        return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                              compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
                              interpret=interpret, name=f"mx_dot_probe_{a_format}_{b_format}")(a, a_scale, b, b_scale)
    return call


def random_operand(rng, rows: int, k: int, fmt: str, scales=(107, 147)):
    """Fresh MX operand [rows, K(/2)] with e8m0 scales [rows, K/32] drawn from ``scales`` (every e2m1
    code in both nibbles, -0 too; e4m3 values over its range)."""
    import numpy as np

    if fmt == "e2m1":
        x = jnp.asarray(rng.integers(0, 256, (rows, k // 2), dtype=np.uint8))
    else:
        x = jnp.asarray(rng.standard_normal((rows, k)) * 40, jnp.float32).astype(jnp.float8_e4m3fn)
    return x, jnp.asarray(rng.integers(*scales, (rows, k // BLOCK), dtype=np.uint8))


def probe(device=None, *, interpret: bool = False, seed: int | None = None) -> str | None:
    """Run ``mx_dot`` in a Pallas-Triton kernel on ``device`` (default: JAX's first) for every format
    pair of :data:`PROBE_CASES` on fresh random operands, and compare each output element with the
    float64 dot of the decoded operands (:func:`decode_host`, exact) on the host (bound:
    :data:`PROBE_REL_BOUND` of |a| . |b|). Returns None if every case compiles and agrees,
    else why not (the case and the error, or the worst element); ``seed`` fixes the operands. It runs in a thread of its own, so
    that a call made while a jitted function is being traced (``mx_default`` is called from a
    kernel's dispatch) evaluates eagerly instead of entering the traced program (JAX's trace state is
    per thread)."""
    import concurrent.futures

    dev = device or jax.devices()[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_probe, dev, interpret, seed).result()


def _probe(dev, interpret: bool, seed: int | None) -> str | None:
    import numpy as np

    rng = np.random.default_rng(seed)
    m, n, k = PROBE_SHAPE
    for a_format, b_format in PROBE_CASES:
        case = f"mx_dot {a_format} x {b_format} on {dev.platform}:{getattr(dev, 'device_kind', '')}"
        args = [jax.device_put(v, dev) for v in (*random_operand(rng, m, k, a_format),
                                                 *random_operand(rng, n, k, b_format))]
        try:
            got = np.asarray(jax.jit(probe_kernel(m, n, a_format, b_format, interpret=interpret))(*args))
        except Exception as e:  # noqa: BLE001 (any compile or launch failure disables the route)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            return f"{case}: {type(e).__name__}: {first}"
        # exact decodes and their dot in float64 on the host: neither the device's XLA nor its dot precision
        da, db = decode_host(*args[:2], a_format), decode_host(*args[2:], b_format)
        want = da @ db.T
        bound = (np.abs(da) @ np.abs(db).T) * PROBE_REL_BOUND
        err = np.abs(got.astype(np.float64) - want) - bound
        if not np.all(err <= 0):  # NaN-safe: a NaN fails too
            i = np.unravel_index(np.argmax(np.where(np.isnan(err), np.inf, err)), err.shape)
            return (f"{case}: output [{i[0]}, {i[1]}] = {float(got[i])!r}, the decoded operands' dot gives "
                    f"{float(want[i])!r} (bound {bound[i]:.3g})")
    return None


def probe_passed(device=None) -> bool:
    """:func:`probe` once per device (cached); a failure warns once, naming the reason and
    ``DSV41_MX_DOT``."""
    import warnings

    dev = device or jax.devices()[0]
    if dev not in _PROBED:
        _PROBED[dev] = reason = probe(dev)
        if reason is not None:
            warnings.warn(f"MX dots disabled on this device, the kernels keep their decode routes: {reason} "
                          "(DSV41_MX_DOT=on forces them, DSV41_MX_DOT=off skips this check)", RuntimeWarning,
                          stacklevel=3)
    return _PROBED[dev] is None


def _k_of(x, fmt: str) -> int:
    return x.shape[-1] * (2 if fmt == "e2m1" else 1)


def unsupported_reason(a, a_scale, b, b_scale, a_format: str, b_format: str) -> str | None:
    """Why ``mx_dot`` cannot take these operands (None: it can)."""
    for name, fmt in (("a_format", a_format), ("b_format", b_format)):
        if fmt not in FORMATS:
            return f"{name}={fmt!r}: expected one of {', '.join(FORMATS)}"
    for name, x, fmt in (("a", a, a_format), ("b", b, b_format)):
        want = jnp.uint8 if fmt == "e2m1" else jnp.float8_e4m3fn
        if x.ndim != 2 or x.dtype != want:
            return f"{name}: expected a 2-D {jnp.dtype(want).name} array for {fmt}, got {x.dtype}{list(x.shape)}"
    ka, kb = _k_of(a, a_format), _k_of(b, b_format)
    if ka != kb:
        return f"a holds K={ka} elements a row and b K={kb}"
    if ka % BLOCK:
        return f"K={ka} is not a multiple of the MX block of {BLOCK}"
    for name, s, x in (("a_scale", a_scale, a), ("b_scale", b_scale, b)):
        want = (x.shape[0], ka // BLOCK)
        if s.dtype != jnp.uint8 or tuple(s.shape) != want:
            return f"{name}: expected uint8{list(want)} (e8m0, one per {BLOCK} elements of K), got {s.dtype}{list(s.shape)}"
    return None


def decode(x, scale, fmt: str):
    """MX operand [R, K(/2)] with its e8m0 scales [R, K/32] -> float32 [R, K] (the codecs of
    ``dsv41_jax.quant``: nibbles low first, e2m1 and e8m0 values)."""
    v = e2m1_decode(unpack_nibbles(x)) if fmt == "e2m1" else x.astype(jnp.float32)
    return (v.reshape(x.shape[0], -1, BLOCK) * e8m0_decode(scale)[:, :, None]).reshape(v.shape)


def decode_host(x, scale, fmt: str):
    """:func:`decode` in float64 numpy on the host, by table (``codecs.E2M1_LUT16`` by code, e8m0 as
    2**(s - 127)), independent of XLA on any device: the probe's and the tests' exact
    reference."""
    import numpy as np

    x = np.asarray(x)
    if fmt == "e2m1":
        table = E2M1_LUT16.astype(np.float64)  # exact: every e2m1 value is a float32
        v = np.stack([table[x & 15], table[x >> 4]], axis=-1).reshape(x.shape[0], -1)
    else:
        v = x.astype(np.float64)
    s = np.exp2(np.asarray(scale, np.float64) - 127)
    return (v.reshape(v.shape[0], -1, BLOCK) * s[:, :, None]).reshape(v.shape)


def reference(a, a_scale, b, b_scale, acc=None, *, a_format: str, b_format: str):
    """float32 [M, N]: the operands decoded (:func:`decode`) and one float32 dot, plus ``acc``."""
    d = jnp.dot(decode(a, a_scale, a_format), decode(b, b_scale, b_format).T,
                precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return d if acc is None else acc + d


mx_dot_p = Primitive("dsv41_mx_dot")


@mx_dot_p.def_abstract_eval
def _abstract(a, a_scale, b, b_scale, acc, *, a_format, b_format):
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


mx_dot_p.def_impl(functools.partial(jax._src.dispatch.apply_primitive, mx_dot_p))  # noqa: SLF001
mlir.register_lowering(mx_dot_p, mlir.lower_fun(reference, multiple_results=False))


def mx_dot(a, a_scale, b, b_scale, *, a_format: str = "e2m1", b_format: str = "e2m1", acc=None):
    """float32 [M, N] = dq(a) @ dq(b).T (+ ``acc``, float32 [M, N]) for MX operands (module docstring);
    one ``tt.dot_scaled`` inside a Pallas-Triton kernel (``acc`` its accumulator operand: the sum is
    the instruction's own, no separate add), :func:`reference` elsewhere. Raises ValueError naming the
    operand for shapes or dtypes it cannot take."""
    reason = unsupported_reason(a, a_scale, b, b_scale, a_format, b_format)
    if reason is None and acc is not None and (acc.dtype != jnp.float32 or acc.shape != (a.shape[0], b.shape[0])):
        reason = f"acc: expected float32{[a.shape[0], b.shape[0]]}, got {acc.dtype}{list(acc.shape)}"
    if reason is not None:
        raise ValueError(f"mx_dot: {reason}")
    if acc is None:
        acc = jnp.zeros((a.shape[0], b.shape[0]), jnp.float32)
    return mx_dot_p.bind(a, a_scale, b, b_scale, acc, a_format=a_format, b_format=b_format)


def _triton_rule(ctx, a, a_scale, b, b_scale, acc, *, a_format, b_format):
    """``tt.dot_scaled(a, b^T, acc)`` with both scales: a [M, K(/2)] and b^T [K(/2), N], packed along K."""
    from jax._src.lib.mlir import ir  # noqa: PLC2701
    from jax._src.lib.triton import dialect as tt_dialect  # noqa: PLC2701

    elem = {"e2m1": tt_dialect.ScaleDotElemType.E2M1, "e4m3": tt_dialect.ScaleDotElemType.E4M3}
    [out_aval] = ctx.avals_out
    acc_type = ir.RankedTensorType.get(list(out_aval.shape), ir.F32Type.get())
    b_t = tt_dialect.trans(b, (1, 0))
    return tt_dialect.dot_scaled(acc_type, a, b_t, acc, elem[a_format], elem[b_format], False,
                                 a_scale=a_scale, b_scale=b_scale,
                                 lhs_k_pack=True if a_format == "e2m1" else None,
                                 rhs_k_pack=True if b_format == "e2m1" else None)


def _register_triton_rule() -> bool:
    try:
        from jax._src.pallas.triton import lowering as tl  # noqa: PLC2701
    except ImportError:  # no Pallas-Triton in this JAX: interpret mode and XLA still take the reference
        return False
    tl.triton_lowering_rules[mx_dot_p] = _triton_rule
    return True


TRITON_RULE = _register_triton_rule()
