"""The end-to-end benchmark's configuration and floors (the timed runs themselves are GPU work)."""

import pytest

from dsv41_jax.bench import bench_config, decode_bytes, main, random_prompt
from dsv41_jax.params import param_specs


def test_full_model_reads_13_gb_per_decoded_token():
    cfg, notes = bench_config("v41-flash", None, None)
    b = decode_bytes(cfg, param_specs(cfg), 1, 4096)
    assert abs(b / 1e9 - 13.0) < 0.1  # performance.md §5c: ≈13.0 GB/token
    # 1M context adds the KV/indexer reads (≈0.19 GB, performance.md §5c notes)
    assert 0.15e9 < decode_bytes(cfg, param_specs(cfg), 1, 1 << 20) - b < 0.22e9


def test_reduced_experts_keep_batch1_bytes_and_say_so():
    full, _ = bench_config("v41-flash", None, None)
    cfg, notes = bench_config("v41-flash", 96, 16000)
    assert cfg.n_routed_experts == 96 and cfg.n_activated_experts == 6
    assert any("routed experts reduced 384 -> 96" in n for n in notes)
    assert any("Engram table rows reduced" in n for n in notes)
    b_full = decode_bytes(full, param_specs(full), 1, 4096)
    b_red = decode_bytes(cfg, param_specs(cfg), 1, 4096)
    assert abs(b_full - b_red) / b_full < 0.02  # only the router rows differ
    assert cfg.engram_num_embeddings[0] < 10**6


def test_random_prompt_excludes_specials_and_is_seeded():
    p = random_prompt(4096, 42, 129280)
    assert len(p) == 4096 and min(p) >= 3 and max(p) < 128000
    assert p == random_prompt(4096, 42, 129280) and p != random_prompt(4096, 43, 129280)


def test_bad_flag_value_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--batch-sizes", "1,x"])
    assert e.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err
