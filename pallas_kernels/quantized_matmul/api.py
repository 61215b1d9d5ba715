"""Dispatch for the weight GEMMs. The model calls :func:`quantized_matmul` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def _gated(implementation) -> bool:
    """True when the choice came from plain 'auto' (no argument, context or env var)."""
    return implementation is None and dispatch.default_implementation() == "auto"


def quantized_matmul(x, w, *, act_block=32, out_dtype=None, implementation=None):
    """y = x @ W.T. x [..., K]; w an Fp8Tensor [N, K], Fp4Tensor [N, K] (packed [N, K/2]) or a plain
    [N, K] array. Quantized weights get DeepSeek's FP8 activation fake-quant per ``act_block``."""
    impl = dispatch.resolve(implementation)
    if impl != "reference":
        try:
            from . import pallas_triton
        except ImportError:
            pallas_triton = None
        if pallas_triton is not None:
            reason = pallas_triton.unsupported_reason(x, w, act_block=act_block)
            if reason is None and _gated(implementation):
                reason = pallas_triton.auto_reason(x, w)  # 'auto' only: paths not yet checked on a GPU
            if reason is None:
                return pallas_triton.quantized_matmul(x, w, act_block=act_block, out_dtype=out_dtype,
                                                      interpret=impl == "interpret")
            if implementation is not None:
                raise ValueError(f"quantized_matmul: Pallas kernel cannot run this shape: {reason}")
        elif implementation is not None:
            raise ValueError("quantized_matmul: no Pallas implementation is available")
    return reference.quantized_matmul(x, w, act_block=act_block, out_dtype=out_dtype)
