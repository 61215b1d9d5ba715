"""Dispatch for sparse attention. The model calls :func:`sparse_attention` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from . import reference

# The Pallas kernel is correct on the H200 but measured slower than the XLA reference
# (BENCHMARKS.md, "Pallas kernels I"), so "auto" keeps the reference until it is faster.
AUTO_PALLAS = False


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, implementation=None):
    """q [B,S,H,D] (bf16 or f32); kv: window keys (=values) [B,Nw,D] in q.dtype or an Fp8Tensor
    (data e4m3 [B,Nw,D], scale e8m0 [B,Nw,D//32], block (1,32)); kv_idx [B,S,Kw] int32, -1 = empty;
    comp_kv: compressed cache [B,Nc,D] plain or Fp4Tensor (packed [B,Nc,D//2], e4m3 scale per 16);
    comp_idx [B,S,Kc] int32 into comp_kv, -1 = empty; sink [H] f32. Returns [B,S,H,D] in q.dtype.
    A query with no valid key returns 0."""
    impl = dispatch.resolve(implementation, auto_pallas=AUTO_PALLAS)
    if impl != "reference":
        try:
            from . import pallas_triton
        except ImportError:
            pallas_triton = None
        if pallas_triton is not None:
            reason = pallas_triton.unsupported_reason(q, kv, kv_idx, comp_kv, comp_idx)
            if reason is None:
                return pallas_triton.sparse_attention(
                    q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx,
                    interpret=impl == "interpret",
                )
            if implementation is not None:
                raise ValueError(f"sparse_attention: Pallas kernel cannot run this shape: {reason}")
        elif implementation is not None:
            raise ValueError("sparse_attention: no Pallas implementation is available")
    return reference.sparse_attention(q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv, comp_idx=comp_idx)
