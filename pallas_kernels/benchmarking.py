"""The timing and input helpers every ``pallas_kernels/<op>/benchmark.py`` uses (H200 protocol,
BENCHMARKS.md): two ways of timing an op inside one jitted program, the L2 flush, error measures,
random quantized weights at real shapes, and the shared command-line flags.

* :func:`time_op` - the two-point method: programs applying the op r1 and r2 times to distinct
  argument sets (distinct weight buffers), L2 flushed before each timed call; per-op =
  (t(r2) - t(r1)) / (r2 - r1). For weight-streaming ops (GEMV, MoE, mHC).
* :func:`timed` - a chain of n dependent calls (a zero-valued perturbation of a small input links
  them, so nothing is hoisted or merged) minus an empty program over the same arguments, / n. For
  ops whose inputs are small next to what they read (attention, indexer).
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet peak, performance.md §4
BF16_DENSE_FLOPS = 989e12  # H200 / H100 SXM dense bf16 tensor-core peak, performance.md §4
L2_BYTES = 60e6


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


_FLUSH = {}


def flush_l2():
    """Stream 256 MB through the GPU (4x the L2) so the next call starts with a cold cache."""
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = jnp.zeros((64 * 1024 * 1024,), jnp.float32)
        _FLUSH["fn"] = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(_FLUSH["fn"](_FLUSH["buf"]))


def time_op(fn, per_rep_args, shared_args=(), *, reps=(3, 9), iters=5):
    """Seconds per op by the two-point method: programs applying ``fn`` r1 and r2 times (to distinct
    argument sets, which should use distinct weight buffers), L2 flushed before every timed call,
    median of ``iters`` calls each; per-op = (t(r2) - t(r1)) / (r2 - r1), which removes the fixed
    dispatch + sync cost of a call (~70 us) exactly. Returns (per_op_s, raw_s = t(r2) / r2)."""
    r1, r2 = reps
    assert len(per_rep_args) >= r2, (len(per_rep_args), r2)

    def measure(r):
        args = per_rep_args[:r]
        prog = jax.jit(lambda reps_args, shared: [fn(*a, *shared) for a in reps_args])
        for _ in range(2):
            jax.block_until_ready(prog(args, shared_args))
        ts = []
        for _ in range(iters):
            flush_l2()
            t0 = time.perf_counter()
            jax.block_until_ready(prog(args, shared_args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    t1 = measure(r1)
    t2 = measure(r2)
    return max((t2 - t1) / (r2 - r1), 1e-9), t2 / r2


def device_time_op(fn, per_rep_args, shared_args=(), *, reps=5, iters=5, outdir=None, kernels=None):
    """Seconds of device time per op: one program applies ``fn`` to ``reps`` argument sets (distinct
    weights, as for :func:`time_op`), runs ``iters`` times under ``jax.profiler`` with the L2 flushed
    before each run, and the program's kernel time (the profiler's sum over its kernels) is divided
    by ``iters * reps``. Launch gaps and dispatch are left out, so this is the figure to compare
    kernel variants by: :func:`time_op`'s difference of two wall-clock programs was within their
    noise for ops of tens of microseconds on the H200 (session 4: per-op times under the byte floor,
    zero or negative differences).
    ``kernels``: a list that receives (kernel name, seconds per op) for each kernel of the program,
    slowest first (which of an op's launches the time goes to)."""
    import tempfile

    from dsv41_jax.profiling import summarize, trace

    args = per_rep_args[:reps]
    assert len(args) == reps, (len(per_rep_args), reps)

    def _device_timed_reps(reps_args, shared):
        return [fn(*a, *shared) for a in reps_args]

    prog = jax.jit(_device_timed_reps)
    for _ in range(2):
        jax.block_until_ready(prog(args, shared_args))

    def body():
        for _ in range(iters):
            flush_l2()
            jax.block_until_ready(prog(args, shared_args))

    _, path = trace(body, outdir or tempfile.mkdtemp(prefix="dsv41_devtime_"))
    progs = [p for p in summarize(path)["programs"] if "_device_timed_reps" in p["module"]]
    if not progs:
        raise RuntimeError("device_time_op: the profile holds no execution of the timed program")
    # busy_ms x executions is the kernel time over the whole trace however the profile counted the
    # executions (GPU traces carry no execution ids, so there it is 1 execution of iters' worth);
    # the trace holds exactly ``iters`` runs of ``reps`` ops (session 6: dividing by the counted
    # executions instead reported 5x the per-op time on the H200)
    if kernels is not None:
        per = collections.Counter()
        for p in progs:
            for k in p["kernels"]:
                per[k["kernel"].split(": ", 1)[-1]] += k["ms"] * p["executions"] / 1e3 / (iters * reps)
        kernels.extend(per.most_common())
    return sum(p["busy_ms"] * p["executions"] for p in progs) / 1e3 / (iters * reps)


def time_variants(row: dict, variants, per_rep_args, shared_args=()) -> dict:
    """For each (name, fn) of ``variants``: ``row[name + "_us"]`` (:func:`device_time_op`, µs per op)
    and ``row[name + "_kernels"]`` (how many kernels the op launched). Returns ``row``."""
    for name, fn in variants:
        kernels = []
        row[f"{name}_us"] = device_time_op(fn, per_rep_args, shared_args, kernels=kernels) * 1e6
        row[f"{name}_kernels"] = len(kernels)
    return row


def write_rows(out_dir: str | None, filename: str, rows: list, **extra) -> str | None:
    """Write ``{"device", "jax", "rows", **extra}`` as JSON to ``out_dir/filename`` (created if
    needed); every benchmark script's result file. Returns the path, or None when ``out_dir`` is
    empty (nothing written)."""
    if not out_dir:
        return None
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows, **extra), f, indent=1)
    return path


def max_rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# The random weights are one jitted program per shape: drawn eagerly, each draw, cast and bitcast
# compiled on its own (most of an interpret-mode CPU test's time); the same values either way.
@functools.partial(jax.jit, static_argnames=("n", "k", "block", "lead"))
def random_fp8(key, n, k, block=32, lead=()):
    """Random e4m3 data with random e8m0 scales per ``block`` x ``block`` (32: V4.1, 128: V4)."""
    k1, k2 = jax.random.split(key)
    data = (jax.random.normal(k1, (*lead, n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    s = jax.random.randint(k2, (*lead, -(-n // block), -(-k // block)), 112, 120).astype(jnp.uint8)
    return Fp8Tensor(data=data, scale=jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), block=(block, block))


@functools.partial(jax.jit, static_argnames=("shape",))
def random_fp4(key, shape):
    *lead, n, k = shape
    k1, k2 = jax.random.split(key)
    data = jax.random.randint(k1, (*lead, n, k // 2), 0, 256).astype(jnp.uint8)
    s = jax.random.randint(k2, (*lead, n, k // 32), 118, 124).astype(jnp.uint8)
    return Fp4Tensor(data=data, scale=jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), block=32)


def fmt_us(t):
    return f"{t * 1e6:9.1f}"




def timed(make_fn, args, *, n=20, reps=7):
    """Per-call device time (s) of an op run ``n`` times back to back in one jitted program.

    ``make_fn(args, c)`` runs the op once with the zero scalar ``c`` folded into a small input and
    returns (output, next c), so the calls form a chain that XLA can neither hoist nor merge. The
    median time of an empty jitted program over the same arguments (the dispatch cost) is subtracted
    from the median time of the n-call program, and the rest divided by n."""
    def f(*a):
        c = jnp.float32(0.0)
        for _ in range(n):
            _, c = make_fn(a, c)
        return c

    def empty(*a):
        return zero_of(jax.tree_util.tree_leaves(a)[-1])

    pn, p0 = jax.jit(f), jax.jit(empty)
    for p in (p0, pn):
        jax.block_until_ready(p(*args))  # compile + warm up
        jax.block_until_ready(p(*args))

    def med(p):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(p(*args))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t0, tn = med(p0), med(pn)
    # n calls no slower than the empty program: the op is below this harness's noise (host timing of
    # two dispatches); NaN rather than a zero that would read as a measurement
    return ((tn - t0) / n if tn > t0 else float("nan")), tn, t0


def zero_of(x):
    return x.reshape(-1)[0].astype(jnp.float32) * 0.0




def read_anchor(nbytes: int, *, n=20, reps=7) -> float:
    """Per-call seconds, in the ``timed`` harness, of one XLA reduction reading ``nbytes`` of
    contiguous bf16 once (the chain's zero scalar scales the input, so the calls stay distinct):
    what "read the op's bytes once" costs in this harness, launch and tail included. Beside a byte
    floor it shows how much of an op's gap is the floor's arithmetic and how much a single kernel's
    fixed cost (a microsecond or more, against sub-microsecond floors at small batch)."""
    x = jnp.ones((max(nbytes // 2, 1),), jnp.bfloat16)

    def f(a, c):
        o = jnp.sum(a[0].astype(jnp.float32) * (1.0 + c))
        return o, zero_of(o)

    return timed(f, (x,), n=n, reps=reps)[0]


def chained_args(ap, *, n: int, reps: int, skip_xla_help: str):
    """The flags of the chained-call benchmarks (attention, indexer)."""
    import os

    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--sweep", action="store_true", help="also time a few block configurations")
    ap.add_argument("--skip-xla", action="store_true", help=skip_xla_help)
    return ap
