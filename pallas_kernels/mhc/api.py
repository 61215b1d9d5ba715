"""Dispatch for mHC. The model calls these functions only."""

from __future__ import annotations

from pallas_kernels import dispatch
from pallas_kernels.deferred_sum import materialize

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def hc_mixes(x, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters, implementation=None):
    """x [..., hc, D] -> (pre [..., hc], post [..., hc], comb [..., hc, hc]) all f32."""
    kernel, interpret = dispatch.choose("hc_mixes", implementation, _kernel, lambda k: k.unsupported_reason(x, fn),
                                        lambda k: k.auto_reason("hc_mixes"))
    if kernel is not None:
        return dispatch.call_kernel(kernel.hc_mixes, x, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps,
                                    sinkhorn_iters=sinkhorn_iters, interpret=interpret)
    return reference.hc_mixes(x, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def hc_collapse(x, pre, *, implementation=None):
    kernel, interpret = dispatch.choose("hc_collapse", implementation, _kernel, lambda k: k.collapse_reason(x, pre),
                                        lambda k: k.auto_reason("hc_collapse"))
    if kernel is not None:
        return dispatch.call_kernel(kernel.hc_collapse, x, pre, interpret=interpret)
    return reference.hc_collapse(x, pre)


def hc_expand(f, residual, post, comb, *, implementation=None):
    kernel, interpret = dispatch.choose("hc_expand", implementation, _kernel,
                                        lambda k: k.expand_reason(f, residual, post, comb),
                                        lambda k: k.auto_reason("hc_expand"))
    if kernel is not None:
        return dispatch.call_kernel(kernel.hc_expand, f, residual, post, comb, interpret=interpret)
    return reference.hc_expand(f, residual, post, comb)


def hc_expand_collapse(f, residual, post, comb, pre, *, implementation=None):
    """(hc_expand(f, residual, post, comb), hc_collapse(that, pre)) -- one kernel on a GPU."""
    kernel, interpret = dispatch.choose("hc_expand_collapse", implementation, _kernel,
                                        lambda k: k.expand_collapse_reason(f, residual, post, comb, pre),
                                        lambda k: k.auto_reason("hc_expand_collapse"))
    if kernel is not None:
        return dispatch.call_kernel(kernel.hc_expand_collapse, f, residual, post, comb, pre, interpret=interpret)
    return reference.hc_expand_collapse(f, residual, post, comb, pre)


def hc_expand_collapse_mixes(f, residual, post, comb, pre, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters,
                             y_norm=None, implementation=None):
    """(h, y, (pre', post', comb')): :func:`hc_expand_collapse` and the next site's
    :func:`hc_mixes` of h. At decode sizes one op on a GPU (two kernels instead of four); where
    that kernel cannot run (prefill sizes), the two ops, each dispatched on its own.
    ``y_norm = (weight, eps)``: y comes back RMS-normalized (the next site's input norm; on a GPU at
    decode sizes inside the same two kernels, else :func:`reference.rms_norm` after the collapse).
    ``f`` may be a :class:`~pallas_kernels.deferred_sum.DeferredSum` (a layer output not yet summed):
    the kernel sums it on its own columns; every other path materializes it first."""
    kernel, interpret = dispatch.choose("hc_expand_collapse_mixes", implementation, _kernel,
                                        lambda k: k.expand_mix_reason(f, residual, post, comb, pre, fn, y_norm),
                                        lambda k: k.auto_reason("hc_expand_collapse_mixes"))
    kw = dict(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    if kernel is not None:
        w, eps = y_norm if y_norm is not None else (None, 0.0)
        return dispatch.call_kernel(kernel.hc_expand_collapse_mixes, f, residual, post, comb, pre, fn, scale, base, w,
                                    y_norm_eps=float(eps), interpret=interpret, **kw)
    f = materialize(f)
    h, y = hc_expand_collapse(f, residual, post, comb, pre, implementation=implementation)
    if y_norm is not None:
        y = reference.rms_norm(y, *y_norm)
    return h, y, hc_mixes(h, fn, scale, base, implementation=implementation, **kw)
