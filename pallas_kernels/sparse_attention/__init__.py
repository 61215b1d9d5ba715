"""Sparse MQA with an attention sink over a window of FP8 KV plus index-selected FP4 compressed KV."""

from .api import sparse_attention

__all__ = ["sparse_attention"]
