"""Shared test setup: CPU only, the persistent compilation cache (so the same program compiled
by several tests or xdist workers is compiled once).

XLA's CPU backend runs at ``--xla_backend_optimization_level=0`` in this process (and the xdist
workers and single-device subprocesses that inherit its XLA_FLAGS): the suite is compile-bound (an
interpret-mode kernel config: 0.1 s to trace, 0.4 s to lower, 0.7 s to compile, ~0 s to run), and
LLVM's optimisations are most of the compile (session 41: test_deferred_sums_model +
test_mhc_fused_collapse 219 -> 142 CPU-seconds). The multi-device subprocesses
(``multi_device.env``) keep the default level: at -O0 the 8-device engine worker of
``test_sharding.py`` hung in a cross-device all-reduce (session 10: over 15 min, against 3 min).
Session 10 also saw the float32 chunked-vs-full comparison of ``test_v4_tiny_formats.py`` move by
0.069 at one logit row at -O0 (an activation rounding flip); it passes at -O0 since. ``XLA_FLAGS``
naming a level keeps it."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
CPU = os.environ["JAX_PLATFORMS"] == "cpu"


def _default_xla_flag(flag: str):
    """Append ``--name=value`` to XLA_FLAGS unless they already name ``name``."""
    name = flag.split("=")[0]
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{flag}").strip()


# One thread per XLA CPU computation (inherited by the subprocess checks through XLA_FLAGS): with two
# xdist workers and the sharding jobs on a 2-core host, Eigen's thread pools only oversubscribed the
# cores. Session 13: the dp x tp x ep quant job alone 78.5 -> 65.4 s wall (cold cache); the whole suite
# from a fresh clone 56.6 and 59.8 CPU-minutes with it against 58.5 without: within the run-to-run spread.
_default_xla_flag("xla_cpu_multi_thread_eigen=false")
if CPU:  # -O0: see the module docstring
    _default_xla_flag("xla_backend_optimization_level=0")
else:
    # On a GPU (JAX_PLATFORMS=cuda,cpu) the references round at every bf16 boundary as the CLIs make
    # XLA do (dsv41_jax/xla_flags.py; session 18: excess precision moved the MoE reference 1.7e-2 away
    # from the kernels). CPU runs are left as they are.
    _default_xla_flag("xla_allow_excess_precision=false")

from dsv41_jax.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get("DSV41_COMPILE_CACHE") or os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
# Persist every compiled program, not only those over the CLI's 0.5 s threshold: most interpret-mode
# kernels, references and jitted input builders compile in 0.1-0.5 s, and the same program recurs across
# tests and the two xdist workers (the per-module fixtures of test_moe / test_quantized_matmul* /
# test_benchmark_scripts did this for their modules first). The subprocess jobs (sharding_worker,
# the CLI tests) keep the 0.5 s of enable_compilation_cache.
import jax  # noqa: E402

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


import compile_log  # noqa: E402  (tests/ is on sys.path: rootdir conftest)

if compile_log.install():
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        compile_log.current["test"] = item.nodeid
        compile_log.test_bounds(item.nodeid, "start")
        yield
        compile_log.test_bounds(item.nodeid, "end")


def pytest_collection_finish(session):
    """Start test_sharding.py's multi-device subprocesses right after collection (only when one of
    its worker_results tests is selected), so they run beside the whole suite instead of from the
    point where xdist reaches that module (they then held the suite's last minutes)."""
    if session.config.option.collectonly or session.config.option.setupplan:
        return
    for item in session.items:
        if "worker_results" in getattr(item, "fixturenames", ()):
            item.module.start_jobs()
            return


def pytest_sessionfinish(session, exitstatus):
    """The process that started the multi-device jobs waits for them (ends them if interrupted)."""
    import sys

    mod = next((m for name, m in list(sys.modules.items()) if name.endswith("test_sharding") and
                hasattr(m, "finish_jobs")), None)
    if mod is not None:
        mod.finish_jobs(interrupted=exitstatus in (2, 3, 4) or bool(session.shouldstop or session.shouldfail))
