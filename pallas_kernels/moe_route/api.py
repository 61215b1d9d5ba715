"""Dispatch for the router's selection. The model calls :func:`route_select` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def route_select(z, bias, *, topk: int, score_func: str, gate_temp: float, norm_topk_prob: bool,
                 route_scale: float, implementation=None):
    """z [N, E] f32 router logits (before the temperature), bias [E] -> (weights [N, topk] f32,
    indices [N, topk] int32); see :mod:`.reference`."""
    kw = dict(topk=topk, score_func=score_func, gate_temp=gate_temp, norm_topk_prob=norm_topk_prob,
              route_scale=route_scale)
    kernel, interpret = dispatch.choose("moe_route", implementation, _kernel,
                                        lambda k: k.unsupported_reason(z, bias, topk, score_func),
                                        lambda k: k.auto_reason(z))
    if kernel is not None:
        return dispatch.call_kernel(lambda z, bias: kernel.route_select(z, bias, interpret=interpret, **kw), z, bias)
    return reference.route_select(z, bias, **kw)
