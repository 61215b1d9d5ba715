"""Dispatch for sparse attention. The model calls :func:`sparse_attention` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def _unsupported(k, q, kv, kv_idx, comp_kv, comp_idx, running_max_block):
    if running_max_block is not None:
        return (f"running_max_block={running_max_block} (DeepSeek's kernel-block rounding) is emulated by the "
                "reference only; the Pallas kernel's running maximum follows its own key blocks and splits")
    return k.unsupported_reason(q, kv, kv_idx, comp_kv, comp_idx)


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, running_max_block=None,
                     implementation=None):
    """q [B,S,H,D] (bf16 or f32); kv: window keys (=values) [B,Nw,D] in q.dtype or an Fp8Tensor
    (data e4m3 [B,Nw,D], scale e8m0 [B,Nw,D//32], block (1,32)); kv_idx [B,S,Kw] int32, -1 = empty;
    comp_kv: compressed cache [B,Nc,D] plain or Fp4Tensor (packed [B,Nc,D//2], e4m3 scale per 16);
    comp_idx [B,S,Kc] int32 into comp_kv, -1 = empty; sink [H] f32. Returns [B,S,H,D] in q.dtype.
    A query with no valid key returns 0. ``running_max_block``: see ``reference.sparse_attention``
    (``RunOptions.running_max_block``)."""
    kernel, interpret = dispatch.choose(
        "sparse_attention", implementation, _kernel,
        lambda k: _unsupported(k, q, kv, kv_idx, comp_kv, comp_idx, running_max_block),
        lambda k: k.auto_reason(q, kv, comp_kv))
    if kernel is not None:
        return dispatch.call_kernel(
            lambda q, kv, kv_idx, sink, comp_kv, comp_idx: kernel.sparse_attention(
                q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx, interpret=interpret),
            q, kv, kv_idx, sink, comp_kv, comp_idx)
    return reference.sparse_attention(q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx,
                                      running_max_block=running_max_block)
