"""Tensor parallelism for the Pallas linear layers, with ``jax.shard_map`` and one XLA collective.

XLA's SPMD partitioner splits an XLA dot over ``tp`` by itself, but a Pallas kernel is an opaque
custom call: left to GSPMD it would run on gathered operands (``pallas_kernels.dispatch.call_kernel``
does exactly that, to stay correct). For the projections that :mod:`sharding.rules` splits over
``tp`` this module runs the kernel on each device's shard instead:

* column-parallel (the rule splits the weight's output dim N: ``attn.wq_b``, the indexer's
  ``wq_b`` / ``weights_proj``, the shared expert's ``w1`` / ``w3``): x whole, each device computes
  its N columns; the output stays split over ``tp`` (no communication);
* row-parallel (the rule splits the input dim K: ``attn.wo_b``, the shared expert's ``w2``): x split
  over K like the weight, each device's fp32 partial product, one ``psum`` over ``tp``, then the
  output dtype. The FP8 activation fake-quant works per ``act_block`` columns, and the rules split
  K in whole blocks, so every shard quantizes exactly the columns one device would.

The weight's spec comes from the same rule table as its placement (``rule_for`` / ``node_specs``),
so the shard_map never moves weights. Only used where the Pallas kernel runs
(``quantized_matmul.uses_kernel``); the XLA reference is left to GSPMD as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .mesh import mesh_sizes
from .rules import PARAM_RULES, auto_axes, context_mesh, node_specs, rule_for


def _tp_dim(spec, nd: int) -> int | None:
    """The one dim a weight spec splits, if it splits exactly one and only over ``tp``."""
    entries = tuple(spec) + (None,) * (nd - len(tuple(spec)))
    split = [(d, e) for d, e in enumerate(entries) if e is not None]
    if len(split) != 1 or split[0][1] not in ("tp", ("tp",)):
        return None
    return split[0][0]


def tp_active() -> bool:
    """Whether the context mesh has an automatic ``tp`` axis of size > 1 (then :func:`tp_linear` may
    split a linear layer's kernel over it)."""
    m = context_mesh()
    return m is not None and "tp" in auto_axes(m) and mesh_sizes(m)["tp"] > 1


def tp_linear(x, w, *, path: str, act_block: int = 32, out_dtype=None, implementation=None):
    """``quantized_matmul(x, w)`` with the Pallas kernel on each ``tp`` shard of ``w`` (see the
    module docstring), or None when that does not apply (no context mesh with an automatic ``tp``
    axis of size > 1, the rule does not split ``w`` over tp alone, or the reference would run):
    the caller then calls ``quantized_matmul`` as usual. ``path``: the weight's name in the rule
    table (e.g. ``"attn.wq_b"``)."""
    from pallas_kernels.quantized_matmul import quantized_matmul, uses_kernel

    if not tp_active():
        return None
    m = context_mesh()
    if not uses_kernel(x, w, act_block=act_block, implementation=implementation):
        return None
    quantized = hasattr(w, "data")
    nd = len(w.data.shape) if quantized else len(w.shape)
    if nd != 2:
        return None
    axes, units = rule_for(path, nd, PARAM_RULES, {"fp8_block_size": act_block})
    spec = node_specs(w, axes, mesh_sizes(m), path, units)
    d = _tp_dim(spec.data if quantized else spec, nd)
    if d is None:
        return None
    # manual over every automatic axis at once (a kernel inside must not open a second shard_map: XLA
    # wants nested manual axes in mesh order); rows stay split over dp when dp is automatic here
    auto = auto_axes(m)
    sizes = mesh_sizes(m)
    row = "dp" if "dp" in auto and sizes["dp"] > 1 and x.ndim >= 2 and x.shape[0] % sizes["dp"] == 0 else None
    lead = (row,) + (None,) * (x.ndim - 2) if x.ndim >= 2 else ()
    out_dtype = out_dtype or x.dtype
    if d == 0:  # column-parallel
        def body(xs, ws):
            return quantized_matmul(xs, ws, act_block=act_block, out_dtype=out_dtype, implementation=implementation)

        in_specs, out_specs = (P(*lead), spec), P(*lead, "tp")
    else:  # row-parallel
        def body(xs, ws):
            y = quantized_matmul(xs, ws, act_block=act_block, out_dtype=jnp.float32, implementation=implementation)
            return jax.lax.psum(y, "tp").astype(out_dtype)

        in_specs, out_specs = (P(*lead, "tp"), spec), P(*lead)
    return jax.shard_map(body, mesh=m, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(auto),
                         check_vma=False)(x, w)
