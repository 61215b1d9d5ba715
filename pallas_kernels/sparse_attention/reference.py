"""Pure-jnp definition of sparse attention with a sink (``shared/spec/attention.md`` §2.5, §9.5).

One shared K=V vector per slot (MQA). Keys come from two stores: the window (``kv``) and the
compressed cache (``comp_kv``), each addressed by an index list with -1 padding. Logits are fp32;
the sink is one extra logit with a zero value vector (in the denominator, not in the max); as in
DeepSeek's kernel, the unnormalised weights ``exp(l - m)`` are cast to ``q.dtype`` (bf16 in the real
model) before P·V, which accumulates in fp32, and the sum is divided by the fp32 denominator at the
end. The kernel takes ``m`` as a running maximum over blocks of 64 indices; here ``m`` is the row's
maximum, the same for every index list of up to 64 entries and for the blocks from the one holding
the maximum on (earlier blocks round their weights relative to a smaller maximum there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, exact_in_bf16

_HI = jax.lax.Precision.HIGHEST


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


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None):
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
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    den = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink.astype(jnp.float32)[None, None, :, None] - m)
    # DeepSeek's kernel casts the unnormalised exp(l - m) to bf16 for P.V and divides the fp32 sum at
    # the end; casting the normalised probability instead (before session 35) rounded every weight
    # differently: at one key per query, bf16(1 / den) against 1.0, a 2**-9 error on every attention
    # output, which the next FP8 activation fake-quants turned into differences in most elements of
    # the first layer's output (cross-checked against DeepSeek's V4.1 model code on the CPU)
    w = e.astype(dtype)
    out, k0 = 0.0, 0
    for rows, i in sets:
        k = i.shape[-1]
        out = out + jnp.einsum("bshk,bskd->bshd", w[..., k0:k0 + k], rows.astype(dtype),
                               preferred_element_type=jnp.float32, precision=_HI)
        k0 += k
    return (out / den).astype(dtype)
