"""y = x @ W.T for FP8 (e4m3 + e8m0 32x32 blocks for V4.1, 128x128 for V4), MXFP4 and plain weights,
with DeepSeek's activation fake-quant (per 32 / 128) before quantized weights."""

from .api import grouped_matmul, quantized_matmul, quantized_matmul_multi, uses_kernel

__all__ = ["grouped_matmul", "quantized_matmul", "quantized_matmul_multi", "uses_kernel"]
