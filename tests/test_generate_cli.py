"""``python -m dsv41_jax.generate``: the v41_tiny_a greedy continuation through the CLI, the tiny
preset end to end, and every bad-input case (one ``error:`` line, non-zero exit, no traceback).

The CLI runs in-process (``main(argv)``) so its step programs come from the session's jit cache
(the fixture run uses the shapes of tests/test_decode_parity.py); one subprocess checks the
``-m`` entry point itself.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsv41_jax.checkpoint import read_official
from dsv41_jax.generate import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "v41_tiny_a")


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def fx():
    return {k: np.asarray(v) for k, v in read_official(os.path.join(FIX, "fixture.safetensors")).items()}


def test_fixture_greedy_through_cli(tmp_path, capsys, fx):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in fx["input_ids"]))
    out = tmp_path / "out.jsonl"
    rc, _, err = _run(capsys, "--checkpoint", FIX, "--prompts", str(prompts), "--dtype", "float32",
                      "--kv-cache-dtype", "float32", "--max-new-tokens", "16", "--output", str(out),
                      "--prefill-chunk", "8", "--max-seq-len", "160", "--prefill-tokens", "8")
    assert rc == 0, err  # 8 prompt tokens per step over the slots: 4 per row (same tokens as any chunking)
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1]
    for b, r in enumerate(recs):
        assert r["output_ids"] == fx["gen_ids_noquant"][b].tolist()
        assert r["finish_reason"] == "length" and r["prompt_tokens"] == 128
        assert set(r["timings"]) >= {"prefill_s", "decode_s", "total_s"}
        assert isinstance(r["text"], str) and r["text"]
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("summary:") and "prefill" in summary and "decode" in summary and "tok/s" in summary
    assert "global KV" in err and "Traceback" not in err


def test_tiny_preset_end_to_end(tmp_path, capsys):
    """Random tiny weights, the real tokenizer: text, chat and id prompts, 3 prompts on 2 slots
    (continuous batching), sampling, JSONL output in input order."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there"}]}) + "\n"
                       + json.dumps({"input_ids": [0, 100, 200, 300]}) + "\n")
    out = tmp_path / "out.jsonl"
    rc, _, err = _run(capsys, "--prompt", "The quick brown fox", "--prompts", str(prompts), "--max-new-tokens", "3",
                      "--batch-size", "2", "--prefill-chunk", "1", "--max-seq-len", "32", "--temperature", "0.8",
                      "--top-p", "0.9", "--top-k", "40", "--seed", "3", "--output", str(out))
    assert rc == 0, err
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2]
    assert recs[2]["prompt_tokens"] == 4
    assert recs[0]["prompt_tokens"] > 1  # BOS + the text's tokens
    for r in recs:
        assert 1 <= len(r["output_ids"]) <= 3 and all(0 <= t < 129280 for t in r["output_ids"])
        assert r["finish_reason"] in ("length", "stop")
    assert "global KV" in err and "summary:" in err and "Traceback" not in err


def _bad(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BAD_CASES = {
    "unknown flag": (["--prompt", "x", "--bogus"], "unrecognized"),
    "no prompts": ([], "no prompts"),
    "missing prompts file": (["--prompts", "/nonexistent/p.txt"], "no such file"),
    "malformed jsonl": (["--prompts", ("p.jsonl", '{"prompt": "a"}\n{"prompt": \n')], "malformed JSON"),
    "record without prompt": (["--prompts", ("q.jsonl", '{"text": "a"}\n')], "exactly one of"),
    "empty prompt": (["--prompt", ""], "empty prompt"),
    "empty input_ids": (["--prompts", ("e.jsonl", '{"input_ids": []}\n')], "empty prompt"),
    "non-int input_ids": (["--prompts", ("n.jsonl", '{"input_ids": [0, "a"]}\n')], "list of integers"),
    "id out of vocab": (["--prompts", ("v.jsonl", '{"input_ids": [0, 129280]}\n')], "out of the vocabulary"),
    "prompt longer than cache": (["--prompt", "one two three four five six seven", "--max-seq-len", "4"], "longer than the cache"),
    "negative temperature": (["--prompt", "x", "--temperature", "-0.5"], "--temperature"),
    "nan temperature": (["--prompt", "x", "--temperature", "nan"], "--temperature"),
    "top-p zero": (["--prompt", "x", "--top-p", "0"], "--top-p"),
    "top-p above one": (["--prompt", "x", "--top-p", "1.5"], "--top-p"),
    "negative top-k": (["--prompt", "x", "--top-k", "-2"], "--top-k"),
    "non-int top-k": (["--prompt", "x", "--top-k", "2.5"], "--top-k"),
    "zero max-new-tokens": (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    "zero batch": (["--prompt", "x", "--batch-size", "0"], "--batch-size"),
    "zero prefill-tokens": (["--prompt", "x", "--prefill-tokens", "0"], "--prefill-tokens"),
    "bad dtype": (["--prompt", "x", "--dtype", "float16"], "--dtype"),
    "bad kv dtype": (["--prompt", "x", "--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    "bad preset": (["--prompt", "x", "--preset", "huge"], "--preset"),
    "missing checkpoint": (["--prompt", "x", "--checkpoint", "/nonexistent/ckpt"], "--checkpoint"),
    "checkpoint without config": (["--prompt", "x", "--checkpoint", ("emptydir/", None)], "config.json"),
    "checkpoint and preset": (["--prompt", "x", "--checkpoint", FIX, "--preset", "tiny"], "not both"),
    "missing tokenizer": (["--prompt", "x", "--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer"),
    "malformed tokenizer": (["--prompt", "x", "--tokenizer", ("tok.json", "{not json")], "tokenizer"),
    "bad messages": (["--prompts", ("m.jsonl", '{"messages": [{"role": "assistant", "content": "a"}]}\n')], "messages"),
    "output dir missing": (["--prompt", "x", "--output", "/nonexistent/dir/out.jsonl"], "--output"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_one_line(case, tmp_path, capsys):
    argv, needle = BAD_CASES[case]
    args = []
    for a in argv:
        if isinstance(a, tuple):
            name, text = a
            if text is None:
                d = tmp_path / name
                d.mkdir()
                args.append(str(d))
            else:
                args.append(_bad(tmp_path, name, text))
        else:
            args.append(a)
    rc, out, err = _run(capsys, *args)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in err and out == ""


def test_module_entry_point_reports_one_line():
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.generate", "--prompt", "x", "--top-p", "2"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --top-p must be in (0, 1], got 2.0"]


def test_prompt_files_and_bos(tmp_path):
    """Text lines vs JSONL; BOS (id 0) prepended to raw text only, input_ids used as given."""
    from dsv41_jax.generate import _read_prompts_file, _tokenize
    from dsv41_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint_dir=FIX)  # the fixture's 192-id WordLevel tokenizer
    txt = tmp_path / "p.txt"
    txt.write_text("the cat\n\n  \nhello world\n")
    items = _read_prompts_file(str(txt))
    assert [it["prompt"] for it in items] == ["the cat", "hello world"]
    ids = _tokenize(items, tok, 192)
    assert all(p[0] == 0 and len(p) > 1 for p in ids)
    assert ids[0][1:] == tok.encode("the cat", add_special_tokens=False).ids
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"input_ids": [5, 6, 7]}\n{"prompt": "the cat"}\n')
    ids = _tokenize(_read_prompts_file(str(jl)), tok, 192)
    assert ids[0] == [5, 6, 7] and ids[1][0] == 0


@pytest.mark.parametrize("what", ["garbage config", "no weights", "truncated weights"])
def test_bad_checkpoint_one_line(what, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    ck.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(FIX, f), ck / f)
    if what == "garbage config":
        (ck / "config.json").write_text("{ not json")
    elif what == "truncated weights":
        data = open(os.path.join(FIX, "model.safetensors"), "rb").read()
        (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [0, 5, 6]}\n')
    rc, out, err = _run(capsys, "--checkpoint", str(ck), "--prompts", str(p), "--max-new-tokens", "2")
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--checkpoint" in lines[0], err
    assert "Traceback" not in err
