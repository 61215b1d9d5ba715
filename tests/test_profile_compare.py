"""dsv41_jax.profile_compare: the decode program is picked by executions, parts line up across
files with their differences, and bad input names the file and the fix."""

import json

import pytest

from dsv41_jax import profile_compare


def report(batch, busy, parts, launches, tok_s, prefill_busy=50.0):
    decode = {"program_id": 7, "executions": 15, "busy_ms": busy, "launches": sum(launches.values()),
              "parts_ms": parts, "parts_launches": launches, "kernels": []}
    prefill = {"program_id": 3, "executions": 1, "busy_ms": prefill_busy, "launches": 9000,
               "parts_ms": {"routed_experts": 40.0}, "parts_launches": {"routed_experts": 8000}, "kernels": []}
    copy = {"program_id": 9, "executions": 15, "busy_ms": 0.01, "launches": 1, "parts_ms": {}, "parts_launches": {},
            "kernels": []}
    return {"decode": [{"batch": batch, "median_tok_s": tok_s, "profile": {"programs": [prefill, copy, decode]}}]}


def test_decode_program_is_the_most_executed_busiest():
    rep = report(1, 2.0, {"attention": 1.0}, {"attention": 10}, 500.0)
    prog = profile_compare.decode_program(rep["decode"][0]["profile"])
    assert prog["program_id"] == 7  # not the prefill (most launches), not the 15-execution copy program


def test_compare_table_has_differences_from_the_first(tmp_path, capsys):
    a = report(1, 2.023, {"attn_mhc": 0.031, "attention": 0.162}, {"attn_mhc": 18, "attention": 118}, 515.6)
    b = report(1, 2.004, {"attn_mhc": 0.022, "attention": 0.157, "shared_expert": 0.05},
               {"attn_mhc": 8, "attention": 114, "shared_expert": 4}, 493.6)
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert profile_compare.main([str(fa), str(fb), "--labels", "off,on"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| | off | on |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out[2:]}
    assert rows["device ms / step"].endswith("| 2.023 | 2.004 (-0.019) |")
    assert rows["kernels / step"].endswith("| 136 | 126 (-10) |")
    assert rows["attn_mhc kernels"].endswith("| 18 | 8 (-10) |")
    assert rows["shared_expert ms"].endswith("| — | 0.050 |")  # a part only the second run has
    assert list(rows)[3] == "attention ms"  # parts by the first run's time, largest first


def test_bad_input_names_the_file_and_the_fix(tmp_path, capsys):
    two = report(1, 2.0, {"a": 1.0}, {"a": 1}, 1.0)
    two["decode"].append(dict(two["decode"][0], batch=8))
    f = tmp_path / "two.json"
    f.write_text(json.dumps(two))
    with pytest.raises(SystemExit):
        profile_compare.main([str(f)])
    assert "found batches [1, 8] (pick one with --batch)" in capsys.readouterr().err
    assert profile_compare.main([str(f), "--batch", "8"]) == 0
    noprof = {"decode": [{"batch": 1, "median_tok_s": 1.0, "profile": None}]}
    g = tmp_path / "noprof.json"
    g.write_text(json.dumps(noprof))
    with pytest.raises(SystemExit):
        profile_compare.main([str(g)])
    assert "run bench with --profile-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_compare.main([str(f), str(g), "--labels", "one"])
    assert "--labels has 1 names for 2 files" in capsys.readouterr().err


def prefill_report(busy, parts, launches, tok_s, executions=1, prompt_len=4096):
    step = {"program_id": 3, "executions": executions, "busy_ms": busy, "launches": sum(launches.values()),
            "parts_ms": parts, "parts_launches": launches, "kernels": []}
    other = {"program_id": 5, "executions": 1, "busy_ms": 2.0, "launches": 40, "parts_ms": {}, "parts_launches": {},
             "kernels": []}
    return {"decode": [], "prefill": [{"prompt_len": prompt_len, "tok_s": tok_s, "profile": {"programs": [other, step]}}]}


def test_prefill_profiles_side_by_side_per_whole_prefill(tmp_path, capsys):
    """``--prefill``: the prefill rows' step programs (bench --profile-prefill), scaled by their
    executions (one per prompt chunk) to the whole prefill; the row picked by prompt length."""
    a = prefill_report(700.0, {"sparse_attn": 100.0, "attention": 200.0}, {"sparse_attn": 300, "attention": 900}, 5603.7)
    b = prefill_report(380.0, {"sparse_attn": 70.0, "attention": 90.0}, {"sparse_attn": 40, "attention": 600}, 5388.2,
                       executions=2)
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    for flag in (["--prefill"], ["--prefill", "4096"]):
        assert profile_compare.main([str(fa), str(fb), "--labels", "xla,pallas", *flag]) == 0
        rows = {line.split(" | ")[0].lstrip("| "): line for line in capsys.readouterr().out.splitlines()[2:]}
        assert rows["device ms / prefill"].endswith("| 700.000 | 760.000 (+60.000) |")
        assert rows["kernels / prefill"].endswith("| 1200 | 1280 (+80) |")
        assert rows["prefill tok/s"].endswith("| 5603.7 | 5388.2 (-215.5) |")
        assert rows["sparse_attn ms"].endswith("| 100.000 | 140.000 (+40.000) |")
    two = dict(a, prefill=a["prefill"] + prefill_report(1.0, {}, {}, 1.0, prompt_len=65536)["prefill"])
    f = tmp_path / "two.json"
    f.write_text(json.dumps(two))
    with pytest.raises(SystemExit):
        profile_compare.main([str(f), "--prefill"])
    assert "found prompt lengths [4096, 65536] (pick one with --prefill LEN)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_compare.main([str(fa), "--prefill", "512"])
    assert "for a 512-token prompt" in capsys.readouterr().err
    noprof = {"prefill": [{"prompt_len": 4096, "tok_s": 1.0, "profile": None}]}
    g = tmp_path / "noprof.json"
    g.write_text(json.dumps(noprof))
    with pytest.raises(SystemExit):
        profile_compare.main([str(g), "--prefill"])
    assert "run bench with --profile-prefill" in capsys.readouterr().err
