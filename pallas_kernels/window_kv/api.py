"""Dispatch for the decode-time window KV write. The model calls :func:`window_kv_write` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def window_kv_write(kv_lat, norm_weight, angles, ring, slot, *, eps: float, implementation=None):
    """One token per row: RMSNorm, RoPE, FP8 (1, 32) quantization, stored into ring slot ``slot``
    (>= W: the row is idle and its ring unchanged) -> the new ring; see :mod:`.reference`."""
    kernel, interpret = dispatch.choose("window_kv_write", implementation, _kernel,
                                        lambda k: k.unsupported_reason(kv_lat, norm_weight, angles, ring, slot),
                                        lambda k: k.auto_reason(kv_lat))
    if kernel is not None:
        return dispatch.call_kernel(lambda *a: kernel.window_kv_write(*a, eps=eps, interpret=interpret),
                                    kv_lat, norm_weight, angles, ring, slot)
    return reference.window_kv_write(kv_lat, norm_weight, angles, ring, slot, eps=eps)
