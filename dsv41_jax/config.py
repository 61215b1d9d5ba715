"""Model configuration: one frozen dataclass, read from DeepSeek's official ``config.json`` (the
flat inference ``ModelArgs`` keys, or the Hugging Face ``deepseek_v41`` composite with a
``text_config``, or the Hugging Face ``deepseek_v4`` config), plus the presets ``v41-flash`` (real
dimensions), ``tiny`` (CPU size, every V4.1 feature switched on), ``v4-flash`` and ``v4-pro``.

Two generations share the code, selected by ``family``:

* ``"v41"`` (V4.1-Flash): shared compressed caches (``kv_source_layers`` / ``index_source_layers``),
  delayed mHC, Engram, DSpark stages.
* ``"v4"`` (V4-Flash / V4-Pro, ``shared/spec/model.md`` §3.1): every compressed layer is its own KV
  source with its own compressor (ratio 4 = CSA: overlapping, plus its own indexer with its own
  index-key compressor; other ratios = HCA: non-overlapping, dense over all complete blocks),
  per-head q RMS normalisation, per-site mHC with ``hc_head``, hash routing in the first
  ``n_hash_layers`` layers, FP8 128x128 weight blocks with 128-wide activation blocks, and
  ``n_mtp_layers`` MTP blocks (not DSpark). ``kv_source_layers`` / ``index_source_layers`` are derived
  (all compressed layers / all ratio-4 layers).

Field names follow DeepSeek's inference ``ModelArgs`` (``shared/spec/model.md`` §1.1).
``compress_ratios`` has one entry per backbone layer followed by one per DSpark stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

_LIST_FIELDS = (
    "compress_ratios",
    "kv_source_layers",
    "index_source_layers",
    "engram_layer_ids",
    "engram_num_embeddings",
    "dspark_target_layer_ids",
)


class ConfigError(ValueError):
    """A config file or preset that cannot describe a valid model."""



def _weight_format(q: dict | None, text: dict, default_block: int, name: str) -> dict:
    """dtype / fp8_block_size / expert_dtype from an HF ``quantization_config`` (None: bf16 weights)."""
    if not q:
        return {"dtype": "bf16", "expert_dtype": text.get("expert_dtype")}
    bs = q.get("weight_block_size", [default_block, default_block])
    if bs[0] != bs[1]:
        raise ConfigError(f"config {name!r}: non-square weight_block_size {bs} is not supported")
    return {"dtype": "fp8", "fp8_block_size": int(bs[0]),
            "expert_dtype": q.get("expert_dtype", text.get("expert_dtype", "fp4"))}

@dataclass(frozen=True)
class ModelConfig:
    # shape
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # MoE
    moe_inter_dim: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # norms and hyper-connections
    norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # compressed attention (CSA2 / CED)
    compress_ratios: tuple[int, ...] = tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # rope / YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    max_position_embeddings: int = 1048576
    # lightning indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark (kept in the parameter tree; the drafter itself is separate work)
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # the MoE gate's separate routing bias for image-span tokens (present in the released
    # checkpoint; the vision tower itself is out of scope, so it is loaded and kept, never used)
    gate_bias_vl: bool = True
    # weight storage
    dtype: str = "fp8"  # "fp8" (e4m3 + e8m0 block scales) or "bf16"
    expert_dtype: str | None = "fp4"  # "fp4" (MXFP4) or None (same as dtype)
    fp8_block_size: int = 32  # weight blocks fp8_block x fp8_block; activation blocks 1 x fp8_block
    fp4_block_size: int = 32
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # generation: "v41" (V4.1-Flash) or "v4" (V4-Flash / V4-Pro); see the module docstring
    family: str = "v41"
    n_hash_layers: int = 0  # V4: layers 0..n_hash_layers-1 route by ``ffn.gate.tid2eid[token]``
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in _LIST_FIELDS:
            object.__setattr__(self, f, tuple(int(v) for v in getattr(self, f)))
        if self.family == "v4":  # every compressed layer owns its caches; CSA layers own an indexer
            rs = self.compress_ratios[: self.n_layers]
            object.__setattr__(self, "kv_source_layers", tuple(l for l, r in enumerate(rs) if r > 0))
            object.__setattr__(self, "index_source_layers", tuple(l for l, r in enumerate(rs) if r == 4))
            object.__setattr__(self, "candidate_source_layer", -1)
        self.validate()

    # ------------------------------------------------------------------ derived quantities
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def is_v4(self) -> bool:
        return self.family == "v4"

    @property
    def has_hc_head(self) -> bool:
        """V4 reduces the streams with ``hc_head`` before the final norm (V4.1: the last ``pre``)."""
        return self.is_v4

    @property
    def has_mtp(self) -> bool:
        """V4's MTP blocks (``mtp.k.{e_proj,h_proj,...}``); V4.1's extra layers are DSpark stages."""
        return self.is_v4 and self.n_mtp_layers > 0

    def overlap(self, layer: int) -> bool:
        """V4: the ratio-4 compressors (main and indexer) pool overlapping windows (coff = 2)."""
        return self.is_v4 and self.ratio(layer) == 4

    def is_hash_layer(self, layer: int) -> bool:
        return self.is_v4 and layer < min(self.n_hash_layers, self.n_layers)

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed cache ``layer`` reads (None for ratio 0)."""
        if layer >= self.n_layers or self.ratio(layer) == 0:
            return None
        srcs = [s for s in self.kv_source_layers if s <= layer]
        return srcs[-1]

    def index_source_of(self, layer: int) -> int | None:
        """The index-source layer whose top-k ``layer`` uses (itself when it is one)."""
        if layer >= self.n_layers or self.ratio(layer) == 0:
            return None
        srcs = [s for s in self.index_source_layers if s <= layer]
        return srcs[-1]

    def uses_candidates(self, layer: int) -> bool:
        return (
            layer in self.index_source_layers
            and 0 <= self.candidate_source_layer < layer
            and layer < self.n_layers
        )

    def moe_experts(self, layer: int) -> tuple[int, int]:
        """(routed experts, activated experts) of a backbone layer or DSpark stage."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(msg):
            raise ConfigError(f"config {self.name!r}: {msg}")

        if self.family not in ("v4", "v41"):
            bad(f"family must be 'v4' or 'v41', got {self.family!r}")
        if len(self.compress_ratios) != self.n_total_layers:
            bad(
                f"compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + n_mtp_layers "
                f"= {self.n_layers} + {self.n_mtp_layers} = {self.n_total_layers}"
            )
        for r in self.compress_ratios:
            if r not in (0, 1, 2, 4, 128) and not (self.is_v4 and r > 1):
                bad(f"unsupported compress ratio {r} in compress_ratios")
        if any(self.compress_ratios[self.n_layers :]):
            bad("DSpark stages / MTP blocks (the last n_mtp_layers entries of compress_ratios) must have ratio 0")
        if self.is_v4:
            if self.engram_layer_ids or self.dspark_block_size:
                bad("V4 has no Engram layers and no DSpark stages")
            if not 0 <= self.n_hash_layers <= self.n_layers:
                bad(f"n_hash_layers {self.n_hash_layers} outside [0, n_layers]")
        else:
            if self.n_hash_layers:
                bad("hash routing (n_hash_layers) exists only in V4")
            self._validate_v41_sources(bad)
        self._validate_common(bad)

    def _validate_v41_sources(self, bad) -> None:
        for name in ("kv_source_layers", "index_source_layers"):
            for s in getattr(self, name):
                if not 0 <= s < self.n_layers or self.compress_ratios[s] == 0:
                    bad(f"{name} contains layer {s}, which is not a backbone layer with a compress ratio > 0")
        for layer in range(self.n_layers):
            r = self.compress_ratios[layer]
            if r == 0:
                continue
            srcs = [s for s in self.kv_source_layers if s <= layer]
            if not srcs:
                bad(f"layer {layer} has compress ratio {r} but no KV-source layer at or before it")
            if self.compress_ratios[srcs[-1]] != r:
                bad(f"layer {layer} (ratio {r}) would read KV source {srcs[-1]} of ratio {self.compress_ratios[srcs[-1]]}")
            isrcs = [s for s in self.index_source_layers if s <= layer]
            if not isrcs:
                bad(f"layer {layer} has compress ratio {r} but no index-source layer at or before it")
        for s in self.kv_source_layers:
            if s not in self.index_source_layers:
                bad(f"KV source layer {s} must also be an index source (it owns the index keys)")
        if self.candidate_source_layer >= 0:
            c = self.candidate_source_layer
            if c not in self.index_source_layers:
                bad(f"candidate_source_layer {c} is not an index source")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                bad("candidate_block_size and candidate_topk_blocks must be > 0 with a candidate source")

    def _validate_common(self, bad) -> None:
        if self.head_dim <= self.rope_head_dim or self.rope_head_dim % 2:
            bad(f"rope_head_dim {self.rope_head_dim} must be even and smaller than head_dim {self.head_dim}")
        if self.index_head_dim <= self.rope_head_dim:
            bad(f"index_head_dim {self.index_head_dim} must exceed rope_head_dim {self.rope_head_dim}")
        if self.n_heads % self.o_groups:
            bad(f"n_heads {self.n_heads} is not divisible by o_groups {self.o_groups}")
        if self.n_activated_experts > self.n_routed_experts:
            bad(f"n_activated_experts {self.n_activated_experts} > n_routed_experts {self.n_routed_experts}")
        if self.n_shared_experts != 1:
            bad(f"n_shared_experts must be 1 (the reference asserts it), got {self.n_shared_experts}")
        if self.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            bad(f"unknown score_func {self.score_func!r}")
        if self.dtype not in ("fp8", "bf16"):
            bad(f"dtype must be 'fp8' or 'bf16', got {self.dtype!r}")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            bad(f"expert_dtype must be 'fp4', 'fp8', 'bf16' or null, got {self.expert_dtype!r}")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            bad(
                f"engram_layer_ids has {len(self.engram_layer_ids)} entries but engram_num_embeddings has "
                f"{len(self.engram_num_embeddings)}"
            )
        for e in self.engram_layer_ids:
            if not 0 <= e < self.n_layers:
                bad(f"engram layer {e} is not a backbone layer")
        if self.engram_layer_ids and self.engram_max_ngram_size < 2:
            bad("engram_max_ngram_size must be >= 2 when Engram layers exist")
        for t in self.dspark_target_layer_ids:
            if not 0 <= t < self.n_layers:
                bad(f"dspark target layer {t} is not a backbone layer")
        if self.n_mtp_layers and self.dspark_block_size and len(self.dspark_target_layer_ids) == 0:
            bad("DSpark stages need dspark_target_layer_ids")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            bad("hc_mult and hc_sinkhorn_iters must be >= 1")
        if self.dtype == "fp8":
            for n, v in (("dim", self.dim), ("q_lora_rank", self.q_lora_rank), ("head_dim", self.head_dim)):
                if v % self.fp8_block_size:
                    bad(f"{n} {v} must be a multiple of the FP8 activation block {self.fp8_block_size}")
        if self.expert_dtype == "fp4":
            for n, v in (("dim", self.dim), ("moe_inter_dim", self.moe_inter_dim)):
                if v % self.fp4_block_size:
                    bad(f"{n} {v} must be a multiple of the FP4 block {self.fp4_block_size}")

    # ------------------------------------------------------------------ I/O
    @classmethod
    def _build(cls, kw: dict[str, Any], name: str) -> "ModelConfig":
        try:
            return cls(**kw)
        except TypeError as e:  # an unexpected or missing field
            raise ConfigError(f"config {name!r}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Build from the flat inference keys or the HF composite (``text_config``) keys; V4
        (``deepseek_v4``, or flat keys with ``n_hash_layers`` / without V4.1's KV sources) is
        recognised from its keys."""
        if "text_config" in d:
            return cls._from_hf(d, name)
        if "hidden_size" in d:
            if _is_v4_hf(d):
                return cls._from_hf_v4(d, name)
            return cls._from_hf({"text_config": d}, name)
        fam = d.get("family")
        if fam == "v4" or (fam is None and ("n_hash_layers" in d or (
                "kv_source_layers" not in d and "engram_layer_ids" not in d and "dspark_block_size" not in d))):
            return cls._from_flat_v4(d, name)
        known = {f.name for f in dataclasses.fields(cls)}
        runtime = {"max_batch_size", "max_seq_len", "temperature", "scale_fmt", "vision_n_layers"}
        kw = {}
        for k, v in d.items():
            if k in known:
                kw[k] = v
            elif k.startswith("vision_") or k in runtime or k == "image_token_id":
                continue  # runtime sizes and the (out of scope) vision tower
        kw.setdefault("name", name)
        # the reference builds Gate.bias_vl only when the vision tower is on
        kw.setdefault("gate_bias_vl", int(d.get("vision_n_layers", 0) or 0) > 0)
        return cls._build(kw, name)

    @classmethod
    def _from_hf(cls, d: dict[str, Any], name: str) -> "ModelConfig":
        t = dict(d["text_config"])
        rs = t.get("rope_scaling") or {}
        q = d.get("quantization_config") or t.get("quantization_config")
        mapping = {
            "vocab_size": "vocab_size",
            "hidden_size": "dim",
            "num_hidden_layers": "n_layers",
            "num_nextn_predict_layers": "n_mtp_layers",
            "num_attention_heads": "n_heads",
            "head_dim": "head_dim",
            "qk_rope_head_dim": "rope_head_dim",
            "q_lora_rank": "q_lora_rank",
            "o_groups": "o_groups",
            "o_lora_rank": "o_lora_rank",
            "sliding_window": "window_size",
            "moe_intermediate_size": "moe_inter_dim",
            "n_routed_experts": "n_routed_experts",
            "n_shared_experts": "n_shared_experts",
            "num_experts_per_tok": "n_activated_experts",
            "scoring_func": "score_func",
            "gate_temp": "gate_temp",
            "norm_topk_prob": "norm_topk_prob",
            "routed_scaling_factor": "route_scale",
            "swiglu_limit": "swiglu_limit",
            "rms_norm_eps": "norm_eps",
            "hc_mult": "hc_mult",
            "hc_sinkhorn_iters": "hc_sinkhorn_iters",
            "hc_eps": "hc_eps",
            "compress_ratios": "compress_ratios",
            "kv_source_layer_ids": "kv_source_layers",
            "index_source_layer_ids": "index_source_layers",
            "candidate_source_layer_id": "candidate_source_layer",
            "candidate_topk_blocks": "candidate_topk_blocks",
            "candidate_block_size": "candidate_block_size",
            "rope_theta": "rope_theta",
            "compress_rope_theta": "compress_rope_theta",
            "max_position_embeddings": "max_position_embeddings",
            "index_n_heads": "index_n_heads",
            "index_head_dim": "index_head_dim",
            "index_topk": "index_topk",
            "engram_layer_ids": "engram_layer_ids",
            "engram_num_embeddings": "engram_num_embeddings",
            "engram_max_ngram_size": "engram_max_ngram_size",
            "engram_vocab_size": "engram_vocab_size",
            "engram_n_heads": "engram_n_heads",
            "engram_head_dim": "engram_head_dim",
            "engram_pad_id": "engram_pad_id",
            "engram_pad_token_id": "engram_pad_id",
            "engram_compressed_vocab_size": "engram_compressed_vocab_size",
            "dspark_block_size": "dspark_block_size",
            "dspark_noise_token_id": "dspark_noise_token_id",
            "dspark_target_layer_ids": "dspark_target_layer_ids",
            "dspark_markov_rank": "dspark_markov_rank",
            "dspark_n_routed_experts": "dspark_n_routed_experts",
            "dspark_num_experts_per_tok": "dspark_n_activated_experts",
            "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id",
            "pad_token_id": "pad_token_id",
        }
        kw: dict[str, Any] = {"name": name}
        for k, v in t.items():
            if k in mapping and v is not None:
                kw[mapping[k]] = v
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in d and d[k] is not None:
                kw[k] = d[k]
        if rs:
            if rs.get("rope_type", rs.get("type", "yarn")) != "yarn":
                raise ConfigError(f"config {name!r}: only YaRN rope_scaling is supported, got {rs}")
            kw["rope_factor"] = rs.get("factor", 16.0)
            kw["original_seq_len"] = rs.get("original_max_position_embeddings", 0)
            kw["beta_fast"] = rs.get("beta_fast", 32)
            kw["beta_slow"] = rs.get("beta_slow", 1)
        else:
            kw["original_seq_len"] = 0
        kw["gate_bias_vl"] = "vision_config" in d
        if "candidate_source_layer" not in kw:
            kw["candidate_source_layer"] = -1
        kw.update(_weight_format(q, t, 32, name))
        return cls._build(kw, name)

    @classmethod
    def _from_flat_v4(cls, d: dict[str, Any], name: str) -> "ModelConfig":
        """The official V4 inference config (``inference/config.json``, ``ModelArgs`` keys)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = dict(_V4_BASE)
        kw.update({k: v for k, v in d.items() if k in known})
        kw["name"] = name
        kw["family"] = "v4"
        if d.get("dtype", "fp8") == "fp8":
            kw.setdefault("fp8_block_size", 128)
        kw["compress_ratios"] = _pad_ratios(list(d.get("compress_ratios", [])), kw.get("n_layers", 43),
                                            kw.get("n_mtp_layers", 1))
        return cls._build(kw, name)

    @classmethod
    def _from_hf_v4(cls, d: dict[str, Any], name: str) -> "ModelConfig":
        """A ``deepseek_v4`` config: the released ``config.json`` (``compress_ratios``,
        ``num_hash_layers``, ``rope_scaling``) or transformers' own form (``layer_types``,
        ``compress_rates``, ``mlp_layer_types``, ``rope_parameters`` {main, compress},
        ``partial_rotary_factor``). Checkpoints written by transformers carry no MTP weights, so a
        config in transformers' form gets ``n_mtp_layers = 0``."""
        m = {
            "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
            "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
            "sliding_window": "window_size", "moe_intermediate_size": "moe_inter_dim",
            "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
            "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
            "norm_topk_prob": "norm_topk_prob", "routed_scaling_factor": "route_scale",
            "swiglu_limit": "swiglu_limit", "rms_norm_eps": "norm_eps", "hc_mult": "hc_mult",
            "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "rope_theta": "rope_theta",
            "compress_rope_theta": "compress_rope_theta", "max_position_embeddings": "max_position_embeddings",
            "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
            "num_hash_layers": "n_hash_layers", "n_hash_layers": "n_hash_layers",
            "num_nextn_predict_layers": "n_mtp_layers", "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
        }
        kw: dict[str, Any] = dict(_V4_BASE)
        kw["name"] = name
        for k, v in d.items():
            if k in m and v is not None:
                kw[m[k]] = v
        hf_native = "layer_types" in d
        if hf_native:
            kw["n_mtp_layers"] = 0
            rates = d.get("compress_rates") or {}
            ratios = [0 if t == "sliding_attention" else int(rates[t]) for t in d["layer_types"]]
        else:
            ratios = list(d.get("compress_ratios", []))
        kw["compress_ratios"] = _pad_ratios(ratios, kw["n_layers"], kw["n_mtp_layers"])
        if "mlp_layer_types" in d:
            mt = list(d["mlp_layer_types"])
            n = 0
            while n < len(mt) and mt[n] == "hash_moe":
                n += 1
            if "hash_moe" in mt[n:]:
                raise ConfigError(f"config {name!r}: hash_moe layers must come first, got {mt}")
            kw["n_hash_layers"] = n
        rp = d.get("rope_parameters") or {}
        main, comp = rp.get("main") or {}, rp.get("compress") or d.get("rope_scaling") or {}
        if main:
            kw["rope_theta"] = main.get("rope_theta", kw.get("rope_theta", 10000.0))
            if main.get("rope_type", "default") != "default":
                raise ConfigError(f"config {name!r}: the main (sliding-layer) rope must be plain, got {main}")
        if comp:
            if "rope_theta" in comp and rp:
                kw["compress_rope_theta"] = comp["rope_theta"]
            if comp.get("rope_type", comp.get("type", "yarn")) == "yarn":
                kw["rope_factor"] = comp.get("factor", 16.0)
                kw["original_seq_len"] = comp.get("original_max_position_embeddings", 65536)
                kw["beta_fast"] = comp.get("beta_fast", 32)
                kw["beta_slow"] = comp.get("beta_slow", 1)
                if float(comp.get("attention_factor", 1.0) or 1.0) != 1.0:
                    raise ConfigError(f"config {name!r}: YaRN attention_factor != 1 is not supported")
            else:
                kw["original_seq_len"] = 0
        # transformers' model sizes each layer type's RoPE by rope_parameters[type]["partial_rotary_factor"]
        # (its rotary embedding), not by the top-level partial_rotary_factor / qk_rope_head_dim, which its
        # config fills from a default of 64 / 512 when only the nested factors are given: the nested ones win
        nested = {t: rp[t]["partial_rotary_factor"] for t in ("main", "compress")
                  if "partial_rotary_factor" in (rp.get(t) or {})}
        if len(set(nested.values())) > 1:
            raise ConfigError(f"config {name!r}: rope_parameters give the sliding and compressed layers different "
                              f"partial_rotary_factor {nested}; one RoPE width for every layer is supported")
        prf = next(iter(nested.values()), d.get("partial_rotary_factor"))
        if prf is not None and (nested or "qk_rope_head_dim" not in d):
            kw["rope_head_dim"] = int(kw["head_dim"] * prf)
        kw.update(_weight_format(d.get("quantization_config"), d, 128, name))
        return cls._build(kw, name)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json`` (a file, or a checkpoint directory containing one)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.exists(p):
            raise ConfigError(f"no config.json at {p}")
        try:
            with open(p) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p} must hold a JSON object")
        return cls.from_dict(d, name=p)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("name")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _is_v4_hf(d: dict) -> bool:
    return d.get("model_type") == "deepseek_v4" or "layer_types" in d or "num_hash_layers" in d


def _pad_ratios(ratios: list, n_layers: int, n_mtp: int) -> tuple:
    """``compress_ratios`` for n_layers + n_mtp entries (MTP blocks are ratio 0)."""
    if len(ratios) == n_layers:
        ratios = ratios + [0] * n_mtp
    if len(ratios) == n_layers + n_mtp + 0 or not ratios:
        return tuple(ratios)
    if len(ratios) > n_layers + n_mtp:
        return tuple(ratios[: n_layers + n_mtp])
    return tuple(ratios)


# V4 defaults that differ from the (V4.1) dataclass defaults; everything V4.1-only switched off.
_V4_BASE: dict[str, Any] = dict(
    family="v4", vocab_size=129280, dim=4096, n_layers=43, n_mtp_layers=1, n_heads=64, head_dim=512,
    rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window_size=128, moe_inter_dim=2048,
    n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, score_func="sqrtsoftplus", gate_temp=1.0,
    norm_topk_prob=True, route_scale=1.5, swiglu_limit=10.0, norm_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, n_hash_layers=3, rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=65536,
    rope_factor=16.0, beta_fast=32, beta_slow=1, max_position_embeddings=1048576, index_n_heads=64,
    index_head_dim=128, index_topk=512, kv_source_layers=(), index_source_layers=(), candidate_source_layer=-1,
    engram_layer_ids=(), engram_num_embeddings=(), dspark_block_size=0, dspark_target_layer_ids=(),
    dspark_n_routed_experts=0, dspark_n_activated_experts=0, gate_bias_vl=False, dtype="fp8",
    expert_dtype="fp4", fp8_block_size=128, fp4_block_size=32,
)


def _v4_flash() -> ModelConfig:
    """V4-Flash (``model.md`` §1.1): 43 layers + 1 MTP block, 284B without MTP."""
    kw = dict(_V4_BASE, name="v4-flash", compress_ratios=tuple([0, 0] + [4, 128] * 20 + [4, 0]))
    return ModelConfig(**kw)


def _v4_pro() -> ModelConfig:
    """V4-Pro (``model.md`` §1.1): 61 layers + 1 MTP block, 1.57T without MTP."""
    kw = dict(_V4_BASE, name="v4-pro", dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16,
              moe_inter_dim=3072, n_routed_experts=384, route_scale=2.5, index_topk=1024,
              compress_ratios=tuple([128, 128] + [4, 128] * 29 + [4, 0]))
    return ModelConfig(**kw)


def _tiny_v4() -> ModelConfig:
    """CPU-sized V4 in the real formats (FP8 128x128 weights with 128-wide activation blocks, MXFP4
    experts, real vocabulary): sliding, CSA (ratio 4 + indexer, 128-wide index heads for the
    Hadamard) and HCA layers (ratio 8 instead of 128, so short prompts complete blocks), one hash
    layer, one MTP block."""
    kw = dict(_V4_BASE, name="tiny-v4", dim=128, n_layers=5, n_mtp_layers=1, n_heads=4, head_dim=128,
              rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=16, moe_inter_dim=128,
              n_routed_experts=8, n_activated_experts=2, n_hash_layers=1, original_seq_len=4096,
              max_position_embeddings=65536, index_n_heads=4, index_head_dim=128, index_topk=4,
              compress_ratios=(0, 4, 8, 4, 8, 0))
    return ModelConfig(**kw)


def _v41_flash() -> ModelConfig:
    return ModelConfig(name="v41-flash")


def _tiny() -> ModelConfig:
    """CPU-sized V4.1: 9 layers + 3 DSpark stages with every feature of the real model (SWA-only
    layers, ratio-2 and ratio-1 KV sources, reuse and re-index layers, a candidate source, two
    Engram layers, FP8 32x32 weights with activation fake-quant, MXFP4 experts). The full real
    vocabulary, so the real tokenizer and its 99,092-id Engram map work unchanged."""
    return ModelConfig(
        name="tiny",
        vocab_size=129280,
        dim=64,
        n_layers=9,
        n_mtp_layers=3,
        n_heads=4,
        head_dim=64,
        rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        window_size=16,
        moe_inter_dim=32,
        n_routed_experts=8,
        n_activated_experts=2,
        gate_temp=1.0,
        route_scale=1.5,
        swiglu_limit=10.0,
        compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layers=(2, 4, 5),
        index_source_layers=(2, 4, 5, 7),
        candidate_source_layer=5,
        candidate_topk_blocks=3,
        candidate_block_size=4,
        original_seq_len=4096,
        max_position_embeddings=65536,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=8,
        engram_layer_ids=(1, 4),
        engram_num_embeddings=(434, 606),
        engram_max_ngram_size=4,
        engram_vocab_size=61,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=99092,
        dspark_block_size=5,
        dspark_target_layer_ids=(6, 7, 8),
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_n_activated_experts=2,
        gate_bias_vl=False,
        dtype="fp8",
        expert_dtype="fp4",
    )


PRESETS = {"v41-flash": _v41_flash, "tiny": _tiny, "v4-flash": _v4_flash, "v4-pro": _v4_pro,
           "tiny-v4": _tiny_v4}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
