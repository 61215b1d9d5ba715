"""Cached decode / chunked prefill through the engine against DeepSeek's own logits (v41_tiny_a).

The fixture model has the tiny preset's structure (window 16, ratio-2 and ratio-1 KV sources,
candidate blocks 3 x 4, index_topk 8, Engram on layers 1 and 4). Every engine here has batch 2,
prefill chunk 8 and max_seq_len 160, so the step programs are compiled once per numerics setting
and shared by all tests of the session (tests/test_engine.py and the fixture CLI test reuse them).
"""

import os

import numpy as np
import pytest

from dsv41_jax.checkpoint import read_official
from dsv41_jax.engine import Engine, Request
from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v41_tiny_a")
F32 = RunOptions(dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def fx():
    return {k: np.asarray(v) for k, v in read_official(os.path.join(FIX, "fixture.safetensors")).items()}


@pytest.fixture(scope="module")
def model():
    return Model.from_checkpoint(FIX)


def _engine(model, opts=F32, mode="auto"):
    return Engine(model, batch_size=2, max_seq_len=160, opts=opts, prefill_chunk=8, engram_mode=mode)


def test_decode_matches_full_forward(model, fx):
    """Prompts of 13 and 29 tokens (odd: open ratio-2 blocks; crossing candidate blocks of 4 and the
    16-token window), chunked prefill by 8, then cached decode teacher-forced along the fixture's
    input up to position 60: logits at every position = the reference's full forward."""
    ids, ref = fx["input_ids"], fx["logits_noquant"]
    eng = _engine(model)
    assert eng.engram_mode == "host"  # load_checkpoint leaves Engram tables as host memmaps
    reqs = [Request(ids[b, :P], max_new_tokens=61 - P, forced_ids=ids[b, P:60]) for b, P in enumerate((13, 29))]
    res = eng.generate(reqs, return_logits=True)
    for b, (r, P) in enumerate(zip(res, (13, 29))):
        got = np.stack(r.logits)
        assert got.shape == (61 - P, 192)
        err = np.abs(got - ref[b, P - 1:60]).max(axis=-1)
        assert err.max() < 1e-4, (b, err.max(), int(err.argmax()) + P - 1)
        assert r.output_ids == ref[b, P - 1:60].argmax(-1).tolist()


def test_irregular_chunks_and_idle_rows(model, fx):
    """Chunks of irregular sizes from arbitrary positions (including single tokens inside the
    8-wide program and idle rows with 0 tokens), then single-token decode."""
    ids, ref = fx["input_ids"], fx["logits_noquant"]
    eng = _engine(model)
    sched = [[3, 8, 0, 1, 5, 7, 2, 8, 6, 1, 8, 4, 3],  # row 0
             [8, 2, 6, 1, 0, 8, 3, 7, 5, 8, 1, 2, 4]]  # row 1
    pos = [0, 0]
    checked = 0
    for k in range(len(sched[0])):
        lens = np.array([sched[0][k], sched[1][k]])
        toks = np.zeros((2, 8), np.int64)
        for b in range(2):
            toks[b, :lens[b]] = ids[b, pos[b]:pos[b] + lens[b]]
        _, lg = eng.step(toks, lens)
        lg = np.asarray(lg)
        for b in range(2):
            pos[b] += lens[b]
            if lens[b]:
                np.testing.assert_allclose(lg[b], ref[b, pos[b] - 1], atol=1e-4, rtol=0)
                checked += 1
    assert pos == [56, 55] and list(eng.pos) == pos
    for _ in range(6):  # decode, S = 1
        toks = np.array([[ids[0, pos[0]]], [ids[1, pos[1]]]])
        _, lg = eng.step(toks, np.array([1, 1]))
        pos = [p + 1 for p in pos]
        for b in range(2):
            np.testing.assert_allclose(np.asarray(lg)[b], ref[b, pos[b] - 1], atol=1e-4, rtol=0)
            checked += 1
    assert checked == 36


def test_fixture_greedy_generation_and_step_logits(model, fx):
    """The fixture's 128-token prompts, 16 greedy tokens: gen_ids_noquant token for token, the
    per-step logits within 2e-4, and the logits after feeding the last token (post_last)."""
    eng = _engine(model)
    res = eng.generate([Request(fx["input_ids"][b], max_new_tokens=17) for b in range(2)], return_logits=True)
    for b, r in enumerate(res):
        assert r.output_ids[:16] == fx["gen_ids_noquant"][b].tolist()
        got = np.stack(r.logits)
        np.testing.assert_allclose(got[:16], fx["step_logits_noquant"][b], atol=2e-4, rtol=0)
        np.testing.assert_allclose(got[16], fx["post_last_logits_noquant"][b], atol=2e-4, rtol=0)
        assert r.finish_reason == "length" and len(r.output_ids) == 17


def _run_schedule(eng, ids, sched):
    out = []
    pos = [0, 0]
    for lens in sched:
        toks = np.zeros((2, 8), np.int64)
        for b in range(2):
            toks[b, :lens[b]] = ids[b, pos[b]:pos[b] + lens[b]]
            pos[b] += lens[b]
        nxt, lg = eng.step(toks, np.asarray(lens))
        out.append((np.asarray(nxt), np.asarray(lg), list(pos)))
    return out


def test_engram_host_and_device_rows_identical(model, fx):
    sched = [(8, 5), (3, 8), (8, 2), (1, 8), (2, 2)]
    host = _run_schedule(_engine(model, mode="host"), fx["input_ids"], sched)
    dev_eng = _engine(model, mode="device")
    assert dev_eng.engram_mode == "device"
    dev = _run_schedule(dev_eng, fx["input_ids"], sched)
    for (n1, l1, _), (n2, l2, _) in zip(host, dev):
        np.testing.assert_array_equal(n1, n2)
        np.testing.assert_array_equal(l1, l2)


def test_reference_quant_mode_short_prefix(model, fx):
    """DeepSeek's FP8/FP4 cache rounding: chaotic w.r.t. float noise (fixture README §7), so only a
    short prefix is compared, and against the quant-off difference as a yardstick."""
    eng = _engine(model, opts=RunOptions(dtype="float32", kv_cache_dtype="reference"))
    sched = [(8, 8), (1, 3), (1, 1), (1, 1), (4, 1), (1, 1)]
    out = _run_schedule(eng, fx["input_ids"], sched)
    errs, gaps = [], []
    for _, lg, pos in out:
        for b in range(2):
            p = pos[b] - 1
            errs.append(np.abs(lg[b] - fx["logits_quant"][b, p]).max())
            gaps.append(np.abs(fx["logits_quant"][b, p] - fx["logits_noquant"][b, p]).max())
    errs, gaps = np.array(errs), np.array(gaps)
    assert errs.max() < 1e-3, errs
    assert gaps.max() > 20 * errs.max()  # the rounding itself is visible and reproduced
