"""V4.1 attention for a chunk of tokens at per-sequence positions (``shared/spec/attention.md`` §3,
§5, §9), written once for prefill (any chunk size, from any position), decode (S = 1) and
multi-token verification.

Per layer: low-rank query (no q-norm in V4.1), one shared 512-wide K=V head with RoPE on its last
dims, a sliding window of ``window_size`` tokens, and for ratio > 0 layers the shared compressed
cache of the layer's KV source, addressed by the lightning indexer's top-k (reused or re-indexed by
the layers in between, ``attention.md`` §9.1). Sparse attention with a sink, inverse RoPE on the
output, grouped ``wo_a`` then ``wo_b``.

Chunk semantics (the references implement only prefill from 0 and single-token decode; this is the
general form they are both cases of, ``attention.md`` §12.5): sequence b holds ``cache["pos"][b]``
tokens and this call adds ``lengths[b] <= S`` of them; tokens past ``lengths[b]`` are padding and
never reach a cache. A query at position t sees window positions ``t-W+1..t`` and compressed
entries ``j < (t+1)//m`` (complete blocks only); a block's entry is made when its last token
arrives, RoPE'd at its first position ``j*m``.

Decisions where the reference is silent or inconsistent:
* the index keys of a ratio-2 source are always its own (``fixtures/v41_tiny_a/README.md`` §9: the
  reference's decode path reads a stale slot; the fixture and we follow the consistent semantics);
* a top-k pick whose score is -inf (masked) is no pick (-1), also at re-index layers with fewer
  candidates than k (``attention.md`` §14.2).

V4 (``cfg.is_v4``, ``attention.md`` §3-§6), on the same code: per-head q RMS normalisation without
weight; every compressed layer compresses into its own cache (ratio 4 = CSA: overlapping windows,
``coff = 2``, the previous block's first half pooled with the current block's second half; other
ratios = HCA: non-overlapping, and attention reads every complete block); both carry the learned
in-block bias ``ape`` on the gate logits. CSA layers run their own lightning indexer whose keys come
from the indexer's own compressor (d = index_head_dim), with the Hadamard rotation on q and k before
the FP4 rounding (``RunOptions.hadamard``; off = transformers' ``deepseek_v4``, the HF comparison
mode). Reference KV rounding: FP8 (block 64) on the non-RoPE dims of window and compressed KV, RoPE
dims bf16; index q/k MXFP4 — stored as rounded values in plain arrays, as DeepSeek's V4 code does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lightning_indexer import lightning_indexer, select_candidate_blocks
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.window_kv import window_kv_write

from .config import ModelConfig
from .layers import grouped_linear, linear, linear_multi, norm, weight_of
from .options import RunOptions
from .quant import Fp4Tensor, Fp8Tensor, bf16_round, quantize_fp4_e4m3, quantize_fp8, quantize_mxfp4, round_to_dtype
from .quant.fake_quant import fake_quant_fp8, fake_quant_mxfp4
from .rope import apply_rope, layer_frequencies, rope_angles

_HI = jax.lax.Precision.HIGHEST


def _store_v4(x, kind: str, opts: RunOptions, rope_dim: int):
    """V4 cache values (``attention.md`` §3.2, §5.2, §7.1): reference mode rounds the non-RoPE dims
    to FP8 (block 64) and keeps the RoPE dims at bf16 (window and compressed KV), or rounds index
    keys/queries to MXFP4; the rounded values are kept in plain arrays of the compute dtype."""
    if not opts.quantized_kv:
        return x.astype(opts.kv_dtype)
    dt = opts.compute_dtype
    if kind == "index":
        return fake_quant_mxfp4(x, 32).astype(dt)
    nope = x.shape[-1] - rope_dim
    blk = 64 if nope % 64 == 0 else nope
    return jnp.concatenate([fake_quant_fp8(x[..., :nope], blk).astype(dt),
                            bf16_round(x[..., nope:]).astype(dt)], axis=-1)


def _hadamard_matrix(n: int):
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    return h / np.sqrt(np.float32(n))


def hadamard(x):
    """``x @ H_n / sqrt(n)`` over the last dim (Sylvester order; ``attention.md`` §2.4), fp32."""
    h = jnp.asarray(_hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=_HI).astype(x.dtype)


def head_rms_norm(q, eps: float):
    """V4's per-head RMS normalisation of q, without weight (``attention.md`` §3.1 step 3)."""
    qf = q.astype(jnp.float32)
    return (qf * jax.lax.rsqrt(jnp.mean(qf * qf, axis=-1, keepdims=True) + eps)).astype(q.dtype)


def cache_store(x, kind: str, opts: RunOptions):
    """Cache-storage form of ``x``: quantized in reference mode, plain otherwise."""
    if not opts.quantized_kv:
        return x.astype(opts.kv_dtype)
    if kind == "window":
        return quantize_fp8(x, (1, 32))
    if kind == "comp":
        return quantize_fp4_e4m3(x, 16)
    return quantize_mxfp4(x, 32)  # index keys / queries


def concat_rows(a, b):
    """Concatenate two stores along the row axis (1)."""
    if isinstance(a, (Fp8Tensor, Fp4Tensor)):
        return type(a)(data=jnp.concatenate([a.data, b.data], 1), scale=jnp.concatenate([a.scale, b.scale], 1),
                       block=a.block)
    return jnp.concatenate([a, b.astype(a.dtype)], 1)


def take_rows(store, idx):
    """store rows at idx [B, K] (clipped into range) -> [B, K, ...]."""
    def take(a):
        i = jnp.clip(idx, 0, a.shape[1] - 1)
        return jnp.take_along_axis(a, i.reshape(*i.shape, *([1] * (a.ndim - 2))), axis=1)
    return jax.tree.map(take, store)


def select_rows(mask, new, old):
    """where(mask [B,K], new, old) for stores."""
    def sel(n, o):
        return jnp.where(mask.reshape(*mask.shape, *([1] * (n.ndim - 2))), n, o)
    return jax.tree.map(sel, new, old)


def scatter_rows(store, idx, rows):
    """store[b, idx[b, k]] = rows[b, k]; out-of-range idx are dropped."""
    b = jnp.arange(idx.shape[0])[:, None]

    def put(a, r):
        return a.at[b, idx].set(r.astype(a.dtype), mode="drop")
    return jax.tree.map(put, store, rows)


def _window_positions(positions, window: int, valid_first: bool):
    """[..., W] positions of the window keys of each query position t, -1 where there is none (t < W-1).
    The order is DeepSeek's ``get_window_topk_idxs``: ``valid_first`` lists 0..t first and pads at
    the end (prefill; V4's decode), else t-W+1..t with the -1 slots first (V4.1's decode: the ring
    oldest slot first). Its sparse attention kernel rounds P.V by blocks of 64 keys of this list, so
    the order decides bf16 bits (pallas_kernels/sparse_attention/reference.py)."""
    k = jnp.arange(window, dtype=jnp.int32)
    if valid_first:
        a = jnp.maximum(positions[..., None] - window + 1, 0) + k
        return jnp.where(a <= positions[..., None], a, -1)
    a = positions[..., None] - window + 1 + k
    return jnp.where(a >= 0, a, -1)


def deepseek_window_width(pos0, lengths, window: int, S: int, opts: RunOptions):
    """[B] width of DeepSeek's window index list for a chunk of ``S`` tokens, where its 64-key blocks
    decide bf16 bits (``opts.running_max_block``; else None, as at decode, where DeepSeek's ring list
    is ``window`` wide like ours). DeepSeek prefills an L-token prompt in one call with a window list
    ``min(L, window)`` wide (``get_window_topk_idxs``) and starts the compressed list after it, where
    ours always has ``window`` slots. So a chunk from position 0 gets ``min(lengths, window)``: exact
    when the prompt is prefilled in one chunk (any prompt shorter than the window with the engine's
    chunks of >= 128 tokens). Chunks from later positions (a longer prompt's, verification) keep the
    full width: DeepSeek's code has no such calls."""
    if opts.running_max_block is None or S == 1:
        return None
    return jnp.where(pos0 == 0, jnp.minimum(lengths, window), window).astype(jnp.int32)


def window_indices(positions, pos0, window: int, valid_first: bool = True):
    """[B,S,W] indices into concat(ring[W], chunk[S]) of the window keys of each query."""
    a = _window_positions(positions, window, valid_first)
    slot = jnp.where(a >= pos0[:, None, None], window + a - pos0[:, None, None], jnp.mod(a, window))
    return jnp.where(a >= 0, slot, -1).astype(jnp.int32)


def ring_window_indices(positions, window: int, valid_first: bool = False):
    """[B,1,W] indices into the ring itself of the window keys of one query per row, once its own
    token is in the ring (:func:`write_ring_token`): positions in slots position % W."""
    a = _window_positions(positions, window, valid_first)
    return jnp.where(a >= 0, jnp.mod(a, window), -1).astype(jnp.int32)


def write_ring_token(ring, token, pos0, lengths, window: int):
    """Write one token per row ([B,1,...] store) into slot pos0 % W of the ring; rows with
    ``lengths == 0`` (idle) are left unchanged. Equal to :func:`update_ring` for one-token chunks. A
    scatter, not update_ring's select: XLA duplicates a select into the attention's gather fusion,
    which then reads the old ring again and the copy comes back (session 15, CPU HLO)."""
    slot = jnp.where(lengths > 0, jnp.mod(pos0, window), window)[:, None]  # window: out of range -> dropped
    return scatter_rows(ring, slot, token)


def update_ring(ring, chunk, pos0, lengths, window: int):
    """Write the valid chunk tokens into the ring (slot = position % W; the last token wins)."""
    end = pos0 + lengths  # [B]
    r = jnp.arange(window, dtype=jnp.int32)
    a = end[:, None] - 1 - jnp.mod(end[:, None] - 1 - r[None, :], window)  # newest position in slot r
    from_chunk = a >= pos0[:, None]
    rows = take_rows(chunk, a - pos0[:, None])
    return select_rows(from_chunk, rows, ring)


def compress(p, x, lc, pos0, lengths, m: int, cfg: ModelConfig, opts: RunOptions, *, overlap: bool = False,
             state: str = "state"):
    """The KV source's compressor over the chunk. Returns (latent [B,nb,Dh] pre-RoPE in x.dtype,
    entry index [B,nb], entry valid [B,nb], new state dict).

    ``p["ape"]`` (V4), when present, is added to the gate logits at each token's in-block position.
    ``overlap`` (V4 ratio 4): the projections are 2d wide and entry j pools, per channel, one softmax
    over the first halves of block j-1 and the second halves of block j (block -1 does not exist).
    The state ``{state}_kv`` / ``{state}_score`` holds the open block's tokens, preceded (overlap)
    by the last complete block: rows ``[lead + m, C]`` with ``lead = m if overlap else 0``."""
    B, S, _ = x.shape
    if m == 1:
        latent = norm(linear(x, p["wkv"]), p["norm"], cfg.norm_eps)
        j = jnp.arange(S, dtype=jnp.int32)[None, :]
        return latent, pos0[:, None] + j, j < lengths[:, None], {}
    # ratio > 1: softmax-gated pooling per channel, in fp32 (weights promoted to fp32)
    xf = x.astype(jnp.float32)
    kv = jnp.einsum("bsd,od->bso", xf, weight_of(p["wkv"]).astype(jnp.float32), precision=_HI)
    sc = jnp.einsum("bsd,od->bso", xf, weight_of(p["wgate"]).astype(jnp.float32), precision=_HI)
    if "ape" in p:
        tok_pos = pos0[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
        sc = sc + jnp.take(p["ape"].astype(jnp.float32), jnp.mod(tok_pos, m), axis=0)
    lead = m if overlap else 0  # rows of the previous (complete) block kept before the open one
    nb = -(-(S + m - 1) // m)
    b0 = pos0 // m
    r0 = pos0 - b0 * m  # tokens of the open block already in the state
    i = jnp.arange(lead + nb * m, dtype=jnp.int32)[None, :]
    c = i - lead - r0[:, None]
    from_state = i < (lead + r0)[:, None]
    from_chunk = (c >= 0) & (c < lengths[:, None])
    si = jnp.clip(i, 0, lead + m - 1)
    ci = jnp.clip(c, 0, S - 1)
    g = lambda a, idx: jnp.take_along_axis(a, idx[..., None], axis=1)  # noqa: E731
    skv, ssc = lc[f"{state}_kv"], lc[f"{state}_score"]
    buf_kv = jnp.where(from_state[..., None], g(skv, si), jnp.where(from_chunk[..., None], g(kv, ci), 0.0))
    buf_sc = jnp.where(from_state[..., None], g(ssc, si), jnp.where(from_chunk[..., None], g(sc, ci), -jnp.inf))
    j = jnp.arange(nb, dtype=jnp.int32)[None, :]
    complete = (j + 1) * m <= (r0 + lengths)[:, None]  # [B, nb]
    bk = buf_kv[:, lead:].reshape(B, nb, m, -1)
    bs = buf_sc[:, lead:].reshape(B, nb, m, -1)
    if overlap:  # block j-1's first halves + block j's second halves: 2m candidates per channel
        d = kv.shape[-1] // 2
        pk = buf_kv[:, : nb * m].reshape(B, nb, m, -1)
        ps = buf_sc[:, : nb * m].reshape(B, nb, m, -1)
        bk = jnp.concatenate([pk[..., :d], bk[..., d:]], axis=2)
        bs = jnp.concatenate([ps[..., :d], bs[..., d:]], axis=2)
    bs = jnp.where(complete[..., None, None], bs, 0.0)
    pooled = jnp.sum(bk * jax.nn.softmax(bs, axis=2), axis=2)
    latent = norm(pooled.astype(x.dtype), p["norm"], cfg.norm_eps)
    # the new state: [previous complete block (overlap)] + the open block, local positions full-lead .. e-1
    e = r0 + lengths
    full = (e // m) * m
    s = jnp.arange(lead + m, dtype=jnp.int32)[None, :]
    li = full[:, None] + s  # buffer rows
    keep = s < (lead + e - full)[:, None]
    li = jnp.clip(li, 0, lead + nb * m - 1)
    new_state = {
        f"{state}_kv": jnp.where(keep[..., None], g(buf_kv, li), 0.0),
        f"{state}_score": jnp.where(keep[..., None], g(buf_sc, li), -jnp.inf),
    }
    return latent, b0[:, None] + j, complete, new_state


def attention(p, x, l: int, cfg: ModelConfig, opts: RunOptions, cache_layers: dict, pos0, lengths, shared: dict, *,
              defer: bool = False):
    """One attention sub-layer. ``x`` [B,S,D] (after attn_norm). Returns (out [B,S,D], cache_layers
    with this layer's updates, shared runtime slots). ``defer``: ``out`` may be wo_b's K parts
    (a :class:`pallas_kernels.deferred_sum.DeferredSum`) for the mHC expansion kernel to sum."""
    B, S, _ = x.shape
    dtype = x.dtype
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    m = cfg.ratio(l)
    positions = pos0[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    freqs = layer_frequencies(cfg, l)
    ang = rope_angles(positions, freqs)
    act = cfg.fp8_block_size

    # one GEMV launch at decode sizes, and one split-K finish kernel that also applies q_norm
    qr, kv_lat = linear_multi(x, [p["wq_a"], p["wkv"]], act_block=act, norms=[p["q_norm"], None],
                              norm_eps=cfg.norm_eps)
    # wq_b and the layer's indexer wq_b read the same qr: one GEMV launch at decode sizes too
    if _indexes(p, l, m, cfg):
        q, qi_lin = linear_multi(qr, [p["wq_b"], p["indexer"]["wq_b"]], act_block=act,
                                 paths=["attn.wq_b", "attn.indexer.wq_b"])
    else:
        q, qi_lin = linear(qr, p["wq_b"], act_block=act, path="attn.wq_b"), None
    q = q.reshape(B, S, H, Dh)
    if cfg.is_v4:
        q = head_rms_norm(q, cfg.norm_eps)
    q = apply_rope(q, ang)

    lc = dict(cache_layers[str(l)])
    ring = lc["window"]
    if S == 1 and not cfg.is_v4 and isinstance(ring, Fp8Tensor) and tuple(ring.block) == (1, 32):
        # Decode with V4.1's FP8 window: norm, RoPE, quantization and the ring store as one op
        # (pallas_kernels.window_kv: the steps of the branch below, one kernel on a GPU). Idle
        # rows (lengths == 0) get slot W: out of range, their ring row is left unchanged.
        slot = jnp.where(lengths > 0, jnp.mod(pos0, W), W).astype(jnp.int32)
        lc["window"] = window_kv_write(kv_lat.reshape(B, -1), p["kv_norm"]["weight"], ang.reshape(B, -1), ring, slot,
                                       eps=cfg.norm_eps)
        window_kv = lc["window"]
        win_idx = ring_window_indices(positions, W)
    else:
        kv = norm(kv_lat, p["kv_norm"], cfg.norm_eps)
        kv = apply_rope(kv, ang)
        kv_chunk = _store_v4(kv, "window", opts, cfg.rope_head_dim) if cfg.is_v4 else cache_store(kv, "window", opts)
        if S == 1:
            # Decode: write the token into its ring slot first, then attend over the ring alone. Exact
            # for one token (the ring then holds positions t-W+1..t; the same rows in the same order as
            # the concatenation below), and the ring is updated in place: reading the old ring beside
            # the write made XLA copy it (and concatenate W + 1 rows) in every layer of every step (H200
            # HLO: 8 of the 14 copies of a 7-layer step; BENCHMARKS.md, issue 8, session 15). XLA's CPU
            # backend still copies: it widens the FP8 update to f16 and back.
            lc["window"] = write_ring_token(ring, kv_chunk, pos0, lengths, W)
            window_kv = lc["window"]
            win_idx = ring_window_indices(positions, W, valid_first=cfg.is_v4)
        else:
            window_kv = concat_rows(ring, kv_chunk)
            win_idx = window_indices(positions, pos0, W)
            lc["window"] = update_ring(ring, kv_chunk, pos0, lengths, W)
    cache_layers = {**cache_layers, str(l): lc}

    comp_kv, comp_idx = None, None
    if m > 0 and cfg.is_v4:
        lc, comp_kv, comp_idx, shared = _v4_compressed(p, x, qi_lin, l, m, cfg, opts, lc, pos0, lengths, positions,
                                                       ang, freqs, shared)
        cache_layers = {**cache_layers, str(l): lc}
    elif m > 0:
        src = cfg.kv_source_of(l)
        if src == l:
            with jax.named_scope("compressor"):
                latent, ent_idx, ent_valid, state = compress(p["compressor"], x, lc, pos0, lengths, m, cfg, opts)
            ent_pos = ent_idx * m
            eang = rope_angles(ent_pos, freqs)
            ix = p["indexer"]
            k = norm(linear(latent, ix["wk"]), ix["k_norm"], cfg.norm_eps)
            k = apply_rope(k, eang)
            latent = apply_rope(latent, eang)
            n_cap = jax.tree.leaves(lc["comp"])[0].shape[1]
            dst = jnp.where(ent_valid, ent_idx, n_cap)  # out of range -> dropped
            lc["index_k"] = scatter_rows(lc["index_k"], dst, cache_store(k, "index", opts))
            lc["comp"] = scatter_rows(lc["comp"], dst, cache_store(latent, "comp", opts))
            lc.update(state)
            cache_layers = {**cache_layers, str(l): lc}
        src_cache = cache_layers[str(src)]
        comp_kv = src_cache["comp"]
        if l in cfg.index_source_layers:
            ix = p["indexer"]
            qi = qi_lin.reshape(B, S, cfg.index_n_heads, cfg.index_head_dim)  # beside wq_b (_indexes)
            qi = apply_rope(qi, ang)
            qi = cache_store(qi, "index", opts) if opts.quantized_kv else qi
            wscale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
            weights = round_to_dtype(linear(x, ix["weights_proj"]) * wscale, dtype)
            visible = (positions + 1) // m
            is_cand_src = l == cfg.candidate_source_layer
            with jax.named_scope("indexer"):
                res = lightning_indexer(
                    qi, weights, src_cache["index_k"], visible, top_k=cfg.index_topk,
                    candidate_blocks=shared.get("candidates") if cfg.uses_candidates(l) else None,
                    block_size=max(cfg.candidate_block_size, 1), want_block_scores=is_cand_src,
                )
                if is_cand_src:
                    shared = {**shared, "candidates": select_candidate_blocks(
                        res.block_scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)}
            shared = {**shared, "topk": res.topk, f"topk_{l}": res.topk}
        comp_idx = shared["topk"]

    with jax.named_scope("sparse_attn"):
        o = sparse_attention(q, window_kv, win_idx, p["attn_sink"], scale=Dh ** -0.5, comp_kv=comp_kv,
                             comp_idx=comp_idx, running_max_block=opts.running_max_block,
                             window_width=deepseek_window_width(pos0, lengths, W, S, opts))
    o = apply_rope(o, ang, inverse=True)
    G, Lo = cfg.o_groups, cfg.o_lora_rank
    with jax.named_scope("wo_a"):
        o = grouped_linear(o.reshape(B, S, G, -1).astype(dtype), p["wo_a"], groups=G)
    out = linear(o.reshape(B, S, G * Lo), p["wo_b"], act_block=act, path="attn.wo_b", defer=defer)
    return out, cache_layers, shared


def _indexes(p, l: int, m: int, cfg: ModelConfig) -> bool:
    """Whether layer ``l`` runs its own lightning indexer (and so projects qr with the indexer's
    wq_b beside wq_b): V4.1's index-source layers, V4's CSA layers (ratio 4)."""
    if m <= 0 or "indexer" not in p:
        return False
    return cfg.overlap(l) if cfg.is_v4 else l in cfg.index_source_layers


def _v4_compressed(p, x, qi_lin, l, m, cfg: ModelConfig, opts: RunOptions, lc, pos0, lengths, positions, ang, freqs,
                   shared):
    """V4's compressed branch of layer ``l``: its own compressor into its own cache, then the key
    set — CSA (ratio 4): the top-k of its own indexer; HCA: every complete block. Returns (layer
    cache, compressed KV store, indices [B,S,K] (-1 = none), shared runtime slots). ``qi_lin``: the
    indexer's wq_b projection of qr [B, S, heads x dim] (CSA layers; computed beside wq_b)."""
    B, S, _ = x.shape
    lc = dict(lc)
    latent, ent_idx, ent_valid, state = compress(p["compressor"], x, lc, pos0, lengths, m, cfg, opts,
                                                 overlap=cfg.overlap(l))
    eang = rope_angles(ent_idx * m, freqs)  # entry j at its block's first position j*m
    latent = apply_rope(latent, eang)
    n_cap = lc["comp"].shape[1]
    dst = jnp.where(ent_valid, ent_idx, n_cap)  # out of range -> dropped
    lc["comp"] = scatter_rows(lc["comp"], dst, _store_v4(latent, "comp", opts, cfg.rope_head_dim))
    lc.update(state)
    visible = (positions + 1) // m  # complete blocks only
    if cfg.overlap(l):  # CSA: own lightning indexer over its own index-key compressor
        ix = p["indexer"]
        k, _, _, istate = compress(ix["compressor"], x, lc, pos0, lengths, m, cfg, opts, overlap=True,
                                   state="index_state")
        k = apply_rope(k, eang)
        if opts.hadamard:
            k = hadamard(k)
        lc["index_k"] = scatter_rows(lc["index_k"], dst, _store_v4(k, "index", opts, cfg.rope_head_dim))
        lc.update(istate)
        qi = qi_lin.reshape(B, S, cfg.index_n_heads, cfg.index_head_dim)
        qi = apply_rope(qi, ang)
        if opts.hadamard:
            qi = hadamard(qi)
        if opts.quantized_kv:
            qi = _store_v4(qi, "index", opts, cfg.rope_head_dim)
        wscale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        weights = round_to_dtype(linear(x, ix["weights_proj"]) * wscale, x.dtype)
        res = lightning_indexer(qi, weights, lc["index_k"], visible, top_k=min(cfg.index_topk, n_cap))
        comp_idx = res.topk
        shared = {**shared, "topk": comp_idx, f"topk_{l}": comp_idx}
    else:  # HCA: dense over all complete blocks
        j = jnp.arange(n_cap, dtype=jnp.int32)
        comp_idx = jnp.where(j[None, None, :] < visible[..., None], j[None, None, :], -1)
    return lc, lc["comp"], comp_idx, shared
