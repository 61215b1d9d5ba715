"""Run-time numerics switches (static under jit)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
KV_CACHE_DTYPES = ("reference", "bfloat16", "float32")


@dataclass(frozen=True)
class RunOptions:
    """``dtype``: compute dtype of activations (``bfloat16``, the reference's, or ``float32``).

    ``kv_cache_dtype``: ``reference`` stores the window KV as FP8 e4m3 (ue8m0 scale per 32, RoPE dims
    included), the compressed KV as FP4 with an e4m3 scale per 16 and the index keys as MXFP4, and
    fake-quantizes the indexer queries to MXFP4 — exactly the rounding DeepSeek's code applies;
    ``bfloat16`` / ``float32`` store them unquantized (no KV / indexer rounding at all)."""

    dtype: str = "bfloat16"
    kv_cache_dtype: str = "reference"
    # V4 only: the Hadamard rotation of the indexer q and k (DeepSeek's reference, the default).
    # ``False`` is the HF comparison mode: transformers' ``deepseek_v4`` leaves the rotation out
    # (with unquantized index keys the rotation changes only float rounding: H is orthonormal).
    hadamard: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r} (flag --dtype)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r} "
                "(flag --kv-cache-dtype)"
            )

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def quantized_kv(self) -> bool:
        return self.kv_cache_dtype == "reference"

    @property
    def kv_dtype(self):
        """Storage dtype of unquantized caches."""
        return DTYPES.get(self.kv_cache_dtype, jnp.float32)
