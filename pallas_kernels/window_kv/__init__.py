"""The decode-time window KV write: RMSNorm, RoPE, FP8 quantization of one token per row, and its
store into the window ring."""

from .api import window_kv_write

__all__ = ["window_kv_write"]
