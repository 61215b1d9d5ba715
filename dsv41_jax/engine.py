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
* **On a mesh** (``Engine(model, ..., mesh=make_mesh("dp=2,tp=2,ep=2"))``): parameters are placed
  by the rule table (:func:`sharding.rules.shard_params`), the cache is created directly in its
  shardings (rows over ``dp``; :func:`sharding.rules.init_cache_sharded`), and every program (the
  steps and the slot reset) runs its rows split over ``dp`` in the row ``shard_map`` of
  :func:`sharding.step.data_parallel`, traced and run under ``use_mesh(mesh)`` so the MoE is
  expert-parallel and GSPMD splits the rest over ``tp``. Each dp group reads and writes only its
  own cache rows; no cache leaf crosses devices. Per-step host inputs are ``device_put`` straight
  into their shardings (batch-leading ones over ``dp``, scalars replicated). ``batch_size`` must be
  a multiple of ``dp``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, make_single_device_sharding

from sharding.mesh import mesh_sizes
from sharding.rules import cache_shardings, init_cache_sharded, shard_params, use_mesh
from sharding.step import batch_sharding, data_parallel, row_offset

from .cache import init_cache, reset_row, tree_bytes
from .config import ModelConfig
from .engram import gather_rows
from .engram_hash import ngram_hash_ids
from .options import RunOptions
from .quant import Fp4Tensor, Fp8Tensor, with_fp4_packing
from .quant.tensors import dotted_path
from .sampling import SamplingParams, request_keys, sample_traced
from .transformer import forward_step
from .xla_flags import decode_compiler_options

EOS_ID = 1

# How the engine stores the routed experts' MXFP4 codes (Engine(expert_packing=...), else the
# environment's DSV41_EXPERT_PACKING, else "auto"): "nibbles" as in the checkpoint; "f16pairs" re-laid
# inside each 32-bit word for the MoE kernels' decode (dsv41_jax.quant.codecs.repack_f16pairs: 11
# integer ops per 8 codes instead of 15; the same values, so the same tokens); "auto" = "f16pairs"
# where the MoE dispatch runs the Pallas kernels (a GPU), else "nibbles".
EXPERT_PACKINGS = ("auto", "nibbles", "f16pairs")


def expert_packing_for(choice: str | None = None) -> str:
    """The concrete packing ("nibbles" or "f16pairs") for ``choice`` (None: DSV41_EXPERT_PACKING,
    default "auto")."""
    import os

    from pallas_kernels import dispatch

    name = (choice if choice is not None else os.environ.get("DSV41_EXPERT_PACKING", "")).strip().lower() or "auto"
    if name not in EXPERT_PACKINGS:
        raise ValueError(f"expert packing {name!r} (Engine(expert_packing=) / DSV41_EXPERT_PACKING): expected one of "
                         f"{', '.join(EXPERT_PACKINGS)}")
    if name == "auto":
        return "f16pairs" if dispatch.resolve(None, "moe_experts") != "reference" else "nibbles"
    return name


def _routed_expert(name: str, node) -> bool:
    """The routed experts' MXFP4 weights (``...ffn.experts.w1/w2/w3``; not the shared expert)."""
    return ".experts." in f".{name}." and node.block == 32


def f16_dots_reason(params) -> str | None:
    """Why the routed experts in ``params`` cannot run under ``DSV41_MMA_FP4=f16dots`` (the MoE
    kernels' float16 dot operands, exact only for MXFP4 scales in a window; None: they can, or the
    route is not forced). Names the first tensor outside the window; two device reductions each
    (none for tensors already marked ``f16_exact``, :func:`mark_f16_exact_experts`)."""
    from pallas_kernels.moe import pallas_triton as moe_pt

    if moe_pt.MMA_FP4["route"] != "f16dots":
        return None
    is_fp4 = lambda x: isinstance(x, Fp4Tensor)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp4)[0]:
        name = dotted_path(path)  # as with_fp4_packing names it for _routed_expert
        if is_fp4(node) and not node.f16_exact and _routed_expert(name, node):  # a mark: checked already
            reason = moe_pt.f16_scale_reason(node)
            if reason is not None:
                return f"routed expert {name}: {reason}"
    return None


def mark_f16_exact_experts(params):
    """``params`` with each routed expert (MXFP4) whose scales lie in the float16 window marked
    ``f16_exact`` (:func:`pallas_kernels.moe.pallas_triton.mark_f16_exact`): the MoE kernels' default
    route then reads those experts with float16 dot operands (same products, another fp32 summation
    order); the others keep the bf16 reads. Two device reductions per tensor, outside any jit."""
    from pallas_kernels.moe import pallas_triton as moe_pt

    is_fp4 = lambda x: isinstance(x, Fp4Tensor)  # noqa: E731

    def mark(path, node):
        return moe_pt.mark_f16_exact(node) if is_fp4(node) and _routed_expert(dotted_path(path), node) else node

    return jax.tree_util.tree_map_with_path(mark, params, is_leaf=is_fp4)


# ---------------------------------------------------------------------------------------------
# jitted programs
# ---------------------------------------------------------------------------------------------

def reset_slot(cache, slot, *, cfg: ModelConfig, opts: RunOptions, max_seq_len: int):
    """Cache with batch row ``slot`` (traced int32) back to its initial state and ``pos[slot] = 0``;
    a ``slot`` outside the cache's rows changes nothing (a dp group's block of rows, see
    :func:`_reset_program`). Pure; the initial row comes from :func:`init_cache` (zeros, unit
    scales, -inf scores)."""
    B = cache["pos"].shape[0]
    here = (slot >= 0) & (slot < B)
    row = jnp.clip(slot, 0, B - 1)
    old = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row, axis=0, keepdims=True), cache)
    fresh = jax.tree.map(lambda f, o: jnp.where(here, f.astype(o.dtype), o), init_cache(cfg, 1, max_seq_len, opts), old)
    return reset_row(cache, fresh, row)


# Every program below takes ``mesh`` (static; None = one device). On a mesh the body runs once
# per dp group on its own rows (sharding.step.data_parallel; _ROW = a batch-leading argument or
# output, _ALL = whole on every group), and the outputs that are fed back (cache, tokens, Engram
# history) are pinned to the shardings they came in with, so every call runs one compiled program.
_ROW, _ALL = True, False


def _pin_rows(mesh, cfg, opts, max_seq_len, cache, *rows):
    """(cache, *rows) constrained to the cache's rule-table shardings / rows over dp."""
    if mesh is None:
        return (cache, *rows)
    B = cache["pos"].shape[0]
    cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cfg, mesh, B, max_seq_len, opts))
    return (cache, *(jax.lax.with_sharding_constraint(r, batch_sharding(mesh, B)) for r in rows))


def _reset_program(cache, slot, *, cfg, opts, max_seq_len, mesh=None):
    """:func:`reset_slot` of global row ``slot``; on a dp mesh each group resets it only if the row
    is one of its own."""
    def body(cache, slot):
        return reset_slot(cache, slot - row_offset(cache["pos"].shape[0]), cfg=cfg, opts=opts,
                          max_seq_len=max_seq_len)

    cache = data_parallel(body, mesh, cache["pos"].shape[0], in_rows=(_ROW, _ALL), out_rows=_ROW)(cache, slot)
    return _pin_rows(mesh, cfg, opts, max_seq_len, cache)[0]


def _flat_params(fn):
    """``fn`` taking its first argument, the parameter tree, as a list of leaves plus a static
    ``param_tree`` (its treedef). jit then checks ~1,500 array arguments in its C++ path instead of
    flattening the tree of quantized-tensor dataclasses in Python at every step (measured on the
    2-core CI machine, V4.1 layer structure: 8 ms -> 1.6 ms per dispatch)."""
    def run(param_leaves, *args, param_tree, **kw):
        return fn(jax.tree.unflatten(param_tree, param_leaves), *args, **kw)

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


_reset_slot_jit = jax.jit(_reset_program, static_argnames=("cfg", "opts", "max_seq_len", "mesh"),
                          donate_argnames=("cache",))


def _engine_step(params, cache, tokens, lengths, engram_ids, engram_rows, seed, request_ids, steps,
                 temperature, top_k, top_p, *, cfg, opts, max_seq_len=None, mesh=None, greedy=None):
    """forward_step (last-token logits) + sampling: one program for greedy decoding and one for every
    sampled setting (temperature / top-k / top-p are traced; ``greedy`` is static, see
    :func:`sample_traced`). Returns (new cache, next [B] int32, logits [B, V] f32): the donated cache
    first, so its [B] int32 positions keep their buffer (jit pairs donated inputs with outputs of the
    same shape in output order)."""
    def body(params, cache, tokens, lengths, engram_ids, engram_rows, seed, request_ids, steps, temperature,
             top_k, top_p):
        logits, cache = forward_step(params, cache, tokens, lengths, engram_ids, engram_rows, cfg=cfg, opts=opts,
                                     logits_mode="last")
        keys = request_keys(seed, request_ids, steps)
        nxt = sample_traced(logits, keys, temperature, top_k, top_p, greedy)
        return nxt, logits, cache

    body = data_parallel(body, mesh, tokens.shape[0], out_rows=(_ROW, _ROW, _ROW),
                         in_rows=(_ALL, _ROW, _ROW, _ROW, _ROW, _ROW, _ALL, _ROW, _ROW, _ALL, _ALL, _ALL))
    nxt, logits, cache = body(params, cache, tokens, lengths, engram_ids, engram_rows, seed, request_ids, steps,
                              temperature, top_k, top_p)
    cache, nxt = _pin_rows(mesh, cfg, opts, max_seq_len, cache, nxt)
    return cache, nxt, logits


_STEP_STATICS = ("cfg", "opts", "max_seq_len", "mesh", "param_tree", "greedy")
# DSV41_DECODE_XLA_OPTIONS: compile options for the decode-width step programs only (xla_flags)
_DECODE_OPTIONS = decode_compiler_options()


def _step_jits(fn, donate_argnums):
    """(the jitted step program, its decode-width twin with ``DSV41_DECODE_XLA_OPTIONS``; the same
    object when there are none)."""
    plain = jax.jit(_flat_params(fn), donate_argnums=donate_argnums, static_argnames=_STEP_STATICS)
    if not _DECODE_OPTIONS:
        return plain, plain
    return plain, jax.jit(_flat_params(fn), donate_argnums=donate_argnums, static_argnames=_STEP_STATICS,
                          compiler_options=_DECODE_OPTIONS)


_engine_step_jit, _engine_step_decode_jit = _step_jits(_engine_step, (1,))


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


def pack_step_rows(tokens, lengths, use_prev, request_ids=None, steps=None) -> np.ndarray:
    """The per-row inputs of a pipelined step as one int32 array [B, S + 4] (tokens, then length,
    use_prev, request id, step; absent ids / steps are 0): one host-to-device copy per step instead
    of five."""
    B = tokens.shape[0]
    cols = [np.zeros((B, 1), np.int64) if c is None else np.asarray(c, np.int64).reshape(B, 1)
            for c in (lengths, use_prev, request_ids, steps)]
    return np.concatenate([np.asarray(tokens, np.int64), *cols], axis=1).astype(np.int32)


def pack_sampling(sp) -> np.ndarray:
    """(seed, temperature, top_k, top_p) as int32 [4], the floats by their bits (exact)."""
    f = np.array([sp.temperature, sp.top_p], np.float32).view(np.int32)
    return np.array([sp.seed, f[0], sp.top_k, f[1]], np.int32)


def _unpack_step(packed, sampling):
    S = packed.shape[1] - 4
    f = jax.lax.bitcast_convert_type(sampling[jnp.array([1, 3])], jnp.float32)
    return (packed[:, :S], packed[:, S], packed[:, S + 1] > 0, packed[:, S + 2], packed[:, S + 3],
            sampling[0], f[0], sampling[2], f[1])


def _engine_step_pipe(params, cache, ehist, ht, packed, prev, sampling, *, cfg, opts, max_seq_len=None, mesh=None,
                      greedy=None):
    """The pipelined step: decode rows (``use_prev``) take their token from the previous step's
    output ``prev`` without a host round trip, and the Engram ids are hashed on the device from
    ``ehist`` [B, J-1] (compressed ids of each row's last J-1 tokens). ``packed`` [B, S+4]: the
    rows' tokens, lengths, use_prev flags, request ids and steps (:func:`pack_step_rows`);
    ``sampling`` [4] (:func:`pack_sampling`). Returns (cache, ehist, next packed, next).

    Every output overwrites a donated input of its shape (cache, ehist, next packed <- packed,
    next <- prev; in the inputs' order, which is how jit pairs donated inputs with outputs of the
    same shape: next first would take the cache's [B] int32 positions), so a run of decode steps
    keeps the addresses of everything the program reads and writes, and XLA does not have to update
    the step's CUDA graph between steps (session 6: an update walks every command of the graph,
    0.7 ms per step at 40 layers). Next packed is ``packed`` with each active row's step + 1
    (:func:`advance_packed`): what the host sends for the following decode step of the same rows,
    so it need not be copied again (:meth:`Engine._pipe_inputs`). No logits: the pipelined loop
    never reads them."""
    def body(params, cache, ehist, ht, packed, prev, sampling):
        tokens, lengths, use_prev, request_ids, steps, seed, temperature, top_k, top_p = _unpack_step(packed, sampling)
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
        logits, cache = forward_step(params, cache, tokens, lengths, eids, None, cfg=cfg, opts=opts,
                                     logits_mode="last")
        keys = request_keys(seed, request_ids, steps)
        nxt = sample_traced(logits, keys, temperature, top_k, top_p, greedy)
        return cache, ehist, advance_packed(packed), nxt.astype(prev.dtype)

    body = data_parallel(body, mesh, packed.shape[0], out_rows=(_ROW, _ROW, _ROW, _ROW),
                         in_rows=(_ALL, _ROW, _ROW, _ALL, _ROW, _ROW, _ALL))
    cache, ehist, packed, nxt = body(params, cache, ehist, ht, packed, prev, sampling)
    return _pin_rows(mesh, cfg, opts, max_seq_len, cache, ehist, packed, nxt)


def advance_packed(packed):
    """``packed`` [B, S+4] (:func:`pack_step_rows`) with the step of every row with tokens in it
    (length > 0) advanced by one; works on numpy and jax arrays alike."""
    S = packed.shape[1] - 4
    inc = (packed[:, S] > 0).astype(packed.dtype)
    if isinstance(packed, np.ndarray):
        out = packed.copy()
        out[:, S + 3] += inc
        return out
    return packed.at[:, S + 3].add(inc)


def _copy_program(x):
    return jnp.copy(x)


# the host reads a step's tokens from this copy: the step's own output is donated to the next step
_copy_jit = jax.jit(_copy_program)


def _stage_program(buf, values):
    return jax.lax.dynamic_update_slice(buf, values, (0, 0))


# new values into an existing (donated) 2-D buffer: a step program reading the buffer then sees the
# same address; only this one-copy program's graph takes the new host copy's address (the engine's
# row arrays, the speculative verify step's int32 buffer)
stage_into = jax.jit(_stage_program, donate_argnums=0)


def _is_greedy(sampling: SamplingParams | None) -> bool:
    """The static sampling branch of a step program (greedy for no SamplingParams, as
    :meth:`Engine._put_step_inputs` defaults)."""
    return (sampling or SamplingParams()).temperature <= 0


_engine_step_pipe_jit, _engine_step_pipe_decode_jit = _step_jits(_engine_step_pipe, (1, 2, 4, 5))


def step_program(width: int, pipelined: bool):
    """The jitted step program for ``width`` tokens per row: the decode-width one (1) carries
    ``DSV41_DECODE_XLA_OPTIONS``; it is the plain program when that is empty."""
    if pipelined:
        return _engine_step_pipe_decode_jit if width == 1 else _engine_step_pipe_jit
    return _engine_step_decode_jit if width == 1 else _engine_step_jit


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
    # pipelined generate, pure decode steps only (no prompt tokens in the step dispatched, nor in the
    # step read): host time handing each step to the runtime (its inputs' copies, the jit call and the
    # tokens' copy for the host; on GPU a call returns once the runtime has enqueued the step's
    # kernels: launches outside CUDA graphs and graph updates count here) and time blocked reading the
    # previous step's tokens (the device still busy). Dispatch >> wait: the host limits the step rate.
    dispatch_s: float = 0.0
    wait_s: float = 0.0
    timed_decode_steps: int = 0
    # pipelined steps whose row inputs were the previous step's device output (no host copy, no
    # new address for the CUDA graph)
    packed_reused: int = 0

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

def prefill_chunk_for(batch_size: int, prefill_tokens: int | None) -> int:
    """The largest power-of-two chunk per row with ``batch_size x chunk <= prefill_tokens`` (at least
    1): a prefill step runs [batch, chunk] tokens in one program, and its activations grow with that
    product (at 8 x 4096 tokens, full-size V4-Flash's prefill program asked XLA for 88 GiB of
    scratch on an H200; BENCHMARKS.md, issue 11). None: no bound."""
    if prefill_tokens is None:
        return 1 << 62
    per_row = max(1, int(prefill_tokens) // int(batch_size))
    return 1 << (per_row.bit_length() - 1)


class Engine:
    """Batch generation over a :class:`dsv41_jax.model.Model` (or anything with ``cfg``, ``params``
    and ``hasher``).

    ``batch_size``: slots; ``max_seq_len``: cache capacity per slot (prompt + generated);
    ``prefill_chunk``: tokens per prompt chunk (any size >= 1); ``engram_mode``: ``auto`` | ``host`` |
    ``device``; ``stop_ids``: tokens that end a sequence (default EOS = 1); ``mesh``: a
    :func:`sharding.make_mesh` mesh to run on (default: one device; see "On a mesh" in the module
    docstring). ``batch_size`` must be a multiple of the mesh's ``dp``. ``expert_packing``: how the
    routed experts' MXFP4 codes are stored (:data:`EXPERT_PACKINGS`; default DSV41_EXPERT_PACKING or
    "auto", which repacks them as "f16pairs" in place where the MoE kernels run: ``model.params``
    then holds the repacked experts, the same values).
    """

    def __init__(self, model, *, batch_size: int = 8, max_seq_len: int = 4096, opts: RunOptions | None = None,
                 prefill_chunk: int = 256, engram_mode: str = "auto", stop_ids: Sequence[int] = (EOS_ID,),
                 mesh=None, prefill_tokens: int | None = None, expert_packing: str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        dp = mesh_sizes(mesh)["dp"]
        if batch_size % dp:
            raise ValueError(f"batch size {batch_size} is not a multiple of the mesh's dp={dp} "
                             f"(--batch-size / --mesh): each data-parallel group decodes an equal share of the rows")
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
        if prefill_tokens is not None and prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.chunk = int(min(prefill_chunk, self.max_seq_len, prefill_chunk_for(self.B, prefill_tokens)))
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stats = EngineStats()
        self._sampling_dev = (None, None)  # (packed sampling bytes, their device copy)
        # pipelined steps, per row-array shape: (the last step's advanced row array, its device output
        # and the buffer the next step of that shape takes; the host values it holds)
        self._row_next: dict = {}
        self._compiled: dict = {}
        # where per-step inputs go: batch-leading ones (_rows: over dp on a mesh) and the rest (_rep).
        # Committed placements from the start: a step's compiled program is keyed by its inputs'
        # placement, and outputs (the next cache) are committed, so an uncommitted first input
        # would compile every program a second time.
        self.mesh = mesh
        if mesh is None:
            self._rows = self._rep = make_single_device_sharding(jax.devices()[0])
        else:
            self._rows, self._rep = batch_sharding(mesh, self.B), NamedSharding(mesh, PartitionSpec())
        self.expert_packing = expert_packing_for(expert_packing)
        self._setup_params(engram_mode)
        if mesh is None:
            self.cache = self._commit(init_cache(self.cfg, self.B, self.max_seq_len, self.opts))
        else:
            self.cache = init_cache_sharded(self.cfg, mesh, self.B, self.max_seq_len, self.opts)
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
            if self._dev_hash is not None:
                self._dev_hash = jax.device_put(self._dev_hash, self._rep)
        self.pipelined = self.engram_mode == "none" or self._dev_hash is not None
        self.ehist = jax.device_put(np.zeros((self.B, max(J - 1, 1)), np.int32), self._rows)

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
        params = {**params, "layers": layers}
        # every leaf as a device array (numpy leaves would be re-transferred at every call)
        if self.mesh is not None:  # by the rule table, numpy leaves straight to their shards
            self.params = shard_params(params, cfg, self.mesh, keep_host=False)
        else:
            self.params = self._commit(jax.tree.map(lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a,
                                                    params))
        self._repack_experts(self.expert_packing)
        from pallas_kernels import dispatch

        if dispatch.resolve(None, "moe_experts") != "reference":
            # the default route reads the experts whose scales allow it in float16 (session 44: the
            # tensor-core decode MoE 2-8 % faster); each tensor is checked once, here
            self.params = mark_f16_exact_experts(self.params)
            reason = f16_dots_reason(self.params)  # the unmarked ones, under a forced float16 route
            if reason is not None:  # the forced float16 MoE route would give silently wrong rows
                raise ValueError(f"DSV41_MMA_FP4=f16dots: {reason}")

    def _repack_experts(self, packing: str):
        """The routed experts' codes re-laid in ``packing`` on the device (a no-op where they are), in
        place: the placed arrays are donated, and where the model's own tree held device arrays
        (possibly those very buffers) its expert nodes are replaced by the repacked ones, so that
        ``model.params`` stays usable and no second copy of the experts is kept. (Any other reference
        to the old arrays is then unusable.)"""
        is_fp4 = lambda x: isinstance(x, Fp4Tensor)  # noqa: E731
        self.params = with_fp4_packing(self.params, packing, only=_routed_expert, donate=True)
        placed = {jax.tree_util.keystr(path): node
                  for path, node in jax.tree_util.tree_flatten_with_path(self.params, is_leaf=is_fp4)[0] if is_fp4(node)}

        def adopt(path, node):
            new = placed.get(jax.tree_util.keystr(path)) if is_fp4(node) else None
            if new is None or new.packing == node.packing or isinstance(node.data, np.ndarray):
                return node
            return new

        try:
            self.model.params = jax.tree_util.tree_map_with_path(adopt, self.model.params, is_leaf=is_fp4)
        except AttributeError:  # a model object whose params cannot be set: only the engine's tree is repacked
            pass

    def _commit(self, tree):
        """Single-device arrays committed to the default device (sharded ones left as they are)."""
        return jax.tree.map(lambda a: jax.device_put(a, self._rep)
                            if isinstance(a, jax.Array) and len(a.devices()) == 1 else a, tree)

    def _on_mesh(self):
        """The context the programs are traced and run in: ``use_mesh(mesh)`` (expert-parallel MoE)."""
        return use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @staticmethod
    def _to_host(x) -> np.ndarray:
        """A device output as numpy; on a mesh spanning processes, every host gets every row."""
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

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
            rows = {k: jax.device_put(gather_rows(self.host_tables[k], v), self._rows) for k, v in out.items()}
            return None, rows
        return {k: jax.device_put(v, self._rows) for k, v in out.items()}, None

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
                _, nxt = self._step_pipe(*zeros, np.zeros(self.B, bool), self._zeros_prev(), sampling=sampling)
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
        self.cache = self._dispatch(_reset_slot_jit, self.cache, jax.device_put(np.int32(slot), self._rep))
        self.pos[slot] = 0
        self._chist[slot] = 0

    def step(self, tokens, lengths, *, sampling: SamplingParams | None = None, request_ids=None, steps=None):
        """Dispatch one step: ``tokens`` [B, S'] host ints (S' <= prefill_chunk; padded to a compiled
        width), ``lengths`` [B]. Appends the real tokens to the slots' histories, advances positions.
        Returns device arrays (next tokens [B] int32, last-token logits [B, V] f32)."""
        t0 = time.perf_counter()
        args = self._step_inputs(tokens, lengths, sampling, request_ids, steps)
        self.stats.host_s += time.perf_counter() - t0
        self.cache, nxt, logits = self._dispatch(step_program(args[0].shape[1], False), self.params, self.cache, *args,
                                                 greedy=_is_greedy(sampling))
        self.pos = self.pos + np.asarray(lengths, np.int64)
        self.stats.steps += 1
        return nxt, logits

    def _step_inputs(self, tokens, lengths, sampling, request_ids, steps):
        """Check a step's host inputs, append its tokens to the compressed histories (Engram) and
        put the arguments of :func:`_engine_step` after (params, cache) on the devices."""
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
        # append to the compressed histories
        if self._hasher is not None:
            valid = np.arange(S)[None, :] < lengths[:, None]
            comp = self._hasher.compress(np.where(valid, tokens, 0))
            cols = np.where(valid, self.pos[:, None] + np.arange(S)[None, :], self.max_seq_len)
            self._chist[np.arange(B)[:, None], cols] = np.where(valid, comp, 0)
            self._chist[:, self.max_seq_len] = 0
        eids, erows = self._engram_inputs(tokens, lengths)
        (tok, lens, rid, stp), scalars = self._put_step_inputs(tokens, lengths, sampling, request_ids, steps)
        return (tok, lens, eids, erows, scalars[0], rid, stp, *scalars[1:])

    def _put_step_inputs(self, tokens, lengths, sampling, request_ids, steps):
        """((tokens, lengths, request ids, steps) over dp, (seed, temperature, top_k, top_p)
        replicated), committed to their shardings (the unpipelined step; the pipelined one packs
        them, :func:`pack_step_rows`)."""
        sp = sampling or SamplingParams()
        B = self.B
        rid = np.zeros(B, np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
        stp = np.zeros(B, np.int32) if steps is None else np.asarray(steps, np.int32)
        rows = (np.asarray(tokens, np.int32), np.asarray(lengths, np.int32), rid, stp)
        scalars = (np.int32(sp.seed), np.float32(sp.temperature), np.int32(sp.top_k), np.float32(sp.top_p))
        return jax.device_put(rows, self._rows), jax.device_put(scalars, self._rep)

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, tree):
        self._params = tree
        self._param_leaves, self._param_tree = jax.tree.flatten(tree)

    def _program_args(self, args):
        """(args, static kwargs) of a jitted program: the parameter tree goes as its leaves."""
        kw = {"cfg": self.cfg, "opts": self.opts, "max_seq_len": self.max_seq_len, "mesh": self.mesh}
        if args and args[0] is self._params:
            args = (self._param_leaves, *args[1:])
            kw["param_tree"] = self._param_tree
        return args, kw

    def _dispatch(self, program, *args, **static):
        """Run one of the jitted programs with the engine's static arguments (and ``static``), under
        the mesh."""
        args, kw = self._program_args(args)
        kw.update(static)
        with self._on_mesh():
            return program(*args, **kw)

    def _zeros_prev(self):
        """The first ``prev`` of a pipelined loop: made by the runtime, not copied from numpy (on the CPU
        backend ``device_put`` may wrap the numpy memory itself, and such a buffer is copied rather
        than donated, so the first step's next tokens would land elsewhere)."""
        with self._on_mesh():
            return jnp.zeros((self.B,), jnp.int32, device=self._rows)

    def _step_pipe(self, tokens, lengths, use_prev, prev, *, sampling=None, request_ids=None, steps=None):
        """Dispatch one pipelined step (see :func:`_engine_step_pipe`); rows with ``use_prev`` feed
        ``prev[b]`` (a device array, donated: it is overwritten by the next tokens) as their single
        token. Returns device arrays (next, a copy of next for the host to read): pass the first
        as the following step's ``prev``, read the second."""
        args = self._pipe_inputs(tokens, lengths, use_prev, prev, sampling, request_ids, steps)
        prog = step_program(np.shape(tokens)[1], True)
        self.cache, self.ehist, packed_next, nxt = self._dispatch(prog, *args, greedy=_is_greedy(sampling))
        self._row_next[packed_next.shape] = (packed_next, self._row_next[packed_next.shape][1])
        self.pos = self.pos + np.asarray(lengths, np.int64)
        self.stats.steps += 1
        with self._on_mesh():
            return nxt, _copy_jit(nxt)

    def _pipe_inputs(self, tokens, lengths, use_prev, prev, sampling, request_ids, steps):
        """The arguments of :func:`_engine_step_pipe`, on the devices."""
        tokens = np.asarray(tokens, np.int64)
        lengths = np.asarray(lengths, np.int64)
        S0 = tokens.shape[1]
        S = 1 if S0 == 1 else self.chunk
        if S0 < S:
            tokens = np.concatenate([tokens, np.zeros((self.B, S - S0), np.int64)], 1)
        if np.any(self.pos + lengths > self.max_seq_len):
            raise ValueError(f"a slot would exceed max_seq_len {self.max_seq_len}")
        host = pack_step_rows(tokens, lengths, use_prev, request_ids, steps)
        buf, expect = self._row_next.pop(host.shape, (None, None))  # buf: donated by this step
        if buf is None:
            packed = jax.device_put(host, self._rows)
        elif np.array_equal(expect, host):
            packed = buf  # the previous step's advanced copy: same values, same device address
            self.stats.packed_reused += 1
        else:  # new values into the same buffer (one small copy program), so the address stays
            with self._on_mesh():
                packed = stage_into(buf, jax.device_put(host, self._rows))
        # what the step's advanced output will hold (the next step of the same rows sends this, steps + 1);
        # _step_pipe pairs it with that output
        self._row_next[host.shape] = (None, advance_packed(host))
        return self.params, self.cache, self.ehist, self._dev_hash, packed, prev, self._sampling_on_device(sampling)

    def _sampling_on_device(self, sampling):
        """The packed sampling scalars on the devices, copied once per distinct setting."""
        key = pack_sampling(sampling or SamplingParams()).tobytes()
        if self._sampling_dev[0] != key:
            self._sampling_dev = (key, jax.device_put(np.frombuffer(key, np.int32), self._rep))
        return self._sampling_dev[1]

    def compiled_text(self, *, decode: bool = True, pipelined: bool | None = None) -> str:
        """The optimised (on a mesh: partitioned) HLO of the step program the engine runs, for
        decode (1 token per row) or a prefill chunk; ``pipelined`` as in :meth:`warmup`. Compiles
        (or hits the compilation cache); the engine's state is not touched. For inspecting what a
        mesh communicates per step (:func:`sharding.step.collectives`)."""
        pipelined = self.pipelined if pipelined is None else pipelined
        zeros = np.zeros((self.B, 1 if decode else self.chunk), np.int64), np.zeros(self.B, np.int64)
        if pipelined:
            kept = dict(self._row_next)
            prog, args = step_program(zeros[0].shape[1], True), self._pipe_inputs(
                *zeros, np.zeros(self.B, bool), self._zeros_prev(), None, None, None)
            self._row_next = kept
        else:
            prog, args = step_program(zeros[0].shape[1], False), (self.params, self.cache,
                                                                  *self._step_inputs(*zeros, None, None, None))
        args, kw = self._program_args(args)
        with self._on_mesh():
            return prog.lower(*args, **kw, greedy=True).compile().as_text()

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
        # one new token per request: each comes from its prompt's last chunk, so no decode step runs
        # (bench's prefill rows: the decode program is not compiled)
        self.warmup(sp, prefill=True, decode=any(r.max_new_tokens > 1 for r in requests), pipelined=pipe)
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
            pending_decode = False  # the pending step had no prompt tokens
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
                t_dispatch = None  # host time of this step's dispatch, when it is a pure decode step
                if lengths.any():
                    t_d = time.perf_counter()
                    prev, readable = self._step_pipe(tokens, lengths, use_prev, prev, sampling=sp, request_ids=rid,
                                                     steps=stp)
                    if n_prompt == 0:  # (with prefill chunk 1 a prompt step has S == 1 too)
                        t_dispatch = time.perf_counter() - t_d
                    had_prompt = had_prompt or n_prompt > 0
                    self.stats.prefill_tokens += n_prompt
                    step = (readable, sampled) if sampled else None
                elif pending is None:
                    raise RuntimeError("engine stalled: active slots but nothing to run or read")
                if pending is not None:  # read the previous step while this one runs
                    t_w = time.perf_counter()
                    nxt = self._to_host(pending[0])
                    now = time.perf_counter()
                    if t_dispatch is not None and pending_decode:  # decode step dispatched, decode step read
                        self.stats.dispatch_s += t_dispatch
                        self.stats.wait_s += now - t_w
                        self.stats.timed_decode_steps += 1
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
                pending, pending_decode = step, t_dispatch is not None
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
            nxt = self._to_host(nxt_d)  # the step's one sync
            lg = self._to_host(logits_d) if return_logits else None
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
