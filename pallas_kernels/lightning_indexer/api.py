"""Dispatch for the lightning indexer. The model calls these functions only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference

# The Pallas kernel is correct on the H200 but measured slower than the XLA reference
# (BENCHMARKS.md, "Pallas kernels I"), so "auto" keeps the reference until it is faster.
AUTO_PALLAS = False
from .reference import IndexerResult, select_candidate_blocks

__all__ = ["IndexerResult", "lightning_indexer", "select_candidate_blocks"]


def lightning_indexer(q, weights, keys, visible, *, top_k, candidate_blocks=None, block_size=8,
                      want_block_scores=False, implementation=None) -> IndexerResult:
    """q [B,S,HI,DI] float or Fp4Tensor (MXFP4); weights [B,S,HI] f32 (already scaled); keys
    [B,Nc,DI] float or Fp4Tensor; visible [B,S] int32 (entries j < visible are causally visible);
    candidate_blocks optional [B,S,ceil(Nc/block_size)] bool. Returns IndexerResult(topk [B,S,top_k]
    int32 ascending -1 padded, block_scores [B,S,NB] f32 or None)."""
    impl = dispatch.resolve(implementation, auto_pallas=AUTO_PALLAS)
    if impl != "reference":
        try:
            from . import pallas_triton
        except ImportError:
            pallas_triton = None
        if pallas_triton is not None:
            reason = pallas_triton.unsupported_reason(q, weights, keys, visible, top_k=top_k,
                                                      candidate_blocks=candidate_blocks, block_size=block_size)
            if reason is None:
                return pallas_triton.lightning_indexer(
                    q, weights, keys, visible, top_k=top_k, candidate_blocks=candidate_blocks,
                    block_size=block_size, want_block_scores=want_block_scores, interpret=impl == "interpret",
                )
            if implementation is not None:
                raise ValueError(f"lightning_indexer: Pallas kernel cannot run this shape: {reason}")
        elif implementation is not None:
            raise ValueError("lightning_indexer: no Pallas implementation is available")
    return reference.lightning_indexer(q, weights, keys, visible, top_k=top_k, candidate_blocks=candidate_blocks,
                                       block_size=block_size, want_block_scores=want_block_scores)
