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
