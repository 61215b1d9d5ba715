"""The one name table between the parameter tree (:mod:`dsv41_jax.params`) and the official
checkpoint tensors, at the granularity of tree leaves.

Every array leaf of :func:`dsv41_jax.params.param_specs` gets

* a **leaf name**: its tree path joined with ``.``, where a quantized node's ``data`` / ``scale``
  fields are written ``weight`` / ``scale`` (so ``layers.0.attn.wq_a.weight``), and
* its **sources**: the official tensor names it is made of, in order. Usually one (the leaf name
  itself); the stacked routed experts ``X.experts.w1.weight`` (shape ``[E, ...]``) are made of
  ``X.experts.0.w1.weight`` ... ``X.experts.{E-1}.w1.weight``.

Both loader and writer use this table, and :func:`check_table` checks that it covers
:func:`dsv41_jax.params.official_shapes` exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..config import ModelConfig
from ..params import official_shapes, param_specs


@dataclass(frozen=True)
class LeafEntry:
    name: str  # leaf name (tree path, data/scale -> weight/scale)
    path: tuple  # jax key path into the tree
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[str, ...]  # official tensor names
    stacked: bool  # sources are slices [e] of the leaf along axis 0

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape


def key_name(k) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return {"data": "weight", "scale": "scale"}[k.name]
    raise TypeError(f"unexpected key {k!r} in the parameter tree")


def leaf_name(path) -> str:
    return ".".join(key_name(k) for k in path)


_ENGRAM_TABLE = re.compile(r"(^|\.)engram\.embed\.(weight|scale)$")


def is_engram_table(name: str) -> bool:
    return bool(_ENGRAM_TABLE.search(name))


def _sources(name: str, shape) -> tuple[tuple[str, ...], bool]:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "experts" and parts[i + 1] in ("w1", "w2", "w3"):
            n = int(shape[0])
            return tuple(".".join(parts[: i + 1] + [str(e)] + parts[i + 1 :]) for e in range(n)), True
    return (name,), False


def leaf_table(cfg: ModelConfig, specs: Any = None) -> tuple[list[LeafEntry], Any]:
    """``(entries in tree-flatten order, treedef)`` for ``param_specs(cfg)``."""
    specs = param_specs(cfg) if specs is None else specs
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs)
    entries = []
    for path, sds in flat:
        name = leaf_name(path)
        src, stacked = _sources(name, sds.shape)
        entries.append(LeafEntry(name, tuple(path), tuple(sds.shape), np.dtype(sds.dtype), src, stacked))
    return entries, treedef


def check_table(cfg: ModelConfig) -> None:
    """Assert the leaf table covers the official names exactly once, with the same shapes."""
    entries, _ = leaf_table(cfg)
    off = official_shapes(cfg)
    seen = {}
    for e in entries:
        for s in e.sources:
            assert s not in seen, f"{s} produced twice"
            seen[s] = (e.source_shape, e.dtype)
    assert set(seen) == set(off), (set(seen) ^ set(off))
    for n, sds in off.items():
        assert seen[n] == (tuple(sds.shape), np.dtype(sds.dtype)), (n, seen[n], sds)
