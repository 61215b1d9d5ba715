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
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
from pallas_kernels.quantized_matmul import pallas_triton, reference

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet peak, performance.md §4
L2_BYTES = 60e6

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
PREFILL = ["wq_b", "wo_b", "shared_w1/w3", "shared_w2", "dspark_main_proj"]


def log(*a):
    print(*a, flush=True)


def tree_bytes(t) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(t)))


def copies_for(nbytes: int, reps: int) -> int:
    return max(1, min(reps, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


def reps_for(nbytes: int, lo: int = 16, hi: int = 96) -> int:
    """Enough reps that one program streams >= 4x L2 of distinct weights."""
    return int(min(hi, max(lo, math.ceil(4 * L2_BYTES / max(nbytes, 1)))))


def distinct_copy(t):
    return jax.tree.map(lambda a: jnp.copy(a), t)


def time_op(fn, per_rep_args, shared_args=(), *, reps, iters=5):
    """Median seconds per op. ``per_rep_args``: list (len reps) of argument tuples; ``fn(*args, *shared)``."""
    prog = jax.jit(lambda reps_args, shared: [fn(*a, *shared) for a in reps_args])
    out = prog(per_rep_args, shared_args)
    jax.block_until_ready(out)
    out = prog(per_rep_args, shared_args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(per_rep_args, shared_args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / len(per_rep_args)


def max_rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_fp8(key, n, k):
    k1, k2 = jax.random.split(key)
    data = (jax.random.normal(k1, (n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    s = jax.random.randint(k2, (n // 32, k // 32), 112, 120).astype(jnp.uint8)
    return Fp8Tensor(data=data, scale=jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), block=(32, 32))


def random_fp4(key, shape):
    *lead, n, k = shape
    k1, k2 = jax.random.split(key)
    data = jax.random.randint(k1, (*lead, n, k // 2), 0, 256).astype(jnp.uint8)
    s = jax.random.randint(k2, (*lead, n, k // 32), 118, 124).astype(jnp.uint8)
    return Fp4Tensor(data=data, scale=jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), block=32)


def fmt_us(t):
    return f"{t * 1e6:9.1f}"


def run(quick=False, out_dir=None, tune=False):
    rows = []
    key = jax.random.PRNGKey(0)
    ms = [1, 8] if quick else [1, 8, 64]
    log(f"# quantized_matmul benchmark: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    log(f"{'case':34s} {'M':>5s} {'MB':>8s} {'floor us':>9s} {'pallas us':>9s} {'xla us':>9s} "
        f"{'%HBM pl':>8s} {'%HBM xla':>8s} {'pl/xla x':>8s} {'relerr':>9s}")
    for name, n, k in PROJECTIONS:
        key, kw = jax.random.split(key)
        w0 = random_fp8(kw, n, k)
        wbytes = tree_bytes(w0)
        for m in ms:
            reps = reps_for(wbytes)
            c = copies_for(wbytes, reps)
            ws = [w0] + [distinct_copy(w0) for _ in range(c - 1)]
            xs = [jax.random.normal(jax.random.fold_in(kw, r), (m, k), jnp.bfloat16) for r in range(reps)]
            rec = dict(op="fp8_gemv", case=name, M=m, N=n, K=k, weight_bytes=wbytes)
            try:
                y = jax.jit(lambda x, w: pallas_triton.quantized_matmul(x, w))(xs[0], w0)
                yr = jax.jit(lambda x, w: reference.quantized_matmul(x, w))(xs[0], w0)
                rec["rel_err"] = max_rel_err(y, yr)
                args = [(xs[r], ws[r % c]) for r in range(reps)]
                rec["pallas_s"] = time_op(lambda x, w: pallas_triton.quantized_matmul(x, w), args, reps=reps)
                rec["xla_s"] = time_op(lambda x, w: reference.quantized_matmul(x, w), args, reps=reps)
            except Exception as e:  # keep going; report the failure
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"{name} M={m} FAILED {rec['error']}")
                rows.append(rec)
                continue
            floor = wbytes / HBM_BYTES_PER_S
            rec["floor_s"] = floor
            rows.append(rec)
            log(f"{'fp8 ' + name:34s} {m:5d} {wbytes / 1e6:8.1f} {fmt_us(floor)} {fmt_us(rec['pallas_s'])} "
                f"{fmt_us(rec['xla_s'])} {100 * floor / rec['pallas_s']:7.1f}% {100 * floor / rec['xla_s']:7.1f}% "
                f"{rec['xla_s'] / rec['pallas_s']:8.2f} {rec['rel_err']:9.2e}")
            del ws, xs

    # MXFP4 GEMV on one expert-shaped matrix (the MoE kernels share this decode path)
    for name, n, k in [("mxfp4 expert w1 2304x5120", 2304, 5120), ("mxfp4 expert w2 5120x2304", 5120, 2304)]:
        key, kw = jax.random.split(key)
        w0 = random_fp4(kw, (n, k))
        wbytes = tree_bytes(w0)
        m = 1
        reps = 16
        c = copies_for(wbytes, reps)
        ws = [w0] + [distinct_copy(w0) for _ in range(c - 1)]
        xs = [jax.random.normal(jax.random.fold_in(kw, r), (m, k), jnp.bfloat16) for r in range(reps)]
        rec = dict(op="fp4_gemv", case=name, M=m, N=n, K=k, weight_bytes=wbytes)
        try:
            y = jax.jit(lambda x, w: pallas_triton.quantized_matmul(x, w))(xs[0], w0)
            yr = jax.jit(lambda x, w: reference.quantized_matmul(x, w))(xs[0], w0)
            rec["rel_err"] = max_rel_err(y, yr)
            args = [(xs[r], ws[r % c]) for r in range(reps)]
            rec["pallas_s"] = time_op(lambda x, w: pallas_triton.quantized_matmul(x, w), args, reps=reps)
            rec["xla_s"] = time_op(lambda x, w: reference.quantized_matmul(x, w), args, reps=reps)
            floor = wbytes / HBM_BYTES_PER_S
            rec["floor_s"] = floor
            log(f"{name:34s} {m:5d} {wbytes / 1e6:8.1f} {fmt_us(floor)} {fmt_us(rec['pallas_s'])} "
                f"{fmt_us(rec['xla_s'])} {100 * floor / rec['pallas_s']:7.1f}% {100 * floor / rec['xla_s']:7.1f}% "
                f"{rec['xla_s'] / rec['pallas_s']:8.2f} {rec['rel_err']:9.2e}")
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{name} FAILED {rec['error']}")
        rows.append(rec)

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
        reps = 4
        xs = [jax.random.normal(jax.random.fold_in(kw, r), (mp, k), jnp.bfloat16) for r in range(reps)]
        rec = dict(op="fp8_prefill", case=name, M=mp, N=n, K=k)
        try:
            y = jax.jit(lambda x, w: pallas_triton.quantized_matmul(x, w))(xs[0], w0)
            yr = jax.jit(lambda x, w: reference.quantized_matmul(x, w))(xs[0], w0)
            rec["rel_err"] = max_rel_err(y, yr)
            args = [(xs[r],) for r in range(reps)]
            rec["pallas_s"] = time_op(lambda x, w: pallas_triton.quantized_matmul(x, w), args, (w0,), reps=reps)
            rec["xla_s"] = time_op(lambda x, w: reference.quantized_matmul(x, w), args, (w0,), reps=reps)
            rec["bf16_dot_s"] = time_op(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                                        args, (wb,), reps=reps)
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
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "quantized_matmul.json"), "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)
    return rows


def tune_gemv(key):
    """Config sweep (bm, bn, bk, splits, warps, stages) on two shapes; Pallas only."""
    rows = []
    cases = [("wq_b", 32768, 1280, 1), ("wo_b", 5120, 8192, 8), ("wq_a", 1280, 5120, 1)]
    cfgs = [(16, 32, 256, 0, 4, 3), (16, 64, 256, 0, 4, 3), (16, 128, 256, 0, 4, 3), (16, 64, 512, 0, 4, 3),
            (16, 128, 128, 0, 4, 4), (16, 64, 256, 0, 8, 3), (16, 128, 256, 0, 8, 3), (16, 256, 128, 0, 8, 3)]
    log("\n# GEMV config sweep (bm, bn, bk, splits, warps, stages); splits 0 = auto")
    for name, n, k, m in cases:
        w0 = random_fp8(jax.random.fold_in(key, n), n, k)
        wbytes = tree_bytes(w0)
        reps = reps_for(wbytes)
        c = copies_for(wbytes, reps)
        ws = [w0] + [distinct_copy(w0) for _ in range(c - 1)]
        xs = [jax.random.normal(jax.random.fold_in(key, r), (m, k), jnp.bfloat16) for r in range(reps)]
        args = [(xs[r], ws[r % c]) for r in range(reps)]
        for cfg in cfgs:
            bm, bn, bk, sp, wp, st = cfg
            if n % bn or k % bk:
                continue
            if sp == 0:  # auto split
                sp = 1
                while (n // bn) * sp < 2 * pallas_triton.N_SM and (k // bk) % (sp * 2) == 0 and (k // bk) // (sp * 2) >= 2:
                    sp *= 2
            full = (bm, bn, bk, sp, wp, st)
            try:
                t = time_op(lambda x, w: pallas_triton.quantized_matmul(x, w, config=full), args, reps=reps)
                floor = wbytes / HBM_BYTES_PER_S
                log(f"  {name:10s} M={m:<3d} cfg={full}: {fmt_us(t)} us  {100 * floor / t:5.1f}% HBM")
                rows.append(dict(op="tune_gemv", case=name, M=m, config=full, pallas_s=t, floor_s=floor))
            except Exception as e:
                log(f"  {name} cfg={full} FAILED {type(e).__name__}: {str(e)[:200]}")
        del ws
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    run(quick=a.quick, out_dir=a.out, tune=a.tune)


if __name__ == "__main__":
    sys.exit(main())
