"""The user-facing model object: a config, its parameters, the Engram hasher, and a jit-compiled
full-sequence forward.

    from dsv41_jax import Model
    m = Model.from_preset("tiny", seed=0)                 # random weights in the real formats
    m = Model.from_checkpoint("/path/to/DeepSeek-V4.1-Flash")
    logits = m.forward(token_ids)                          # [B, S, vocab] float32, from position 0
    logits = m.forward(token_ids, dtype="float32", kv_cache_dtype="float32")

``dtype`` is the compute dtype (``bfloat16`` default, or ``float32``); ``kv_cache_dtype`` is
``reference`` (DeepSeek's FP8/FP4 rounding of window KV, compressed KV and indexer q/k; default) or
``bfloat16`` / ``float32`` (unquantized). The batched engine (caches, decode) builds on the same
:func:`dsv41_jax.transformer.forward_step`.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from .cache import init_cache
from .config import ModelConfig, get_preset
from .engram import gather_rows
from .options import RunOptions
from .params import init_params
from .transformer import forward_step_jit


class Model:
    def __init__(self, cfg: ModelConfig, params: dict, *, tokenizer=None, token_map=None):
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self._token_map = token_map
        self._hasher = None

    # ---------------------------------------------------------------------------- construction
    @classmethod
    def from_preset(cls, name: str = "tiny", seed: int = 0, *, tokenizer=None, token_map=None) -> "Model":
        cfg = get_preset(name)
        return cls(cfg, init_params(cfg, seed), tokenizer=tokenizer, token_map=token_map)

    @classmethod
    def from_checkpoint(cls, path: str, *, tokenizer: str | None = None, mesh=None, **kw) -> "Model":
        from .checkpoint import load_checkpoint
        from .tokenizer import load_tokenizer

        cfg, params = load_checkpoint(path, mesh=mesh, **kw)
        tok = load_tokenizer(tokenizer, checkpoint_dir=path)
        return cls(cfg, params, tokenizer=tok)

    # ---------------------------------------------------------------------------- Engram
    @property
    def hasher(self):
        if self._hasher is None and self.cfg.engram_layer_ids:
            from .engram_hash import EngramHasher

            tok = self.tokenizer
            if tok is None and self._token_map is None:
                from .tokenizer import load_tokenizer

                tok = self.tokenizer = load_tokenizer()
            self._hasher = EngramHasher.from_config(self.cfg, tokenizer=tok, token_map=self._token_map)
        return self._hasher

    def engram_ids(self, history: np.ndarray, positions: np.ndarray) -> dict:
        """{str(layer): int32 [B, S, n_cols]} row ids of the Engram tables for ``positions`` [B,S]
        given each sequence's token ``history`` [B, T] from position 0."""
        if not self.cfg.engram_layer_ids:
            return {}
        ids = self.hasher(np.asarray(history), np.asarray(positions))  # [B,S,L,cols] int64
        return {str(l): jnp.asarray(ids[:, :, i].astype(np.int32)) for i, l in enumerate(self.cfg.engram_layer_ids)}

    def _split_host_tables(self, ids: dict):
        """Engram tables held on the host (numpy / memmap, as the checkpoint loader leaves them) are
        not passed into the jitted step (they would be copied to the device on every call): their
        rows are gathered here and passed instead. Returns (params for the step, rows or None)."""
        tables = {str(l): self.params["layers"][str(l)]["engram"]["embed"] for l in self.cfg.engram_layer_ids}
        if not tables or not any(isinstance(t.data, np.ndarray) for t in tables.values()):
            return self.params, None
        rows = {k: jax.device_put(gather_rows(t, np.asarray(ids[k]))) for k, t in tables.items()}
        layers = dict(self.params["layers"])
        for k in tables:
            layers[k] = {**layers[k], "engram": {**layers[k]["engram"], "embed": None}}
        return {**self.params, "layers": layers}, rows

    # ---------------------------------------------------------------------------- forward
    def forward(self, tokens, *, dtype: str = "bfloat16", kv_cache_dtype: str = "reference",
                return_aux: bool = False, hadamard: bool = True):
        """Full-sequence forward from position 0: logits [B, S, vocab] float32 for every position.
        ``hadamard`` (V4 only): ``False`` is the Hugging Face comparison mode (no indexer rotation)."""
        opts = RunOptions(dtype=dtype, kv_cache_dtype=kv_cache_dtype, hadamard=hadamard)
        toks = np.asarray(tokens)
        if toks.ndim == 1:
            toks = toks[None]
        if toks.ndim != 2 or toks.shape[1] == 0:
            raise ValueError(f"tokens must be [batch, seq] with seq > 0, got shape {toks.shape}")
        if toks.min() < 0 or toks.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}), got [{toks.min()}, {toks.max()}]")
        B, S = toks.shape
        cap = max(S, self.cfg.window_size)
        cap += -cap % max(self.cfg.compress_ratios)
        cache = init_cache(self.cfg, B, cap, opts)
        positions = np.broadcast_to(np.arange(S), (B, S))
        ids = self.engram_ids(toks, positions)
        params, rows = self._split_host_tables(ids)
        out = forward_step_jit(params, cache, jnp.asarray(toks, jnp.int32), jnp.full((B,), S, jnp.int32),
                               None if rows else ids, rows, cfg=self.cfg, opts=opts, return_aux=return_aux)
        if return_aux:
            return out[0], out[2]
        return out[0]
