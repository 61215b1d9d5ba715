"""V4's MTP block as the drafter of speculative decoding (MTP-1: one draft per verify step).

The MTP block (:mod:`dsv41_jax.mtp`) at main-model position t reads the main model's final streams
``h_t`` and the token ``x_{t+1}`` and predicts ``x_{t+2}``. So after a verify step has committed
positions ``P .. P+n_acc`` (the anchor and the accepted drafts) and sampled the next token, the
block runs over exactly those positions, each with the token after it (the accepted drafts, then
the new token), and its prediction at the last one is the draft that follows the new token. It only
ever sees committed positions: its cache needs no rollback, and its ``pos`` stays one token behind
the main model's (the block needs ``x_{t+1}``, known only once sampled).

* Prompt chunks: the block runs over the chunk's positions with the prompt's next tokens (known on
  the host), except the prompt's last position, whose next token is the first sampled one: that
  position runs with the first token (:meth:`.drafters.MTPDrafter.first_draft`), and its streams are kept
  until then.
* Draft: greedy ``argmax``; sampled, Gumbel-max from ``softmax(logits / T)`` with the key
  ``fold_in(draft key, 0)``, the distribution the acceptance rule divides by (the logits are
  returned untempered, as the DSpark drafter's).
* Confidence (for ``policy="confidence"``): the block has no confidence head, so the draft's
  log-odds under ``softmax(logits)``, ``log p - log(1 - p)``, stand in for it.

Returns match :func:`dsv41_jax.dspark.dspark_draft`: ids [B, 2] (column 0 the anchor), draft
logits [B, 1, V] f32, confidence [B, 1] f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .mtp import mtp_forward
from .options import RunOptions
from .sampling import draft_pick
from .transformer import last_rows


def mtp_draft(params, mcache, hidden, next_tokens, lengths, keys=None, temperature=None, *, cfg: ModelConfig,
              opts: RunOptions):
    """Run the MTP block over the first ``lengths[b]`` positions of ``hidden`` [B, S, hc, D] (the main
    model's final streams of the positions at ``mcache["pos"] + s``) with ``next_tokens`` [B, S] (the
    token after each), then draft the token after each row's last next token (the anchor).
    Rows with ``lengths`` 0 keep their cache (their outputs are meaningless).
    Returns (mcache, ids [B, 2], draft logits [B, 1, V], confidence [B, 1])."""
    logits, mcache = mtp_forward(params, mcache, hidden, next_tokens, lengths, cfg=cfg, opts=opts,
                                 logits_mode="last")
    anchor = last_rows(next_tokens.astype(jnp.int32), lengths)
    draft = draft_pick(logits, keys, temperature, 0)
    lp = jax.nn.log_softmax(logits, axis=-1)
    lpd = jnp.take_along_axis(lp, draft[:, None], axis=1)  # [B, 1]
    conf = lpd - jnp.log1p(-jnp.minimum(jnp.exp(lpd), 1.0 - 1e-7))
    return mcache, jnp.stack([anchor, draft], 1), logits[:, None, :], conf


def prompt_update(params, mcache, hidden, next_tokens, lengths, *, cfg: ModelConfig, opts: RunOptions):
    """A prompt chunk into the MTP block's cache (its logits are not needed)."""
    _, mcache = mtp_forward(params, mcache, hidden, next_tokens, lengths, cfg=cfg, opts=opts, logits_mode="last")
    return mcache


def last_streams(hidden, lengths, prev):
    """Each row's streams at its last real chunk position [B, hc, D] (``prev`` where ``lengths`` is 0)."""
    return jnp.where((lengths > 0)[:, None, None], last_rows(hidden, lengths).astype(prev.dtype), prev)
