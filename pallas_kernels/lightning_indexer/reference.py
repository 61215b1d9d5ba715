"""Pure-jnp definition of the V4.1 lightning indexer (``shared/spec/attention.md`` §6, §9.4).

``score[b,s,j] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,j])`` in fp32 on exactly dequantized MXFP4 q
and k; ``-inf`` where ``j >= visible[b,s]`` (causal: only complete compressed blocks) or where the
candidate-block mask (level two of the hierarchical indexer) excludes j. The top-k positions are
returned in ascending position order, -1 padded (a pick with a ``-inf`` score is no pick).

Decision (spec unsure): the reference computes the einsum in the activation dtype (bf16 on GPU);
we score in fp32 — tighter, and identical to the fp32 fixture. Dequantized MXFP4 q and k are bf16
numbers exactly, so the dot runs as bf16 x bf16 with fp32 accumulation: the same fp32 products,
summed in fp32 (only the order differs from an fp32 GEMM). Ties are broken toward the lower
position (``lax.top_k``); torch's order is unspecified (attention.md §12). ``topk_ascending`` is the
definition of the selection; above ``GROUPED_TOPK_MIN`` scores per call ``lightning_indexer`` computes
the same positions by ``topk_by_groups`` (proof in its docstring), which is faster there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax.quant import dequantize, exact_in_bf16


class IndexerResult(NamedTuple):
    topk: jax.Array  # [B,S,top_k] int32, ascending, -1 padded
    block_scores: jax.Array | None  # [B,S,NB] f32 block maxima of the masked scores


SCORE_BUDGET = 1 << 25  # elements of the [B,S,G,Nc] f32 head-group intermediate (128 MiB)


def head_group(b: int, sq: int, nh: int, n: int, budget: int | None = None) -> int:
    """How many heads one step of :func:`index_scores` scores at once: the largest divisor of ``nh``
    whose [B,S,G,Nc] intermediate fits ``budget`` (default ``SCORE_BUDGET``) elements (at least 1)."""
    budget = SCORE_BUDGET if budget is None else budget
    g = nh
    while g > 1 and (b * sq * g * n > budget or nh % g):
        g -= 1
    return g


def index_scores(q, weights, keys, visible, *, candidate_blocks=None, block_size=8):
    # exact-in-bf16 operands: one bf16 x bf16 dot with fp32 accumulation per head group -- the
    # products are exact in fp32, so the scores equal the fp32 ones up to summation order, on the
    # tensor cores instead of an fp32 SIMT GEMM
    low = exact_in_bf16(q) and exact_in_bf16(keys)
    qf = dequantize(q, jnp.bfloat16 if low else jnp.float32)
    kf = dequantize(keys, jnp.bfloat16 if low else jnp.float32)
    w = weights.astype(jnp.float32)
    b, sq, nh, _ = qf.shape
    g = head_group(b, sq, nh, kf.shape[1])

    def group(h0):  # heads h0 .. h0+g-1 at once: an [B,S,g,Nc] intermediate within SCORE_BUDGET
        qh = jax.lax.dynamic_slice_in_dim(qf, h0, g, axis=2)
        wh = jax.lax.dynamic_slice_in_dim(w, h0, g, axis=2)
        if low:
            sh = jnp.einsum("bshd,bnd->bshn", qh, kf, preferred_element_type=jnp.float32)
        else:
            sh = jnp.einsum("bshd,bnd->bshn", qh, kf, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(jax.nn.relu(sh) * wh[..., None], axis=2)

    if nh // g <= 8:
        # Decode and small prefill chunks: at most 8 groups, unrolled. No ``while`` loop: on a GPU each
        # iteration of one waits for the host to read the loop condition (a device->host sync), which
        # left the device idle for half of a decode step (session 3 profile, BENCHMARKS.md).
        s = group(0)
        for h0 in range(g, nh, g):
            s = s + group(h0)
    else:  # long prefill chunks: a loop over head groups, never more than the budget in flight
        s = jax.lax.fori_loop(1, nh // g, lambda i, acc: acc + group(i * g), group(0))  # [B,S,Nc]
    n = s.shape[-1]
    pos = jnp.arange(n, dtype=jnp.int32)
    s = jnp.where(pos[None, None, :] < visible[..., None], s, -jnp.inf)
    if candidate_blocks is not None:
        s = jnp.where(expand_blocks(candidate_blocks, block_size, n), s, -jnp.inf)
    return s


def expand_blocks(block_mask, block_size: int, n: int):
    """[..., NB] block mask -> [..., n] position mask."""
    return jnp.repeat(block_mask, block_size, axis=-1)[..., :n]


def block_max(scores, block_size: int):
    n = scores.shape[-1]
    pad = -n % block_size
    s = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return jnp.max(s.reshape(*s.shape[:-1], -1, block_size), axis=-1)


def topk_ascending(scores, top_k: int):
    """Positions of the ``top_k`` largest finite scores, ascending, -1 padded."""
    n = scores.shape[-1]
    k = min(top_k, n)
    vals, idx = jax.lax.top_k(scores, k)
    idx = jnp.where(jnp.isfinite(vals), idx, jnp.iinfo(jnp.int32).max)
    idx = jnp.sort(idx, axis=-1)
    idx = jnp.where(idx == jnp.iinfo(jnp.int32).max, -1, idx).astype(jnp.int32)
    if k < top_k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, top_k - k)], constant_values=-1)
    return idx


def topk_by_groups(scores, top_k: int, group: int, group_max=None):
    """:func:`topk_ascending` (same positions, ties included) in two small ``lax.top_k`` calls
    instead of one over the whole row: the top-k of the ``group``-wide maxima, then the top-k of the
    scores in those groups. Exact: an element the reference picks has fewer than k elements before
    it in (score desc, position asc) order, and every group before its own in (max desc, group asc)
    order contributes a distinct such element, so its group is among the top-k groups; the chosen
    groups are taken in ascending order, so candidate order follows position order and the second
    top-k breaks ties toward the lower position as the reference does. ``group_max``: the
    [..., ceil(n / group)] maxima when the caller already has them (:func:`block_max`)."""
    n = scores.shape[-1]
    ng = -(-n // group)
    if top_k * group >= n:  # nothing to gain
        return topk_ascending(scores, top_k)
    gm = block_max(scores, group) if group_max is None else group_max
    _, gi = jax.lax.top_k(gm, min(top_k, ng))
    gi = jnp.sort(gi, axis=-1)  # ascending groups: candidates in position order
    pos = (gi[..., :, None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(*gi.shape[:-1], -1)
    inb = pos < n
    cand = jnp.where(inb, jnp.take_along_axis(scores, jnp.where(inb, pos, 0), axis=-1), -jnp.inf)
    vals, ci = jax.lax.top_k(cand, min(top_k, cand.shape[-1]))
    picked = jnp.take_along_axis(pos, ci, axis=-1)
    idx = jnp.where(jnp.isfinite(vals), picked, jnp.iinfo(jnp.int32).max)
    idx = jnp.sort(idx, axis=-1)
    idx = jnp.where(idx == jnp.iinfo(jnp.int32).max, -1, idx).astype(jnp.int32)
    if idx.shape[-1] < top_k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, top_k - idx.shape[-1])], constant_values=-1)
    return idx


# From this many scores per call (rows x entries) the top-k goes through ``topk_by_groups`` (the same
# positions). H200, decode rows (BENCHMARKS.md, issue 5, session 11): 1.84x faster at 8 x 262,144 and
# 2.70x at 8 x 1M, 1.01x at 8 x 65,536, 0.78-0.80x at one row of 64K / 256K; prefill chunks 4x.
GROUPED_TOPK_MIN = 1 << 21


def lightning_indexer(q, weights, keys, visible, *, top_k, candidate_blocks=None, block_size=8,
                      want_block_scores=False):
    s = index_scores(q, weights, keys, visible, candidate_blocks=candidate_blocks, block_size=block_size)
    bmax = block_max(s, block_size) if want_block_scores else None
    if s.size >= GROUPED_TOPK_MIN:
        topk = topk_by_groups(s, top_k, block_size, bmax)
    else:
        topk = topk_ascending(s, top_k)
    return IndexerResult(topk, bmax)


def select_candidate_blocks(block_scores, visible, topk_blocks: int, block_size: int):
    """Level one of the hierarchical indexer: keep the ``topk_blocks`` best blocks per query (block
    score = max of its masked position scores), always keeping the block that holds the newest
    visible position, and dropping picks whose score is -inf. Returns a [B,S,NB] bool mask."""
    nb = block_scores.shape[-1]
    last = (visible - 1) // block_size  # -1 when nothing is visible (then no block is forced)
    forced = jnp.arange(nb, dtype=jnp.int32)[None, None, :] == last[..., None]
    s = jnp.where(forced, jnp.inf, block_scores)
    k = min(topk_blocks, nb)
    vals, idx = jax.lax.top_k(s, k)
    keep = vals > -jnp.inf
    mask = jnp.zeros(s.shape, jnp.bool_)
    b, q = jnp.meshgrid(jnp.arange(s.shape[0]), jnp.arange(s.shape[1]), indexing="ij")
    return mask.at[b[..., None], q[..., None], idx].set(keep)
