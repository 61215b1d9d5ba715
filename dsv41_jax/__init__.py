"""DeepSeek-V4.1-Flash in JAX: config, formats, model, caches, engine, checkpoints.

The top-level names are imported lazily, so that leaf modules (``dsv41_jax.quant``, used by the
kernels in ``pallas_kernels``) can be imported without pulling in the whole model.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Model": ("dsv41_jax.model", "Model"),
    "ModelConfig": ("dsv41_jax.config", "ModelConfig"),
    "RunOptions": ("dsv41_jax.options", "RunOptions"),
    "get_preset": ("dsv41_jax.config", "get_preset"),
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'dsv41_jax' has no attribute {name!r}")
