"""Speculative decoding (DSpark, or V4's MTP block): verification on the target, lossless acceptance, cache rollback,
confidence scheduling, and a batch generator (``shared/spec/model.md`` §8.3, ``attention.md`` §10).

One device program per step (:func:`spec_step`, jitted per verify width ``S = 1 + k``):

1. **Verify.** Row b feeds ``[anchor, d_1 .. d_k]`` (``k = n_verify[b] <= gamma``) at positions
   ``P .. P+k`` through :func:`dsv41_jax.transformer.forward_step` (a variable-length multi-token
   decode; ``lengths = 1 + n_verify``), logits for every position.
2. **Accept** (:func:`accept`). Greedy: ``d_{j+1}`` is accepted while it equals the target's argmax
   at chunk index j. Sampled: accept with ``min(1, p(d)/q(d))`` (p: the target's temperature /
   top-k / top-p distribution, exactly the one the non-speculative sampler uses; q: the draft's
   ``softmax(logits / T)``); at the first rejection sample from ``normalize(max(0, p - q))``; if all k
   are accepted sample a bonus token from p at index k. ``n_acc`` drafts are committed plus one new
   token; positions ``P .. P+n_acc`` (anchor + accepted drafts) stay in the caches.
3. **Roll back** (:func:`rollback`) every cache entry the rejected chunk tokens touched, so the cache
   equals what a non-speculative run over the same committed tokens leaves:

   * window rings: a slot written by a rejected token gets its previous content back (exact: each
     slot is written at most once per step as ``S <= window``);
   * compressed KV and index keys of every KV source: the entries ``j >= (P+1+n_acc) // m`` (the
     blocks not complete among the committed tokens) get their previous content back (never
     written before, i.e. the initial zeros) — these are invisible to every query anyway
     (``visible = (t+1)//m``), the restore just makes the pytree equal;
   * compressor partial-block state (ratio > 1): recomputed by :func:`dsv41_jax.attention.compress`
     from the old state and the committed chunk tokens (the attention inputs of the source layers are
     rebuilt from ``aux`` residuals, re-applying Engram where it sits before the layer);
   * lightning-indexer top-k lists and candidate blocks are per-step transients (nothing to undo);
   * Engram n-gram history: the host appends only committed tokens (:class:`SpeculativeGenerator`);
   * ``pos`` = ``P + 1 + n_acc``.
4. **Draft the next block**: the committed positions' features go into the DSpark rings
   (:func:`dsv41_jax.dspark.dspark_update`), then :func:`dsv41_jax.dspark.dspark_draft` from the new
   anchor. Drafts, draft logits and confidences come back with the acceptance results (one host sync
   per step: the host needs the drafts to hash the Engram ids of the next verify chunk).

Drafters (``drafter``, :func:`choose_drafter`; one object each in :mod:`dsv41_jax.drafters`, which
every program asks for its drafter's part): ``dspark`` as above (V4.1, gamma = the DSpark block
size), or ``mtp`` (V4): V4's MTP block drafts one token per step (:mod:`dsv41_jax.mtp_draft`).
Step 4 then runs the block over the committed positions ``P .. P+n_acc``, each with the token
after it, and drafts after the new token. The block sees committed positions only, so its cache
needs no rollback. Step 3 restores V4's caches too: each compressed layer's own KV entries and
partial-block state, and the CSA layers' index keys and the indexer compressor's state.

Scheduling (:class:`SpeculativeGenerator`, ``policy``): ``"all"`` verifies every draft (always
correct, the baseline); ``"confidence"`` (:func:`choose_width`) picks the width ``k`` maximizing the
expected committed tokens per second ``sum_b (1 + sum_{i<=k} a_{b,i}) / t(1+k)`` with ``a_{b,i} =
prod_{j<=i} sigmoid(conf_{b,j})`` (prefix survival, DSPARK Alg. 1) and ``t(S)`` the measured time of
a verify step of width S (:meth:`SpeculativeGenerator.calibrate`); ties go to the larger k, so with a
flat ``t`` (weight-bandwidth-bound steps) it verifies everything; ``"fixed:k"`` always verifies k.
One k for the whole batch: the step's cost depends on its width, and at a given width verifying
every draft a row has never lowers its expected yield.

Continuous batching (:meth:`SpeculativeGenerator.generate`): more prompts than slots; a finished
slot is reset (backbone row via :func:`dsv41_jax.engine.reset_slot`, the drafter's state via
:meth:`dsv41_jax.drafters.Drafter.reset_row`, its Engram history on the host) and takes the next prompt,
prefilled chunk by chunk between the other slots' verify steps. Random keys come from (seed, request
index, the request's own step), so a request's tokens do not depend on its slot or neighbours.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mhc import hc_collapse

from .attention import scatter_rows, select_rows, take_rows, compress
from .cache import init_cache
from .config import ModelConfig
from .drafters import DRAFTERS, Drafter, choose_drafter, get_drafter
from .engine import _copy_jit, reset_slot, stage_into
from .engram import engram, gather_rows
from .engram_hash import ngram_hash_ids
from .layers import norm
from .options import RunOptions
from .sampling import SamplingParams, filter_logits, request_keys
from .transformer import forward_step

# ---------------------------------------------------------------------------------------------
# acceptance
# ---------------------------------------------------------------------------------------------


def target_probs(logits, temperature, top_k, top_p, *, use_top_k: bool, use_top_p: bool):
    """The non-speculative sampler's distribution: softmax(filter(logits / T)). logits [..., V]."""
    shp = logits.shape
    lg = logits.reshape(-1, shp[-1]).astype(jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)
    lg = filter_logits(lg / t, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p)
    return jax.nn.softmax(lg, axis=-1).reshape(shp)


def _leading(acc):
    """Number of leading True along the last axis."""
    return jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _categorical(key, probs):
    """One sample from probs [V] (Gumbel-max on log p; zero-probability tokens are never drawn)."""
    g = jax.random.gumbel(key, probs.shape, jnp.float32)
    return jnp.argmax(jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)) + g, -jnp.inf)).astype(jnp.int32)


def accept(logits, drafts, n_verify, draft_logits=None, keys=None, temperature=1.0, top_k=0, top_p=1.0, *,
           greedy: bool, use_top_k: bool = False, use_top_p: bool = False):
    """Speculative acceptance. logits [B,S,V] (the target at the S chunk positions), drafts [B,S-1]
    (the proposed tokens for chunk positions 1..S-1), n_verify [B] (how many drafts each row put up;
    drafts at index >= n_verify are ignored), draft_logits [B,>=S-1,V] (sampled mode; q =
    softmax(draft_logits / T)), keys uint32 [B,2]. Returns (n_acc [B], next token [B])."""
    B, S, V = logits.shape
    j = jnp.arange(S - 1, dtype=jnp.int32)[None, :]
    live = j < n_verify[:, None]
    if greedy:
        tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,S]
        n_acc = _leading((tgt[:, : S - 1] == drafts) & live)
        return n_acc, jnp.take_along_axis(tgt, n_acc[:, None], axis=1)[:, 0]
    p = target_probs(logits, temperature, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p)
    q = jax.nn.softmax(draft_logits[:, : S - 1].astype(jnp.float32) / jnp.asarray(temperature, jnp.float32), -1)
    pd = jnp.take_along_axis(p[:, : S - 1], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0), (S - 1,), jnp.float32))(keys)
    n_acc = _leading((u * qd < pd) & live)
    p_n = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B,V]
    q_n = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], 1), n_acc[:, None, None],
                              axis=1)[:, 0]
    rejected = n_acc < n_verify
    resid = jnp.maximum(p_n - q_n, 0.0)
    ok = jnp.sum(resid, -1, keepdims=True) > 0
    dist = jnp.where(rejected[:, None] & ok, resid, p_n)
    nxt = jax.vmap(lambda k, d: _categorical(jax.random.fold_in(k, 1), d))(keys, dist)
    return n_acc, nxt


# ---------------------------------------------------------------------------------------------
# rollback
# ---------------------------------------------------------------------------------------------


def _layer_input(params, aux, tokens, l, cfg, opts, engram_ids, engram_rows):
    """The attention input (after attn_norm) of backbone layer l for the verify chunk."""
    p = params["layers"][str(l)]
    if l == 0:
        e = jnp.take(params["embed"]["weight"], tokens, axis=0).astype(opts.compute_dtype)
        h = jnp.broadcast_to(e[:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.dim))
    else:
        h = aux["resid"][l - 1]
    if l in cfg.engram_layer_ids:
        rows = engram_rows[str(l)] if engram_rows is not None else gather_rows(p["engram"]["embed"],
                                                                                 engram_ids[str(l)])
        h = engram(p["engram"], h, rows, cfg)
    pre = aux["attn_pre"][l] if cfg.is_v4 else aux["pre"][l]  # V4: the site's own pre; V4.1: the previous site's
    return norm(hc_collapse(h, pre), p["attn_norm"], cfg.norm_eps)


def rollback(params, old, new, aux, tokens, keep, lengths, engram_ids=None, engram_rows=None, *, cfg: ModelConfig,
             opts: RunOptions):
    """The cache a run over only the first ``keep[b]`` of the chunk's ``lengths[b]`` tokens leaves,
    from the cache before the chunk (``old``), after all of it (``new``) and ``aux`` of that step."""
    B, S = tokens.shape
    W = cfg.window_size
    assert S <= W, "a verify chunk must not wrap the window ring"
    pos0 = old["pos"]
    new_pos = pos0 + keep
    i = jnp.arange(S, dtype=jnp.int32)[None, :]
    rejected = (i >= keep[:, None]) & (i < lengths[:, None])  # [B,S]
    slot = jnp.mod(pos0[:, None] + i, W)
    ring_mask = jnp.any((slot[..., None] == jnp.arange(W)[None, None, :]) & rejected[..., None], axis=1)  # [B,W]
    layers = {}
    for l in range(cfg.n_layers):
        lo, ln = old["layers"][str(l)], new["layers"][str(l)]
        lc = dict(ln)
        lc["window"] = select_rows(ring_mask, lo["window"], ln["window"])
        if l in cfg.kv_source_layers:
            m = cfg.ratio(l)
            idx = new_pos[:, None] // m + jnp.arange(S // m + 2, dtype=jnp.int32)[None, :]
            for name in ("comp", "index_k"):
                if name in ln:  # V4: index keys in the ratio-4 (CSA) layers only
                    lc[name] = scatter_rows(ln[name], idx, take_rows(lo[name], idx))
            if m > 1:
                x = _layer_input(params, aux, tokens, l, cfg, opts, engram_ids, engram_rows)
                pa = params["layers"][str(l)]["attn"]
                overlap = cfg.is_v4 and cfg.overlap(l)
                _, _, _, state = compress(pa["compressor"], x, lo, pos0, keep, m, cfg, opts, overlap=overlap)
                lc.update(state)
                if cfg.is_v4 and "index_k" in ln:  # V4's indexer has its own compressor and state
                    _, _, _, istate = compress(pa["indexer"]["compressor"], x, lo, pos0, keep, m, cfg, opts,
                                               overlap=True, state="index_state")
                    lc.update(istate)
        layers[str(l)] = lc
    return {"pos": new_pos, "layers": layers}


# ---------------------------------------------------------------------------------------------
# device programs
# ---------------------------------------------------------------------------------------------


__all__ = ["DRAFTERS", "choose_drafter", "get_drafter", "SpeculativeGenerator", "accept", "rollback", "spec_step"]


def _draft_keys(keys):
    return None if keys is None else jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys)


def spec_step(params, cache, dcache, tokens, n_verify, active, draft_logits, engram_ids, engram_rows, keys,
              temperature, top_k, top_p, force_acc=None, *, cfg: ModelConfig, opts: RunOptions, sampler,
              drafter: Drafter = DRAFTERS["dspark"]):
    """Verify + accept + roll back + drafter update + next draft. tokens [B,S] = [anchor, drafts...].
    ``drafter`` (:mod:`dsv41_jax.drafters`) takes the committed positions in and drafts after the
    new token (:meth:`~dsv41_jax.drafters.Drafter.after_verify`); ``dcache`` is its state.
    ``force_acc`` [B] (benchmarks only, NOT lossless): where >= 0, accept ``min(force_acc, n_verify)``
    drafts whatever the target says (the "simulated acceptance" protocol of published numbers).
    Returns (n_acc [B], next [B], cache, dcache, draft ids [B,G+1], draft logits [B,G,V], conf [B,G])."""
    greedy, use_k, use_p = sampler
    n_verify = jnp.where(active, n_verify, 0).astype(jnp.int32)
    lengths = jnp.where(active, 1 + n_verify, 0).astype(jnp.int32)
    logits, new_cache, aux = forward_step(params, cache, tokens, lengths, engram_ids, engram_rows, cfg=cfg, opts=opts,
                                          logits_mode="all", return_aux=True)
    n_acc, nxt = accept(logits, tokens[:, 1:], n_verify, draft_logits, keys, temperature, top_k, top_p, greedy=greedy,
                        use_top_k=use_k, use_top_p=use_p)
    if force_acc is not None:
        forced = jnp.minimum(force_acc, n_verify)
        fnxt = jnp.argmax(jnp.take_along_axis(logits, forced[:, None, None], axis=1)[:, 0], -1).astype(jnp.int32)
        nxt = jnp.where(force_acc >= 0, fnxt, nxt)
        n_acc = jnp.where(force_acc >= 0, forced, n_acc)
    n_acc = jnp.where(active, n_acc, 0)
    keep = jnp.where(active, n_acc + 1, 0)
    cache = rollback(params, cache, new_cache, aux, tokens, keep, lengths, engram_ids, engram_rows, cfg=cfg, opts=opts)
    dcache, ids, dl, conf = drafter.after_verify(params, dcache, aux, tokens, n_acc, nxt, keep,
                                                 None if greedy else _draft_keys(keys), temperature, cfg=cfg, opts=opts)
    # the donated caches first: jit gives each output of a donated input's shape that input's buffer, in
    # output order, so n_acc / nxt ([B] int32) listed first would take the caches' positions
    return cache, dcache, n_acc, nxt, ids, dl, conf


# ---- the verify step as the generation loop runs it: every buffer keeps its address between steps

def io_width(G: int, engram_cols: int) -> int:
    """Columns of the int32 [B, W] step buffer (:func:`spec_step_io`): in, the anchor + G drafts, the
    number to verify, active, request id, step, forced acceptance, and each position's Engram ids
    (``engram_cols`` per position); out, n_acc, next, the G + 1 new draft ids, the G confidences."""
    return max(G + 1 + 5 + (G + 1) * engram_cols, 2 + (G + 1) + G)


def spec_step_io(params, cache, dcache, dl, io, seed, temperature, top_k, top_p, *, cfg: ModelConfig,
                 opts: RunOptions, sampler, S: int, forced: bool, engram_shape: tuple | None,
                 drafter: Drafter = DRAFTERS["dspark"]):
    """:func:`spec_step` reading its per-step inputs from, and writing its results back into, one
    int32 [B, W] buffer ``io`` (layout: :func:`io_width`, :func:`pack_io`; the host copies new
    values into it with :func:`dsv41_jax.engine.stage_into` and reads it through a copy). Returns (cache, dcache, draft logits, io), each
    overwriting its donated input (in the inputs' order: jit pairs donated inputs with outputs of the
    same shape in output order), so consecutive verify steps keep every buffer's address and XLA
    need not re-record the step's CUDA graph (the engine's decode step, BENCHMARKS.md session 6).
    The draft logits of inactive rows are kept; random keys come from (seed, request id, step) as
    :meth:`SpeculativeGenerator._keys`. ``engram_shape``: (layers, ids per layer) or None."""
    G = drafter.width(cfg)
    B = io.shape[0]
    tokens = io[:, :S]
    o = G + 1
    n_verify, active, rid, steps = io[:, o], io[:, o + 1] > 0, io[:, o + 2], io[:, o + 3]
    force = io[:, o + 4] if forced else None
    eids = None
    if engram_shape is not None:
        L, H = engram_shape
        e = io[:, o + 5:o + 5 + (G + 1) * L * H].reshape(B, G + 1, L, H)[:, :S]
        eids = {str(l): e[:, :, i] for i, l in enumerate(cfg.engram_layer_ids)}
    keys = None if sampler[0] else request_keys(seed, rid, steps)
    cache, dcache, n_acc, nxt, ids, dl_new, conf = spec_step(
        params, cache, dcache, tokens, n_verify, active, dl, eids, None, keys, temperature, top_k, top_p, force,
        cfg=cfg, opts=opts, sampler=sampler, drafter=drafter)
    dl = jnp.where(active[:, None, None], dl_new, dl)
    res = jnp.concatenate([n_acc[:, None].astype(jnp.int32), nxt[:, None].astype(jnp.int32), ids.astype(jnp.int32),
                           jax.lax.bitcast_convert_type(conf.astype(jnp.float32), jnp.int32)], axis=1)
    return cache, dcache, dl, jax.lax.dynamic_update_slice(io, res, (0, 0))


spec_step_io_jit = jax.jit(spec_step_io, static_argnames=("cfg", "opts", "sampler", "S", "forced", "engram_shape",
                                                          "drafter"),
                           donate_argnames=("cache", "dcache", "dl", "io"))


def pack_io(tokens, n_verify, active, request_ids, steps, force, engram_ids, G: int) -> np.ndarray:
    """The host's int32 [B, W] inputs of :func:`spec_step_io`: tokens [B, S] (S <= G + 1), the drafts
    to verify, active, request ids, steps [B], forced acceptance [B] or None, Engram ids [B, S,
    layers, ids] or None (each position's block of columns; positions >= S zero)."""
    B, S = tokens.shape
    ecols = 0 if engram_ids is None else engram_ids.shape[2] * engram_ids.shape[3]
    host = np.zeros((B, io_width(G, ecols)), np.int32)
    host[:, :S] = tokens
    o = G + 1
    host[:, o], host[:, o + 1], host[:, o + 2], host[:, o + 3] = n_verify, active, request_ids, steps
    if force is not None:
        host[:, o + 4] = force
    if engram_ids is not None:
        e = np.zeros((B, G + 1) + engram_ids.shape[2:], np.int32)
        e[:, :S] = engram_ids
        host[:, o + 5:o + 5 + (G + 1) * ecols] = e.reshape(B, -1)
    return host


def unpack_io(res: np.ndarray, G: int):
    """(n_acc [B], next [B], draft ids [B, G+1], confidence [B, G]) from a host copy of ``io``."""
    return (res[:, 0], res[:, 1], res[:, 2:G + 3],
            np.ascontiguousarray(res[:, G + 3:2 * G + 3]).view(np.float32))



def prefill_step(params, cache, dcache, tokens, lengths, next_tokens, next_lengths, engram_ids, engram_rows, *, cfg,
                 opts, drafter: Drafter):
    """A prompt chunk through the target (last logits) and into the drafter's state
    (:meth:`~dsv41_jax.drafters.Drafter.after_prompt`; ``next_tokens`` [B, chunk] / ``next_lengths``
    [B]: the prompt's token after each chunk position, None unless the drafter needs them)."""
    logits, cache, aux = forward_step(params, cache, tokens, lengths, engram_ids, engram_rows, cfg=cfg, opts=opts,
                                      logits_mode="last", return_aux=True)
    dcache = drafter.after_prompt(params, dcache, aux, lengths, next_tokens, next_lengths, cfg=cfg, opts=opts)
    return logits, cache, dcache


prefill_step_jit = jax.jit(prefill_step, static_argnames=("cfg", "opts", "drafter"),
                           donate_argnames=("cache", "dcache"))


def first_token(params, dcache, logits, ready, keys, temperature, top_k, top_p, *, cfg, opts, sampler,
                drafter: Drafter):
    """The first generated token [B] of the ``ready`` rows (their prompt just ended) from the prompt's
    last logits, and the drafter's first drafts after it
    (:meth:`~dsv41_jax.drafters.Drafter.first_draft`). Returns (dcache, next, ids [B, G + 1], draft
    logits [B, G, V], confidence [B, G]); the host reads the ready rows only."""
    greedy, use_k, use_p = sampler
    if greedy:
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    else:
        p = target_probs(logits, temperature, top_k, top_p, use_top_k=use_k, use_top_p=use_p)
        nxt = jax.vmap(lambda k, d: _categorical(jax.random.fold_in(k, 1), d))(keys, p)
    dcache, ids, dl, conf = drafter.first_draft(params, dcache, nxt, ready, None if greedy else _draft_keys(keys),
                                                temperature, cfg=cfg, opts=opts)
    return dcache, nxt, ids, dl, conf


first_token_jit = jax.jit(first_token, static_argnames=("cfg", "opts", "sampler", "drafter"),
                          donate_argnames=("dcache",))


def reset_slot_pair(cache, dcache, slot, *, cfg, opts, max_seq_len, drafter: Drafter = DRAFTERS["dspark"]):
    """Slot ``slot``'s backbone cache row (:func:`dsv41_jax.engine.reset_slot`) and drafter state row
    (:meth:`~dsv41_jax.drafters.Drafter.reset_row`) back to their initial state, ``pos`` 0 in both."""
    return (reset_slot(cache, slot, cfg=cfg, opts=opts, max_seq_len=max_seq_len),
            drafter.reset_row(dcache, slot, cfg=cfg, opts=opts, max_seq_len=max_seq_len))


reset_slot_pair_jit = jax.jit(reset_slot_pair, static_argnames=("cfg", "opts", "max_seq_len", "drafter"),
                              donate_argnames=("cache", "dcache"))
request_keys_jit = jax.jit(request_keys)


# ---------------------------------------------------------------------------------------------
# scheduling (how many drafts to verify)
# ---------------------------------------------------------------------------------------------


def expected_tokens(conf, active):
    """Expected tokens one verify step commits, summed over the ``active`` rows [B], for k = 0..G
    drafts verified: ``sum_b 1 + sum_{i<=k} prod_{j<=i} sigmoid(conf[b, j])`` (prefix survival,
    DSPARK Alg. 1). conf [B, G] raw confidence logits. Returns float64 [G + 1]."""
    conf = np.asarray(conf, np.float64)
    a = np.cumprod(0.5 * (1.0 + np.tanh(0.5 * conf)), axis=1)  # sigmoid (no overflow); P(1..i accepted) [B, G]
    per_row = 1.0 + np.concatenate([np.zeros((conf.shape[0], 1)), np.cumsum(a, 1)], 1)  # [B, G + 1]
    return (per_row * np.asarray(active, np.float64)[:, None]).sum(0)


def choose_width(conf, active, cost) -> int:
    """The confidence policy: the number of drafts k (0..G) maximizing expected committed tokens per
    second, ``expected_tokens(conf, active)[k] / cost[1 + k]`` (``cost[S]``: seconds of a verify step
    of width S, as :meth:`SpeculativeGenerator.calibrate` measures). Ties go to the larger k, so a
    flat cost table (a weight-bandwidth-bound step, batch-1 on a GPU) always verifies every draft."""
    tot = expected_tokens(conf, active)
    rate = np.array([tot[k] / cost[k + 1] for k in range(len(tot))])
    return int(np.flatnonzero(rate == rate.max()).max())


# ---------------------------------------------------------------------------------------------
# host loop
# ---------------------------------------------------------------------------------------------


@dataclass
class SpecStats:
    steps: int = 0  # verify steps (each counts every active row once in row_steps)
    row_steps: int = 0
    committed: int = 0  # tokens emitted by verify steps (accepted drafts + one new token per row-step)
    drafted: int = 0  # drafts put up for verification
    accepted: int = 0
    decode_s: float = 0.0  # wall time of verify steps
    prefill_s: float = 0.0  # wall time of prompt chunks and first tokens
    compile_s: float = 0.0
    admitted: int = 0  # requests admitted into a slot
    widths: dict = field(default_factory=dict)
    drafter: str = "dspark"

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per row per verify step (accepted drafts + 1)."""
        return self.committed / max(self.row_steps, 1)

    @property
    def verified_per_step(self) -> float:
        """Mean drafts put up for verification per row per verify step (the policy's choice)."""
        return self.drafted / max(self.row_steps, 1)

    @property
    def decode_tps(self) -> float:
        return self.committed / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"speculative {self.drafter}: acceptance length {self.acceptance_length:.2f} "
                f"({self.accepted}/{self.drafted} drafts accepted, {self.verified_per_step:.2f} verified per row-step, "
                f"{self.steps} verify steps), decode {self.committed} tokens {self.decode_tps:.1f} tok/s")


@dataclass
class _Slot:
    index: int  # the request's index in the generate call
    sample_id: int  # its id in the random keys
    prompt: np.ndarray
    max_new: int
    cursor: int = 0  # prompt tokens fed
    out: list = field(default_factory=list)
    steps: int = 0  # verify steps run (the random-key step of the next one is steps + 1)


def _on_mesh(method):
    """Run a generator method under its mesh (``use_mesh``), so that every program it traces shards
    as the partition rules say (the routed experts through the expert-parallel ``shard_map``)."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        if self.mesh is None:
            return method(self, *args, **kw)
        from sharding.rules import use_mesh

        with use_mesh(self.mesh):
            return method(self, *args, **kw)

    return run


class SpeculativeGenerator:
    """Generation with drafts (V4.1's DSpark, or V4's MTP block: ``drafter``) and continuous batching: ``batch_size`` slots; when a sequence
    finishes (a stop token / its ``max_new_tokens``) its slot is reset (backbone cache row, drafter
    state, Engram history: :func:`reset_slot_pair`) and takes the next waiting prompt, whose chunks
    are prefilled between the verify steps of the other slots. ``policy``: ``all`` | ``confidence``
    | ``fixed:k``. ``mesh``: run on a ``sharding.make_mesh`` mesh with ``dp = 1`` (parameters on
    their partition-rule shardings, the routed experts over ``ep``; caches and rows replicated)."""

    def __init__(self, model, *, batch_size: int, max_seq_len: int, opts: RunOptions | None = None,
                 prefill_chunk: int = 64, policy: str = "all", stop_ids=(1,), propose=None,
                 simulate_accept: float | None = None, pad_width: bool = False, mesh=None, drafter: str = "auto"):
        """``propose(request, pos, tokens_row) -> tokens_row`` (tests): replaces a request's verify
        chunk ``[anchor, drafts...]`` on the host before verification (e.g. oracle drafts).
        ``simulate_accept`` (benchmarks, not lossless): force the accepted-draft count per step to
        floor/ceil of ``simulate_accept - 1`` at random with that mean (e.g. 5.5 -> 4 or 5 drafts, 5
        or 6 tokens). ``pad_width``: always run the verify program at width ``gamma + 1`` (rows
        verifying fewer drafts are padded; one compiled program instead of one per width: tests,
        compile-bound hosts). ``drafter``: ``dspark`` | ``mtp`` | ``auto`` (the one the model has,
        :func:`choose_drafter`)."""
        self.cfg: ModelConfig = model.cfg
        cfg = self.cfg
        self.drafter: Drafter = get_drafter(choose_drafter(cfg, model.params, drafter))
        self.G = self.drafter.width(cfg)
        if self.G + 1 > cfg.window_size:
            raise ValueError(f"{self.G} drafts + 1 must not exceed window_size {cfg.window_size}")
        if not (policy in ("all", "confidence") or policy.startswith("fixed:")):
            raise ValueError(f"policy must be all, confidence or fixed:k, got {policy!r}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.policy = policy
        self.model = model
        self.opts = opts or RunOptions()
        self.B, self.max_seq_len, self.chunk = int(batch_size), int(max_seq_len), int(prefill_chunk)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        # every leaf on the device (Engram tables included: rows are gathered inside the programs)
        self.params = jax.tree.map(lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a, model.params)
        self.mesh = mesh
        if mesh is not None:
            from sharding.mesh import mesh_sizes
            from sharding.rules import shard_params

            dp = mesh_sizes(mesh)["dp"]
            if dp != 1:
                raise ValueError(f"DSpark speculative decoding on a mesh needs dp=1 (rows are not split), got dp={dp} "
                                 f"(--mesh: use ep / tp)")
            self.params = shard_params(self.params, cfg, mesh, keep_host=False)
        self.hasher = model.hasher if cfg.engram_layer_ids else None
        self.J = cfg.engram_max_ngram_size if cfg.engram_layer_ids else 1
        self.cost = {S: 1.0 for S in range(1, self.G + 2)}  # seconds per verify width (calibrate measures)
        self.stats = SpecStats(drafter=self.drafter.name)
        self.propose = propose
        self.simulate_accept = simulate_accept
        self.pad_width = pad_width
        self._rng = np.random.default_rng(0)

    # ------------------------------------------------------------------ host helpers
    def _engram(self, hist, pos, tokens, lengths):
        """The Engram ids of a step as the model takes them ({layer: [B, S, ids]} on the device)."""
        ids = self._engram_np(hist, pos, tokens, lengths)
        if ids is None:
            return None
        return {str(l): jnp.asarray(ids[:, :, i]) for i, l in enumerate(self.cfg.engram_layer_ids)}

    def _engram_np(self, hist, pos, tokens, lengths):
        """The Engram ids of a step on the host, [B, S, layers, ids] (None without Engram)."""
        if self.hasher is None:
            return None
        B, S = tokens.shape
        J = self.J
        start = np.maximum(pos - (J - 1), 0)
        T = J - 1 + S
        win = np.zeros((B, T), np.int64)
        for b in range(B):
            n0 = pos[b] - start[b]
            win[b, :n0] = hist[b, start[b]:pos[b]]
            win[b, n0:n0 + S] = tokens[b]
        comp = self.hasher.compress(win)
        lpos = np.minimum((pos - start)[:, None] + np.arange(S)[None, :], T - 1)
        return ngram_hash_ids(comp, lpos, self.hasher.layout, self.hasher.pad_compressed_id).astype(np.int32)

    @staticmethod
    def _keys(sp: SamplingParams, rid, steps):
        """Random keys [B, 2] from (seed, request index, the request's own step): a request draws the
        same numbers in any slot, next to any neighbours. None when greedy (no randomness)."""
        if sp.greedy:
            return None
        return request_keys_jit(jnp.int32(sp.seed), jnp.asarray(rid, jnp.int32), jnp.asarray(steps, jnp.int32))

    def _choose(self, conf, active, room):
        """Drafts to verify per row [B] (host)."""
        G = self.G
        if self.policy == "all":
            k = np.full(self.B, G)
        elif self.policy.startswith("fixed:"):
            k = np.full(self.B, int(self.policy.split(":")[1]))
        else:
            k = np.full(self.B, choose_width(conf, active, self.cost))
        return np.clip(np.minimum(k, room), 0, G)

    def _placed(self, tree):
        """``tree`` committed where the verify program returns its state: to the parameters' device
        (one device; on a mesh left as it is: whether the mesh path compiles twice too was not
        checked). Arguments left uncommitted (the
        step buffer from jnp.zeros, fresh caches and draft logits) made the first and the second
        verify step two compilations of one program (an argument's sharding is part of jit's cache
        key): 14 instead of 6 compilations for the six widths of the confidence policy plus
        verify-all in ``spec_bench --rows policies`` on the CPU. Called where the state is created,
        not per step (a device_put per leaf costs host time)."""
        if self.mesh is not None:
            return tree
        return jax.device_put(tree, jax.tree.leaves(self.params)[0].sharding)

    def _first_io(self, shape):
        """The verify steps' int32 buffer before the first step, placed as :func:`spec_step_io_jit`
        returns it (:meth:`_placed`; replicated over the parameters' mesh on a mesh)."""
        if self.mesh is None:
            return self._placed(np.zeros(shape, np.int32))
        return jax.device_put(np.zeros(shape, np.int32), jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _verify_step(self, cache, dcache, dl, io, host, sampling_args, *, sampler, S, forced, engram_ids):
        """One verify step as the generation loop runs it: the host inputs ``host`` (:func:`pack_io`)
        staged into the persistent int32 buffer ``io`` (made on the first step), :func:`spec_step_io_jit`
        on the donated caches, draft logits and buffer, the results read through a copy. Returns
        (cache, dcache, draft logits, io, (n_acc, next, draft ids, confidences) on the host).
        ``sampling_args``: (seed, temperature, top_k, top_p) device scalars; ``engram_ids`` the host
        ids in ``host`` (their shape is the program's) or None."""
        if io is None:  # committed where the verify program returns it, so its second call does not recompile
            io = self._first_io(host.shape)
        io = stage_into(io, host)
        cache, dcache, dl, io = spec_step_io_jit(
            self.params, cache, dcache, dl, io, *sampling_args, cfg=self.cfg, opts=self.opts, sampler=sampler, S=S,
            forced=forced, engram_shape=None if engram_ids is None else tuple(engram_ids.shape[2:]), drafter=self.drafter)
        return cache, dcache, dl, io, unpack_io(np.asarray(_copy_jit(io)), self.G)

    @_on_mesh
    def calibrate(self, sampling: SamplingParams | None = None, reps: int = 5):
        """Compile every verify width and time the verify program the generation loop runs
        (:func:`spec_step_io_jit`: caches, draft logits and the step buffer donated and reused, the
        inputs staged into that buffer, the results read through a copy) on an all-active batch from
        fresh caches per width; the median of ``reps`` steps after a compiling one goes into
        ``self.cost`` (for the confidence policy). Each step advances a row by at most ``gamma + 1``
        positions, so ``max_seq_len`` must exceed ``(reps + 1) * (gamma + 1)``. With ``pad_width``
        every width runs the ``gamma + 1`` program, so that one is measured for all. (Until session
        7 this timed a separate jitted step with new caches per call: another program than the loop
        runs, with new buffer addresses every call.)"""
        sp = sampling or SamplingParams()
        sampler = sp.static_key(self.cfg.vocab_size)
        G, B, V = self.G, self.B, self.cfg.vocab_size
        need = (reps + 1) * (G + 1) + 1
        if self.max_seq_len < need:
            raise ValueError(f"calibrate: max_seq_len {self.max_seq_len} has no room for {reps + 1} verify steps of "
                             f"up to {G + 1} tokens; it needs max_seq_len >= {need} (or fewer reps)")
        temp, topk, topp = jnp.float32(max(sp.temperature, 1e-30)), jnp.int32(sp.top_k), jnp.float32(sp.top_p)
        seed = jnp.int32(sp.seed)
        widths = [G + 1] if self.pad_width else list(range(1, G + 2))
        for S in widths:
            cache, dcache, dl = self._placed((init_cache(self.cfg, B, self.max_seq_len, self.opts),
                                              self.drafter.init_state(self.cfg, B, self.max_seq_len, self.opts),
                                              jnp.zeros((B, G, V), jnp.float32)))
            io = None
            hist, pos = np.zeros((B, self.max_seq_len), np.int64), np.zeros(B, np.int64)
            jax.block_until_ready((cache, dcache, dl))
            ts = []
            for r in range(reps + 1):
                t0 = time.perf_counter()
                tok = np.zeros((B, S), np.int64)
                eids = self._engram_np(hist, pos, tok, np.full(B, S))
                force = None if self.simulate_accept is None else np.full(B, S - 1)
                host = pack_io(tok, np.full(B, S - 1), np.ones(B, bool), np.zeros(B), np.full(B, r + 1), force, eids, G)
                cache, dcache, dl, io, (n_acc, *_) = self._verify_step(
                    cache, dcache, dl, io, host, (seed, temp, topk, topp), sampler=sampler, S=S,
                    forced=force is not None, engram_ids=eids)
                pos += n_acc + 1
                dt = time.perf_counter() - t0
                if r == 0:
                    self.stats.compile_s += dt
                else:
                    ts.append(dt)
            self.cost[S] = float(np.median(ts))
        if self.pad_width:
            self.cost = {S: self.cost[self.G + 1] for S in range(1, self.G + 2)}
        # a wider verify never costs less: keep the measured table non-decreasing (timing noise)
        for S in range(2, self.G + 2):
            self.cost[S] = max(self.cost[S], self.cost[S - 1])
        return dict(self.cost)

    # ------------------------------------------------------------------ generation
    @_on_mesh
    def generate(self, prompts, max_new_tokens, sampling: SamplingParams | None = None, *,
                 return_state: bool = False, trace: list | None = None, on_finish=None, sample_ids=None):
        """Generate for any number of prompts with continuous batching over ``batch_size`` slots;
        ``max_new_tokens`` an int or one per prompt. Returns one token list per prompt, in input order
        (ending at its first stop token, at most ``max_new_tokens`` long).

        Each loop iteration: waiting prompts take the free slots (a slot used before is reset
        first); one prompt chunk is prefilled for the slots still in their prompt (rows whose prompt
        ends get their first token and first drafts); one verify step runs for the slots in decode.
        ``on_finish(index, tokens, reason)`` when a request ends (reason ``stop`` | ``length``).
        ``sample_ids``: each prompt's id in its random keys (default: its index in this call; as
        :class:`dsv41_jax.engine.Request.sample_id`, so a prompt samples the same tokens in any call).
        ``return_state``: also return the final ``(cache, dcache, committed histories, positions)`` of
        the slots. ``trace``: a list that receives host copies of ``(draft ids [B,G+1], draft logits
        [B,G,V], confidence [B,G])`` after every first-token call and every verify step (rows not
        concerned keep their previous values)."""
        cfg, B, G, V = self.cfg, self.B, self.G, self.cfg.vocab_size
        sp = sampling or SamplingParams()
        sampler = sp.static_key(V)
        n = len(prompts)
        if n < 1:
            raise ValueError("need at least one prompt")
        plen = np.array([len(p) for p in prompts], np.int64)
        if (plen < 1).any():
            raise ValueError("empty prompt")
        mnt = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (n,))
        if (mnt < 1).any():
            raise ValueError("max_new_tokens must be >= 1")
        if (plen + mnt + G + 1 > self.max_seq_len).any():
            raise ValueError("prompt + max_new_tokens + gamma + 1 exceeds max_seq_len")
        hist = np.zeros((B, self.max_seq_len + G + 2), np.int64)  # committed tokens (Engram history)
        cache, dcache = self._placed((init_cache(cfg, B, self.max_seq_len, self.opts),
                                      self.drafter.init_state(cfg, B, self.max_seq_len, self.opts)))
        temp, topk, topp = jnp.float32(max(sp.temperature, 1e-30)), jnp.int32(sp.top_k), jnp.float32(sp.top_p)
        pos = np.zeros(B, np.int64)
        last = self._placed(jnp.zeros((B, V), jnp.float32))  # each row's last prompt logits
        ids = np.zeros((B, G + 1), np.int64)  # [anchor, drafts] per row
        conf = np.zeros((B, G), np.float32)
        dl = self._placed(jnp.zeros((B, G, V), jnp.float32))
        seed = jnp.int32(sp.seed)
        io = None  # the verify steps' int32 [B, W] in/out buffer (spec_step_io), made at the first step
        slots: list[_Slot | None] = [None] * B
        used = np.zeros(B, bool)
        waiting = deque(range(n))
        outs: list = [None] * n
        sid = list(range(n)) if sample_ids is None else [int(x) for x in sample_ids]
        if len(sid) != n:
            raise ValueError("sample_ids needs one id per prompt")

        def admit():
            nonlocal cache, dcache
            for b in range(B):
                if slots[b] is None and waiting:
                    i = waiting.popleft()
                    if used[b]:
                        cache, dcache = reset_slot_pair_jit(cache, dcache, jnp.int32(b), cfg=cfg, opts=self.opts,
                                                            max_seq_len=self.max_seq_len, drafter=self.drafter)
                    used[b] = True
                    hist[b] = 0
                    hist[b, :plen[i]] = prompts[i]
                    pos[b] = 0
                    slots[b] = _Slot(i, sid[i], np.asarray(prompts[i], np.int64), int(mnt[i]))
                    self.stats.admitted += 1

        def emit(b, toks) -> int:
            """Append tokens to slot b's output up to a stop token / its budget; frees the slot when
            it ends. Returns the number appended."""
            s = slots[b]
            for c, t in enumerate(toks):
                s.out.append(int(t))
                reason = "stop" if t in self.stop_ids else "length" if len(s.out) >= s.max_new else None
                if reason:
                    outs[s.index] = s.out
                    slots[b] = None
                    if on_finish is not None:
                        on_finish(s.index, s.out, reason)
                    return c + 1
            return len(toks)

        admit()
        while any(s is not None for s in slots):
            # ---- one prompt chunk for the slots still in their prompt
            pre = [b for b, s in enumerate(slots) if s is not None and s.cursor < len(s.prompt)]
            if pre:
                t0 = time.perf_counter()
                lens = np.zeros(B, np.int64)
                tok = np.zeros((B, self.chunk), np.int64)
                for b in pre:
                    s = slots[b]
                    lens[b] = min(self.chunk, len(s.prompt) - s.cursor)
                    tok[b, :lens[b]] = s.prompt[s.cursor:s.cursor + lens[b]]
                eids = self._engram(hist, pos, tok, lens)
                after = nlens = None
                if self.drafter.needs_next_tokens:  # the prompt's token after each chunk position (the
                    after = np.zeros((B, self.chunk), np.int64)  # last one's is the first sampled token)
                    nlens = lens.copy()
                    for b in pre:
                        s = slots[b]
                        nxt_prompt = s.prompt[s.cursor + 1:s.cursor + 1 + lens[b]]
                        after[b, :len(nxt_prompt)] = nxt_prompt
                        nlens[b] = len(nxt_prompt)
                    after, nlens = jnp.asarray(after, jnp.int32), jnp.asarray(nlens, jnp.int32)
                lg, cache, dcache = prefill_step_jit(self.params, cache, dcache, jnp.asarray(tok, jnp.int32),
                                                     jnp.asarray(lens, jnp.int32), after, nlens, eids, None, cfg=cfg,
                                                     opts=self.opts, drafter=self.drafter)
                last = jnp.where(jnp.asarray(lens > 0)[:, None], lg, last)
                pos += lens
                ready = np.zeros(B, bool)
                for b in pre:
                    slots[b].cursor += int(lens[b])
                    ready[b] = slots[b].cursor == len(slots[b].prompt)
                if ready.any():  # first token + first drafts of the rows whose prompt just ended
                    rid = np.array([s.sample_id if s is not None else 0 for s in slots])
                    keys0 = self._keys(sp, rid, np.zeros(B))
                    dcache, nxt_f, ids_f, dl_f, conf_f = first_token_jit(
                        self.params, dcache, last, jnp.asarray(ready), keys0, temp, topk, topp, cfg=cfg,
                        opts=self.opts, sampler=sampler, drafter=self.drafter)
                    nxt_f, ids_f, conf_f = np.asarray(nxt_f), np.asarray(ids_f), np.asarray(conf_f)
                    ids[ready], conf[ready] = ids_f[ready], conf_f[ready]
                    dl = jnp.where(jnp.asarray(ready)[:, None, None], dl_f, dl)
                    if trace is not None:
                        trace.append((ids.copy(), np.asarray(dl), conf.copy()))
                    for b in np.flatnonzero(ready):
                        emit(b, [int(nxt_f[b])])
                else:
                    jax.block_until_ready(last)
                self.stats.prefill_s += time.perf_counter() - t0
            # ---- one verify step for the slots in decode
            active = np.array([s is not None and s.cursor == len(s.prompt) for s in slots])
            if active.any():
                t0 = time.perf_counter()
                room = self.max_seq_len - pos - 1
                k = self._choose(conf, active, room)
                S = G + 1 if self.pad_width else 1 + int(k[active].max())
                tok = ids[:, :S].astype(np.int64)
                lens = np.where(active, 1 + k, 0)
                rid = np.array([s.sample_id if s is not None else 0 for s in slots])
                stp = np.array([s.steps + 1 if s is not None else 0 for s in slots])
                if self.propose is not None:
                    for b in np.flatnonzero(active):
                        tok[b] = self.propose(slots[b].index, int(pos[b]), tok[b].copy())
                force = None
                if self.simulate_accept is not None:
                    f = self.simulate_accept - 1.0
                    lo = int(np.floor(f))
                    force = lo + (self._rng.random(B) < f - lo)
                eids = self._engram_np(hist, pos, tok, lens)  # [B, S, layers, ids] or None
                host = pack_io(tok, np.minimum(k, S - 1), active, rid, stp, force, eids, G)
                cache, dcache, dl, io, (n_acc, nxt, ids_d, conf_d) = self._verify_step(
                    cache, dcache, dl, io, host, (seed, temp, topk, topp), sampler=sampler, S=S,
                    forced=force is not None, engram_ids=eids)
                # rows not in decode keep their drafts (a row mid-prompt gets its first ones with its first token)
                ids[active], conf[active] = ids_d[active], conf_d[active]
                if trace is not None:
                    trace.append((ids.copy(), np.asarray(dl), conf.copy()))
                self.stats.widths[S] = self.stats.widths.get(S, 0) + 1
                self.stats.steps += 1
                for b in np.flatnonzero(active):
                    c = int(n_acc[b])
                    hist[b, pos[b]:pos[b] + c + 1] = tok[b, :c + 1]
                    pos[b] += c + 1
                    slots[b].steps += 1
                    self.stats.row_steps += 1
                    self.stats.drafted += int(k[b])
                    self.stats.accepted += c
                    self.stats.committed += emit(b, [int(t) for t in tok[b, 1:c + 1]] + [int(nxt[b])])
                self.stats.decode_s += time.perf_counter() - t0
            admit()
        if return_state:
            return outs, (cache, dcache, hist, pos)
        return outs


# ---------------------------------------------------------------------------------------------
# command line (``python -m dsv41_jax.generate --speculative dspark|mtp``)
# ---------------------------------------------------------------------------------------------


def run_cli(a, model, prompts, tok, opts: RunOptions, sampling: SamplingParams, max_seq_len: int, mesh=None) -> int:
    """The ``--speculative dspark|mtp`` path of :mod:`dsv41_jax.generate`: same outputs (records / texts,
    summary on stderr) from one continuous-batching :meth:`SpeculativeGenerator.generate` over all
    prompts on ``--batch-size`` slots; the summary adds the measured acceptance length."""
    import json
    import sys

    from .tokenizer import decode

    cfg = model.cfg
    err = sys.stderr
    B = max(1, min(a.batch_size, len(prompts)))
    drafter = choose_drafter(cfg, model.params, a.speculative)
    G = get_drafter(drafter).width(cfg)
    cap = max_seq_len + G + 1
    cap += -cap % 16
    cap = min(cap, cfg.max_position_embeddings)
    policy = getattr(a, "speculative_policy", "all") or "all"
    gen = SpeculativeGenerator(model, batch_size=B, max_seq_len=cap, opts=opts,
                               prefill_chunk=min(a.prefill_chunk, cap), policy=policy, stop_ids=(cfg.eos_token_id,),
                               mesh=mesh, drafter=drafter)
    name = f"DSpark, block {G}" if drafter == "dspark" else "MTP-1 (one draft per step)"
    print(f"speculative: {name}, policy {policy}, batch {B} slots for {len(prompts)} prompts "
          f"(continuous batching)", file=err, flush=True)
    if policy == "confidence":
        cost = gen.calibrate(sampling)
        print("verify step cost (s) by width: " + ", ".join(f"{k}: {v:.4f}" for k, v in cost.items()), file=err)
    mnt = [max(1, min(a.max_new_tokens, cap - G - 1 - len(p))) for p in prompts]
    done: dict = {}
    t_gen = time.perf_counter()
    outs = gen.generate([list(p) for p in prompts], mnt, sampling,
                        on_finish=lambda i, o, reason: done.__setitem__(i, (reason, time.perf_counter() - t_gen)))
    wall = time.perf_counter() - t_gen
    out_f = open(a.output, "w", encoding="utf-8") if a.output else None
    for i, (p, o) in enumerate(zip(prompts, outs)):
        reason, t_end = done[i]
        ids = o[:-1] if o and o[-1] == cfg.eos_token_id else o
        rec = {"index": i, "text": decode(tok, ids), "output_ids": o, "finish_reason": reason,
               "prompt_tokens": len(p), "timings": {"total_s": round(t_end, 6)}}
        if out_f is not None:
            out_f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        else:
            print(f"=== [{i}] ({reason}, {len(o)} tokens)")
            print(rec["text"])
    if out_f is not None:
        out_f.close()
    st = gen.stats
    n_gen = sum(len(o) for o in outs)
    print(f"summary: {len(prompts)} prompts, {sum(len(p) for p in prompts)} prompt tokens, {n_gen} generated tokens "
          f"in {wall:.2f} s; {st.summary()} (batch {B}, {st.admitted} admissions, "
          f"widths {dict(sorted(st.widths.items()))})", file=err)
    return 0
