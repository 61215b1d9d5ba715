"""H200 benchmark of the fused MoE (MXFP4 experts, V4.1 shape: E=384, I=2304, D=5120, top-6) vs the
XLA reference (jit), beside the byte floor of the experts actually touched.

    PYTHONPATH=. python -m pallas_kernels.moe.benchmark [--quick] [--out DIR]

Protocol as :mod:`pallas_kernels.quantized_matmul.benchmark` (one program, ``reps`` calls with
distinct tokens and distinct uniformly random routings, median of timed calls / reps). One copy of
the 6.8 GB expert set: every rep routes anew, so the weights come from HBM. Floor = (distinct
experts touched in that rep) x 3 x (5120 x 2304 / 2 + scales) bytes / 4.8 TB/s, averaged over reps.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.quant import FP4_PACKINGS, with_fp4_packing
from pallas_kernels.moe import pallas_triton, reference
from pallas_kernels.benchmarking import (HBM_BYTES_PER_S, device_time_op, fmt_us, log, max_rel_err, random_fp4,
                                         random_fp8, time_op, write_rows)

E, I, D, TOPK = 384, 2304, 5120, 6
LIMIT = 10.0


def frac_off(y, yr, rel: float = 0.01) -> float:
    """Share of the output elements off by more than ``rel`` of max|yr|."""
    y, yr = np.asarray(y, np.float32), np.asarray(yr, np.float32)
    return float(np.mean(np.abs(y - yr) > rel * float(np.max(np.abs(yr)))))


# Input construction: each helper is one jitted program per shape (the same values as the eager
# jax.random calls; eager, every jax.random call compiled its own program per shape: ~10 s of the
# interpret-mode tests' time), as benchmarking's random_fp4 / random_fp8. Shapes and the module
# constants they read (E, D, TOPK: the tests patch them) are static arguments.


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _routing(key, n, experts, topk):
    k1, k2 = jax.random.split(key)
    idx = jnp.argsort(jax.random.uniform(k1, (n, experts)), axis=1)[:, :topk].astype(jnp.int32)
    w = jax.random.uniform(k2, (n, topk), jnp.float32, 0.05, 0.5)
    return w, idx


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _topk_routing(kr, n, experts, topk):
    """Indices from ``uniform(kr)``, weights from ``uniform(fold_in(kr, 1))`` (the checks' routing)."""
    idx = jnp.argsort(jax.random.uniform(kr, (n, experts)), axis=1)[:, :topk].astype(jnp.int32)
    w = jax.random.uniform(jax.random.fold_in(kr, 1), (n, topk), jnp.float32, 0.05, 0.5)
    return idx, w


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fp8_experts(kk, e, r, cc):
    """FP8 experts (32x32 blocks) from random e4m3 data and e8m0 scales 2^-15..2^-8, one key for both."""
    from dsv41_jax.quant import Fp8Tensor

    d8 = (jax.random.normal(kk, (e, r, cc), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    s8 = jax.random.randint(kk, (e, r // 32, cc // 32), 112, 120).astype(jnp.uint8)
    return Fp8Tensor(data=d8, scale=jax.lax.bitcast_convert_type(s8, jnp.float8_e8m0fnu), block=(32, 32))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _plain_experts(kk, e, r, cc):
    return (jax.random.normal(kk, (e, r, cc), jnp.float32) / np.sqrt(cc)).astype(jnp.bfloat16)


def routing(key, n, experts=None):
    """Random top-TOPK routing of ``n`` tokens over ``experts`` (default E) experts: (weights, indices)."""
    return _routing(key, n, experts or E, TOPK)


TUNE_PREFILL_TOKENS = 2048  # the --tune sweep's prefill size (TUNE_CONFIGS_PREFILL)


def run(quick=False, out_dir=None, tune=False):
    rows = []
    key = jax.random.PRNGKey(1)
    k1, k2, k3, key = jax.random.split(key, 4)
    w1 = random_fp4(k1, (E, I, D))
    w2 = random_fp4(k2, (E, D, I))
    w3 = random_fp4(k3, (E, I, D))
    expert_bytes = sum(int(t.data[0].size + t.scale[0].size) for t in (w1, w2, w3))
    log(f"# MoE benchmark (MXFP4 experts E={E} I={I} D={D} top-{TOPK}): {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}; bytes per expert {expert_bytes / 1e6:.2f} MB")
    log(f"{'tokens':>6s} {'experts':>8s} {'MB':>8s} {'floor us':>9s} {'pallas us':>9s} {'xla us':>9s} "
        f"{'%HBM pl':>8s} {'%HBM xla':>8s} {'pl/xla x':>8s} {'relerr':>9s} {'>1%':>6s}")
    sizes = [1, 8] if quick else [1, 8, 64, 2048]
    for n in sizes:
        reps = (2, 5)
        args = []
        touched = []
        for r in range(reps[1]):
            kr = jax.random.fold_in(key, 1000 * n + r)
            w, idx = routing(kr, n)
            x = _normal(jax.random.fold_in(kr, 7), (n, D), jnp.bfloat16)
            args.append((x, w, idx))
            touched.append(len(np.unique(np.asarray(idx))))
        floor = float(np.mean(touched)) * expert_bytes / HBM_BYTES_PER_S
        rec = dict(op="moe", tokens=n, experts_touched=float(np.mean(touched)), floor_s=floor)
        try:
            fp = lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=LIMIT)
            fr = lambda x, w, idx, a, b, c: reference.moe_experts(x, w, idx, a, b, c, swiglu_limit=LIMIT)
            y = jax.jit(fp)(*args[0], w1, w2, w3)
            yr = jax.jit(fr)(*args[0], w1, w2, w3)
            rec["rel_err"] = max_rel_err(y, yr)
            rec["pallas_s"], rec["pallas_raw_s"] = time_op(fp, args, (w1, w2, w3), reps=reps)
            rec["xla_s"], rec["xla_raw_s"] = time_op(fr, args, (w1, w2, w3), reps=reps, iters=3)
            rec["frac_gt_1pct"] = frac_off(y, yr)
            log(f"{n:6d} {rec['experts_touched']:8.1f} {rec['experts_touched'] * expert_bytes / 1e6:8.1f} {fmt_us(floor)} "
                f"{fmt_us(rec['pallas_s'])} {fmt_us(rec['xla_s'])} {100 * floor / rec['pallas_s']:7.1f}% "
                f"{100 * floor / rec['xla_s']:7.1f}% {rec['xla_s'] / rec['pallas_s']:8.2f} {rec['rel_err']:9.2e} "
                f"{rec['frac_gt_1pct']:6.4f}")
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"moe n={n} FAILED {rec['error']}")
        rows.append(rec)
    if tune:
        log("\n# MoE config sweep (bt, bi, bk_a, bd, bk_b, warps[, stages]); Pallas only")
        for n, cfgs in ((1, TUNE_CONFIGS), (8, TUNE_CONFIGS), (TUNE_PREFILL_TOKENS, TUNE_CONFIGS_PREFILL)):
            args = []
            for r in range(5):
                kr = jax.random.fold_in(key, 777 * n + r)
                w, idx = routing(kr, n)
                args.append((_normal(jax.random.fold_in(kr, 7), (n, D), jnp.bfloat16), w, idx))
            yr = jax.jit(lambda x, w, idx, a, b, c: reference.moe_experts(x, w, idx, a, b, c, swiglu_limit=LIMIT))(
                *args[0], w1, w2, w3)
            for cfg in cfgs:
                try:
                    f = lambda x, w, idx, a, b, c, cfg=cfg: pallas_triton.moe_experts(  # noqa: E731
                        x, w, idx, a, b, c, swiglu_limit=LIMIT, config=cfg)
                    # a wrong config is never the pick: a tiling fault moves many elements (session 1:
                    # 15% by > 1%), while bf16 rounding flips of g/u/h (the kernels sum in another order
                    # than XLA; exact in float32) move a few elements by one e4m3 step of one h entry
                    y = jax.jit(f)(*args[0], w1, w2, w3)
                    err, frac = max_rel_err(y, yr), frac_off(y, yr)
                    t, _ = time_op(f, args, (w1, w2, w3), reps=(2, 5))
                    log(f"  n={n} cfg={cfg}: {fmt_us(t)} us, rel err {err:.2e}, {frac:.4f} of elements > 1%"
                        f"{'' if frac <= TUNE_MAX_FRAC else '  WRONG'}")
                    rows.append(dict(op="tune_moe", tokens=n, config=cfg, pallas_s=t, rel_err=err, frac_gt_1pct=frac,
                                     ok=frac <= TUNE_MAX_FRAC))
                except Exception as e:
                    log(f"  n={n} cfg={cfg} FAILED {type(e).__name__}: {str(e)[:200]}")
    write_rows(out_dir, "moe.json", rows)
    return rows


# Session 3's 40-layer profile: at 1 token the two kernels take 135 + 57 us per layer (12-14% of
# HBM) with 216 / 480 programs of 4 warps, one or two per SM; the MXFP4 decode is ALU work, so
# the sweep tries more, smaller programs (bi / bd 16-32), more warps, and pipelining depth.
# (Two entries had 512-wide down K tiles, which do not divide I = 2304: the kernel ran 4 of 4.5 steps
# and dropped the last 256 columns. Such a tiling is now refused; they take 256-wide down K tiles.)
TUNE_CONFIGS = [(16, 64, 256, 64, 256, 4), (16, 32, 256, 32, 256, 4), (16, 16, 256, 16, 256, 4),
                (16, 32, 512, 32, 256, 4), (16, 64, 256, 64, 256, 8), (16, 32, 256, 32, 256, 8),
                (16, 16, 512, 16, 256, 2), (16, 32, 256, 32, 256, 4, 2), (16, 32, 256, 32, 256, 4, 4),
                (16, 128, 256, 128, 256, 4), (16, 128, 256, 128, 256, 8)]
TUNE_MAX_FRAC = 1e-2  # at most this share of output elements off by > 1% of max|y|

# Prefill (--tune: 2048 tokens, ~128 rows per expert; --prefill: 4096 tokens over 96 experts): the
# 4096-token prefill profile had the two kernels at 10.4 + 5.1 ms per layer, about 112 TFLOP/s (14% of
# the bf16 peak); bigger tiles, more warps. Session 7's SASS (inspect_sass, CPU): the default 64-row
# blocks spend 0.27 instructions per weight code and token row in the gate/up loop and spill
# registers; (128, 128, 64, 128, 64, 8) spends 0.17, (64, 128, 64, 128, 64, 8) 0.26 without spills.
TUNE_CONFIGS_PREFILL = [(64, 128, 64, 128, 64, 4), (64, 128, 64, 128, 64, 8), (128, 128, 64, 128, 64, 8),
                        (64, 128, 128, 128, 128, 8), (128, 64, 64, 64, 64, 4), (64, 256, 64, 256, 64, 8),
                        (128, 128, 64, 128, 64, 8, 4), (64, 128, 64, 128, 64, 4, 4)]


# Tensor-core tilings with 64-wide K tiles for decode sizes (``--fma --wide``): the word decode of
# MXFP4 was 1.24x faster than bytes with 64-wide K tiles at prefill size and 2x slower with the
# decode default's 256-wide ones (session 9), so these are the candidates for batch 32 / 64.
TC_DECODE_CONFIGS = [(16, 64, 64, 64, 64, 4), (16, 128, 64, 128, 64, 4), (32, 64, 64, 64, 64, 4),
                     (16, 64, 64, 64, 64, 2)]
# --wide: neighbours of the phase route's decode tiling (16, 64, 256, 64, 256, 4) (K tiles >= 128,
# which the phase route needs): warps, row tiles, K tile, block height, pipelining depth
TC_PHASE_CONFIGS = [(16, 64, 256, 64, 256, 8), (16, 64, 256, 64, 256, 2), (16, 32, 256, 32, 256, 4),
                    (16, 128, 256, 128, 256, 4), (16, 64, 128, 64, 128, 4), (32, 64, 256, 64, 256, 4),
                    (16, 64, 256, 64, 256, 4, 2), (16, 64, 512, 64, 256, 4)]


def fma_configs(w1, n, wide: bool = False):
    """Vector-unit ("fma") configs for ``n`` tokens: the default (one-row blocks) and neighbours
    (rows per program, K groups per step, warps, pipelining; 2- and 4-row blocks from 4 tokens)."""
    base = pallas_triton.default_fma_config(w1)
    _, bt, bi, kga, bd, kgb, warps, stages = base
    cands = [base, ("fma", bt, bi, kga, bd, kgb, 2, stages), ("fma", bt, bi, kga, bd, kgb, 8, stages),
             ("fma", bt, bi // 2, kga, bd // 2, kgb, 4, stages), ("fma", bt, bi * 2, kga, bd * 2, kgb, 4, stages),
             ("fma", bt, bi, kga // 2, bd, kgb // 2, 4, stages), ("fma", bt, bi, kga, bd, kgb, 4, 1),
             ("fma", bt, bi // 2, kga, bd // 2, kgb, 2, stages)]
    if wide:  # (--wide) larger tiles with more warps, other pipelining depths, smaller K steps
        cands += [("fma", bt, bi * 2, kga, bd * 2, kgb, 8, stages), ("fma", bt, bi * 2, kga // 2, bd * 2, kgb // 2, 8, stages),
                  ("fma", bt, bi * 4, kga // 4, bd * 4, kgb // 4, 8, stages), ("fma", bt, bi, kga // 2, bd, kgb // 2, 2, stages),
                  ("fma", bt, bi, kga, bd, kgb, 4, 2), ("fma", bt, bi, kga, bd, kgb, 4, 4),
                  ("fma", bt, bi, kga, bd, kgb, 8, 2), ("fma", bt, bi // 2, kga // 2, bd // 2, kgb // 2, 2, stages),
                  ("fma", bt, bi, kga // 4, bd, kgb // 4, 4, 4)]
    if n >= 4:
        cands += [("fma", 2, bi, kga, bd, kgb, 4, stages), ("fma", 4, bi, kga, bd, kgb, 4, stages)]
    if wide and n >= 4:  # multi-row blocks with 1-2 warps (the guess: each thread would then hold more
        # weight rows and reuse an activation value across them; all slower at 32 tokens, session 10)
        cands += [("fma", 1, bi, kga, bd, kgb, 1, stages), ("fma", 2, bi, kga, bd, kgb, 1, stages),
                  ("fma", 2, bi, kga, bd, kgb, 2, stages), ("fma", 4, bi, kga, bd, kgb, 1, stages),
                  ("fma", 4, bi, kga, bd, kgb, 2, stages), ("fma", 2, bi * 2, kga, bd * 2, kgb, 2, stages)]
    out = []
    for c in cands:
        if c not in out and min(c[2:6]) >= 1 and pallas_triton.fma_reason(w1, c) is None:
            out.append(c)
    return out


def int_tuples(text: str, flag: str) -> list[tuple]:
    """``"a,b,c;d,e,f"`` -> [(a, b, c), (d, e, f)]; a ValueError naming ``flag`` and the bad entry."""
    out = []
    for c in (text or "").split(";"):
        if c.strip():
            try:
                out.append(tuple(int(v) for v in c.split(",")))
            except ValueError:
                raise ValueError(f"{flag}: {c.strip()!r} is not a comma-separated list of integers") from None
    return out


def f16acc_modes(text) -> tuple:
    """``--f16acc`` -> the modes (None: the current one); a ValueError naming an unknown mode."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    if not text:
        return (None,)
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in pallas_triton_fma.F16ACC_MODES]
    if bad or not modes:
        raise ValueError(f"--f16acc {text!r}: expected a comma-separated list of {', '.join(pallas_triton_fma.F16ACC_MODES)}")
    return modes


def fma_sweep(sizes=(1, 8), wide: bool = False, vias=None, default_only: bool = False, experts: int | None = None,
              mma_routes=None, act_block: int = 32, packings=("nibbles",), tc_only: bool = False,
              tc_configs=(), f16acc=(None,), fma_extra=()):
    """Tensor-core kernels (default config) vs the vector-unit ("fma") kernels at decode sizes, MXFP4
    experts at the V4.1 shape; every config checked against the reference (rel err, share of
    elements off by > 1%) before it is timed (device time from the profiler, :func:`device_time_op`:
    the wall-clock two-point method was within its noise here). Prints the best per size last.
    ``vias``: the fma configs once per weight decode route for both formats (``FMA_DECODE``; None: the
    current routes);
    ``default_only``: only the default fma config; ``tc_only``: no fma config (the tensor-core
    routes only); ``tc_configs``: more tensor-core tilings, each timed with every route (e.g. the
    8th entry 1: the weight tile as the dots' first operand); ``experts``: routed experts (96: the benchmark's
    reduced model, where batch 32 puts 2 pairs on each expert; None: ``E``); ``mma_routes``: the tensor-core
    kernels' MXFP4 decode routes to time beside the fma ones (``pallas_triton.MMA_FP4``; None: the
    current one); ``act_block``: the activation's fake-quant block (V4.1 32, V4 128; the shapes are the
    module's ``E, I, D``, which ``--v4-flash`` sets to :data:`V4_SHAPE`); ``packings``: the experts' MXFP4
    packings to run every config with, on the same codes (:data:`dsv41_jax.quant.FP4_PACKINGS`; the
    tensor-core config of "f16pairs" is its word-route tiling); ``f16acc``: the fma configs once per
    float16-product mode (``pallas_triton_fma.F16ACC``: "off", "on", "ptx", "gcn"; None: the current one),
    side by side in this process; ``fma_extra``: more fma configs (full tuples after "fma", as
    :func:`pallas_triton.default_fma_config` writes them, split entries included) timed at every size
    beside the others, each refused with :func:`pallas_triton.fma_reason`'s words where it does not fit
    (logged, not timed)."""
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    vias = pallas_triton_fma.checked_routes(vias)
    experts = experts or E
    key = jax.random.PRNGKey(11)
    k1, k2, k3 = jax.random.split(key, 3)
    w1, w2, w3 = (random_fp4(k1, (experts, I, D)), random_fp4(k2, (experts, D, I)),
                  random_fp4(k3, (experts, I, D)))
    expert_bytes = sum(int(t.data[0].size + t.scale[0].size) for t in (w1, w2, w3))
    rows, summary = [], []
    log(f"# MoE fma sweep (MXFP4 E={experts} I={I} D={D} top-{TOPK}, act blocks of {act_block}), "
        f"{jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}")
    # marked f16_exact where their scales allow it, as the Engine marks the model's routed experts: the
    # default route ("auto") then reads them as it does in the model (float16 phases with swap)
    packed = {pk: tuple(pallas_triton.mark_f16_exact(with_fp4_packing(t, pk)) for t in (w1, w2, w3)) for pk in packings}
    for n in sizes:
        args, touched = [], []
        for r in range(5):
            kr = jax.random.fold_in(key, 991 * n + r)
            w, idx = routing(kr, n, experts)
            args.append((_normal(jax.random.fold_in(kr, 7), (n, D), jnp.bfloat16), w, idx))
            touched.append(len(np.unique(np.asarray(idx))))
        floor = float(np.mean(touched)) * expert_bytes / HBM_BYTES_PER_S
        yr = jax.jit(lambda x, w, idx, a, b, c: reference.moe_experts(x, w, idx, a, b, c, swiglu_limit=LIMIT,
                                                                        act_block=act_block))(*args[0], w1, w2, w3)
        fmas = fma_configs(w1, n, wide)[:1 if default_only else None]
        # the config the dispatch picks at this size (block height; the gate/up K split at one token)
        auto = pallas_triton.default_fma_config(w1, pallas_triton.rows_per_expert(n * TOPK, experts), routing_shape=(n, TOPK),
                                                act_block=act_block)
        fmas += [auto] if auto not in fmas else []
        for c in fma_extra:
            c = ("fma",) + tuple(c)
            reason = pallas_triton.fma_reason(w1, c)
            if reason is not None:
                log(f"  n={n} cfg={c} refused: {reason}")
            elif c not in fmas:
                fmas.append(c)
        # the down kernel's K splits around the dispatch's choice (session 31: 3 at one and two tokens):
        # every split that divides its K steps, with the dispatch's K step and with half of it
        same = {pallas_triton.with_down_splits(c, pallas_triton.fma_down_splits(c)) for c in fmas}
        for kgb in [k for k in (auto[5], auto[5] // 2) if k]:
            steps = I // pallas_triton.fma.group_size(w1) // kgb
            for ds in range(1, min(steps, 9) + 1):
                c = pallas_triton.with_down_splits(auto[:5] + (kgb,) + auto[6:], ds)
                if steps % ds == 0 and c not in same and pallas_triton.fma_reason(w1, c) is None:
                    fmas.append(c)
                    same.add(c)
        for pk in packings:
            ws = packed[pk]
            results = []
            tc = []
            for r in mma_routes or [None]:  # the dispatch's tiling for this packing and route
                with pallas_triton.use_mma_fp4(r):
                    mma = pallas_triton.default_tiling(n * TOPK, experts, ws[0])
                more = [c for c in TC_DECODE_CONFIGS + TC_PHASE_CONFIGS if c != mma] if wide else []
                more += [tuple(c) for c in tc_configs if tuple(c) != mma and tuple(c) not in more]
                tc += [(c, vias[0], r, None) for c in [mma] + more]
            fm = [] if tc_only else [(c, v, None, m) for m in f16acc for v in vias for c in fmas]
            for cfg, via, mroute, mode in tc + fm:
                try:
                    f = lambda x, w, idx, a, b, c, cfg=cfg: pallas_triton.moe_experts(  # noqa: E731
                        x, w, idx, a, b, c, swiglu_limit=LIMIT, config=cfg, act_block=act_block)
                    with (pallas_triton_fma.use_decode_route(via), pallas_triton.use_mma_fp4(mroute),
                          pallas_triton_fma.use_f16acc(mode)):  # traced here
                        mode = mode or pallas_triton_fma.F16ACC["mode"]
                        y = jax.jit(f)(*args[0], *ws)
                        t = device_time_op(f, args, ws, reps=5)
                        read = None if cfg[0] == "fma" else pallas_triton.fp4_read_for(
                            jnp.bfloat16, pk, cfg[2], cfg[4], pallas_triton.experts_f16_exact(*ws))
                    err, frac = max_rel_err(y, yr), frac_off(y, yr)
                    ok = frac <= TUNE_MAX_FRAC and err <= 8e-3
                    label = (f"mma {pk} {read} (route {mroute or pallas_triton.MMA_FP4['route']})" if cfg[0] != "fma"
                             else f"decode {'f16pairs' if pk == 'f16pairs' else via or 'current'}"
                             + ("" if mode == "off" else f" f16acc={mode}"))
                    log(f"  n={n} cfg={cfg} {label}: {fmt_us(t)} us ({100 * floor / t:5.1f}% of HBM), rel err "
                        f"{err:.2e}, {frac:.4f} of elements > 1%{'' if ok else '  WRONG'}")
                    rec = dict(op="fma_moe", tokens=n, experts=experts, config=cfg, via=via, mma_fp4=mroute,
                               f16acc=mode if cfg[0] == "fma" else None,
                               packing=pk, pallas_s=t, floor_s=floor, rel_err=err, frac_gt_1pct=frac, ok=ok)
                    rows.append(rec)
                    results.append(rec)
                except Exception as e:  # noqa: BLE001
                    log(f"  n={n} cfg={cfg} FAILED {type(e).__name__}: {str(e)[:300]}")
            good = [r for r in results if r["ok"]]
            base = min((r for r in good if r["config"][0] != "fma"), key=lambda r: r["pallas_s"], default=None)
            for via in vias:
                for mode in sorted({r["f16acc"] for r in good if r["config"][0] == "fma"}) or [None]:
                    best = min((r for r in good if r["config"][0] == "fma" and r["via"] == via and r["f16acc"] == mode),
                               key=lambda r: r["pallas_s"], default=None)
                    label = via if pk == "nibbles" else pk
                    summary.append((n, label if mode in (None, "off") else f"{label} f16acc={mode}", floor, base, best))
    log("\n# MoE fma sweep summary: tokens, decode route, floor us, best tensor-core us, best fma us (config), % of HBM")
    for n, via, floor, base, best in summary:
        log(f"  {n:4d} {via or 'current':7s} {fmt_us(floor)} "
            f"{fmt_us(base['pallas_s']) + ' ' + str(base['config']) + ' ' + str(base['mma_fp4']) if base else '      n/a'} "
            f"{fmt_us(best['pallas_s']) if best else '      n/a'} {best['config'] if best else ''} "
            f"{100 * floor / best['pallas_s'] if best else float('nan'):.1f}%")
    return rows


def prefill_sweep(tokens: int = 4096, experts: int = 96, configs=None, reps: int = 2, routes=None, plain=False,
                  packings=("nibbles",)):
    """Prefill-size fused MoE (tensor-core kernels): the default tiling and ``configs`` (default
    :data:`TUNE_CONFIGS_PREFILL`) at ``tokens`` tokens over ``experts`` MXFP4 experts (96 = the
    benchmark's reduced model: 256 rows per expert at 4096 tokens), each checked against the reference
    on the same inputs (rel err, share of elements off by > 1%), then timed by the profiler
    (:func:`device_time_op`); beside each, TFLOP/s and the share of the bf16 matmul ceiling measured in
    the same run (``jnp.dot`` of [tokens, D] x [D, 2I], the shape of one expert's gate/up GEMM over
    every token). The best correct config is printed last. ``routes``: the MXFP4 decode routes of the
    tensor-core kernels to run every config with (``pallas_triton.MMA_FP4``; None: the current one).
    ``plain``: also every config on the same experts dequantized to bf16 (no decode in the kernel; a
    diagnostic of how much of the time the MXFP4 decode costs, not a model path). ``packings``: the
    experts' MXFP4 packings to run (:data:`dsv41_jax.quant.FP4_PACKINGS`; "f16pairs" always takes
    the word route, so ``routes`` apply to "nibbles" only)."""
    key = jax.random.PRNGKey(23)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    w1, w2, w3 = random_fp4(k1, (experts, I, D)), random_fp4(k2, (experts, D, I)), random_fp4(k3, (experts, I, D))
    args = []
    for r in range(reps):
        kr = jax.random.fold_in(k4, r)
        w, idx = routing(kr, tokens, experts)
        args.append((_normal(jax.random.fold_in(kr, 2), (tokens, D), jnp.bfloat16), w, idx))
    flops = 2 * tokens * TOPK * 3 * I * D
    a = [(_normal(jax.random.fold_in(k4, 100 + r), (tokens, D), jnp.bfloat16),
          _normal(jax.random.fold_in(k4, 200 + r), (D, 2 * I), jnp.bfloat16)) for r in range(reps)]
    t_mm = device_time_op(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32), a, reps=reps)
    ceiling = 2 * tokens * D * 2 * I / t_mm
    log(f"# MoE prefill sweep: {tokens} tokens, {experts} MXFP4 experts (I={I} D={D} top-{TOPK}), "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    yr = jax.jit(lambda x, w, idx, a, b, c: reference.moe_experts(x, w, idx, a, b, c, swiglu_limit=LIMIT))(
        *args[0], w1, w2, w3)
    rows = []
    # (packing, decode route, experts, their reference): each packing once per --mma-fp4 route (the
    # reference reads either packing alike); "plain" (bf16 copies) has no route
    variants = []
    for packing in ("nibbles", "f16pairs"):
        if packing in packings:
            ws = tuple(pallas_triton.mark_f16_exact(with_fp4_packing(t, packing)) for t in (w1, w2, w3))  # as fma_sweep
            variants += [(packing, r, ws, yr) for r in routes or [None]]
    if plain:
        pw = tuple(jax.jit(lambda t: t.dequantize(jnp.bfloat16))(t) for t in (w1, w2, w3))
        variants.append(("plain", "plain", pw, jax.jit(lambda x, w, idx, a, b, c: reference.moe_experts(
            x, w, idx, a, b, c, swiglu_limit=LIMIT))(*args[0], *pw)))
    for packing, route, ws, yv in variants:
        with pallas_triton.use_mma_fp4(None if route == "plain" else route):
            name = "plain" if route == "plain" else pallas_triton.MMA_FP4["route"]
            for cfg in [None] + list(configs or TUNE_CONFIGS_PREFILL):
                try:
                    f = lambda x, w, idx, a, b, c, cfg=cfg: pallas_triton.moe_experts(  # noqa: E731
                        x, w, idx, a, b, c, swiglu_limit=LIMIT, config=cfg)
                    y = jax.jit(f)(*args[0], *ws)
                    err, frac = max_rel_err(y, yv), frac_off(y, yv)
                    kernels = []
                    t = device_time_op(f, args, ws, reps=reps, kernels=kernels)
                    ok = frac <= TUNE_MAX_FRAC and err <= 8e-3
                    label = cfg or ("default", pallas_triton.default_tiling(tokens * TOPK, experts, ws[0]))
                    log(f"  {'plain bf16 weights' if name == 'plain' else f'{packing} route={name}'} cfg={label}: {t * 1e3:8.3f} ms, "
                        f"{flops / t / 1e12:6.1f} TFLOP/s ({100 * flops / t / ceiling:5.1f}% of "
                        f"the ceiling), rel err {err:.2e}, {frac:.4f} of elements > 1%{'' if ok else '  WRONG'}")
                    log("    kernels (ms per op): " + ", ".join(f"{k[:40]} {s * 1e3:.3f}" for k, s in kernels[:6]))
                    rows.append(dict(op="prefill_moe", tokens=tokens, experts=experts, config=cfg,
                                     packing=packing, route=name, pallas_s=t, tflops=flops / t / 1e12,
                                     ceiling_tflops=ceiling / 1e12, rel_err=err, frac_gt_1pct=frac, ok=ok,
                                     kernels_s=dict(kernels)))
                except Exception as e:  # noqa: BLE001
                    log(f"  cfg={cfg} FAILED {type(e).__name__}: {str(e)[:300]}")
    good = [r for r in rows if r["ok"] and r["route"] != "plain"]
    if good:
        best = min(good, key=lambda r: r["pallas_s"])
        log(f"# best: {best['packing']} route {best['route']} {best['config'] or 'default'} {best['pallas_s'] * 1e3:.3f} ms, {best['tflops']:.1f} TFLOP/s "
            f"({100 * best['tflops'] / best['ceiling_tflops']:.1f}% of the ceiling)")
    return rows


CHECK_PREFILL_TOKENS = 4096


def check_case(label, x, w, idx, a, b, c, *, act_block=32, frac_limit=1e-3, max_err=8e-3):
    """One ``--check`` row: the Pallas MoE against the jitted reference on the same inputs; PASS when
    rel err <= ``max_err`` and at most ``frac_limit`` of the elements are off by more than 1% of max|y|.
    Logs the row and returns whether it passed (an exception is a FAIL with its message)."""
    n = x.shape[0]
    try:
        y = jax.jit(lambda *t: pallas_triton.moe_experts(*t, swiglu_limit=LIMIT, act_block=act_block))(
            x, w, idx, a, b, c)
        yr = jax.jit(lambda *t: reference.moe_experts(*t, swiglu_limit=LIMIT, act_block=act_block))(
            x, w, idx, a, b, c)
        err, frac = max_rel_err(y, yr), frac_off(y, yr)
        good = bool(err <= max_err and frac <= frac_limit)
        msg = f"rel err {err:.2e}, {frac:.4f} of elements > 1%"
    except Exception as e:  # noqa: BLE001
        good, msg = False, f"{type(e).__name__}: {str(e)[:200]}"
    log(f"{'PASS' if good else 'FAIL'} moe {label} tokens={n}: {msg}")
    return good


def check():
    """Correctness only at the real expert shapes (MXFP4 at 1/8/64/300 tokens, at 300 also as the
    Engine holds the experts: f16pairs marked f16_exact; FP8 at 8 tokens; then
    V4's act_block 128 and FP8 128x128 experts, :func:`check_v4`): rel err <= 8e-3 and at most 0.1%
    of elements off by more than 1% of max|y|."""
    ok = True
    key = jax.random.PRNGKey(3)
    k1, k2, k3 = jax.random.split(key, 3)
    sets = [("mxfp4", random_fp4(k1, (E, I, D)), random_fp4(k2, (E, D, I)), random_fp4(k3, (E, I, D)), (1, 8, 64, 300))]
    for label, a, b, c, ns in sets:
        for n in ns:
            w, idx = routing(jax.random.fold_in(key, n), n)
            x = _normal(jax.random.fold_in(key, 99 + n), (n, D), jnp.bfloat16)
            ok &= check_case(label, x, w, idx, a, b, c)
            if n == 300:  # as the Engine holds them: f16pairs, marked f16_exact (float16 phases with swap)
                eng = tuple(pallas_triton.mark_f16_exact(with_fp4_packing(t, "f16pairs")) for t in (a, b, c))
                ok &= check_case(f"{label} f16pairs f16_exact={pallas_triton.experts_f16_exact(*eng)}", x, w, idx, *eng)
        # prefill blocking (128-token blocks: ~256 rows per expert, the 4096-token prefill over 96
        # experts): bf16 rounding-order flips move a few elements, so up to 1% may differ by > 1%
        # (a blocking fault moves far more); in float32 no element may differ by > 1%. Not 1e-5: the
        # kernel's SwiGLU (Triton's exp) and XLA's differ by ulps, and h's FP8 act-quant turns an ulp
        # at a rounding or scale boundary into a step (on the CPU, 4 ulps on h moved y by 9.7e-4 of
        # max|y| at 256 tokens). On the H200 the float32 case was 2.98e-3 in session 12, when XLA
        # still folded the reference's act-quant away (issue 11), and 3.96e-4 in session 18 with it
        # rounding. Interpret mode, where both sides use XLA's functions, is checked to 1e-5
        # (tests/pallas_kernels/test_moe.py).
        ne, n = min(96, E), CHECK_PREFILL_TOKENS
        e96 = jax.tree.map(lambda t: t[:ne], (a, b, c))
        idx, w = _topk_routing(jax.random.fold_in(key, n), n, ne, TOPK)
        x = _normal(jax.random.fold_in(key, 99 + n), (n, D), jnp.float32)
        ok &= check_case(f"{label} 96 experts (prefill blocking) bf16", x.astype(jnp.bfloat16), w, idx, *e96,
                         frac_limit=1e-2)
        ok &= check_case(f"{label} 96 experts (prefill blocking) f32", x, w, idx, *e96, frac_limit=0.0)
    del sets
    # FP8 experts (the format of the reference's FP8 fallback), built from random e4m3 data
    a, b, c = _fp8_experts(k1, E, I, D), _fp8_experts(k2, E, D, I), _fp8_experts(k3, E, I, D)
    n = 8
    w, idx = routing(jax.random.fold_in(key, 7), n)
    x = _normal(key, (n, D), jnp.bfloat16)
    ok &= check_case("fp8", x, w, idx, a, b, c, frac_limit=1.0)
    del a, b, c
    ok &= check_v4(key)
    log(f"moe check: {'ALL PASS' if ok else 'FAILURES'}")
    return ok


V4_SHAPE = (256, 2048, 4096)  # V4-Flash experts (E, I, D), top-6, act_block 128 (model.md §10.2, §10.5)


def check_v4(key):
    """V4's formats, not yet run on a GPU: MXFP4 experts with act_block 128 at the V4-Flash shape
    (1/8/64/300 tokens) and FP8 128x128 experts (the Flash-Base layout with e8m0 scales) at 8 tokens;
    same criteria as :func:`check`."""
    ok = True
    e4, i4, d4 = V4_SHAPE
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, 4), 3)
    sets = [("v4 mxfp4 act128", lambda kk, r, c: random_fp4(kk, (e4, r, c)), (1, 8, 64, 300)),
            ("v4 fp8-128", lambda kk, r, c: random_fp8(kk, r, c, 128, (e4,)), (8,))]
    for label, mk, ns in sets:
        a, b, c = mk(k1, i4, d4), mk(k2, d4, i4), mk(k3, i4, d4)
        for n in ns:
            kr = jax.random.fold_in(key, 500 + n)
            idx, w = _topk_routing(kr, n, e4, TOPK)
            x = _normal(jax.random.fold_in(kr, 2), (n, d4), jnp.bfloat16)
            ok &= check_case(label, x, w, idx, a, b, c, act_block=128)
        del a, b, c
    return ok


def debug(n_exp=16, interpret=False, formats=("fp8", "mxfp4", "bf16"), sizes=(1, 8)):
    """Localise a GPU-only mismatch: kernel A's h rows against the reference h per (token, slot),
    then the whole op with the h act-quant in kernel A vs in XLA, for FP8, MXFP4 and bf16 experts."""
    saved = dict(pallas_triton.DEBUG)
    try:
        return _debug(n_exp, interpret, formats, sizes)
    finally:  # the switches are module state: leave them as found (later calls in one process)
        pallas_triton.DEBUG.update(saved)


def _debug(n_exp, interpret, formats, sizes):
    from dsv41_jax.quant import act_quant
    from pallas_kernels.quantized_matmul.reference import quantized_matmul as qref

    key = jax.random.PRNGKey(3)
    k1, k2, k3, key = jax.random.split(key, 4)
    builders = {"fp8": lambda k, r, c: _fp8_experts(k, n_exp, r, c),
                "mxfp4": lambda k, r, c: random_fp4(k, (n_exp, r, c)),
                "bf16": lambda k, r, c: _plain_experts(k, n_exp, r, c)}
    # only the formats asked for are built (each set is a few hundred MB at the real shape)
    sets = {label: [mk(k, *s) for k, s in ((k1, (I, D)), (k2, (D, I)), (k3, (I, D)))]
            for label, mk in builders.items() if label in formats}
    results = []
    for label, (a, b, c) in sets.items():
        if label not in formats:
            continue
        for n in sizes:
            kr = jax.random.fold_in(key, n)
            idx, w = _topk_routing(kr, n, n_exp, TOPK)
            x = _normal(jax.random.fold_in(kr, 2), (n, D), jnp.bfloat16)
            yr = jax.jit(lambda *t: reference.moe_experts(*t, swiglu_limit=LIMIT))(x, w, idx, a, b, c)
            for inside in (True, False):
                pallas_triton.DEBUG.update(act_quant_in_kernel=inside, return_h=False)
                y = jax.jit(lambda *t: pallas_triton.moe_experts(*t, swiglu_limit=LIMIT, interpret=interpret))(x, w, idx, a, b, c)
                err = max_rel_err(y, yr)
                results.append((f"{label} n={n} y act_quant_in_kernel={inside}", err))
                log(f"DEBUG moe {label} n={n} act_quant_in_kernel={inside}: y rel err {err:.2e}")
            pallas_triton.DEBUG.update(act_quant_in_kernel=False, return_h=True)
            h, bp = jax.jit(lambda *t: pallas_triton.moe_experts(*t, swiglu_limit=LIMIT, interpret=interpret))(x, w, idx, a, b, c)
            pallas_triton.DEBUG.update(act_quant_in_kernel=True, return_h=False)
            quant = label != "bf16"

            def h_ref(xv, wv, e):
                take = lambda t: jax.tree.map(lambda q: q[e], t)
                g = qref(xv[None], take(a), act_block=32).astype(jnp.float32)
                u = qref(xv[None], take(c), act_block=32).astype(jnp.float32)
                u = jnp.clip(u, -LIMIT, LIMIT)
                g = jnp.minimum(g, LIMIT)
                hh = (jax.nn.silu(g) * u * wv).astype(x.dtype)
                return (act_quant(hh, 32) if quant else hh).astype(jnp.float32)[0]

            hr = jax.jit(jax.vmap(jax.vmap(h_ref, in_axes=(None, 0, 0))))(x, w, idx)  # [n, k, I]
            bp = np.asarray(bp)
            hk = np.asarray(h.astype(jnp.float32))
            rows = np.nonzero(bp < n * TOPK)[0]
            hp = np.asarray(hr).reshape(n * TOPK, I)[bp[rows]]
            diff = np.abs(hk[rows] - hp)
            scale = float(np.max(np.abs(hp)))
            bad = np.nonzero(diff.max(axis=1) > 0.01 * scale)[0]
            results.append((f"{label} n={n} kernel A h", float(diff.max()) / scale))
            log(f"DEBUG moe {label} n={n} kernel A h: rel err {float(diff.max()) / scale:.2e}, "
                f"{len(bad)}/{len(rows)} rows > 1%, worst columns {np.argsort(-diff.max(axis=0))[:8].tolist()}")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="correctness only, then exit")
    ap.add_argument("--debug", action="store_true", help="localise a mismatch (kernel A rows, act-quant placement)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--fma", action="store_true", help="tensor-core vs vector-unit (fma) kernels at decode sizes")
    ap.add_argument("--wide", action="store_true", help="with --fma: a wider set of configs per size")
    ap.add_argument("--vias", default=None, help="with --fma: weight decode routes to compare, e.g. e4m3,f16w")
    ap.add_argument("--prefill", action="store_true", help="prefill-size tilings of the tensor-core kernels, then exit")
    ap.add_argument("--tokens", type=int, default=4096, help="with --prefill")
    ap.add_argument("--configs", default=None, help="with --prefill: tilings bt,bi,bk_a,bd,bk_b,warps[,stages] separated by ;")
    ap.add_argument("--plain", action="store_true", help="with --prefill: also every tiling on bf16 copies of the "
                    "experts (no MXFP4 decode in the kernel; a diagnostic)")
    ap.add_argument("--experts", type=int, default=None,
                    help=f"routed experts (default: 96 with --prefill, {E} with --fma)")
    ap.add_argument("--sizes", default=None, help="with --fma: token counts, e.g. 1,8,32 (default 1,8; --quick 1)")
    ap.add_argument("--mma-fp4", default=None, help="with --prefill or --fma: the tensor-core kernels' MXFP4 decode routes "
                                                            "to compare, e.g. bytes,f16w")
    ap.add_argument("--default-only", action="store_true", help="with --fma: only the default fma config")
    ap.add_argument("--f16acc", default=None, help="with --fma: float16-product modes to time the fma configs with, "
                    "side by side (comma-separated from off,on,ptx,gcn; pallas_triton_fma.F16ACC; default: the current one)")
    ap.add_argument("--fma-configs", default="", help="with --fma: more fma configs timed at every size, "
                    "bt,bi,kg_a,bd,kg_b,warps,stages[,splits,gate/up warps[,down splits]] separated by ;")
    ap.add_argument("--tc-only", action="store_true", help="with --fma: only the tensor-core kernels (each --mma-fp4 route)")
    ap.add_argument("--tc-configs", default="", help="with --fma: more tensor-core tilings timed with each route, "
                    "bt,bi,bk_a,bd,bk_b,warps[,stages[,swap]] separated by ;")
    ap.add_argument("--grid-order", default=None, choices=["rows", "blocks"],
                    help="the tensor-core kernels' launch order (pallas_triton.GRID_ORDER; default: as it is)")
    ap.add_argument("--v4-flash", action="store_true", help="with --fma: V4-Flash's experts (E, I, D = V4_SHAPE, "
                    "activation blocks of 128) instead of V4.1's")
    ap.add_argument("--packings", default="nibbles", help="with --fma or --prefill: the experts' MXFP4 packings to "
                    f"compare on the same codes, e.g. nibbles,f16pairs (of {', '.join(FP4_PACKINGS)})")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    packings = tuple(p.strip() for p in a.packings.split(",") if p.strip())
    if not packings or any(p not in FP4_PACKINGS for p in packings):
        ap.error(f"--packings {a.packings!r}: expected a comma-separated subset of {', '.join(FP4_PACKINGS)}")
    if a.grid_order:
        pallas_triton.GRID_ORDER["order"] = a.grid_order
    if a.check:
        return 0 if check() else 1
    if a.debug:
        debug()
        return 0
    if a.prefill:
        try:
            cfgs = int_tuples(a.configs, "--configs") or ([(128, 128, 64, 128, 64, 8)] if a.quick else None)
        except ValueError as e:
            ap.error(str(e))
        rows = prefill_sweep(a.tokens, a.experts or 96, routes=a.mma_fp4 and a.mma_fp4.split(","), configs=cfgs,
                             plain=a.plain, packings=packings)
        write_rows(a.out, "moe_prefill.json", rows)
        return 0
    if a.fma:
        if a.v4_flash:
            globals().update(zip(("E", "I", "D"), V4_SHAPE))
        sizes = tuple(int(v) for v in a.sizes.split(",")) if a.sizes else (1,) if a.quick else (1, 8)
        try:
            tcs, extra = int_tuples(a.tc_configs, "--tc-configs"), int_tuples(a.fma_configs, "--fma-configs")
        except ValueError as e:
            ap.error(str(e))
        bad = [c for c in extra if not 7 <= len(c) <= 10]
        if bad:
            ap.error(f"--fma-configs: {bad[0]} has {len(bad[0])} entries; expected 7 to 10 "
                     "(bt,bi,kg_a,bd,kg_b,warps,stages[,splits,gate/up warps[,down splits]])")
        rows = fma_sweep(sizes, wide=a.wide, vias=a.vias and a.vias.split(","), default_only=a.default_only,
                         experts=a.experts, mma_routes=a.mma_fp4 and a.mma_fp4.split(","),
                         act_block=128 if a.v4_flash else 32, packings=packings, tc_only=a.tc_only,
                         tc_configs=tcs,
                         f16acc=f16acc_modes(a.f16acc), fma_extra=extra)
        write_rows(a.out, "moe_fma.json", rows)
        return 0
    run(quick=a.quick, out_dir=a.out, tune=a.tune)


if __name__ == "__main__":
    sys.exit(main())
