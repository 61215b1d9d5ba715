"""Batched inference engine: caches, chunked prefill, decode, continuous batching, sampling.

    from dsv41_jax import Model
    from dsv41_jax.engine import Engine, Request
    from dsv41_jax.sampling import SamplingParams
    eng = Engine(Model.from_preset("tiny"), batch_size=4, max_seq_len=256, prefill_chunk=64)
    results = eng.generate([Request([0, 5, 6, 7], max_new_tokens=16), ...], SamplingParams())

Design
------
* **One step program.** Every device step is ``forward_step(logits_mode="last")`` followed by the
  sampler, jitted together with the cache donated (:func:`_engine_step`). A step runs a chunk
  ``tokens [B, S]`` where row ``b`` has ``lengths[b]`` real tokens: a row still in its prompt takes
  up to ``S`` prompt tokens (chunked prefill), a row in decode takes its one last sampled token, an
  idle row takes 0 tokens (its cache is untouched). Only two shapes are ever compiled per engine:
  ``S = prefill_chunk`` (any step with a prompt chunk in it) and ``S = 1`` (pure decode steps).
  Both are compiled ahead of time (:meth:`Engine.warmup`), so no step pays a Python round trip per
  layer and no compilation happens inside the timed loop.
* **Per-sequence positions.** ``cache["pos"][b]`` is each row's own position; padding tokens never
  reach a cache (``forward_step`` contract), so prompts of any lengths share a batch.
* **Continuous batching.** When a row finishes (EOS / ``max_new_tokens`` / cache full) its slot takes
  the next waiting request; the slot's cache row is reset (:func:`reset_slot`: every cache leaf's row
  back to its initial value, ``pos`` to 0; one small jitted program, cache donated).
* **Sampling** is fused into the step; a request's random key is ``(seed, request index, step)``
  (:mod:`dsv41_jax.sampling`), so its tokens do not depend on slot or batch size.
* **Engram hashing and the per-token round trip.** The hash ids of a position depend on the token
  ids at that position and the ``max_ngram_size - 1`` before it (int64 arithmetic in
  ``engram_hash.py``). Two loops:

  - *pipelined* (default when the Engram tables are on the device, or there is no Engram): the
    hash runs on the device (:func:`device_ngram_ids`, the int64 products as 8-bit limbs in uint32,
    bit-identical to the host hasher; each row's last J-1 compressed ids are device state
    ``ehist``), decode rows take their token straight from the previous step's output, and the
    host reads step k's tokens (progress, stop checks) while step k+1 already runs. No host round
    trip sits between two steps; a stop token is seen one step late and the extra sample of that
    row is discarded (``max_new_tokens`` and the cache capacity are known ahead and never
    overrun).
  - *synced* (host-memory Engram tables, or ``return_logits`` / ``forced_ids``): the host keeps
    each slot's compressed-id history, hashes a ``[B, J-1+S]`` window per step (numpy, a few
    microseconds) and, in host mode, gathers the rows; the sampled tokens of step k are needed to
    hash step k+1, so each sampling step is synced (one copy of ``B`` int32). Steps in which no row
    samples (all active rows mid-prompt) are not synced: the next chunk's ids / rows are built and
    dispatched while the device still runs the previous one.
* **Engram tables**, two modes with identical numbers: ``device`` (tables in the parameter tree on
  the device; the step gathers rows with ``jnp.take``) and ``host`` (tables stay host numpy /
  memmaps, e.g. as :func:`dsv41_jax.checkpoint.load_checkpoint` leaves them; the rows a step needs,
  ``B * S * n_cols`` of them, are gathered on the host and ``device_put`` asynchronously before the
  step is dispatched). ``auto`` picks ``host`` when the tables are numpy arrays.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache import init_cache, reset_row, tree_bytes
from .config import ModelConfig
from .engram import gather_rows
from .engram_hash import ngram_hash_ids
from .options import RunOptions
from .quant import Fp8Tensor
from .sampling import SamplingParams, request_keys, sample_traced
from .transformer import forward_step

EOS_ID = 1


# ---------------------------------------------------------------------------------------------
# jitted programs
# ---------------------------------------------------------------------------------------------

def reset_slot(cache, slot, *, cfg: ModelConfig, opts: RunOptions, max_seq_len: int):
    """Cache with batch row ``slot`` (traced int32) back to its initial state and ``pos[slot] = 0``.
    Pure; the initial row comes from :func:`init_cache` (zeros, unit scales, -inf scores)."""
    return reset_row(cache, init_cache(cfg, 1, max_seq_len, opts), slot)


_reset_slot_jit = jax.jit(reset_slot, static_argnames=("cfg", "opts", "max_seq_len"), donate_argnames=("cache",))


def _engine_step(params, cache, tokens, lengths, engram_ids, engram_rows, seed, request_ids, steps,
                 temperature, top_k, top_p, *, cfg, opts):
    """forward_step (last-token logits) + sampling, one program for every sampling setting (they
    are traced). Returns (next [B] int32, logits [B, V] f32, new cache)."""
    logits, cache = forward_step(params, cache, tokens, lengths, engram_ids, engram_rows, cfg=cfg, opts=opts,
                                 logits_mode="last")
    keys = request_keys(seed, request_ids, steps)
    nxt = sample_traced(logits, keys, temperature, top_k, top_p)
    return nxt, logits, cache


_engine_step_jit = jax.jit(_engine_step, static_argnames=("cfg", "opts"), donate_argnames=("cache",))


def device_hash_tables(hasher):
    """Device constants of the Engram n-gram hash for :func:`device_ngram_ids`, or None when the
    layout does not fit its 32-bit arithmetic (primes < 2^24 and compressed ids < 2^23; the products
    are < 2^63 by construction of the multipliers; V4.1-Flash's primes are ~1.6e7 < 2^24)."""
    lay = hasher.layout
    mult = lay.multipliers_array()
    primes = lay.primes_array()
    if primes.max() >= 2**24 or lay.compressed_vocab_size >= 2**23:
        return None
    limbs = np.stack([(mult >> (8 * i)) & 255 for i in range(8)], -1).astype(np.uint32)  # [L, J, 8]
    return {"token_map": jnp.asarray(hasher.token_map.astype(np.int32)), "mult": jnp.asarray(limbs),
            "primes": jnp.asarray(primes.astype(np.uint32)),
            "offsets": jnp.asarray(lay.offsets_array().astype(np.int32)), "pad": jnp.int32(hasher.pad_compressed_id)}


def device_ngram_ids(ht, win, first_pos, S: int):
    """The Engram row ids of :func:`dsv41_jax.engram_hash.ngram_hash_ids`, on the device in 32-bit
    integer arithmetic: the int64 products ``tok * mult`` as eight 8-bit limbs (carries
    propagated), the XOR limb by limb, the remainder by Horner over the limbs (``r < 2^24`` so
    ``r * 256 + limb`` fits in uint32). ``win`` [B, J-1+S] compressed ids, ``win[:, i]`` at absolute
    position ``first_pos + i``; returns int32 [B, S, L, cols] for positions ``first_pos + J-1 + s``."""
    L, J, _ = ht["mult"].shape
    H = ht["primes"].shape[-1]
    B = win.shape[0]
    idx = (J - 1) + jnp.arange(S)[:, None] - jnp.arange(J)[None, :]  # [S, J]: token at p - j
    tok = win[:, idx]
    apos = first_pos[:, None, None] + idx[None]
    tok = jnp.where(apos < 0, ht["pad"], tok).astype(jnp.uint32)  # before the sequence: pad
    m = ht["mult"]
    carry = jnp.zeros((B, S, L, J), jnp.uint32)
    limbs = []
    for i in range(8):
        acc = tok[:, :, None, :] * m[None, None, :, :, i] + carry
        limbs.append(acc & 255)
        carry = acc >> 8
    prod = jnp.stack(limbs, -1)  # [B, S, L, J, 8]
    cols = []
    rolling = prod[:, :, :, 0]
    for k in range(1, J):
        rolling = rolling ^ prod[:, :, :, k]
        p = ht["primes"][None, None, :, k - 1, :]  # [1, 1, L, H]
        r = jnp.zeros((B, S, L, H), jnp.uint32)
        for i in range(7, -1, -1):
            r = (r * 256 + rolling[..., i][..., None]) % p
        cols.append(r)
    return jnp.concatenate(cols, -1).astype(jnp.int32) + ht["offsets"][None, None]


def _engine_step_pipe(params, cache, ehist, ht, tokens, lengths, use_prev, prev, seed, request_ids, steps,
                      temperature, top_k, top_p, *, cfg, opts):
    """The pipelined step: decode rows (``use_prev``) take their token from the previous step's
    output ``prev`` without a host round trip, and the Engram ids are hashed on the device from
    ``ehist`` [B, J-1] (compressed ids of each row's last J-1 tokens). Returns (next, logits, cache,
    ehist)."""
    S = tokens.shape[1]
    first = (jnp.arange(S) == 0)[None, :] & use_prev[:, None]
    tokens = jnp.where(first, prev[:, None], tokens)
    eids = None
    if ht is not None:
        J1 = ehist.shape[1]
        win = jnp.concatenate([ehist, ht["token_map"][tokens]], axis=1)
        ids = device_ngram_ids(ht, win, cache["pos"] - J1, S)
        eids = {str(l): ids[:, :, i] for i, l in enumerate(cfg.engram_layer_ids)}
        ehist = jnp.take_along_axis(win, lengths.astype(jnp.int32)[:, None] + jnp.arange(J1)[None, :], axis=1)
    logits, cache = forward_step(params, cache, tokens, lengths, eids, None, cfg=cfg, opts=opts, logits_mode="last")
    keys = request_keys(seed, request_ids, steps)
    nxt = sample_traced(logits, keys, temperature, top_k, top_p)
    return nxt, logits, cache, ehist


_engine_step_pipe_jit = jax.jit(_engine_step_pipe, static_argnames=("cfg", "opts"), donate_argnames=("cache", "ehist"))


# ---------------------------------------------------------------------------------------------
# requests and results
# ---------------------------------------------------------------------------------------------

@dataclass
class Request:
    """``prompt_ids``: token ids used exactly as given. ``forced_ids``: optional teacher forcing: the
    k-th decode step feeds ``forced_ids[k]`` instead of the sampled token (``output_ids`` still
    holds the sampled ones); used to score a known continuation. ``sample_id``: the id mixed into
    the request's random keys with the seed and the step (default: its index in the ``generate``
    call), so a request samples the same tokens in any slot, batch size or order."""

    prompt_ids: Sequence[int]
    max_new_tokens: int = 64
    forced_ids: Sequence[int] | None = None
    sample_id: int | None = None  # the request's id in its random keys (default: its index in the call)


@dataclass
class Result:
    index: int
    prompt_len: int
    output_ids: list[int]
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens), "max_seq_len" (cache full)
    timings: dict
    logits: list | None = None  # per generated token, [V] float32 (return_logits=True)


@dataclass
class _Slot:
    index: int
    req: Request
    prompt: np.ndarray
    cursor: int = 0  # prompt tokens already fed
    out: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    t_admit: float = 0.0
    t_first: float = 0.0
    n_sched: int = 0  # tokens sampled by dispatched steps (pipelined loop; >= len(out))
    done: bool = False


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0  # wall time of steps containing prompt tokens
    decode_s: float = 0.0  # wall time of pure decode steps
    host_s: float = 0.0  # host work building step inputs (hashing, row gathers)
    compile_s: float = 0.0
    steps: int = 0

    def summary(self) -> str:
        pf = self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0
        dc = self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0
        return (f"prefill {self.prefill_tokens} tokens {pf:.1f} tok/s, decode {self.decode_tokens} tokens "
                f"{dc:.1f} tok/s ({self.steps} steps, compile {self.compile_s:.1f} s, host input build "
                f"{self.host_s:.2f} s)")


def cache_bytes(cfg: ModelConfig, opts: RunOptions) -> tuple[float, int]:
    """(bytes per token of the caches that grow with the sequence, fixed bytes per sequence: the
    window rings and partial-block states), measured on :func:`init_cache`'s shapes (no memory is
    allocated). V4.1-Flash, ``reference`` storage: 890 B/token."""
    m = int(np.lcm.reduce([r for r in cfg.compress_ratios if r > 0] or [1]))
    L = 64 * m

    def size(n):
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize
                   for a in jax.tree.leaves(jax.eval_shape(lambda: init_cache(cfg, 1, n, opts))))

    per_token = (size(2 * L) - size(L)) / L
    return per_token, int(round(size(L) - L * per_token))


def cache_report(cfg: ModelConfig, opts: RunOptions, batch: int, max_seq_len: int, cache=None) -> str:
    """One line: global KV bytes/token, the fixed part per sequence (window rings), the allocated total."""
    g, fixed = cache_bytes(cfg, opts)
    s = (f"cache ({opts.kv_cache_dtype}): global KV {g:g} B/token + window/state {fixed / 1024:.1f} KiB/sequence "
         f"(window {cfg.window_size} tokens)")
    if cache is not None:
        s += f"; allocated {tree_bytes(cache) / 2**20:.2f} MiB for batch {batch} x max_seq_len {max_seq_len}"
    return s


# ---------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------

class Engine:
    """Batch generation over a :class:`dsv41_jax.model.Model` (or anything with ``cfg``, ``params``
    and ``hasher``).

    ``batch_size``: slots; ``max_seq_len``: cache capacity per slot (prompt + generated);
    ``prefill_chunk``: tokens per prompt chunk (any size >= 1); ``engram_mode``: ``auto`` | ``host`` |
    ``device``; ``stop_ids``: tokens that end a sequence (default EOS = 1).
    """

    def __init__(self, model, *, batch_size: int = 8, max_seq_len: int = 4096, opts: RunOptions | None = None,
                 prefill_chunk: int = 256, engram_mode: str = "auto", stop_ids: Sequence[int] = (EOS_ID,)):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if engram_mode not in ("auto", "host", "device"):
            raise ValueError(f"engram_mode must be auto, host or device, got {engram_mode!r}")
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.opts = opts or RunOptions()
        self.B = int(batch_size)
        self.max_seq_len = int(max_seq_len)
        if self.max_seq_len < 1 or self.max_seq_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [1, {self.cfg.max_position_embeddings}], got {max_seq_len}")
        self.chunk = int(min(prefill_chunk, self.max_seq_len))
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stats = EngineStats()
        self._compiled: dict = {}
        self._dev = jax.devices()[0]
        self._setup_params(engram_mode)
        # committed placements from the start: a step's compiled program is keyed by its inputs'
        # placement, and outputs (the next cache) are committed, so an uncommitted first input
        # would compile every program a second time
        self.cache = self._commit(init_cache(self.cfg, self.B, self.max_seq_len, self.opts))
        # host mirrors: positions and compressed-id histories (for Engram hashing)
        self.pos = np.zeros(self.B, np.int64)
        J = self.cfg.engram_max_ngram_size if self.cfg.engram_layer_ids else 1
        self._J = J
        self._chist = np.zeros((self.B, self.max_seq_len + 1), np.int64)
        self._hasher = model.hasher if self.cfg.engram_layer_ids else None
        # pipelined decode (no host round trip per token) needs the hash on the device
        self._dev_hash = None
        if self.engram_mode == "device":
            self._dev_hash = device_hash_tables(self._hasher)
        self.pipelined = self.engram_mode == "none" or self._dev_hash is not None
        # committed device arrays from the start, so the pipelined step's inputs (ehist, prev) keep
        # one placement across calls (an uncommitted first input would compile the step again)
        self.ehist = jax.device_put(np.zeros((self.B, max(J - 1, 1)), np.int32), self._dev)

    # ------------------------------------------------------------------ parameters / Engram tables
    def _setup_params(self, engram_mode: str):
        cfg = self.cfg
        params = self.model.params
        layers = dict(params["layers"])
        tables = {}
        for l in cfg.engram_layer_ids:
            lp = dict(layers[str(l)])
            ep = dict(lp["engram"])
            tables[str(l)] = ep["embed"]
            layers[str(l)] = {**lp, "engram": ep}
        on_host = any(isinstance(t.data, np.ndarray) for t in tables.values())
        mode = engram_mode if engram_mode != "auto" else ("host" if on_host else "device")
        self.engram_mode = mode if tables else "none"
        self.host_tables = {}
        for k, t in tables.items():
            ep = layers[k]["engram"]
            if mode == "host":
                self.host_tables[k] = Fp8Tensor(data=np.asarray(t.data), scale=np.asarray(t.scale), block=t.block)
                ep["embed"] = None  # not an argument of the device program
            else:
                ep["embed"] = Fp8Tensor(data=jnp.asarray(t.data), scale=jnp.asarray(t.scale), block=t.block)
        params = {**params, "layers": layers}
        # every other leaf as a device array (numpy leaves would be re-transferred at every call)
        self.params = self._commit(jax.tree.map(lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a, params))

    def _commit(self, tree):
        """Single-device arrays committed to the default device (sharded ones left as they are)."""
        return jax.tree.map(lambda a: jax.device_put(a, self._dev)
                            if isinstance(a, jax.Array) and len(a.devices()) == 1 else a, tree)

    # ------------------------------------------------------------------ host-side Engram inputs
    def _engram_inputs(self, tokens: np.ndarray, lengths: np.ndarray):
        """(engram_ids, engram_rows) for a step; tokens [B,S] were just appended to the histories at
        self.pos .. self.pos + lengths - 1."""
        if self._hasher is None:
            return None, None
        B, S = tokens.shape
        J = self._J
        start = np.maximum(self.pos - (J - 1), 0)  # [B]
        T = J - 1 + S
        idx = np.minimum(start[:, None] + np.arange(T)[None, :], self.max_seq_len)
        win = self._chist[np.arange(B)[:, None], idx]  # [B, T]
        lpos = (self.pos - start)[:, None] + np.arange(S)[None, :]  # [B, S] local positions
        lpos = np.minimum(lpos, T - 1)
        ids = ngram_hash_ids(win, lpos, self._hasher.layout, self._hasher.pad_compressed_id)  # [B,S,L,c]
        ids = ids.astype(np.int32)
        out = {}
        for i, l in enumerate(self.cfg.engram_layer_ids):
            out[str(l)] = ids[:, :, i]
        if self.engram_mode == "host":
            rows = {k: jax.device_put(gather_rows(self.host_tables[k], v)) for k, v in out.items()}
            return None, rows
        return {k: jax.device_put(v) for k, v in out.items()}, None

    # ------------------------------------------------------------------ compiled programs
    def warmup(self, sampling: SamplingParams | None = None, *, decode: bool = True, prefill: bool = True,
               pipelined: bool | None = None):
        """Compile the step programs (prefill chunk width and decode) and the slot reset before timing
        anything: each is run once on an all-idle batch (every length 0: caches unchanged). Compiled
        programs live in jit's cache, shared by every engine of the same shapes in the process.
        ``pipelined`` (default: ``self.pipelined``) picks which loop's programs."""
        pipelined = self.pipelined if pipelined is None else pipelined
        widths = ([self.chunk] if prefill else []) + ([1] if decode and self.chunk != 1 else [])
        for S in widths:
            key = (S, pipelined)
            if key in self._compiled:
                continue
            t = time.perf_counter()
            zeros = np.zeros((self.B, S), np.int64), np.zeros(self.B, np.int64)
            if pipelined:
                nxt, _ = self._step_pipe(*zeros, np.zeros(self.B, bool), self._zeros_prev(), sampling=sampling)
            else:
                nxt, _ = self.step(*zeros, sampling=sampling)
            jax.block_until_ready(nxt)
            self._compiled[key] = True
            self.stats.compile_s += time.perf_counter() - t
            self.stats.steps -= 1
        if "reset" not in self._compiled:
            t = time.perf_counter()
            self.reset(0)
            jax.block_until_ready(self.cache)
            self._compiled["reset"] = True
            self.stats.compile_s += time.perf_counter() - t

    # ------------------------------------------------------------------ low-level step
    def reset(self, slot: int):
        """Reset one slot's cache row (device) and its host history."""
        self.cache = _reset_slot_jit(self.cache, jnp.int32(slot), cfg=self.cfg, opts=self.opts,
                                     max_seq_len=self.max_seq_len)
        self.pos[slot] = 0
        self._chist[slot] = 0

    def step(self, tokens, lengths, *, sampling: SamplingParams | None = None, request_ids=None, steps=None):
        """Dispatch one step: ``tokens`` [B, S'] host ints (S' <= prefill_chunk; padded to a compiled
        width), ``lengths`` [B]. Appends the real tokens to the slots' histories, advances positions.
        Returns device arrays (next tokens [B] int32, last-token logits [B, V] f32)."""
        t0 = time.perf_counter()
        tokens = np.asarray(tokens, np.int64)
        lengths = np.asarray(lengths, np.int64)
        B, S0 = tokens.shape
        if B != self.B:
            raise ValueError(f"tokens has batch {B}, the engine has {self.B} slots")
        if np.any(lengths < 0) or np.any(lengths > S0):
            raise ValueError("lengths must lie in [0, tokens.shape[1]]")
        if np.any(self.pos + lengths > self.max_seq_len):
            raise ValueError(f"a slot would exceed max_seq_len {self.max_seq_len}")
        S = 1 if S0 == 1 else self.chunk
        if S0 > S:
            raise ValueError(f"chunk of {S0} tokens exceeds prefill_chunk {self.chunk}")
        if S0 < S:
            tokens = np.concatenate([tokens, np.zeros((B, S - S0), np.int64)], 1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        sp = sampling or SamplingParams()
        # append to the compressed histories
        if self._hasher is not None:
            valid = np.arange(S)[None, :] < lengths[:, None]
            comp = self._hasher.compress(np.where(valid, tokens, 0))
            cols = np.where(valid, self.pos[:, None] + np.arange(S)[None, :], self.max_seq_len)
            self._chist[np.arange(B)[:, None], cols] = np.where(valid, comp, 0)
            self._chist[:, self.max_seq_len] = 0
        eids, erows = self._engram_inputs(tokens, lengths)
        rid = np.zeros(B, np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
        stp = np.zeros(B, np.int32) if steps is None else np.asarray(steps, np.int32)
        t1 = time.perf_counter()
        self.stats.host_s += t1 - t0
        nxt, logits, self.cache = _engine_step_jit(
            self.params, self.cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), eids, erows,
            jnp.int32(sp.seed), jnp.asarray(rid), jnp.asarray(stp), jnp.float32(sp.temperature),
            jnp.int32(sp.top_k), jnp.float32(sp.top_p), cfg=self.cfg, opts=self.opts)
        self.pos = self.pos + lengths
        self.stats.steps += 1
        return nxt, logits

    def _zeros_prev(self):
        return jax.device_put(np.zeros(self.B, np.int32), self._dev)

    def _step_pipe(self, tokens, lengths, use_prev, prev, *, sampling=None, request_ids=None, steps=None):
        """Dispatch one pipelined step (see :func:`_engine_step_pipe`); rows with ``use_prev`` feed
        ``prev[b]`` (a device array) as their single token. Returns device (next, logits)."""
        B = self.B
        tokens = np.asarray(tokens, np.int64)
        lengths = np.asarray(lengths, np.int64)
        S0 = tokens.shape[1]
        S = 1 if S0 == 1 else self.chunk
        if S0 < S:
            tokens = np.concatenate([tokens, np.zeros((B, S - S0), np.int64)], 1)
        if np.any(self.pos + lengths > self.max_seq_len):
            raise ValueError(f"a slot would exceed max_seq_len {self.max_seq_len}")
        sp = sampling or SamplingParams()
        rid = np.zeros(B, np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
        stp = np.zeros(B, np.int32) if steps is None else np.asarray(steps, np.int32)
        nxt, logits, self.cache, self.ehist = _engine_step_pipe_jit(
            self.params, self.cache, self.ehist, self._dev_hash, jnp.asarray(tokens, jnp.int32),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(np.asarray(use_prev, bool)), prev, jnp.int32(sp.seed),
            jnp.asarray(rid), jnp.asarray(stp), jnp.float32(sp.temperature), jnp.int32(sp.top_k),
            jnp.float32(sp.top_p), cfg=self.cfg, opts=self.opts)
        self.pos = self.pos + lengths
        self.stats.steps += 1
        return nxt, logits

    # ------------------------------------------------------------------ generation loop
    def generate(self, requests: Sequence[Request], sampling: SamplingParams | None = None, *,
                 return_logits: bool = False, on_token: Callable[[int, int], None] | None = None,
                 on_finish: Callable[[Result], None] | None = None, pipelined: bool | None = None) -> list[Result]:
        """Run every request to completion with continuous batching. Results in request order.
        ``on_token(request_index, n_new_tokens)`` after each step (progress bars);
        ``on_finish(result)`` when a request completes. ``pipelined`` (default: whenever possible,
        i.e. Engram tables on the device or no Engram, and no ``return_logits`` / ``forced_ids``):
        decode tokens stay on the device and the host reads each step's tokens while the next step
        already runs (:meth:`_step_pipe`); otherwise every sampling step is synced."""
        sp = sampling or SamplingParams()
        results: list[Result | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            n = len(r.prompt_ids)
            if n == 0:
                raise ValueError(f"request {i}: empty prompt")
            if n >= self.max_seq_len:
                raise ValueError(f"request {i}: prompt of {n} tokens leaves no room in max_seq_len {self.max_seq_len}")
            if r.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1")
        pipe = self.pipelined if pipelined is None else bool(pipelined)
        if pipelined is None and (return_logits or any(r.forced_ids is not None for r in requests)):
            pipe = False
        if pipe and not self.pipelined:
            raise ValueError("pipelined decoding needs the Engram tables on the device (engram_mode='device')")
        if pipe and (return_logits or any(r.forced_ids is not None for r in requests)):
            raise ValueError("return_logits / forced_ids need pipelined=False")
        self.warmup(sp, prefill=True, decode=True, pipelined=pipe)
        waiting = deque(range(len(requests)))
        slots: list[_Slot | None] = [None] * self.B
        # every slot starts fresh
        for b in range(self.B):
            self.reset(b)

        def admit():
            for b in range(self.B):
                if slots[b] is None and waiting:
                    i = waiting.popleft()
                    if self.pos[b] != 0:
                        self.reset(b)
                    r = requests[i]
                    slots[b] = _Slot(index=i, req=r, prompt=np.asarray(r.prompt_ids, np.int64),
                                     t_admit=time.perf_counter())

        def finish(b: int, reason: str):
            s = slots[b]
            now = time.perf_counter()
            res = Result(index=s.index, prompt_len=len(s.prompt), output_ids=list(s.out), finish_reason=reason,
                         timings={"queue_s": s.t_admit - t_start, "prefill_s": s.t_first - s.t_admit,
                                  "decode_s": now - s.t_first, "total_s": now - t_start},
                         logits=s.logits if return_logits else None)
            results[s.index] = res
            slots[b] = None
            if on_finish is not None:
                on_finish(res)

        t_start = t_mark = time.perf_counter()
        had_prompt = False
        admit()
        if pipe:
            prev = self._zeros_prev()
            pending = None  # (next tokens of the last dispatched step, [(slot, _Slot)] that sampled in it)
            while any(s is not None for s in slots) or pending is not None:
                in_prompt = [s is not None and s.cursor < len(s.prompt) for s in slots]
                S = self.chunk if any(in_prompt) else 1
                tokens = np.zeros((self.B, S), np.int64)
                lengths = np.zeros(self.B, np.int64)
                use_prev = np.zeros(self.B, bool)
                rid = np.zeros(self.B, np.int32)
                stp = np.zeros(self.B, np.int32)
                sampled = []
                n_prompt = 0
                for b, s in enumerate(slots):
                    if s is None or s.done:
                        continue
                    if in_prompt[b]:
                        n = min(S, len(s.prompt) - s.cursor)
                        tokens[b, :n] = s.prompt[s.cursor:s.cursor + n]
                        lengths[b] = n
                        s.cursor += n
                        n_prompt += n
                        if s.cursor < len(s.prompt):
                            continue
                    elif s.n_sched < s.req.max_new_tokens and len(s.prompt) + s.n_sched <= self.max_seq_len:
                        use_prev[b] = True  # its last sampled token, still on the device
                        lengths[b] = 1
                    else:
                        continue  # exhausted: finishes when its last token is read
                    rid[b] = s.index if s.req.sample_id is None else s.req.sample_id
                    stp[b] = s.n_sched
                    s.n_sched += 1
                    sampled.append((b, s))
                step = None
                if lengths.any():
                    prev, _ = self._step_pipe(tokens, lengths, use_prev, prev, sampling=sp, request_ids=rid, steps=stp)
                    had_prompt = had_prompt or n_prompt > 0
                    self.stats.prefill_tokens += n_prompt
                    step = (prev, sampled) if sampled else None
                elif pending is None:
                    raise RuntimeError("engine stalled: active slots but nothing to run or read")
                if pending is not None:  # read the previous step while this one runs
                    nxt = np.asarray(pending[0])
                    now = time.perf_counter()
                    dt, t_mark = now - t_mark, now
                    n_new = 0
                    for b, s in pending[1]:
                        if s.done:
                            continue  # sampled after its stop token: discarded
                        if not s.out:
                            s.t_first = now
                        tok = int(nxt[b])
                        s.out.append(tok)
                        n_new += 1
                        if on_token is not None:
                            on_token(s.index, 1)
                        reason = ("stop" if tok in self.stop_ids else "length" if len(s.out) >= s.req.max_new_tokens
                                  else "max_seq_len" if len(s.prompt) + len(s.out) > self.max_seq_len else None)
                        if reason:
                            s.done = True
                            finish(b, reason)
                    if had_prompt:
                        self.stats.prefill_s += dt
                    else:
                        self.stats.decode_tokens += n_new
                        self.stats.decode_s += dt
                    had_prompt = False
                pending = step
                admit()
            return results  # type: ignore[return-value]
        while any(s is not None for s in slots):
            in_prompt = [s is not None and s.cursor < len(s.prompt) for s in slots]
            S = self.chunk if any(in_prompt) else 1
            tokens = np.zeros((self.B, S), np.int64)
            lengths = np.zeros(self.B, np.int64)
            rid = np.zeros(self.B, np.int32)
            stp = np.zeros(self.B, np.int32)
            n_prompt = 0
            for b, s in enumerate(slots):
                if s is None:
                    continue
                rid[b] = s.index if s.req.sample_id is None else s.req.sample_id
                stp[b] = len(s.out)
                if in_prompt[b]:
                    n = min(S, len(s.prompt) - s.cursor)
                    tokens[b, :n] = s.prompt[s.cursor:s.cursor + n]
                    lengths[b] = n
                    s.cursor += n
                    n_prompt += n
                else:
                    k = len(s.out) - 1
                    f = s.req.forced_ids
                    tokens[b, 0] = f[k] if f is not None and k < len(f) else s.out[-1]
                    lengths[b] = 1
            nxt_d, logits_d = self.step(tokens, lengths, sampling=sp, request_ids=rid, steps=stp)
            had_prompt = had_prompt or n_prompt > 0
            self.stats.prefill_tokens += n_prompt
            if all(s is None or s.cursor < len(s.prompt) for s in slots):
                continue  # nobody samples this step: dispatch the next prompt chunk without a sync
            nxt = np.asarray(nxt_d)  # the step's one sync
            lg = np.asarray(logits_d) if return_logits else None
            now = time.perf_counter()
            dt, t_mark = now - t_mark, now
            n_new = 0
            for b, s in enumerate(slots):
                if s is None or s.cursor < len(s.prompt):
                    continue  # idle, or prompt not finished yet
                if not s.out:
                    s.t_first = now
                tok = int(nxt[b])
                s.out.append(tok)
                n_new += 1
                if lg is not None:
                    s.logits.append(lg[b].copy())
                if on_token is not None:
                    on_token(s.index, 1)
                if tok in self.stop_ids:
                    finish(b, "stop")
                elif len(s.out) >= s.req.max_new_tokens:
                    finish(b, "length")
                elif self.pos[b] + 1 > self.max_seq_len:
                    finish(b, "max_seq_len")
            if had_prompt:  # wall time since the last sync, by the kind of steps it covered
                self.stats.prefill_s += dt
            else:
                self.stats.decode_tokens += n_new
                self.stats.decode_s += dt
            had_prompt = False
            admit()
        return results  # type: ignore[return-value]
