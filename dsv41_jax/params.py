"""The parameter tree: its structure, its official checkpoint names, abstract shapes and random
initialisation.

Structure. The tree is the official DeepSeek tensor-name hierarchy (``shared/spec/model.md`` §10,
``attention.md`` §9.7) split on ``.``: ``layers.3.attn.wq_b`` is ``params["layers"]["3"]["attn"]
["wq_b"]``. Every key is a string, every node a dict, except two kinds of node that stand for a
pair of checkpoint tensors ``X.weight`` + ``X.scale``:

* :class:`~dsv41_jax.quant.Fp8Tensor` (e4m3 data, e8m0 32x32 block scales; Engram tables use 1x32);
* :class:`~dsv41_jax.quant.Fp4Tensor` (MXFP4 experts: packed e2m1 bytes, e8m0 scale per 32).

An unquantized linear is ``{"weight": array}``. The routed experts of one MoE are **stacked**:
``ffn.experts.{w1,w2,w3}`` hold ``[E, ...]`` tensors and map one-to-one onto the official
``ffn.experts.{e}.{w1,w2,w3}.{weight,scale}`` names (slice ``e``). Weights stay quantized in memory:
nothing here expands the model to bf16.

Functions: :func:`param_specs` (shapes/dtypes, no memory; ``jax.eval_shape`` friendly),
:func:`init_params` (random weights in the real formats), :func:`to_official` /
:func:`official_shapes` (name <-> tree), :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .quant import Fp4Tensor, Fp8Tensor, quantize_fp8, quantize_mxfp4
from .quant.tensors import fp8_scale_shape

SDS = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32

# Random-initialisation recipes (the fixture's, `shared/fixtures/v41_tiny_a/README.md` §6), by leaf name.
_INIT_KINDS = ("linear", "norm", "sink", "hc_fn", "hc_base", "hc_scale", "gate_bias", "gate_weight",
               "weights_proj", "engram_qk", "engram_table", "ape", "tid2eid")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A parameter's description before it exists: shape, storage format, init recipe."""

    shape: tuple
    fmt: str  # "bf16" | "f32" | "fp8" | "fp4" | "i32"
    init: str
    block: object = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    def spec(self):
        if self.fmt == "fp8":
            block = self.block or (32, 32)
            return Fp8Tensor(
                data=SDS(self.shape, jnp.float8_e4m3fn),
                scale=SDS(fp8_scale_shape(self.shape, block), jnp.float8_e8m0fnu),
                block=block,
            )
        if self.fmt == "fp4":
            block = self.block or 32
            return Fp4Tensor(
                data=SDS((*self.shape[:-1], self.shape[-1] // 2), jnp.uint8),
                scale=SDS((*self.shape[:-1], self.shape[-1] // block), jnp.float8_e8m0fnu),
                block=block,
            )
        if self.fmt == "i32":
            return SDS(self.shape, jnp.int32)
        return SDS(self.shape, BF16 if self.fmt == "bf16" else F32)


def _linear(cfg: ModelConfig, out: int, inp: int, fmt: str | None = None, stack: int | None = None):
    """A Linear [out, in] in the checkpoint's format for it (``fmt`` None = the config's ``dtype``).
    Quantized: the node itself is the Fp8/Fp4 leaf. Plain: ``{"weight": leaf}``."""
    fmt = fmt or ("fp8" if cfg.dtype == "fp8" else "bf16")
    shape = (out, inp) if stack is None else (stack, out, inp)
    if fmt == "fp8":
        return Leaf(shape, "fp8", "linear", (cfg.fp8_block_size, cfg.fp8_block_size))
    if fmt == "fp4":
        return Leaf(shape, "fp4", "linear", cfg.fp4_block_size)
    return {"weight": Leaf(shape, fmt, "linear")}


def _norm(dim: int):
    return {"weight": Leaf((dim,), "bf16", "norm")}


def _compressor(cfg: ModelConfig, layer: int, d_out: int) -> dict:
    """A V4 compressor (``attention.md`` §5.1): wkv/wgate [coff*d, D] bf16, ape [m, coff*d] f32, norm [d]."""
    m, coff = cfg.ratio(layer), 2 if cfg.overlap(layer) else 1
    return {
        "ape": Leaf((m, coff * d_out), "f32", "ape"),
        "wkv": _linear(cfg, coff * d_out, cfg.dim, "bf16"),
        "wgate": _linear(cfg, coff * d_out, cfg.dim, "bf16"),
        "norm": _norm(d_out),
    }


def _attention(cfg: ModelConfig, layer: int) -> dict:
    d, h, dh, lq = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    a: dict[str, Any] = {
        "wq_a": _linear(cfg, lq, d),
        "q_norm": _norm(lq),
        "wq_b": _linear(cfg, h * dh, lq),
        "wkv": _linear(cfg, dh, d),
        "kv_norm": _norm(dh),
        "wo_a": _linear(cfg, cfg.o_groups * cfg.o_lora_rank, h * dh // cfg.o_groups),
        "wo_b": _linear(cfg, d, cfg.o_groups * cfg.o_lora_rank),
        "attn_sink": Leaf((h,), "f32", "sink"),
    }
    backbone = layer < cfg.n_layers
    if cfg.is_v4:
        if backbone and cfg.ratio(layer) > 0:
            a["compressor"] = _compressor(cfg, layer, dh)
            if cfg.ratio(layer) == 4:  # CSA: an indexer with its own compressor
                a["indexer"] = {
                    "wq_b": _linear(cfg, cfg.index_n_heads * cfg.index_head_dim, lq),
                    "weights_proj": {"weight": Leaf((cfg.index_n_heads, d), "bf16", "weights_proj")},
                    "compressor": _compressor(cfg, layer, cfg.index_head_dim),
                }
        return a
    if backbone and layer in cfg.kv_source_layers:
        c = {"wkv": _linear(cfg, dh, d, "bf16"), "norm": _norm(dh)}
        if cfg.ratio(layer) > 1:
            c["wgate"] = _linear(cfg, dh, d, "bf16")
        a["compressor"] = c
    if backbone and layer in cfg.index_source_layers:
        ix: dict[str, Any] = {
            "wq_b": _linear(cfg, cfg.index_n_heads * cfg.index_head_dim, lq),
            "weights_proj": {"weight": Leaf((cfg.index_n_heads, d), "bf16", "weights_proj")},
        }
        if layer in cfg.kv_source_layers:
            ix["wk"] = _linear(cfg, cfg.index_head_dim, dh, "bf16")
            ix["k_norm"] = _norm(cfg.index_head_dim)
        a["indexer"] = ix
    return a


def _moe(cfg: ModelConfig, layer: int) -> dict:
    d, inter = cfg.dim, cfg.moe_inter_dim
    n_exp, n_act = cfg.moe_experts(layer)
    efmt = {"fp4": "fp4", "fp8": "fp8", "bf16": "bf16", None: None}[cfg.expert_dtype]
    gate = {"weight": Leaf((n_exp, d), "bf16", "gate_weight"), "bias": Leaf((n_exp,), "f32", "gate_bias")}
    if cfg.is_hash_layer(layer):  # V4 hash routing: a token -> experts table instead of the bias
        gate = {"weight": gate["weight"], "tid2eid": Leaf((cfg.vocab_size, n_act), "i32", "tid2eid", n_exp)}
    if cfg.gate_bias_vl:
        gate["bias_vl"] = Leaf((n_exp,), "f32", "gate_bias")
    return {
        "gate": gate,
        "experts": {
            "w1": _linear(cfg, inter, d, efmt, stack=n_exp),
            "w2": _linear(cfg, d, inter, efmt, stack=n_exp),
            "w3": _linear(cfg, inter, d, efmt, stack=n_exp),
        },
        "shared_experts": {
            "w1": _linear(cfg, inter, d),
            "w2": _linear(cfg, d, inter),
            "w3": _linear(cfg, inter, d),
        },
    }


def _block(cfg: ModelConfig, layer: int) -> dict:
    hcd = cfg.hc_mult * cfg.dim
    b: dict[str, Any] = {
        "attn_norm": _norm(cfg.dim),
        "ffn_norm": _norm(cfg.dim),
        "attn": _attention(cfg, layer),
        "ffn": _moe(cfg, layer),
    }
    for site in ("attn", "ffn"):
        b[f"hc_{site}_fn"] = Leaf((cfg.mix_hc, hcd), "f32", "hc_fn")
        b[f"hc_{site}_base"] = Leaf((cfg.mix_hc,), "f32", "hc_base")
        b[f"hc_{site}_scale"] = Leaf((3,), "f32", "hc_scale")
    if layer in cfg.engram_layer_ids:
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
        b["engram"] = {
            "embed": Leaf((rows, cfg.engram_head_dim), "fp8", "engram_table", (1, cfg.fp8_block_size)),
            "wkv": _linear(cfg, cfg.dim * (cfg.hc_mult + 1), cfg.engram_n_hash_cols * cfg.engram_head_dim),
            "q_weight": Leaf((cfg.hc_mult, cfg.dim), "bf16", "engram_qk"),
            "k_weight": Leaf((cfg.hc_mult, cfg.dim), "bf16", "engram_qk"),
        }
    return b


def param_layout(cfg: ModelConfig) -> dict:
    """The tree of :class:`Leaf` descriptions."""
    tree: dict[str, Any] = {
        "embed": {"weight": Leaf((cfg.vocab_size, cfg.dim), "bf16", "linear")},
        "layers": {str(i): _block(cfg, i) for i in range(cfg.n_layers)},
        "norm": _norm(cfg.dim),
        "head": {"weight": Leaf((cfg.vocab_size, cfg.dim), "bf16", "linear")},
    }
    if cfg.has_hc_head:
        tree.update(_hc_head(cfg))
    if cfg.has_mtp:  # V4 MTP blocks (model.md §7)
        mtp = {}
        for k in range(cfg.n_mtp_layers):
            stage = _block(cfg, cfg.n_layers + k)
            stage["e_proj"] = _linear(cfg, cfg.dim, cfg.dim)
            stage["h_proj"] = _linear(cfg, cfg.dim, cfg.dim)
            stage["enorm"] = _norm(cfg.dim)
            stage["hnorm"] = _norm(cfg.dim)
            stage["norm"] = _norm(cfg.dim)
            stage.update(_hc_head(cfg))
            mtp[str(k)] = stage
        tree["mtp"] = mtp
    elif cfg.n_mtp_layers and cfg.dspark_block_size:
        mtp = {}
        for k in range(cfg.n_mtp_layers):
            stage = _block(cfg, cfg.n_layers + k)
            if k == 0:
                stage["main_proj"] = _linear(cfg, cfg.dim, cfg.dim * len(cfg.dspark_target_layer_ids))
                stage["main_norm"] = _norm(cfg.dim)
            if k == cfg.n_mtp_layers - 1:
                r = cfg.dspark_markov_rank
                stage["norm"] = _norm(cfg.dim)
                stage["markov_head"] = {
                    "embed": {"weight": Leaf((cfg.vocab_size, r), "bf16", "linear")},
                    "head": {"weight": Leaf((cfg.vocab_size, r), "bf16", "linear")},
                }
                stage["confidence_head"] = {"proj": {"weight": Leaf((1, cfg.dim + r), "bf16", "linear")}}
            mtp[str(k)] = stage
        tree["mtp"] = mtp
    return tree


def _hc_head(cfg: ModelConfig) -> dict:
    """V4's final stream reduction (model.md §4.4): fn [hc, hc*D], base [hc], scale [1], all f32."""
    hc = cfg.hc_mult
    return {"hc_head_fn": Leaf((hc, hc * cfg.dim), "f32", "hc_fn"), "hc_head_base": Leaf((hc,), "f32", "hc_base"),
            "hc_head_scale": Leaf((1,), "f32", "hc_scale")}


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def param_specs(cfg: ModelConfig) -> dict:
    """Shapes and dtypes of every parameter, as ShapeDtypeStructs inside the real tree types."""
    return jax.tree.map(lambda l: l.spec(), param_layout(cfg), is_leaf=_is_leaf)


# ---------------------------------------------------------------------------------------------
# random initialisation


def _scale_draft(kind: str, n, fan_in: int, hc_dim: int):
    """Turn a standard-normal draft ``n`` (uniform [0, 1) for ``hc_scale``) into the recipe's values."""
    if kind == "linear":
        return n / math.sqrt(fan_in)
    if kind == "norm":
        return 1.0 + 0.1 * n
    if kind in ("sink", "hc_base", "gate_bias"):
        return 0.5 * n
    if kind == "hc_fn":
        return n / math.sqrt(hc_dim)
    if kind == "hc_scale":
        return 0.5 + n
    if kind == "gate_weight":
        return 4.0 * n / math.sqrt(fan_in)
    if kind == "weights_proj":
        return 16.0 * n / math.sqrt(fan_in)
    if kind == "engram_qk":
        return 1.0 + 0.3 * n
    if kind == "engram_table":
        return 0.5 * n
    if kind == "ape":
        return 0.5 * n
    raise ValueError(kind)


def _tid2eid(draft, n_experts: int):
    """Distinct experts per row from a normal draft [V, k]: a random start plus even strides."""
    k = draft.shape[-1]
    start = jnp.floor(jnp.abs(draft[..., :1]) * 1000.0).astype(jnp.int32)
    return ((start + jnp.arange(k, dtype=jnp.int32) * max(n_experts // k, 1)) % n_experts).astype(jnp.int32)


def _finish(leaf: "Leaf", draft, hc_dim: int):
    if leaf.init == "tid2eid":
        return _tid2eid(draft, leaf.block)
    x = _scale_draft(leaf.init, draft, leaf.shape[-1], hc_dim)
    if leaf.fmt == "fp8":
        return quantize_fp8(x, leaf.block)
    if leaf.fmt == "fp4":
        return quantize_mxfp4(x, leaf.block)
    return x.astype(BF16 if leaf.fmt == "bf16" else F32)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _finish_group(leaves: tuple, drafts, hc_dim: int):
    return [_finish(l, d, hc_dim) for l, d in zip(leaves, drafts)]


@functools.partial(jax.jit, static_argnums=(0, 2))
def _make_on_device(leaf: "Leaf", key, hc_dim: int):
    draft = (jax.random.uniform(key, leaf.shape, F32) if leaf.init == "hc_scale"
             else jax.random.normal(key, leaf.shape, F32))
    return _finish(leaf, draft, hc_dim)


_BIG = 1 << 24  # elements: a leaf this large is drawn on the device, one compiled call per signature
_GROUP = 1 << 26  # smaller leaves are drawn on the host and quantized together, this many per call


def init_params(cfg: ModelConfig, seed: int = 0, mesh=None) -> dict:
    """Random weights at the config's shapes, in the checkpoint's formats (FP8 e4m3 + e8m0 32x32,
    MXFP4 experts, bf16/fp32 elsewhere), with the fixture's init recipes. Deterministic in
    ``seed``. Small leaves are drawn with numpy and quantized together in one compiled call; large
    ones are drawn on the device one at a time (peak memory: one leaf's float32 draft).

    ``mesh``: place every leaf on its sharding (``sharding.rules.param_shardings``) as soon as it is
    made, so that a model larger than one device's memory (full-size V4-Flash on two H200s) is
    built without ever being whole on one device. The values do not depend on the mesh."""
    layout = param_layout(cfg)
    leaves, treedef = jax.tree.flatten(layout, is_leaf=_is_leaf)
    by_leaf = None
    if mesh is not None:
        from sharding.rules import param_shardings

        shard_leaves = jax.tree.leaves(param_shardings(cfg, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        by_leaf = []  # one Sharding per layout leaf (a quantized leaf has one per part: data, scale)
        pos = 0
        for leaf in leaves:
            n = len(jax.tree.leaves(leaf.spec()))
            by_leaf.append(shard_leaves[pos:pos + n])
            pos += n
        if pos != len(shard_leaves):
            raise ValueError(f"init_params: {len(shard_leaves)} shardings for {pos} parameter arrays")

    def place(i, v):
        if by_leaf is None:
            return v
        parts, tdef = jax.tree.flatten(v)
        return jax.tree.unflatten(tdef, [jax.device_put(a, sh) for a, sh in zip(parts, by_leaf[i])])

    hc_dim = cfg.hc_mult * cfg.dim
    out: list = [None] * len(leaves)
    group: list[int] = []
    drafts: list = []
    size = 0

    def flush():
        nonlocal group, drafts, size
        if group:
            made = _finish_group(tuple(leaves[i] for i in group), drafts, hc_dim)
            for i, v in zip(group, made):
                out[i] = place(i, v)
        group, drafts, size = [], [], 0

    for i, leaf in enumerate(leaves):
        n = int(np.prod(leaf.shape))
        if n >= _BIG:
            out[i] = place(i, _make_on_device(leaf, jax.random.fold_in(jax.random.PRNGKey(seed), i), hc_dim))
            continue
        if size + n > _GROUP:
            flush()
        rng = np.random.default_rng([seed, i])
        drafts.append(rng.random(leaf.shape, np.float32) if leaf.init == "hc_scale"
                      else rng.standard_normal(leaf.shape, np.float32))
        group.append(i)
        size += n
    flush()
    return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------
# official names

_EXPERTS = re.compile(r"(^|\.)experts$")


def _walk(tree, prefix: str, fn: Callable[[str, Any], None]):
    if isinstance(tree, dict):
        for k, v in tree.items():
            _walk(v, f"{prefix}.{k}" if prefix else k, fn)
    else:
        fn(prefix, tree)


def to_official(tree: dict) -> dict[str, Any]:
    """Flatten a parameter (or spec) tree to ``{official name: array}``. Quantized nodes give
    ``X.weight`` and ``X.scale``; stacked experts give one entry per expert (a slice)."""
    out: dict[str, Any] = {}

    def emit(name, node):
        if isinstance(node, (Fp8Tensor, Fp4Tensor)):
            out[f"{name}.weight"] = node.data
            out[f"{name}.scale"] = node.scale
        else:
            out[name] = node

    def visit(name, node):
        parent, _, last = name.rpartition(".")
        grand = parent.rpartition(".")[0] if parent else ""
        if parent.endswith("experts") and not parent.endswith("shared_experts") and last in ("w1", "w2", "w3") or (
            _EXPERTS.search(grand) and not grand.endswith("shared_experts") and last == "weight"
        ):
            base = parent if last in ("w1", "w2", "w3") else grand
            w = last if last in ("w1", "w2", "w3") else parent.rpartition(".")[2]
            n = (node.data if isinstance(node, (Fp8Tensor, Fp4Tensor)) else node).shape[0]
            for e in range(n):
                sl = jax.tree.map(lambda a: _slice0(a, e), node)
                emit(f"{base}.{e}.{w}" if last in ("w1", "w2", "w3") else f"{base}.{e}.{w}.weight", sl)
        else:
            emit(name, node)

    _walk(tree, "", visit)
    return out


def _slice0(a, e):
    if isinstance(a, SDS):
        return SDS(a.shape[1:], a.dtype)
    return a[e]


def official_shapes(cfg: ModelConfig) -> dict[str, SDS]:
    """``{official tensor name: ShapeDtypeStruct}`` for every tensor a checkpoint of ``cfg`` holds."""
    return to_official(param_specs(cfg))


# ---------------------------------------------------------------------------------------------
# counting


def _logical_size(node) -> int:
    if isinstance(node, Fp4Tensor):
        return int(np.prod(node.data.shape)) * 2
    if isinstance(node, Fp8Tensor):
        return int(np.prod(node.data.shape))
    return int(np.prod(node.shape))


def count_params(tree: dict) -> dict[str, int]:
    """Logical parameter counts (FP4 counts two per byte; scales are not parameters):
    ``backbone`` (embed, head, norm, layers without Engram), ``engram`` (tables + Engram wkv and
    q/k weights), ``dspark`` (the mtp stages), ``total``."""
    counts = {"backbone": 0, "engram": 0, "dspark": 0}

    def visit(name, node):
        n = _logical_size(node)
        if name.startswith("mtp."):
            counts["dspark"] += n
        elif ".engram." in name:
            counts["engram"] += n
        else:
            counts["backbone"] += n

    def walk(tree, prefix):
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            visit(prefix, tree)

    walk(tree, "")
    counts["total"] = sum(counts.values())
    return counts
