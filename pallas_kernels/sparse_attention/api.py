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


def _blocks(block, kw: int, has_comp: bool, window_width):
    """The kernel configuration that walks the lists in DeepSeek's blocks (``block`` keys, one split:
    the kernel's loop is then DeepSeek's), or {} without a rounding block; and the window width the
    kernel shifts its blocks by and masks the window list at (None: neither) -- ``window_width``, or a
    ``kw``-key window list that the kernel pads when a compressed list follows it."""
    if block is None:
        return {}, None
    if window_width is None and has_comp and kw % block:
        window_width = kw
    return dict(block_k=block, num_splits=1), window_width


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, running_max_block=None,
                     window_width=None, implementation=None):
    """q [B,S,H,D] (bf16 or f32); kv: window keys (=values) [B,Nw,D] in q.dtype or an Fp8Tensor
    (data e4m3 [B,Nw,D], scale e8m0 [B,Nw,D//32], block (1,32)); kv_idx [B,S,Kw] int32, -1 = empty;
    comp_kv: compressed cache [B,Nc,D] plain or Fp4Tensor (packed [B,Nc,D//2], e4m3 scale per 16);
    comp_idx [B,S,Kc] int32 into comp_kv, -1 = empty; sink [H] f32. Returns [B,S,H,D] in q.dtype.
    A query with no valid key returns 0. ``running_max_block``: see ``reference.sparse_attention``
    (``RunOptions.running_max_block``); the Pallas kernel then runs with blocks of that many keys and
    one split, its own online softmax being DeepSeek's loop (checked in interpret mode against a
    transcription of that loop, tests/pallas_kernels/test_sparse_attention.py). ``window_width`` (int
    or int32 [B]; None = all Kw): DeepSeek's window list is that many leading entries of row b's (its
    prefill list is ``min(L, window)`` wide for an L-token prompt); the entries after them are ignored,
    and under ``running_max_block`` the blocks run over DeepSeek's concatenated list."""
    block = _rounding_block(q, running_max_block)
    kw = kv_idx.shape[-1]
    has_comp = comp_kv is not None and comp_idx is not None and comp_idx.shape[-1] > 0
    if window_width is not None:
        window_width = jnp.broadcast_to(jnp.asarray(window_width, jnp.int32), (q.shape[0],))
        if block is None:  # without blocks the width only masks: here, once, for either implementation
            kv_idx = jnp.where(jnp.arange(kw, dtype=jnp.int32)[None, None, :] < window_width[:, None, None],
                               kv_idx, -1)
            window_width = None
    kernel, interpret = dispatch.choose(
        "sparse_attention", implementation, _kernel,
        lambda k: k.unsupported_reason(q, kv, kv_idx, comp_kv, comp_idx),
        lambda k: k.auto_reason(q, kv, comp_kv, block, kv_idx=kv_idx, comp_idx=comp_idx))
    if kernel is not None:
        cfg, width = _blocks(block, kw, has_comp, window_width)
        extra = () if width is None else (jnp.broadcast_to(jnp.asarray(width, jnp.int32), (q.shape[0],)),)
        return dispatch.call_kernel(
            lambda q, kv, kv_idx, sink, comp_kv, comp_idx, *width: kernel.sparse_attention(
                q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx, interpret=interpret,
                window_width=width[0] if width else None, **cfg),
            q, kv, kv_idx, sink, comp_kv, comp_idx, *extra)
    return reference.sparse_attention(q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx,
                                      running_max_block=running_max_block, window_width=window_width)
