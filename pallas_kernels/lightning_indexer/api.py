"""Dispatch for the lightning indexer. The model calls these functions only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference
from .reference import IndexerResult, select_candidate_blocks


def _kernel():
    from . import pallas_triton

    return pallas_triton

__all__ = ["IndexerResult", "lightning_indexer", "select_candidate_blocks"]


def lightning_indexer(q, weights, keys, visible, *, top_k, candidate_blocks=None, block_size=8,
                      want_block_scores=False, implementation=None) -> IndexerResult:
    """q [B,S,HI,DI] float or Fp4Tensor (MXFP4); weights [B,S,HI] f32 (already scaled); keys
    [B,Nc,DI] float or Fp4Tensor; visible [B,S] int32 (entries j < visible are causally visible);
    candidate_blocks optional [B,S,ceil(Nc/block_size)] bool. Returns IndexerResult(topk [B,S,top_k]
    int32 ascending -1 padded, block_scores [B,S,NB] f32 or None)."""
    kernel, interpret = dispatch.choose(
        "lightning_indexer", implementation, _kernel,
        lambda k: k.unsupported_reason(q, weights, keys, visible, top_k=top_k, candidate_blocks=candidate_blocks,
                                       block_size=block_size),
        lambda k: k.auto_reason(q, keys))
    if kernel is not None:
        return dispatch.call_kernel(
            lambda q, w, k, v, c: kernel.lightning_indexer(q, w, k, v, top_k=top_k, candidate_blocks=c,
                                                           block_size=block_size,
                                                           want_block_scores=want_block_scores, interpret=interpret),
            q, weights, keys, visible, candidate_blocks)
    return reference.lightning_indexer(q, weights, keys, visible, top_k=top_k, candidate_blocks=candidate_blocks,
                                       block_size=block_size, want_block_scores=want_block_scores)
