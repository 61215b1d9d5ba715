"""Dispatch for sparse attention. The model calls :func:`sparse_attention` only."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import dispatch

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def _rounding_block(q, running_max_block):
    """``running_max_block`` where the P.V weights are rounded (bf16 q), else None: f32 results do
    not depend on the blocks."""
    return None if q.dtype == jnp.float32 else running_max_block


def _blocks(block):
    """The kernel configuration that walks the lists in DeepSeek's blocks (``block`` keys, one split:
    the kernel's loop is then DeepSeek's), or {} without a rounding block."""
    return {} if block is None else dict(block_k=block, num_splits=1)


def _unsupported(k, q, kv, kv_idx, comp_kv, comp_idx, block):
    kw = kv_idx.shape[-1]
    has_comp = comp_idx is not None and comp_idx.shape[-1] > 0
    if block is not None and has_comp and kw % block:
        return (f"running_max_block={block} with a {kw}-key window list: the kernel starts the "
                "compressed list on a block of its own, which is DeepSeek's block of the concatenated list "
                f"only when the window list is a multiple of {block} keys")
    return k.unsupported_reason(q, kv, kv_idx, comp_kv, comp_idx)


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, running_max_block=None,
                     implementation=None):
    """q [B,S,H,D] (bf16 or f32); kv: window keys (=values) [B,Nw,D] in q.dtype or an Fp8Tensor
    (data e4m3 [B,Nw,D], scale e8m0 [B,Nw,D//32], block (1,32)); kv_idx [B,S,Kw] int32, -1 = empty;
    comp_kv: compressed cache [B,Nc,D] plain or Fp4Tensor (packed [B,Nc,D//2], e4m3 scale per 16);
    comp_idx [B,S,Kc] int32 into comp_kv, -1 = empty; sink [H] f32. Returns [B,S,H,D] in q.dtype.
    A query with no valid key returns 0. ``running_max_block``: see ``reference.sparse_attention``
    (``RunOptions.running_max_block``); the Pallas kernel then runs with blocks of that many keys and
    one split, its own online softmax being DeepSeek's loop (checked in interpret mode against a
    transcription of that loop, tests/pallas_kernels/test_sparse_attention.py)."""
    block = _rounding_block(q, running_max_block)
    kernel, interpret = dispatch.choose(
        "sparse_attention", implementation, _kernel,
        lambda k: _unsupported(k, q, kv, kv_idx, comp_kv, comp_idx, block),
        lambda k: k.auto_reason(q, kv, comp_kv, block))
    if kernel is not None:
        blocks = _blocks(block)
        return dispatch.call_kernel(
            lambda q, kv, kv_idx, sink, comp_kv, comp_idx: kernel.sparse_attention(
                q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx, interpret=interpret, **blocks),
            q, kv, kv_idx, sink, comp_kv, comp_idx)
    return reference.sparse_attention(q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx,
                                      running_max_block=running_max_block)
