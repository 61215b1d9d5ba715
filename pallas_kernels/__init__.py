"""Pallas kernels for the hot paths of DeepSeek-V4.1-Flash.

One package per op. Each package has ``reference.py`` (pure ``jnp``, the numerical definition),
``pallas_triton.py`` (the portable Pallas kernel, Triton lowering, runs on NVIDIA and AMD) and
``api.py`` (the one function the model calls; it picks the implementation through
:mod:`pallas_kernels.dispatch`).
"""
