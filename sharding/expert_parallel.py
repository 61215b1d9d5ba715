"""Expert parallelism for the routed experts, with ``jax.shard_map`` and XLA collectives.

The stacked experts ``w1/w3 [E, I, D]``, ``w2 [E, D, I]`` are split as :mod:`sharding.rules` says:
experts over ``ep`` and the hidden dim ``I`` over ``tp`` (each where it divides). Two exact paths:

* ``"psum"`` (default; decode sizes): every (ep, tp) shard of a dp group sees all of the group's
  tokens, runs its local experts on the (token, slot) pairs routed to them (the others get index -1:
  the kernels skip them, so a shard reads only its own experts' weights) over its slice of ``I`` (SwiGLU is elementwise in ``I``, and the down
  projection's sum over ``I`` splits), and one ``psum`` over ``ep`` and ``tp`` adds the partial
  outputs. Communication per layer: one all-reduce of ``[tokens, dim]`` f32.
* ``"all_to_all"`` (prefill sizes): tokens are also split over ``ep``; each shard packs, for every
  ep peer, the (token, slot) pairs routed to that peer's experts into a fixed ``tokens*k`` capacity
  buffer (never drops: the worst case fits), ``all_to_all`` sends them, the peer runs its experts
  (psum over ``tp`` when ``I`` is split), a second ``all_to_all`` returns the rows and each shard
  adds them to its tokens. Needs ``tokens % (dp*ep) == 0``; otherwise ``psum`` is used.

Both give the single-device result up to f32 summation order. With ``I`` split over ``tp`` each
shard's partial down projection is rounded to the compute dtype (as ``moe_experts`` rounds each
expert's output) before the f32 psum, so bf16 runs can differ from one device in the last bf16 bit;
float32 runs agree to rounding.

Entry point for the model: :func:`routed_experts` (same signature as
``pallas_kernels.moe.moe_experts``); it uses the context mesh (``sharding.use_mesh`` /
``jax.set_mesh``) and falls back to ``moe_experts`` when there is none or ep = tp = 1.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def moe_experts(*args, **kw):
    """``pallas_kernels.moe.moe_experts`` (imported on first use: dsv41_jax.moe imports this module)."""
    from pallas_kernels.moe import moe_experts as f

    return f(*args, **kw)

from .mesh import mesh_sizes
from .rules import PARAM_RULES, auto_axes, context_mesh, node_specs, rule_for


def _default_path() -> str:
    """``DSV41_EP_PATH``: "psum" | "all_to_all" | "auto" (read when a step is traced)."""
    return os.environ.get("DSV41_EP_PATH", "auto")


def _a2a_min_tokens() -> int:
    """``auto`` picks all_to_all from this many tokens per ep shard (``DSV41_EP_A2A_MIN_TOKENS``)."""
    return int(os.environ.get("DSV41_EP_A2A_MIN_TOKENS", "64"))


def _spec_of(node, name, sizes, act_block):
    """The spec :mod:`sharding.rules` gives this expert weight (same table, same units)."""
    nd = len(node.data.shape) if hasattr(node, "data") else len(node.shape)
    axes, units = rule_for(f"ffn.experts.{name}", nd, PARAM_RULES, {"fp8_block_size": act_block})
    return node_specs(node, axes, sizes, f"ffn.experts.{name}", units)


def _split_axes(spec_tree):
    """Mesh axes used by a spec pytree."""
    out = []
    for s in jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P)):
        for e in s:
            for a in ((e,) if isinstance(e, str) else (e or ())):
                if a not in out:
                    out.append(a)
    return out


def routed_experts(x, weights, indices, w1, w2, w3, *, swiglu_limit, act_block=32, implementation=None,
                   mesh=None, path=None, defer=False):
    """``moe_experts`` with the experts split over the mesh (context mesh by default). ``defer``: as
    ``moe_experts``' (the unsplit cases only; the expert-parallel paths return the sum)."""
    m = mesh if mesh is not None else context_mesh()
    if m is None or not (set(auto_axes(m)) & {"ep", "tp"}):
        return moe_experts(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit, act_block=act_block,
                           implementation=implementation, defer=defer)
    sizes = mesh_sizes(m)
    if sizes["ep"] == 1 and sizes["tp"] == 1:
        return moe_experts(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit, act_block=act_block,
                           implementation=implementation, defer=defer)
    return expert_parallel_moe(x, weights, indices, w1, w2, w3, mesh=m, swiglu_limit=swiglu_limit,
                               act_block=act_block, implementation=implementation, path=path)


def expert_parallel_moe(x, weights, indices, w1, w2, w3, *, mesh, swiglu_limit, act_block=32,
                        implementation=None, path=None):
    """x [N, D]; weights [N, k] f32; indices [N, k] int32 (global expert ids); stacked experts.
    Returns [N, D] f32, replicated over ep/tp, split over dp like x."""
    sizes = mesh_sizes(mesh)
    specs = [_spec_of(w, n, sizes, act_block) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))]
    e_split = "ep" in _split_axes(specs[0])
    i_split = "tp" in _split_axes(specs[0])
    n_exp = jax.tree.leaves(w1)[0].shape[0]
    e_loc = n_exp // sizes["ep"] if e_split else n_exp
    N = x.shape[0]
    free = auto_axes(mesh)
    dp = sizes["dp"] if "dp" in free else 1  # under data_parallel(), dp is already manual
    tok_dp = "dp" if dp > 1 and N % dp == 0 else None
    names = frozenset(a for a in ("dp", "ep", "tp") if a in free)
    path = path or _default_path()
    if path == "auto":
        path = "all_to_all" if e_split and N % (dp * sizes["ep"]) == 0 and N // (dp * sizes["ep"]) >= _a2a_min_tokens() \
            else "psum"
    if path == "all_to_all" and not (e_split and N % (dp * sizes["ep"]) == 0):
        path = "psum"
    kw = dict(swiglu_limit=swiglu_limit, act_block=act_block, implementation=implementation)

    if path == "psum":
        tok = P(tok_dp)
        red = tuple(a for a, on in (("ep", e_split), ("tp", i_split)) if on)

        def body(xs, ws, ids, a, b, c):
            if e_split:
                lo = jax.lax.axis_index("ep") * e_loc
                li = ids - lo
                ok = (li >= 0) & (li < e_loc)
                ws = jnp.where(ok, ws, 0.0)
                ids = jnp.where(ok, li, -1)  # no local expert: the kernels skip the pair
            # the other shards' pairs come as -1: the rows per local expert are pairs / n_exp
            y = _local_experts(xs, ws, ids, a, b, c, i_split, {**kw, "routed_experts": n_exp} if e_split else kw)
            return jax.lax.psum(y, red) if red else y

        f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *specs), out_specs=tok, axis_names=names,
                          check_vma=False)
        return f(x, weights.astype(jnp.float32), indices.astype(jnp.int32), w1, w2, w3)

    if path != "all_to_all":
        raise ValueError(f"expert-parallel path must be psum, all_to_all or auto, got {path!r}")
    ep = sizes["ep"]
    tok = P(("dp", "ep") if dp > 1 else "ep")

    def body(xs, ws, ids, a, b, c):
        n, k = ids.shape
        cap = n * k  # worst case: every pair of this shard goes to one peer
        dest = ids // e_loc  # [n, k] peer
        flat_dest = dest.reshape(-1)
        flat_tok = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
        # slot of each pair inside its destination's buffer: rank among pairs with the same dest
        onehot = (flat_dest[:, None] == jnp.arange(ep)[None, :]).astype(jnp.int32)  # [nk, ep]
        slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # [nk]
        send_x = jnp.zeros((ep, cap, xs.shape[-1]), xs.dtype).at[flat_dest, slot].set(xs[flat_tok])
        send_w = jnp.zeros((ep, cap), jnp.float32).at[flat_dest, slot].set(ws.reshape(-1))
        # empty slots as expert -1: the kernels skip them (expert 0 with weight 0 gave the same sum,
        # but its weights were read for every empty slot)
        send_e = jnp.full((ep, cap), -1, jnp.int32).at[flat_dest, slot].set((ids % e_loc).reshape(-1))
        recv_x = jax.lax.all_to_all(send_x, "ep", 0, 0, tiled=True)
        recv_w = jax.lax.all_to_all(send_w, "ep", 0, 0, tiled=True)
        recv_e = jax.lax.all_to_all(send_e, "ep", 0, 0, tiled=True)
        # the ep * cap slots hold about n * k real pairs per shard on average: rows per local expert
        # are slots / n_exp (routed_experts), not slots / e_loc
        y = _local_experts(recv_x.reshape(ep * cap, -1), recv_w.reshape(-1, 1), recv_e.reshape(-1, 1), a, b, c,
                           i_split, {**kw, "routed_experts": n_exp})  # empty slots: expert -1, weight 0 -> 0
        if i_split:
            y = jax.lax.psum(y, "tp")
        back = jax.lax.all_to_all(y.reshape(ep, cap, -1), "ep", 0, 0, tiled=True)
        rows = back[flat_dest, slot]  # [nk, D] f32
        return jnp.sum(rows.reshape(n, k, -1), axis=1)

    f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *specs), out_specs=tok, axis_names=names,
                      check_vma=False)
    return f(x, weights.astype(jnp.float32), indices.astype(jnp.int32), w1, w2, w3)


def _local_experts(x, w, ids, w1, w2, w3, i_split, kw):
    """The local experts on local tokens -> f32 [n, D] (a partial sum over I when ``i_split``)."""
    return moe_experts(x, w, ids, w1, w2, w3, **kw).astype(jnp.float32)
