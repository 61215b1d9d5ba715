"""H200 benchmark: lightning indexer score + top-k, Pallas-Triton vs the jitted XLA reference and
``jax.lax.top_k`` on precomputed scores.

    PYTHONPATH=. python -m pallas_kernels.lightning_indexer.benchmark [--out DIR] [--quick]

Protocol (same as ``pallas_kernels/sparse_attention/benchmark.py``): correctness on the GPU first
(top-k sets against the reference, block maxima), then per-call device time from one jitted program
running the op N times back to back (a zero-valued perturbation of ``weights`` chains the calls), the
N = 1 program subtracted, median of ``reps``.

Byte floor: the MXFP4 key cache must be read once per batch element (64 B codes + 4 B e8m0 scales =
68 B per entry, ``attention.md`` §9.6), plus q (68 B per head), weights and the top-k output;
divided by 4.8 TB/s. Shapes: HI = 32, DI = 128, top_k = 512, block 8, visible = Nc (all entries
causally visible), S = 1 (decode).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from pallas_kernels.benchmarking import HBM_BYTES_PER_S, chained_args, timed, write_rows, zero_of


def make_inputs(key, b, s, nc, *, hi=32, di=128, plain=False):
    """Random MXFP4 q / keys (``plain``: float32 q and the keys dequantized), weights, all visible; one
    jitted program per shape (eagerly, each random draw and quantizer op compiled on its own: most of
    a CPU test's time), the same values."""
    return _make_inputs_jit()(key, b, s, nc, hi, di, plain)


@functools.cache
def _make_inputs_jit():
    import jax

    return jax.jit(_make_inputs, static_argnums=(1, 2, 3, 4, 5, 6))


def _make_inputs(key, b, s, nc, hi, di, plain):
    import jax
    import jax.numpy as jnp

    import dsv41_jax.quant as quant
    ks = jax.random.split(key, 6)
    qf = jax.random.normal(ks[0], (b, s, hi, di), jnp.float32)
    w = jax.random.uniform(ks[1], (b, s, hi), jnp.float32, 0.0, 1.0) * (di ** -0.5 * hi ** -0.5)
    k = quant.quantize_mxfp4(jax.random.normal(ks[2], (b, nc, di), jnp.float32))
    q = quant.quantize_mxfp4(qf)
    vis = jnp.full((b, s), nc, jnp.int32)
    if plain:
        return qf, w, k.dequantize(jnp.float32), vis
    return q, w, k, vis


def floor_bytes(b, s, nc, *, hi=32, di=128, k=512):
    return b * nc * (di // 2 + di // 32) + b * s * (hi * (di // 2 + di // 32) + hi * 4 + k * 4)


CHECK_CASES = [(2, 1, 65536, True, False), (1, 6, 262144, False, True), (2, 3, 4000, False, False)]


def check(log, cases=None):
    """The Pallas pipeline against the reference on the GPU, per (B, S, Nc, block scores, candidate
    mask) of ``cases`` (default :data:`CHECK_CASES`) and per MXFP4 decode route."""
    import jax
    import numpy as np

    from pallas_kernels.lightning_indexer import pallas_triton as pt
    from pallas_kernels.lightning_indexer import reference as ref

    ok = True
    for (b, s, nc, wbs, cb) in cases or CHECK_CASES:
        q, w, k, vis = make_inputs(jax.random.PRNGKey(nc + s), b, s, nc)
        vis = vis.at[0, 0].set(nc // 3)
        if s > 1:
            vis = vis.at[0, 1].set(100)  # fewer visible than top_k: -1 padding
        cbm = None
        if cb:
            cbm = jax.random.bernoulli(jax.random.PRNGKey(3), 0.3, (b, s, -(-nc // 8)))
        rfun = jax.jit(lambda q, w, k, v, c: ref.lightning_indexer(q, w, k, v, top_k=512, candidate_blocks=c,
                                                                   want_block_scores=wbs))
        r = rfun(q, w, k, vis, cbm)
        scores = np.asarray(jax.jit(lambda q, w, k, v, c: ref.index_scores(q, w, k, v, candidate_blocks=c))(
            q, w, k, vis, cbm))
        for fp4_read in pt.FP4_READS:  # every MXFP4 decode route
            ok &= _check_one(log, pt, r, scores, (q, w, k, vis, cbm), wbs, cb, fp4_read)
    return ok


def _check_one(log, pt, r, scores, args, wbs, cb, fp4_read):
    """One MXFP4 decode route against the reference's result ``r`` and ``scores`` [B, S, Nc]."""
    import jax
    import numpy as np

    b, s, nc = scores.shape
    rt = np.asarray(r.topk)

    pfun = jax.jit(lambda q, w, k, v, c: pt.lightning_indexer(q, w, k, v, top_k=512, candidate_blocks=c,
                                                              want_block_scores=wbs,
                                                              config=dict(fp4_read=fp4_read)))
    o = pfun(*args)
    ot = np.asarray(o.topk)
    n_mis, n_near = 0, 0
    for i in range(b):
        for j in range(s):
            a, c2 = set(rt[i, j][rt[i, j] >= 0]), set(ot[i, j][ot[i, j] >= 0])
            if a != c2:
                n_mis += 1
                kth = np.sort(scores[i, j][list(a)])[0] if a else -np.inf
                diff = [scores[i, j][x] for x in a ^ c2]
                if all(abs(x - kth) <= 1e-5 * max(abs(kth), 1e-30) for x in diff):
                    n_near += 1
    asc = all(np.all(np.diff(ot[i, j][ot[i, j] >= 0]) > 0) for i in range(b) for j in range(s))
    pad = all(np.all(ot[i, j][len(ot[i, j][ot[i, j] >= 0]):] == -1) for i in range(b) for j in range(s))
    bs_ok = True
    if wbs:
        br, bo = np.asarray(r.block_scores), np.asarray(o.block_scores)
        fin = np.isfinite(br)
        bs_ok = bool(np.array_equal(fin, np.isfinite(bo)) and np.allclose(br[fin], bo[fin], rtol=1e-5, atol=1e-6))
    good = (n_mis == n_near) and asc and pad and bs_ok
    log(f"check B={b} S={s} Nc={nc} block_scores={wbs} cand_mask={cb} fp4_read={fp4_read}: rows with a different "
        f"set {n_mis} (all at exact/near ties: {n_mis == n_near}), ascending {asc}, -1 padded {pad}, block maxima "
        f"{bs_ok} -> {'OK' if good else 'FAIL'}")
    return good


# tilings of the tile score kernel; None = its defaults (PREFILL_DEFAULTS), the one every case runs
PREFILL_TILES = [None, dict(block_s=128, block_n=128, num_warps=8), dict(block_s=64, block_n=64, num_warps=4),
                 dict(block_s=128, block_n=64, num_warps=4), dict(block_s=32, block_n=128, num_warps=4),
                 dict(block_s=64, block_n=128, num_warps=4, num_stages=2)]


def _tile_name(cfg) -> str:
    if cfg is None:
        return "default"
    return "b{block_s}x{block_n}w{num_warps}".format(**cfg) + (f"s{cfg['num_stages']}" if "num_stages" in cfg else "")


PREFILL_SHAPE = dict(rows=4096, prompt=65536)


def prefill_model(args, log):
    """The model's prefill shapes: one 4096-row chunk (B = 1, HI 32, DI 128, MXFP4, top-512) against
    the key cache of a 64K-token prompt -- a ratio-1 layer (65,538 entries) and a ratio-2 layer
    (32,769) -- at the last chunk (every row sees ~all entries) and a middle one (~half). Times the
    XLA reference as it was before the grouped top-k (scores + one ``lax.top_k``, and its two
    halves), the grouped top-k alone, the tile score kernel (+ the grouped top-k: the model's prefill
    path) per tiling, and checks the kernel's top-k against the reference on the GPU. Nonzero exit
    if a tiling failed or disagreed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.lightning_indexer import pallas_triton as pt
    from pallas_kernels.lightning_indexer import pallas_triton_prefill as pf
    from pallas_kernels.lightning_indexer import reference as ref

    s, k, prompt = PREFILL_SHAPE["rows"], 512, PREFILL_SHAPE["prompt"]
    rows, bad = [], []  # bad: tilings that failed or disagreed with the reference
    # V4.1: 32 index heads, ratio-1 and ratio-2 layers; V4(-Flash): 64 heads over its ratio-4 layers
    for hi, ratio, wheres in ((32, 1, ("last", "middle")), (32, 2, ("last", "middle")), (64, 4, ("last",))):
        nc = (prompt + 2) // ratio  # the bench's cache: max_seq_len = prompt + 2
        for where, first in (("last", prompt - s), ("middle", prompt // 2 - s)):
            if where not in wheres:
                continue
            q, w, kk, _ = make_inputs(jax.random.PRNGKey(nc + first), 1, s, nc, hi=hi)
            vis = ((first + jnp.arange(s, dtype=jnp.int32) + 1) // ratio)[None]
            seen = float(jnp.sum(vis))  # (row, key) pairs that must be scored
            flops = 2 * hi * 128 * seen
            tag = f"HI {hi} ratio {ratio} Nc={nc} {where} chunk"

            def run_ref(a, c):  # the XLA path before the grouped top-k: scores + one lax.top_k
                o = ref.topk_ascending(ref.index_scores(a[0], a[1] + c, a[2], a[3]), k)
                return o, zero_of(o)

            def run_ref_scores(a, c):
                o = ref.index_scores(a[0], a[1] + c, a[2], a[3])
                return o, zero_of(o)

            def run_topk(a, c):
                o = ref.topk_ascending(a[0] + c, k)
                return o, zero_of(o)

            a = (q, w, kk, vis)
            r = {}
            r["xla"] = timed(run_ref, a, n=args.n, reps=args.reps)[0]
            r["xla_scores"] = timed(run_ref_scores, a, n=args.n, reps=args.reps)[0]
            sc = jax.jit(ref.index_scores)(q, w, kk, vis)
            r["topk"] = timed(run_topk, (sc,), n=args.n, reps=args.reps)[0]
            r["topk_groups"] = timed(lambda a, c: (lambda o: (o, zero_of(o)))(pf.topk_by_groups(a[0] + c, k, 8)),
                                     (sc,), n=args.n, reps=args.reps)[0]
            ref_topk = np.asarray(jax.jit(lambda sc: ref.topk_ascending(sc, k))(sc))
            grp_same = bool(np.array_equal(ref_topk, np.asarray(jax.jit(lambda sc: pf.topk_by_groups(sc, k, 8))(sc))))
            for cfg in PREFILL_TILES if (args.sweep or not rows) else PREFILL_TILES[:1]:
                name = _tile_name(cfg)
                try:
                    def run_pf(a, c, cfg=cfg):  # scores + the grouped top-k (the model's prefill path)
                        o = pt.lightning_indexer(a[0], a[1] + c, a[2], a[3], top_k=k, config=cfg)
                        return o, zero_of(o.topk)

                    def run_pf_scores(a, c, cfg=cfg):
                        o = pf.index_scores(a[0], a[1] + c, a[2], a[3], config=cfg)
                        return o, zero_of(o)

                    got = jax.jit(lambda q, w, kk, v, cfg=cfg: pf.index_scores(q, w, kk, v, config=cfg))(q, w, kk, vis)
                    fin = jnp.isfinite(sc)
                    same_mask = bool(jnp.all(fin == jnp.isfinite(got)))
                    err = float(jnp.max(jnp.where(fin, jnp.abs(got - sc), 0.0)) / jnp.max(jnp.where(fin, jnp.abs(sc), 0.0)))
                    topk = np.asarray(jax.jit(lambda q, w, kk, v, cfg=cfg: pt.lightning_indexer(
                        q, w, kk, v, top_k=k, config=cfg).topk)(q, w, kk, vis))
                    same_rows = float(np.mean(np.all(topk == ref_topk, axis=-1)))
                    t_p = timed(run_pf, a, n=args.n, reps=args.reps)[0]
                    t_ps = timed(run_pf_scores, a, n=args.n, reps=args.reps)[0]
                    log(f"{tag} {name}: pallas {t_p*1e3:.2f} ms (scores {t_ps*1e3:.2f} ms = {flops/t_ps/1e12:.0f} "
                        f"TFLOP/s) | masks equal {same_mask}, max score err / max |score| {err:.1e}, "
                        f"rows with the reference's exact top-k {same_rows:.4f}")
                    r[name] = (t_p, t_ps, same_mask, err, same_rows)
                    if not (same_mask and err < 1e-3 and same_rows == 1.0):
                        bad.append(f"{tag} {name}")
                except Exception as e:  # noqa: BLE001
                    log(f"{tag} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    bad.append(f"{tag} {name}")
            log(f"{tag}: XLA ref {r['xla']*1e3:.2f} ms (scores {r['xla_scores']*1e3:.2f} ms = "
                f"{flops/r['xla_scores']/1e12:.0f} TFLOP/s of needed dots; top-k of the [S, Nc] scores "
                f"{r['topk']*1e3:.2f} ms; by groups of 8 {r['topk_groups']*1e3:.2f} ms, same positions {grp_same})")
            rows.append(dict(tag=tag, flops=flops, **{kk_: (v if not isinstance(v, tuple) else list(v)) for kk_, v in r.items()}))
            del a, q, w, kk, sc
    log("")
    log("| case | XLA ref ms (scores / top-k) | top-k by groups ms | best Pallas ms (scores) | tiling | XLA / Pallas | score TFLOP/s |")
    log("|---|---|---:|---|---|---:|---:|")
    for row in rows:
        cands = {n: v for n, v in row.items() if isinstance(v, list)}
        if not cands:
            log(f"| {row['tag']} | {row['xla']*1e3:.2f} ({row['xla_scores']*1e3:.2f} / {row['topk']*1e3:.2f}) | "
                f"{row['topk_groups']*1e3:.2f} | failed | | | |")
            continue
        best = min(cands, key=lambda n: cands[n][0])
        t_p, t_ps = cands[best][0], cands[best][1]
        log(f"| {row['tag']} | {row['xla']*1e3:.2f} ({row['xla_scores']*1e3:.2f} / {row['topk']*1e3:.2f}) | "
            f"{row['topk_groups']*1e3:.2f} | {t_p*1e3:.2f} ({t_ps*1e3:.2f}) | {best} | {row['xla']/t_p:.2f}x | {row['flops']/t_ps/1e12:.0f} |")
    write_rows(args.out, "lightning_indexer_prefill.json", rows)
    if bad:
        log(f"FAILED or not equal to the reference: {', '.join(bad)}")
    return 1 if bad else 0


DECODE_TOPK_ENTRIES = (65536, 262144, 1 << 20)


def decode_topk(args, log):
    """Decode rows (S = 1): the XLA scores + one ``lax.top_k`` over the row (``topk_ascending``) against the same
    scores + the grouped top-k (``topk_by_groups``: top-k of the 8-wide block maxima, then of the
    chosen blocks' scores), same positions checked, at 64K / 256K / 1M entries, batch 1 and 8."""
    import jax
    import numpy as np

    from pallas_kernels.lightning_indexer import pallas_triton_prefill as pf
    from pallas_kernels.lightning_indexer import reference as ref

    k = 512
    rows = []
    for nc in DECODE_TOPK_ENTRIES:
        for b in (1, 8):
            a = make_inputs(jax.random.PRNGKey(nc + b), b, 1, nc)

            def run(select):
                def f(a, c):
                    o = select(ref.index_scores(a[0], a[1] + c, a[2], a[3]))
                    return o, zero_of(o)
                return f

            direct = lambda sc: ref.topk_ascending(sc, k)  # noqa: E731  (the reference's one lax.top_k)
            grouped = lambda sc: pf.topk_by_groups(sc, k, 8)  # noqa: E731
            sc = jax.jit(ref.index_scores)(*a)
            same = bool(np.array_equal(np.asarray(jax.jit(direct)(sc)), np.asarray(jax.jit(grouped)(sc))))
            run_ref, run_grp = run(direct), run(grouped)
            t_r = timed(run_ref, a, n=args.n, reps=args.reps)[0]
            t_g = timed(run_grp, a, n=args.n, reps=args.reps)[0]
            rows.append(dict(entries=nc, batch=b, xla_us=t_r * 1e6, grouped_us=t_g * 1e6, same=same))
            log(f"decode Nc={nc} B={b}: XLA ref {t_r*1e6:.1f} us, scores + grouped top-k {t_g*1e6:.1f} us "
                f"({t_r/t_g:.2f}x), same positions {same}")
            del a, sc
    write_rows(args.out, "lightning_indexer_decode_topk.json", rows)
    return 0 if all(r["same"] for r in rows) else 1


READ_AB_CASES = ((1 << 20, 8), (1 << 20, 1))  # (entries, batch) of --read-ab


def score_kernel_op(cfg):
    """The score kernel alone (``index_block_maxima`` over ``_prep``'s operands, decode rows, blocks
    of 8) under ``cfg`` as an op for :func:`timed`: (inputs of :func:`make_inputs`, zero) -> (maxima,
    a zero of them)."""
    from pallas_kernels.lightning_indexer import pallas_triton as pt

    def op(a, c):
        q, w, kk, vis = a
        pp = pt._prep(q, kk, w + c, vis, None, 8, cfg["fp4_read"])
        o = pt.index_block_maxima(pp, g0=8, interpret=False, cfg=cfg)
        return o, zero_of(o)

    return op


def read_ab(args, log):
    """Interleaved A/B of the MXFP4 reads (``--reads``, default phases against f16phases) at
    :data:`READ_AB_CASES`: per case ``--rounds`` rounds, each timing every read in turn in this one
    process -- the whole decode pipeline (``lightning_indexer(..., config=dict(fp4_read=read))``) and
    its score kernel alone (``index_block_maxima``) -- so drifts between programs and machines fall on
    both reads alike; the median over rounds per read, and how many of each read's top-k positions
    equal the first read's. Session 44's call ran this as a script of its own (BENCHMARKS.md, issue 5)."""
    import statistics

    import jax
    import numpy as np

    from pallas_kernels.lightning_indexer import pallas_triton as pt

    reads = [r.strip() for r in args.reads.split(",") if r.strip()]
    res, same = {}, {}
    for nc, b in READ_AB_CASES:
        a = make_inputs(jax.random.PRNGKey(nc + b), b, 1, nc)
        first = None
        for read in reads:  # the positions each read picks, against the first read's
            topk = np.asarray(pt.lightning_indexer(*a, top_k=512, config=dict(fp4_read=read)).topk).reshape(b, -1)
            first = topk if first is None else first
            same[(nc, b, read)] = _same_share(topk, first)
        for rnd in range(args.rounds):
            for read in reads:
                cfg = dict(pt.DEFAULTS, block_size=8, fp4_read=read)

                def whole(a, c, read=read):
                    q, w, kk, vis = a
                    o = pt.lightning_indexer(q, w + c, kk, vis, top_k=512, config=dict(fp4_read=read))
                    return o, zero_of(o.topk)

                tw = timed(whole, a, n=args.n, reps=args.reps)[0] * 1e6
                ts = timed(score_kernel_op(cfg), a, n=args.n, reps=args.reps)[0] * 1e6
                res.setdefault((nc, b, read), []).append((tw, ts))
                log(f"Nc={nc} B={b} round {rnd} {read:10s}: pipeline {tw:7.1f} us, score kernel {ts:7.1f} us")
        del a
    log("| entries x batch | read | pipeline us (median of rounds) | score kernel us | top-k positions as the first read's |")
    rows = []
    for (nc, b, read), v in res.items():
        tw, ts = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        rows.append(dict(entries=nc, batch=b, read=read, pipeline_us=tw, score_us=ts, rounds=v,
                         same_positions=same[(nc, b, read)]))
        log(f"| {nc}x{b} | {read} | {tw:.1f} | {ts:.1f} | {same[(nc, b, read)]:.4f} |")
    write_rows(args.out, "lightning_indexer_read_ab.json", rows)
    return 0


# (entries, batch) of --path-ab: the protocol's decode caches (1,280 at a 4K prompt's ratio-4 layers,
# 5,121 at its ratio-1 layers) and around the pipeline's switch (DECODE_MIN_ENTRIES = 2,048)
PATH_AB_CASES = ((1280, 1), (1280, 8), (2560, 1), (5121, 1), (5121, 8), (16384, 1), (16384, 8))


def _same_share(topk, first) -> float:
    """The share of ``topk``'s positions that ``first`` also picks, averaged over rows (sets, not
    elementwise: one near-tie swap shifts every later entry of an ascending list)."""
    import numpy as np

    return float(np.mean([len(np.intersect1d(t[t >= 0], f[f >= 0])) / max(1, int((f >= 0).sum()))
                          for t, f in zip(topk, first)]))


def path_ab(args, log):
    """Decode paths at small caches (:data:`PATH_AB_CASES`): the XLA reference, the streaming pipeline
    (``decode_path="pipeline"``, 5-6 launches) and the direct path (every score, one select: 2
    launches), by device time (``device_time_op``: the profiler's sum over each program's kernels,
    ``--reps`` distinct inputs, L2 flushed; the chained-call harness could not rank these ~30 us
    calls, session 14), each path's top-k positions against the reference's."""
    import jax
    import numpy as np

    from pallas_kernels.benchmarking import device_time_op
    from pallas_kernels.lightning_indexer import pallas_triton as pt
    from pallas_kernels.lightning_indexer import reference as ref

    def path(name):
        if name == "reference":
            return lambda q, w, k, v: ref.lightning_indexer(q, w, k, v, top_k=512).topk
        return lambda q, w, k, v: pt.lightning_indexer(q, w, k, v, top_k=512, config=dict(decode_path=name)).topk

    reps = max(2, args.reps)
    rows = []
    log("| entries x batch | reference us | pipeline us | direct us | direct / reference | positions as the reference's (pipeline, direct) | kernels (reference, pipeline, direct) |")
    for nc, b in PATH_AB_CASES:
        inputs = [make_inputs(jax.random.PRNGKey(7919 * r + nc + b), b, 1, nc) for r in range(reps)]
        row = dict(entries=nc, batch=b)
        first = None
        for name in ("reference", "pipeline", "direct"):
            fn = path(name)
            top = np.asarray(jax.jit(fn)(*inputs[0])).reshape(b, -1)
            first = top if first is None else first
            kernels = []
            t = device_time_op(fn, inputs, reps=reps, kernels=kernels)
            row.update({f"{name}_us": t * 1e6, f"{name}_same": _same_share(top, first), f"{name}_kernels": len(kernels)})
        rows.append(row)
        log(f"| {nc}x{b} | {row['reference_us']:.1f} | {row['pipeline_us']:.1f} | {row['direct_us']:.1f} | "
            f"{row['direct_us'] / row['reference_us']:.2f} | {row['pipeline_same']:.4f}, {row['direct_same']:.4f} | "
            f"{row['reference_kernels']}, {row['pipeline_kernels']}, {row['direct_kernels']} |")
        del inputs
    write_rows(args.out, "lightning_indexer_path_ab.json", rows)
    return 0 if all(r["pipeline_same"] >= 0.99 and r["direct_same"] >= 0.99 for r in rows) else 1


def main(argv=None):
    ap = chained_args(argparse.ArgumentParser(), n=10, reps=5, skip_xla_help="skip the XLA reference and lax.top_k timings")
    ap.add_argument("--decode-topk", action="store_true",
                    help="only decode rows: XLA scores + one lax.top_k vs the same scores + the grouped top-k")
    ap.add_argument("--prefill-model", action="store_true",
                    help="only the model's prefill shapes (4096-row chunk of a 64K prompt): XLA vs the tile score kernel")
    ap.add_argument("--read-ab", action="store_true",
                    help="only the interleaved A/B of the MXFP4 reads (--reads, --rounds) at 1M entries x batch 8 and 1")
    ap.add_argument("--path-ab", action="store_true",
                    help="only the decode paths at small caches (XLA reference, pipeline, direct) by device time")
    ap.add_argument("--reads", default="phases,f16phases", help="with --read-ab: the fp4_read values to compare")
    ap.add_argument("--rounds", type=int, default=2, help="with --read-ab: rounds of every read in turn")
    ap.add_argument("--variants", default="",
                    help='JSON list of config dicts timed beside the default in every decode row, e.g. '
                         '\'[{"score_warps": 4}, {"select_warps": 16}]\'')
    args = ap.parse_args(argv)
    try:
        variants = json.loads(args.variants) if args.variants else []
    except ValueError:
        variants = None
    if not (isinstance(variants, list) and all(isinstance(v, dict) for v in variants)):
        ap.error(f"--variants {args.variants!r}: expected a JSON list of config dicts")

    import jax
    import jax.numpy as jnp

    from pallas_kernels.lightning_indexer import pallas_triton as pt
    from pallas_kernels.lightning_indexer import reference as ref

    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    dev = jax.devices()[0]
    log(f"# lightning indexer score+top-k | device {dev.device_kind} | jax {jax.__version__} | n={args.n} reps={args.reps}")
    if args.path_ab:
        return path_ab(args, log)
    if args.read_ab:
        from pallas_kernels.lightning_indexer import pallas_triton as pt_reads

        bad = [r for r in args.reads.split(",") if r.strip() not in pt_reads.FP4_READS]
        if bad or args.rounds < 1:
            ap.error(f"--reads {args.reads!r} / --rounds {args.rounds}: reads of {', '.join(pt_reads.FP4_READS)}, "
                     "comma-separated, and at least one round")
        return read_ab(args, log)
    if args.decode_topk or args.prefill_model:  # these two tables only; nonzero if any check failed
        rc = 0
        for wanted, fn, name in ((args.decode_topk, decode_topk, "decode_topk"), (args.prefill_model, prefill_model, "prefill")):
            if wanted:
                rc |= fn(args, log)
                with open(os.path.join(args.out, f"lightning_indexer_{name}.log"), "w") as fh:
                    fh.write("\n".join(lines) + "\n")
        return rc
    ok = check(log)

    # jax.lax.top_k anchor (pallas_triton.md §9 M8): 64 x 262144, k = 2048
    sc = jax.random.normal(jax.random.PRNGKey(0), (64, 262144), jnp.float32)
    t_anchor = float("nan") if args.skip_xla else timed(lambda a, c: (lambda o: (o, zero_of(o[0])))(jax.lax.top_k(a[0] + c, 2048)), (sc,),
                           n=args.n, reps=args.reps)[0]
    log(f"lax.top_k 64 x 262144, k=2048: {t_anchor*1e6:.1f} us (spec M8: 2561 us)")
    del sc

    sizes = [65536, 262144, 1 << 20]
    batches = [1, 8]
    rows = []
    k = 512

    def run_pallas(cfg):
        def f(a, c):
            q, w, kk, vis = a
            o = pt.lightning_indexer(q, w + c, kk, vis, top_k=k, config=cfg)
            return o, zero_of(o.topk)
        return f

    def run_ref(a, c):
        q, w, kk, vis = a
        o = ref.lightning_indexer(q, w + c, kk, vis, top_k=k)
        return o, zero_of(o.topk)

    def run_topk(a, c):
        o = jax.lax.top_k(a[0] + c, k)
        return o, zero_of(o[0])

    for nc in sizes:
        for b in batches:
            a = make_inputs(jax.random.PRNGKey(nc + b), b, 1, nc)
            fb = floor_bytes(b, 1, nc)
            t_floor = fb / HBM_BYTES_PER_S
            t_p, _, _ = timed(run_pallas({}), a, n=args.n, reps=args.reps)
            t_b, _, _ = timed(run_pallas(dict(fp4_read="bytes")), a, n=args.n, reps=args.reps)  # the byte decode
            try:
                if args.skip_xla:
                    raise RuntimeError("skipped (--skip-xla)")
                t_r, _, _ = timed(run_ref, a, n=args.n, reps=args.reps)
            except Exception as e:  # noqa: BLE001
                log(f"  xla reference failed at Nc={nc} B={b}: {type(e).__name__}: {str(e)[:160]}")
                t_r = float("nan")
            scores = jax.random.normal(jax.random.PRNGKey(1), (b, nc), jnp.float32)
            t_k = float("nan") if args.skip_xla else timed(run_topk, (scores,), n=args.n, reps=args.reps)[0]
            del scores
            row = dict(entries=nc, batch=b, pallas_us=t_p * 1e6, pallas_bytes_us=t_b * 1e6, xla_us=t_r * 1e6,
                       topk_us=t_k * 1e6, floor_us=t_floor * 1e6, bytes=fb, variants_us={})
            for var in variants:
                t_v, _, _ = timed(run_pallas(var), a, n=args.n, reps=args.reps)
                row["variants_us"][json.dumps(var, sort_keys=True)] = t_v * 1e6
                log(f"    variant {var} at Nc={nc} B={b}: {t_v*1e6:8.1f} us (default {t_p*1e6:.1f}, x{t_v/t_p:.3f})")
            rows.append(row)
            log(f"Nc={nc:>8} B={b}: pallas {t_p*1e6:8.1f} us (byte decode {t_b*1e6:8.1f})  xla ref {t_r*1e6:9.1f} us  lax.top_k(scores) "
                f"{t_k*1e6:8.1f} us  floor {t_floor*1e6:6.2f} us  pallas/floor {t_p/t_floor:.2f}x  "
                f"top_k/pallas {t_k/t_p:.2f}x")
            if args.sweep and b == 1 and nc == (1 << 20):
                # cand_tile: at batch 1 the candidate rescoring runs k * g0 / cand_tile = 16 programs
                for var in (dict(tile_n=4096), dict(tile_n=256), dict(chunk=64), dict(score_warps=4),
                            dict(select_warps=16), dict(select_early_exit=False), dict(cand_tile=128),
                            dict(cand_tile=64), dict(dot_order="q")):
                    try:
                        t_v, _, _ = timed(run_pallas(var), a, n=args.n, reps=args.reps)
                        log(f"    sweep {var}: {t_v*1e6:8.1f} us  ({t_v/t_floor:.2f}x floor)")
                    except Exception as e:  # noqa: BLE001
                        log(f"    sweep {var}: FAILED {type(e).__name__}: {str(e)[:200]}")
            del a

    # stage breakdown at batch 1 (where the pipeline is latency-bound)
    for nc in [65536, 1 << 20]:
        a = make_inputs(jax.random.PRNGKey(nc), 1, 1, nc)
        times = {}
        for route in pt.FP4_READS:  # each MXFP4 decode route, with programs of its own
            cfg = dict(pt.DEFAULTS, block_size=8, fp4_read=route)

            def stage_cand(a, c, nc=nc, cfg=cfg):
                q, w, kk, vis = a
                pp = pt._prep(q, kk, w + c, vis, None, 8, cfg["fp4_read"])
                pos = (jnp.arange(4096, dtype=jnp.int32) * (nc // 4096))[None]
                o = pt.candidate_scores(pp, pos, interpret=False, cfg=cfg)
                return o, zero_of(o)

            times[route] = (timed(score_kernel_op(cfg), a, n=args.n, reps=args.reps)[0],
                            timed(stage_cand, a, n=args.n, reps=args.reps)[0])
        log(f"breakdown Nc={nc} B=1: score kernel (block maxima) "
            + ", ".join(f"{r} {t[0]*1e6:.1f} us" for r, t in times.items())
            + "; candidate rescoring 4096 keys " + ", ".join(f"{r} {t[1]*1e6:.1f} us" for r, t in times.items()))
        del a
    for n_sel in (4096, 16384):
        v = jax.random.normal(jax.random.PRNGKey(n_sel), (1, n_sel), jnp.float32)
        for wv, ee in ((8, True), (16, True), (8, False)):  # early_exit=False: all 32 bisection steps
            t3, _, _ = timed(lambda a, c, wv=wv, ee=ee: (lambda o: (o, zero_of(o)))(
                pt.select_topk(a[0] + c, 512, num_warps=wv, early_exit=ee)), (v,), n=args.n, reps=args.reps)
            log(f"breakdown select top-512 of 1 x {n_sel} (num_warps={wv}, early_exit={ee}): {t3*1e6:.1f} us")

    # prefill: many query rows, no [S, Nc] matrix (pallas only; the reference would materialise it)
    pre = []
    for (s, nc) in ([(64, 1 << 20)] if args.quick else [(256, 65536), (64, 1 << 20)]):
        a = make_inputs(jax.random.PRNGKey(s), 1, s, nc)
        t_p, _, _ = timed(run_pallas({}), a, n=3, reps=3)
        flops = 2 * s * 32 * 128 * nc
        pre.append(dict(S=s, entries=nc, pallas_us=t_p * 1e6, tflops=flops / t_p / 1e12))
        log(f"prefill S={s} Nc={nc}: pallas {t_p*1e6:.1f} us = {flops/t_p/1e12:.1f} TFLOP/s of score dots")
        del a

    log("")
    log("| entries | batch | Pallas (us) | Pallas, byte decode (us) | XLA ref (us) | lax.top_k on scores (us) | "
        "byte floor (us) | Pallas/floor | top_k/Pallas | XLA/Pallas |")
    log("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        log(f"| {r['entries']} | {r['batch']} | {r['pallas_us']:.1f} | {r['pallas_bytes_us']:.1f} | {r['xla_us']:.1f} | "
            f"{r['topk_us']:.1f} | "
            f"{r['floor_us']:.2f} | {r['pallas_us']/r['floor_us']:.2f}x | {r['topk_us']/r['pallas_us']:.2f}x | "
            f"{r['xla_us']/r['pallas_us']:.2f}x |")
    log(f"lax.top_k anchor 64 x 262144 k=2048: {t_anchor*1e6:.1f} us")
    log(f"correctness: {'OK' if ok else 'FAIL'}")
    write_rows(args.out, "lightning_indexer_bench.json", rows, prefill=pre, anchor_us=t_anchor * 1e6, ok=ok)
    with open(os.path.join(args.out, "lightning_indexer_bench.log"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
