"""Dispatch for the routed experts. The model calls :func:`moe_experts` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def moe_experts(x, weights, indices, w1, w2, w3, *, swiglu_limit, act_block=32, implementation=None, defer=False,
                routed_experts=None):
    """x [N,D]; weights [N,k] f32; indices [N,k] int32; w1/w3 [E,I,D], w2 [E,D,I] stacked (Fp4Tensor,
    Fp8Tensor or plain). Returns sum over slots of the weighted expert outputs, [N,D] f32. The shared
    expert is not included. ``act_block``: the activation fake-quant block (32 V4.1, 128 V4).
    ``defer``: where the kernels run, the sum may come back unsummed as their slot rows (a
    :class:`~pallas_kernels.deferred_sum.DeferredSum`; ``materialize`` gives the same value).
    ``routed_experts``: where ``w1`` is one expert-parallel shard and the other shards' pairs come as
    index -1, the number of experts over all shards (the kernels' rows-per-expert estimate; the
    value does not change the result)."""
    kernel, interpret = dispatch.choose(
        "moe_experts", implementation, _kernel,
        lambda k: k.unsupported_reason(x, weights, indices, w1, w2, w3, act_block),
        lambda k: k.auto_reason(w1, act_block))
    if kernel is not None:
        hint = {} if routed_experts is None else {"routed_experts": routed_experts}  # only where set: a kernel
        # that replaces this one need not know the hint
        return dispatch.call_kernel(kernel.moe_experts, x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit,
                                    act_block=act_block, interpret=interpret, defer=defer, **hint)
    return reference.moe_experts(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit, act_block=act_block)
