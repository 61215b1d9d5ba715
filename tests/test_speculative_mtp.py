"""Speculative decoding with V4's MTP block as the drafter (dsv41_jax/mtp_draft.py, the ``mtp``
drafter of dsv41_jax/speculative.py) on the tiny V4 model (the v4_tiny_a fixture's backbone plus a
random MTP block, as tests/test_mtp.py), float32, batch 2, prefill chunk 8, window 16, ratios 4
(overlapping, with its own indexer compressor) and 8. The backbone keeps the fixture's first 3
layers (ratios 0, 4, 8: each layer kind once; its layers 3-4 repeat 1-2): the module 113 -> 100 CPU-s.

* greedy speculation gives the plain Engine's tokens, with the real (random-weight) MTP drafts and
  with oracle drafts that are right and wrong in turn (so both accept counts occur);
* after verify steps with rejections the backbone cache (window rings, compressed KV, index keys,
  both compressors' partial-block states) and the MTP block's cache equal, bit for bit, those of a
  plain run over the same committed tokens: V4's rollback;
* every draft is what the MTP block predicts from the whole committed sequence run at once
  (one forward over prompt + output, then the block over all positions): the incremental MTP cache
  (chunked prompt, one position behind, first token) is right;
* continuous batching on a recycled slot and sampled decoding run; the CLI takes
  ``--speculative mtp``; a model without the block is refused with a clear message.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.cache import init_cache, init_mtp_cache
from dsv41_jax.checkpoint import read_official
from dsv41_jax.engine import Engine, Request
from dsv41_jax.model import Model
from dsv41_jax.mtp import mtp_forward_jit
from dsv41_jax.options import RunOptions
from dsv41_jax.sampling import SamplingParams
from dsv41_jax.speculative import SpeculativeGenerator, choose_drafter
from dsv41_jax.transformer import forward_step_jit
from tests.test_mtp import v4_with_mtp
from tests.test_speculative import assert_trees_equal

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v4_tiny_a")
F32 = RunOptions(dtype="float32", kv_cache_dtype="float32", hadamard=False)
PLENS = (13, 30)
NEW = 20
CAP = 96


@pytest.fixture(scope="module")
def model():
    return Model(*v4_with_mtp(n_layers=3))  # sliding, CSA (ratio 4 + indexer) and HCA (ratio 8): see the docstring


@pytest.fixture(scope="module")
def prompts():
    ids = np.asarray(read_official(os.path.join(FIX, "fixture.safetensors"))["input_ids"])
    return [[int(t) for t in ids[b % ids.shape[0], :P]] for b, P in enumerate(PLENS)]


def _gen(model, **kw):
    return SpeculativeGenerator(model, batch_size=2, max_seq_len=CAP, opts=F32, prefill_chunk=8, pad_width=True,
                                stop_ids=(), drafter="mtp", **kw)


@pytest.fixture(scope="module")
def plain(model, prompts):
    eng = Engine(model, batch_size=2, max_seq_len=CAP, opts=F32, prefill_chunk=8, stop_ids=())
    res = eng.generate([Request(p, max_new_tokens=NEW) for p in prompts], SamplingParams())
    return [list(r.output_ids) for r in res]


@pytest.fixture(scope="module")
def real_run(model, prompts):
    log = []

    def propose(i, pos, tok):  # records (request, anchor position, [anchor, draft]); changes nothing
        log.append((i, pos, tok.copy()))
        return tok

    gen = _gen(model, propose=propose)
    out = gen.generate(prompts, NEW)
    return out, gen.stats, log


def test_drafter_choice(model):
    assert choose_drafter(model.cfg, model.params) == "mtp"
    with pytest.raises(ValueError, match="no DSpark stages"):
        choose_drafter(model.cfg, model.params, "dspark")
    bare = {k: v for k, v in model.params.items() if k != "mtp"}
    with pytest.raises(ValueError, match="no drafter"):
        choose_drafter(model.cfg, bare)
    with pytest.raises(ValueError, match="no V4 MTP block"):
        choose_drafter(model.cfg, bare, "mtp")


def test_greedy_real_mtp_drafts_identical(real_run, plain):
    out, stats, _ = real_run
    assert out == plain
    assert stats.drafted > 0 and stats.drafter == "mtp"
    assert "speculative mtp" in stats.summary()


def test_drafts_are_the_blocks_prediction_on_the_whole_sequence(model, prompts, real_run):
    """Each draft (after the first token and after every verify step) equals the argmax of the MTP
    block run once over the whole committed sequence: position t with token t+1 predicts t+2."""
    out, _, log = real_run
    cfg, params = model.cfg, model.params
    for i, p in enumerate(prompts):
        full = np.asarray(p + out[i], np.int32)[None]
        T = full.shape[1]
        _, _, aux = forward_step_jit(params, init_cache(cfg, 1, CAP, F32), jnp.asarray(full),
                                     jnp.asarray([T], jnp.int32), cfg=cfg, opts=F32, return_aux=True)
        nxt = jnp.concatenate([jnp.asarray(full[:, 1:]), jnp.zeros((1, 1), jnp.int32)], 1)
        lg, _ = mtp_forward_jit(params, init_mtp_cache(cfg, 1, CAP, F32), aux["hidden"], nxt,
                                jnp.asarray([T - 1], jnp.int32), cfg=cfg, opts=F32)
        pred = np.asarray(jnp.argmax(lg[0], -1))  # pred[t]: the token at t + 2
        mine = [(pos, tok) for (r, pos, tok) in log if r == i]
        assert len(mine) >= NEW // 2
        for pos, tok in mine:
            assert tok[0] == full[0, pos]  # the anchor is the committed token at pos
            assert tok[1] == pred[pos - 1], (i, pos)


def oracle(full, every=2):
    """Drafts from the known greedy continuation, wrong on every ``every``-th step."""
    state = {"n": 0, "wrong": 0}

    def propose(i, pos, tok):
        state["n"] += 1
        f = full[i]
        tok[1] = f[pos + 1] if pos + 1 < len(f) else 0
        if state["n"] % every == 0:
            tok[1] = (tok[1] + 1) % 256
            state["wrong"] += 1
        return tok

    return propose, state


@pytest.fixture(scope="module")
def oracle_run(model, prompts, plain):
    full = [prompts[b] + plain[b] for b in range(2)]
    propose, state = oracle(full)
    gen = _gen(model, propose=propose)
    out, st = gen.generate(prompts, NEW, return_state=True)
    return out, st, gen.stats, state


def test_greedy_oracle_drafts_identical(oracle_run, plain):
    out, _, stats, state = oracle_run
    assert out == plain
    assert state["wrong"] > 0 and 0 < stats.accepted < stats.drafted  # rejections and acceptances both


def test_rollback_cache_equals_plain_run(model, prompts, oracle_run):
    """Backbone + MTP caches after verify steps with rejections = a run verifying no drafts that
    committed the same tokens (it stops with its last token unfed: max_new = pos - prompt + 1)."""
    _, (cache, mcache, _, pos), _, _ = oracle_run
    mnt = [int(pos[b]) - PLENS[b] + 1 for b in range(2)]
    _, (cache0, mcache0, _, pos0) = _gen(model, policy="fixed:0").generate(prompts, mnt, return_state=True)
    np.testing.assert_array_equal(pos, pos0)
    assert_trees_equal(cache, cache0)  # bit-exact
    assert_trees_equal(mcache, mcache0)


def test_continuous_batching_and_sampling(model, prompts, plain):
    """Three requests on two slots (one slot recycled) give each request's plain greedy tokens;
    sampled decoding draws tokens in range and the same ones alone as next to a neighbour."""
    eng = Engine(model, batch_size=1, max_seq_len=CAP, opts=F32, prefill_chunk=8, stop_ids=())
    reqs = prompts + [prompts[0][:7]]
    want = [list(eng.generate([Request(p, max_new_tokens=9)], SamplingParams())[0].output_ids) for p in reqs]
    assert _gen(model).generate(reqs, 9) == want
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3)
    both = _gen(model).generate(prompts, 8, sp)
    alone = _gen(model).generate(prompts[1:], 8, sp, sample_ids=[1])
    assert all(0 <= t < model.cfg.vocab_size for o in both for t in o)
    assert alone[0] == both[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model):
    """The test model written as an official-layout checkpoint (backbone + mtp.0.*)."""
    from dsv41_jax.checkpoint.writer import save_checkpoint

    ck = tmp_path_factory.mktemp("ck") / "v4_mtp"
    save_checkpoint(model.params, model.cfg, ck)
    return ck


def test_cli_speculative_mtp(tmp_path, ckpt, model, prompts, capsys):
    """``python -m dsv41_jax.generate --speculative mtp`` on a V4 checkpoint with its MTP block
    (written in the official layout): three prompts on two slots, the Engine's greedy tokens."""
    import json

    from dsv41_jax import generate

    ck = ckpt
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    reqs = prompts + [prompts[0][:5]]
    eng = Engine(Model.from_checkpoint(str(ck)), batch_size=2, max_seq_len=64, opts=opts, prefill_chunk=8,
                 stop_ids=(model.cfg.eos_token_id,))
    want = [list(r.output_ids) for r in eng.generate([Request(p, max_new_tokens=8) for p in reqs], SamplingParams())]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in reqs))
    out = tmp_path / "o.jsonl"
    rc = generate.main(["--checkpoint", str(ck), "--prompts", str(src), "--output", str(out), "--max-new-tokens", "8",
                        "--dtype", "float32", "--kv-cache-dtype", "float32", "--batch-size", "2", "--prefill-chunk",
                        "8", "--max-seq-len", "64", "--speculative", "mtp", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [json.loads(line)["output_ids"] for line in out.read_text().splitlines()] == want
    assert "MTP-1" in err and "speculative mtp: acceptance length" in err
    rc = generate.main(["--checkpoint", FIX, "--prompt", "x", "--speculative", "mtp", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: --speculative mtp:") and "no V4 MTP block" in err[-1]


def test_spec_bench_mtp_rows(ckpt, capsys):
    """``python -m dsv41_jax.spec_bench`` on the V4 checkpoint: the engine row and the MTP rows
    (greedy verify-all token-identical to the engine; simulated acceptance runs)."""
    from dsv41_jax import spec_bench

    spec_bench.main(["--checkpoint", str(ckpt), "--dtype", "float32", "--kv-cache-dtype", "float32", "--prompt-len",
                     "12", "--new-tokens", "6", "--batch-size", "2", "--runs", "1", "--rows", "engine,all,simulate",
                     "--simulate", "2"])
    out = capsys.readouterr().out
    assert "engine, no speculation: decode tok/s" in out
    assert "mtp verify-all, greedy" in out and "identical to engine: True" in out
    sim = next(line for line in out.splitlines() if "simulated acceptance 2.0" in line)
    assert sim.startswith("mtp verify-all") and "speculative mtp" in sim
    accepted, drafted = (int(v) for v in sim.split(" drafts accepted")[0].split("(")[-1].split("/"))
    assert accepted == drafted > 0  # 2.0: every draft forced accepted
