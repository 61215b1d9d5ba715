"""Engine behaviour on the v41_tiny_a model: mixed prompt lengths, continuous batching, slot reuse,
per-sequence stops, batch-size / slot independence (greedy and sampled), cache reset.

Engines of batch 2 / chunk 8 / max_seq_len 160 share their compiled programs with
tests/test_decode_parity.py; the batch-3 engines use prefill chunk 1 (one program each).
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

from dsv41_jax.cache import init_cache
from dsv41_jax.checkpoint import read_official
from dsv41_jax.engine import Engine, Request, cache_report, reset_slot
from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions
from dsv41_jax.sampling import SamplingParams

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v41_tiny_a")
F32 = RunOptions(dtype="float32", kv_cache_dtype="float32")
LENS = (5, 17, 9, 30, 12)
NEW = (6, 3, 8, 4, 5)


@pytest.fixture(scope="module")
def model():
    return Model.from_checkpoint(FIX)


@pytest.fixture(scope="module")
def requests():
    ids = np.asarray(read_official(os.path.join(FIX, "fixture.safetensors"))["input_ids"])
    return [Request(ids[i % 2, 3 * i:3 * i + L], max_new_tokens=n) for i, (L, n) in enumerate(zip(LENS, NEW))]


@pytest.fixture(scope="module")
def pipe_engine(model):
    """Engram tables on the device: the pipelined loop (device-side hash, tokens never leave the
    device between steps). Prefill chunk 1: a single program."""
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=1, engram_mode="device", stop_ids=())
    assert eng.engram_mode == "device" and eng.pipelined
    return eng


@pytest.fixture(scope="module")
def alone(model, requests):
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8)
    return [eng.generate([r])[0].output_ids for r in requests]


def test_mixed_lengths_continuous_batching_equals_alone(model, requests, alone):
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8)
    res = eng.generate(requests)
    assert [r.index for r in res] == list(range(5))
    assert [r.output_ids for r in res] == alone
    assert [len(a) for a in alone] == list(NEW) and all(r.finish_reason == "length" for r in res)
    # another order: every request lands in other slots, next to other neighbours
    rev = eng.generate(requests[::-1])
    assert [r.output_ids for r in rev] == alone[::-1]
    assert eng.stats.prefill_tokens == 2 * sum(LENS) and eng.stats.steps > 0


def test_one_new_token_compiles_no_decode_program(model, requests, alone):
    """Requests of one new token each (bench's prefill rows): the first token comes from the
    prompt's last chunk, so generate compiles the chunk program only, and the token is the one the
    longer generation started with."""
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8)
    out = eng.generate([dataclasses.replace(r, max_new_tokens=1) for r in requests[:3]])
    assert [o.output_ids for o in out] == [a[:1] for a in alone[:3]]
    widths = {k[0] for k in eng._compiled if isinstance(k, tuple)}
    assert widths == {8}, eng._compiled


def test_batch_size_and_chunk_independent(model, requests, alone):
    eng = Engine(model, batch_size=3, max_seq_len=160, opts=F32, prefill_chunk=1)
    assert [r.output_ids for r in eng.generate(requests)] == alone


def test_stop_token_and_cache_full(model, requests, alone):
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8)
    stop = alone[2][3]
    eng.stop_ids = frozenset({stop})
    res = eng.generate(requests)
    for r, a in zip(res, alone):
        if stop in a:
            k = a.index(stop)
            assert r.output_ids == a[:k + 1] and r.finish_reason == "stop"
        else:
            assert r.output_ids == a and r.finish_reason == "length"
    assert res[2].finish_reason == "stop"
    # a sequence that fills the cache stops there (the cache holds 160 tokens; the last sample needs none)
    eng.stop_ids = frozenset()
    long = Request(list(requests[3].prompt_ids) * 5, max_new_tokens=50)  # 150 tokens
    r = eng.generate([long, requests[0]])
    assert r[0].finish_reason == "max_seq_len" and len(r[0].output_ids) == 11
    assert r[1].output_ids == alone[0]


def test_sampled_tokens_independent_of_slot_and_batch(model, requests):
    """A request's random keys come from (seed, sample_id, step): same tokens in any slot, order or
    batch size. The batch-3 engine is the one of test_batch_size_and_chunk_independent (greedy and
    sampling compile one program each; every temperature / top-k / top-p shares the sampled one)."""
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11)
    reqs = [Request(r.prompt_ids, r.max_new_tokens, sample_id=100 + i) for i, r in enumerate(requests)]
    eng = Engine(model, batch_size=3, max_seq_len=160, opts=F32, prefill_chunk=1, stop_ids=())
    crowd = [r.output_ids for r in eng.generate(reqs, sp)]
    assert [r.output_ids for r in eng.generate(reqs[::-1], sp)] == crowd[::-1]
    assert eng.generate([reqs[3]], sp)[0].output_ids == crowd[3]
    assert [len(c) for c in crowd] == list(NEW)
    other = [r.output_ids for r in eng.generate(reqs, SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=12))]
    assert other != crowd
    # batch size 2 (another program) samples the same tokens
    eng2 = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8, stop_ids=())
    assert [r.output_ids for r in eng2.generate(reqs[:3], sp)] == crowd[:3]


def test_decode_program_has_no_conditional(pipe_engine):
    """The sampling branch is chosen at trace time: a traced ``lax.cond`` in the step makes the GPU
    runtime read its predicate on the host mid-step, stalling the next step's dispatch."""
    text = pipe_engine.compiled_text(decode=True)
    assert "ENTRY" in text and " conditional(" not in text


def test_reset_slot_restores_one_row(model):
    cfg = model.cfg
    opts = RunOptions(dtype="float32", kv_cache_dtype="reference")
    # one jitted program each (as the engine runs reset_slot): eagerly, every op on every cache leaf
    # compiled on its own
    fresh = jax.jit(init_cache, static_argnums=(0, 1, 2, 3))(cfg, 3, 32, opts)
    dirty = jax.jit(lambda c: jax.tree.map(
        lambda a: (a.astype(np.float32) + 1).astype(a.dtype) if a.dtype != np.uint8 else a + 1, c))(fresh)
    out = jax.jit(reset_slot, static_argnames=("cfg", "opts", "max_seq_len"))(dirty, 1, cfg=cfg, opts=opts,
                                                                              max_seq_len=32)
    for o, f, d in zip(jax.tree.leaves(out), jax.tree.leaves(fresh), jax.tree.leaves(dirty)):
        o, f, d = (np.asarray(x).astype(np.float32) for x in (o, f, d))
        np.testing.assert_array_equal(o[1], f[1])
        np.testing.assert_array_equal(o[[0, 2]], d[[0, 2]])
    assert np.asarray(out["pos"]).tolist() == [1, 0, 1]


def test_cache_report_v41_flash_bytes():
    from dsv41_jax.config import get_preset

    from dsv41_jax.cache import global_kv_bytes_per_token, window_bytes_per_sequence
    from dsv41_jax.engine import cache_bytes

    cfg = get_preset("v41-flash")
    line = cache_report(cfg, RunOptions(), 1, 1024)
    assert "global KV 890 B/token" in line and "window" in line
    for name in ("v41-flash", "tiny"):
        c = get_preset(name)
        per_token, fixed = cache_bytes(c, RunOptions())  # measured on init_cache's shapes
        assert per_token == global_kv_bytes_per_token(c)
        states = sum(2 * c.ratio(l) * c.head_dim * 4 for l in c.kv_source_layers if c.ratio(l) > 1)
        assert fixed == window_bytes_per_sequence(c) + states + 4  # + pos (int32)


def test_bad_requests(model):
    eng = Engine(model, batch_size=2, max_seq_len=16, opts=F32, prefill_chunk=8)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([Request([], 3)])
    with pytest.raises(ValueError, match="no room"):
        eng.generate([Request(list(range(3, 19)), 3)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([Request([0, 5], 0)])


def test_pipelined_device_hash_matches_synced(pipe_engine, requests, alone):
    """Pipelined decoding (device hash, host reads step k while step k+1 runs) gives the tokens of
    the synced host-hash loop: greedy, with a stop token found one step late (the extra sample is
    discarded), at a full cache, and sampled."""
    eng = pipe_engine
    assert [r.output_ids for r in eng.generate(requests)] == alone
    stop = alone[2][3]
    eng.stop_ids = frozenset({stop})
    try:
        res = eng.generate(requests)
    finally:
        eng.stop_ids = frozenset()
    for r, a in zip(res, alone):
        k = a.index(stop) + 1 if stop in a else len(a)
        assert r.output_ids == a[:k] and r.finish_reason == ("stop" if stop in a else "length")
    long = Request(list(requests[3].prompt_ids) * 5, max_new_tokens=50)
    r = eng.generate([long, requests[0]])
    assert r[0].finish_reason == "max_seq_len" and len(r[0].output_ids) == 11 and r[1].output_ids == alone[0]
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11)
    reqs = [Request(q.prompt_ids, q.max_new_tokens, sample_id=100 + i) for i, q in enumerate(requests)]
    host = Engine(eng.model, batch_size=3, max_seq_len=160, opts=F32, prefill_chunk=1, stop_ids=())
    assert [q.output_ids for q in eng.generate(reqs, sp)] == [q.output_ids for q in host.generate(reqs, sp)]


def test_host_timing_covers_pure_decode_steps_only(pipe_engine, requests):
    """EngineStats.dispatch_s / wait_s (the bench's host columns) count a step only when the step
    dispatched and the step read both have no prompt tokens, also with prefill chunk 1 (where a prompt
    step has S = 1 like a decode step): N new tokens = 1 from the last prompt step + N - 1 decode steps,
    of which N - 2 are read while the next decode step is in flight."""
    eng = pipe_engine
    r = Request(requests[1].prompt_ids, max_new_tokens=6)
    before = dataclasses.replace(eng.stats)
    eng.generate([r])
    assert eng.stats.timed_decode_steps - before.timed_decode_steps == 6 - 2
    assert eng.stats.dispatch_s > before.dispatch_s and eng.stats.wait_s >= before.wait_s


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_device_ngram_hash_matches_host(preset):
    """The device hash (32-bit limb arithmetic) = the host int64 hasher, real tokenizer map,
    including the first positions (look-back before the sequence start)."""
    import jax.numpy as jnp

    from dsv41_jax.config import get_preset
    from dsv41_jax.engine import device_hash_tables, device_ngram_ids
    from dsv41_jax.engram_hash import EngramHasher
    from dsv41_jax.tokenizer import load_tokenizer

    cfg = get_preset(preset)
    h = EngramHasher.from_config(cfg, tokenizer=load_tokenizer())
    ht = device_hash_tables(h)
    assert ht is not None
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 40))
    c, ref = h.compress(toks), h(toks)
    J = cfg.engram_max_ngram_size
    f = jax.jit(device_ngram_ids, static_argnums=3)
    for p0, S in [(0, 5), (2, 1), (17, 8), (39, 1)]:
        first = np.full(3, p0 - (J - 1))
        win = np.take_along_axis(c, np.clip(first[:, None] + np.arange(J - 1 + S), 0, 39), 1).astype(np.int32)
        got = np.asarray(f(ht, jnp.asarray(win), jnp.asarray(first), S))
        n = min(S, 40 - p0)
        np.testing.assert_array_equal(got[:, :n], ref[:, p0:p0 + n])


def test_packed_step_inputs_round_trip():
    """A pipelined step's row inputs travel as one int32 array and its sampling settings as one
    int32 [4] (floats by their bits): unpacking on the device gives the values back exactly."""
    import jax.numpy as jnp

    from dsv41_jax.engine import _unpack_step, pack_sampling, pack_step_rows
    from dsv41_jax.sampling import SamplingParams

    rng = np.random.default_rng()
    B, S = 3, 5
    tokens = rng.integers(0, 129280, (B, S))
    lengths, use, rid, stp = rng.integers(0, S + 1, B), rng.integers(0, 2, B).astype(bool), rng.integers(0, 99, B), \
        rng.integers(0, 4096, B)
    sp = SamplingParams(temperature=0.7301, top_k=37, top_p=0.913, seed=123456789)
    out = _unpack_step(jnp.asarray(pack_step_rows(tokens, lengths, use, rid, stp)), jnp.asarray(pack_sampling(sp)))
    for got, want in zip(out[:5], (tokens, lengths, use, rid, stp)):
        np.testing.assert_array_equal(np.asarray(got), want)
    seed, temp, top_k, top_p = (np.asarray(v) for v in out[5:])
    assert seed == 123456789 and top_k == 37
    assert temp == np.float32(0.7301) and top_p == np.float32(0.913)


def test_pipelined_decode_keeps_its_buffers(pipe_engine, requests, alone):
    """A run of pipelined steps keeps the device address of everything the step program reads or
    writes per step (the next tokens overwrite the donated previous ones, the advanced row array the
    donated row array, the cache and Engram history in place), so XLA need not update the step's
    CUDA graph between steps (BENCHMARKS.md, session 6). The row array of a step of unchanged decode
    rows is the previous step's device output (no host copy); new row values are copied into that
    same buffer; the tokens the host reads are a copy, still readable after the next step consumed
    the original."""
    from dsv41_jax.engine import advance_packed, pack_step_rows

    eng = pipe_engine
    eng.generate([requests[0]])  # compiled; slot 0 holds a finished sequence, positions free beyond it
    B = eng.B
    use = np.zeros(B, bool)
    use[0] = True
    lengths = use.astype(np.int64)
    tokens = np.zeros((B, 1), np.int64)
    rid = np.zeros(B, np.int32)
    prev = eng._zeros_prev()
    ptr = lambda a: a.unsafe_buffer_pointer()  # noqa: E731
    cache_ptrs = lambda: [ptr(x) for x in jax.tree.leaves(eng.cache)]  # noqa: E731
    rows = lambda: eng._row_next[(B, 5)][0]  # noqa: E731
    reused0 = eng.stats.packed_reused
    seen, reads = [ptr(rows())], []
    for k in list(range(4)) + [9]:  # the last step's rows differ from the advanced ones: copied in
        stp = np.where(use, k, 0).astype(np.int32)  # as the engine: inactive rows step 0
        p_prev, p_cache, p_ehist = ptr(prev), cache_ptrs(), ptr(eng.ehist)
        prev, readable = eng._step_pipe(tokens, lengths, use, prev, request_ids=rid, steps=stp)
        assert ptr(prev) == p_prev, "next tokens must overwrite the donated previous tokens"
        assert cache_ptrs() == p_cache and ptr(eng.ehist) == p_ehist
        seen.append(ptr(rows()))
        reads.append(readable)
        np.testing.assert_array_equal(np.asarray(rows()), advance_packed(pack_step_rows(tokens, lengths, use, rid, stp)))
    assert eng.stats.packed_reused - reused0 == 3  # steps 1..3 took the device rows; 0 and 9 were copied in
    assert len(set(seen)) == 1, "the row array must stay at one address"
    toks = [int(np.asarray(r)[0]) for r in reads]  # all still readable: copies, not the donated originals
    assert all(0 <= t < eng.cfg.vocab_size for t in toks)
    assert [r.output_ids for r in eng.generate(requests[:2])] == alone[:2]


def test_synced_step_keeps_cache_buffers(model, requests):
    """The unpipelined step donates the cache and returns it first, so every cache leaf (also the
    [B] int32 positions, which the [B] int32 next tokens would otherwise take) keeps its buffer."""
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8)
    eng.generate([requests[0]])
    ptrs = lambda: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(eng.cache)]  # noqa: E731
    for _ in range(3):
        before = ptrs()
        nxt, _ = eng.step(np.array([[5], [0]]), np.array([1, 0]))
        assert ptrs() == before and nxt.shape == (2,)


def test_decode_only_compile_options(model, requests, alone, monkeypatch):
    """DSV41_DECODE_XLA_OPTIONS go to the decode-width step programs only (prefill chunks keep the
    plain ones), and here (CUDA-graph scheduling CONCURRENT, which the CPU backend parses and
    ignores) the tokens are unchanged; a malformed entry names the variable."""
    import jax

    from dsv41_jax import engine as engine_mod
    from dsv41_jax.xla_flags import decode_compiler_options

    opts = decode_compiler_options("xla_gpu_command_buffer_scheduling_mode=CONCURRENT, --xla_dump_hlo_as_text=true")
    assert opts == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_dump_hlo_as_text": "true"}
    assert decode_compiler_options("") == {}
    with pytest.raises(ValueError, match="DSV41_DECODE_XLA_OPTIONS: 'CONCURRENT' is not name=value"):
        decode_compiler_options("CONCURRENT")
    base = engine_mod._flat_params(engine_mod._engine_step_pipe)
    used = []

    def spy(tag, fn):
        def call(*a, **k):
            used.append(tag)
            return fn(*a, **k)
        call.lower = fn.lower
        return call

    dec = jax.jit(base, donate_argnums=(1, 2, 4, 5), static_argnames=engine_mod._STEP_STATICS,
                  compiler_options={"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"})
    monkeypatch.setattr(engine_mod, "_engine_step_pipe_decode_jit", spy("decode", dec))
    monkeypatch.setattr(engine_mod, "_engine_step_pipe_jit", spy("plain", engine_mod._engine_step_pipe_jit))
    eng = Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8, engram_mode="device", stop_ids=())
    assert eng.pipelined
    res = eng.generate(requests[:2])
    assert [r.output_ids for r in res] == alone[:2]
    assert "decode" in used and "plain" in used  # prefill chunks (width 8) on the plain program
    assert engine_mod.step_program(1, False) is engine_mod._engine_step_decode_jit
    assert engine_mod.step_program(8, True) is engine_mod._engine_step_pipe_jit
