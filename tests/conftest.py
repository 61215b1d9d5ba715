"""Shared test setup: CPU only, the persistent compilation cache (so the same program compiled
by several tests or xdist workers is compiled once)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dsv41_jax.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get("DSV41_COMPILE_CACHE") or os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
