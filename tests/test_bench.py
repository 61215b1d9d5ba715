"""The end-to-end benchmark's configuration and floors (the timed runs themselves are GPU work)."""

import pytest

from dsv41_jax.bench import bench_config, decode_bytes, main, random_prompt
from dsv41_jax.config import get_preset
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


class _Split:
    """A sharding stand-in: ``shard_shape`` divides the leading dim by ``n``."""

    def __init__(self, n):
        self.n = n

    def shard_shape(self, shape):
        return (shape[0] // self.n, *shape[1:])


class _Leaf:
    def __init__(self, sds, n):
        self.shape, self.dtype, self.sharding = sds.shape, sds.dtype, _Split(n)


def test_per_device_bytes_on_a_mesh():
    """With ``dp`` given, decode_bytes counts one device's shards: routed experts split 2-way (ep=2)
    halve the expert bytes, replicated weights count whole, and the KV reads split over dp."""
    import jax

    cfg, _ = bench_config("v41-flash", 96, 16000)
    specs = param_specs(cfg)
    whole = decode_bytes(cfg, specs, 8, 4096)
    one = lambda n: jax.tree.map(lambda a: _Leaf(a, n), specs)  # noqa: E731
    assert decode_bytes(cfg, one(1), 8, 4096, dp=1) == pytest.approx(whole)

    def experts_split(path, a):
        return _Leaf(a, 2 if "['experts']" in jax.tree_util.keystr(path) else 1)

    ep2 = jax.tree_util.tree_map_with_path(experts_split, specs)
    b_ep2 = decode_bytes(cfg, ep2, 8, 4096, dp=1)
    experts = whole - decode_bytes(cfg.replace(n_activated_experts=0), specs, 8, 4096)
    assert b_ep2 == pytest.approx(whole - experts / 2, rel=1e-6)
    kv = whole - decode_bytes(cfg, specs, 8, 0)  # context 0: no KV reads
    assert decode_bytes(cfg, one(1), 8, 4096, dp=2) == pytest.approx(whole - kv / 2, rel=1e-6)


def test_v4_flash_reads_11_gb_per_decoded_token():
    """Full-size V4-Flash (the 2-GPU comparison with SGLang): performance.md §5b gives 11.0 GB per
    token at batch 1; the MTP block is left out and the note says so."""
    cfg, notes = bench_config("v4-flash", None, None)
    assert cfg.n_layers == 43 and cfg.n_mtp_layers == 0 and cfg.n_routed_experts == 256
    assert any(n.startswith("MTP block not built") for n in notes)
    assert abs(decode_bytes(cfg, param_specs(cfg), 1, 4096) / 1e9 - 11.0) < 0.35


def test_fit_problem_names_the_flags(monkeypatch):
    """A model that cannot fit is refused before anything is allocated, naming the flags that fix it;
    the full V4.1-Flash (its Engram table on the device) does not fit one H200, the benchmark's
    reduced one does."""
    from dsv41_jax.bench import _stored_bytes, bench_config, fit_problem

    h200 = 141e9
    assert fit_problem(100e9, 1, h200) is None
    assert fit_problem(100e9, 1, None) is None  # CPU: no limit reported
    msg = fit_problem(200e9, 1, h200)
    assert "--routed-experts" in msg and "--engram-vocab" in msg and "--mesh" in msg and "200.0 GB" in msg
    assert fit_problem(200e9, 2, h200) is None
    # the session-41 H100 case: 58.1 GB over 90 % of JAX's default 75 % of an 80 GB card
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    msg = fit_problem(58.1e9, 1, 63.8e9)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in msg and "90%" in msg
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in fit_problem(58.1e9, 1, 63.8e9)
    full = _stored_bytes(param_specs(bench_config("v41-flash", None, None)[0]))
    reduced = _stored_bytes(param_specs(bench_config("v41-flash", 96, 16000)[0]))
    assert fit_problem(full, 1, h200) is not None and fit_problem(reduced, 1, h200) is None
    assert reduced < 90e9 < full


def test_prefill_chunk_shrinks_with_the_batch():
    from dsv41_jax.engine import prefill_chunk_for

    assert prefill_chunk_for(1, 4096) == 4096 and prefill_chunk_for(8, 4096) == 512
    assert prefill_chunk_for(32, 4096) == 128 and prefill_chunk_for(3, 4096) == 1024  # power of two below 1365
    assert prefill_chunk_for(8192, 4096) == 1 and prefill_chunk_for(8, None) > 1 << 40


def test_bad_prefill_tokens_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--prefill-tokens", "0"])
    assert e.value.code == 2
    assert "--prefill-tokens" in capsys.readouterr().err


def test_profile_asks_for_an_hlo_dump():
    from dsv41_jax.bench import with_hlo_dump

    f = with_hlo_dump("--xla_gpu_autotune_level=0", "/tmp/p/hlo")
    assert f.startswith("--xla_gpu_autotune_level=0 ") and "--xla_dump_to=/tmp/p/hlo" in f
    assert "engine_step" in f and "--xla_dump_hlo_as_text" in f
    assert with_hlo_dump("--xla_dump_to=/x", "/tmp/p/hlo") == "--xla_dump_to=/x"  # the caller's dump wins


def test_prefill_flops_per_token_matches_active_parameters():
    """performance.md §1c: about 8B active parameters per token in 20 layers, so ~2 x 16B FLOPs per
    token through all 40 (exact prefill), plus attention; reducing the routed experts keeps it
    (only the router's rows differ)."""
    from dsv41_jax.bench import prefill_flops

    full, _ = bench_config("v41-flash", None, None)
    red, _ = bench_config("v41-flash", 96, 16000)
    f_full = prefill_flops(full, param_specs(full), 4096)
    f_red = prefill_flops(red, param_specs(red), 4096)
    assert 30e9 < f_full / 4096 < 38e9
    assert abs(f_full - f_red) / f_full < 0.01
    # the last position of a 64K prompt: weights plus 640 keys per compressed layer (window 128 +
    # top-512), 128 in the SWA-only layers, and the indexer scans of 16K compressed keys
    specs = param_specs(red)
    step = prefill_flops(red, specs, 65536) - prefill_flops(red, specs, 65535)
    weights = prefill_flops(red, specs, 1)  # a one-token prompt: the weights and one key per layer
    swa = sum(1 for l in range(red.n_layers) if not red.ratio(l))
    attn = 4 * red.n_heads * red.head_dim * (128 * swa + 640 * (red.n_layers - swa))
    assert step > weights + attn  # plus the indexer's scans, which grow with the context
    assert step - weights - attn < 0.25 * step


def _tiny_preset_as_three_layers(monkeypatch):
    """``--preset tiny`` in this process gives the preset's first 3 layers (``tiny_short(3)``)."""
    from dsv41_jax import bench
    from tiny_short import tiny_short

    monkeypatch.setattr(bench, "get_preset", lambda name: tiny_short(3) if name == "tiny" else get_preset(name))


def test_prefill_row_profile_on_cpu(tmp_path, monkeypatch):
    """``--batch-sizes 0 --profile-prefill``: the prefill row alone, with the FLOP count and a
    profile of one more prefill whose step program ran once per prompt chunk (40 tokens in chunks
    of 16: 3). ``--preset tiny`` gives the preset's first 3 layers here (``tiny_short``; the row and
    the program count do not depend on the layers): 18.7 -> 10.3 CPU-s."""
    import json

    _tiny_preset_as_three_layers(monkeypatch)

    out = tmp_path / "b.json"
    assert main(["--preset", "tiny", "--batch-sizes", "0", "--prefill-lens", "40", "--prefill-chunk", "16",
                 "--warmup", "0", "--runs", "1", "--profile-prefill", "--profile-dir", str(tmp_path / "p"),
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["decode"] == [] and len(d["prefill"]) == 1
    row = d["prefill"][0]
    assert row["prompt_len"] == 40 and row["flops"] > 0 and row["tok_s"] > 0
    steps = [p for p in row["profile"]["programs"] if "engine_step" in p["module"]]
    assert steps and max(p["executions"] for p in steps) == 3, [(p["module"], p["executions"]) for p in steps]


def test_profile_without_execution_ids_counts_prefill_and_decode_steps(monkeypatch):
    """A trace that kept no execution ids reports every program once: the decode program (most
    launches) is re-expressed per one of new_tokens - 1 steps, the prefill program per one of
    ceil(prompt / chunk) steps; with one new token only the prefill program ran."""
    import types

    import dsv41_jax.profiling as prof
    from dsv41_jax.bench import profile_generate
    from dsv41_jax.engine import Request

    def prog(launches):
        return {"module": "jit__engine_step_pipe", "executions": 1, "busy_ms": 60.0, "parts_ms": {"moe": 60.0},
                "launches": launches, "kernels": []}

    def fake(progs):
        monkeypatch.setattr(prof, "trace", lambda f, d: (None, "trace"))
        monkeypatch.setattr(prof, "summarize", lambda *a, **k: {"programs": progs})
        monkeypatch.setattr(prof, "format_report", lambda rep: "")

    eng = types.SimpleNamespace(chunk=16)
    reqs = [Request(list(range(40)), 4), Request(list(range(20)), 4)]  # 3 prefill steps
    fake([prog(900.0), prog(300.0)])
    rep = profile_generate(eng, reqs, 7, "/tmp/unused")
    assert [(p["executions"], p["busy_ms"]) for p in rep["programs"]] == [(6, 10.0), (3, 20.0)]
    fake([prog(300.0)])
    rep = profile_generate(eng, reqs, 1, "/tmp/unused")
    assert [(p["executions"], p["busy_ms"]) for p in rep["programs"]] == [(3, 20.0)]
    assert "prefill program" in rep["programs"][0]["note"]
    # prompts over max_prompt_tokens in all are cut for the profile: 2 x 12 tokens = one 16-token chunk
    seen = []
    eng.generate = lambda rs, sp: seen.append([len(r.prompt_ids) for r in rs])
    monkeypatch.setattr(prof, "trace", lambda f, d: (f(), "trace"))
    monkeypatch.setattr(prof, "summarize", lambda *a, **k: {"programs": [prog(900.0), prog(300.0)]})
    rep = profile_generate(eng, reqs, 7, "/tmp/unused", max_prompt_tokens=25)
    assert seen[-1] == [12, 12] and rep["prompt_cut"]["prompt_tokens"] == 60
    assert [(p["executions"], p["busy_ms"]) for p in rep["programs"]] == [(6, 10.0), (1, 60.0)]  # one prefill step
    rep = profile_generate(eng, reqs, 7, "/tmp/unused", max_prompt_tokens=60)  # 60 tokens: not cut
    assert seen[-1] == [40, 20] and "prompt_cut" not in rep


def test_runs_split_over_two_calls_merge(tmp_path, capsys, monkeypatch):
    """The protocol's runs split over two invocations (two device calls) and ``--merge``d: every
    timed run of both, the median recomputed; each --json is complete at the end and was written
    after every timed run while it ran (a call stopped by its time limit keeps those); mismatched
    or foreign files are refused with the file named. ``--preset tiny`` gives the preset's first 3
    layers here (``tiny_short``; the protocol does not depend on the layers): 31.0 -> 16.3 CPU-s."""
    import json
    import statistics

    from dsv41_jax import bench

    _tiny_preset_as_three_layers(monkeypatch)

    saved = []
    real_save = bench.save_json
    bench.save_json = lambda path, out, partial=None: (saved.append(partial), real_save(path, out, partial))[1]
    try:
        a, b = tmp_path / "a.json", tmp_path / "b.json"
        common = ["--preset", "tiny", "--batch-sizes", "1", "--prefill-lens", "0", "--new-tokens", "4", "--prompt-len", "32"]
        assert main(common + ["--warmup", "1", "--runs", "2", "--json", str(a)]) == 0
        assert main(common + ["--warmup", "1", "--warmup-tokens", "2", "--runs", "1", "--json", str(b)]) == 0
    finally:
        bench.save_json = real_save
    parts = [p for p in saved if p is not None]
    assert [len(p["runs"]) for p in parts] == [1, 2, 1] and all(p["partial"] for p in parts)
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert da["complete"] and db["complete"] and len(da["decode"][0]["runs"]) == 2
    m = tmp_path / "m.json"
    capsys.readouterr()
    assert main(["--merge", str(a), str(b), "--json", str(m)]) == 0
    dm = json.loads(m.read_text())
    runs = da["decode"][0]["runs"] + db["decode"][0]["runs"]
    assert dm["decode"][0]["runs"] == runs and dm["decode"][0]["median_tok_s"] == statistics.median(runs)
    assert dm["decode"][0]["merged_from"] == [str(a), str(b)] and "| 1 |" in capsys.readouterr().out
    # greedy: both calls generated the same tokens (one digest in each file and in the merge)
    assert len(da["decode"][0]["output_sha256"]) == 1 and da["decode"][0]["output_sha256"] == db["decode"][0]["output_sha256"]
    assert dm["decode"][0]["output_sha256"] == da["decode"][0]["output_sha256"]
    assert parts[-1]["output_sha256"] == db["decode"][0]["output_sha256"]
    other = tmp_path / "o.json"
    other.write_text(json.dumps({**db, "config": "something-else"}))
    assert main(["--merge", str(a), str(other)]) == 2
    assert "o.json has config 'something-else'" in capsys.readouterr().err
    other.write_text("{}")
    assert main(["--merge", str(a), str(other)]) == 2
    assert "o.json is not a python -m dsv41_jax.bench --json result" in capsys.readouterr().err


def test_output_digest_tells_outputs_apart():
    """bench's output digest: equal for equal token lists, different when a token or the split
    between requests differs."""
    from types import SimpleNamespace as R

    from dsv41_jax.bench import output_digest

    d = lambda *lists: output_digest([R(output_ids=list(x)) for x in lists])
    assert d([5, 7], [9]) == d([5, 7], [9])
    assert len({d([5, 7], [9]), d([5, 8], [9]), d([5], [7, 9]), d([9], [5, 7])}) == 4
