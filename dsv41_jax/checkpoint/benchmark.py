"""Checkpoint I/O benchmark: write a multi-GB random official-format checkpoint, convert it to
Orbax, then measure load time and peak host RSS of (a) the safetensors loader and (b) the Orbax
restore, each in a fresh subprocess (``resource.getrusage(RUSAGE_SELF).ru_maxrss``).

    python -m dsv41_jax.checkpoint.benchmark --dir /tmp/ckbench [--experts 32] [--layers 4] [--keep]
        [--repeat 5] [--methods safetensors,orbax,orbax-tensorstore,orbax-grouped]

The model has the real V4.1-Flash widths (dim 5120, 64 heads x 512, q_lora 1280, o_lora 8x1024,
MoE inter 2304, FP8 32x32 weights, MXFP4 experts) with fewer layers / experts, a 16k vocab and
small Engram tables. "cold" runs evict the files from the page cache first (posix_fadvise
DONTNEED); "warm" runs read from the page cache. Loads: ``safetensors`` (:func:`load_checkpoint`),
``orbax`` (:func:`restore_params`, default method "direct"), ``orbax-tensorstore`` and
``orbax-grouped`` (its "tensorstore" and "orbax" methods). With ``--repeat N`` every load runs N
times, interleaved (so a noisy machine affects all of them alike), and the medians are reported.

On a CPU-only host the loaded parameters themselves live in host memory, so the figure that says
whether the loader streams is ``overhead = peak RSS - RSS before loading - bytes of the loaded
device arrays``; on an accelerator the peak RSS itself is that figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time


def bench_config(layers: int = 4, experts: int = 32, vocab: int = 16384, engram_rows: int = 500_000):
    from ..config import get_preset

    if layers != 4:
        raise ValueError("the benchmark layer pattern is fixed at 4 backbone layers")
    return get_preset("v41-flash").replace(
        name="bench",
        vocab_size=vocab,
        n_layers=4,
        n_mtp_layers=1,
        compress_ratios=(0, 2, 1, 1, 0),
        kv_source_layers=(1, 2),
        index_source_layers=(1, 2, 3),
        candidate_source_layer=2,
        n_routed_experts=experts,
        engram_layer_ids=(1, 3),
        engram_num_embeddings=(engram_rows, engram_rows),
        dspark_target_layer_ids=(1, 2, 3),
        dspark_n_routed_experts=max(8, experts // 4),
        dspark_noise_token_id=vocab - 1,
    )


BENCH_HOST_BUDGET = 128 << 20  # host bytes in flight (the library default is 1 GiB, for real sizes)
METHODS = {"orbax": "direct", "orbax-tensorstore": "tensorstore", "orbax-grouped": "orbax"}
KINDS = ("safetensors", *METHODS)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _curr_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _evict(path: str) -> None:
    for root, _, files in os.walk(path):
        for fn in files:
            fd = os.open(os.path.join(root, fn), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------------------------------------
# subprocess entry points


def _child_write(d: str, layers: int, experts: int) -> dict:
    from .synthetic import random_params
    from .writer import save_checkpoint

    cfg = bench_config(layers, experts)
    t = time.time()
    params = random_params(cfg, seed=0)
    t_gen = time.time() - t
    t = time.time()
    save_checkpoint(params, cfg, os.path.join(d, "official"), max_shard_bytes=1 << 30, overwrite=True)
    return {"gen_s": t_gen, "write_s": time.time() - t}


def _child_convert(d: str) -> dict:
    from ..convert import main

    t = time.time()
    rc = main([os.path.join(d, "official"), os.path.join(d, "orbax"), "--overwrite", "-q"])
    assert rc == 0
    return {"convert_s": time.time() - t, "convert_peak_rss": _maxrss()}


def _child_load(d: str, kind: str, cold: bool) -> dict:
    import jax
    import numpy as np

    from . import load_checkpoint, restore_params

    # backend up, and one small host->device transfer, before the baseline: the XLA GPU client sets
    # up its host staging memory (~4.5 GB RSS on an H200 host, fixed, whatever the transfer size)
    # on the first transfer; that is runtime cost, not loader cost
    jax.block_until_ready(jax.device_put(np.zeros(16 << 20, np.uint8)))
    src = os.path.join(d, "official" if kind == "safetensors" else "orbax")
    if cold:
        _evict(src)
    base_rss = _curr_rss()
    base_peak = _maxrss()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.time()
    budget = BENCH_HOST_BUDGET
    if kind == "safetensors":
        _, params = load_checkpoint(src, host_budget_bytes=budget)
    else:
        params = restore_params(src, host_budget_bytes=budget, method=METHODS[kind])
    leaves = jax.tree.leaves(params)
    dev = [x for x in leaves if isinstance(x, jax.Array)]
    jax.block_until_ready(dev)
    dt = time.time() - t
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    on_device = sum(x.nbytes for x in dev)
    host = sum(x.nbytes for x in leaves if isinstance(x, np.ndarray))
    peak = _maxrss()
    status = {}
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")):
                k, v = ln.split(":")
                status[k] = int(v.split()[0]) * 1024
    return {
        "status_after": status,
        "kind": kind,
        "cold": cold,
        "load_s": dt,
        "cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "rss_before": base_rss,
        "peak_before": base_peak,
        "peak_rss": peak,
        "device_bytes": on_device,
        "host_memmap_bytes": host,
        "overhead": peak - base_rss - (on_device if jax.default_backend() == "cpu" else 0),
    }


def _run_child(args: list[str], a) -> dict:
    env = dict(os.environ)
    common = ["--dir", a.dir, "--layers", str(a.layers), "--experts", str(a.experts)]
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.checkpoint.benchmark", *common, "--child", *args],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"child {args} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _summary(loads: list[dict], ckpt_bytes: int) -> list[dict]:
    """Median time / CPU time and worst overhead per (load, cache state)."""
    import statistics

    out = []
    for kind in dict.fromkeys(r["kind"] for r in loads):
        for cold in (True, False):
            rs = [r for r in loads if r["kind"] == kind and r["cold"] == cold]
            if not rs:
                continue
            t = [r["load_s"] for r in rs]
            out.append({
                "kind": kind, "cache": "cold" if cold else "warm", "n": len(rs),
                "load_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                "rss_before_gb": statistics.median(r["rss_before"] for r in rs) / 1e9,
                "peak_rss_gb": max(r["peak_rss"] for r in rs) / 1e9,
                "overhead_gb": max(r["overhead"] for r in rs) / 1e9,
                "overhead_frac": max(r["overhead"] for r in rs) / ckpt_bytes,
            })
    return out


def _git_commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        r = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True, text=True)
        return r.stdout.strip() or "?"
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/dsv41_ckbench")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    ap.add_argument("--reuse", action="store_true", help="reuse files already in --dir")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the JSON results here")
    ap.add_argument("--repeat", type=int, default=1, help="run every load this many times (interleaved); report medians")
    ap.add_argument("--methods", default="safetensors,orbax", help=f"comma-separated loads among {', '.join(KINDS)}")
    a = ap.parse_args(argv)
    if a.child:
        what = a.child[0]
        if what == "write":
            res = _child_write(a.dir, a.layers, a.experts)
        elif what == "convert":
            res = _child_convert(a.dir)
        else:
            res = _child_load(a.dir, what, a.child[1] == "cold")
        print(json.dumps(res))
        return 0

    import jax, orbax.checkpoint, safetensors, numpy  # noqa: E401  (versions only)

    from ..params import official_shapes

    cfg = bench_config(a.layers, a.experts)
    ck_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in official_shapes(cfg).values())
    res: dict = {
        "config": {"dim": cfg.dim, "layers": cfg.n_layers, "mtp": cfg.n_mtp_layers, "experts": cfg.n_routed_experts,
                   "vocab": cfg.vocab_size, "engram_rows": list(cfg.engram_num_embeddings)},
        "tensor_bytes": ck_bytes,
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__, "numpy": numpy.__version__,
                     "orbax": getattr(orbax.checkpoint, "__version__", "?"), "safetensors": safetensors.__version__},
        "cpus": os.cpu_count(),
        "commit": _git_commit(),
        "budget": BENCH_HOST_BUDGET,
    }
    os.makedirs(a.dir, exist_ok=True)
    try:
        if not (a.reuse and os.path.exists(os.path.join(a.dir, "official"))):
            res["write"] = _run_child(["write"], a)
        res["official_bytes"] = _dir_bytes(os.path.join(a.dir, "official"))
        if not (a.reuse and os.path.exists(os.path.join(a.dir, "orbax"))):
            res["convert"] = _run_child(["convert"], a)
        res["orbax_bytes"] = _dir_bytes(os.path.join(a.dir, "orbax"))
        kinds = [k.strip() for k in a.methods.split(",") if k.strip()]
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise SystemExit(f"unknown --methods {bad}; choose among {KINDS}")
        res["loads"] = []
        for rep in range(a.repeat):
            for kind in kinds:
                for cold in ("cold", "warm"):
                    r = _run_child([kind, cold], a)
                    r["repeat"] = rep
                    r["peak_frac_of_ckpt"] = r["peak_rss"] / res["official_bytes"]
                    r["overhead_frac_of_ckpt"] = r["overhead"] / res["official_bytes"]
                    res["loads"].append(r)
                    print(json.dumps(r), flush=True)
        res["summary"] = _summary(res["loads"], res["official_bytes"])
        for row in res["summary"]:
            print(f"{row['kind']:18s} {row['cache']:4s} median {row['load_s']:6.2f} s (min {row['min_s']:.2f}, max "
                  f"{row['max_s']:.2f}, n={row['n']}), cpu {row['cpu_s']:.2f} s, overhead {row['overhead_gb']:.3f} GB "
                  f"({100 * row['overhead_frac']:.1f} %)", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
