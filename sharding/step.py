"""A step jitted for a mesh: parameters, caches and inputs in the shardings of
:mod:`sharding.rules`, the batch rows split over ``dp`` by a row ``shard_map``
(:func:`data_parallel`, also used by :class:`dsv41_jax.engine.Engine`), the routed experts
expert-parallel (:mod:`sharding.expert_parallel`), the rest partitioned by XLA's GSPMD from those
shardings; and :func:`collective_ops` to read what a compiled step communicates.

    mesh = make_mesh("dp=1,tp=2,ep=2")
    params = shard_params(params, cfg, mesh)
    cache = init_cache_sharded(cfg, mesh, batch, max_seq_len, opts)
    step = sharded_forward_step(cfg, opts, mesh, batch=batch, max_seq_len=max_seq_len)
    logits, cache = step(params, cache, tokens, lengths, engram_ids)      # cache is donated
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .mesh import AXES, mesh_sizes
from .rules import auto_axes, cache_shardings, context_mesh, logical_spec, use_mesh


def batch_sharding(mesh, batch: int, ndim: int = 1) -> NamedSharding:
    """Inputs with a leading batch dim ([B], [B,S], [B,S,cols]): batch over dp where it divides."""
    dp = mesh_sizes(mesh)["dp"]
    return NamedSharding(mesh, P("dp") if dp > 1 and batch % dp == 0 else P())


def logits_sharding(mesh, batch: int, vocab: int, logits_mode: str, layout: str = "replicated") -> NamedSharding:
    """``replicated`` (every device holds all logits) or ``vocab`` (batch over dp, vocab over tp,
    for a sharded argmax / sampling)."""
    if layout == "replicated":
        return NamedSharding(mesh, P())
    axes = ("batch", "vocab") if logits_mode == "last" else ("batch", None, "vocab")
    shape = (batch, vocab) if logits_mode == "last" else (batch, 1, vocab)
    return NamedSharding(mesh, logical_spec(axes, mesh, shape))


def data_parallel(fn, mesh, batch: int, in_rows=(False, True, True, True, True), out_rows=(True, True)):
    """Wrap ``fn`` in a ``shard_map`` that is manual over ``dp`` only (``tp``/``ep`` stay
    automatic): each dp group runs ``fn`` on its own rows. Without it GSPMD cannot prove that the
    caches' per-row gathers/scatters stay within a row and all-gathers the caches over dp every step.

    ``in_rows[i]``: positional argument ``i`` is batch-leading (every leaf split over dp) or not
    (parameters, scalars, tables: whole on every dp group); ``out_rows`` likewise for the outputs
    (a tuple of bools for a tuple of outputs, one bool for a single one). The default fits
    ``fn(params, cache, tokens, lengths, engram_ids) -> (logits, cache)``. Identity when ``mesh``
    is None, dp = 1 or the batch does not split. Inside, :func:`row_offset` gives a group's first
    global row."""
    dp = mesh_sizes(mesh)["dp"]
    if mesh is None or dp == 1 or batch % dp:
        return fn

    def spec(r):
        return P("dp") if r else P()

    outs = tuple(map(spec, out_rows)) if isinstance(out_rows, (tuple, list)) else spec(out_rows)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(spec, in_rows)), out_specs=outs,
                         axis_names=frozenset({"dp"}), check_vma=False)


def row_offset(local_batch: int):
    """The first global batch row of this dp group inside :func:`data_parallel` (traced int32),
    0 outside it (no mesh, dp = 1, or a batch that does not split)."""
    return jax.lax.axis_index("dp") * local_batch if _dp_is_manual() else 0


def _dp_is_manual() -> bool:
    m = context_mesh()
    return m is not None and "dp" in m.axis_names and "dp" not in auto_axes(m)


def sharded_forward_step(cfg, opts, mesh, *, batch: int, max_seq_len: int, logits_mode: str = "all",
                         logits_layout: str = "replicated", engram: str = "ids", dp_shard_map: bool = True):
    """``fn(params, cache, tokens, lengths, engram_inputs=None) -> (logits, cache)``: jitted with
    the cache, token and logits shardings from the rules, cache donated, traced and run under
    ``use_mesh(mesh)``; ``dp_shard_map``: rows split over dp by :func:`data_parallel`.

    ``params`` must already be placed (:func:`sharding.rules.shard_params`, or
    ``load_checkpoint(..., shardings=param_shardings(cfg, mesh))``); their shardings are used as
    they are, so a tree without the Engram tables works too. ``engram``: ``"ids"`` (row ids
    {layer: int32 [B,S,cols]}, tables on the devices), ``"rows"`` (rows gathered on the host,
    {layer: Fp8Tensor [B,S,cols,hd]} — tables kept as host memmaps by the loader) or ``"none"``."""
    from dsv41_jax.transformer import forward_step

    if engram not in ("ids", "rows", "none"):
        raise ValueError(f"engram must be ids, rows or none, got {engram!r}")
    if not cfg.engram_layer_ids:
        engram = "none"
    cs = cache_shardings(cfg, mesh, batch, max_seq_len, opts)
    bs = batch_sharding(mesh, batch)
    ls = logits_sharding(mesh, batch, cfg.vocab_size, logits_mode, logits_layout)
    use_ids = engram != "none"
    ids_sh = {str(l): bs for l in cfg.engram_layer_ids} if use_ids else None

    def step(params, cache, tokens, lengths, engram_in):
        ids, rows = (engram_in, None) if engram == "ids" else (None, engram_in)
        return forward_step(params, cache, tokens, lengths, ids, rows, cfg=cfg, opts=opts, logits_mode=logits_mode)

    if dp_shard_map:
        step = data_parallel(step, mesh, batch)
    jitted = jax.jit(step, in_shardings=(None, cs, bs, bs, ids_sh), out_shardings=(ls, cs), donate_argnums=(1,))

    def run(params, cache, tokens, lengths, engram_ids=None):
        with use_mesh(mesh):
            return jitted(params, cache, tokens, lengths, engram_ids if use_ids else None)

    def compiled_text(params, cache, tokens, lengths, engram_ids=None):
        """The partitioned, optimised HLO of the step for these argument shapes (compiles)."""
        with use_mesh(mesh):
            return jitted.lower(params, cache, tokens, lengths, engram_ids if use_ids else None).compile().as_text()

    run.jitted = jitted
    run.mesh = mesh
    run.compiled_text = compiled_text
    return run


# element types NCCL / RCCL cannot carry (XLA aborts at run time: "element type ... not supported by NCCL")
NCCL_UNSUPPORTED = ("f8e8m0fnu", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f4e2m1fn")

_OPS = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
_COLL = re.compile(r"^\s*(?:ROOT )?\S+ = (?P<type>.*?) (?P<op>" + _OPS + r")(?:-start)?\((?P<rest>.*)$", re.M)
_BUF = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=(\{[\d,{}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\] \{[^}]*\})")


def collective_ops(hlo_text: str, mesh=None) -> list[dict]:
    """Every collective in a compiled HLO module text, one dict per buffer it moves (a tuple
    collective moves several): ``op``, ``dtype`` (HLO element type: f32, s32, u8, f8e4m3fn, ...),
    ``shape`` and, with ``mesh`` (the mesh the program was compiled for), ``axes``: the mesh axes
    its device groups span (``["dp"]``: data moves between data-parallel groups)."""
    sizes = mesh_sizes(mesh) if mesh is not None else None
    out = []
    for m in _COLL.finditer(hlo_text):
        axes = None
        if sizes is not None:
            g = _GROUPS.search(m.group("rest"))
            axes = _group_axes(g.group(1) if g else "{}", sizes)
        for dtype, dims in _BUF.findall(m.group("type")):
            out.append({"op": m.group("op"), "dtype": dtype, "shape": [int(d) for d in dims.split(",") if d],
                        "axes": axes})
    return out


def _group_axes(groups: str, sizes: dict) -> list[str]:
    """Mesh axes spanned by HLO device groups (explicit ``{{0,1},..}``, iota ``[4,2]<=[8]``,
    ``[2,4]<=[4,2]T(1,0)``, named ``mesh['dp'=2,..] {'ep'}``; ``{}``: all devices). Device ids are
    positions in the mesh's (dp, ep, tp) order."""
    if groups.startswith("mesh["):
        return [a for a in AXES if f"'{a}'" in groups.split("{", 1)[1]]
    if groups.startswith("["):
        shape, _, rest = groups.partition("<=")
        dims, _, perm = rest.partition("T")
        ints = lambda t: [int(x) for x in t.strip("[]()").split(",")]  # noqa: E731
        ids = np.arange(math.prod(ints(dims))).reshape(ints(dims))
        if perm:
            ids = ids.transpose(ints(perm))
        members = ids.reshape(ints(shape)).tolist()
    else:
        members = [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", groups)]
        members = [grp for grp in members if grp]
    dims = [sizes[a] for a in AXES]
    if not members:
        return [a for a in AXES if sizes[a] > 1]
    spanned = set()
    for grp in members:
        coords = np.array(np.unravel_index(np.asarray(grp), dims)).T  # [members, 3]
        spanned |= {AXES[i] for i in range(len(AXES)) if len(set(coords[:, i].tolist())) > 1}
    return [a for a in AXES if a in spanned]


def collectives(hlo_text: str) -> dict[tuple[str, str], int]:
    """{(collective, element type): count of buffers moved} in a compiled HLO module text."""
    out: dict[tuple[str, str], int] = {}
    for c in collective_ops(hlo_text):
        k = (c["op"], c["dtype"])
        out[k] = out.get(k, 0) + 1
    return out
