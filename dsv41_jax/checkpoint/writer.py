"""Write parameters in DeepSeek's official safetensors layout: official tensor names, F8_E4M3
weights with F8_E8M0 32x32 ``.scale``, MXFP4 experts as I8 packed bytes (as the released V4.1
checkpoint; ``fp4_dtype="U8"`` for torch's float4_e2m1fn_x2 byte type) with F8_E8M0 scales per 32,
BF16 / F32 elsewhere; several ``model-0000i-of-0000n.safetensors`` shards, a
``model.safetensors.index.json`` and a ``config.json`` (HF composite, with ``quantization_config``
when the weights are FP8, so :meth:`ModelConfig.from_json` gives back the same config) plus the
flat inference keys in ``inference_config.json``.

Parameters may be given unquantized where the config wants FP8/FP4 (a ``{"weight": array}`` node
where :func:`~dsv41_jax.params.param_specs` has an :class:`Fp8Tensor` / :class:`Fp4Tensor`): they are
quantized on write with :func:`~dsv41_jax.quant.quantize_fp8` / :func:`~dsv41_jax.quant.quantize_mxfp4`,
which follow DeepSeek's format (ue8m0 power-of-two block scales). Tensors are produced one at a
time, so writing holds at most one parameter node on the host beyond the tree itself.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..params import param_specs
from ..quant import Fp4Tensor, Fp8Tensor, quantize_fp8, quantize_mxfp4
from .layout import key_name, leaf_table
from .loader import INDEX_FILE
from .safetensors_io import DTYPES, CheckpointError, dtype_name, write_file

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

_HF_KEYS = (  # HF text_config key <- ModelConfig field (inverse of ModelConfig._from_hf)
    ("vocab_size", "vocab_size"),
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_nextn_predict_layers", "n_mtp_layers"),
    ("num_attention_heads", "n_heads"),
    ("head_dim", "head_dim"),
    ("qk_rope_head_dim", "rope_head_dim"),
    ("q_lora_rank", "q_lora_rank"),
    ("o_groups", "o_groups"),
    ("o_lora_rank", "o_lora_rank"),
    ("sliding_window", "window_size"),
    ("moe_intermediate_size", "moe_inter_dim"),
    ("n_routed_experts", "n_routed_experts"),
    ("n_shared_experts", "n_shared_experts"),
    ("num_experts_per_tok", "n_activated_experts"),
    ("scoring_func", "score_func"),
    ("gate_temp", "gate_temp"),
    ("norm_topk_prob", "norm_topk_prob"),
    ("routed_scaling_factor", "route_scale"),
    ("swiglu_limit", "swiglu_limit"),
    ("rms_norm_eps", "norm_eps"),
    ("hc_mult", "hc_mult"),
    ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
    ("hc_eps", "hc_eps"),
    ("compress_ratios", "compress_ratios"),
    ("kv_source_layer_ids", "kv_source_layers"),
    ("index_source_layer_ids", "index_source_layers"),
    ("candidate_source_layer_id", "candidate_source_layer"),
    ("candidate_topk_blocks", "candidate_topk_blocks"),
    ("candidate_block_size", "candidate_block_size"),
    ("rope_theta", "rope_theta"),
    ("compress_rope_theta", "compress_rope_theta"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("index_n_heads", "index_n_heads"),
    ("index_head_dim", "index_head_dim"),
    ("index_topk", "index_topk"),
    ("engram_layer_ids", "engram_layer_ids"),
    ("engram_num_embeddings", "engram_num_embeddings"),
    ("engram_max_ngram_size", "engram_max_ngram_size"),
    ("engram_vocab_size", "engram_vocab_size"),
    ("engram_n_heads", "engram_n_heads"),
    ("engram_head_dim", "engram_head_dim"),
    ("engram_pad_id", "engram_pad_id"),
    ("engram_compressed_vocab_size", "engram_compressed_vocab_size"),
    ("dspark_block_size", "dspark_block_size"),
    ("dspark_noise_token_id", "dspark_noise_token_id"),
    ("dspark_target_layer_ids", "dspark_target_layer_ids"),
    ("dspark_markov_rank", "dspark_markov_rank"),
    ("dspark_n_routed_experts", "dspark_n_routed_experts"),
    ("dspark_num_experts_per_tok", "dspark_n_activated_experts"),
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "pad_token_id"),
)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF composite ``config.json`` (``deepseek_v41`` with a ``text_config``) for ``cfg``."""
    d = cfg.to_dict()
    t: dict[str, Any] = {"model_type": "deepseek_v41_text"}
    for hk, f in _HF_KEYS:
        t[hk] = d[f]
    t["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": cfg.rope_factor,
        "beta_fast": cfg.beta_fast,
        "beta_slow": cfg.beta_slow,
        "original_max_position_embeddings": cfg.original_seq_len,
    }
    t["hidden_act"] = "silu"
    t["tie_word_embeddings"] = False
    t["torch_dtype"] = "bfloat16"
    out: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": t,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if cfg.dtype == "fp8":
        out["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [cfg.fp8_block_size, cfg.fp8_block_size],
            "expert_dtype": cfg.expert_dtype,
        }
    else:
        t["expert_dtype"] = cfg.expert_dtype
    if cfg.gate_bias_vl:  # the loader infers the VL routing bias from the presence of a vision tower
        out["vision_config"] = {}
    return out


def write_config(cfg: ModelConfig, root: str, config_format: str = "hf") -> None:
    """``config.json`` (HF composite, or the flat inference keys when ``config_format="flat"`` or
    when the HF keys cannot express ``cfg`` exactly) and ``inference_config.json`` (flat). A V4
    config is always written flat (its ``family`` key selects V4 when read back): the HF composite
    written here is V4.1's (``deepseek_v41``), which a V4 layout does not fit."""
    flat = cfg.to_dict()
    body = flat
    if config_format not in ("hf", "flat"):
        raise ValueError(f"config_format must be 'hf' or 'flat', got {config_format!r}")
    if config_format == "hf" and not cfg.is_v4:
        hf = config_to_hf(cfg)
        if ModelConfig.from_dict(json.loads(json.dumps(hf))) == cfg:
            body = hf
        else:
            warnings.warn("config cannot be expressed exactly in HF format; writing the flat inference keys")
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(body, f, indent=1)
    with open(os.path.join(root, "inference_config.json"), "w") as f:
        json.dump(flat, f, indent=1)


def _lookup(params, path: tuple[str, ...]):
    node = params
    for i, k in enumerate(path):
        if isinstance(node, (Fp8Tensor, Fp4Tensor)):
            raise KeyError(f"{'.'.join(path[:i])} is quantized ({type(node).__name__}) but the config stores it unquantized")
        if not isinstance(node, dict) or k not in node:
            raise KeyError(f"{'.'.join(path[: i + 1])} is missing")
        node = node[k]
    return node


class _Resolver:
    """Turns the params node for one spec node into host numpy in the config's format (quantizing
    on the fly); remembers the last node so expert slices and weight/scale pairs reuse it."""

    def __init__(self, params):
        self.params = params
        self.key = None
        self.value = None

    def get(self, node_path: tuple[str, ...], spec):
        if self.key == node_path:
            return self.value
        self.key, self.value = None, None
        p = _lookup(self.params, node_path)
        if isinstance(spec, (Fp8Tensor, Fp4Tensor)):
            kind = type(spec)
            if isinstance(p, dict) and set(p) == {"weight"}:
                x = jnp.asarray(p["weight"])
                p = quantize_fp8(x, spec.block) if kind is Fp8Tensor else quantize_mxfp4(x, spec.block)
            elif not isinstance(p, kind):
                raise KeyError(f"{'.'.join(node_path)}: config expects {kind.__name__}, params hold {type(p).__name__}")
            elif p.block != spec.block:
                raise KeyError(f"{'.'.join(node_path)}: block {p.block}, config expects {spec.block}")
            if isinstance(p, Fp4Tensor):  # checkpoints hold the nibble layout (an engine may have repacked)
                p = p.with_packing("nibbles")
            val = type(p)(data=np.asarray(p.data), scale=np.asarray(p.scale), block=p.block)
            for part, s in (("data", spec.data), ("scale", spec.scale)):
                a = getattr(val, part)
                if a.shape != s.shape or a.dtype != s.dtype:
                    raise KeyError(
                        f"{'.'.join(node_path)}.{part}: params {a.dtype}{list(a.shape)}, config expects {np.dtype(s.dtype)}{list(s.shape)}"
                    )
        else:
            if isinstance(p, (Fp8Tensor, Fp4Tensor)):
                raise KeyError(f"{'.'.join(node_path)} is quantized but the config stores it as {np.dtype(spec.dtype)}")
            val = np.asarray(p)
            if val.shape != spec.shape:
                raise KeyError(f"{'.'.join(node_path)}: params shape {list(val.shape)}, config expects {list(spec.shape)}")
            if val.dtype != spec.dtype:
                val = val.astype(spec.dtype)
        self.key, self.value = node_path, val
        return val


def save_checkpoint(
    params: dict,
    cfg: ModelConfig,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    fp4_dtype: str = "I8",
    config_format: str = "hf",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``params`` (the tree of :func:`~dsv41_jax.params.param_specs`, possibly unquantized
    where the config quantizes) as an official-format checkpoint directory ``path``. Written into
    ``path.partial`` and renamed at the end, so a crash leaves no complete-looking directory.
    Returns the index dict (``metadata.total_size``, ``weight_map``)."""
    if fp4_dtype not in ("I8", "U8"):
        raise ValueError(f"fp4_dtype must be 'I8' or 'U8', got {fp4_dtype!r}")
    path = os.fspath(path).rstrip("/")
    if os.path.exists(path) and not overwrite:
        raise CheckpointError(f"{path} already exists (pass overwrite=True to replace it)")
    specs = param_specs(cfg)
    entries, _ = leaf_table(cfg, specs)
    nodes = dict(
        (tuple(key_name(k) for k in p), n)
        for p, n in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, (Fp8Tensor, Fp4Tensor)))[0]
    )
    res = _Resolver(params)

    # 1. check that every node resolves (cheap for already-quantized trees; collects all problems)
    problems = []
    for np_, spec in nodes.items():
        try:
            if isinstance(spec, (Fp8Tensor, Fp4Tensor)):
                p = _lookup(params, np_)
                if not (isinstance(p, type(spec)) or isinstance(p, dict) and set(p) == {"weight"}):
                    raise KeyError(f"{'.'.join(np_)}: config expects {type(spec).__name__}, params hold {type(p).__name__}")
            else:
                p = _lookup(params, np_)
                if isinstance(p, (Fp8Tensor, Fp4Tensor, dict)):
                    raise KeyError(f"{'.'.join(np_)}: config expects a {np.dtype(spec.dtype)} array, params hold {type(p).__name__}")
        except KeyError as e:
            problems.append(str(e.args[0]))
    if problems:
        raise CheckpointError(
            f"parameters do not match the config ({len(problems)} problem(s)):\n  " + "\n  ".join(sorted(problems)[:40])
        )

    # 2. the tensor list: (name, dtype name, shape, getter)
    tensors = []
    for e in entries:
        parts = e.name.split(".")
        if parts[-1] in ("weight", "scale") and tuple(parts[:-1]) in nodes and isinstance(
            nodes[tuple(parts[:-1])], (Fp8Tensor, Fp4Tensor)
        ):
            node_path, field = tuple(parts[:-1]), ("data" if parts[-1] == "weight" else "scale")
        else:
            node_path, field = tuple(parts), None
        spec = nodes[node_path]
        dt = fp4_dtype if e.dtype == np.uint8 else dtype_name(e.dtype)

        def getter(node_path=node_path, spec=spec, field=field, idx=None, e=e):
            v = res.get(node_path, spec)
            a = getattr(v, field) if field else v
            if idx is not None:
                a = a[idx]
            if e.dtype == np.uint8 and fp4_dtype == "I8":
                a = np.ascontiguousarray(a).view(np.int8)
            return a

        if e.stacked:
            for i, s in enumerate(e.sources):
                tensors.append((s, dt, e.source_shape, lambda g=getter, i=i: g(idx=i)))
        else:
            tensors.append((e.sources[0], dt, e.shape, getter))

    # 3. shards
    shards: list[list] = [[]]
    size = 0
    for t in tensors:
        nb = math.prod(t[2]) * _itemsize(t[1])
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nb
    n = len(shards)
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map, total = {}, 0
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_file(os.path.join(tmp, fn), sh, metadata={"format": "pt"})
        for t in sh:
            weight_map[t[0]] = fn
            total += math.prod(t[2]) * _itemsize(t[1])
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=1)
    write_config(cfg, tmp, config_format)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    return index


def _itemsize(dt: str) -> int:
    return DTYPES[dt].itemsize
