"""y = x @ W.T for FP8 (e4m3 + e8m0 32x32 blocks), MXFP4 and plain weights, with DeepSeek's
activation fake-quant before quantized weights."""

from .api import quantized_matmul

__all__ = ["quantized_matmul"]
