"""Dispatch for mHC. The model calls these functions only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def _pallas(implementation):
    impl = dispatch.resolve(implementation)
    if impl == "reference":
        return None, impl
    try:
        from . import pallas_triton
    except ImportError:
        if implementation is not None:
            raise ValueError("mhc: no Pallas implementation is available") from None
        return None, impl
    return pallas_triton, impl


def _gated(implementation) -> bool:
    """True when the choice came from plain 'auto' (no argument, context or env var)."""
    return implementation is None and dispatch.default_implementation() == "auto"


def hc_mixes(x, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters, implementation=None):
    """x [..., hc, D] -> (pre [..., hc], post [..., hc], comb [..., hc, hc]) all f32."""
    kernel, impl = _pallas(implementation)
    if kernel is not None:
        reason = kernel.unsupported_reason(x, fn)
        if reason is None and _gated(implementation):
            reason = kernel.auto_reason("hc_mixes")
        if reason is None:
            return kernel.hc_mixes(x, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps,
                                   sinkhorn_iters=sinkhorn_iters, interpret=impl == "interpret")
        if implementation is not None:
            raise ValueError(f"hc_mixes: Pallas kernel cannot run this shape: {reason}")
    return reference.hc_mixes(x, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def hc_collapse(x, pre, *, implementation=None):
    kernel, impl = _pallas(implementation)
    if kernel is not None:
        reason = kernel.collapse_reason(x, pre)
        if reason is None and _gated(implementation):
            reason = kernel.auto_reason("hc_collapse")
        if reason is None:
            return kernel.hc_collapse(x, pre, interpret=impl == "interpret")
        if implementation is not None:
            raise ValueError(f"hc_collapse: Pallas kernel cannot run this shape: {reason}")
    return reference.hc_collapse(x, pre)


def hc_expand(f, residual, post, comb, *, implementation=None):
    kernel, impl = _pallas(implementation)
    if kernel is not None:
        reason = kernel.expand_reason(f, residual, post, comb)
        if reason is None and _gated(implementation):
            reason = kernel.auto_reason("hc_expand")
        if reason is None:
            return kernel.hc_expand(f, residual, post, comb, interpret=impl == "interpret")
        if implementation is not None:
            raise ValueError(f"hc_expand: Pallas kernel cannot run this shape: {reason}")
    return reference.hc_expand(f, residual, post, comb)
