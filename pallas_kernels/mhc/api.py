"""Dispatch for mHC. The model calls these functions only."""

from __future__ import annotations

from typing import NamedTuple

from pallas_kernels import dispatch

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


# ------------------------------------------------------------------------------------------------
# a delayed (V4.1) site as two calls around the layer: hc_site_in before it, hc_site_out after it


class SiteMixes(NamedTuple):
    """This site's mixes, computed in hc_site_in (reference path, or sizes the two-kernel site
    does not take)."""
    pre: object
    post: object
    comb: object


class SitePartials(NamedTuple):
    """Split-K partials of this site's mixes (the two-kernel path); hc_site_out splits them."""
    pa: object
    pb: object
    ps: object


def hc_site_in(h, pre_prev, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters, implementation=None):
    """The start of a delayed mHC site (V4.1): ``y = hc_collapse(h, pre_prev)`` (the previous site's
    pre) and this site's mixes of ``h``. Returns (y [..., D], state) for :func:`hc_site_out`.
    Decode sizes on a GPU: one kernel for both (``hc_site_in``), the mixes left as split-K partials."""
    kernel, interpret = dispatch.choose("hc_site", implementation, _kernel, lambda k: k.unsupported_reason(h, fn),
                                        lambda k: k.auto_reason("hc_site"))
    if kernel is not None and kernel.site_reason(h, fn) is None:
        y, parts = dispatch.call_kernel(kernel.hc_site_in, h, pre_prev, fn, interpret=interpret)
        return y, SitePartials(*parts)
    # the reference, or sizes the two-kernel site does not take (> 8 rows): the three separate ops
    mixes = SiteMixes(*hc_mixes(h, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
                                implementation=implementation))
    return hc_collapse(h, pre_prev, implementation=implementation), mixes


def hc_site_out(f, residual, state, scale, base, *, norm_eps, hc_eps, sinkhorn_iters, implementation=None):
    """The end of the site: ``hc_expand(f, residual, post, comb)`` with this site's (pre, post,
    comb). Returns (h [..., hc, D], pre [..., hc], comb [..., hc, hc])."""
    if isinstance(state, SitePartials):  # hc_site_in ran the kernel: split + expand in one kernel
        kernel = _kernel()
        interpret = dispatch.resolve(implementation, "hc_site") == "interpret"
        return dispatch.call_kernel(kernel.hc_site_out, f, residual, tuple(state), scale, base, norm_eps=norm_eps,
                                    hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, interpret=interpret)
    return hc_expand(f, residual, state.post, state.comb, implementation=implementation), state.pre, state.comb
