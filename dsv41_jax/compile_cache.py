"""JAX's persistent compilation cache, shared by the CLI, the benchmarks and the tests.

Compiling the model is the slowest part of a short run (tens of seconds on a CPU for the tiny
preset); the cache makes every later run start in seconds. Location: ``$DSV41_COMPILE_CACHE``, else
``~/.cache/dsv41_jax/jax``; set ``DSV41_COMPILE_CACHE=off`` to disable.
"""

from __future__ import annotations

import os

import jax


def enable_compilation_cache(path: str | None = None) -> str | None:
    path = path or os.environ.get("DSV41_COMPILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dsv41_jax", "jax")
    if path == "off":
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
