"""Config parsing, validation, and the parameter tree (counts, official names)."""

import json

import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.config import ConfigError, ModelConfig, get_preset
from dsv41_jax.params import count_params, init_params, official_shapes, param_specs, to_official
from dsv41_jax.quant import Fp4Tensor, Fp8Tensor

FIX = "tests/fixtures/v41_tiny_a"


def test_hf_composite_and_flat_inference_configs_agree():
    a = ModelConfig.from_json(f"{FIX}/config.json")
    b = ModelConfig.from_json(f"{FIX}/inference_config.json")
    assert a.replace(name="x", max_position_embeddings=0) == b.replace(name="x", max_position_embeddings=0)
    assert a.gate_temp == 0.8 and a.norm_eps == 1e-20 and a.dtype == "bf16" and a.expert_dtype is None
    assert a.original_seq_len == 4096 and a.kv_source_of(8) == 5 and a.index_source_of(8) == 7
    assert a.uses_candidates(7) and not a.uses_candidates(5)


def test_presets_are_consistent():
    real = get_preset("v41-flash")
    assert real.n_layers == 40 and real.compress_ratios[2] == 2 and real.compress_ratios[20] == 1
    assert [real.kv_source_of(l) for l in (3, 9, 19, 21, 39)] == [2, 8, 14, 20, 20]
    assert [real.index_source_of(l) for l in (3, 23, 27, 39)] == [2, 20, 24, 36]
    tiny = get_preset("tiny")
    assert tiny.dtype == "fp8" and tiny.expert_dtype == "fp4" and tiny.engram_compressed_vocab_size == 99092
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("huge")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"compress_ratios": [0, 0, 2]}, "compress_ratios has 3 entries"),
        ({"kv_source_layer_ids": [3, 4, 5]}, "reads KV source|no KV-source"),
        ({"num_experts_per_tok": 9}, "n_activated_experts 9 > n_routed_experts 8"),
        ({"engram_num_embeddings": [434]}, "engram_layer_ids has 2 entries"),
        ({"candidate_source_layer_id": 3}, "candidate_source_layer 3 is not an index source"),
    ],
)
def test_inconsistent_configs_are_rejected_with_a_clear_error(tmp_path, change, match):
    d = json.load(open(f"{FIX}/config.json"))
    d["text_config"].update(change)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_json(p)


def test_bad_json_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)


def test_v41_flash_builds_abstractly_with_the_real_parameter_count():
    cfg = get_preset("v41-flash")
    specs = jax.eval_shape(lambda: param_specs(cfg))
    c = count_params(specs)
    assert abs(c["backbone"] / 1e9 - 551.6) < 0.05  # model.md §1.3
    assert abs(c["engram"] / 1e9 - 196.9) < 0.05
    assert abs(c["dspark"] / 1e9 - 14.2) < 0.05
    names = official_shapes(cfg)
    assert names["layers.0.attn.wq_b.weight"].shape == (32768, 1280)
    assert names["layers.0.attn.wq_b.scale"].shape == (1024, 40)
    assert names["layers.0.attn.wo_a.scale"].shape == (256, 128)
    assert names["layers.3.ffn.experts.383.w1.weight"].shape == (2304, 2560)
    assert names["layers.3.ffn.experts.383.w1.scale"].shape == (2304, 160)
    assert names["layers.3.ffn.experts.0.w2.weight"].shape == (5120, 1152)
    assert names["layers.3.ffn.shared_experts.w1.scale"].shape == (72, 160)
    assert names["layers.14.engram.embed.weight"].shape == (384016682, 256)
    assert names["layers.14.engram.embed.scale"].shape == (384016682, 8)
    assert names["layers.14.engram.wkv.weight"].shape == (25600, 6144)
    assert names["mtp.0.main_proj.scale"].shape == (160, 480)
    assert names["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    assert "layers.20.attn.compressor.wgate.weight" not in names and "layers.14.attn.compressor.wgate.weight" in names
    assert "layers.24.attn.indexer.wq_b.weight" in names and "layers.24.attn.indexer.wk.weight" not in names
    assert not any(n.startswith("hc_head") or ".hc_head" in n for n in names)
    assert len([n for n in names if ".experts." in n and not n.startswith("mtp")]) == 40 * 384 * 6


def test_tiny_random_params_are_in_the_real_formats_and_flatten_one_to_one():
    cfg = get_preset("tiny")
    p = init_params(cfg, seed=1)
    assert isinstance(p["layers"]["0"]["attn"]["wq_a"], Fp8Tensor)
    assert isinstance(p["layers"]["0"]["ffn"]["experts"]["w1"], Fp4Tensor)
    assert p["layers"]["0"]["ffn"]["experts"]["w1"].data.dtype == jnp.uint8
    flat = to_official(p)
    shapes = official_shapes(cfg)
    assert set(flat) == set(shapes)
    for k, v in flat.items():
        assert tuple(v.shape) == tuple(shapes[k].shape) and v.dtype == shapes[k].dtype, k
