"""The drafters of speculative decoding, one object each: what :mod:`dsv41_jax.speculative` asks of
a drafter, in one place per drafter instead of a branch at every call site.

A drafter keeps a state (a pytree with batch-major leaves, reset per slot) beside the backbone cache
and is asked four things, each traced inside the speculative programs (the drafter object is a
static, hashable argument of those programs):

* :meth:`Drafter.after_prompt` -- a prompt chunk went through the backbone (``aux`` of
  :func:`dsv41_jax.transformer.forward_step`); ``next_tokens`` / ``next_lengths`` give the prompt's
  token after each chunk position (the host builds them only when :attr:`Drafter.needs_next_tokens`);
* :meth:`Drafter.first_draft` -- the rows in ``ready`` just sampled their first token ``nxt``:
  draft after it;
* :meth:`Drafter.after_verify` -- a verify step committed the anchor and ``n_acc`` drafts
  (``keep = n_acc + 1`` positions) and sampled ``nxt``: take the committed positions in, draft
  after ``nxt``;
* :meth:`Drafter.reset_row` -- a recycled slot's state back to its initial row.

Drafts come back as (ids [B, G + 1] with column 0 the anchor, draft logits [B, G, V] f32,
confidence logits [B, G] f32), G = :meth:`Drafter.width`.

* :class:`DSparkDrafter` (V4.1): the DSpark stages' rings take the committed positions' features
  (:func:`dsv41_jax.dspark.dspark_update`), then draft ``dspark_block_size`` tokens.
* :class:`MTPDrafter` (V4): MTP-1 (:mod:`dsv41_jax.mtp_draft`). Its state is the MTP block's cache
  (``"block"``) and each row's main-model streams at its last prompt position (``"hlast"``), kept
  until the first token is sampled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import jax.numpy as jnp

from .cache import init_mtp_cache, reset_row
from .config import ModelConfig
from .dspark import dspark_draft, dspark_update, init_dspark_cache
from .mtp_draft import last_streams, mtp_draft, prompt_update
from .options import RunOptions

__all__ = ["Drafter", "DSparkDrafter", "MTPDrafter", "DRAFTERS", "choose_drafter", "get_drafter"]


@dataclass(frozen=True)
class Drafter(ABC):
    """The interface (see the module docstring); an abstract base, not instantiable. Subclasses are
    field-less frozen dataclasses, so equal drafters hash equal and a jitted program is compiled
    once per drafter kind."""
    name = "?"
    needs_next_tokens = False  # after_prompt reads the prompt's next tokens

    @abstractmethod
    def has(self, cfg: ModelConfig, params) -> bool:
        """Whether the model (config + parameters) carries this drafter."""

    @abstractmethod
    def missing(self) -> str:
        """What a model lacks when :meth:`has` is False (for the error message)."""

    @abstractmethod
    def width(self, cfg: ModelConfig) -> int:
        """Drafts per step (gamma)."""

    @abstractmethod
    def init_state(self, cfg: ModelConfig, batch: int, max_seq_len: int, opts: RunOptions) -> dict:
        """The initial state of ``batch`` rows."""

    def reset_row(self, state, slot, *, cfg: ModelConfig, opts: RunOptions, max_seq_len: int) -> dict:
        return reset_row(state, self.init_state(cfg, 1, max_seq_len, opts), slot)

    @abstractmethod
    def after_prompt(self, params, state, aux, lengths, next_tokens, next_lengths, *, cfg, opts):
        """The state after a prompt chunk."""

    @abstractmethod
    def first_draft(self, params, state, nxt, ready, keys, temperature, *, cfg, opts):
        """(state, ids, draft logits, confidence) after the first sampled token ``nxt``."""

    @abstractmethod
    def after_verify(self, params, state, aux, tokens, n_acc, nxt, keep, keys, temperature, *, cfg, opts):
        """(state, ids, draft logits, confidence) after a verify step."""


@dataclass(frozen=True)
class DSparkDrafter(Drafter):
    """V4.1's DSpark stages (``mtp.*`` with ``dspark_block_size``): a block of drafts per step."""
    name = "dspark"

    def has(self, cfg, params):
        return bool(cfg.n_mtp_layers and cfg.dspark_block_size and "mtp" in params)

    def missing(self):
        return "DSpark stages (mtp.* with dspark_block_size)"

    def width(self, cfg):
        return cfg.dspark_block_size

    def init_state(self, cfg, batch, max_seq_len, opts):
        return init_dspark_cache(cfg, batch, opts)

    def after_prompt(self, params, state, aux, lengths, next_tokens, next_lengths, *, cfg, opts):
        return dspark_update(params, state, aux["features"], lengths, cfg=cfg, opts=opts)

    def first_draft(self, params, state, nxt, ready, keys, temperature, *, cfg, opts):
        # the rings already hold the whole prompt: nothing to add before drafting (rows not ready
        # draft too; the host ignores them)
        return (state, *dspark_draft(params, state, nxt, keys, temperature, cfg=cfg, opts=opts))

    def after_verify(self, params, state, aux, tokens, n_acc, nxt, keep, keys, temperature, *, cfg, opts):
        state = dspark_update(params, state, aux["features"], keep, cfg=cfg, opts=opts)
        return (state, *dspark_draft(params, state, nxt, keys, temperature, cfg=cfg, opts=opts))


@dataclass(frozen=True)
class MTPDrafter(Drafter):
    """V4's MTP block, one draft per step (MTP-1, :mod:`dsv41_jax.mtp_draft`)."""
    name = "mtp"
    needs_next_tokens = True

    def has(self, cfg, params):
        return bool(cfg.has_mtp and "mtp" in params)

    def missing(self):
        return "V4 MTP block (mtp.*)"

    def width(self, cfg):
        return 1

    def init_state(self, cfg, batch, max_seq_len, opts):
        return {"block": init_mtp_cache(cfg, batch, max_seq_len, opts),
                "hlast": jnp.zeros((batch, cfg.hc_mult, cfg.dim), opts.compute_dtype)}

    def after_prompt(self, params, state, aux, lengths, next_tokens, next_lengths, *, cfg, opts):
        """The chunk's positions with the prompt's next tokens into the block (``next_lengths``: a row
        whose prompt ends in this chunk runs one position fewer, whose next token is the first
        sampled one), and each row's streams at its last chunk position kept for :meth:`first_draft`."""
        block = prompt_update(params, state["block"], aux["hidden"], next_tokens, next_lengths, cfg=cfg, opts=opts)
        return {"block": block, "hlast": last_streams(aux["hidden"], lengths, state["hlast"])}

    def first_draft(self, params, state, nxt, ready, keys, temperature, *, cfg, opts):
        """The block over each ready row's last prompt position with its first token; other rows keep
        their block cache."""
        block, ids, dl, conf = mtp_draft(params, state["block"], state["hlast"][:, None], nxt[:, None],
                                         ready.astype(jnp.int32), keys, temperature, cfg=cfg, opts=opts)
        return {"block": block, "hlast": state["hlast"]}, ids, dl, conf

    def after_verify(self, params, state, aux, tokens, n_acc, nxt, keep, keys, temperature, *, cfg, opts):
        """The committed positions, each with the token after it (the accepted drafts, then ``nxt``)."""
        S = tokens.shape[1]
        after = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        after = jnp.where(jnp.arange(S)[None, :] == n_acc[:, None], nxt[:, None], after).astype(jnp.int32)
        block, ids, dl, conf = mtp_draft(params, state["block"], aux["hidden"], after, keep, keys, temperature,
                                         cfg=cfg, opts=opts)
        return {"block": block, "hlast": state["hlast"]}, ids, dl, conf


DRAFTERS = {d.name: d for d in (DSparkDrafter(), MTPDrafter())}  # "auto" tries them in this order


def get_drafter(name: str) -> Drafter:
    if name not in DRAFTERS:
        raise ValueError(f"drafter must be auto, {' or '.join(DRAFTERS)}, got {name!r}")
    return DRAFTERS[name]


def choose_drafter(cfg: ModelConfig, params, drafter: str = "auto") -> str:
    """The name of the drafter a model speculates with: ``dspark`` (V4.1's DSpark stages) or ``mtp``
    (V4's MTP block); ``auto`` takes the one the model has. Raises ValueError naming what is missing."""
    if drafter == "auto":
        for d in DRAFTERS.values():
            if d.has(cfg, params):
                return d.name
        raise ValueError(f"config {cfg.name!r} has no drafter: neither DSpark stages nor a V4 MTP block (mtp.*)")
    d = get_drafter(drafter)
    if not d.has(cfg, params):
        raise ValueError(f"the model has no {d.missing()}: drafter {drafter!r} cannot run on config {cfg.name!r}")
    return d.name
