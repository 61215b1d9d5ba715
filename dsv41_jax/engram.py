"""Engram conditional memory applied to the residual streams (``shared/spec/model.md`` §9.2).

The hash row ids come from :mod:`dsv41_jax.engram_hash` (host side, int64 numpy; they depend on
token ids only). The table rows are FP8 e4m3 with one e8m0 scale per 32 channels; they may be
gathered on the device from the parameter tree (:func:`gather_rows`) or on the host from a
memory-mapped table and passed in already gathered (same numbers either way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layers import linear
from .quant import Fp8Tensor

_HI = jax.lax.Precision.HIGHEST


def gather_rows(table: Fp8Tensor, ids) -> Fp8Tensor:
    """Rows ``ids`` [...] of an Engram table (device arrays or host numpy) -> Fp8Tensor [..., hd]."""
    if isinstance(table.data, np.ndarray):
        return Fp8Tensor(data=table.data[np.asarray(ids)], scale=table.scale[np.asarray(ids)], block=table.block)
    return Fp8Tensor(data=jnp.take(table.data, ids, axis=0), scale=jnp.take(table.scale, ids, axis=0), block=table.block)


def engram(p, h, rows: Fp8Tensor, cfg: ModelConfig, *, return_gate: bool = False):
    """h [B,S,hc,D] residual streams; rows: the gathered table rows [B,S,n_cols,head_dim]."""
    B, S, hc, D = h.shape
    dtype = h.dtype
    e = rows.dequantize(jnp.float32).astype(jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32).astype(dtype)
    kv = linear(e.reshape(B, S, -1), p["wkv"], act_block=cfg.fp8_block_size)
    key = kv[..., : hc * D].astype(jnp.float32).reshape(B, S, hc, D)
    value = kv[..., hc * D :].astype(jnp.float32)
    wqk = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    hf = h.astype(jnp.float32)
    eps = cfg.norm_eps
    rstd = jax.lax.rsqrt(jnp.mean(hf * hf, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(hf * wqk * key, -1) * rstd * D ** -0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    out = (hf + gate[..., None] * value[:, :, None, :]).astype(dtype)
    return (out, gate) if return_gate else out
