"""Shared test setup: CPU only, LLVM at -O0, the persistent compilation cache (so the same program
compiled by several tests or xdist workers is compiled once)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests' programs are tiny, so on the CPU they are compile-bound: XLA's LLVM backend at -O0 takes
# about a third less CPU time per test (session 10: 34 -> 25 s, 73 -> 48 s and 50 -> 34 s of user
# time in three of the slowest tests). Numerics stay IEEE (no fast-math at any level). Subprocesses
# (multi-device workers, notebook kernels, the CLI) inherit it; an explicit level in XLA_FLAGS wins.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

from dsv41_jax.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get("DSV41_COMPILE_CACHE") or os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
