"""Pure-jnp definition of the router's selection (``shared/spec/model.md`` §5): scores from the
logits ``z / gate_temp`` (softmax, sigmoid or sqrt-softplus), the top-k of ``scores + bias`` (the
correction bias selects only; ties go to the lower expert index, as ``jax.lax.top_k``), the
weights ``scores[idx]``, normalised over the k picks when ``norm_topk_prob``, times
``route_scale``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def scores(z, *, score_func: str, gate_temp: float):
    """z [N, E] f32 router logits -> scores [N, E] f32."""
    z = z / gate_temp
    if score_func == "softmax":
        return jax.nn.softmax(z, axis=-1)
    if score_func == "sigmoid":
        return jax.nn.sigmoid(z)
    return jnp.sqrt(jax.nn.softplus(z))


def route_select(z, bias, *, topk: int, score_func: str, gate_temp: float, norm_topk_prob: bool,
                 route_scale: float):
    """z [N, E] f32, bias [E] -> (weights [N, topk] f32, indices [N, topk] int32)."""
    s = scores(z.astype(jnp.float32), score_func=score_func, gate_temp=gate_temp)
    _, idx = jax.lax.top_k(s + bias.astype(jnp.float32), topk)
    return picked_weights(s, idx, norm_topk_prob=norm_topk_prob, route_scale=route_scale)


def picked_weights(s, idx, *, norm_topk_prob: bool, route_scale: float):
    """scores [N, E] and the picked experts idx [N, k] -> (weights [N, k] f32, idx as int32): the
    picks' scores, normalised over the k picks when ``norm_topk_prob``, times ``route_scale`` (also
    the weights of a V4 hash layer, whose picks come from its table)."""
    w = jnp.take_along_axis(s, idx, axis=-1)
    if norm_topk_prob and idx.shape[-1] > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * route_scale, idx.astype(jnp.int32)
