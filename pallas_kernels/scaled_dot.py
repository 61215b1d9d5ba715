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

from dsv41_jax.quant.codecs import e2m1_decode, e8m0_decode, unpack_nibbles

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
    where every kernel keeps its decode route (the MX dot there is the float32 reference)."""
    return not interpret and (MX_DOT == "on" or (MX_DOT == "auto" and has_mx_dot()))


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
