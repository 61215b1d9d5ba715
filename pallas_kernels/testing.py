"""Test utilities shared by every kernel package.

``lower_for(target, fn, *specs)`` runs the full Pallas -> Triton-IR lowering on a CPU-only host for
one GPU target (``"cuda"`` = an NVIDIA H200, ``"rocm"`` = an AMD MI350X, gfx950), under an abstract
mesh whose abstract device names that GPU (see ``shared/spec/pallas_triton.md`` §5, method A). No
device memory is touched; the inputs are ``jax.ShapeDtypeStruct``s. It raises what the backend's
lowering raises (non-power-of-two blocks, scalar prefetch, fnuz casts, ...), which interpret mode
would silently accept. This is the MI350X portability gate: no AMD GPU is lent to us.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType

# AbstractDevice lives in a private module; keep that dependency in this one place.
from jax._src.mesh import AbstractDevice, AbstractMesh  # noqa: PLC2701

TARGETS = {
    "cuda": ("NVIDIA H200", "cuda"),
    "rocm": ("gfx950", "rocm"),
}


def abstract_mesh(target: str) -> AbstractMesh:
    kind, platform = TARGETS[target]
    device = AbstractDevice(kind, 1, platform)
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)


def lower_for(target: str, fn, *specs):
    """Lower ``jax.jit(fn)`` on ShapeDtypeStruct ``specs`` for ``target`` ('cuda' or 'rocm').

    Returns the ``Lowered`` object; its ``as_text()`` holds the Triton custom call.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {sorted(TARGETS)}")
    with jax.sharding.use_abstract_mesh(abstract_mesh(target)):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=(target,))
