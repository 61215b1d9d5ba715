"""Pallas-Triton sparse attention for decode rows in two passes: every logit first, then P·V.

Why a second kernel beside the flash-decoding one (:mod:`.pallas_triton`): at batch-1 decode the op
reads only ~350 KB (64 heads x 512, 128 FP8 window rows and 512 FP4 compressed rows), so its time is
latency, not bytes. XLA's reference takes ≈ 14.8 µs per layer there in 8 kernels (H200 profile,
session 46) and the flash kernel needs 16 splits plus a combine to fill the GPU, which left it tied
with XLA in the model (BENCHMARKS.md, issue 5, sessions 15-25). Two passes need no combine:

* **pass 1** (``sparse_attention_logits``), grid ``(rows, key blocks)``: each program gathers
  ``bk1`` keys of the concatenated list (window, then compressed; each padded to ``bk2``), decodes
  them in column chunks of ``dc`` and writes their scaled, masked fp32 logits for every head
  ``[rows, H, K]`` and the block's per-head maximum into ``[rows, nb1p, H]`` (``nb1p`` the power of
  two at or above the block count; pass 2 masks the rows no program wrote); with ``p1_loop`` > 1 a
  program walks that many blocks of one list with its q tile loaded once, the next block's loads
  issued ahead (same sums, bit for bit);
* **pass 2** (``sparse_attention_pv``), grid ``(rows, head blocks, column blocks, key splits)``:
  the row maximum ``m`` from pass 1's block maxima, then over the program's ``split`` blocks of
  ``bk2`` keys (unrolled, loads issued a group of blocks ahead) ``e = exp(l - m)``, ``den += Σ e``
  in fp32 and ``acc += q.dtype(e) · V`` for the program's ``dv`` value columns, V read from the rows
  pass 1 decoded (``stage_values``) or gathered and decoded again. With one key split the program
  ends with ``out = acc / (den + exp(sink - m))``; with several, each writes its fp32 ``acc`` and
  ``den`` (split 0 adds the sink's term) and the sums ``Σ acc / Σ den`` are left to XLA, which fuses
  them into the consumer (the model's inverse RoPE). Because every split uses the same row maximum
  the partial sums add without rescaling: this is not flash-decoding's combine.

Numerics are the reference's default (``running_max_block=None``) to the fp32 summation order: the
row maximum (not a running one), the unnormalised weights cast to ``q.dtype`` before P·V, the fp32
denominator with the sink, a row with no valid key gives 0. DeepSeek's running-maximum rounding
(``kernel_blocks``) and its shifted window blocks stay with the flash kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
from dsv41_jax.quant.codecs import le_words

from .pallas_triton import _is_pow2, _pad_idx, read_rows, store_reader, unsupported_reason

_NEG_INF = float("-inf")

# Tiles (sm_90 SASS of the lowering, session 46; not yet timed in this form):
# * bk1: keys per pass-1 program; dc: the column chunk pass 1 decodes and dots at a time (512, all
#   of V4.1's D: every load of a program in one round, 168 registers, no spills; 128-column chunks
#   took a round trip and barriers each);
# * bk2: keys per pass-2 step (the lists are padded to it); bh: heads and dv: value columns per
#   pass-2 program; group: pass-2 blocks whose loads are issued before their arithmetic (3 is the
#   most at 4 warps without spills in the gathering form: 254 registers; 5 spilled 140 words);
# * stage_values: pass 1 also writes the rows it decoded ([rows, K, D] in q's dtype: 640 KB a row at
#   640 x 512 bf16) and pass 2 reads contiguous tiles of them (167 registers); False: pass 2 gathers
#   and decodes its columns from the stores again, after each block's index list.
# * split: bk2 blocks per pass-2 program (None: fewest that give rows x head blocks x column blocks x
#   splits >= pv_programs programs; a list of nb2 blocks then runs in ceil(nb2 / split) key splits).
#   One split per row was 15.7 us of pass 2 at batch 1 on the H200 (32 programs, 10 blocks each in a
#   chain) against 16.5 us at batch 8 (256 programs): latency, not bytes (session 47);
# * pv_programs: the programs split=None aims for. 512 in sessions 49-54: on two H100s (sessions 47
#   and 49, the decode site by device time, dv = 64) the fastest split at V4.1's 640 keys was the one
#   with about 512 programs at both batch sizes -- batch 1: 1 block a split (10 splits) 27.43 / 26.25 us
#   against 28.00 / 26.88 for 2 blocks (256 programs); batch 8: 5 blocks a split (2 splits) 64.96 /
#   63.43 against 67.94 / 66.37 for one split. 256 since session 55 (with dv 256 and group 1, below);
# * dv 256, group 1, pv_programs 256 since session 55 (dv 64, group 3, pv_programs 512 before). The op
#   alone by device time on an H100 (BENCHMARKS.md, issue 5, session 55), 64 heads x 512, 128 window
#   + 512 compressed keys, batch 1 / 6 verify rows / 8 / 32 / 64: 11.3 / 15.8 / 20.6 / 55.8 / 91.5 us
#   against 11.3-11.8 / 18.5 / 25.4 / 78.3 / 145.3 with the old tiles. Wider value columns cut
#   pass 2's column blocks from 8 to 2, and with them its programs and the re-reads and exps of the
#   weights; with 10 blocks in a program (batch >= 32, one split) a group of 3 [64, 256] tiles loaded
#   ahead was slower (group 1: 108.2 -> 91.1 us at batch 64; not spills: the sm_90 SASS has none
#   either way and the same instruction counts, but group 3 holds 102,400 bytes of shared memory a
#   program against 36,864), while at batch 8 (2 blocks a program) the group made no clear
#   difference (21.1-22.5).
# * pv_warps: pass 2's warps (None: num_warps). With bh = 16 query rows the MMA's A operand (the
#   weights) is replicated in each warp, so 4 warps compute every exp 4 times (401 MUFU.EX2 a thread
#   for 80 weights, sm_90 SASS, session 47).
# * p1_loop: bk1 blocks per pass-1 program (a power of two; 1: one block, no loop, as timed in
#   sessions 46-55). With more, the program loads its row's q tile once and walks its blocks in
#   order, issuing the next block's index and store loads before it decodes and dots the current one
#   (the next block's raw words held in registers across the step). Each program's blocks come from
#   one list (window or compressed); where a list's block count is not a multiple of it, the most
#   that divides both lists is used (:func:`pass1_loop`). Session 56's hypothesis for batch 64, where
#   one block a program is 1,280 programs each re-loading a 64 KB q tile: 4 blocks a program (320)
#   take pass 1 from 44 to about 20 us on an H100. Timed in session 58 (H100, 64K context): loops of 2
#   2.5 % faster at batch 32-64 (pass 1 44.2 -> 41.1 us), 1.4-2x slower at batch 1-8; loops of 4 slower at
#   every batch (the q tile's wgmma descriptors spill) -- so not the default.
# * skip_empty: key blocks whose index entries are all -1 are not computed. Pass 1 writes their -inf
#   logits (and, staged, zero rows, so that a pass-2 block half of which is empty weighs zeros, never
#   unwritten memory) without gathering, decoding or dotting; pass 2 skips a bk2 block whose pass-1
#   block maxima are all -inf (no value load, no exp, no dot). The model's lists are padded to top-512
#   at the end, so below 2,048 tokens of context (512 compressed entries at ratio 4) most compressed
#   blocks are empty: at a 384-token context 13 of pass 1's 16 compressed blocks and 6 of pass 2's 8.
#   Same sums, bit for bit (an empty block adds exactly 0). Not timed, so off; one block a pass-1
#   program only (p1_loop 1).
# At batch 1 with 64 heads x 512 and 640 keys: 20 pass-1 and 8 x 10 pass-2 programs (4 head blocks x
# 2 column blocks x 10 key splits of one block).
DEFAULTS = dict(bk1=32, dc=512, bk2=64, bh=16, dv=256, group=1, num_warps=4, stage_values=True, split=None,
                pv_programs=256, pv_warps=None, p1_loop=1, skip_empty=False)

# The most query rows (B*S) this path serves when the caller does not pick a method: decode and
# speculative-verify sizes, what it was built for.
MAX_ROWS = 64
# The most bk2 blocks of index list (window + compressed, each padded) a call may hold: pass 2 is
# unrolled over them (V4.1's decode list: 10 blocks of 64).
MAX_BLOCKS = 64


def _config(cfg, d: int) -> dict:
    """:data:`DEFAULTS` with ``cfg``'s overrides; column tiles wider than D are cut to D."""
    c = {**DEFAULTS, **(cfg or {})}
    return {**c, "dc": min(c["dc"], d), "dv": min(c["dv"], d)}


def two_pass_reason(q, kv, kv_idx, comp_kv=None, comp_idx=None, cfg=None) -> str | None:
    """None when the two-pass kernels support these inputs, else why not (the flash kernel's
    :func:`unsupported_reason` first)."""
    reason = unsupported_reason(q, kv, kv_idx, comp_kv, comp_idx)
    if reason is not None:
        return reason
    d = q.shape[-1]
    c = _config(cfg, d)
    if not all(_is_pow2(c[k]) for k in ("bk1", "dc", "bk2", "bh", "dv")):
        return f"two-pass tiles must be powers of two, got {c}"
    if c["bk2"] % c["bk1"]:
        return f"bk2={c['bk2']} must be a multiple of bk1={c['bk1']} (the lists are padded to bk2)"
    if d % c["dc"] or d % c["dv"] or c["dv"] < 32 or c["dc"] < 32:
        return f"D={d} must split into column chunks dc={c['dc']} and dv={c['dv']} (each >= 32, the FP8 scale block)"
    if c["bh"] < 16:
        return f"bh={c['bh']}: the P.V dot needs at least 16 rows"
    if not _is_pow2(q.shape[2]):
        return f"H={q.shape[2]} heads: pass 1 holds every head of a row in one power-of-two tile"
    kc = comp_idx.shape[-1] if comp_kv is not None and comp_idx is not None else 0
    blocks = -(-kv_idx.shape[-1] // c["bk2"]) + -(-kc // c["bk2"])
    if blocks > MAX_BLOCKS:
        return (f"index lists of {kv_idx.shape[-1]} + {kc} entries are {blocks} blocks of {c['bk2']}: pass 2 is "
                f"unrolled over at most {MAX_BLOCKS} (a decode-sized list; prefill chunks take the flash kernel)")
    if c["split"] is not None and (int(c["split"]) < 1 or (not c["stage_values"] and int(c["split"]) < blocks)):
        return (f"split={c['split']} over {blocks} key blocks: pass 2's key splits need >= 1 block each and staged "
                "values (stage_values=False reads each block's store by its static position: one split)")
    if c["pv_warps"] is not None and c["pv_warps"] not in (1, 2, 4, 8):
        return f"pv_warps={c['pv_warps']}: expected 1, 2, 4 or 8"
    if not (isinstance(c["p1_loop"], int) and c["p1_loop"] >= 1 and _is_pow2(c["p1_loop"])):
        return f"p1_loop={c['p1_loop']!r}: pass 1's blocks per program must be a power of two >= 1"
    if c["skip_empty"] and c["p1_loop"] != 1:
        return f"skip_empty with p1_loop={c['p1_loop']}: skipping empty blocks is built for one block a pass-1 program"
    return None


def pass1_loop(want: int, list_blocks) -> int:
    """Pass 1's bk1 blocks per program: the most power of two <= ``want`` that divides every list's
    block count (``list_blocks``: the window's, then the compressed list's, each in bk1 blocks), so
    that no program's blocks straddle the two lists (1 always does)."""
    n = want
    while any(b % n for b in list_blocks):
        n //= 2
    return n


def _logits_kernel(q_ref, widx_ref, *refs, nwb1, dc, d, scale, cdt, prec, w_fp8, c_fp4, has_comp, stage, loop=1,
                   skip_empty=False):
    """Pass 1 for one (row, key block): the block's entries from the window list (blocks < nwb1) or
    the compressed one, read from each list's own ref (no concatenated copy: an XLA kernel of 2.5 us
    before pass 1 at batch 1 on an H100, session 47). ``loop`` > 1: :func:`_logits_loop_kernel`."""
    if loop > 1:
        return _logits_loop_kernel(q_ref, widx_ref, *refs, nwb1=nwb1, dc=dc, d=d, scale=scale, cdt=cdt, prec=prec,
                                   w_fp8=w_fp8, c_fp4=c_fp4, has_comp=has_comp, stage=stage, loop=loop)
    it = iter(refs)
    cidx_ref = next(it) if has_comp else None
    window_rows = read_rows(store_reader(it, "fp8" if w_fp8 else "plain"))
    comp_rows = read_rows(store_reader(it, "fp4" if c_fp4 else "plain")) if has_comp else None
    lg_ref, bmax_ref = next(it), next(it)
    vals_ref = next(it) if stage else None
    bk = lg_ref.shape[-1]
    j = pl.program_id(1)

    def block(idx_ref, jl, rows_of):
        ids = idx_ref[pl.ds(jl * bk, bk)]
        valid = ids >= 0

        def compute():
            s = jnp.zeros((q_ref.shape[0], bk), jnp.float32)
            safe = jnp.where(valid, ids, 0)
            for c in range(0, d, dc):
                k = rows_of(safe, c, dc, cdt)  # [bk, dc]
                if stage:  # the decoded rows for pass 2 (rows of -1 entries hold row 0: their weight is 0)
                    vals_ref[:, pl.ds(c, dc)] = k
                s += jnp.dot(q_ref[:, pl.ds(c, dc)].astype(cdt), k.T, preferred_element_type=jnp.float32,
                             precision=prec)
            return jnp.where(valid[None, :], s * scale, _NEG_INF)

        if not skip_empty:
            return compute()

        def empty():  # every entry -1: -inf logits, zero staged rows (pass 2 may weigh them beside a valid half)
            if stage:
                for c in range(0, d, dc):
                    vals_ref[:, pl.ds(c, dc)] = jnp.zeros((bk, dc), vals_ref.dtype)
            return jnp.full((q_ref.shape[0], bk), _NEG_INF, jnp.float32)

        return jax.lax.cond(jnp.max(ids) >= 0, compute, empty)

    if has_comp:
        s = jax.lax.cond(j < nwb1, lambda: block(widx_ref, j, window_rows), lambda: block(cidx_ref, j - nwb1, comp_rows))
    else:
        s = block(widx_ref, j, window_rows)
    lg_ref[...] = s
    bmax_ref[...] = jnp.max(s, axis=1)


def _logits_loop_kernel(q_ref, widx_ref, *refs, nwb1, dc, d, scale, cdt, prec, w_fp8, c_fp4, has_comp, stage, loop):
    """Pass 1 for one (row, ``loop`` consecutive key blocks of one list): the q tile loaded once, and
    each block's index and store loads issued before the previous block's decode and dots (unrolled:
    the next block's raw words are live across the step). Writes the blocks' logits, block maxima and
    (staged) decoded rows at their offsets in the program's output tiles."""
    it = iter(refs)
    cidx_ref = next(it) if has_comp else None
    window = store_reader(it, "fp8" if w_fp8 else "plain")
    comp = store_reader(it, "fp4" if c_fp4 else "plain") if has_comp else None
    lg_ref, bmax_ref = next(it), next(it)
    vals_ref = next(it) if stage else None
    bk = lg_ref.shape[-1] // loop
    j = pl.program_id(1) * loop  # the program's first block in the concatenated list
    chunks = range(0, d, dc)
    qs = [q_ref[:, pl.ds(c, dc)].astype(cdt) for c in chunks]

    def blocks(idx_ref, jl, reader):
        load, decode = reader

        def fetch(i):
            ids = idx_ref[pl.ds((jl + i) * bk, bk)]
            valid = ids >= 0
            ids = jnp.where(valid, ids, 0)
            return valid, [load(ids, c, dc) for c in chunks]

        ahead = fetch(0)
        for i in range(loop):
            valid, raws = ahead
            if i + 1 < loop:
                ahead = fetch(i + 1)
            s = jnp.zeros((q_ref.shape[0], bk), jnp.float32)
            for c, raw, qc in zip(chunks, raws, qs):
                k = decode(raw, cdt)  # [bk, dc]
                if stage:  # rows of -1 entries hold row 0: their weight is 0
                    vals_ref[pl.ds(i * bk, bk), pl.ds(c, dc)] = k
                s += jnp.dot(qc, k.T, preferred_element_type=jnp.float32, precision=prec)
            s = jnp.where(valid[None, :], s * scale, _NEG_INF)
            lg_ref[:, pl.ds(i * bk, bk)] = s
            bmax_ref[i, :] = jnp.max(s, axis=1)

    if has_comp:
        jax.lax.cond(j < nwb1, lambda: blocks(widx_ref, j, window), lambda: blocks(cidx_ref, j - nwb1, comp))
    else:
        blocks(widx_ref, j, window)


def _softmax_pv(lg_ref, bmax_ref, sink_ref, out_refs, load, decode, *, nb, nb1, bk2, dv, group, cdt, prec,
                skip_empty=0):
    """Pass 2's arithmetic for one (row, head block, column block, key split): the row maximum, then
    per key block ``jb`` of the split's ``nb`` the weights from the logits and
    ``decode(jb, load(jb))`` [bk2, dv] values. ``out_refs``: ``(o_ref,)`` (one split: the normalised
    output) or ``(acc_ref, den_ref)`` (the split's fp32 sums; split 0's denominator has the sink).
    ``skip_empty``: 0, or bk2 / bk1 -- then a block whose pass-1 maxima are all -inf is skipped (one
    block at a time: ``group`` does not apply)."""
    # the row maximum from pass 1's block maxima, one [nb1p, bh] load (rows >= nb1 were never written:
    # masked). One load per block, as first built, put a barrier after each: 20 round trips in a row
    # (sm_90 SASS), most of the kernel's 34 us on an H100 (session 46)
    bm = bmax_ref[...]
    m = jnp.max(jnp.where(jnp.arange(bm.shape[0], dtype=jnp.int32)[:, None] < nb1, bm, _NEG_INF), axis=0)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)

    def add(carry, jb, raw, lg):  # block jb's weights and their P.V into (den, acc)
        den, acc = carry
        e = jnp.exp(lg - m_safe[:, None])  # exp(-inf) = 0: no key
        return den + jnp.sum(e, axis=1), acc + jnp.dot(e.astype(cdt), decode(jb, raw),
                                                        preferred_element_type=jnp.float32, precision=prec)

    carry = (jnp.zeros(m.shape, jnp.float32), jnp.zeros((m.shape[0], dv), jnp.float32))
    if skip_empty:  # one block at a time, each behind a branch on its pass-1 maxima (all -inf: no valid key)
        r1 = jnp.arange(bm.shape[0], dtype=jnp.int32)[:, None]
        for jb in range(nb):
            # the split's block jb covers pass-1 blocks [(t * nb + jb) * f, + f), f = skip_empty
            lo = (pl.program_id(3) * nb + jb) * skip_empty
            # (one axis a reduction: Pallas-Triton lowers no whole-tile one)
            live = jnp.max(jnp.max(jnp.where((r1 >= lo) & (r1 < lo + skip_empty), bm, _NEG_INF), axis=1)) > _NEG_INF
            carry = jax.lax.cond(live, lambda c, jb=jb: add(c, jb, load(jb), lg_ref[:, pl.ds(jb * bk2, bk2)]),
                                 lambda c: c, carry)
    else:
        for g0 in range(0, nb, group):
            # every load of ``group`` blocks first, then their arithmetic: the dot operands' layout
            # conversions put barriers in each block, and loads traced after a barrier are issued after it
            blocks = range(g0, min(g0 + group, nb))
            raw = [load(jb) for jb in blocks]
            lgs = [lg_ref[:, pl.ds(jb * bk2, bk2)] for jb in blocks]
            for jb, r, lg in zip(blocks, raw, lgs):
                carry = add(carry, jb, r, lg)
    den, acc = carry
    sink_term = jnp.exp(sink_ref[...] - m_safe)
    if len(out_refs) == 2:  # one of several key splits: its sums, XLA adds them (_finish_splits)
        acc_ref, den_ref = out_refs
        acc_ref[...] = acc
        den_ref[...] = den + jnp.where(pl.program_id(3) == 0, sink_term, 0.0)
        return
    den = den + sink_term
    inv = jnp.where(m == _NEG_INF, 0.0, 1.0 / den)
    out_refs[0][...] = (acc * inv[:, None]).astype(out_refs[0].dtype)


def _pv_gather_kernel(lg_ref, bmax_ref, idx_ref, *refs, nwb2, w_fp8, c_fp4, has_comp, **kw):
    """Pass 2 reading its values from the stores: each block's index list, then its rows' columns
    gathered and decoded again (``stage_values=False``; one key split)."""
    it = iter(refs)
    window = store_reader(it, "fp8" if w_fp8 else "plain")
    comp = store_reader(it, "fp4" if c_fp4 else "plain") if has_comp else None
    sink_ref, o_ref = next(it), next(it)
    c0, bk2, dv = pl.program_id(2) * kw["dv"], kw["bk2"], kw["dv"]

    def load(jb):
        ids = idx_ref[pl.ds(jb * bk2, bk2)]
        return (window if jb < nwb2 else comp)[0](jnp.where(ids >= 0, ids, 0), c0, dv)

    _softmax_pv(lg_ref, bmax_ref, sink_ref, (o_ref,), load,
                lambda jb, r: (window if jb < nwb2 else comp)[1](r, kw["cdt"]), **kw)


def _pv_staged_kernel(lg_ref, bmax_ref, vals_ref, sink_ref, *out_refs, **kw):
    """Pass 2 reading the rows pass 1 decoded (``stage_values=True``): contiguous [bk2, dv] tiles at
    addresses known up front, no index lists, no decode; the program's key split of them."""
    bk2 = kw["bk2"]
    _softmax_pv(lg_ref, bmax_ref, sink_ref, out_refs, lambda jb: vals_ref[pl.ds(jb * bk2, bk2), :],
                lambda jb, v: v, **kw)


def key_splits(rows: int, head_blocks: int, col_blocks: int, nb2: int, cfg: dict) -> int:
    """bk2 blocks per pass-2 program: ``cfg['split']``, or (None) the fewest that give at least
    ``pv_programs`` programs, spread evenly (10 blocks for 32 programs: at 512, 1 block and 10 splits;
    at 256, 2 blocks and 5 splits) -- unless that count of splits does not divide the ``nb2`` blocks
    and a divisor at least half of it does: then that divisor's even split. An uneven split pads the
    last list with whole blocks of -1 entries, which pass 1 scores and stages and pass 2 weighs (one
    more XLA pad besides): 6 verify rows at V4.1's 10 blocks would run 3 splits of 4 blocks, 12 blocks
    of work for 10 -- 60.07 / 60.54 us for the decode site on an H100 (sessions 51 / 50) against
    49.75 / 50.49 for 2 splits of 5 (``pv_programs=256``); batch 1 and 8 split 10 evenly either way."""
    if cfg["split"] is not None:
        return min(int(cfg["split"]), nb2)
    base = rows * head_blocks * col_blocks
    want = min(nb2, max(1, -(-int(cfg["pv_programs"]) // base)))
    # the most splits <= want that divide nb2: where the ceil rule does not pad, its own split count
    # (and >= want / 2); where it pads, the even split if it keeps at least half the programs
    even = max(n for n in range(1, want + 1) if nb2 % n == 0)
    return nb2 // even if 2 * even >= want else -(-nb2 // want)


def _finish_splits(acc, den, dtype):
    """The key splits' sums: ``Σ acc / Σ den`` (a row with no valid key has acc = 0: 0), in XLA so
    that it fuses into the op's consumer. acc [splits, rows, H, D], den [splits, rows, H]."""
    a, dn = jnp.sum(acc, axis=0), jnp.sum(den, axis=0)
    return jnp.where(dn[..., None] > 0, a / jnp.where(dn > 0, dn, 1.0)[..., None], 0.0).astype(dtype)


def sparse_attention(q, kv, kv_idx, sink, *, scale, comp_kv=None, comp_idx=None, interpret=False, config=None):
    """The arguments of ``api.sparse_attention`` without rounding blocks or a window width (decode
    rows; the caller masks the window list). ``config`` overrides :data:`DEFAULTS`."""
    reason = two_pass_reason(q, kv, kv_idx, comp_kv, comp_idx, config)
    if reason is not None:
        raise ValueError(f"sparse_attention (pallas two-pass): {reason}")
    b, s, h, d = q.shape
    c = _config(config, d)
    rows = b * s
    has_comp = comp_kv is not None and comp_idx is not None and comp_idx.shape[-1] > 0
    bk1, bk2, dv = c["bk1"], c["bk2"], c["dv"]
    bh = min(c["bh"], max(16, 1 << (h - 1).bit_length()))
    hp = -(-h // bh) * bh
    qf = q.reshape(rows, h, d)
    sinkf = sink.astype(jnp.float32)
    if hp != h:  # tiny test configs: padded heads have -inf sinks and zero q (their rows are dropped)
        qf = jnp.pad(qf, ((0, 0), (0, hp - h), (0, 0)))
        sinkf = jnp.pad(sinkf, (0, hp - h), constant_values=_NEG_INF)
    kw = kv_idx.shape[-1]
    widx = _pad_idx(kv_idx.astype(jnp.int32).reshape(rows, kw), bk2)
    lists = [widx]
    w_fp8 = isinstance(kv, Fp8Tensor)
    stores = [kv.data, jax.lax.bitcast_convert_type(kv.scale, jnp.uint8) if kv.scale.dtype != jnp.uint8 else kv.scale] \
        if w_fp8 else [kv]
    c_fp4 = False
    if has_comp:
        lists.append(_pad_idx(comp_idx.astype(jnp.int32).reshape(rows, comp_idx.shape[-1]), bk2))
        c_fp4 = isinstance(comp_kv, Fp4Tensor)
        stores += [le_words(comp_kv.data), comp_kv.scale] if c_fp4 else [comp_kv]
    stage = bool(c["stage_values"])
    hb, cb, nb2 = hp // bh, d // dv, sum(x.shape[-1] for x in lists) // bk2
    ks = key_splits(rows, hb, cb, nb2, c) if stage else nb2  # pass 2's blocks per program
    splits = -(-nb2 // ks)
    if splits * ks != nb2:  # the last split's blocks past the lists: -1 entries (-inf logits, zero weights)
        lists[-1] = jnp.pad(lists[-1], ((0, 0), (0, (splits * ks - nb2) * bk2)), constant_values=-1)
    widx = lists[0]
    kp = sum(x.shape[-1] for x in lists)
    nb1, nwb2 = kp // bk1, widx.shape[-1] // bk2
    nb1p = 1 << (nb1 - 1).bit_length()  # pass 2 loads the block maxima as one power-of-two tile
    loop = pass1_loop(c["p1_loop"], [x.shape[-1] // bk1 for x in lists])
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kinds = dict(cdt=q.dtype, prec=prec, w_fp8=w_fp8, c_fp4=c_fp4, has_comp=has_comp)

    def store_specs(grid_rank):
        def spec(a):
            n, w = a.shape[1], a.shape[2]
            return pl.BlockSpec((None, n, w), (lambda r, j: (r // s, 0, 0)) if grid_rank == 2
                                else (lambda r, i, j, t: (r // s, 0, 0)))
        return [spec(a) for a in stores]

    params = pltriton.CompilerParams(num_warps=c["num_warps"], num_stages=1)
    bmax_spec = pl.BlockSpec((None, None, hp), lambda r, j: (r, j, 0)) if loop == 1 else \
        pl.BlockSpec((None, loop, hp), lambda r, j: (r, j, 0))
    out_specs = [pl.BlockSpec((None, hp, loop * bk1), lambda r, j: (r, 0, j)), bmax_spec]
    out_shape = [jax.ShapeDtypeStruct((rows, hp, kp), jnp.float32), jax.ShapeDtypeStruct((rows, nb1p, hp), jnp.float32)]
    if stage:  # pass 1's decoded rows, [rows, K, D] in q's dtype
        out_specs.append(pl.BlockSpec((None, loop * bk1, d), lambda r, j: (r, j, 0)))
        out_shape.append(jax.ShapeDtypeStruct((rows, kp, d), q.dtype))
    lg, bmax, *vals = pl.pallas_call(
        functools.partial(_logits_kernel, nwb1=widx.shape[-1] // bk1, dc=c["dc"], d=d, scale=float(scale), stage=stage,
                          loop=loop, skip_empty=bool(c["skip_empty"]), **kinds),
        grid=(rows, nb1 // loop),
        in_specs=[pl.BlockSpec((None, hp, d), lambda r, j: (r, 0, 0)),
                  *[pl.BlockSpec((None, x.shape[-1]), lambda r, j: (r, 0)) for x in lists], *store_specs(2)],
        out_specs=tuple(out_specs),
        out_shape=tuple(out_shape),
        compiler_params=params,
        interpret=interpret,
        name="sparse_attention_logits",
    )(qf, *lists, *stores)
    common = dict(nb=ks, nb1=nb1, bk2=bk2, dv=dv, group=max(1, c["group"]), cdt=q.dtype, prec=prec,
                  skip_empty=bk2 // bk1 if c["skip_empty"] else 0)
    head_specs = [pl.BlockSpec((None, bh, ks * bk2), lambda r, i, j, t: (r, i, t)),
                  pl.BlockSpec((None, nb1p, bh), lambda r, i, j, t: (r, 0, i))]
    sink_spec = pl.BlockSpec((bh,), lambda r, i, j, t: (i,))
    if stage:
        kernel = functools.partial(_pv_staged_kernel, **common)
        specs = [*head_specs, pl.BlockSpec((None, ks * bk2, dv), lambda r, i, j, t: (r, t, j)), sink_spec]
        args = (lg, bmax, vals[0], sinkf)
    else:
        kernel = functools.partial(_pv_gather_kernel, nwb2=nwb2, w_fp8=w_fp8, c_fp4=c_fp4, has_comp=has_comp, **common)
        specs = [*head_specs, pl.BlockSpec((None, kp), lambda r, i, j, t: (r, 0)), *store_specs(4), sink_spec]
        args = (lg, bmax, jnp.concatenate(lists, axis=-1) if len(lists) > 1 else widx, *stores, sinkf)
    if splits == 1:
        out_specs = pl.BlockSpec((None, bh, dv), lambda r, i, j, t: (r, i, j))
        out_shape = jax.ShapeDtypeStruct((rows, hp, d), q.dtype)
    else:  # each split's fp32 sums (the denominators once per column block: no two programs write one)
        out_specs = (pl.BlockSpec((None, None, bh, dv), lambda r, i, j, t: (t, r, i, j)),
                     pl.BlockSpec((None, None, None, bh), lambda r, i, j, t: (t, r, j, i)))
        out_shape = (jax.ShapeDtypeStruct((splits, rows, hp, d), jnp.float32),
                     jax.ShapeDtypeStruct((splits, rows, cb, hp), jnp.float32))
    pv_params = pltriton.CompilerParams(num_warps=c["pv_warps"] or c["num_warps"], num_stages=1)
    out = pl.pallas_call(
        kernel,
        grid=(rows, hb, cb, splits),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pv_params,
        interpret=interpret,
        name="sparse_attention_pv",
    )(*args)
    if splits > 1:
        out = _finish_splits(out[0], out[1][:, :, 0], q.dtype)
    return out[:, :h].reshape(b, s, h, d)
