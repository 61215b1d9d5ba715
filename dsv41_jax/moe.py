"""The MoE feed-forward of V4.1 (``shared/spec/model.md`` §5): sqrt-softplus router with gate
temperature, the correction bias used for selection only, normalised top-k weights times
``route_scale``, routed SwiGLU experts with the clamp (``pallas_kernels.moe``) and one shared
expert (clamped too, as DeepSeek's V4.1 code does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.deferred_sum import moe_output
from pallas_kernels.moe_route import route_select
from pallas_kernels.moe_route.reference import picked_weights
from pallas_kernels.moe_route.reference import scores as route_scores
from sharding.expert_parallel import routed_experts  # moe_experts, expert-parallel under a mesh

from .config import ModelConfig
from .layers import linear, linear_multi, weight_of
from .quant import exact_f32

_HI = jax.lax.Precision.HIGHEST


def route(p_gate, x, cfg: ModelConfig, topk: int, tokens=None):
    """x [N, D] -> (weights [N, k] f32, indices [N, k] int32). A V4 hash layer (``tid2eid`` in the
    gate, ``model.md`` §5.2) selects ``tid2eid[tokens]`` (tokens [N]) instead of the biased top-k; the
    weights still come from the gate's scores."""
    z = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), p_gate["weight"].astype(jnp.float32), precision=_HI)
    if "tid2eid" not in p_gate:  # scores, biased top-k (the bias only selects), weights: one op
        return route_select(z, p_gate["bias"], topk=topk, score_func=cfg.score_func, gate_temp=cfg.gate_temp,
                            norm_topk_prob=cfg.norm_topk_prob, route_scale=cfg.route_scale)
    if tokens is None:
        raise ValueError("a hash-routed MoE layer needs the token ids")
    s = route_scores(z, score_func=cfg.score_func, gate_temp=cfg.gate_temp)
    idx = jnp.take(p_gate["tid2eid"], tokens.reshape(-1), axis=0)
    return picked_weights(s, idx, norm_topk_prob=cfg.norm_topk_prob, route_scale=cfg.route_scale)


def shared_expert(p, x, cfg: ModelConfig, *, defer: bool = False):
    act = cfg.fp8_block_size
    # one launch at decode sizes; the bf16 outputs' own values (quant.exact_f32)
    g, u = (exact_f32(y) for y in linear_multi(
        x, [p["w1"], p["w3"]], act_block=act, paths=["ffn.shared_experts.w1", "ffn.shared_experts.w3"]))
    if cfg.swiglu_limit > 0:
        u = jnp.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
        g = jnp.minimum(g, cfg.swiglu_limit)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    return linear(h, p["w2"], act_block=act, path="ffn.shared_experts.w2", defer=defer)


def moe(p, x, layer: int, cfg: ModelConfig, *, return_routing: bool = False, tokens=None, defer: bool = False):
    """x [B, S, D] (after ffn_norm) -> [B, S, D] in x.dtype. ``tokens`` [B, S]: the input ids (V4
    hash layers route by them). ``defer``: the output may be a
    :class:`pallas_kernels.deferred_sum.DeferredSum` (the routed experts' slot rows and the shared
    expert's K parts, unsummed) for the mHC expansion kernel to sum; the same value otherwise."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    _, topk = cfg.moe_experts(layer)
    with jax.named_scope("route"):
        w, idx = route(p["gate"], xf, cfg, topk, tokens)
    e = p["experts"]
    with jax.named_scope("routed_experts"):
        y = routed_experts(xf, w, idx, weight_of(e["w1"]), weight_of(e["w2"]), weight_of(e["w3"]),
                           swiglu_limit=cfg.swiglu_limit, act_block=cfg.fp8_block_size, defer=defer)
    with jax.named_scope("shared_expert"):
        out = moe_output(y, shared_expert(p["shared_experts"], xf, cfg, defer=defer), x.dtype, shape)
    if return_routing:
        return out, (w.reshape(*shape[:-1], -1), idx.reshape(*shape[:-1], -1))
    return out
