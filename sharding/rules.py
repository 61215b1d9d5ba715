"""Partition rules: ONE table that names every parameter's and every cache leaf's dimensions by
logical axes, and one map from logical axes to mesh axes.

Rules are matched (first match wins, ``re.search``) against the dotted path of a *node*: a plain
leaf (``layers.3.attn.attn_sink``), the weight of a plain linear (``layers.3.attn.wq_a.weight``
is matched as ``layers.3.attn.wq_a``) or a quantized :class:`Fp8Tensor` / :class:`Fp4Tensor`
(``layers.3.ffn.experts.w1``). A rule gives one logical axis (or ``None``) per *logical* dimension
of the node (for FP4: the unpacked shape). The quantized node's ``data`` and ``scale`` are then
sharded alike:

* Fp8Tensor, block (br, bc): a split of one of the last two dims needs ``dim % (n * b) == 0`` so
  that shard boundaries fall on scale-block boundaries (the scale dim is then divisible by n);
* Fp4Tensor, block b: a split of the last (packed) dim needs ``C % (n * b) == 0``;
* leading dims (experts, batch) and plain arrays: ``dim % n == 0``.

A dimension that does not divide is replicated instead (recorded by :func:`explain`; never an
error), as is a mesh axis of size 1. A logical axis may map to several mesh axes (Engram table rows
over ``ep`` and ``tp``); if the product does not divide, the largest single axis that does is used.

Logical axes -> mesh axes (:data:`LOGICAL_AXES`): vocabulary, attention heads and output groups,
indexer heads, the shared expert's and the routed experts' hidden dims over ``tp``; experts over
``ep``; the batch of every cache leaf and activation over ``dp``; Engram table rows over
``(ep, tp)``. Everything small (norms, mHC, router, RoPE'd single-head KV projections, sinks) is
replicated.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from typing import Iterable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .mesh import AXES, mesh_sizes

# logical axis -> mesh axis (or tuple of mesh axes, major to minor)
LOGICAL_AXES: dict[str, str | tuple[str, ...]] = {
    "batch": "dp",
    "vocab": "tp",
    "heads": "tp",  # wq_b rows = n_heads * head_dim, heads-major
    "o_groups": "tp",  # wo_a rows / wo_b cols = o_groups * o_lora_rank, group-major
    "index_heads": "tp",  # indexer wq_b rows, weights_proj rows
    "mlp": "tp",  # shared expert hidden dim
    "experts": "ep",  # stacked routed experts
    "expert_mlp": "tp",  # routed experts' hidden dim (moe_inter_dim)
    "engram_rows": (),  # replicated: row-sharded gathers all-reduce e8m0 scales, which NCCL rejects
}

# (regex on the node path, logical axes per logical dim[, {dim: unit}]). First match wins; no match
# = replicated. A unit (an int or a ModelConfig field name) is the granularity a split of that dim
# must respect: a head's rows, an output group, the activation fake-quant block along K.
PARAM_RULES: tuple = (
    (r"^embed$", ("vocab", None)),
    (r"^head$", ("vocab", None)),
    (r"markov_head\.(embed|head)$", ("vocab", None)),
    (r"attn\.wq_b$", ("heads", None), {0: "head_dim"}),
    (r"attn\.wo_a$", ("o_groups", None), {0: "o_lora_rank"}),
    (r"attn\.wo_b$", (None, "o_groups"), {1: "o_lora_rank"}),
    (r"attn\.indexer\.wq_b$", ("index_heads", None), {0: "index_head_dim"}),
    (r"attn\.indexer\.weights_proj$", ("index_heads", None)),
    (r"ffn\.experts\.(w1|w3)$", ("experts", "expert_mlp", None), {1: "fp8_block_size"}),
    (r"ffn\.experts\.w2$", ("experts", None, "expert_mlp"), {2: "fp8_block_size"}),
    (r"ffn\.shared_experts\.(w1|w3)$", ("mlp", None), {0: "fp8_block_size"}),
    (r"ffn\.shared_experts\.w2$", (None, "mlp"), {1: "fp8_block_size"}),
    (r"engram\.embed$", ("engram_rows", None)),
    # replicated (listed so that the table documents every parameter):
    # attn.{wq_a,q_norm,wkv,kv_norm,attn_sink}, attn.compressor.*, attn.indexer.{wk,k_norm},
    # ffn.gate.*, hc_*, *_norm, norm, engram.{wkv,q_weight,k_weight}, mtp main_proj / main_norm /
    # confidence_head
    (r".*", ()),
)

# Cache leaves (cache.init_cache): every one is batch-leading.
CACHE_RULES: tuple = (
    (r"^pos$", ("batch",)),
    (r"^layers\.\d+\.(window|comp|index_k|state_kv|state_score|index_state_kv|index_state_score)$",
     ("batch", None, None)),
    (r".*", ()),
)


# ------------------------------------------------------------------------------------------------
# helpers


def _is_quant(x) -> bool:
    from dsv41_jax.quant import Fp4Tensor, Fp8Tensor

    return isinstance(x, (Fp8Tensor, Fp4Tensor))


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path) -> str:
    return ".".join(_key_str(k) for k in path)


def rule_for(path: str, ndim: int, rules=PARAM_RULES, cfg=None) -> tuple[tuple[str | None, ...], tuple[int, ...]]:
    """(logical axes, split units) of the node at ``path``, padded to ``ndim`` dims. Units named
    by a config field are read from ``cfg`` (an object or a dict; missing -> 1)."""
    for rule in rules:
        pat, axes = rule[0], rule[1]
        if re.search(pat, path):
            if len(axes) > ndim:
                raise ValueError(f"partition rule {pat!r} names {len(axes)} dims but {path} has {ndim}")
            units = [1] * ndim
            for d, u in (rule[2] if len(rule) > 2 else {}).items():
                if isinstance(u, str):
                    u = cfg.get(u, 1) if isinstance(cfg, dict) else getattr(cfg, u, 1) if cfg is not None else 1
                units[d] = int(u)
            return tuple(axes) + (None,) * (ndim - len(axes)), tuple(units)
    return (None,) * ndim, (1,) * ndim


def logical_axes_for(path: str, ndim: int, rules=PARAM_RULES) -> tuple[str | None, ...]:
    """The logical axes of the node at ``path`` (padded with None to ``ndim``)."""
    return rule_for(path, ndim, rules)[0]


_NOTES: list[tuple[str, str]] = []


def explain() -> list[tuple[str, str]]:
    """(path, note) for every dimension the last ``*_shardings`` call replicated because it did
    not divide (cleared by each top-level call)."""
    return list(_NOTES)


def _mesh_axes(logical: str | None) -> tuple[str, ...]:
    if logical is None:
        return ()
    m = LOGICAL_AXES.get(logical, ())
    return (m,) if isinstance(m, str) else tuple(m)


def _choose(dim: int, unit: int, cand: tuple[str, ...], sizes: dict, used: set, where: str, logical: str):
    """Mesh axes (tuple) to split a dim of size ``dim`` (a multiple of ``unit`` per shard)."""
    cand = tuple(a for a in cand if sizes.get(a, 1) > 1 and a not in used)
    if not cand:
        return ()
    n = math.prod(sizes[a] for a in cand)
    if dim % (n * unit) == 0:
        return cand
    for a in sorted(cand, key=lambda a: -sizes[a]):
        if dim % (sizes[a] * unit) == 0:
            _NOTES.append((where, f"{logical}: {dim} not divisible by {n}x{unit}; split over {a} only"))
            return (a,)
    _NOTES.append((where, f"{logical}: {dim} not divisible by {sizes[cand[0]]}x{unit}; replicated"))
    return ()


def _entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def node_specs(node, logical: tuple[str | None, ...], sizes: dict[str, int], where: str = "", units=None):
    """PartitionSpec(s) for one node: a P for a plain array / ShapeDtypeStruct, an Fp8Tensor /
    Fp4Tensor of P (data and scale) for a quantized node."""
    from dsv41_jax.quant import Fp4Tensor, Fp8Tensor

    used: set[str] = set()
    if isinstance(node, Fp8Tensor):
        shape = tuple(node.data.shape)
        nd = len(shape)
        br, bc = node.block
        rule_units = (1,) * (nd - 2) + (br, bc)
    elif isinstance(node, Fp4Tensor):
        shape = (*node.data.shape[:-1], node.data.shape[-1] * 2)
        nd = len(shape)
        rule_units = (1,) * (nd - 1) + (node.block,)
    else:
        shape = tuple(node.shape)
        nd = len(shape)
        rule_units = (1,) * nd
    if units is not None:
        units = tuple(math.lcm(a, b) for a, b in zip(units, rule_units))
    else:
        units = rule_units
    entries = []
    for d in range(nd):
        ax = _choose(shape[d], units[d], _mesh_axes(logical[d]), sizes, used, where, logical[d] or "")
        used.update(ax)
        entries.append(_entry(ax))
    while entries and entries[-1] is None:
        entries.pop()
    spec = P(*entries)
    if isinstance(node, (Fp8Tensor, Fp4Tensor)):
        return node.replace(data=spec, scale=spec)  # static fields (block, FP4 packing) kept
    return spec


def _map_nodes(fn, tree):
    """tree_map over nodes (quantized tensors are one node) with their path string; a plain
    linear's ``weight`` is reported under its parent's path."""
    def visit(path, node):
        p = path_str(path)
        if p.endswith(".weight") or p == "weight":
            p = p[: -len(".weight")] if p.endswith(".weight") else ""
        return fn(p, node)

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=_is_quant)


def tree_specs(tree, mesh, rules=PARAM_RULES, cfg=None):
    """PartitionSpec pytree (quantized nodes hold specs for data and scale) for any tree of arrays
    or ShapeDtypeStructs named like the parameter (or cache) tree."""
    sizes = mesh_sizes(mesh)
    _NOTES.clear()

    def fn(p, node):
        nd = len(node.data.shape) if _is_quant(node) else len(node.shape)
        axes, units = rule_for(p, nd, rules, cfg)
        return node_specs(node, axes, sizes, p, units)

    return _map_nodes(fn, tree)


def _to_named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# ------------------------------------------------------------------------------------------------
# public API


def param_partition_specs(cfg, mesh):
    """PartitionSpecs matching ``param_specs(cfg)``."""
    from dsv41_jax.params import param_specs

    return tree_specs(param_specs(cfg), mesh, PARAM_RULES, cfg)


def param_shardings(cfg, mesh):
    """A pytree of ``NamedSharding`` matching :func:`dsv41_jax.params.param_specs` (inside
    Fp8Tensor/Fp4Tensor: one for ``data``, one for ``scale``, split alike). Pass it to
    ``load_checkpoint(..., shardings=...)``, ``jax.device_put(params, ...)`` or jit."""
    return _to_named(mesh, param_partition_specs(cfg, mesh))


def cache_partition_specs(cfg, mesh, batch: int, max_seq_len: int, opts):
    from dsv41_jax.cache import init_cache

    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, max_seq_len, opts))
    return tree_specs(shapes, mesh, CACHE_RULES, cfg)


def cache_shardings(cfg, mesh, batch: int, max_seq_len: int, opts):
    """A pytree of ``NamedSharding`` matching ``init_cache(cfg, batch, max_seq_len, opts)``: the
    batch over ``dp`` (replicated when ``batch % dp``), the rest replicated (one shared KV head)."""
    return _to_named(mesh, cache_partition_specs(cfg, mesh, batch, max_seq_len, opts))


def shard_params(params, cfg, mesh, *, keep_host: bool = True):
    """``jax.device_put`` every parameter onto its sharding. Works on any tree named like the
    parameter tree (a subset, ``None`` holes such as an engine's host-side Engram tables).
    ``keep_host``: numpy leaves (tables the loader kept as host memmaps) are left where they are."""
    import numpy as np

    specs = tree_specs(params, mesh, PARAM_RULES, cfg)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731

    def put(x, s):
        if keep_host and isinstance(x, np.ndarray):
            return x
        return jax.device_put(x, NamedSharding(mesh, s))

    flat_s, _ = jax.tree.flatten(specs, is_leaf=is_spec)
    flat_x, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [put(x, s) for x, s in zip(flat_x, flat_s)])


def init_cache_sharded(cfg, mesh, batch: int, max_seq_len: int, opts):
    """An empty cache created directly in its shardings (no single-device copy first)."""
    from dsv41_jax.cache import init_cache

    sh = cache_shardings(cfg, mesh, batch, max_seq_len, opts)
    return jax.jit(lambda: init_cache(cfg, batch, max_seq_len, opts), out_shardings=sh)()


# ------------------------------------------------------------------------------------------------
# activations


def logical_spec(axes: Iterable[str | None], mesh=None, shape=None) -> P:
    """A PartitionSpec for logical ``axes`` (e.g. ``("batch", None, "vocab")``); with ``shape``,
    dims that do not divide are replicated."""
    sizes = mesh_sizes(mesh) if mesh is not None else {a: 2 for a in AXES}
    used: set[str] = set()
    out = []
    for d, lg in enumerate(axes):
        cand = tuple(a for a in _mesh_axes(lg) if sizes.get(a, 1) > 1 and a not in used)
        if shape is not None and cand:
            cand = _choose(shape[d], 1, cand, sizes, used, "activation", lg or "")
        used.update(cand)
        out.append(_entry(cand))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def context_mesh():
    """The mesh set by :func:`use_mesh` / ``jax.set_mesh`` (an AbstractMesh under jit), or None."""
    try:
        m = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover
        return None
    if m is None or getattr(m, "empty", False) or not getattr(m, "axis_names", ()):
        return None
    return m


def constrain(x, *axes: str | None):
    """``with_sharding_constraint`` of ``x`` to logical ``axes`` under the context mesh (no-op
    without one, or inside shard_map). Example: ``constrain(h, "batch", None, None, None)``."""
    m = context_mesh()
    if m is None or _manual(m):
        return x
    spec = logical_spec(axes, m, x.shape)
    return jax.lax.with_sharding_constraint(x, spec)


def auto_axes(m) -> tuple[str, ...]:
    """Mesh axes not already manual (inside a shard_map over dp, only ep and tp are left)."""
    try:
        from jax.sharding import AxisType

        return tuple(n for n, t in zip(m.axis_names, m.axis_types) if t != AxisType.Manual)
    except (ImportError, AttributeError):  # pragma: no cover
        return tuple(m.axis_names)


def _manual(m) -> bool:
    """Whether some axis of ``m`` is manual (inside a shard_map)."""
    return auto_axes(m) != tuple(m.axis_names)


@contextmanager
def use_mesh(mesh):
    """Make ``mesh`` the context mesh while tracing/running (``jax.set_mesh``): the MoE hook then
    runs the routed experts expert-parallel, and :func:`constrain` applies."""
    if hasattr(jax, "set_mesh"):
        with jax.set_mesh(mesh):
            yield mesh
    else:  # pragma: no cover - older JAX
        with jax.sharding.use_mesh(mesh):
            yield mesh
