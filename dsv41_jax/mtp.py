"""V4's MTP block ("MTP-1", ``shared/spec/model.md`` §7): one extra full V4 block (layer id
``n_layers + k``, sliding window only, ordinary biased top-k MoE) that predicts the token after next.

For main-model position t it consumes the main model's final streams ``h_t`` (after the last layer,
**before** ``hc_head``: ``forward_step(..., return_aux=True)`` returns them as ``aux["hidden"]``) and
the next token ``x_{t+1}`` (EAGLE / V3 convention):

    e = enorm(embed[x_{t+1}]);  hh = hnorm(h_t) per stream
    X = e_proj(e) broadcast over streams + h_proj(hh)
    X = Block_{n_layers + k}(X)                      # V4 mHC sites, attention, MoE
    logits = head(norm_mtp(hc_head_mtp(X)))          # shared embed and head, own norm and hc_head

The block keeps its own window cache (:func:`dsv41_jax.cache.init_mtp_cache`) and its own ``pos``:
it runs one token behind the main model (token t+1 is known only once sampled), so an engine
prefills it over the prompt shifted by one, like the main model, chunk by chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import linear, norm
from .options import RunOptions
from .transformer import block, hc_head, lm_logits



def mtp_input(p, embed, hidden, next_tokens, cfg: ModelConfig, dtype):
    """The MTP block's input streams [B,S,hc,D] from ``hidden`` [B,S,hc,D] and ``next_tokens`` [B,S]."""
    e = jnp.take(embed, next_tokens, axis=0).astype(dtype)
    e = norm(e, p["enorm"], cfg.norm_eps)
    hh = norm(hidden.astype(dtype), p["hnorm"], cfg.norm_eps)
    act = cfg.fp8_block_size
    return linear(e, p["e_proj"], act_block=act)[:, :, None, :] + linear(hh, p["h_proj"], act_block=act)


def mtp_forward(params, mtp_cache, hidden, next_tokens, lengths, *, cfg: ModelConfig, opts: RunOptions, k: int = 0,
                logits_mode: str = "all", return_aux: bool = False):
    """Run MTP block ``k`` over a chunk: ``hidden`` [B,S,hc,D] (main streams of positions
    ``mtp_cache["pos"] + s``), ``next_tokens`` [B,S] (the token after each of those positions);
    the first ``lengths[b]`` of row b are real. Returns (logits f32 [B,S,V] or [B,V], new mtp cache[, aux])."""
    if not cfg.has_mtp:
        raise ValueError(f"config {cfg.name!r} has no V4 MTP blocks")
    dtype = opts.compute_dtype

    p = params["mtp"][str(k)]
    l = cfg.n_layers + k
    pos0 = mtp_cache["pos"]
    lengths = lengths.astype(jnp.int32)
    h = mtp_input(p, params["embed"]["weight"], hidden, next_tokens, cfg, dtype)
    aux = {"input": h} if return_aux else None
    h, _, layers, _, _ = block(p, h, None, l, cfg, opts, dict(mtp_cache["layers"]), pos0, lengths, {}, None,
                               tokens=next_tokens)
    y = hc_head(h, p["hc_head_fn"], p["hc_head_scale"], p["hc_head_base"], cfg)
    logits = lm_logits(y, p["norm"], params["head"], lengths, cfg, logits_mode)
    new_cache = {"pos": pos0 + lengths, "layers": layers}
    if return_aux:
        aux["output"] = h
        return logits, new_cache, aux
    return logits, new_cache


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "k", "logits_mode", "return_aux"),
                   donate_argnames=("mtp_cache",))
def mtp_forward_jit(params, mtp_cache, hidden, next_tokens, lengths, *, cfg, opts, k=0, logits_mode="all",
                    return_aux=False):
    return mtp_forward(params, mtp_cache, hidden, next_tokens, lengths, cfg=cfg, opts=opts, k=k,
                       logits_mode=logits_mode, return_aux=return_aux)
