"""The one place that chooses between the pure-jnp references and the Pallas kernels.

Every op's ``api.py`` calls :func:`resolve` with the caller's ``implementation`` argument (usually
``None``). The answer, in order of precedence:

1. an explicit ``implementation=`` argument;
2. the innermost :func:`use_implementation` context;
3. the ``DSV41_KERNELS`` environment variable (one name for every op and/or ``op=name`` entries,
   e.g. ``auto,mhc=reference``: :func:`parse_kernels_env`);
4. ``"auto"``: ``"pallas"`` when JAX's default backend is a GPU, ``"reference"`` otherwise.

:func:`choose` then asks the kernel module whether it can run the call (``unsupported_reason``) and,
under plain ``auto`` only, whether it should (``auto_reason``: a kernel path not yet verified on a
GPU, or measured slower than the XLA reference there, declines; BENCHMARKS.md has the numbers).
An explicit ``implementation=`` argument that cannot be honoured raises the kernel's reason; a
context or environment choice falls back to the reference for calls the kernel cannot run.

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


# the ops that dispatch here, and names for groups of them (DSV41_KERNELS per-op entries)
OPS = ("quantized_matmul", "moe_experts", "hc_mixes", "hc_collapse", "hc_expand", "hc_expand_collapse",
       "hc_expand_collapse_mixes", "sparse_attention", "lightning_indexer", "moe_route", "window_kv_write")
OP_GROUPS = {"mhc": ("hc_mixes", "hc_collapse", "hc_expand", "hc_expand_collapse", "hc_expand_collapse_mixes")}


def parse_kernels_env(text: str) -> tuple[str, dict[str, str]]:
    """``DSV41_KERNELS``: an implementation for every op and/or ``op=implementation`` entries,
    comma-separated, e.g. ``auto,mhc=reference`` (the mHC ops on their XLA references, the rest as
    ``auto``). Returns (default, {op: implementation})."""
    default, per_op = "auto", {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        if "=" not in part:
            default = _check(part)
            continue
        op, impl = (t.strip() for t in part.split("=", 1))
        _check(impl)
        for o in OP_GROUPS.get(op, (op,)):
            if o not in OPS:
                raise ValueError(f"DSV41_KERNELS={text!r}: unknown op {op!r}; expected one of "
                                 f"{', '.join(OPS + tuple(OP_GROUPS))}")
            per_op[o] = impl
    return default, per_op


def default_implementation(op: str | None = None) -> str:
    """The implementation a call without ``implementation=`` gets: the innermost
    :func:`use_implementation`, else ``DSV41_KERNELS`` (its entry for ``op`` if it has one)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    default, per_op = parse_kernels_env(os.environ.get("DSV41_KERNELS", "auto"))
    return per_op.get(op, default)


def resolve(implementation: str | None = None, op: str | None = None) -> str:
    """Return the concrete implementation name ('reference', 'pallas' or 'interpret')."""
    name = _check(implementation) if implementation is not None else default_implementation(op)
    if name == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"
    return name


def choose(op: str, implementation: str | None, load_kernel, unsupported, auto=None):
    """Pick the kernel for one call: returns ``(kernel_module, interpret)`` or ``(None, False)`` for
    the reference. ``load_kernel()`` imports the op's ``pallas_triton`` module; ``unsupported(k)`` and
    ``auto(k)`` return a readable reason or None."""
    impl = resolve(implementation, op)
    if impl == "reference":
        return None, False
    explicit = implementation is not None
    try:
        kernel = load_kernel()
    except ImportError as e:
        if explicit:
            raise ValueError(f"{op}: no Pallas implementation is available ({e})") from None
        return None, False
    reason = unsupported(kernel)
    if reason is None and auto is not None and not explicit and default_implementation(op) == "auto":
        reason = auto(kernel)
    if reason is not None:
        if explicit:
            raise ValueError(f"{op}: Pallas kernel cannot run this shape: {reason}")
        return None, False
    return kernel, impl == "interpret"


def _auto_mesh_axes():
    """(mesh, axes) when traced under a context mesh (``jax.set_mesh``) with automatic (GSPMD) axes
    of size > 1, else (None, ()). (The context mesh and its automatic axes as ``sharding.rules``
    defines them for the model's own sharding constraints.)"""
    from sharding.rules import auto_axes, context_mesh

    m = context_mesh()
    if m is None:
        return None, ()
    sizes = dict(m.shape)  # every axis, not only dp / ep / tp
    axes = tuple(a for a in auto_axes(m) if sizes[a] > 1)
    return (m, axes) if axes else (None, ())


def call_kernel(fn, *args, **static):
    """``fn(*args, **static)``, on whole operands. A ``pallas_call`` is an opaque custom call to
    XLA's SPMD partitioner, which cannot split its work; what it does with operands split over
    devices is not something to rely on. So under a mesh with automatic (GSPMD) axes the kernel
    runs inside a ``shard_map`` over those axes with every operand replicated: XLA gathers the
    operands, each device computes the whole result, and the caller's sharding constraints slice
    it again -- correct by construction, though the op itself is then not split. (Session 3, two
    H200s: a real-width ``tp=2`` run without this wrapper decoded other greedy tokens than one GPU,
    but one GPU's own tokens also changed between processes, so that run shows no fault; see
    BENCHMARKS.md, sharding.) Inside a ``shard_map`` that is already manual over every axis (the
    expert-parallel MoE) the kernel runs as it is. ``static``: non-array keyword arguments."""
    mesh, axes = _auto_mesh_axes()
    if mesh is None:
        return fn(*args, **static)
    from jax.sharding import PartitionSpec as P

    return jax.shard_map(lambda *a: fn(*a, **static), mesh=mesh, in_specs=P(), out_specs=P(),
                         axis_names=frozenset(axes), check_vma=False)(*args)


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
