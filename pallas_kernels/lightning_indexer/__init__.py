"""The lightning indexer: FP4 scores sum_h w_h ReLU(q_h . k_j), masks, top-k, candidate blocks."""

from .api import IndexerResult, lightning_indexer, select_candidate_blocks

__all__ = ["IndexerResult", "lightning_indexer", "select_candidate_blocks"]
