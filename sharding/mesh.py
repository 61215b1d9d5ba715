"""Device meshes from a short spec: ``make_mesh("dp=1,tp=2,ep=2")``.

Axes (all three always exist; an axis left out of the spec has size 1):

* ``dp`` – data parallel: the batch (sequences and their caches) is split over it;
* ``ep`` – expert parallel: the routed experts of every MoE layer are split over it;
* ``tp`` – tensor parallel: attention heads / projections, the vocabulary (embedding and head),
  the shared expert's and the routed experts' hidden dimension are split over it.

The mesh is laid out ``(dp, ep, tp)`` with ``tp`` innermost, so tensor-parallel peers are
neighbouring devices (same host, fastest links) and ``dp`` spans hosts first in a multi-host run
(``jax.devices()`` lists devices process by process). One axis may be ``-1`` (or ``*``): it takes
all devices the others leave. The product may be smaller than the device count (the first devices
are used); it may not be larger. Axis types are ``Auto`` (GSPMD propagation), whatever
``jax.make_mesh``'s default is in the installed JAX.
"""

from __future__ import annotations

import math
import warnings
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("dp", "ep", "tp")
_ALIASES = {"data": "dp", "expert": "ep", "tensor": "tp", "model": "tp"}


class MeshSpecError(ValueError):
    """A mesh spec that cannot be parsed or does not fit the devices."""


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"dp=1,tp=2,ep=2"`` (or a dict) -> ``{"dp": 1, "ep": 2, "tp": 2}`` (sizes; -1 = fill).

    Separators ``,`` or whitespace; ``x`` between sizes is not accepted (name every axis)."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return {a: 1 for a in AXES}
    items: list[tuple[str, str]] = []
    if isinstance(spec, Mapping):
        items = [(str(k), str(v)) for k, v in spec.items()]
    else:
        for part in str(spec).replace(";", ",").replace(" ", ",").split(","):
            if not part:
                continue
            if "=" not in part:
                raise MeshSpecError(f"mesh spec {spec!r}: {part!r} is not AXIS=SIZE (expected e.g. 'dp=1,tp=2,ep=2')")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    out: dict[str, int] = {}
    for k, v in items:
        name = _ALIASES.get(k.lower(), k.lower())
        if name not in AXES:
            raise MeshSpecError(f"mesh spec {spec!r}: unknown axis {k!r}; axes are {', '.join(AXES)}")
        if name in out:
            raise MeshSpecError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if v in ("*", "-1", "auto"):
            size = -1
        else:
            try:
                size = int(v)
            except ValueError:
                raise MeshSpecError(f"mesh spec {spec!r}: size of {name!r} must be an integer, got {v!r}") from None
            if size < 1:
                raise MeshSpecError(f"mesh spec {spec!r}: size of {name!r} must be >= 1 (or -1 to fill), got {size}")
        out[name] = size
    if sum(1 for s in out.values() if s == -1) > 1:
        raise MeshSpecError(f"mesh spec {spec!r}: at most one axis may be -1")
    return {a: out.get(a, 1) for a in AXES}


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A ``jax.sharding.Mesh`` with axes ``("dp", "ep", "tp")`` from a spec like ``"dp=1,tp=2,ep=2"``.

    ``devices``: default ``jax.devices()`` (all processes' devices in a multi-host run). Raises
    :class:`MeshSpecError` with the device count when the spec asks for more devices than exist
    or the fill axis does not divide them."""
    sizes = parse_mesh_spec(spec)
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    fixed = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    if fill:
        if n % fixed:
            raise MeshSpecError(f"mesh spec {spec!r}: {n} devices are not divisible by the fixed axes' product {fixed}")
        sizes[fill[0]] = n // fixed
    total = math.prod(sizes.values())
    if total > n:
        raise MeshSpecError(
            f"mesh spec {spec!r} needs {total} devices (dp={sizes['dp']} x ep={sizes['ep']} x tp={sizes['tp']}) "
            f"but only {n} are visible ({devs[0].platform if devs else 'none'}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={total} before importing jax")
    if total < n and jax.process_count() > 1:
        raise MeshSpecError(f"mesh spec {spec!r} uses {total} of {n} devices; a multi-host mesh must use them all")
    if jax.process_count() > 1:
        local = jax.local_device_count()
        inner = sizes["tp"] * sizes["ep"]
        if local % inner and inner % local:
            warnings.warn(f"mesh {sizes}: ep x tp = {inner} does not align with {local} devices per host; "
                          "expert/tensor collectives will cross hosts unevenly", stacklevel=2)
    arr = np.array(devs[:total], dtype=object).reshape(tuple(sizes[a] for a in AXES))
    try:
        from jax.sharding import AxisType

        return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    except (ImportError, TypeError):  # older JAX: Auto is the only kind
        return Mesh(arr, AXES)


def mesh_sizes(mesh) -> dict[str, int]:
    """``{"dp":.., "ep":.., "tp":..}`` of a mesh (an axis it lacks counts as 1). Works for Mesh and
    AbstractMesh."""
    shape = dict(mesh.shape) if mesh is not None else {}
    return {a: int(shape.get(a, 1)) for a in AXES}


def describe(mesh) -> str:
    s = mesh_sizes(mesh)
    return f"dp={s['dp']},ep={s['ep']},tp={s['tp']} ({math.prod(s.values())} devices)"
