"""Pure-jnp definition of sparse attention with a sink (``shared/spec/attention.md`` §2.5, §9.5).

One shared K=V vector per slot (MQA). Keys come from two stores: the window (``kv``) and the
compressed cache (``comp_kv``), each addressed by an index list with -1 padding. Logits are fp32;
the sink is one extra logit with a zero value vector (in the denominator, not in the max); as in
DeepSeek's kernel, the unnormalised weights ``exp(l - m)`` are cast to ``q.dtype`` (bf16 in the real
model) before P·V, which accumulates in fp32, and the sum is divided by the fp32 denominator at the
end. The kernel takes ``m`` as a running maximum over blocks of 64 indices of the
concatenated list (window, then compressed). By default ``m`` here is the row's maximum: the same
for lists of up to 64 entries and for the blocks from the one holding the maximum on. On request
(``running_max_block``) the reference emulates the running maximum, so that a key in an earlier
block is rounded relative to the smaller running maximum, as there; then the fp32 sums differ from
the kernel's in order only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, exact_in_bf16

_HI = jax.lax.Precision.HIGHEST
PV_PARTS = 3


def gather_rows(store, idx: jax.Array, dtype) -> jax.Array:
    """Rows of ``store`` ([B, N, D] plain, Fp8Tensor or Fp4Tensor) at ``idx`` [B, S, K] (-1 allowed,
    read as row 0) -> [B, S, K, D] in ``dtype``; quantized stores are dequantized after the gather."""
    safe = jnp.maximum(idx, 0)

    def take(a):
        return jax.vmap(lambda rows, i: rows[i])(a, safe)

    if isinstance(store, (Fp8Tensor, Fp4Tensor)):
        g = type(store)(data=take(store.data), scale=take(store.scale), block=store.block)
        return g.dequantize(dtype)
    return take(store).astype(dtype)


def running_max_factors(logits, m, block):
    """DeepSeek's kernel walks the index list in blocks of ``block`` keys with a running maximum. For
    logits [.., K] (-inf = no key) and the row maximum ``m`` [.., 1] (finite): each key's running
    maximum (that of the blocks up to its own) ``mk`` [.., K] and the factor ``exp(mk - m)`` [.., K]
    that the kernel's rescaling of its fp32 accumulator applies to that key's term (0 where ``mk`` is
    -inf: no valid key up to there, so the key's weight is 0 anyway)."""
    k = logits.shape[-1]
    nb = -(-k // block)
    lp = jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, nb * block - k)], constant_values=-jnp.inf)
    run = jax.lax.cummax(jnp.max(lp.reshape(*logits.shape[:-1], nb, block), axis=-1), axis=logits.ndim - 1)
    finite = jnp.isfinite(run)  # per block [.., nb], then spread to the block's keys

    def per_key(a):
        return jnp.repeat(a, block, axis=-1, total_repeat_length=nb * block)[..., :k]
    return per_key(jnp.where(finite, run, 0.0)), per_key(jnp.where(finite, jnp.exp(run - m), 0.0))


def deepseek_columns(kw: int, k: int, window_width):
    """Where DeepSeek's concatenated index list and ours differ. Ours is the window list (``kw``
    entries) then the compressed list; DeepSeek's prefill window list is ``min(L, window)`` wide for an
    L-token prompt (``get_window_topk_idxs``), so its compressed entries start at ``window_width`` [B]
    and its 64-key blocks hold other keys than ours. The window entries at and beyond
    ``window_width`` are -1 in both (valid entries first). Returns, per batch row, the column of our
    list that each of DeepSeek's columns holds (``to_ds`` [B, K]; >= K: none, a -inf logit) and the
    column of DeepSeek's list that each of ours is (``from_ds`` [B, K]; the unused window columns map
    onto themselves)."""
    c = jnp.arange(k, dtype=jnp.int32)[None, :]
    ww = jnp.asarray(window_width, jnp.int32).reshape(-1, 1)
    shift = kw - ww
    return jnp.where(c < ww, c, c + shift), jnp.where(c < kw, c, c - shift)


def _take_columns(x, cols, fill):
    """x [B, S, H, K] -> x[b, s, h, cols[b, c]] (cols [B, K']; a column >= K reads ``fill``)."""
    k = x.shape[-1]
    safe = jnp.minimum(cols, k - 1)[:, None, None, :]
    got = jnp.take_along_axis(x, jnp.broadcast_to(safe, (*x.shape[:3], cols.shape[-1])), axis=-1)
    return jnp.where((cols < k)[:, None, None, :], got, fill)


def split_bf16(p, parts: int):
    """fp32 ``p`` as ``parts`` bf16 terms whose fp32 sum is ``p`` (3 parts: exactly, bar subnormal
    remainders; 2 parts: to 2**-16 relative), stacked on a new axis -3 (before the head axis)."""
    terms = []
    for _ in range(parts - 1):
        t = p.astype(jnp.bfloat16)
        terms.append(t)
        p = p - t.astype(jnp.float32)
    terms.append(p.astype(jnp.bfloat16))
    return jnp.stack(terms, axis=-3)


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, running_max_block=None,
                     window_width=None, pv_parts=PV_PARTS):
    """``running_max_block``: emulate the kernel's running maximum over blocks of that many keys of
    the concatenated index list (window, then compressed; DeepSeek's: 64) when the weights are
    rounded (bf16 q) and the list is longer than one block; None (the default) rounds every weight
    relative to the row's maximum. The emulation costs 20-40 % of the op's time on an H200
    (BENCHMARKS.md, issue 5, session 36), hence opt-in (``RunOptions.attention_rounding``).
    ``window_width`` (int or int32 [B]; None = the whole window list): how many leading entries of
    each batch row's window list DeepSeek's list holds; later window entries are ignored, and under
    the emulation the blocks run over DeepSeek's list, whose compressed entries start there
    (:func:`deepseek_columns`: a prompt shorter than the window).
    ``pv_parts``: bf16 terms per rescaled weight in P·V under the emulation (see :func:`split_bf16`)."""
    dtype = q.dtype
    has_comp = comp_kv is not None and comp_idx is not None and comp_idx.shape[-1] > 0
    # bf16 q and keys that are exact in bf16: the rows are gathered in bf16 and the logits are one
    # bf16 x bf16 dot with fp32 accumulation -- every product is exact in fp32, so this equals the
    # fp32 logits up to the fp32 summation order, at half the gathered bytes and on the tensor cores
    # (the fp32 path ran as a SIMT fp32 GEMM: 3.7 ms per layer of a 4096-token prefill on an H200)
    low = dtype == jnp.bfloat16 and exact_in_bf16(kv) and (not has_comp or exact_in_bf16(comp_kv))
    rdt = jnp.bfloat16 if low else jnp.float32
    # the two key sets stay apart (no [B, S, K, D] concatenation of gathered rows): logits per set,
    # one softmax over both, P.V per set summed in fp32
    sets = [(gather_rows(kv, kv_idx, rdt), kv_idx)]
    if has_comp:
        sets.append((gather_rows(comp_kv, comp_idx, rdt), comp_idx))

    def qk(rows):
        if low:
            return jnp.einsum("bshd,bskd->bshk", q, rows, preferred_element_type=jnp.float32)
        return jnp.einsum("bshd,bskd->bshk", q.astype(jnp.float32), rows, precision=_HI)

    logits = jnp.concatenate([qk(r) for r, _ in sets], axis=-1) * scale
    valid = jnp.concatenate([i for _, i in sets], axis=-1) >= 0  # [B,S,K]
    kw = kv_idx.shape[-1]
    if window_width is not None:
        ww = jnp.broadcast_to(jnp.asarray(window_width, jnp.int32), (q.shape[0],))
        col = jnp.arange(valid.shape[-1], dtype=jnp.int32)
        valid = valid & ~((col >= ww[:, None]) & (col < kw))[:, None, :]
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    k_all = logits.shape[-1]
    emulate = running_max_block is not None and dtype != jnp.float32 and k_all > running_max_block
    if emulate:
        # the kernel rounds exp(l - m_b) to bf16, m_b the running maximum after the key's block, and
        # rescales its fp32 accumulator by exp(m_b - m_b') from block to block: a key's term is
        # bf16(exp(l - m_b)) * exp(m_b - m) * v. The rescaled weight is fp32; P.V takes it as
        # pv_parts bf16 terms stacked beside the heads (one GEMM with pv_parts x H rows: the gathered
        # rows are read once)
        if window_width is not None and has_comp:
            to_ds, from_ds = deepseek_columns(kw, k_all, ww)
            mk, f = running_max_factors(_take_columns(logits, to_ds, -jnp.inf), m, running_max_block)
            mk, f = _take_columns(mk, from_ds, 0.0), _take_columns(f, from_ds, 0.0)
        else:
            mk, f = running_max_factors(logits, m, running_max_block)
        e = jnp.exp(logits - mk)
        w = split_bf16(e.astype(dtype).astype(jnp.float32) * f, pv_parts)  # [B,S,P,H,K]
        w = w.reshape(*w.shape[:2], -1, k_all)
        den = jnp.sum(e * f, axis=-1, keepdims=True)
    else:
        e = jnp.exp(logits - m)
        # DeepSeek's kernel casts the unnormalised exp(l - m) to bf16 for P.V and divides the fp32 sum
        # at the end; casting the normalised probability instead (before session 35) rounded every
        # weight differently: at one key per query, bf16(1 / den) against 1.0, a 2**-9 error on every
        # attention output, which the next FP8 activation fake-quants turned into differences in most
        # elements of the first layer's output (cross-checked against DeepSeek's V4.1 model code)
        w = e.astype(dtype)
        den = jnp.sum(e, axis=-1, keepdims=True)
    den = den + jnp.exp(sink.astype(jnp.float32)[None, None, :, None] - m)
    out, k0 = 0.0, 0
    for rows, i in sets:
        k = i.shape[-1]
        out = out + jnp.einsum("bshk,bskd->bshd", w[..., k0:k0 + k], rows.astype(dtype),
                               preferred_element_type=jnp.float32, precision=_HI)
        k0 += k
    if emulate:
        out = out.reshape(*out.shape[:2], pv_parts, -1, out.shape[-1])
        out = sum(out[:, :, j] for j in reversed(range(pv_parts)))  # smallest terms first
    return (out / den).astype(dtype)
