"""H200 benchmark: sparse attention decode, Pallas-Triton kernel vs the jitted XLA reference.

    PYTHONPATH=. python -m pallas_kernels.sparse_attention.benchmark [--out DIR] [--quick]

Protocol (printed with the table):
* correctness first: the Pallas output is compared with ``reference.sparse_attention`` (jit) on the
  GPU on fresh random inputs (FP8 window, FP4 compressed cache, -1 padding, a query with no key);
* timing: one jitted program runs the op ``N`` times back to back (each call depends on the previous
  one through a zero-valued perturbation of ``sink``, so nothing is hoisted or merged); the time of
  an identical program with ``N = 1`` is subtracted and the difference divided by ``N - 1``, which
  removes the Python dispatch cost; median over ``reps`` repetitions;
* byte floor: the bytes the op must move once — q (bf16), the 128 window rows (512 B FP8 + 16 B
  scales), the 512 compressed rows (256 B FP4 + 32 B scales), the int32 index lists and the bf16
  output — divided by 4.8 TB/s (H200 HBM, ``performance.md`` §4);
* read anchor: one XLA reduction reading the floor's bytes contiguously, timed the same way: the
  cost of a single kernel that only reads those bytes (at batch 1 and 8 it is launch and tail, not
  bandwidth).

Decode shapes: H = 64, D = 512, window 128 (ring, all valid), top-k 512 compressed picks over a cache
of ``context`` entries (ratio-1 layer: one compressed entry per token), batch 1 / 8 / 64.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


from pallas_kernels.benchmarking import (BF16_DENSE_FLOPS, HBM_BYTES_PER_S, chained_args, read_anchor, timed,
                                         write_rows, zero_of)

def make_inputs(key, b, s, nc, *, kw=128, kc=512, h=64, d=512, dtype=None, pad_frac=0.0):
    import jax.numpy as jnp

    dtype = dtype or jnp.bfloat16
    return _make_inputs_jit()(key, b, s, nc, kw, kc, h, d, jnp.dtype(dtype), pad_frac)


@functools.cache
def _make_inputs_jit():
    """``make_inputs`` as one jitted program per shape (eagerly, each of its dozen random draws,
    casts and sorts compiled on its own: most of a CPU test's time); the same values."""
    import jax

    return jax.jit(_make_inputs, static_argnums=tuple(range(1, 10)))


def _make_inputs(key, b, s, nc, kw, kc, h, d, dtype, pad_frac):
    import jax
    import jax.numpy as jnp

    import dsv41_jax.quant as quant
    ks = jax.random.split(key, 8)
    q, win, widx, sink = _query_side(ks[0], ks[1], ks[6], b, s, kw, h, d, dtype)
    data = jax.random.bits(ks[2], (b, nc, d // 2), jnp.uint8)
    sc = (jax.random.uniform(ks[3], (b, nc, d // 16), jnp.float32, 0.05, 0.5)).astype(jnp.float8_e4m3fn)
    ck = quant.Fp4Tensor(data=data, scale=sc, block=16)
    # distinct random picks per query, sorted (as the indexer returns them)
    r = jax.random.uniform(ks[4], (b, s, nc))
    cidx = jnp.sort(jax.lax.top_k(r, kc)[1], axis=-1).astype(jnp.int32) if nc <= (1 << 16) else jnp.sort(
        jax.random.randint(ks[4], (b, s, kc), 0, nc), axis=-1).astype(jnp.int32)
    if pad_frac:
        drop = jax.random.bernoulli(ks[5], pad_frac, cidx.shape)
        cidx = jnp.where(drop, -1, cidx)
    return q, win, widx, sink, ck, cidx


def _query_side(kq, kwin, ksink, b, s, kw, h, d, dtype):
    """The inputs besides the compressed cache and its picks: query rows [b, s, h, d], the FP8 window
    [b, kw, d] (all valid: widx 0..kw-1 for every row) and the sinks [h]."""
    import jax
    import jax.numpy as jnp

    import dsv41_jax.quant as quant

    q = jax.random.normal(kq, (b, s, h, d), jnp.float32).astype(dtype)
    win = quant.quantize_fp8(jax.random.normal(kwin, (b, kw, d), jnp.float32), (1, 32))
    widx = jnp.broadcast_to(jnp.arange(kw, dtype=jnp.int32), (b, s, kw))
    return q, win, widx, jax.random.normal(ksink, (h,), jnp.float32)


def make_prefill_inputs(key, s, ratio, *, window=128, kc=512, h=64, d=512):
    """The inputs of a model's first prefill chunk of ``s`` tokens (B = 1, pos0 = 0), laid out as the
    model lays them out: the window store is the (empty) ring followed by the chunk, FP8 [1, window +
    s, d], indexed by the model's own window lists (``dsv41_jax.attention.window_indices``); the
    compressed cache holds s // ratio FP4 entries, and query p picks the top ``kc`` of random scores
    over its (p + 1) // ratio visible entries in the indexer's layout (ascending, -1 padded:
    ``lightning_indexer.reference.topk_ascending``), so the first kc * ratio queries' lists are
    partly -1. (``make_inputs`` gives every query the same 128 valid window rows and kc valid picks.)"""
    return _make_prefill_inputs_jit()(key, s, ratio, window, kc, h, d)


@functools.cache
def _make_prefill_inputs_jit():
    import jax

    return jax.jit(_make_prefill_inputs, static_argnums=tuple(range(1, 7)))


def _make_prefill_inputs(key, s, ratio, window, kc, h, d):
    import jax
    import jax.numpy as jnp

    import dsv41_jax.quant as quant
    from dsv41_jax.attention import window_indices
    from pallas_kernels.lightning_indexer.reference import topk_ascending

    ks = jax.random.split(key, 6)
    nc = s // ratio
    q = jax.random.normal(ks[0], (1, s, h, d), jnp.float32).astype(jnp.bfloat16)
    win = quant.quantize_fp8(jax.random.normal(ks[1], (1, window + s, d), jnp.float32), (1, 32))
    positions = jnp.arange(s, dtype=jnp.int32)[None]
    widx = window_indices(positions, jnp.zeros((1,), jnp.int32), window)
    data = jax.random.bits(ks[2], (1, nc, d // 2), jnp.uint8)
    sc = jax.random.uniform(ks[3], (1, nc, d // 16), jnp.float32, 0.05, 0.5).astype(jnp.float8_e4m3fn)
    ck = quant.Fp4Tensor(data=data, scale=sc, block=16)
    visible = (positions[..., None] + 1) // ratio  # [1, s, 1]
    scores = jax.random.uniform(ks[4], (1, s, nc))
    scores = jnp.where(jnp.arange(nc)[None, None] < visible, scores, -jnp.inf)
    cidx = topk_ascending(scores, kc)
    sink = jax.random.normal(ks[5], (h,), jnp.float32)
    return q, win, widx, sink, ck, cidx


def floor_bytes(b, s, *, h=64, d=512, kw=128, kc=512, qbytes=2):
    per_row = h * d * qbytes * 2 + kw * (d + d // 32) + kc * (d // 2 + d // 16) + (kw + kc) * 4
    return b * s * per_row


def floor_flops(b, s, *, h=64, d=512, kw=128, kc=512):
    """The op's dot FLOPs: q·kᵀ and P·V over every head and listed key of each query row (2 · 2 · H ·
    K · D per row; the MQA keys are distinct per row, so no row shares another's)."""
    return 4 * b * s * h * (kw + kc) * d


# Column-split variants (fewer register spills offline, session 12; timed in session 13, BENCHMARKS.md),
# checked and swept with --sweep beside the default.
D_SPLIT_SWEEP = (dict(d_split=2), dict(d_split=4), dict(d_split=4, num_warps=4), dict(d_split=8),
                 dict(d_split=8, num_warps=4), dict(d_split=4, block_h=32, num_warps=4), dict(combine="pallas"),
                 dict(combine="kernel"))


def check(log, cfgs=({},)):
    """Each config in ``cfgs`` against the reference on three cases (batch-8 decode at 64K, S = 6
    verify rows, f32), a query with no valid key included."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.sparse_attention import pallas_triton as pt
    from pallas_kernels.sparse_attention import reference as ref

    ok = True
    for (b, s, nc, dt) in [(8, 1, 65536, jnp.bfloat16), (2, 6, 4096, jnp.bfloat16), (2, 1, 4096, jnp.float32)]:
        q, win, widx, sink, ck, cidx = make_inputs(jax.random.PRNGKey(b * 7 + s), b, s, nc, dtype=dt, pad_frac=0.2)
        widx = widx.at[0, 0].set(-1)
        cidx = cidx.at[0, 0].set(-1)  # a query with no valid key at all
        if dt == jnp.float32:
            win = win.dequantize(jnp.float32)
        f_ref = jax.jit(lambda *a: ref.sparse_attention(*a[:4], scale=512 ** -0.5, comp_kv=a[4], comp_idx=a[5]))
        r = np.asarray(f_ref(q, win, widx, sink, ck, cidx).astype(jnp.float32))
        tol = 2e-2 if dt == jnp.bfloat16 else 1e-4
        for cfg in cfgs:
            f_pal = jax.jit(lambda *a, cfg=cfg: pt.sparse_attention(*a[:4], scale=512 ** -0.5, comp_kv=a[4],
                                                                    comp_idx=a[5], **cfg))
            o = np.asarray(f_pal(q, win, widx, sink, ck, cidx).astype(jnp.float32))
            err = float(np.abs(o - r).max())
            rel = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
            good = bool(np.isfinite(o).all() and rel < tol and np.abs(o[0, 0]).max() == 0.0)
            ok &= good
            log(f"check B={b} S={s} Nc={nc} {jnp.dtype(dt).name} {cfg or 'default'}: max|err|={err:.3e} rel={rel:.3e} "
                f"empty-row-zero={np.abs(o[0, 0]).max() == 0.0} -> {'OK' if good else 'FAIL'}")
    return ok


# The --site variants: (label, sparse_attention keyword arguments; None = the XLA reference)
SITE_VARIANTS = (("xla", None), ("pallas default", dict(combine="xla")), ("pallas combine", dict(combine="pallas")),
                 ("pallas in-kernel combine", dict(combine="kernel")),
                 ("pallas 8 splits", dict(num_splits=8, combine="xla")),
                 ("pallas 8 splits combine", dict(num_splits=8, combine="pallas")),
                 ("pallas 8 splits in-kernel", dict(num_splits=8, combine="kernel")))


# The --decode variants: the two-pass decode kernels (pallas_triton_two_pass; "two_pass": its config
# overrides) against the XLA reference and the flash kernel, at decode and verify row counts
DECODE_VARIANTS = (("xla", None), ("pallas flash", dict(method="flash")), ("two-pass", dict(two_pass={})),
                   ("two-pass one key split", dict(two_pass=dict(split=64))),
                   ("two-pass 256 programs", dict(two_pass=dict(pv_programs=256))),
                   ("two-pass split 1 block", dict(two_pass=dict(split=1))),
                   ("two-pass split 5 blocks", dict(two_pass=dict(split=5))),
                   ("two-pass pv warps 2", dict(two_pass=dict(pv_warps=2))),
                   ("two-pass pv warps 1", dict(two_pass=dict(pv_warps=1))),
                   ("two-pass gathered values", dict(two_pass=dict(stage_values=False))),
                   ("two-pass dv 32", dict(two_pass=dict(dv=32))))
# the model benchmark's lists (dsv41_jax.bench: 1,024 new tokens, no prompt): CSA layers top-256 of
# 256 compressed entries, HCA layers every one of 8, each beside the 128-entry window
DECODE_SHORT_LISTS = (("csa-256", 256, 256), ("hca-8", 8, 8))


# The --rounding variants: the XLA reference with the row's maximum against the emulation of
# DeepSeek's running maximum (P.V with the rescaled weights in 2 or 3 bf16 parts) and against the
# Pallas kernel in DeepSeek's blocks (64 keys, one split: its loop is DeepSeek's)
ROUNDING_VARIANTS = (("xla, row max", None),
                     ("xla, running max, 3 parts", dict(reference=dict(running_max_block=64))),
                     ("xla, running max, 2 parts", dict(reference=dict(running_max_block=64, pv_parts=2))),
                     ("pallas, 64-key blocks", dict(block_k=64, num_splits=1)))


# The --prefill variants: prefill-sized row counts (one query row per prompt token), where the
# kernel's grid is rows x head blocks without flash-decoding splits.
PREFILL_VARIANTS = (("xla, row max", None),
                    ("pallas default", {}),
                    ("pallas, 64-key blocks", dict(block_k=64, num_splits=1)),
                    ("pallas, 64-key blocks, 32 heads", dict(block_k=64, num_splits=1, block_h=32)))


def checked_device_time(fn, args, shared, y0, reps):
    """(seconds, kernels, rel err) of ``fn``: its output on ``args[0]`` (+ ``shared``) compared with
    ``y0`` first (relative Frobenius error), then its device time over ``args``
    (:func:`~pallas_kernels.benchmarking.device_time_op`, with the list of its kernels)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import benchmarking

    y = np.asarray(jax.jit(fn)(*args[0], *shared).astype(jnp.float32))
    rel = float(np.linalg.norm(y - y0) / np.linalg.norm(y0))
    kernels = []
    t = benchmarking.device_time_op(fn, args, shared, reps=reps, kernels=kernels)
    return t, kernels, rel


# The --table variants: the op alone (no site around it) for the issue-5 table, by device time
TABLE_VARIANTS = (("xla", None), ("pallas flash", dict(method="flash")), ("two-pass", dict(two_pass={})))
TABLE_CASES = tuple((nc, b, 1) for nc in (4096, 65536, 1 << 20) for b in (1, 8, 64)) + ((65536, 1, 6),)

# The --tiles variants (session 55's sweep, H100: BENCHMARKS.md issue 5): the defaults beside the
# tiles they replaced, the alternatives that lost and session 57's looped pass 1 (loops of 2: 2.5 % faster
# than one block a program at batch 32-64, far slower at batch 1-8; session 58), at every decode size of one context.
TILE_VARIANTS = TABLE_VARIANTS + (
    ("two-pass, session 54 tiles", dict(two_pass=dict(dv=64, group=3, pv_programs=512))),
    ("two-pass dv 128", dict(two_pass=dict(dv=128))),
    ("two-pass group 3", dict(two_pass=dict(group=3))),
    ("two-pass 512 programs", dict(two_pass=dict(pv_programs=512))),
    ("two-pass unstaged", dict(two_pass=dict(stage_values=False))),
    ("two-pass, pass 1 loops 2 blocks", dict(two_pass=dict(p1_loop=2))),
    # session 58 (H100, 64K context): loops of 4 spill the q tile's wgmma descriptors and are slower at
    # every batch (batch 64 124.8 against 92.6 us); pass 2 gathering its own values for all 64 heads
    # (bh 64, dv 128, 8 warps, unstaged) takes pass 2 from 48 to 80 us at batch 64 -- both dropped
    # here (BENCHMARKS.md, issue 5, session 58); bh 64 keeps its interpret parity test
    # session 58, untimed: blocks of -1 entries (the model's short contexts: --contexts 96) not computed
    ("two-pass, empty blocks skipped", dict(two_pass=dict(skip_empty=True))),
    ("flash, 1 column block, 8 warps", dict(method="flash", d_split=1, num_warps=8)),
    ("flash, 2 column blocks, 4 warps", dict(method="flash", d_split=2, num_warps=4)),
)
TILE_CASES = ((65536, 1, 1), (65536, 1, 6), (65536, 8, 1), (65536, 32, 1), (65536, 64, 1))


def tile_variants(words: str | None = None):
    """:data:`TILE_VARIANTS`, or (``words``: separated by semicolons, as the names hold commas) XLA's reference and the variants whose
    names contain one of them (``=name``: that name exactly); a word that names none is an error
    naming the variants."""
    if not words:
        return TILE_VARIANTS

    def hit(w, n):
        return n == w[1:] if w.startswith("=") else w in n

    ws = [w.strip() for w in words.split(";") if w.strip()]
    unknown = [w for w in ws if not any(hit(w, n) for n, _ in TILE_VARIANTS)]
    if unknown:
        raise SystemExit(f"--variants {';'.join(unknown)}: no --tiles variant's name contains it; the variants are "
                         + "; ".join(n for n, _ in TILE_VARIANTS))
    return tuple((n, c) for n, c in TILE_VARIANTS if c is None or any(hit(w, n) for w in ws))


def table_op(cfg, scale):
    """The op of one table variant, ``f(q, win, widx, sink, cidx, ck)``: ``cfg`` None is the XLA
    reference, ``{"two_pass": tiles}`` the two-pass kernels with those tiles, anything else the
    keyword arguments of ``pallas_triton.sparse_attention`` (the flash kernel and its dispatch)."""
    from pallas_kernels.sparse_attention import pallas_triton as pt
    from pallas_kernels.sparse_attention import pallas_triton_two_pass as tp
    from pallas_kernels.sparse_attention import reference as ref

    def f(q, win, widx, sink, cidx, ck):
        kw = dict(scale=scale, comp_kv=ck, comp_idx=cidx)
        if cfg is None:
            return ref.sparse_attention(q, win, widx, sink, **kw)
        if "two_pass" in cfg:
            return tp.sparse_attention(q, win, widx, sink, **kw, config=cfg["two_pass"])
        return pt.sparse_attention(q, win, widx, sink, **kw, **cfg)
    return f


@functools.cache
def _table_rep_jit():
    """Rep r's own query rows, window and sorted compressed picks (distinct per rep; the compressed
    cache is shared, so a 1M-entry cache at batch 64 (19 GB) is built once per row)."""
    import jax
    import jax.numpy as jnp

    def rep(key, b, s, nc, kw, kc, h, d):
        ks = jax.random.split(key, 4)
        q, win, widx, sink = _query_side(ks[0], ks[1], ks[3], b, s, kw, h, d, jnp.bfloat16)
        if nc < kc:  # a short context: every entry, ascending, then -1 padding (the indexer's list there)
            j = jnp.arange(kc, dtype=jnp.int32)
            return q, win, widx, sink, jnp.broadcast_to(jnp.where(j < nc, j, -1), (b, s, kc))
        # kc distinct positions per query row: a random offset into each of kc equal strides, sorted
        stride = nc // kc
        off = jax.random.randint(ks[2], (b, s, kc), 0, stride)
        cidx = (jnp.arange(kc, dtype=jnp.int32) * stride + off).astype(jnp.int32)
        return q, win, widx, sink, cidx

    return jax.jit(rep, static_argnums=tuple(range(1, 8)))


def op_table(log, cases=TABLE_CASES, variants=TABLE_VARIANTS, reps=3, kw=128, kc=512, h=64, d=512):
    """The issue-5 table by device time (:func:`device_time_op`: the sum of the op's kernels over
    ``reps`` distinct query / window / pick sets sharing one compressed cache, L2 flushed): the op
    alone for each (context, batch, rows per batch element) case and variant (the XLA reference, the
    flash kernel, the two-pass kernels), each checked against the XLA output first (rel err < 2e-2),
    beside the byte floor (:func:`floor_bytes` at 4.8 TB/s), the FLOP floor (:func:`floor_flops` at
    989 TFLOP/s bf16: above the byte floor at every decode batch, so 70 % of HBM would ask for more
    than 80 % of the tensor-core peak; BENCHMARKS.md, issue 5, sessions 13 and 56) and a read anchor
    (XLA's sum over that many distinct bytes, by the same device time). Returns the rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.benchmarking import device_time_op

    op = functools.partial(table_op, scale=d ** -0.5)
    rows = []
    for nc, b, s in cases:
        # a context of fewer than kc compressed entries (the model's short prompts) lists them all, then
        # -1 padding to kc; its floors count the listed entries only
        listed = min(kc, nc)
        ck = make_inputs(jax.random.PRNGKey(nc + b), b, 1, nc, kw=kw, kc=listed, h=h, d=d)[4]
        args = [_table_rep_jit()(jax.random.PRNGKey(1000 * r + b + s), b, s, nc, kw, kc, h, d) for r in range(reps)]
        fb = floor_bytes(b, s, h=h, d=d, kw=kw, kc=listed)
        flop_us = floor_flops(b, s, h=h, d=d, kw=kw, kc=listed) / BF16_DENSE_FLOPS * 1e6
        words = [(jax.random.bits(jax.random.PRNGKey(7 + r), (max(fb // 4, 1),), jnp.uint32),) for r in range(reps)]
        t_a = device_time_op(lambda w: jnp.sum(w, dtype=jnp.uint32), words, reps=reps)
        del words
        y0 = np.asarray(jax.jit(op(None))(*args[0], ck).astype(jnp.float32))
        row = dict(context=nc, batch=b, seq=s, bytes=fb, floor_us=fb / HBM_BYTES_PER_S * 1e6, anchor_us=t_a * 1e6,
                   flop_floor_us=flop_us, variants={})
        for name, cfg in variants:
            try:
                t, kernels, rel = checked_device_time(op(cfg), args, (ck,), y0, reps)
                row["variants"][name] = dict(us=t * 1e6, kernels=len(kernels), rel_err=rel, ok=rel < 2e-2)
                top = ", ".join(f"{k[:24]} {kt * 1e6:.1f}" for k, kt in kernels[:3])
                log(f"table ctx={nc} B={b} S={s} {name}: {t*1e6:8.2f} us in {len(kernels)} kernels, rel {rel:.2e}"
                    f"{'' if rel < 2e-2 else '  WRONG'}  floor {row['floor_us']:.2f} us, read anchor {t_a*1e6:.2f} us"
                    f"  [{top}]")
            except Exception as e:  # noqa: BLE001
                row["variants"][name] = dict(us=float("nan"), kernels=0, rel_err=float("nan"), ok=False,
                                             error=f"{type(e).__name__}: {str(e)[:200]}")
                log(f"table ctx={nc} B={b} S={s} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        del ck, args
    names = [n for n, _ in variants]
    log("")
    log("| context | batch × rows | " + " | ".join(f"{n} µs" for n in names)
        + " | byte floor µs (4.8 TB/s) | FLOP floor µs (989 TF/s) | read anchor µs | best Pallas / XLA"
          " | floor / best Pallas | anchor / best Pallas |")
    log("|---:|---:|" + "---:|" * (len(names) + 6))
    for r in rows:
        v = r["variants"]
        pal = [v[n]["us"] for n in names[1:] if v[n]["ok"]]
        best = min(pal) if pal else float("nan")
        x = v[names[0]]["us"]
        log(f"| {r['context']:,} | {r['batch']} × {r['seq']} | " + " | ".join(f"{v[n]['us']:.2f}" for n in names)
            + f" | {r['floor_us']:.2f} | {r['flop_floor_us']:.2f} | {r['anchor_us']:.2f} | {best / x:.3f} | "
              f"{r['floor_us'] / best * 100:.1f} % | "
              f"{r['anchor_us'] / best * 100:.1f} % |")
    return rows


def site(log, contexts=(2560, 5121), batches=(1,), variants=SITE_VARIANTS, reps=5, seq=1, inputs=None, label=""):
    """The model's attention site at decode (sparse attention -> inverse RoPE -> wo_a, the grouped FP8
    GEMV of 8 groups x 1024 rows), by device time (:func:`device_time_op`: the sum of the site's
    kernels, 5 distinct input sets, L2 flushed), for the XLA reference and Pallas variants. Each
    variant is first compared with the XLA site (rel err of the wo_a output). The kernel alone can win
    while the site does not: XLA fuses its combine into wo_a's input (BENCHMARKS.md, issue 5, session 15).
    ``inputs(key, b, seq, nc)``: the op's inputs (default :func:`make_inputs`); ``label`` names them
    in the log and the rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.rope import apply_rope
    from pallas_kernels.benchmarking import random_fp8
    from pallas_kernels.quantized_matmul.api import grouped_matmul
    from pallas_kernels.sparse_attention import pallas_triton as pt
    from pallas_kernels.sparse_attention import pallas_triton_two_pass as tp
    from pallas_kernels.sparse_attention import reference as ref

    scale = 512 ** -0.5
    w = random_fp8(jax.random.PRNGKey(3), 8 * 1024, 4096)

    def site_fn(cfg):
        def f(q, win, widx, sink, ck, cidx, ang, w):
            kw = dict(scale=scale, comp_kv=ck, comp_idx=cidx)
            if cfg is None or "reference" in cfg:
                o = ref.sparse_attention(q, win, widx, sink, **kw, **(cfg or {}).get("reference", {}))
            elif "two_pass" in cfg:
                o = tp.sparse_attention(q, win, widx, sink, **kw, config=cfg["two_pass"])
            else:
                o = pt.sparse_attention(q, win, widx, sink, **kw, **cfg)
            o = apply_rope(o, ang, inverse=True)
            return grouped_matmul(o.reshape(*o.shape[:2], 8, -1).astype(jnp.bfloat16), w, groups=8)
        return f

    rows = []
    for nc in contexts:
        for b in batches:
            args = [(*(inputs or make_inputs)(jax.random.PRNGKey(100 * nc + 10 * b + r), b, seq, nc),
                     jax.random.uniform(jax.random.PRNGKey(r), (b, seq, 32), jnp.float32, 0, 6.28)) for r in range(reps)]
            y0 = np.asarray(jax.jit(site_fn(None))(*args[0], w).astype(jnp.float32))
            t_x = None
            for name, cfg in variants:
                try:
                    t, kernels, rel = checked_device_time(site_fn(cfg), args, (w,), y0, reps)
                    t_x = t if cfg is None else t_x
                    rows.append(dict(context=nc, batch=b, seq=seq, variant=name, inputs=label or "uniform",
                                     site_us=t * 1e6, kernels=len(kernels), rel_err=rel, ok=rel < 2e-2))
                    top = ", ".join(f"{n[:28]} {k * 1e6:.2f}" for n, k in kernels[:4])
                    log(f"site{label and ' ' + label} ctx={nc} B={b} S={seq} {name:26s} {t * 1e6:7.2f} us  "
                        f"{len(kernels):2d} kernels  rel {rel:.1e}"
                        f"{'' if rel < 2e-2 else '  WRONG'}  xla/this {t_x / t if t_x else float('nan'):.2f}  [{top}]")
                except Exception as e:  # noqa: BLE001
                    log(f"site{label and ' ' + label} ctx={nc} B={b} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
    return rows


def main(argv=None):
    from dsv41_jax.bench import positive_ints

    ap = chained_args(argparse.ArgumentParser(), n=20, reps=7, skip_xla_help="time the Pallas kernel only")
    ap.add_argument("--site", action="store_true",
                    help="the model's decode site (attention -> inverse RoPE -> wo_a) by device time, then exit")
    ap.add_argument("--rounding", action="store_true",
                    help="the decode site and a 4096-row prefill chunk with the XLA reference's P.V roundings, then exit")
    ap.add_argument("--prefill", action="store_true",
                    help="the site at prefill row counts (256 to 4096 rows; then a first 4096-token chunk laid out "
                         "as the model lays it out, compressed ratios 2 and 1), XLA against Pallas tilings, then exit")
    ap.add_argument("--table", action="store_true",
                    help="the issue-5 table by device time: the op alone at contexts 4K / 64K / 1M x batch 1 / 8 / 64 "
                         "and 6 verify rows, XLA against the flash and two-pass kernels, with the byte floor and a read "
                         "anchor, then exit (--quick: contexts 4K and 64K)")
    ap.add_argument("--tiles", action="store_true",
                    help="the op alone at 64K context (--contexts: others) and every decode size (batch 1 / 6 verify rows / 8 / 32 / "
                         "64): XLA, the flash and two-pass defaults and the tiles session 55 compared them with "
                         "(TILE_VARIANTS), with each variant's kernels, then exit")
    ap.add_argument("--variants", default=None,
                    help="--tiles: only the variants whose names contain one of these words, separated by semicolons "
                         "(XLA's reference always runs first; '=name': that name exactly), e.g. '=two-pass;loops'")
    ap.add_argument("--contexts", type=positive_ints, default=None,
                    help="--tiles: these compressed-cache sizes (comma-separated) in place of 65536, e.g. 96,65536; "
                         "below 512 entries a row lists them all, then -1 padding (the model's short prompts: "
                         "context / 4 entries at V4.1's ratio 4)")
    ap.add_argument("--decode", action="store_true",
                    help="the decode site at batch 1, 8 and 6 verify rows: XLA, the flash kernel and the two-pass "
                         "kernels (with tile variants) by device time, then exit")
    args = ap.parse_args(argv)

    import jax

    from pallas_kernels.sparse_attention import pallas_triton as pt
    from pallas_kernels.sparse_attention import reference as ref

    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    dev = jax.devices()[0]
    if args.site:
        log(f"# sparse attention site (attention -> inverse RoPE -> wo_a), device time | {dev.device_kind} | "
            f"jax {jax.__version__}")
        rows = site(log, batches=(1,) if args.quick else (1, 8))
        write_rows(args.out, "sparse_attention_site.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if args.table or args.tiles:
        log(f"# sparse attention op, device time | {dev.device_kind} | jax {jax.__version__} | reps={args.reps}")
        if args.tiles:
            cases = TILE_CASES if not args.contexts else tuple(
                (nc, b, s) for nc in args.contexts for _, b, s in TILE_CASES)
            rows = op_table(log, cases, variants=tile_variants(args.variants), reps=args.reps)
        else:
            rows = op_table(log, [c for c in TABLE_CASES if not (args.quick and c[0] > 65536)], reps=args.reps)
        name = "sparse_attention_tiles" if args.tiles else "sparse_attention_table"
        write_rows(args.out, f"{name}.json", rows)
        with open(os.path.join(args.out, f"{name}.log"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        return 0 if rows and all(v["ok"] for r in rows for v in r["variants"].values()) else 1
    if args.decode:
        log(f"# sparse attention decode site, two-pass kernels, device time | {dev.device_kind} | jax {jax.__version__}")
        rows = site(log, contexts=(5121,), batches=(1, 8), variants=DECODE_VARIANTS, reps=args.reps)
        rows += site(log, contexts=(5121,), batches=(1,), variants=DECODE_VARIANTS[:5], reps=args.reps, seq=6)
        for label, nc, kc in DECODE_SHORT_LISTS:
            rows += site(log, contexts=(nc,), batches=(1, 8), variants=DECODE_VARIANTS[:5], reps=args.reps,
                         inputs=functools.partial(make_inputs, kc=kc), label=label)
        write_rows(args.out, "sparse_attention_decode.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if args.rounding:
        log(f"# sparse attention site, XLA reference roundings, device time | {dev.device_kind} | jax {jax.__version__}")
        rows = site(log, contexts=(5121,), batches=(1, 8, 32), variants=ROUNDING_VARIANTS)
        rows += site(log, contexts=(1024,), batches=(1,), variants=ROUNDING_VARIANTS, reps=2, seq=4096)
        write_rows(args.out, "sparse_attention_rounding.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if args.prefill:
        log(f"# sparse attention site at prefill row counts, device time | {dev.device_kind} | jax {jax.__version__}")
        rows = []
        for seq in (256, 1024, 4096):
            rows += site(log, contexts=(1024,), batches=(1,), variants=PREFILL_VARIANTS, reps=2 if seq > 1024 else 3,
                         seq=seq)
        # the model's first 4,096-token chunk: its window store and lists, causal compressed picks
        for ratio in (2, 1):
            rows += site(log, contexts=(4096 // ratio,), batches=(1,), variants=PREFILL_VARIANTS[:3], reps=2, seq=4096,
                         inputs=lambda k, b, seq, nc, ratio=ratio: make_prefill_inputs(k, seq, ratio),
                         label=f"model-like ratio {ratio}")
        write_rows(args.out, "sparse_attention_prefill.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    log(f"# sparse attention decode | device {dev.device_kind} | jax {jax.__version__} | n={args.n} reps={args.reps}")
    ok = check(log, ({},) + (D_SPLIT_SWEEP if args.sweep else ()))

    contexts = [4096, 65536] if args.quick else [4096, 65536, 1 << 20]
    batches = [1, 8, 64]
    rows = []
    scale = 512 ** -0.5

    def run_pallas(cfg):
        def f(a, c):
            q, win, widx, sink, ck, cidx = a
            o = pt.sparse_attention(q, win, widx, sink + c, scale=scale, comp_kv=ck, comp_idx=cidx, **cfg)
            return o, zero_of(o)
        return f

    def run_ref(a, c):
        q, win, widx, sink, ck, cidx = a
        o = ref.sparse_attention(q, win, widx, sink + c, scale=scale, comp_kv=ck, comp_idx=cidx)
        return o, zero_of(o)

    for nc in contexts:
        for b in batches:
            a = make_inputs(jax.random.PRNGKey(nc + b), b, 1, nc)
            fb = floor_bytes(b, 1)
            t_floor = fb / HBM_BYTES_PER_S
            t_p, _, _ = timed(run_pallas({}), a, n=args.n, reps=args.reps)
            t_r = float("nan") if args.skip_xla else timed(run_ref, a, n=args.n, reps=args.reps)[0]
            t_a = read_anchor(fb, n=args.n, reps=args.reps)
            cfg = pt.default_config(b, 64, 128, 512)
            row = dict(context=nc, batch=b, pallas_us=t_p * 1e6, xla_us=t_r * 1e6, floor_us=t_floor * 1e6,
                       anchor_us=t_a * 1e6,
                       bytes=fb, speedup=t_r / t_p if t_p else float("nan"),
                       hbm_frac=t_floor / t_p if t_p else float("nan"), cfg=cfg)
            rows.append(row)
            log(f"ctx={nc:>8} B={b:>3}: pallas {t_p*1e6:8.1f} us  xla {t_r*1e6:8.1f} us  floor {t_floor*1e6:6.2f} us "
                f"({fb/1e6:.2f} MB)  read anchor {t_a*1e6:6.2f} us  xla/pallas {row['speedup']:.2f}x  floor/pallas {row['hbm_frac']*100:.1f}%  cfg {cfg}")
            if args.sweep and nc == 65536:
                for var in ([dict(block_k=16), dict(block_h=32, num_warps=4), dict(block_h=16, block_k=16, num_warps=4),
                             dict(num_warps=4)] + list(D_SPLIT_SWEEP)
                            + ([dict(num_splits=4)] if b == 1 else [])):
                    try:
                        t_v, _, _ = timed(run_pallas(var), a, n=args.n, reps=args.reps)
                        log(f"    sweep {var}: {t_v*1e6:8.1f} us  floor/pallas {t_floor/t_v*100:.1f}%")
                    except Exception as e:  # noqa: BLE001
                        log(f"    sweep {var}: FAILED {type(e).__name__}: {str(e)[:200]}")
            del a

    log("")
    log("| context | batch | Pallas (us) | XLA ref (us) | byte floor (us) | read anchor (us) | XLA/Pallas | "
        "floor/Pallas (% of HBM BW) |")
    log("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        log(f"| {r['context']} | {r['batch']} | {r['pallas_us']:.1f} | {r['xla_us']:.1f} | {r['floor_us']:.2f} | {r['anchor_us']:.2f} | "
            f"{r['speedup']:.2f}x | {r['hbm_frac']*100:.1f}% |")
    log(f"correctness: {'OK' if ok else 'FAIL'}")
    write_rows(args.out, "sparse_attention_bench.json", rows, ok=ok)
    with open(os.path.join(args.out, "sparse_attention_bench.log"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
