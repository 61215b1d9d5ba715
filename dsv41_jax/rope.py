"""Rotary embedding of DeepSeek-V4/V4.1 (``shared/spec/attention.md`` §2.2).

Interleaved pairs (GPT-J style: ``x[2i] + j x[2i+1]``) on the **last** ``rope_head_dim`` dims of a
vector, frequencies ``base**(-2i/R)``; YaRN (no mscale) only when ``original_seq_len > 0``, which the
model uses for layers with a compress ratio > 0 (base ``compress_rope_theta``); ratio-0 layers (SWA
only, DSpark) use ``rope_theta`` without YaRN. Angles are ``float32(position) * float32(freq)``
exactly as the reference's table; the rotation runs in fp32 and casts back to the input dtype.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig


@lru_cache(maxsize=64)
def rope_frequencies(dim: int, base: float, original_seq_len: int, factor: float, beta_fast: int,
                     beta_slow: int) -> np.ndarray:
    """float32 [dim // 2] rotation frequencies (YaRN-corrected when original_seq_len > 0)."""
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    if original_seq_len > 0:
        def corrected_dim(rotations):
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(max(high - low, 1e-3)), 0, 1)
        smooth = (np.float32(1) - ramp).astype(np.float32)
        freqs = (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def layer_frequencies(cfg: ModelConfig, layer: int) -> np.ndarray:
    if cfg.ratio(layer) > 0:
        return rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                                cfg.beta_fast, cfg.beta_slow)
    return rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, 0, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)


def rope_angles(positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """positions [...] (int) -> angles [..., R/2] float32."""
    return positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)


def apply_rope(x: jax.Array, angles: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * angles.shape[-1]`` dims of ``x`` by ``angles``. ``angles`` broadcasts
    against ``x[..., :1]`` minus the last dim (e.g. [B,S,R/2] for x [B,S,H,D] gets a head axis)."""
    r = angles.shape[-1] * 2
    while angles.ndim < x.ndim:
        angles = angles[..., None, :]
    head, tail = x[..., :-r], x[..., -r:]
    t = tail.astype(jnp.float32).reshape(*tail.shape[:-1], r // 2, 2)
    c, s = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        s = -s
    a, b = t[..., 0], t[..., 1]
    rot = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rot.astype(x.dtype)], axis=-1)
