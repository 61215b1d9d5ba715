"""Pallas-Triton kernel: sparse MQA with an attention sink, FP8 window + FP4 compressed KV.

One kernel covers decode (S = 1), speculative verify (S = 6) and prefill: every query row (b, s)
has its own index lists, so the grid is ``(B*S, H // block_h * d_split, num_splits)``:

* axis 0 — one query row (token);
* axis 1 — a block of ``block_h`` heads (the dot's M dimension; 16..64) and, with ``d_split`` > 1,
  a block of D / d_split output columns (the logits still use all of D);
* axis 2 — flash-decoding split of the key lists: split ``p`` handles the ``p``-th slice of the
  window list *and* the ``p``-th slice of the compressed list, so work stays balanced. With more
  than one split the kernel writes unnormalised partials (acc, running max, running sum) and a
  small jnp epilogue merges them together with the sink. Splits are used only when the first two
  axes give too few programs to fill the GPU (small batch decode).

Inside a program the keys are gathered by index vector, whole rows at a time
(``ref[ids[:, None], cols[None, :]]`` with explicit 2-D index arrays, pallas_triton.md §3 rule 5;
contiguous along the row so the loads vectorise), ``block_k`` rows per step, dequantized in
registers and fed to one 2-D dot for the logits and one for P·V (rule 8).

Dequantization (all exact in bf16, attention.md §2.3):
* window FP8: ``e4m3fn`` data (rule 9: fn, not fnuz) times ``2^(s-127)`` from the ue8m0 scale byte,
  built with integer ops as the float bit pattern ``s << 23``; the [rows, D/32] scales are
  broadcast to [rows, D] with a broadcast + reshape;
* compressed FP4: the packed codes read as 32-bit words; one shift-mask-or places codes j and j + 4
  of a word into the two f16 halves of a word (``e2m1 * 2**-14``, exact: the fused MoE's and the
  indexer's word decode), times the ``e4m3fn`` scale of the 16-element block, and the 8 phases are
  joined back into element order by three levels of 2-way ``stack`` on the last axis (Triton
  ``tt.join``) + reshape. Since session 38, in place of the arithmetic e2m1 decode of §3.1: the sm_90
  compressed-list loop 4,006 -> 2,060 instructions per 64-key prefill step offline (2,577 with a
  byte-wise e4m3-placement decode).

Numerics: logits fp32 (bf16 × bf16 products are exact in fp32; f32 inputs use an IEEE f32 dot),
online softmax in fp32, the probabilities cast to ``q.dtype`` before P·V, fp32 accumulation, the
sink added to the denominator at the end (not to the max). Like DeepSeek's kernel it casts
``exp(l - m_running)`` and divides at the end. With ``block_k=64`` and one split its loop is
DeepSeek's (the ``kernel_blocks`` rounding, ``api.sparse_attention(running_max_block=64)``); with
other tilings, and against the reference's default row maximum, bf16 results agree exactly where the
running maximum is the final one and to bf16 rounding elsewhere; f32 results to ~1e-6.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
from dsv41_jax.quant.codecs import le_words
from pallas_kernels.quantized_matmul.pallas_triton_fma import fp4_word_pairs_f32
from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fixes)

__all__ = ["sparse_attention", "unsupported_reason", "default_config", "combine_splits", "combine_reason"]

_NEG_INF = float("-inf")


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _gpu_vendor() -> str:
    try:
        dev = jax.devices()[0]
    except Exception:  # pragma: no cover
        return "cuda"
    if dev.platform == "gpu":
        kind = getattr(dev, "device_kind", "") or ""
        return "rocm" if "gfx" in kind.lower() or "amd" in kind.lower() else "cuda"
    return dev.platform


# Per-vendor launch parameters (pallas_triton.md §3 rule 13). ROCm: wave64, 1 stage by default.
_VENDOR_CONFIG = {
    "cuda": dict(num_warps=4, num_stages=2),
    "rocm": dict(num_warps=4, num_stages=1),
}


# Fewest query rows (B*S) of a prefill chunk: from here 'auto' runs this kernel (under either rounding;
# see :func:`auto_reason`) and :func:`default_config` takes DeepSeek's 64-key blocks.
KERNEL_BLOCKS_MIN_ROWS = 256


def default_config(batch_rows: int, heads: int, kw: int, kc: int, vendor: str | None = None, d: int = 512,
                   d_split: int | None = None) -> dict:
    """Block sizes and splits for ``batch_rows`` = B*S query rows (decode or prefill).

    H200 sweeps (BENCHMARKS.md, issue 5): all 64 heads in one program with 8 warps beat 32-head
    blocks with 4 warps by ~4x at batch 1 (one gather of each key row instead of two). When the grid
    is still one program per flash-decoding split (batch 1), eight column blocks with 4 warps
    (``d_split`` 8) ran 28.6 -> 16.7 us (session 13); at batch 8 the best split gained 8 % and at
    batch 64 every split lost, so only the smallest grids took it until session 55; since then (an
    H100, the op alone by device time) grids of 4+ key splits over more than 16 programs (batch 8 and
    32, 6 verify rows) take 2 column blocks with 4 warps: batch 8 46.5 -> 27.7 us, batch 32 132.5
    -> 64.4-64.7, while batch 64 (2 splits) ran 112.2 that way against 89.6-92.3 as before. A
    ``d_split`` given by the caller is kept, with 4 warps when it splits (better in 5 of the 6
    measured split and batch cases) and 8 when it does not. From :data:`KERNEL_BLOCKS_MIN_ROWS` rows
    (prefill chunks, one split) the blocks are 64 keys, DeepSeek's: the site ran 1.46-1.49x XLA's
    with them against 1.29-1.32x with 32 (H200, session 37), and in the model's 4,096-token prefill
    the kernel took 153.1 ms in 64-key blocks (with DeepSeek's shifted window blocks) against 162.3 ms
    in 32-key ones (H100, session 41);
    predicted -9 ms per such prompt, not yet timed as this default."""
    vendor = vendor or _gpu_vendor()
    block_h = min(heads, 64) if heads >= 16 else 16
    block_k = 64 if batch_rows >= KERNEL_BLOCKS_MIN_ROWS else 32
    programs = batch_rows * max(1, heads // block_h)
    longest = max(kw, kc)
    num_splits = 1
    # Flash-decoding split only while the grid is well below one wave of ~132 SMs.
    while programs * num_splits * 2 <= 132 and longest // (num_splits * 2) >= block_k:
        num_splits *= 2
    cfg = dict(block_h=block_h, block_k=block_k, num_splits=num_splits)
    cfg.update(_VENDOR_CONFIG.get(vendor, _VENDOR_CONFIG["cuda"]))
    if d_split is None:
        small = block_h >= 64 and programs * num_splits <= 16 and d % 8 == 0 and (d // 8) % 32 == 0
        # 4+ splits over more than 16 programs (batch 8 and 32 at V4.1's lists: 16 and 4 splits):
        # two column blocks with 4 warps; 64 heads with 8 warps and one column block took 46.5 / 132.5 us
        # there against 27.7 / 64.4-64.7 (H100, op alone, session 55). Batch 64 (2 splits) keeps
        # one column block with 8 warps: 89.6-92.3 us against 112.2 for two with 4 warps.
        wide = block_h >= 64 and num_splits >= 4 and programs * num_splits > 16 and d % 64 == 0
        d_split = 8 if small else 2 if wide else 1
    cfg["d_split"] = d_split
    if block_h >= 64:
        cfg["num_warps"] = 4 if cfg["d_split"] > 1 else 8
    return cfg


def unsupported_reason(q, kv, kv_idx, comp_kv=None, comp_idx=None) -> str | None:
    """None when the kernel supports these inputs, else a readable reason."""
    if q.ndim != 4:
        return f"q must be [B,S,H,D], got shape {tuple(q.shape)}"
    b, s, h, d = q.shape
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        return f"q dtype {q.dtype} is not bf16 or f32"
    if not _is_pow2(d) or d < 64:
        return f"head dim D={d} must be a power of two >= 64 (Triton blocks are powers of two; D/2 >= 32)"
    if not _is_pow2(h) and h % 32:
        return f"H={h} heads must be a power of two or a multiple of 32"
    if isinstance(kv, Fp8Tensor):
        if kv.data.dtype != jnp.float8_e4m3fn:
            return f"window FP8 data must be float8_e4m3fn (OCP), got {kv.data.dtype}"
        if tuple(kv.block) != (1, 32):
            return f"window FP8 block must be (1, 32), got {kv.block}"
        if kv.data.shape[-1] != d or kv.data.ndim != 3 or kv.data.shape[0] != b:
            return f"window FP8 data shape {tuple(kv.data.shape)} does not match q (B={b}, D={d})"
    elif isinstance(kv, Fp4Tensor):
        return "an FP4 window cache is not supported (the window is FP8 or plain)"
    else:
        if kv.ndim != 3 or kv.shape[0] != b or kv.shape[-1] != d:
            return f"window kv shape {tuple(kv.shape)} does not match q (B={b}, D={d})"
        if kv.dtype != q.dtype:
            return f"plain window kv dtype {kv.dtype} differs from q dtype {q.dtype}"
    if kv_idx.shape[:2] != (b, s):
        return f"kv_idx shape {tuple(kv_idx.shape)} does not match q [B={b}, S={s}]"
    if comp_kv is not None and comp_idx is not None:
        if comp_idx.shape[:2] != (b, s):
            return f"comp_idx shape {tuple(comp_idx.shape)} does not match q [B={b}, S={s}]"
        if isinstance(comp_kv, Fp4Tensor):
            if comp_kv.block != 16 or comp_kv.scale.dtype != jnp.float8_e4m3fn:
                return (f"compressed FP4 cache must have block 16 with e4m3 scales, got block {comp_kv.block}, "
                        f"scale {comp_kv.scale.dtype}")
            if comp_kv.packing != "nibbles":
                return f"compressed FP4 codes are packed as {comp_kv.packing!r}; the kernel decodes the nibble layout"
            if comp_kv.data.shape[-1] * 2 != d or comp_kv.data.shape[0] != b:
                return f"compressed FP4 data shape {tuple(comp_kv.data.shape)} does not match q (B={b}, D={d})"
        elif isinstance(comp_kv, Fp8Tensor):
            return "an FP8 compressed cache is not supported (the compressed cache is FP4 or plain)"
        else:
            if comp_kv.ndim != 3 or comp_kv.shape[0] != b or comp_kv.shape[-1] != d:
                return f"compressed kv shape {tuple(comp_kv.shape)} does not match q (B={b}, D={d})"
            if comp_kv.dtype != q.dtype:
                return f"plain compressed kv dtype {comp_kv.dtype} differs from q dtype {q.dtype}"
    return None


# ------------------------------------------------------------------------------------------------
# in-kernel decoders (integer ops only)


def _e8m0_to_f32(s):
    """ue8m0 byte (uint8/int32 array) -> 2^(s-127) as f32, built as the bit pattern s << 23."""
    return jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)


# ------------------------------------------------------------------------------------------------
# kernel


def _expand_cols(x, width):
    """[N, G] per-group values -> [N, G*width] (each repeated ``width`` times): broadcast + reshape."""
    n, g = x.shape
    return jnp.broadcast_to(x[:, :, None], (n, g, width)).reshape(n, g * width)


def _grid2(ids, cols):
    """Explicit 2-D index arrays (the Triton lowering does not broadcast [K,1] x [1,C] itself)."""
    shape = (ids.shape[0], cols.shape[0])
    return jnp.broadcast_to(ids[:, None], shape), jnp.broadcast_to(cols[None, :], shape)


def _fp8_load(data_ref, scale_ref, ids, first, width):
    """The raw bytes of window rows ``ids`` of an FP8 store, columns [first, first + width): rows
    gathered whole (contiguous along the row) and their ue8m0 scale bytes, one per 32 columns."""
    cols = first + jnp.arange(width, dtype=jnp.int32)
    return data_ref[_grid2(ids, cols)], scale_ref[_grid2(ids, first // 32 + jnp.arange(width // 32, dtype=jnp.int32))]


def _fp8_decode(raw, cdt):
    """:func:`_fp8_load`'s bytes dequantized to ``cdt`` (the scale broadcast in registers)."""
    data, scale = raw
    return (data.astype(jnp.float32) * _expand_cols(_e8m0_to_f32(scale), 32)).astype(cdt)


def _plain_load(ref, ids, first, width):
    """Rows ``ids`` of a plain store, columns [first, first + width)."""
    return ref[_grid2(ids, first + jnp.arange(width, dtype=jnp.int32))]


def _plain_decode(raw, cdt):
    return raw.astype(cdt)


def _fp4_load(words_ref, scale_ref, ids, first, width):
    """The raw codes of rows ``ids`` of an FP4 store, columns [first, first + width): 32-bit words
    (element 8w + j in nibble j) and the e4m3 scales, one per 16 columns."""
    return (words_ref[_grid2(ids, first // 8 + jnp.arange(width // 8, dtype=jnp.int32))],
            scale_ref[_grid2(ids, first // 16 + jnp.arange(width // 16, dtype=jnp.int32))])


def _fp4_decode(raw, cdt):
    """:func:`_fp4_load`'s codes dequantized to ``cdt``: one shift-mask-or places codes j and j + 4 of
    a word into the f16 halves of a word (e2m1 * 2**-14, exact; the fused MoE's and the indexer's word
    decode), times the e4m3 scale of their 16-element block (2 words), and three levels of 2-way
    joins (tt.join) put the 8 phases back in element order."""
    wds, sc = raw  # [N, width / 8], [N, width / 16]
    sc = _expand_cols(sc.astype(jnp.float32) * (2.0 ** 14), 2)  # [N, width / 8]: one scale per 2 words
    e = [None] * 8  # e[j]: element 8w + j of every word w
    for j, (lo, hi) in enumerate(fp4_word_pairs_f32(wds)):
        e[j], e[j + 4] = (lo * sc).astype(cdt), (hi * sc).astype(cdt)
    # [N, width / 8, x, y, z] holds element 8w + 4x + 2y + z: Triton stacks on the last axis only, so
    # the slowest of the three (x: j and j + 4) is joined first
    a = jnp.stack([jnp.stack([e[0], e[4]], axis=-1), jnp.stack([e[2], e[6]], axis=-1)], axis=-1)
    c = jnp.stack([jnp.stack([e[1], e[5]], axis=-1), jnp.stack([e[3], e[7]], axis=-1)], axis=-1)
    return jnp.stack([a, c], axis=-1).reshape(wds.shape[0], 8 * wds.shape[1])


STORE_CODECS = {"fp8": (_fp8_load, _fp8_decode), "plain": (_plain_load, _plain_decode),
                "fp4": (_fp4_load, _fp4_decode)}  # (load, decode) per store kind


def store_reader(refs, kind: str):
    """The next refs of a kernel's ``refs`` iterator for a store of ``kind`` ("fp8" and "fp4": data
    and scale, "plain": one) -> ``(load, decode)``: ``load(ids, first, width)`` its raw rows,
    ``decode(raw, cdt)`` them dequantized; ``read_rows(reader)`` composes the two."""
    load, decode = STORE_CODECS[kind]
    bound = (next(refs), next(refs)) if kind != "plain" else (next(refs),)
    return functools.partial(load, *bound), decode


def read_rows(reader):
    """``(ids, first, width, cdt) -> [N, width]`` rows of a :func:`store_reader` store, in ``cdt``."""
    load, decode = reader
    return lambda ids, first, width, cdt: decode(load(ids, first, width), cdt)


def _kernel(*refs, has_comp, w_fp8, c_fp4, scale, block_k, d, nw_blocks, nc_blocks, split_out, cdt, prec, d_split=1,
            in_kernel_combine=False, num_splits=1, interpret=False, shift=False):
    it = iter(refs)
    q_ref = next(it)
    widx_ref = next(it)
    ww_ref = next(it) if shift else None
    window_rows = read_rows(store_reader(it, "fp8" if w_fp8 else "plain"))
    if has_comp:
        cidx_ref = next(it)
        comp_rows = read_rows(store_reader(it, "fp4" if c_fp4 else "plain"))
    sink_ref = next(it)
    if in_kernel_combine:
        next(it)  # the zeroed counters (input side; the aliased output ref below is the same buffer)
        acc_ref, m_ref, l_ref, cnt_ref, o_ref = next(it), next(it), next(it), next(it), next(it)
    elif split_out:
        acc_ref, m_ref, l_ref = next(it), next(it), next(it)
    else:
        o_ref = next(it)

    split = pl.program_id(2)
    dv = d // d_split  # output columns of this program (d_split > 1: the value part of D is split)
    c0 = (pl.program_id(1) % d_split) * dv if d_split > 1 else 0
    q = q_ref[...].astype(cdt)  # [BH, D], contiguous
    bh = q.shape[0]

    def softmax_step(carry, part):
        """One block of keys: ``part`` = (k, v, valid)."""
        m, l, acc = carry
        k, v, valid = part
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=prec)
        s = jnp.where(valid[None, :], s * scale, _NEG_INF)  # [BH, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(cdt), v, preferred_element_type=jnp.float32, precision=prec)
        return m_new, l, acc

    lanes = jnp.arange(block_k, dtype=jnp.int32)

    def part(rows_of, ids, valid):
        ids = jnp.where(valid, ids, 0)
        k = rows_of(ids, 0, d, cdt)  # the logits need every column
        v = k if d_split == 1 else rows_of(ids, c0, dv, cdt)  # P.V only this program's columns
        return k, v, valid

    def body(rows_of, idx_ref, blocks):
        def step(i, carry):
            start = (split * blocks + i) * block_k
            ids = idx_ref[pl.ds(start, block_k)]
            return softmax_step(carry, part(rows_of, ids, ids >= 0))
        return step

    def comp_at(first):
        """(ids, valid) of the ``block_k`` compressed-list entries from position ``first`` (>= -nw*bk:
        under ``shift`` the wrapper pads the list with nw*bk -1 entries at both ends)."""
        ids = cidx_ref[pl.ds(first + nw_blocks * block_k, block_k)]
        return ids, ids >= 0

    def shifted_window_step(i, carry):
        """Block i of DeepSeek's list, whose window list is ``ww`` entries wide: window entries
        [i*bk, min((i+1)*bk, ww)), and where the block reaches past ``ww``, compressed entries from
        position i*bk - ww on."""
        ids = widx_ref[pl.ds(i * block_k, block_k)]
        win = part(window_rows, ids, (ids >= 0) & (i * block_k + lanes < ww))
        if not has_comp:
            return softmax_step(carry, win)

        def straddle(c):
            # lane l holds list position i*bk + l: a window entry below ww, else compressed entry
            # i*bk + l - ww, which is lane l of comp_at(i*bk - ww) (the list's -1 padding fills the
            # lanes below ww). The two lane sets are disjoint, so one [bk, D] tile takes each lane's
            # row and the block is one step of one dot, as in DeepSeek's loop. (Two dots, one per
            # part, needed 262,144 bytes of shared memory on the H100 with jax 0.11.2 -- over its
            # 232,448 -- BENCHMARKS.md, issue 5, session 41.)
            kw_, vw_, w_valid = win
            kc_, vc_, c_valid = part(comp_rows, *comp_at(i * block_k - ww))
            k = jnp.where(w_valid[:, None], kw_, kc_)
            v = k if d_split == 1 else jnp.where(w_valid[:, None], vw_, vc_)
            return softmax_step(c, (k, v, w_valid | c_valid))

        return jax.lax.cond((i + 1) * block_k > ww, straddle, lambda c: softmax_step(c, win), carry)

    def shifted_comp_step(j, carry):
        """The compressed entries after those in the window's blocks: from position nw*bk - ww on."""
        return softmax_step(carry, part(comp_rows, *comp_at(nw_blocks * block_k - ww + j * block_k)))

    carry = (
        jnp.full((bh,), _NEG_INF, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
        jnp.zeros((bh, dv), jnp.float32),
    )
    if shift:  # one split (checked by the wrapper): the blocks of DeepSeek's list
        ww = ww_ref[0]
        carry = jax.lax.fori_loop(0, nw_blocks, shifted_window_step, carry)
        if has_comp and nc_blocks:
            carry = jax.lax.fori_loop(0, nc_blocks, shifted_comp_step, carry)
    else:
        if nw_blocks:
            carry = jax.lax.fori_loop(0, nw_blocks, body(window_rows, widx_ref, nw_blocks), carry)
        if has_comp and nc_blocks:
            carry = jax.lax.fori_loop(0, nc_blocks, body(comp_rows, cidx_ref, nc_blocks), carry)
    m, l, acc = carry

    if in_kernel_combine:
        _combine_in_kernel(acc, m, l, acc_ref, m_ref, l_ref, cnt_ref, sink_ref, o_ref, c0=c0, d_split=d_split,
                           num_splits=num_splits, interpret=interpret)
    elif split_out:
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        sink = sink_ref[...]
        m_safe = jnp.where(m == _NEG_INF, 0.0, m)
        den = l + jnp.exp(sink - m_safe)
        inv = jnp.where(m == _NEG_INF, 0.0, 1.0 / den)
        o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)


def _combine_in_kernel(acc, m, l, acc_ref, m_ref, l_ref, cnt_ref, sink_ref, o_ref, *, c0, d_split, num_splits,
                       interpret):
    """``combine="kernel"``: every split program stores its partials (acc [bh, dv], m and l [bh]) into
    the full-array scratch outputs, then increments the counter of its (row, head / column block);
    the program that reads ``num_splits - 1`` there came last and merges all the splits' partials
    with the sink into the output block: the merge of :func:`_xla_combine`, the splits summed in
    the order 0..P-1, so the result does not depend on which program came last.

    Ordering: the barrier puts every thread's partial stores before the counter increment, which
    Triton emits with acquire-release semantics at GPU scope; the last program's increment reads
    the value every other program's increment wrote (one release sequence), so their stores are
    visible to the loads after it. The partials are loaded with the ``cg`` cache modifier (from L2, not the SM's L1)."""
    r, j, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bh, dv = acc.shape
    h0 = (j // d_split) * bh
    heads, cols = pl.ds(h0, bh), pl.ds(c0, dv)
    acc_ref[r, p, heads, cols] = acc
    m_ref[r, p, heads] = m  # the same values from every column block of this head block
    l_ref[r, p, heads] = l
    if not interpret:  # interpret mode runs the programs one after another (and has no barrier rule)
        pltriton.debug_barrier()
    slot = r * pl.num_programs(1) + j
    # a scalar atomic: one thread performs it (after a GPU-scope fence) and Triton broadcasts the old
    # value to the program's threads through shared memory. The [1]-shaped tensor form used before
    # gave non-finite outputs on the H200 (session 23); this form is correct there (session 24:
    # counters equal to the split count, partials equal to the XLA path's, output within the
    # reference's tolerance at 2, 8 and 16 splits).
    old = pltriton.atomic_add(cnt_ref, (slot,), jnp.int32(1))

    @pl.when(old == num_splits - 1)
    def _():
        cg = {} if interpret else dict(cache_modifier=".cg")  # triton_compat makes jax 0.11.2 take it
        o = _merge_splits(pltriton.load(m_ref.at[r, :, heads], **cg), pltriton.load(l_ref.at[r, :, heads], **cg),
                          sink_ref[...], lambda q: pltriton.load(m_ref.at[r, q, heads], **cg),
                          lambda q: pltriton.load(acc_ref.at[r, q, heads, cols], **cg), num_splits, (bh, dv))
        o_ref[...] = o.astype(o_ref.dtype)


# Splits whose partials the merge loads together before adding them (the loads of a group are
# independent, so they are in flight at once): session 24 measured the in-kernel merge with one load
# at a time (a fori_loop) at 13.4 µs for 16 splits, about one L2 round trip per split. A group of G
# [64, 64] f32 tiles holds 32 G registers per thread at 4 warps; 1 = the loop.
MERGE_GROUP = 4


def _merge_splits(m, l, sink, m_of, acc_of, num_splits: int, shape, group: int | None = None):
    """The flash-decoding merge inside a kernel: running maxima ``m`` and sums ``l`` [P, bh] of the
    P splits, the sink [bh], ``m_of(p)`` / ``acc_of(p)`` that split's [bh] maxima and [bh, dv]
    accumulator -> the output tile [bh, dv] in f32 (0 for a head whose splits are all empty). The
    splits are added in order 0..P-1 whatever ``group`` (default :data:`MERGE_GROUP`): with
    ``group`` > 1 the loop is unrolled and each group of splits is loaded before it is added."""
    mx = jnp.max(m, axis=0)
    mxs = jnp.where(mx == _NEG_INF, 0.0, mx)
    den = jnp.sum(jnp.exp(m - mxs[None, :]) * l, axis=0) + jnp.exp(sink - mxs)  # exp(-inf) = 0: empty splits
    inv = jnp.where(mx == _NEG_INF, 0.0, 1.0 / den)
    group = MERGE_GROUP if group is None else group
    o = jnp.zeros(shape, jnp.float32)
    if group <= 1:
        def body(p, o):
            return o + jnp.exp(m_of(p) - mxs)[:, None] * acc_of(p)

        o = jax.lax.fori_loop(0, num_splits, body, o)
    else:
        for g in range(0, num_splits, group):
            tiles = [(m_of(jnp.int32(p)), acc_of(jnp.int32(p))) for p in range(g, min(g + group, num_splits))]
            for mp, ap in tiles:
                o = o + jnp.exp(mp - mxs)[:, None] * ap
    return o * inv[:, None]


def _pad_idx(idx, multiple):
    k = idx.shape[-1]
    kp = max(multiple, -(-k // multiple) * multiple)
    if kp != k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, kp - k)], constant_values=-1)
    return idx


# Flash-decoding combine: merge the per-split partial outputs (acc [rows, P, H, D] f32, running max m
# and sum l [rows, P, H]) with the sink into the output. XLA's version of it (the einsum below) fused
# into wo_a's input fusion in the model and cost more than the kernel saved (BENCHMARKS.md, issue 5,
# session 15); ``combine="pallas"`` runs this kernel instead: one program per (row, head block,
# column block) reads its P partial tiles once and writes the output in q's dtype.
COMBINE_BLOCK_H = 16
COMBINE_BLOCK_D = 128


def _combine_kernel(acc_ref, m_ref, l_ref, sink_ref, o_ref, *, num_splits: int):
    o = _merge_splits(m_ref[...], l_ref[...], sink_ref[...], lambda p: m_ref[p, :], lambda p: acc_ref[p, :, :],
                      num_splits, o_ref.shape)
    o_ref[...] = o.astype(o_ref.dtype)


def _xla_combine(acc, m, l, sink):
    """The same merge as :func:`combine_splits`, in XLA (float32 result)."""
    mx = jnp.max(m, axis=1)  # [rows, hp]
    mxs = jnp.where(mx == _NEG_INF, 0.0, mx)
    w = jnp.exp(m - mxs[:, None, :])  # exp(-inf) = 0 for empty splits
    den = jnp.sum(w * l, axis=1) + jnp.exp(sink[None, :] - mxs)
    inv = jnp.where(mx == _NEG_INF, 0.0, 1.0 / den)
    return jnp.einsum("rph,rphd->rhd", w, acc, precision=jax.lax.Precision.HIGHEST) * inv[..., None]


def combine_reason(num_splits: int, heads: int, d: int) -> str | None:
    """Why the Pallas combine cannot merge these partials (None: it can)."""
    if not _is_pow2(num_splits):
        return f"num_splits={num_splits} is not a power of two (the [splits, heads] tile of m and l)"
    bh, bd = min(heads, COMBINE_BLOCK_H), min(d, COMBINE_BLOCK_D)
    if not _is_pow2(bh) or heads % bh or d % bd or not _is_pow2(bd):
        return f"heads={heads} / D={d} do not split into power-of-two blocks of {bh} x {bd}"
    return None


def combine_splits(acc, m, l, sink, out_dtype, *, interpret=False, num_warps=4):
    """acc [rows, P, H, D] f32, m / l [rows, P, H] f32, sink [H] f32 -> [rows, H, D] out_dtype: the
    same merge as the XLA combine (rows whose splits are all empty give 0)."""
    rows, nsp, hp, d = acc.shape
    reason = combine_reason(nsp, hp, d)
    if reason is not None:
        raise ValueError(f"sparse_attention (pallas): the Pallas combine cannot run: {reason}")
    bh, bd = min(hp, COMBINE_BLOCK_H), min(d, COMBINE_BLOCK_D)
    return pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=nsp),
        grid=(rows, hp // bh, d // bd),
        in_specs=[
            pl.BlockSpec((None, nsp, bh, bd), lambda r, i, j: (r, 0, i, j)),
            pl.BlockSpec((None, nsp, bh), lambda r, i, j: (r, 0, i)),
            pl.BlockSpec((None, nsp, bh), lambda r, i, j: (r, 0, i)),
            pl.BlockSpec((bh,), lambda r, i, j: (i,)),
        ],
        out_specs=pl.BlockSpec((None, bh, bd), lambda r, i, j: (r, i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, hp, d), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="sparse_attention_combine",
    )(acc, m, l, sink.astype(jnp.float32))


# How the flash-decoding splits are merged when the caller does not say (DSV41_SPARSE_COMBINE, read
# at import): "xla" (the default: an einsum that XLA fuses into the consumer), "pallas" (the
# separate combine kernel, :func:`combine_splits`; session 17: 5 us slower in the site) or "kernel"
# (the last split program of each head / column block merges, :func:`_combine_in_kernel`: no
# partials left for XLA and no second launch; session 22: the batch-1 step's sparse attention
# 0.68 -> 0.52 ms on the H200 while its merge was broken; session 24: correct with the scalar
# counter atomic, and slower than the XLA combine at the decode site, 40.6 against 33.4 µs).
COMBINES = ("xla", "pallas", "kernel")
COMBINE = os.environ.get("DSV41_SPARSE_COMBINE", "xla").lower()
if COMBINE not in COMBINES:
    raise ValueError(f"DSV41_SPARSE_COMBINE={COMBINE!r}: expected one of {', '.join(COMBINES)}")


# How decode-sized calls (at most pallas_triton_two_pass.MAX_ROWS query rows) run when the caller
# names no tiling (DSV41_SPARSE_DECODE, read at import): "flash" (this module's kernel with
# flash-decoding splits), "two_pass" (pallas_triton_two_pass: every logit, then P.V over key splits;
# no rescaling combine) or "auto" (the default: two-pass for calls of at most TWO_PASS_AUTO_ROWS rows
# over V4.1's stores, else as "flash"). "two_pass" makes 'auto' dispatch take the kernel for every
# decode row count over V4.1's stores, "auto" for TWO_PASS_AUTO_ROWS (auto_reason).
DECODE_METHODS = ("auto", "flash", "two_pass")
DECODE_METHOD = os.environ.get("DSV41_SPARSE_DECODE", "auto").lower()
if DECODE_METHOD not in DECODE_METHODS:
    raise ValueError(f"DSV41_SPARSE_DECODE={DECODE_METHOD!r}: expected one of {', '.join(DECODE_METHODS)}")
# The most query rows DECODE_METHOD "auto" gives the two-pass kernels: the row counts measured faster
# in the model (auto_reason has the numbers; 1 row until session 55). Batches 32 and 64 win the site
# too (94.3 / 133.0 against 113.1 / 180.8 us, H100) but keep XLA's: batch 32's only model run
# (session 56) was cut to 4-token warm-up runs, too short to show the gain either way.
TWO_PASS_AUTO_ROWS = 8


def _two_pass_module():
    from . import pallas_triton_two_pass

    return pallas_triton_two_pass


def _v41_stores(kv, comp_kv) -> bool:
    """V4.1's stores: the FP8 window and an FP4 compressed cache or none (the measured rules' case)."""
    return isinstance(kv, Fp8Tensor) and (comp_kv is None or isinstance(comp_kv, Fp4Tensor))


def _two_pass_rows(q, kv, comp_kv) -> bool:
    """Whether :data:`DECODE_METHOD` gives a call of this many rows over these stores to the two-pass
    kernels (their shape support aside)."""
    rows = q.shape[0] * q.shape[1]
    if DECODE_METHOD == "two_pass":
        return rows <= _two_pass_module().MAX_ROWS
    return DECODE_METHOD == "auto" and rows <= TWO_PASS_AUTO_ROWS and _v41_stores(kv, comp_kv)


def takes_two_pass(q, kv, kv_idx, comp_kv, comp_idx) -> bool:
    """Whether a call that names no method or tiling runs the two-pass decode kernels:
    :data:`DECODE_METHOD` gives them its row count (:func:`_two_pass_rows`) and those kernels
    support its shapes."""
    return _two_pass_rows(q, kv, comp_kv) and _two_pass_module().two_pass_reason(q, kv, kv_idx, comp_kv, comp_idx) is None


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, interpret=False,
                     block_h=None, block_k=None, num_splits=None, num_warps=None, num_stages=None, d_split=None,
                     combine=None, counters=None, return_partials=False, window_width=None, method=None):
    """``method``: "flash" (this module's kernel) or "two_pass" (:mod:`.pallas_triton_two_pass`, for
    any row count; it refuses flash tilings and shapes it cannot run by name). Without ``method``,
    :data:`DECODE_METHOD` "two_pass" sends calls of at most ``pallas_triton_two_pass.MAX_ROWS`` rows
    that name no tiling, splits, combine or window width there (:func:`takes_two_pass`).
    ``window_width`` (int or int32 [B]; one split only): DeepSeek's window list is that many leading
    entries of each row's window list (later ones are ignored), and the kernel walks its blocks over
    DeepSeek's concatenated list, whose compressed entries start there
    (``reference.deepseek_columns``); a block that holds both the end of the window list and the
    start of the compressed one is one step (one [block_k, D] tile holding each lane's row).
    ``combine``: how the flash-decoding splits are merged (default :data:`COMBINE`): ``"xla"``,
    ``"pallas"`` (:func:`combine_splits`; falls back to XLA where :func:`combine_reason` says it
    cannot run) or ``"kernel"`` (inside the attention kernel, by the last split program of each
    block; with one split there is nothing to merge and the kernel writes the output directly; a
    split count that is not a power of two falls back to the XLA combine).
    ``d_split`` > 1: each program accumulates D / d_split output columns (the logits still use all
    of D, so every key row is read d_split times, from L2 after the first), which divides the [block_h,
    D] f32 accumulator that makes the one-program version spill (BENCHMARKS.md, issue 5, session 12).
    Diagnostics (``combine="kernel"``): ``counters`` replaces the zeroed int32 counters the kernel
    counts its finished splits in; ``return_partials`` returns (output, the pallas_call's outputs:
    partial acc, m, l, the counters after the call, the output block array)."""
    if method is not None and method not in DECODE_METHODS:
        raise ValueError(f"sparse_attention (pallas): method={method!r}; expected one of {', '.join(DECODE_METHODS)}")
    reason = unsupported_reason(q, kv, kv_idx, comp_kv, comp_idx)
    if reason is not None:
        raise ValueError(f"sparse_attention (pallas): {reason}")
    tiled = (block_h, block_k, num_splits, d_split, combine, counters, window_width) != (None,) * 7 or return_partials
    if method == "two_pass" and tiled:
        raise ValueError("sparse_attention (pallas): method='two_pass' takes no flash tiling, splits, combine, "
                         "counters or window width (the caller masks the window list); drop them or use method='flash'")
    if method == "two_pass" or (method is None and not tiled and takes_two_pass(q, kv, kv_idx, comp_kv, comp_idx)):
        return _two_pass_module().sparse_attention(q, kv, kv_idx, sink, scale=scale, comp_kv=comp_kv,
                                                   comp_idx=comp_idx, interpret=interpret)
    b, s, h, d = q.shape
    rows = b * s
    has_comp = comp_kv is not None and comp_idx is not None and comp_idx.shape[-1] > 0
    kw = kv_idx.shape[-1]
    kc = comp_idx.shape[-1] if has_comp else 0
    cfg = default_config(rows, h, kw, kc, "cuda" if interpret else None, d, d_split)
    if q.dtype == jnp.float32:
        # f32 (tests / debugging only): an IEEE f32 dot over a [64, 512] f32 tile did not finish
        # compiling within a minute on the H200 (jax 0.11.2); keep the f32 tiles small.
        cfg.update(block_h=16, block_k=16, num_warps=4, d_split=1 if d_split is None else d_split)
    combine = combine or COMBINE
    if combine not in COMBINES:
        raise ValueError(f"sparse_attention (pallas): combine={combine!r}; expected one of {', '.join(COMBINES)}")
    d_split = cfg["d_split"]
    if d_split < 1 or d % d_split or (d // d_split) % 32:
        raise ValueError(f"sparse_attention (pallas): d_split={d_split} must divide D={d} into column blocks that "
                         f"are multiples of 32 (the window's FP8 scale block)")
    block_h = block_h or cfg["block_h"]
    block_k = block_k or cfg["block_k"]
    num_splits = num_splits or cfg["num_splits"]
    if window_width is not None and num_splits != 1:
        raise ValueError(f"sparse_attention (pallas): window_width walks DeepSeek's list in one pass; "
                         f"num_splits={num_splits} must be 1")
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]

    # heads: pad to a multiple of block_h (only tiny test configs; real H=64)
    hp = -(-h // block_h) * block_h
    qf = q.reshape(rows, h, d)
    sinkf = sink.astype(jnp.float32)
    if hp != h:
        qf = jnp.pad(qf, ((0, 0), (0, hp - h), (0, 0)))
        sinkf = jnp.pad(sinkf, (0, hp - h), constant_values=_NEG_INF)
    nhb = hp // block_h

    gran = num_splits * block_k
    widx = _pad_idx(kv_idx.astype(jnp.int32).reshape(rows, kw), gran) if kw else None
    nw_blocks = (widx.shape[-1] // gran) if kw else 0
    if widx is None:
        widx = jnp.full((rows, gran), -1, jnp.int32)
    cdt = q.dtype

    def per_batch(arr):  # whole per-batch cache, gathered inside the kernel
        n, c = arr.shape[1], arr.shape[2]
        return arr, pl.BlockSpec((None, n, c), lambda r, j, p: (r // s, 0, 0))

    row_spec = lambda width: pl.BlockSpec((None, width), lambda r, j, p: (r, 0))
    ds = d_split
    dv = d // ds
    # grid axis 1 = head block x column block (j // ds: heads, j % ds: output columns)
    args, specs = [qf, widx], [
        pl.BlockSpec((None, block_h, d), lambda r, j, p: (r, j // ds, 0)),
        row_spec(widx.shape[-1]),
    ]
    if window_width is not None:
        ww = jnp.clip(jnp.broadcast_to(jnp.asarray(window_width, jnp.int32), (b,)), 0, kw)
        args.append(jnp.repeat(ww, s))  # one per query row
        specs.append(pl.BlockSpec((1,), lambda r, j, p: (r,)))
    w_fp8 = isinstance(kv, Fp8Tensor)
    if w_fp8:
        wscale = jax.lax.bitcast_convert_type(kv.scale, jnp.uint8) if kv.scale.dtype != jnp.uint8 else kv.scale
        for a in (kv.data, wscale):
            x, sp = per_batch(a)
            args.append(x)
            specs.append(sp)
    else:
        x, sp = per_batch(kv)
        args.append(x)
        specs.append(sp)
    c_fp4 = False
    nc_blocks = 0
    if has_comp:
        cidx = _pad_idx(comp_idx.astype(jnp.int32).reshape(rows, kc), gran)
        nc_blocks = cidx.shape[-1] // gran
        if window_width is not None:  # the shifted blocks read it from position -nw*bk to nw*bk past its end
            cidx = jnp.pad(cidx, ((0, 0), (nw_blocks * gran,) * 2), constant_values=-1)
        args.append(cidx)
        specs.append(row_spec(cidx.shape[-1]))
        c_fp4 = isinstance(comp_kv, Fp4Tensor)
        for a in ((le_words(comp_kv.data), comp_kv.scale) if c_fp4 else (comp_kv,)):  # words: an XLA bitcast
            x, sp = per_batch(a)
            args.append(x)
            specs.append(sp)
    args.append(sinkf)
    specs.append(pl.BlockSpec((block_h,), lambda r, j, p: (j // ds,)))

    split_out = num_splits > 1
    # the last program loads the [splits, block_h] tiles of m and l: a power-of-two split count
    in_kernel = split_out and combine == "kernel" and _is_pow2(num_splits)
    io_aliases = {}
    if in_kernel:
        # partials in full-array scratch outputs (the last split program reads every split's), the
        # zeroed per-(row, head / column block) counters aliased in -> out, then the output block
        nslots = rows * nhb * ds
        io_aliases = {len(args): 3}
        args.append(jnp.zeros((nslots,), jnp.int32) if counters is None else counters)
        specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape = (
            jax.ShapeDtypeStruct((rows, num_splits, hp, d), jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, hp), jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, hp), jnp.float32),
            jax.ShapeDtypeStruct((nslots,), jnp.int32),
            jax.ShapeDtypeStruct((rows, hp, d), q.dtype),
        )
        out_specs = tuple(pl.BlockSpec(memory_space=pl.ANY) for _ in range(4)) + (
            pl.BlockSpec((None, block_h, dv), lambda r, j, p: (r, j // ds, j % ds)),)
    elif split_out:
        out_shape = (
            jax.ShapeDtypeStruct((rows, num_splits, hp, d), jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, hp), jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, hp), jnp.float32),
        )
        # m and l are the same in every column block of a head block: each of them writes them
        out_specs = (
            pl.BlockSpec((None, None, block_h, dv), lambda r, j, p: (r, p, j // ds, j % ds)),
            pl.BlockSpec((None, None, block_h), lambda r, j, p: (r, p, j // ds)),
            pl.BlockSpec((None, None, block_h), lambda r, j, p: (r, p, j // ds)),
        )
    else:
        out_shape = jax.ShapeDtypeStruct((rows, hp, d), q.dtype)
        out_specs = pl.BlockSpec((None, block_h, dv), lambda r, j, p: (r, j // ds, j % ds))

    kernel = functools.partial(
        _kernel, has_comp=has_comp, w_fp8=w_fp8, c_fp4=c_fp4, scale=float(scale), block_k=block_k, d=d,
        nw_blocks=nw_blocks, nc_blocks=nc_blocks, split_out=split_out, cdt=cdt,
        prec=jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None, d_split=ds,
        in_kernel_combine=in_kernel, num_splits=num_splits, interpret=interpret, shift=window_width is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid=(rows, nhb * ds, num_splits),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=io_aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_attention_sink",
    )(*args)

    parts = out
    if in_kernel:
        out = out[4]
    elif split_out and combine == "pallas" and combine_reason(num_splits, hp, d) is None:
        out = combine_splits(*out, sinkf, q.dtype, interpret=interpret)
    elif split_out:
        out = _xla_combine(*out, sinkf).astype(q.dtype)
    out = out[:, :h].reshape(b, s, h, d)
    return (out, parts) if return_partials else out


def auto_reason(q, kv=None, comp_kv=None, running_max_block=None, kv_idx=None, comp_idx=None):
    """Why plain 'auto' dispatch does not pick this kernel on a GPU (None: pick it). Measured on the
    H200 by device time (profiler; BENCHMARKS.md, issue 5):
    * row-maximum rounding (the default), one query row (batch-1 decode) over V4.1's stores: the op
      18.8-19.0 us against the XLA reference's 22.1 us, but the model's whole site (attention, inverse
      RoPE, wo_a) a tie, 32.4-32.6 against 32.9 us, and in the 40-layer model decode went 112.85 ->
      110.76 tok/s with it (the flash-decoding combine lands in wo_a's input fusion; session 15);
      batch 8: 46.5-46.9 us against 33.9-34.1 us;
    * the two-pass kernels (:data:`DECODE_METHOD`, session 47, an H100): the site 28.0 / 67.9 / 52.1 us
      at batch 1 / 8 / 6 verify rows against XLA's 35.7 / 70.2 / 60.5 (5,121-entry cache), and at the
      model benchmark's short lists too; in the model batch 1 gained 1.1 % and batch 8 lost 1.2 %; with
      session 55's tiles (dv 256, group 1) the site at batch 8 took 58.5 against 70.6 us and the batch-8
      model gained 0.6 % (365.13 against 363.06 tok/s), so "auto" takes them for up to
      :data:`TWO_PASS_AUTO_ROWS` rows over V4.1's stores (batch 1 to 8, and 6 verify rows);
    * row maximum, prefill rows (session 37, the kernel's arithmetic FP4 decode of the time): the site
      1.29-1.32x faster than XLA at 256, 1,024 and 4,096 rows with the default tiling (1.46-1.49x with
      64-key blocks), yet the model's 4,096-token prefill went 5,604 -> 5,388 tok/s with the kernel.
      With session 38's word decode (session 41, an H100, 64 routed experts) the model's 4,096-token
      prefill went 5,361.7 -> 5,543.4 tok/s with it (device time 753.0 -> 731.2 ms per prompt: -60 ms
      of XLA kernels in the profile's "other" and "attention" parts, +40 ms in "sparse_attn"), so from
      :data:`KERNEL_BLOCKS_MIN_ROWS` rows over V4.1's stores (FP8 window, FP4 or no compressed cache)
      it is picked; V4's plain stores were not measured and keep the reference;
    * ``running_max_block`` (``attention_rounding="kernel_blocks"``), where the kernel runs DeepSeek's
      own loop: at >= :data:`KERNEL_BLOCKS_MIN_ROWS` rows it is picked. The model's 4,096-token prefill
      ran 5,388 tok/s with it against 4,790 with the XLA emulation (session 36) and the site 362.6 /
      1,279 / 4,891 us at 256 / 1,024 / 4,096 rows against 530 / 1,872 / 7,263 us for XLA's row maximum
      (the emulation costs 1.41x that). At decode the one-split kernel is slow: the whole site took
      181.5 / 176.2 / 164.0 us at batch 1 / 8 / 32 against the emulation's 37.8 / 82.7 / 144.9 us
      (session 37).
    implementation='pallas' (argument, context or DSV41_KERNELS) still runs it for any supported
    shape. ``kv`` / ``comp_kv`` let a rule depend on the stores, ``kv_idx`` / ``comp_idx`` on the
    lists (a decode call the two-pass kernels cannot take keeps the reference)."""
    rows = q.shape[0] * q.shape[1]
    if running_max_block is not None:  # (the dispatch passes it only for bf16 q, where it rounds)
        if rows >= KERNEL_BLOCKS_MIN_ROWS:
            return None
        return (f"running-maximum rounding over {rows} query row(s): the one-split kernel is slower than the "
                f"XLA emulation below {KERNEL_BLOCKS_MIN_ROWS} rows on the H200 (BENCHMARKS.md, issue 5, session 37)")
    if _two_pass_rows(q, kv, comp_kv) and _v41_stores(kv, comp_kv):
        why = None if kv_idx is None else _two_pass_module().two_pass_reason(q, kv, kv_idx, comp_kv, comp_idx)
        if why is None:
            return None  # the two-pass decode kernels (sessions 46-47)
        return (f"{rows} decode row(s) over lists the two-pass kernels do not take ({why}); the flash kernel "
                "they would fall back to was slower in the model than the XLA reference (BENCHMARKS.md, issue 5)")
    if rows == 1 and isinstance(kv, Fp8Tensor) and isinstance(comp_kv, Fp4Tensor):
        return ("batch-1 decode with DSV41_SPARSE_DECODE=flash: the flash kernel is faster as an op but slower in "
                "the model than the XLA reference on the H200 (BENCHMARKS.md, issue 5, session 15)")
    if rows >= KERNEL_BLOCKS_MIN_ROWS:
        if _v41_stores(kv, comp_kv):
            return None
        return (f"{rows} query rows (prefill) over plain stores (V4's): the kernel's prefill gain was measured "
                "over V4.1's FP8 / FP4 stores only (BENCHMARKS.md, issue 5, session 41)")
    return f"{rows} query row(s): measured slower than the XLA reference on the H200 (BENCHMARKS.md, issue 5)"
