"""H200 benchmark of one mHC site (hc_mixes + hc_collapse + hc_expand; V4.1: hc=4, D=5120) vs the
XLA reference (jit), beside the byte floor.

    PYTHONPATH=. python -m pallas_kernels.mhc.benchmark [--quick] [--out DIR]

Protocol as :mod:`pallas_kernels.quantized_matmul.benchmark`; each rep uses its own x, f and its
own copy of (fn, scale, base), as the 80 sites of a decode step do. Floor bytes: fn (f32) + x read
twice (mixes, collapse) + collapse out + f + residual + expand out.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.mhc import pallas_triton, reference
from pallas_kernels.benchmarking import HBM_BYTES_PER_S, device_time_op, fmt_us, log, max_rel_err, time_op, write_rows

HC, D = 4, 5120
KW = dict(norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)


def site(mod, x, f, pre_prev, fn, scale, base):
    pre, post, comb = mod.hc_mixes(x, fn, scale, base, **KW)
    a = mod.hc_collapse(x, pre_prev)
    y = mod.hc_expand(f, x, post, comb)
    return pre, y, a


def run(quick=False, out_dir=None):
    rows = []
    key = jax.random.PRNGKey(2)
    mix = (2 + HC) * HC
    log(f"# mHC site benchmark (hc={HC}, D={D}): {jax.devices()[0].device_kind}, jax {jax.__version__}")
    log(f"{'T':>6s} {'MB':>7s} {'floor us':>9s} {'pallas us':>9s} {'xla us':>9s} {'pl/xla x':>8s} "
        f"{'mixes pl us':>11s} {'relerr pre/post/comb/exp/col':>28s}")
    for t in ([1, 8] if quick else [1, 8, 64, 4096]):
        reps = (3, 9) if t <= 64 else (2, 5)
        args = []
        for r in range(reps[1]):
            ks = jax.random.split(jax.random.fold_in(key, 100 * t + r), 6)
            x = jax.random.normal(ks[0], (t, HC, D), jnp.bfloat16)
            f = jax.random.normal(ks[1], (t, D), jnp.bfloat16)
            pre_prev = jax.nn.sigmoid(jax.random.normal(ks[2], (t, HC), jnp.float32))
            fn = jax.random.normal(ks[3], (mix, HC * D), jnp.float32) * 0.02
            scale = jax.random.uniform(ks[4], (3,), jnp.float32, 0.5, 2.0)
            base = jax.random.normal(ks[5], (mix,), jnp.float32)
            args.append((x, f, pre_prev, fn, scale, base))
        nbytes = mix * HC * D * 4 + 2 * t * HC * D * 2 + 2 * t * D * 2 + t * D * 2 + 2 * t * HC * D * 2
        floor = nbytes / HBM_BYTES_PER_S
        rec = dict(op="mhc_site", T=t, bytes=nbytes, floor_s=floor)
        try:
            fp = lambda *a: site(pallas_triton, *a)
            fr = lambda *a: site(reference, *a)
            outp = jax.jit(fp)(*args[0])
            outr = jax.jit(fr)(*args[0])
            mp = jax.jit(lambda x, fn, s, b: pallas_triton.hc_mixes(x, fn, s, b, **KW))(*[args[0][i] for i in (0, 3, 4, 5)])
            mr = jax.jit(lambda x, fn, s, b: reference.hc_mixes(x, fn, s, b, **KW))(*[args[0][i] for i in (0, 3, 4, 5)])
            errs = [max_rel_err(a, b) for a, b in zip(mp, mr)] + [max_rel_err(outp[1], outr[1]), max_rel_err(outp[2], outr[2])]
            rec["rel_err"] = errs
            rec["pallas_s"], rec["pallas_raw_s"] = time_op(fp, args, reps=reps)
            rec["xla_s"], rec["xla_raw_s"] = time_op(fr, args, reps=reps)
            fm = lambda x, f, p, fn, s, b: pallas_triton.hc_mixes(x, fn, s, b, **KW)
            rec["pallas_mixes_s"], _ = time_op(fm, args, reps=reps)
            log(f"{t:6d} {nbytes / 1e6:7.2f} {fmt_us(floor)} {fmt_us(rec['pallas_s'])} {fmt_us(rec['xla_s'])} "
                f"{rec['xla_s'] / rec['pallas_s']:8.2f} {fmt_us(rec['pallas_mixes_s']):>11s} "
                f"{'/'.join(f'{e:.1e}' for e in errs):>28s}")
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"mhc T={t} FAILED {rec['error']}")
        rows.append(rec)
    write_rows(out_dir, "mhc.json", rows)
    return rows


# (rows per program, K block, K splits[, split-kernel warps; default by rows]); (1, 64, 128) is refused: 160 K blocks
# of 64 do not split in 128. Splits that are not a power of two are summed in power-of-two groups.
SWEEP_CONFIGS = {1: [(1, 128, 32, 4), (1, 128, 16, 1), (1, 64, 64, 1), (1, 64, 128), (1, 128, 80, 1), (1, 128, 160, 1),
                     (1, 256, 80, 1)],
                 8: [(1, 128, 32, 4), (1, 128, 8, 1), (1, 128, 80, 1), (1, 64, 32, 1)]}


def sweep(tokens=(1, 8), reps=5):
    """Device time (profiler, :func:`device_time_op`) of hc_mixes per config (rows per program, K
    block, K splits; default first) and of the whole site (Pallas and XLA) at decode sizes, each
    config checked against the reference first (max abs err <= 1e-5 on values in [0, 2])."""
    mix = (2 + HC) * HC
    log(f"# mHC decode sweep (hc={HC}, D={D}): {jax.devices()[0].device_kind}, jax {jax.__version__}; device us per op")
    rows = []
    for t in tokens:
        args = []
        for r in range(reps):
            ks = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(7), 100 * t + r), 6)
            args.append((jax.random.normal(ks[0], (t, HC, D), jnp.bfloat16),
                         jax.random.normal(ks[1], (t, D), jnp.bfloat16),
                         jax.nn.sigmoid(jax.random.normal(ks[2], (t, HC), jnp.float32)),
                         jax.random.normal(ks[3], (mix, HC * D), jnp.float32) * 0.02,
                         jax.random.uniform(ks[4], (3,), jnp.float32, 0.5, 2.0),
                         jax.random.normal(ks[5], (mix,), jnp.float32)))
        floor = (mix * HC * D * 4 + t * HC * D * 2) / HBM_BYTES_PER_S
        x, _, _, fn, sc, base = args[0]
        ref = jax.jit(lambda *a: reference.hc_mixes(*a, **KW))(x, fn, sc, base)
        default = pallas_triton._mix_config(t, HC * D)
        for cfg in [default] + [c for c in SWEEP_CONFIGS.get(t, []) if c != default]:
            try:
                out = jax.jit(lambda *a, cfg=cfg: pallas_triton.hc_mixes(*a, config=cfg, **KW))(x, fn, sc, base)
                err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(out, ref))
                tm = device_time_op(lambda x, f, p, fn, s, b, cfg=cfg: pallas_triton.hc_mixes(x, fn, s, b, config=cfg, **KW),
                                    args, reps=reps)
                log(f"  T={t} hc_mixes cfg={cfg}{' (default)' if cfg == default else ''}: {tm * 1e6:7.2f} us "
                    f"(mixes floor {floor * 1e6:.2f} us), max abs err {err:.1e}{'' if err <= 1e-5 else '  WRONG'}")
                rows.append(dict(op="hc_mixes", T=t, config=cfg, s=tm, err=err))
            except Exception as e:  # noqa: BLE001
                log(f"  T={t} hc_mixes cfg={cfg} FAILED {type(e).__name__}: {str(e)[:300]}")
        for name, mod in (("pallas", pallas_triton), ("xla", reference)):
            ts = device_time_op(lambda *a, mod=mod: site(mod, *a), args, reps=reps)
            log(f"  T={t} site ({name}): {ts * 1e6:7.2f} us")
            rows.append(dict(op="mhc_site", T=t, impl=name, s=ts))
        # the expansion followed by the next site's collapse (V4.1), two kernels or one
        two = lambda x, f, p, fn, s, b: (lambda h: (h, pallas_triton.hc_collapse(h, p)))(  # noqa: E731
            pallas_triton.hc_expand(f, x, jnp.ones_like(p) * 0.5, jnp.full(p.shape + (HC,), 0.25)))
        one = lambda x, f, p, fn, s, b: pallas_triton.hc_expand_collapse(  # noqa: E731
            f, x, jnp.ones_like(p) * 0.5, jnp.full(p.shape + (HC,), 0.25), p)
        mixf = lambda x, f, p, fn, s, b: pallas_triton.hc_expand_collapse_mixes(  # noqa: E731
            f, x, jnp.ones_like(p) * 0.5, jnp.full(p.shape + (HC,), 0.25), p, fn, s, b, **KW)
        sep = lambda x, f, p, fn, s, b: (lambda hy: (hy, pallas_triton.hc_mixes(hy[0], fn, s, b, **KW)))(  # noqa: E731
            one(x, f, p, fn, s, b))
        for name, fn_ in (("expand + collapse, two kernels", two), ("hc_expand_collapse, one kernel", one),
                          ("hc_expand_collapse + hc_mixes, three kernels", sep),
                          ("hc_expand_collapse_mixes, two kernels", mixf)):
            ts = device_time_op(fn_, args, reps=reps)
            log(f"  T={t} {name}: {ts * 1e6:7.2f} us")
            rows.append(dict(op="expand_collapse", T=t, impl=name, s=ts))
    return rows


CHECK_DIMS = (5120, 4096, 7168)  # V4.1-Flash, V4-Flash, V4-Pro hidden sizes


def check(dims=CHECK_DIMS, tokens=(1, 8, 64, 300)):
    """Correctness only (hc_mixes, hc_collapse, hc_expand, hc_expand_collapse at T = 1, 8, 64, 300;
    hc_expand_collapse_mixes at the decode sizes among them) for each model width in ``dims``."""
    ok = True
    mix = (2 + HC) * HC
    for d, t in [(d, t) for d in dims for t in tokens]:
        ks = jax.random.split(jax.random.PRNGKey(50 + t + d), 6)
        x = jax.random.normal(ks[0], (t, HC, d), jnp.bfloat16)
        f = jax.random.normal(ks[1], (t, d), jnp.bfloat16)
        fn = jax.random.normal(ks[3], (mix, HC * d), jnp.float32) * 0.02
        scale = jax.random.uniform(ks[4], (3,), jnp.float32, 0.5, 2.0)
        base = jax.random.normal(ks[5], (mix,), jnp.float32)
        try:
            mp = jax.jit(lambda *a: pallas_triton.hc_mixes(*a, **KW))(x, fn, scale, base)
            mr = jax.jit(lambda *a: reference.hc_mixes(*a, **KW))(x, fn, scale, base)
            e_mix = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(mp, mr))
            pre, post, comb = mr
            e_col = max_rel_err(jax.jit(pallas_triton.hc_collapse)(x, pre), jax.jit(reference.hc_collapse)(x, pre))
            e_exp = max_rel_err(jax.jit(pallas_triton.hc_expand)(f, x, post, comb),
                                jax.jit(reference.hc_expand)(f, x, post, comb))
            hp, yp = jax.jit(pallas_triton.hc_expand_collapse)(f, x, post, comb, pre)
            hr, yr = jax.jit(reference.hc_expand_collapse)(f, x, post, comb, pre)
            e_ec = max(max_rel_err(hp, hr), max_rel_err(yp, yr))
            res = [("hc_mixes", e_mix <= 1e-5, f"max abs err {e_mix:.2e}"),
                   ("hc_collapse", e_col <= 8e-3, f"rel err {e_col:.2e}"),
                   ("hc_expand", e_exp <= 8e-3, f"rel err {e_exp:.2e}"),
                   ("hc_expand_collapse", e_ec <= 8e-3, f"rel err {e_ec:.2e}")]
            if t <= pallas_triton.MIX_FUSED_MAX_T:  # decode sizes: + the next site's mixes, two kernels
                fm = lambda *a: pallas_triton.hc_expand_collapse_mixes(*a, **KW)  # noqa: E731
                h3, y3, m3 = jax.jit(fm)(f, x, post, comb, pre, fn, scale, base)
                m3r = jax.jit(lambda *a: reference.hc_mixes(*a, **KW))(h3, fn, scale, base)
                e3 = max(max_rel_err(h3, hp), max_rel_err(y3, yp))
                e3m = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(m3, m3r))
                res.append(("hc_expand_collapse_mixes", e3 <= 8e-3 and e3m <= 1e-5,
                            f"streams/collapse rel err {e3:.2e}, mixes max abs err {e3m:.2e}"))
                # with the next site's RMSNorm fused (DSV41_MHC_FUSED_NORM): y against rms_norm of the
                # reference collapse (per element, one bf16 ulp plus the collapse's own rounding)
                w = jax.random.uniform(ks[2], (d,), jnp.float32, 0.2, 3.0).astype(jnp.bfloat16)
                fmn = lambda *a: pallas_triton.hc_expand_collapse_mixes(*a, y_norm_eps=1e-6, **KW)  # noqa: E731
                h4, y4, m4 = jax.jit(fmn)(f, x, post, comb, pre, fn, scale, base, w)
                y4r = jax.jit(lambda y: reference.rms_norm(y, w, 1e-6))(yr)
                e4 = max(max_rel_err(y4, y4r), max_rel_err(h4, hr))
                e4m = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(m4, m3))
                res.append(("hc_expand_collapse_mixes + norm", e4 <= 8e-3 and e4m == 0.0,
                            f"normed collapse/streams rel err {e4:.2e}, mixes vs unnormed max abs diff {e4m:.2e}"))
        except Exception as e:  # noqa: BLE001
            res = [("mhc", False, f"{type(e).__name__}: {str(e)[:200]}")]
        for name, good, msg in res:
            ok &= bool(good)
            log(f"{'PASS' if good else 'FAIL'} {name} D={d} T={t}: {msg}")
    log(f"mhc check: {'ALL PASS' if ok else 'FAILURES'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="correctness only, then exit")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="decode-size hc_mixes configs and the site, device time")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    if a.check:
        return 0 if check() else 1
    if a.sweep:
        sweep()
        return 0
    run(quick=a.quick, out_dir=a.out)


if __name__ == "__main__":
    sys.exit(main())
