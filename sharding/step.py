"""A ``forward_step`` jitted for a mesh: parameters, caches and inputs in the shardings of
:mod:`sharding.rules`, the routed experts expert-parallel (:mod:`sharding.expert_parallel`), the
rest partitioned by XLA's GSPMD from those shardings.

    mesh = make_mesh("dp=1,tp=2,ep=2")
    params = shard_params(params, cfg, mesh)
    cache = init_cache_sharded(cfg, mesh, batch, max_seq_len, opts)
    step = sharded_forward_step(cfg, opts, mesh, batch=batch, max_seq_len=max_seq_len)
    logits, cache = step(params, cache, tokens, lengths, engram_ids)      # cache is donated
"""

from __future__ import annotations

import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .mesh import mesh_sizes
from .rules import cache_shardings, logical_spec, use_mesh


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


def data_parallel(fn, mesh, batch: int):
    """Wrap ``fn(params, cache, tokens, lengths, engram_ids) -> (logits, cache)`` in a ``shard_map``
    that is manual over ``dp`` only (``tp``/``ep`` stay automatic): each dp group runs the step on
    its own rows. Without it GSPMD cannot prove that the caches' per-row gathers/scatters stay
    within a row and all-gathers the caches over dp every step. Identity when dp = 1 or the batch
    does not split."""
    dp = mesh_sizes(mesh)["dp"]
    if dp == 1 or batch % dp:
        return fn
    row = P("dp")
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(), row, row, row, row), out_specs=(row, row),
                         axis_names=frozenset({"dp"}), check_vma=False)


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


_COLL = re.compile(r"= (\S+?)\[[^\]]*\][^ ]* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")

# element types NCCL / RCCL cannot carry (XLA aborts at run time: "element type ... not supported by NCCL")
NCCL_UNSUPPORTED = ("f8e8m0fnu", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f4e2m1fn")


def collectives(hlo_text: str) -> dict[tuple[str, str], int]:
    """{(collective, element type): count} in a compiled HLO module text."""
    out: dict[tuple[str, str], int] = {}
    for m in _COLL.finditer(hlo_text):
        k = (m.group(2), m.group(1).lstrip("("))
        out[k] = out.get(k, 0) + 1
    return out
