"""H200 benchmark of the weight GEMMs: Pallas-Triton vs the XLA reference (jit), beside the HBM byte
floor (decode) and a bf16 ``jnp.dot`` ceiling (prefill) measured in the same run.

    PYTHONPATH=. python -m pallas_kernels.quantized_matmul.benchmark [--quick] [--out DIR]

Protocol (shared by the MoE and mHC benchmarks, see :func:`time_op`): one jitted program applies the
op ``reps`` times to distinct activations, cycling over enough distinct weight copies that the
weights streamed per program exceed 4x the 60 MB L2 (so nothing is served from cache); wall clock
around the call + ``block_until_ready``; 2 warm-up calls, then the median of ``iters`` timed calls,
divided by ``reps``. This is the in-program cost of one op (launch gaps included), the number that
matters inside a jitted decode step; Python dispatch (~70 us) is amortised away. Correctness is
checked on the GPU first (every element, against the reference on the same inputs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.benchmarking import (
    HBM_BYTES_PER_S,
    copies_for,
    device_time_op,
    distinct_copy,
    fmt_us,
    log,
    max_rel_err,
    random_fp4,
    random_fp8,
    time_op,
    tree_bytes,
    write_rows,
)
from pallas_kernels.quantized_matmul import pallas_triton, reference


# (name, N, K) of the V4.1 projections (model.md §10.3; issue 6)
PROJECTIONS = [
    ("wq_a", 1280, 5120),
    ("wq_b", 32768, 1280),
    ("wkv", 512, 5120),
    ("wo_b", 5120, 8192),
    ("idx_wq_b", 4096, 1280),
    ("shared_w1/w3", 2304, 5120),
    ("shared_w2", 5120, 2304),
    ("engram_wkv", 25600, 6144),
    ("dspark_main_proj", 5120, 15360),
]
PREFILL_M = 4096


def projection_names() -> list:
    """The names of :data:`PROJECTIONS`, which ``--pair``, ``--names`` and ``--read-ceiling`` accept."""
    return [name for name, _, _ in PROJECTIONS]


PREFILL = ["wq_b", "wo_b", "shared_w2"]


def gemv_case(rows, label, w0, m, key, *, reps=(3, 9), config=None, extra=None, xla=None, timer="wall"):
    """Check (every element vs the reference) and time one GEMV case; append a record; log a line."""
    wbytes = tree_bytes(w0)
    n, k = w0.shape
    ws = [w0] + [distinct_copy(w0) for _ in range(reps[1] - 1)]
    xs = [jax.random.normal(jax.random.fold_in(key, r), (m, k), jnp.bfloat16) for r in range(reps[1])]
    args = [(xs[r], ws[r]) for r in range(reps[1])]
    rec = dict(op="gemv", case=label, M=m, N=n, K=k, weight_bytes=wbytes, config=config, **(extra or {}))
    fp = lambda x, w: pallas_triton.quantized_matmul(x, w, config=config)
    fr = lambda x, w: reference.quantized_matmul(x, w)
    try:
        rec["rel_err"] = max_rel_err(jax.jit(fp)(xs[0], w0), jax.jit(fr)(xs[0], w0))
        # "wall": the two-point wall-clock method; "device": profiler kernel time (see device_time_op)
        measure = (lambda f: time_op(f, args, reps=reps)) if timer == "wall" else \
            (lambda f: (device_time_op(f, args, reps=reps[1]),) * 2)
        rec["pallas_s"], rec["pallas_raw_s"] = measure(fp)
        if config is None if xla is None else xla:
            rec["xla_s"], rec["xla_raw_s"] = measure(fr)
    except Exception as e:  # keep going; report the failure
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"{label} M={m} FAILED {rec['error']}")
        rows.append(rec)
        return rec
    floor = wbytes / HBM_BYTES_PER_S
    rec["floor_s"] = floor
    rows.append(rec)
    xla = rec.get("xla_s")
    pl_s = rec["pallas_s"]
    xla_txt = fmt_us(xla) if xla else "        -"
    xla_pct = f"{100 * floor / xla:7.1f}%" if xla else "       -"
    ratio = f"{xla / pl_s:8.2f}" if xla else "       -"
    log(f"{label:34s} {m:5d} {wbytes / 1e6:8.1f} {fmt_us(floor)} {fmt_us(pl_s)} {xla_txt} "
        f"{100 * floor / pl_s:7.1f}% {xla_pct} {ratio} {rec['rel_err']:9.2e} {fmt_us(rec['pallas_raw_s'])}")
    return rec


def run(quick=False, out_dir=None, tune=False):
    rows = []
    key = jax.random.PRNGKey(0)
    ms = [1, 8] if quick else [1, 8, 64]
    log(f"# quantized_matmul benchmark: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"offset patch {pallas_triton.TRITON_OFFSETS_PATCHED}, scale modes {pallas_triton.SCALE_MODE}")
    log(f"{'case':34s} {'M':>5s} {'MB':>8s} {'floor us':>9s} {'pallas us':>9s} {'xla us':>9s} "
        f"{'%HBM pl':>8s} {'%HBM xla':>8s} {'pl/xla x':>8s} {'relerr':>9s} {'raw pl us':>9s}")
    for name, n, k in PROJECTIONS:
        key, kw = jax.random.split(key)
        w0 = random_fp8(kw, n, k)
        for m in ms:
            if m == 64 and name not in ("wq_b", "wo_b", "shared_w1/w3"):
                continue
            gemv_case(rows, "fp8 " + name, w0, m, kw)
    for name, n, k in [("mxfp4 expert w1 2304x5120", 2304, 5120), ("mxfp4 expert w2 5120x2304", 5120, 2304)]:
        key, kw = jax.random.split(key)
        gemv_case(rows, name, random_fp4(kw, (n, k)), 1, kw)

    # prefill: tiled kernel vs XLA reference vs a plain bf16 jnp.dot ceiling
    mp = PREFILL_M
    log(f"\n{'prefill case (M=' + str(mp) + ')':34s} {'TFLOP':>6s} {'pallas us':>9s} {'xla us':>9s} {'bf16dot us':>10s} "
        f"{'pl TF/s':>8s} {'%ceil pl':>8s} {'%ceil xla':>9s} {'relerr':>9s}")
    for name, n, k in PROJECTIONS:
        if name not in PREFILL or (quick and name != "wo_b"):
            continue
        key, kw = jax.random.split(key)
        w0 = random_fp8(kw, n, k)
        wb = w0.dequantize(jnp.bfloat16)
        xs = [jax.random.normal(jax.random.fold_in(kw, r), (mp, k), jnp.bfloat16) for r in range(5)]
        rec = dict(op="fp8_prefill", case=name, M=mp, N=n, K=k)
        try:
            y = jax.jit(lambda x, w: pallas_triton.quantized_matmul(x, w))(xs[0], w0)
            yr = jax.jit(lambda x, w: reference.quantized_matmul(x, w))(xs[0], w0)
            rec["rel_err"] = max_rel_err(y, yr)
            args = [(x,) for x in xs]
            rp = (2, 5)
            rec["pallas_s"], _ = time_op(lambda x, w: pallas_triton.quantized_matmul(x, w), args, (w0,), reps=rp)
            rec["xla_s"], _ = time_op(lambda x, w: reference.quantized_matmul(x, w), args, (w0,), reps=rp)
            rec["bf16_dot_s"], _ = time_op(
                lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16), args, (wb,), reps=rp)
            flop = 2.0 * mp * n * k
            rec["flop"] = flop
            log(f"{name:34s} {flop / 1e12:6.3f} {fmt_us(rec['pallas_s'])} {fmt_us(rec['xla_s'])} {fmt_us(rec['bf16_dot_s']):>10s} "
                f"{flop / rec['pallas_s'] / 1e12:8.1f} {100 * rec['bf16_dot_s'] / rec['pallas_s']:7.1f}% "
                f"{100 * rec['bf16_dot_s'] / rec['xla_s']:8.1f}% {rec['rel_err']:9.2e}")
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{name} prefill FAILED {rec['error']}")
        rows.append(rec)
        del wb, xs

    if tune:
        rows += tune_gemv(key)
    write_rows(out_dir, "quantized_matmul.json", rows)
    return rows


def tune_gemv(key):
    """Config / scale-mode sweep on three shapes; Pallas only (same protocol)."""
    rows = []
    log("\n# GEMV sweep: config (bm, bn, bk, splits, warps, stages), scale mode")
    cases = [("fp8 wq_b", random_fp8(jax.random.fold_in(key, 1), 32768, 1280), 1),
             ("fp8 wo_b", random_fp8(jax.random.fold_in(key, 2), 5120, 8192), 8),
             ("mxfp4 w1", random_fp4(jax.random.fold_in(key, 3), (2304, 5120)), 1)]
    cfgs = [(16, 128, 256, 1, 4, 3), (16, 64, 512, 1, 4, 3), (16, 128, 256, 1, 8, 4)]
    for label, w0, m in cases:
        fmt = "fp4" if "mxfp4" in label else "fp8"
        modes = ["expand", "view3d", "mx"] if fmt == "fp4" else ["expand", "gather", "mma8", "mx"]
        for mode in modes:
            pallas_triton.SCALE_MODE[fmt] = mode
            for cfg in [None] + cfgs:
                n, k = w0.shape
                if cfg is not None and (n % cfg[1] or k % cfg[2]):
                    continue
                gemv_case(rows, f"{label} {mode} {cfg}", w0, m, key, config=cfg, extra=dict(mode=mode))
        pallas_triton.SCALE_MODE[fmt] = "expand"
    return rows


FMA_SWEEP = ("wq_a", "wq_b", "wo_b", "idx_wq_b", "shared_w1/w3", "shared_w2")  # the decode step's FP8 GEMVs
FMA_SWEEP_M4 = ("wq_b", "wo_b")


def fma_variants(m, w, wide: bool = False):
    """The vector-unit GEMV configs the ``--fma`` sweep times: the default and its neighbours
    (rows per program, K groups per step, split factor, warps)."""
    from pallas_kernels.quantized_matmul.pallas_triton_fma import default_config, group_size, unsupported_reason

    n, k = w.shape
    base = default_config(m, n, k, w)
    _, bn, kg, splits, warps, stages = base
    cands = [base, ("fma", bn, kg, splits, 2, stages), ("fma", bn, kg, splits, 8, stages),
             ("fma", bn // 2, kg, splits, 4, stages), ("fma", bn, kg * 2, splits, 4, stages),
             ("fma", bn, kg, splits * 2, 4, stages)]
    # every larger K split that divides the K steps, down to one step per program, up to 16 programs
    # per SM of an H200 (the default stops at about 4 per SM; the MXFP4 MoE's down kernel gained 17 %
    # going from 480 to 1,440 programs, session 31), with the default's K groups per step and with
    # half of them (more, smaller steps: finer splits)
    for kgs in (kg, kg // 2):
        steps = k // group_size(w) // max(kgs, 1)
        cands += [("fma", bn, kgs, s, 4, stages) for s in range(splits + 1, steps + 1)
                  if steps % s == 0 and (n // bn) * s <= 16 * 132]
    if wide:  # (--wide) smaller row tiles with more warps, the other pipelining depths, more K splits
        cands += [("fma", bn // 2, kg, splits, 8, stages), ("fma", bn // 2, kg, splits * 2, 4, stages),
                  ("fma", bn // 4, kg, splits, 4, stages), ("fma", bn // 2, kg * 2, splits, 8, stages),
                  ("fma", bn, kg, splits, 4, 2), ("fma", bn, kg, splits, 4, 4), ("fma", bn // 2, kg, splits, 4, 4),
                  ("fma", bn, kg // 2, splits, 4, stages)]
    out = []
    for c in cands:
        if c not in out and c[1] >= 1 and unsupported_reason(m, w, c) is None:
            out.append(c)
    return out


def fma_sweep(key, quick=False, wide: bool = False, names=FMA_SWEEP, vias=None, default_only: bool = False):
    """Tensor-core GEMV (default config) vs the vector-unit ("fma") GEMV and its neighbours vs XLA
    (device time from the profiler, :func:`device_time_op`; the "raw" column repeats it), at
    1 row (and 4 for the two largest), the V4.1 FP8 projections of a decode step; each config checked against
    the reference on the GPU (rel err column) before it is timed. ``vias``: the fma configs once per
    weight decode route for both formats (``FMA_DECODE``; None: the current routes); ``default_only``:
    only the default."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    vias = pallas_triton_fma.checked_routes(vias)
    rows = []
    log("\n# fma GEMV sweep (tensor-core default, then fma configs ('fma', bn, kg, splits, warps, stages))")
    log(f"{'case':34s} {'M':>5s} {'MB':>8s} {'floor us':>9s} {'pallas us':>9s} {'xla us':>9s} "
        f"{'%HBM pl':>8s} {'%HBM xla':>8s} {'pl/xla x':>8s} {'relerr':>9s} {'raw pl us':>9s}")
    cases = [(f"fp8 {name}", random_fp8(jax.random.fold_in(key, i), n, k))
             for i, (name, n, k) in enumerate(PROJECTIONS) if name in names]
    for label, w0 in cases:
        for m in ((1,) if quick or label[4:] not in FMA_SWEEP_M4 else (1, 4)):
            mma = pallas_triton._config(m, *w0.shape, "fp4" if "mxfp4" in label else "fp8")
            base = gemv_case(rows, f"{label} mma {mma}", w0, m, key, config=mma, xla=True, timer="device")
            for via in vias:
                best = None
                for cfg in fma_variants(m, w0, wide)[:1 if default_only else None]:
                    with pallas_triton_fma.use_decode_route(via):
                        rec = gemv_case(rows, f"{label} {via or 'current'} {cfg}", w0, m, key, config=cfg,
                                        extra=dict(mode="fma", via=via), timer="device")
                    if "pallas_s" in rec and rec["rel_err"] <= CHECK_TOL and (best is None or rec["pallas_s"] < best["pallas_s"]):
                        best = rec
                if best is not None and "pallas_s" in base:
                    log(f"  => {label} M={m} decode {via or 'current'}: best fma {best['config']} {fmt_us(best['pallas_s'])} us vs mma "
                        f"{fmt_us(base['pallas_s'])} us vs xla {fmt_us(base.get('xla_s', float('nan')))} us "
                        f"({100 * base['floor_s'] / best['pallas_s']:.1f}% of HBM)")
    return rows


WO_A = (8, 1024, 4096)  # V4.1-Flash wo_a: 8 groups x 1024 rows (o_lora_rank), K = 64 * 512 / 8


def grouped_sweep(key, rows_list=(1, 2, 8), reps=9):
    """The grouped GEMV (``wo_a``, FP8 32x32, no activation fake-quant) at 1, 2 and 8 rows per group:
    checked against the reference on the GPU (max|diff| / max|ref|), then device time (profiler) of
    the default and a few other fma configs beside XLA's dequantize + batched dot (the reference) and
    the byte floor (weight + scales)."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    groups, n, k = WO_A
    w0 = random_fp8(key, groups * n, k)
    ws = [w0] + [distinct_copy(w0) for _ in range(reps - 1)]
    floor = tree_bytes(w0) / HBM_BYTES_PER_S
    log(f"\n# grouped GEMV (wo_a: {groups} groups x {n} rows, K={k}, FP8 32x32; floor {floor * 1e6:.2f} us)")
    out = []
    for m in rows_list:
        xs = [jax.random.normal(jax.random.fold_in(key, 100 * m + r), (m, groups, k), jnp.bfloat16) for r in range(reps)]
        args = [(xs[r], ws[r]) for r in range(reps)]
        fr = lambda x, w: reference.grouped_matmul(x, w, groups=groups)  # noqa: E731
        yr = jax.jit(fr)(*args[0])
        t_x = device_time_op(fr, args, reps=reps)
        base = fma.grouped_config(m, w0, groups)
        cfgs = [base] + [c for c in (base[:3] + (1,) + base[4:], base[:1] + (16,) + base[2:],
                                     base[:5] + (2,), base[:4] + (8,) + base[5:]) if c != base]
        for cfg in cfgs:
            try:
                fp = lambda x, w, cfg=cfg: pallas_triton.grouped_matmul(x, w, groups=groups, config=cfg)  # noqa: E731
                err = max_rel_err(jax.jit(fp)(*args[0]), yr)
                t = device_time_op(fp, args, reps=reps)
                ok = err <= CHECK_TOL
                log(f"  M={m} cfg={cfg}{' (default)' if cfg == base else ''}: {t * 1e6:7.2f} us "
                    f"({100 * floor / t:5.1f}% of HBM), xla {t_x * 1e6:7.2f} us ({100 * floor / t_x:5.1f}%), "
                    f"xla/pallas {t_x / t:5.2f}x, rel err {err:.2e} {'PASS' if ok else 'FAIL'}")
                out.append(dict(op="grouped_gemv", M=m, config=cfg, pallas_s=t, xla_s=t_x, floor_s=floor,
                                rel_err=err, ok=ok))
            except Exception as e:  # noqa: BLE001
                log(f"  M={m} cfg={cfg} FAILED {type(e).__name__}: {str(e)[:300]}")
    return out


def _same_input_pair(key, names, reps):
    """Two random FP8 projections of :data:`PROJECTIONS` that read one input (``names``: they must
    share K) -> (w1, w2, ``reps`` weight pairs (the first and distinct copies), byte floor s)."""
    shapes = {name: (n, k) for name, n, k in PROJECTIONS}
    (n1, k), (n2, k2) = shapes[names[0]], shapes[names[1]]
    if k != k2:
        raise ValueError(f"--pair {','.join(names)}: the projections must share K, got {k} and {k2}")
    w1, w2 = random_fp8(key, n1, k), random_fp8(jax.random.fold_in(key, 1), n2, k)
    pairs = [(w1, w2)] + [(distinct_copy(w1), distinct_copy(w2)) for _ in range(reps - 1)]
    return w1, w2, pairs, (tree_bytes(w1) + tree_bytes(w2)) / HBM_BYTES_PER_S


def _rep_args(key, m, k, pairs):
    """Per weight pair a fresh bf16 activation [m, k]: the argument sets ``(x, w1, w2)``."""
    return [(jax.random.normal(jax.random.fold_in(key, 100 * m + r), (m, k), jnp.bfloat16), *wp)
            for r, wp in enumerate(pairs)]


def finish_sweep(key, rows_list=(1, 2, 4), reps=9):
    """wq_a + wkv (FP8, K = 5120) with q_norm, as the attention's decode calls them: one fma GEMV
    launch, then the split-K finish kernel (K parts summed, q normalized; ``pallas_triton_finish``)
    against the same GEMV with XLA's sum + rms_norm after it (the path before session 26) and the
    reference (dequantize + dot + norm). Each checked against the reference on the GPU; device time
    per call (profiler) with the kernels listed."""
    from dsv41_jax.layers import rms_norm

    w1, w2, pairs, floor = _same_input_pair(key, ("wq_a", "wkv"), reps)
    (n1, k), n2 = w1.shape, w2.shape[0]
    nw = (1.0 + 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (n1,), jnp.float32)).astype(jnp.bfloat16)
    log(f"\n# wq_a + wkv with q_norm (FP8 32x32, {n1} + {n2} rows, K={k}; floor {floor * 1e6:.2f} us)")
    eps = 1e-6

    from pallas_kernels.quantized_matmul import pallas_triton_finish as fin
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    def finish(x, a, b, w):
        return pallas_triton.quantized_matmul_multi(x, [a, b], norms=[w, None], norm_eps=eps)

    def finish_warps(warps):
        def fn(x, a, b, w):
            saved = fin.FINISH_WARPS
            fin.FINISH_WARPS = warps  # read when the kernel is traced (inside device_time_op's jit)
            try:
                return finish(x, a, b, w)
            finally:
                fin.FINISH_WARPS = saved
        return fn

    def xla_after(x, a, b, w):
        q, kv = pallas_triton.quantized_matmul_multi(x, [a, b])
        return [rms_norm(q, w, eps), kv]

    def ref(x, a, b, w):
        return [rms_norm(reference.quantized_matmul(x, a), w, eps), reference.quantized_matmul(x, b)]

    out = []
    for m in rows_list:
        args = _rep_args(key, m, k, pairs)
        yr = jax.jit(ref)(*args[0], nw)
        row = dict(op="qmm_multi_q_norm", M=m, floor_s=floor, ok=True)
        variants = [("finish", finish), ("xla_after", xla_after), ("reference", ref)]
        variants += [(f"finish_w{w}", finish_warps(w)) for w in (1, 2, 4, 8) if w != fin.FINISH_WARPS]
        base = pallas_triton.fused_gemv_config(args[0][0], [w1, w2])
        for splits in (5, 2):  # fewer K parts: a GEMV with fewer programs, less for the finish to read
            cfg = base[:3] + (splits,) + base[4:]
            if cfg != base and fma.multi_reason(m, [w1, w2], cfg) is None:
                variants.append((f"finish_s{splits}", lambda x, a, b, w, cfg=cfg: pallas_triton.quantized_matmul_multi(
                    x, [a, b], norms=[w, None], norm_eps=eps, config=cfg)))
        _time_variants(row, variants, args, (nw,), yr, m, floor, reps)
        out.append(row)
    return out


def _time_variants(row, variants, args, shared, yr, m, floor, reps):
    """Each (name, fn) of ``variants`` on ``args[0]`` + ``shared`` checked against the outputs ``yr``
    (max rel err <= CHECK_TOL), then its device time per call over ``args`` with its kernels; the
    results go into ``row`` (``<name>_s``, ``<name>_rel_err``, ``<name>_kernels``; ``ok`` false on a
    failed check or an error)."""
    for name, fn in variants:
        try:
            y = jax.jit(fn)(*args[0], *shared)
            err = max(max_rel_err(a, b) for a, b in zip(y, yr))
            kernels = []
            t = device_time_op(fn, args, shared, reps=reps, kernels=kernels)
            good = bool(err <= CHECK_TOL)
            row.update({f"{name}_s": t, f"{name}_rel_err": err, f"{name}_kernels": [kn for kn, _ in kernels]})
            row["ok"] &= good
            log(f"  M={m} {name:10s}: {t * 1e6:7.2f} us ({100 * floor / t:5.1f}% of HBM), rel err {err:.2e} "
                f"{'PASS' if good else 'FAIL'}; kernels: {', '.join(f'{kn} {ks * 1e6:.2f}' for kn, ks in kernels)}")
        except Exception as e:  # noqa: BLE001
            row["ok"] = False
            log(f"  M={m} {name} FAILED {type(e).__name__}: {str(e)[:300]}")


def pair_sweep(key, names=("wq_b", "idx_wq_b"), rows_list=(1, 2, 4), reps=9):
    """Two FP8 projections that read the same input (default: wq_b and the indexer's wq_b, which the
    attention projects together since session 45): one fma launch (``quantized_matmul_multi``)
    against one launch each and the reference, each checked against the reference on the GPU;
    device time per call (profiler) with the kernels listed."""
    w1, w2, pairs, floor = _same_input_pair(key, names, reps)
    (n1, k), n2 = w1.shape, w2.shape[0]
    log(f"\n# {names[0]} + {names[1]} (FP8 32x32, {n1} + {n2} rows, K={k}; floor {floor * 1e6:.2f} us)")

    def fused(x, a, b):
        return pallas_triton.quantized_matmul_multi(x, [a, b])

    def separate(x, a, b):
        return [pallas_triton.quantized_matmul(x, a), pallas_triton.quantized_matmul(x, b)]

    def ref(x, a, b):
        return [reference.quantized_matmul(x, a), reference.quantized_matmul(x, b)]

    out = []
    for m in rows_list:
        args = _rep_args(key, m, k, pairs)
        yr = jax.jit(ref)(*args[0])
        row = dict(op="qmm_pair", names=list(names), M=m, floor_s=floor, ok=True)
        _time_variants(row, [("fused", fused), ("separate", separate), ("reference", ref)], args, (), yr, m, floor,
                       reps)
        out.append(row)
    return out


# tiled-kernel configs (bm, bn, bk, splits, warps, stages) the prefill sweep tries beside the default
PREFILL_CONFIGS = [(128, 128, 64, 1, 8, 3), (128, 128, 64, 1, 4, 3), (128, 256, 64, 1, 8, 3), (64, 128, 64, 1, 4, 4),
                   (128, 128, 128, 1, 8, 3), (256, 128, 64, 1, 8, 3), (128, 64, 128, 1, 4, 4)]
PREFILL_FP8_BLOCKS = ((32, 32), (128, 128))  # V4.1's and V4's weight blocks (act_block 32 / 128)


def prefill_sweep(key, m=PREFILL_M, names=tuple(PREFILL), configs=None, reps=3, mma8=False):
    """The FP8 tiled GEMM at a prefill chunk (``m`` rows) for the projections ``names`` and both
    weight-block formats: every config checked against the XLA reference on the GPU (max|diff| /
    max|ref| <= CHECK_TOL), then device time (profiler, :func:`device_time_op`) of the default
    config, the other configs, XLA's dequantize + dot (the reference, with the same activation
    fake-quant) and a bf16 ``jnp.dot`` of the dequantized weight (the matmul ceiling of this shape),
    all in one run. Issue 6's target: >= 60 % of that ceiling. ``mma8``: with 32x32 blocks, also
    every config in the experimental 'mma8' scale mode (e4m3 x e4m3 tensor-core dots per 32-wide K
    block, no weight decode), labelled ``mma8``."""
    configs = PREFILL_CONFIGS if configs is None else configs
    log(f"\n# FP8 prefill GEMM, M={m}: {jax.devices()[0].device_kind}, jax {jax.__version__}; device us per op")
    out = []
    for name, n, k in PROJECTIONS:
        if name not in names:
            continue
        for blk in PREFILL_FP8_BLOCKS:
            if n % blk[0] or k % blk[1]:
                continue
            act = blk[1]
            kw = jax.random.fold_in(key, n * 7 + k + blk[0])
            w0 = random_fp8(kw, n, k, blk[0])
            ws = [w0] + [distinct_copy(w0) for _ in range(reps - 1)]
            xs = [jax.random.normal(jax.random.fold_in(kw, r), (m, k), jnp.bfloat16) for r in range(reps)]
            args = [(xs[r], ws[r]) for r in range(reps)]
            flop = 2.0 * m * n * k
            fr = lambda x, w, act=act: reference.quantized_matmul(x, w, act_block=act)  # noqa: E731
            yr = jax.jit(fr)(*args[0])
            t_x = device_time_op(fr, args, reps=reps)
            wbs = [w.dequantize(jnp.bfloat16) for w in ws]
            t_c = device_time_op(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                                 [(xs[r], wbs[r]) for r in range(reps)], reps=reps)
            del wbs
            base = pallas_triton._config(m, n, k, "fp8")
            label = f"{name} {n}x{k} fp8 {blk[0]}x{blk[1]}"
            log(f"{label}: {flop / 1e12:.3f} TFLOP; bf16 dot (ceiling) {t_c * 1e6:8.1f} us "
                f"({flop / t_c / 1e12:6.1f} TF/s); xla {t_x * 1e6:8.1f} us ({100 * t_c / t_x:5.1f}% of ceiling)")
            modes = ["expand"] + (["mma8"] if mma8 and tuple(blk) == (32, 32) else [])
            variants = [(mode, cfg) for mode in modes for cfg in [base] + [c for c in configs if c != base]]
            for mode, cfg in variants:
                tag = f"cfg={cfg}{' (default)' if cfg == base and mode == 'expand' else ''}" + (
                    f" {mode}" if mode != "expand" else "")
                prev = pallas_triton.SCALE_MODE["fp8"]
                pallas_triton.SCALE_MODE["fp8"] = mode  # read at trace time: each variant traces afresh
                try:
                    fp = lambda x, w, cfg=cfg, act=act: pallas_triton.quantized_matmul(x, w, act_block=act, config=cfg)  # noqa: E731
                    err = max_rel_err(jax.jit(fp)(*args[0]), yr)
                    ok = err <= CHECK_TOL
                    t = device_time_op(fp, args, reps=reps) if ok else float("nan")
                    log(f"  {tag}: {t * 1e6:8.1f} us ({100 * t_c / t:5.1f}% of ceiling), xla/pallas {t_x / t:5.2f}x, "
                        f"rel err {err:.2e} {'PASS' if ok else 'FAIL'}")
                    out.append(dict(op="fp8_prefill", case=name, block=blk, M=m, N=n, K=k, config=cfg, mode=mode,
                                    pallas_s=t, xla_s=t_x, ceiling_s=t_c, flop=flop, rel_err=err, ok=ok))
                except Exception as e:  # noqa: BLE001
                    log(f"  {tag} FAILED {type(e).__name__}: {str(e)[:300]}")
                    out.append(dict(op="fp8_prefill", case=name, block=blk, M=m, config=cfg, mode=mode, ok=False,
                                    error=f"{type(e).__name__}: {str(e)[:300]}"))
                finally:
                    pallas_triton.SCALE_MODE["fp8"] = prev
            del ws, xs, args
    return out


CHECK_FP8 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("shared_w2", 5120, 2304)]
# V4-Flash FP8 projections (128x128 blocks, act_block 128; model.md §10.2, attention.md): not yet run on a GPU
CHECK_FP8_V4 = [("v4 wq_a", 1024, 4096), ("v4 wq_b", 32768, 1024), ("v4 wo_b", 4096, 8192),
                ("v4 shared_w2", 4096, 2048)]
CHECK_FP4 = [(2304, 5120), (5120, 2304)]
CHECK_PLAIN = (1024, 4096)  # a wo_a group, dequantized to bf16
CHECK_TOL = 8e-3  # max|diff| / max|ref| for bf16 outputs (fp32 summation order vs cuBLAS, then bf16)


READ_SIZES_MB = (113.0, 1024.0)  # one token's MoE bytes (6 experts), a large stream


def read_ceiling_sweep(key, names=("wq_a", "idx_wq_b", "shared_w2", "wq_b", "wo_b"), sizes_mb=READ_SIZES_MB, reps=9):
    """What a read of each FP8 projection's bytes costs (:mod:`pallas_kernels.read_ceiling`): the
    default fma GEMV (M = 1), a read-only kernel in the GEMV's tile walk, the best of the read
    variants around it, and XLA's sum of the same words, each by device time over ``reps``
    distinct weight copies (L2 flushed; each read checked bit-exactly against XLA's sum first); then
    contiguous word arrays of ``sizes_mb`` (K = 5,120 rows of 32-element groups) read by the same
    variants and XLA. The GEMV's % of the best read is how close it is to what this toolchain can
    stream at that size, beside the % of the 4.8 TB/s datasheet floor."""
    from pallas_kernels import read_ceiling as rc
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    rows = []
    log("\n# read ceiling: device time per op (us), % of 4.8 TB/s; read configs (bn, kg, splits, warps, stages)")
    log(f"{'case':22s} {'MB':>8s} {'floor':>7s} {'gemv':>7s} {'walk':>7s} {'best read':>9s} {'xla sum':>8s} "
        f"{'%HBM gemv':>9s} {'%HBM best':>9s} {'gemv/best':>9s}  best config")
    cases = []
    for i, (name, n, k) in enumerate(PROJECTIONS):
        if name in names:
            cases.append((name, random_fp8(jax.random.fold_in(key, i), n, k), True))
    for mb in sizes_mb:
        n = max(32, int(mb * 1e6 / 5120) // 32 * 32)
        cases.append((f"stream {mb:g} MB", random_fp8(jax.random.fold_in(key, 100 + int(mb)), n, 5120), False))
    for label, w0, with_gemv in cases:
        n, k = w0.shape
        words0 = rc.words_of(w0)
        nbytes = words0.size * 4
        copies = max(2, copies_for(nbytes, reps))
        ws = [w0] + [distinct_copy(w0) for _ in range(copies - 1)]
        wargs = [(rc.words_of(w),) for w in ws]
        rec = dict(op="read_ceiling", case=label, N=n, K=k, bytes=nbytes, floor_s=nbytes / HBM_BYTES_PER_S)
        fma_cfg = pallas_triton_fma.default_config(1, n, k, w0)
        walk = rc.gemv_walk(fma_cfg)
        rec["walk"] = list(walk)
        try:
            if with_gemv:
                xs = [(jax.random.normal(jax.random.fold_in(key, r), (1, k), jnp.bfloat16), w) for r, w in enumerate(ws)]
                rec["gemv_s"] = device_time_op(lambda x, w: pallas_triton.quantized_matmul(x, w, config=fma_cfg), xs,
                                               reps=copies)
            reads = {}
            for cfg in rc.variants(words0.shape, walk):
                y = jax.jit(lambda a, c=cfg: rc.stream_read(a, c))(words0)
                if not bool(jnp.all(y == rc.reference(words0, cfg[2]))):
                    raise AssertionError(f"stream_read {cfg} differs from XLA's word sums")
                reads[cfg] = device_time_op(lambda a, c=cfg: rc.stream_read(a, c), wargs, reps=copies)
            rec["reads_s"] = {str(c): t for c, t in reads.items()}
            rec["walk_s"] = reads[walk]
            best = min(reads, key=reads.get)
            rec["best_read"], rec["best_read_s"] = list(best), reads[best]
            rec["xla_sum_s"] = device_time_op(lambda a: jnp.sum(a, dtype=jnp.uint32), wargs, reps=copies)
        except Exception as e:  # keep going; report the failure
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{label} FAILED {rec['error']}")
            rows.append(rec)
            continue
        rows.append(rec)
        g = rec.get("gemv_s")
        fl, br = rec["floor_s"], rec["best_read_s"]
        us = lambda t: f"{t * 1e6:7.2f}" if t else "      -"  # noqa: E731
        log(f"{label:22s} {nbytes / 1e6:8.1f} {us(fl)} {us(g)} {us(rec['walk_s'])} {br * 1e6:9.2f} {us(rec['xla_sum_s'])} "
            f"{(f'{100 * fl / g:8.1f}%' if g else '        -')} {100 * fl / br:8.1f}% "
            f"{(f'{100 * br / g:8.1f}%' if g else '        -')}  {best}")
    return rows


def check(only: str | None = None, with_mma8: bool = False):
    """Correctness only (no timing), every path at real shapes, fresh random inputs; PASS/FAIL
    lines. Run this first on a GPU; the 'auto' gates (auto_reason) can be lifted for what passes.
    V4's FP8 128x128 blocks (act_block 128) are checked in the expand and gather modes; 'mma8' must
    reject them with a reason (reported as SKIP, not a failure)."""
    ok = True
    key = jax.random.PRNGKey(int(time.time()))
    cases = []  # (label, weight, rows, act_block)
    for name, n, k in CHECK_FP8:
        cases += [(f"fp8 {name}", random_fp8(jax.random.fold_in(key, n), n, k), m, 32) for m in (1, 8, 64, 256)]
    for name, n, k in CHECK_FP8_V4:
        cases += [(f"fp8-128 {name}", random_fp8(jax.random.fold_in(key, n + 1), n, k, 128), m, 128)
                  for m in (1, 8, 64, 256)]
    for n, k in CHECK_FP4:
        cases += [(f"mxfp4 {n}x{k}", random_fp4(jax.random.fold_in(key, k), (n, k)), m, 32) for m in (1, 8, 256)]
    n, k = CHECK_PLAIN
    wb = (jax.random.normal(key, (n, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    cases += [(f"plain bf16 {n}x{k}", wb, m, 32) for m in (1, 256)]
    if only:
        cases = [c for c in cases if any(o and o in c[0] for o in only.split(","))]
    fp8_modes = ["expand", "gather", "mx"] + (["mma8"] if with_mma8 else [])
    for label, w, m, ab in cases:
        for mode in (fp8_modes if label.startswith("fp8") else ["expand", "view3d", "mx"] if label.startswith("mxfp4") else ["-"]):
            fmt = "fp8" if label.startswith("fp8") else "fp4"
            if mode != "-":
                pallas_triton.SCALE_MODE[fmt] = mode
            x = jax.random.normal(jax.random.fold_in(key, m), (m, w.shape[-1]), jnp.bfloat16) * 4
            reason = pallas_triton.unsupported_reason(x, w, act_block=ab)
            if reason is not None and ab != 32 and mode == "mma8":
                log(f"SKIP quantized_matmul {label:24s} M={m:<4d} mode={mode:7s} rejected as expected: {reason}")
                continue
            try:
                y = jax.jit(lambda x, w: pallas_triton.quantized_matmul(x, w, act_block=ab))(x, w)
                yr = jax.jit(lambda x, w: reference.quantized_matmul(x, w, act_block=ab))(x, w)
                err = max_rel_err(y, yr)
                good = bool(err <= CHECK_TOL)
            except Exception as e:  # noqa: BLE001
                err, good = f"{type(e).__name__}: {str(e)[:200]}", False
            ok &= good
            log(f"{'PASS' if good else 'FAIL'} quantized_matmul {label:24s} M={m:<4d} mode={mode:7s} rel err {err}")
        pallas_triton.SCALE_MODE.update(fp8="expand", fp4="expand")
    log(f"quantized_matmul check: {'ALL PASS' if ok else 'FAILURES'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--check", action="store_true", help="correctness only, every path, then exit")
    ap.add_argument("--only", default=None, help="with --check: only cases whose label contains one of these (comma-separated, e.g. fp8-128,mxfp4)")
    ap.add_argument("--with-mma8", action="store_true",
                    help="with --check or --prefill: also the experimental mma8 FP8 mode (32x32 blocks)")
    ap.add_argument("--fma", action="store_true", help="tensor-core vs vector-unit (fma) GEMV sweep, then exit")
    ap.add_argument("--wide", action="store_true", help="with --fma: a wider set of configs per projection")
    ap.add_argument("--vias", default=None, help="with --fma: weight decode routes to compare, e.g. e4m3,f16w")
    ap.add_argument("--default-only", action="store_true", help="with --fma: only the default fma config")
    ap.add_argument("--names", default=None, help="with --fma: projections to sweep, e.g. wq_b,wo_b")
    ap.add_argument("--grouped", action="store_true", help="the grouped GEMV (wo_a): check + device time, then exit")
    ap.add_argument("--prefill", action="store_true",
                    help="the FP8 tiled GEMM at a 4096-row prefill chunk: configs checked, then device time beside "
                         "XLA and the bf16 dot ceiling, then exit (with --names: projections, default wq_b,wo_b,shared_w2)")
    ap.add_argument("--finish", action="store_true",
                    help="wq_a + wkv with q_norm: the split-K finish kernel vs XLA's sum + norm: check + device time")
    ap.add_argument("--pair", default=None, metavar="A,B",
                    help="two projections that read one input (e.g. wq_b,idx_wq_b): one fused launch vs one each: "
                         "check + device time")
    ap.add_argument("--read-ceiling", action="store_true",
                    help="what a read-only kernel streams at each FP8 projection's size and at larger sizes, beside "
                         "the default fma GEMV and XLA's sum of the same bytes (device time), then exit")
    ap.add_argument("--read-sizes", default=None, metavar="MB,MB",
                    help="with --read-ceiling: the contiguous stream sizes in MB (default 113,1024; with --names - "
                         "no projection)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    if a.read_ceiling:
        kw = {}
        if a.names:
            known = projection_names()
            names = () if a.names == "-" else tuple(a.names.split(","))
            if any(n not in known for n in names):
                ap.error(f"--names {a.names}: expected '-' or some of {', '.join(known)}")
            kw["names"] = names
        if a.read_sizes:
            try:
                kw["sizes_mb"] = tuple(float(v) for v in a.read_sizes.split(","))
            except ValueError:
                ap.error(f"--read-sizes {a.read_sizes}: expected sizes in MB separated by commas, e.g. 112.9,722")
            if any(v <= 0 for v in kw["sizes_mb"]):
                ap.error(f"--read-sizes {a.read_sizes}: sizes must be positive")
        rows = read_ceiling_sweep(jax.random.PRNGKey(19), **kw)
        write_rows(a.out, "qmm_read_ceiling.json", rows)
        return 0 if rows and not any("error" in r for r in rows) else 1
    if a.pair:
        names = tuple(a.pair.split(","))
        known = projection_names()
        if len(names) != 2 or any(n not in known for n in names):
            ap.error(f"--pair {a.pair}: expected two of {', '.join(known)}")
        rows = pair_sweep(jax.random.PRNGKey(17), names=names)
        write_rows(a.out, "qmm_pair.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if a.finish:
        rows = finish_sweep(jax.random.PRNGKey(13))
        write_rows(a.out, "qmm_finish.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if a.grouped:
        rows = grouped_sweep(jax.random.PRNGKey(9))
        write_rows(a.out, "qmm_grouped.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if a.prefill:
        rows = prefill_sweep(jax.random.PRNGKey(11), names=tuple(a.names.split(",")) if a.names else tuple(PREFILL),
                             mma8=a.with_mma8)
        write_rows(a.out, "qmm_prefill.json", rows)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    if a.check:
        return 0 if check(a.only, a.with_mma8) else 1
    if a.fma:
        rows = fma_sweep(jax.random.PRNGKey(5), quick=a.quick, wide=a.wide, vias=a.vias and a.vias.split(","),
                         default_only=a.default_only, names=tuple(a.names.split(",")) if a.names else FMA_SWEEP)
        write_rows(a.out, "qmm_fma.json", rows)
        return 0
    run(quick=a.quick, out_dir=a.out, tune=a.tune)


if __name__ == "__main__":
    sys.exit(main())
