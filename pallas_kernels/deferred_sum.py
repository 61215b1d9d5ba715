"""A layer output handed on before its last sum, so that the kernel that reads it next can do the sum.

At batch-1 decode the split-K GEMV writes its K parts in float32 and XLA then sums them and rounds
to bf16 in one small kernel (about 1.2 us on the H200); the fused MoE leaves its per-slot rows for
XLA to sum, add to the shared expert and round (1.5 us). Where the next op is the mHC expansion
kernel (:func:`pallas_kernels.mhc.hc_expand_collapse_mixes`), that kernel reads the parts instead
and does the sum on its own columns, so those XLA kernels go away.

:class:`DeferredSum` holds the pieces; :meth:`DeferredSum.value` is the value, computed with the
same XLA ops the producers run when they do not defer (so a consumer that cannot take the pieces,
and every reference path, sees the same numbers as before). The value is

* ``parts`` only: ``dtype(sum_p parts[p])``, the parts added in order (:func:`sum_splits`, as every
  kernel that sums them does) -- a split-K GEMV's output;
* ``expert_rows`` only: ``sum_s rows[t*k + s]`` over the slots s with ``expert_index[t, s] >= 0``, in
  float32 (``dtype`` float32) -- the routed experts' output. The rows may themselves come unsummed,
  as a split-K down kernel's fp32 sums ``[S, R, D]``: then each row is ``rows_dtype(sum_j rows[j])``
  (the splits in order, :func:`sum_splits`) before the slot sum;
* both: ``dtype(routed + float32(dtype(sum_p parts[p])))`` -- the MoE's output (routed experts plus
  the shared expert's w2 GEMV).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeferredSum:
    parts: jax.Array | None  # [P, T, D] float32: the K parts of a GEMV's T output rows
    expert_rows: jax.Array | None  # [R >= T*k, D]: row t*k + s is token t's slot s (the fused MoE's y)
    expert_index: jax.Array | None  # [T, k] int32: the slot's expert, < 0 = no expert (row not written)
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))  # the value's shape (..., D), prod(...) = T
    # with expert_rows [S, R, D] (a split-K down kernel's fp32 sums): the dtype each row's in-order
    # sum over S is rounded to (the unsplit kernel's output dtype); None for [R, D] rows
    rows_dtype: np.dtype | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if self.parts is None and self.expert_rows is None:
            raise ValueError("DeferredSum: give the GEMV's parts, the experts' rows, or both")
        if (self.expert_rows is None) != (self.expert_index is None):
            raise ValueError("DeferredSum: expert_rows and expert_index go together")
        if self.expert_rows is not None and (self.expert_rows.ndim == 3) != (self.rows_dtype is not None):
            raise ValueError("DeferredSum: split expert rows [S, R, D] need rows_dtype (and 2-D rows none), got "
                             f"rows of shape {tuple(self.expert_rows.shape)} with rows_dtype {self.rows_dtype}")

    @property
    def row_splits(self) -> int:
        """S for split expert rows [S, R, D], else 0."""
        return int(self.expert_rows.shape[0]) if self.expert_rows is not None and self.expert_rows.ndim == 3 else 0

    def expert_row_values(self) -> jax.Array:
        """The experts' slot rows [R, D]: as given, or the split rows summed in order and rounded."""
        if self.row_splits:
            return sum_splits(self.expert_rows).astype(self.rows_dtype)
        return self.expert_rows

    @property
    def rows(self) -> int:
        """T: the number of output rows (the product of the leading dims)."""
        return math.prod(self.shape[:-1])

    def value(self) -> jax.Array:
        """The value, by the producers' own XLA ops (see the module docstring)."""
        y = None
        if self.parts is not None:
            y = sum_splits(self.parts)  # in order, as the kernels that take the parts add them
            y = y.astype(self.dtype)
        if self.expert_rows is not None:
            routed = slot_sum(self.expert_row_values(), self.expert_index)
            y = routed if y is None else _routed_plus_shared(routed, y, self.dtype)
        return y.reshape(self.shape)


def sum_splits(parts):
    """A split-K kernel's partial sums (a sequence, or an array's leading axis) added in split order
    (s = 0 first): one definition for the XLA sums and the kernels that sum splits themselves."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def slot_sum(rows, index):
    """sum over slots of the fused MoE's rows: rows [R >= T*k, D] (row t*k + s = token t's slot s),
    index [T, k]; slots with index < 0 (rows never written) count as 0. -> [T, D] float32."""
    n, k = index.shape
    r = rows[: n * k].reshape(n, k, -1).astype(jnp.float32)
    return jnp.sum(jnp.where((index >= 0)[:, :, None], r, 0.0), axis=1)


def _routed_plus_shared(routed, shared, dtype):
    """The MoE layer's output: ``dtype(routed + float32(shared))`` (routed float32, shared the shared
    expert's output in ``dtype``)."""
    return (routed + shared.astype(jnp.float32)).astype(dtype)


def materialize(x):
    """``x.value()`` for a :class:`DeferredSum`, else ``x`` itself."""
    return x.value() if isinstance(x, DeferredSum) else x


def gemv_parts(parts, dtype, shape) -> DeferredSum:
    """A split-K GEMV's output: ``dtype(sum_p parts[p])`` reshaped to ``shape``."""
    return DeferredSum(parts=parts, expert_rows=None, expert_index=None, dtype=jnp.dtype(dtype), shape=tuple(shape))


def expert_slots(rows, index, rows_dtype=None) -> DeferredSum:
    """The routed experts' output [T, D] float32 as the fused MoE's unsummed slot rows: ``rows`` [R, D],
    or a split-K down kernel's fp32 sums [S, R, D] with ``rows_dtype`` (the rows' dtype after their sum)."""
    return DeferredSum(parts=None, expert_rows=rows, expert_index=index, dtype=jnp.dtype(jnp.float32),
                       shape=(index.shape[0], rows.shape[-1]),
                       rows_dtype=None if rows_dtype is None else jnp.dtype(rows_dtype))


def moe_output(routed, shared, dtype, shape):
    """``dtype(routed + float32(shared))`` reshaped to ``shape`` (the MoE layer's output), deferred
    when both are (``routed`` from :func:`expert_slots`, ``shared`` a GEMV's :func:`gemv_parts` of
    ``dtype``), else computed."""
    if (isinstance(routed, DeferredSum) and isinstance(shared, DeferredSum) and routed.parts is None
            and shared.expert_rows is None and shared.dtype == jnp.dtype(dtype)
            and shared.rows == routed.rows):
        return DeferredSum(parts=shared.parts, expert_rows=routed.expert_rows, expert_index=routed.expert_index,
                           dtype=jnp.dtype(dtype), shape=tuple(shape), rows_dtype=routed.rows_dtype)
    routed = materialize(routed).astype(jnp.float32)
    return _routed_plus_shared(routed, materialize(shared).reshape(routed.shape), dtype).reshape(shape)
