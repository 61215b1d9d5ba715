"""V4-Flash / V4-Pro configs: presets, parameter counts from the shapes (model.md §1.3), and the
official config forms (flat inference ``ModelArgs`` keys; the released ``deepseek_v4`` config.json;
transformers' own ``deepseek_v4`` form)."""

import json
import os

import pytest

from dsv41_jax.config import ConfigError, ModelConfig, get_preset
from dsv41_jax.params import count_params, official_shapes, param_specs

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v4_tiny_a")


def _counts(cfg):
    return count_params(param_specs(cfg))  # ShapeDtypeStructs only: no memory


def test_v4_flash_parameter_counts():
    cfg = get_preset("v4-flash")
    assert cfg.is_v4 and cfg.has_mtp and cfg.has_hc_head and cfg.n_hash_layers == 3
    c = _counts(cfg)
    assert round(c["backbone"] / 1e9, 2) == 284.33  # "284B" without MTP
    assert round(c["dspark"] / 1e9, 2) == 6.61  # the MTP block (counted under the mtp.* key)
    assert c["engram"] == 0


def test_v4_pro_parameter_counts():
    c = _counts(get_preset("v4-pro"))
    assert round(c["backbone"] / 1e12, 3) == 1.573
    assert round(c["total"] / 1e12, 3) == 1.599


def test_v4_flash_layout_matches_checkpoint_facts():
    cfg = get_preset("v4-flash")
    names = official_shapes(cfg)
    assert sum(n.endswith("attn.compressor.ape") and n.startswith("layers.") for n in names) == 41
    assert sum(n.endswith("attn.indexer.wq_b.weight") and n.startswith("layers.") for n in names) == 21
    assert names["layers.2.attn.compressor.wkv.weight"].shape == (1024, 4096)
    assert names["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert names["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert names["layers.2.attn.indexer.compressor.wkv.weight"].shape == (256, 4096)
    assert names["layers.2.attn.indexer.compressor.ape"].shape == (4, 256)
    assert names["layers.2.attn.wq_a.scale"].shape == (8, 32)  # 128x128 blocks
    assert names["layers.0.ffn.gate.tid2eid"].shape == (129280, 6)
    assert "layers.0.ffn.gate.bias" not in names and "layers.3.ffn.gate.bias" in names
    assert not any(n.endswith("bias_vl") for n in names)
    assert names["hc_head_fn"].shape == (4, 16384) and names["hc_head_scale"].shape == (1,)
    assert names["mtp.0.e_proj.scale"].shape == (32, 32)
    assert names["layers.0.ffn.experts.0.w1.weight"].shape == (2048, 2048)  # FP4 packed


def test_pro_layers_0_1_are_hca():
    cfg = get_preset("v4-pro")
    assert cfg.compress_ratios[:3] == (128, 128, 4) and cfg.overlap(2) and not cfg.overlap(0)
    assert cfg.index_source_layers[:2] == (2, 4) and cfg.kv_source_layers[:3] == (0, 1, 2)


def test_flat_official_inference_config():
    d = {"vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3,
         "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6,
         "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024,
         "head_dim": 512, "rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
         "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
         "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
         "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4", "compress_rope_theta": 160000,
         "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "max_batch_size": 4, "max_seq_len": 4096}
    cfg = ModelConfig.from_dict(d, name="flat")
    assert cfg.replace(name="v4-flash") == get_preset("v4-flash")


def test_released_hf_config_json():
    d = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280,
         "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
         "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
         "sliding_window": 128, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
         "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
         "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "hc_mult": 4,
         "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
         "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1},
         "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
         "num_hash_layers": 3, "num_nextn_predict_layers": 1, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
         "expert_dtype": "fp4", "bos_token_id": 0, "eos_token_id": 1,
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    cfg = ModelConfig.from_dict(d, name="hf")
    ref = get_preset("v4-flash")
    assert cfg.replace(name="v4-flash", pad_token_id=ref.pad_token_id) == ref


def test_transformers_form_and_roundtrip():
    cfg = ModelConfig.from_json(FIX)
    assert cfg.is_v4 and cfg.n_mtp_layers == 0 and cfg.n_hash_layers == 1
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    for n in ("v4-flash", "v4-pro", "v41-flash", "tiny"):
        c = get_preset(n)
        assert ModelConfig.from_dict(c.to_dict(), name=n) == c
    d = json.load(open(os.path.join(FIX, "config.json")))
    d["mlp_layer_types"] = ["moe", "hash_moe", "moe", "moe", "moe"]
    with pytest.raises(ConfigError, match="hash_moe"):
        ModelConfig.from_dict(d)


def test_transformers_form_rope_width_follows_the_nested_factors():
    """transformers' model sizes RoPE by ``rope_parameters[type]["partial_rotary_factor"]``; a config it
    built from nested factors alone carries a stale top-level ``partial_rotary_factor`` 0.125 and
    ``qk_rope_head_dim`` 8 (its 64 / 512 default), which we read before session 35: RoPE on 8 of the
    64 dims where transformers rotates 16, logits off by ~5 from the second position (caught by the
    live comparison, tests/test_v4_hf_live.py, on weights from make_v4_fixture.py)."""
    d = json.load(open(os.path.join(FIX, "config.json")))
    assert ModelConfig.from_dict(d).rope_head_dim == 16
    stale = {**d, "partial_rotary_factor": 0.125, "qk_rope_head_dim": 8}
    assert ModelConfig.from_dict(stale).rope_head_dim == 16
    # no nested factors: the top level counts, qk_rope_head_dim before partial_rotary_factor
    flat = {k: v for k, v in d.items() if k not in ("rope_parameters", "qk_rope_head_dim")}
    assert ModelConfig.from_dict({**flat, "qk_rope_head_dim": 8}).rope_head_dim == 8
    assert ModelConfig.from_dict({**flat, "partial_rotary_factor": 0.125}).rope_head_dim == 8
    rp = json.loads(json.dumps(d["rope_parameters"]))
    rp["compress"]["partial_rotary_factor"] = 0.5
    with pytest.raises(ConfigError, match="different partial_rotary_factor"):
        ModelConfig.from_dict({**d, "rope_parameters": rp})


def test_v4_validation():
    cfg = get_preset("v4-flash")
    with pytest.raises(ConfigError):
        cfg.replace(n_hash_layers=50)
    with pytest.raises(ConfigError):
        cfg.replace(engram_layer_ids=(1,), engram_num_embeddings=(10,))
    with pytest.raises(ConfigError):
        cfg.replace(family="v5")
    with pytest.raises(ConfigError):
        get_preset("tiny").replace(n_hash_layers=1)


def test_v4_flash_full_size_traces():
    """The real V4-Flash shapes (FP8 128x128 weights, MXFP4 experts, reference KV rounding) trace
    through the backbone and the MTP block under jax.eval_shape (no memory, no device)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.cache import init_cache, init_mtp_cache
    from dsv41_jax.mtp import mtp_forward
    from dsv41_jax.options import RunOptions
    from dsv41_jax.transformer import forward_step

    cfg, opts = get_preset("v4-flash"), RunOptions()
    ps = param_specs(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 1024, opts))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    lg, new_cache, aux = jax.eval_shape(
        lambda p, c, t, l: forward_step(p, c, t, l, cfg=cfg, opts=opts, logits_mode="last", return_aux=True),
        ps, cache, i32(2, 4), i32(2))
    assert lg.shape == (2, cfg.vocab_size) and aux["hidden"].shape == (2, 4, 4, 4096)
    assert jax.tree.structure(new_cache) == jax.tree.structure(cache)
    assert cache["layers"]["2"]["state_kv"].shape == (2, 8, 1024)  # overlap: previous + open block
    assert cache["layers"]["2"]["index_state_kv"].shape == (2, 8, 256)
    assert cache["layers"]["3"]["state_kv"].shape == (2, 128, 512) and "index_k" not in cache["layers"]["3"]
    mc = jax.eval_shape(lambda: init_mtp_cache(cfg, 2, 1024, opts))
    ml, _ = jax.eval_shape(lambda p, c, h, t, l: mtp_forward(p, c, h, t, l, cfg=cfg, opts=opts, logits_mode="last"),
                           ps, mc, aux["hidden"], i32(2, 4), i32(2))
    assert ml.shape == (2, cfg.vocab_size)


def test_v4_name_tables_cover_official_names():
    from dsv41_jax.checkpoint.layout import check_table

    for n in ("v4-flash", "v4-pro"):
        check_table(get_preset(n))
    check_table(ModelConfig.from_json(FIX))
