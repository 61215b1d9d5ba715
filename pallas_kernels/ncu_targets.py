"""Decode kernels to run under Nsight Compute (``ncu``) on a GPU: hardware counters for one op.

    PYTHONPATH=. ncu --clock-control none --set full -k regex:"moe_gate_up_fma|moe_down_fma" \\
        --launch-skip 2 --launch-count 2 -o moe python -m pallas_kernels.ncu_targets moe8
    ncu --import moe.ncu-rep --page details      # or --page raw --csv for every metric

Each target runs its op ``--calls`` times (default 3) with the dispatch's default configuration, so
that ``--launch-skip`` can step over the first call; nothing is timed here (the benchmarks time,
ncu measures one launch with the caches flushed). Targets:

* ``moe``  -- the fused MoE at one token over 96 MXFP4 experts (the benchmark model's), V4.1 shapes;
* ``moe8`` -- the same kernels over 8 experts (the same grid at one token: 6 pairs on 6 experts, and
  ncu saves and restores 0.2 GB instead of 1.7 GB per replay pass, so ``--set full`` fits a call);
* ``gemv`` -- the FP8 GEMVs wq_b, wo_b and shared_w2 at one row, in that order;
* ``wqb``  -- wq_b alone.

ncu on the H200 (session 32, BENCHMARKS.md issue 6) took 40-60 s per profiled launch with a few
sections, longer with ``--set full``: profile few launches per call. ``DSV41_FMA_ACT_QUANT`` and the
other trace-time switches apply as in the model. ``--lower-only TARGET`` (CPU) lowers each target's
ops for ``cuda`` instead of running them, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

TARGETS = ("moe", "moe8", "gemv", "wqb")
GEMV_NAMES = ("wq_b", "wo_b", "shared_w2")  # of the GEMV benchmark's PROJECTIONS (V4.1 shapes)


def cases(target: str):
    """[(label, fn, make)] for ``target``: ``fn(*make())`` runs the op once (``make`` builds its
    random inputs; ``jax.eval_shape(make)`` gives their shapes without allocating them)."""
    from pallas_kernels.benchmarking import random_fp4, random_fp8
    from pallas_kernels.moe import benchmark as moe_bench
    from pallas_kernels.moe import pallas_triton as moe
    from pallas_kernels.quantized_matmul import pallas_triton as qmm
    from pallas_kernels.quantized_matmul.benchmark import PROJECTIONS

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
    key = jax.random.PRNGKey(0)
    out = []
    if target in ("moe", "moe8"):
        e = 8 if target == "moe8" else 96
        i, d = moe_bench.I, moe_bench.D  # V4.1's, top-6

        def make_moe():
            w1, w2, w3 = (random_fp4(jax.random.fold_in(key, j), s)
                          for j, s in enumerate([(e, i, d), (e, d, i), (e, i, d)]))
            idx = jnp.array([[0, 1, 2, 4, 5, 7]] if e == 8 else [[3, 17, 29, 44, 60, 91]], jnp.int32)
            return jax.random.normal(key, (1, d), jnp.bfloat16), jnp.full((1, 6), 0.2, jnp.float32), idx, w1, w2, w3

        fn = lambda x, w, ix, a, b, c: moe.moe_experts(x, w, ix, a, b, c, swiglu_limit=moe_bench.LIMIT)  # noqa: E731
        out.append((f"moe E={e}", fn, make_moe))
    else:
        shapes = {name: (n, k) for name, n, k in PROJECTIONS}
        for name in ("wq_b",) if target == "wqb" else GEMV_NAMES:
            n, k = shapes[name]

            def make_gemv(n=n, k=k):
                return jax.random.normal(key, (1, k), jnp.bfloat16), random_fp8(jax.random.fold_in(key, n), n, k)

            out.append((name, lambda x, w: qmm.quantized_matmul(x, w), make_gemv))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--calls", type=int, default=3, help="calls of each op (ncu's --launch-skip steps over the first)")
    ap.add_argument("--lower-only", action="store_true", help="lower each op for cuda on this machine, run nothing")
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error(f"--calls must be at least 1, got {a.calls}")
    for label, fn, make in cases(a.target):
        if a.lower_only:
            from jax.experimental.pallas import triton as pltriton

            from pallas_kernels.testing import lower_for

            text = lower_for("cuda", fn, *jax.eval_shape(make)).as_text()
            print(f"{label}: lowered for cuda, {text.count(pltriton.CUSTOM_CALL_TARGET_NAME)} Triton calls")
            continue
        args = make()
        f = jax.jit(fn)
        for _ in range(a.calls):
            jax.block_until_ready(f(*args))
        print(f"{label}: {a.calls} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
