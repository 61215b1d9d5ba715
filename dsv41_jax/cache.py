"""Inference caches of V4.1-Flash as an explicit pytree (donated into the jitted steps).

``cache["pos"]`` [B] int32: tokens already processed per sequence (= position of the next token).
``cache["layers"][str(l)]`` for every backbone layer:

* ``window``: the sliding-window ring, W slots, token at position p in slot ``p % W``. In
  ``reference`` mode an :class:`Fp8Tensor` (e4m3 + e8m0 scale per 32 over all ``head_dim`` dims,
  RoPE dims included); otherwise a plain array.
* KV-source layers only (``kv_source_layers``; every other compressed layer reads its source's):
  ``comp`` – the shared compressed KV, ``max_seq_len // ratio`` entries (FP4 e2m1 packed, e4m3 scale
  per 16 in ``reference`` mode); ``index_k`` – the lightning indexer's keys (MXFP4 packed);
  ratio > 1: ``state_kv`` / ``state_score`` fp32 ``[B, ratio, head_dim]``, the partial block (a
  compressed entry becomes visible only when its block is complete).

V4 (``cfg.is_v4``): every compressed layer has its own ``comp`` (``max_seq_len // ratio`` entries)
and ``state_kv`` / ``state_score`` (``[B, lead + ratio, coff * head_dim]``, ``lead = coff = 2`` rows of
the previous complete block for the overlapping ratio-4 compressor); ratio-4 (CSA) layers also have
``index_k`` and ``index_state_kv`` / ``index_state_score`` for the indexer's own compressor. All are
plain arrays (``reference`` mode stores DeepSeek's rounded values in the compute dtype, as its V4
code does). The MTP blocks have their own cache (:func:`init_mtp_cache`: a window ring per block and
their own ``pos``, since an MTP step at position t needs token t+1 and so runs one token behind).

Per-step transient state (top-k lists, the layer-20 candidate blocks) is recomputed each step, as
in the reference. The Engram n-gram history is the token history the engine keeps per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .options import RunOptions
from .quant import Fp4Tensor, Fp8Tensor


def _one_scale(shape, dtype):
    if dtype == jnp.float8_e8m0fnu:
        return jax.lax.bitcast_convert_type(jnp.full(shape, 127, jnp.uint8), jnp.float8_e8m0fnu)
    return jnp.ones(shape, dtype)


def fp8_rows(shape):
    return Fp8Tensor(data=jnp.zeros(shape, jnp.float8_e4m3fn), scale=_one_scale((*shape[:-1], shape[-1] // 32), jnp.float8_e8m0fnu),
                     block=(1, 32))


def fp4_rows(shape, block, scale_dtype):
    return Fp4Tensor(data=jnp.zeros((*shape[:-1], shape[-1] // 2), jnp.uint8),
                     scale=_one_scale((*shape[:-1], shape[-1] // block), scale_dtype), block=block)


def init_cache(cfg: ModelConfig, batch: int, max_seq_len: int, opts: RunOptions) -> dict:
    """Empty caches for ``batch`` sequences of up to ``max_seq_len`` tokens."""
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    q = opts.quantized_kv
    dh, di, w = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    if cfg.is_v4:
        return {"pos": jnp.zeros((batch,), jnp.int32), "layers": _v4_layers(cfg, batch, max_seq_len, opts)}
    layers = {}
    for l in range(cfg.n_layers):
        c = {"window": fp8_rows((batch, w, dh)) if q else jnp.zeros((batch, w, dh), opts.kv_dtype)}
        if l in cfg.kv_source_layers:
            m = cfg.ratio(l)
            n = max_seq_len // m
            c["comp"] = fp4_rows((batch, n, dh), 16, jnp.float8_e4m3fn) if q else jnp.zeros((batch, n, dh), opts.kv_dtype)
            c["index_k"] = fp4_rows((batch, n, di), 32, jnp.float8_e8m0fnu) if q else jnp.zeros((batch, n, di), opts.kv_dtype)
            if m > 1:
                c["state_kv"] = jnp.zeros((batch, m, dh), jnp.float32)
                c["state_score"] = jnp.full((batch, m, dh), -jnp.inf, jnp.float32)
        layers[str(l)] = c
    return {"pos": jnp.zeros((batch,), jnp.int32), "layers": layers}


def _v4_layers(cfg: ModelConfig, batch: int, max_seq_len: int, opts: RunOptions) -> dict:
    dt = opts.compute_dtype if opts.quantized_kv else opts.kv_dtype
    dh, di, w = cfg.head_dim, cfg.index_head_dim, cfg.window_size

    def state(c, rows, width):
        c[f"{rows[0]}_kv"] = jnp.zeros((batch, rows[1], width), jnp.float32)
        c[f"{rows[0]}_score"] = jnp.full((batch, rows[1], width), -jnp.inf, jnp.float32)

    layers = {}
    for l in range(cfg.n_layers):
        c = {"window": jnp.zeros((batch, w, dh), dt)}
        m = cfg.ratio(l)
        if m > 0:
            coff = 2 if cfg.overlap(l) else 1
            c["comp"] = jnp.zeros((batch, max_seq_len // m, dh), dt)
            state(c, ("state", (coff - 1) * m + m), coff * dh)
            if cfg.overlap(l):
                c["index_k"] = jnp.zeros((batch, max_seq_len // m, di), dt)
                state(c, ("index_state", 2 * m), 2 * di)
        layers[str(l)] = c
    return layers


def init_mtp_cache(cfg: ModelConfig, batch: int, max_seq_len: int, opts: RunOptions) -> dict:
    """V4 MTP blocks' caches: ``{"pos": [B], "layers": {str(n_layers + k): {"window": ring}}}`` (the
    MTP blocks are sliding-window-only layers, ratio 0)."""
    if not cfg.has_mtp:
        raise ValueError(f"config {cfg.name!r} has no V4 MTP blocks")
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    dt = opts.compute_dtype if opts.quantized_kv else opts.kv_dtype
    layers = {str(cfg.n_layers + k): {"window": jnp.zeros((batch, cfg.window_size, cfg.head_dim), dt)}
              for k in range(cfg.n_mtp_layers)}
    return {"pos": jnp.zeros((batch,), jnp.int32), "layers": layers}


def reset_row(tree, fresh, slot):
    """``tree`` with batch row ``slot`` (traced int32) replaced by the one row of ``fresh``, a batch-1
    tree of the same structure (e.g. ``init_cache(cfg, 1, ...)``: zeros, unit scales, -inf scores,
    ``pos`` 0). Pure; the one row-reset used by every slot-recycling cache (backbone, DSpark)."""

    def put(a, f):
        return jax.lax.dynamic_update_index_in_dim(a, f.astype(a.dtype), slot, axis=0)

    return jax.tree.map(put, tree, fresh)


def cache_capacity(cache: dict, cfg: ModelConfig) -> int:
    """The max_seq_len a cache was made for (from a KV source's compressed capacity)."""
    for l in cfg.kv_source_layers:
        c = cache["layers"][str(l)]["comp"]
        n = (c.data.shape[1] if isinstance(c, Fp4Tensor) else c.shape[1])
        return n * cfg.ratio(l)
    raise ValueError("config has no KV source layer")


def global_kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Bytes of global (compressed + index-key) cache per token in ``reference`` storage:
    per source of ratio m, (head_dim/2 + head_dim/16 + index_head_dim/2 + index_head_dim/32) / m.
    V4.1-Flash: 3 x (288 + 68) / 2 + (288 + 68) = 890 B/token.
    V4 (rounded values held as bf16, as DeepSeek's V4 code and our V4 cache do): per compressed
    layer 2 * head_dim / m, plus 2 * index_head_dim / 4 per CSA layer (V4-Flash: 6880 B/token)."""
    if cfg.is_v4:
        return float(sum(2 * cfg.head_dim / cfg.ratio(l) for l in cfg.kv_source_layers)
                     + sum(2 * cfg.index_head_dim / cfg.ratio(l) for l in cfg.index_source_layers))
    per_entry = cfg.head_dim // 2 + cfg.head_dim // 16 + cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    return float(sum(per_entry / cfg.ratio(l) for l in cfg.kv_source_layers))


def window_bytes_per_sequence(cfg: ModelConfig) -> int:
    """The sliding-window rings of all backbone layers, per sequence (FP8 + e8m0 per 32)."""
    return cfg.n_layers * cfg.window_size * (cfg.head_dim + cfg.head_dim // 32)


def tree_bytes(tree) -> int:
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree)))
