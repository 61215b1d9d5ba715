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

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .mesh import mesh_sizes
from .rules import cache_shardings, logical_spec, param_shardings, use_mesh


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


def sharded_forward_step(cfg, opts, mesh, *, batch: int, max_seq_len: int, logits_mode: str = "all",
                         logits_layout: str = "replicated", with_engram_ids: bool | None = None):
    """``fn(params, cache, tokens, lengths, engram_ids=None) -> (logits, cache)``: jitted with
    in/out shardings from the rules, cache donated, traced and run under ``use_mesh(mesh)``."""
    from dsv41_jax.transformer import forward_step

    ps = param_shardings(cfg, mesh)
    cs = cache_shardings(cfg, mesh, batch, max_seq_len, opts)
    bs = batch_sharding(mesh, batch)
    ls = logits_sharding(mesh, batch, cfg.vocab_size, logits_mode, logits_layout)
    use_ids = bool(cfg.engram_layer_ids) if with_engram_ids is None else with_engram_ids
    ids_sh = {str(l): bs for l in cfg.engram_layer_ids} if use_ids else None

    def step(params, cache, tokens, lengths, engram_ids):
        return forward_step(params, cache, tokens, lengths, engram_ids, None, cfg=cfg, opts=opts,
                            logits_mode=logits_mode)

    jitted = jax.jit(step, in_shardings=(ps, cs, bs, bs, ids_sh), out_shardings=(ls, cs), donate_argnums=(1,))

    def run(params, cache, tokens, lengths, engram_ids=None):
        with use_mesh(mesh):
            return jitted(params, cache, tokens, lengths, engram_ids if use_ids else None)

    run.jitted = jitted
    run.mesh = mesh
    return run
