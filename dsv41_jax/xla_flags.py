"""XLA runtime flags the command-line tools set before JAX starts its backend.

Without CUDA graphs (XLA "command buffers") the GPU runtime launches a decode step's kernels one by
one from the host. By default XLA puts only its own fusions and library calls into graphs, and only
runs of at least a few of them; with the two flags below the whole decode step is one graph (2,511
commands at 40 layers; session 6 logs). The 7-layer probe of V4.1-Flash decoded 2.57 ms per step on
one H200 with them against 2.83 ms without (BENCHMARKS.md, session 5). A graph pays off only if the
buffers it references keep their addresses between launches: see ``Engine._step_pipe``.

The third default is about numerics, not speed: ``--xla_allow_excess_precision=false``. By default
XLA's GPU compiler may skip a bf16 rounding inside a fusion and hand the consumer the producer's
float32 value. DeepSeek's reference rounds at every bf16 tensor boundary, and the FP8 activation
quantizers turn one skipped bf16 rounding into an e4m3 step in about 1 of 30 elements (session 18:
the MoE reference on the H200 was 1.7e-2 from the kernels at decode sizes, reproduced on the CPU by
keeping the f32 intermediates). The quantizers' own inputs are made exact by
``dsv41_jax.quant.exact_f32`` whatever the flag; the flag covers every other bf16 boundary. It costs
nothing measurable: 2.050 against 2.048 ms per 7-layer decode step on the H200 (session 20).

Not a default: ``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` builds each graph as a DAG of
the commands' buffer dependencies, so independent kernels (the q and kv paths, the shared expert
beside the routed experts) may overlap; XLA's default (LHS) keeps its schedule's order. On the
H200 it made the 7-layer decode step 15 % slower (1.928 -> 2.220 ms, same tokens; session 22).

``DSV41_XLA_DEFAULTS=off`` leaves ``XLA_FLAGS`` alone; a flag the user already set in ``XLA_FLAGS``
is never overridden.

``DSV41_AUTOTUNE_RESULTS=PATH`` pins XLA's GEMM autotuning across processes: when PATH does not
exist the run writes its autotuning choices there (``--xla_gpu_dump_autotune_results_to``), and
when it exists the run reads them back (``--xla_gpu_load_autotune_results_from``) instead of timing
the candidates again. Why: XLA picks each GEMM fusion's config by timing it, so two processes of
the same commit can compile different summation orders and decode different greedy tokens. On the
H200 (session 26, 7-layer probe, same commit): two default processes gave two digests,
two processes with ``--xla_gpu_autotune_level=0`` one digest, 16 % slower. With the compilation
cache on, a re-run loads the same executables anyway; this is for comparing runs with the cache
off (the benchmark protocol) or across commits.

``DSV41_DECODE_XLA_OPTIONS`` (``name=value`` pairs, comma-separated, e.g.
``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``) are compile options for the engine's
decode-step programs only (one token per row): :func:`decode_compiler_options`. A flag tried for
decode then leaves the prefill programs (whose temporaries are large) as they are.
"""

from __future__ import annotations

import os

# flag name -> value; GPU options that the CPU backend parses (and, but for the last, ignores)
GPU_RUNTIME_DEFAULTS = {
    # allow custom calls (where XLA can capture them) in command buffers beside fusions and library calls
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
    # capture a run of commands however short (the default leaves short runs between kernels to
    # per-kernel launches)
    "xla_gpu_graph_min_graph_size": "1",
    # round at every bf16 boundary as the reference does (see the module docstring)
    "xla_allow_excess_precision": "false",
}


def with_runtime_defaults(xla_flags: str, defaults: dict[str, str] = GPU_RUNTIME_DEFAULTS) -> str:
    """``xla_flags`` plus every default flag it does not already set (by name, any value)."""
    given = {tok.lstrip("-").split("=", 1)[0] for tok in xla_flags.split()}
    extra = [f"--{k}={v}" for k, v in defaults.items() if k not in given]
    return " ".join([xla_flags.strip()] + extra).strip()


def apply_runtime_defaults() -> str:
    """Set ``os.environ['XLA_FLAGS']`` to :func:`with_runtime_defaults` of itself (unless
    ``DSV41_XLA_DEFAULTS=off``) and return it. Takes effect only if called before JAX starts a
    backend."""
    cur = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("DSV41_XLA_DEFAULTS", "").lower() == "off":
        return cur
    os.environ["XLA_FLAGS"] = with_runtime_defaults(cur, {**GPU_RUNTIME_DEFAULTS, **autotune_results_flags()})
    return os.environ["XLA_FLAGS"]


def autotune_results_flags(path: str | None = None) -> dict[str, str]:
    """The flag that ``DSV41_AUTOTUNE_RESULTS`` (or ``path``) asks for: read the autotuning results
    from the file when it exists, else write them there (module docstring). A directory, or a file
    in a missing directory, is refused with the variable's name."""
    path = os.environ.get("DSV41_AUTOTUNE_RESULTS", "") if path is None else path
    if not path:
        return {}
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise ValueError(f"DSV41_AUTOTUNE_RESULTS={path!r} is a directory; give a file path (e.g. {path}/autotune.txt)")
    if os.path.exists(path):
        return {"xla_gpu_load_autotune_results_from": path}
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"DSV41_AUTOTUNE_RESULTS={path!r}: directory {os.path.dirname(path)!r} does not exist")
    return {"xla_gpu_dump_autotune_results_to": path}


def decode_compiler_options(text: str | None = None) -> dict[str, str]:
    """``DSV41_DECODE_XLA_OPTIONS`` (or ``text``) as a dict for ``jax.jit(compiler_options=...)``:
    comma-separated ``name=value`` pairs of XLA debug options (names without the leading ``--``).
    A malformed entry raises a ValueError naming the variable; an unknown name or value is refused
    by XLA when the program compiles."""
    text = os.environ.get("DSV41_DECODE_XLA_OPTIONS", "") if text is None else text
    out = {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip().lstrip("-")
        if not eq or not name.startswith("xla_") or not value.strip():
            raise ValueError(f"DSV41_DECODE_XLA_OPTIONS: {part!r} is not name=value with an XLA option name "
                             "(e.g. xla_gpu_command_buffer_scheduling_mode=CONCURRENT)")
        out[name] = value.strip()
    return out
