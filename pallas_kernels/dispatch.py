"""The one place that chooses between the pure-jnp references and the Pallas kernels.

Every op's ``api.py`` calls :func:`resolve` with the caller's ``implementation`` argument (usually
``None``). The answer, in order of precedence:

1. an explicit ``implementation=`` argument;
2. the innermost :func:`use_implementation` context;
3. the ``DSV41_KERNELS`` environment variable;
4. ``"auto"``: ``"pallas"`` when JAX's default backend is a GPU and the op's kernel is enabled for
   auto-selection (``auto_pallas``: an op whose kernel measures slower than the XLA reference on
   the H200 keeps the reference until it is faster; BENCHMARKS.md has the numbers), else
   ``"reference"``.

Names:
* ``"reference"`` – the pure-jnp definition (runs anywhere, the numerical ground truth);
* ``"pallas"``    – the Pallas-Triton kernel (GPU: CUDA or ROCm);
* ``"interpret"`` – the same Pallas kernel in ``interpret=True`` mode (CPU tests).
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax

IMPLEMENTATIONS = ("reference", "pallas", "interpret")
_ALL = IMPLEMENTATIONS + ("auto",)
_local = threading.local()


def _check(name: str) -> str:
    if name not in _ALL:
        raise ValueError(
            f"unknown kernel implementation {name!r}; expected one of {', '.join(_ALL)} "
            "(set by implementation=, use_implementation() or DSV41_KERNELS)"
        )
    return name


def default_implementation() -> str:
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return _check(os.environ.get("DSV41_KERNELS", "auto"))


def resolve(implementation: str | None = None, *, auto_pallas: bool = True) -> str:
    """Return the concrete implementation name ('reference', 'pallas' or 'interpret')."""
    name = _check(implementation) if implementation is not None else default_implementation()
    if name == "auto":
        gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
        return "pallas" if gpu and auto_pallas else "reference"
    return name


@contextlib.contextmanager
def use_implementation(name: str):
    """Run a block (and everything traced inside it) with one implementation for every op."""
    _check(name)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()
