"""Token sampling for the engine: greedy, temperature, top-k and top-p, all in fp32 and jit-able.

Reproducibility: the random key of a sampled token is derived from ``(seed, request index, step)``
only (``fold_in(fold_in(PRNGKey(seed), request), step)``), never from the batch slot or the batch
size, so a request produces the same tokens whether it runs alone, in a batch, or in whichever slot
continuous batching gives it.

Sampling is Gumbel-max over the filtered, temperature-scaled logits (the same distribution as
DeepSeek's ``generate.py``, ``argmax(softmax(logits / T) / Exp(1))``); ``temperature == 0`` is greedy
argmax (no filtering, no randomness). Ties in top-k keep every token equal to the k-th largest logit.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sharding.rules import auto_axes, context_mesh


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 = greedy; ``top_p`` in (0, 1] (1 = off); ``top_k`` >= 0 (0 = off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or not (t >= 0.0) or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r} (flag --temperature)")
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r} (flag --top-p)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r} (flag --top-k)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2^31), got {self.seed!r} (flag --seed)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def static_key(self, vocab_size: int) -> tuple[bool, bool, bool]:
        """(greedy, use_top_k, use_top_p): a specialised sampler's compile-time shape (the engine
        uses the traced :func:`sample_traced` instead: one program for greedy, one for every sampled
        setting)."""
        if self.greedy:
            return (True, False, False)
        return (False, 0 < self.top_k < vocab_size, self.top_p < 1.0)


def request_keys(seed, request_ids, steps):
    """[B] raw PRNG keys (uint32 [B, 2]) from (seed, request index [B], step [B])."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(base, r), s))(
        request_ids.astype(jnp.uint32), steps.astype(jnp.uint32))


def _whole_rows(x):
    """``x`` [B, V] with every row whole on each device of the context mesh (its rows may still be
    split over a manual ``dp``): no-op without a mesh. A cumulative sum over a vocabulary split
    over ``tp`` is partitioned into XLA's O(V^2) reduce-window (on 8 virtual CPU devices ~10 s of
    CPU per sampled step at V = 129280, against ~0.01 s for whole rows, where XLA rewrites the
    reduce-window into a scan); whole rows also sum in the single-device order."""
    m = context_mesh()
    if m is None or not auto_axes(m):  # no mesh, or a shard_map manual over every axis: rows are whole
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def draft_pick(logits, keys, temperature, index: int):
    """A drafter's token [B] from logits [B, V]: argmax when ``keys`` is None, else Gumbel-max from
    ``softmax(logits / T)`` with key ``fold_in(keys[b], index)`` (the draft distribution the
    sampled acceptance rule divides by). ``temperature``: a scalar or [B]."""
    if keys is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (logits.shape[0],))
    g = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, index), logits.shape[1:], jnp.float32))(keys)
    return jnp.argmax(logits / t[:, None] + g, axis=-1).astype(jnp.int32)


def filter_logits(logits, top_k, top_p, *, use_top_k: bool, use_top_p: bool):
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus. logits [B, V] f32
    (already temperature-scaled); top_k, top_p: scalars or [B]."""
    if not (use_top_k or use_top_p):
        return logits
    B, V = logits.shape
    srt = -jnp.sort(-logits, axis=-1)  # descending
    keep_min = jnp.full((B,), -jnp.inf, logits.dtype)
    if use_top_k:
        k = jnp.clip(jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,)), 1, V)
        keep_min = jnp.maximum(keep_min, jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)[:, 0])
        srt = jnp.where(srt >= keep_min[:, None], srt, -jnp.inf)
    if use_top_p:
        p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,))
        probs = _whole_rows(jax.nn.softmax(srt, axis=-1))
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
        keep = (before < p[:, None]) | (p[:, None] >= 1.0)
        keep = keep.at[:, 0].set(True)
        # smallest kept logit: the last kept in descending order
        n_keep = jnp.sum(keep, axis=-1)
        thr = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)[:, 0]
        keep_min = jnp.maximum(keep_min, thr)
    return jnp.where(logits >= keep_min[:, None], logits, -jnp.inf)


def sample(logits, keys, temperature, top_k, top_p, *, greedy: bool, use_top_k: bool, use_top_p: bool):
    """Next tokens int32 [B] from logits [B, V] (cast to fp32). ``keys``: uint32 [B, 2]."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:1])
    scaled = logits / t[:, None]
    scaled = filter_logits(scaled, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p)
    g = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:], jnp.float32))(keys)
    return jnp.argmax(scaled + g, axis=-1).astype(jnp.int32)


def sample_traced(logits, keys, temperature, top_k, top_p, greedy: bool | None = None):
    """:func:`sample` with every setting traced (one compiled program for greedy and any
    temperature / top-k / top-p): greedy when ``temperature <= 0``; top-k off when ``top_k <= 0``;
    top-p off when ``top_p >= 1``. The sort and the noise run only on the sampling branch.

    ``greedy`` (static) picks the branch at trace time instead: True -> argmax, False -> the
    sampling branch (``temperature`` must then be > 0). The engine passes it: a ``lax.cond`` on a
    traced predicate makes the GPU runtime read the predicate on the host in the middle of the
    step, which stalls the dispatch of the next step (``temperature``'s value still comes traced,
    so one sampled program serves every temperature)."""
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]

    def greedy_(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-30)
        scaled = logits / t
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
        f = filter_logits(scaled, k, jnp.asarray(top_p, jnp.float32), use_top_k=True, use_top_p=True)
        g = jax.vmap(lambda kk: jax.random.gumbel(kk, (V,), jnp.float32))(keys)
        return jnp.argmax(f + g, axis=-1).astype(jnp.int32)

    if greedy is True:
        return greedy_(None)
    if greedy is False:
        return sampled(None)
    return jax.lax.cond(temperature <= 0, greedy_, sampled, None)
