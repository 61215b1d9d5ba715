"""Dispatch for the routed experts. The model calls :func:`moe_experts` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def moe_experts(x, weights, indices, w1, w2, w3, *, swiglu_limit, act_block=32, implementation=None):
    """x [N,D]; weights [N,k] f32; indices [N,k] int32; w1/w3 [E,I,D], w2 [E,D,I] stacked (Fp4Tensor,
    Fp8Tensor or plain). Returns sum over slots of the weighted expert outputs, [N,D] f32. The shared
    expert is not included."""
    impl = dispatch.resolve(implementation)
    if impl != "reference":
        try:
            from . import pallas_triton
        except ImportError:
            pallas_triton = None
        if pallas_triton is not None:
            reason = pallas_triton.unsupported_reason(x, weights, indices, w1, w2, w3)
            if reason is None and implementation is None and dispatch.default_implementation() == "auto":
                reason = pallas_triton.auto_reason()  # 'auto' only: not yet checked on a GPU
            if reason is None:
                return pallas_triton.moe_experts(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit,
                                                 act_block=act_block, interpret=impl == "interpret")
            if implementation is not None:
                raise ValueError(f"moe_experts: Pallas kernel cannot run this shape: {reason}")
        elif implementation is not None:
            raise ValueError("moe_experts: no Pallas implementation is available")
    return reference.moe_experts(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit, act_block=act_block)
