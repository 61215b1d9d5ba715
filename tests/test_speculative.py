"""DSpark speculative decoding (dsv41_jax/speculative.py) on the tiny v41_tiny_a model, float32 with
unquantized KV, batch 2, max_seq_len 160, prefill chunk 8 (compiled programs shared with
tests/test_dspark.py).

* greedy speculation is token-for-token identical to plain decoding, with high
  acceptance simulated by oracle drafts (the target's own greedy continuation, corrupted at a
  cycling position, so every accepted count 0..5 occurs) and with the real (random-weight) drafter;
  prompts of 13 and 30 tokens so verify chunks straddle ratio-2 blocks, ratio-1 candidate blocks of
  4 and the 16-slot window wrap;
* after rollback the backbone cache (window rings, compressed KV, index keys, compressor state,
  positions) and the DSpark rings equal, bit for bit, those of a plain run over the same committed
  tokens (no slot excepted: rejected blocks' compressed/index-key entries are restored too);
* the sampled acceptance rule reproduces the target distribution exactly (chi-square on synthetic
  p / q, fixed keys);
* the confidence scheduler picks long blocks when confident, short ones when not; on a given
  step-cost table it picks the draft count maximizing expected tokens per second (checked against a
  brute-force evaluation), and verify-all when the costs are flat;
* continuous batching: five requests of different prompt lengths and max_new_tokens on two slots
  give the plain Engine's greedy tokens for every request (real drafter, oracle drafts with a
  stop token, confidence policy); a request admitted into a recycled slot ends with the same
  output and the same slot state (backbone and DSpark caches, Engram history, position) as when
  run alone in a fresh generator; sampled requests draw the same tokens alone and in recycled
  slots; the CLI (``--speculative dspark``, 5 prompts, ``--batch-size 2``) goes through it;
* spec_bench prints verify-all and the confidence policy side by side (slow).
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.engine import Engine, Request
from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions
from dsv41_jax.speculative import SpeculativeGenerator, accept, choose_width, expected_tokens
from tests.test_model_fixture import FIX, read_fixture

F32 = RunOptions(dtype="float32", kv_cache_dtype="float32")
PLENS = (13, 30)
NEW = 24


@pytest.fixture(scope="module")
def model():
    return Model.from_checkpoint(FIX)


@pytest.fixture(scope="module")
def prompts():
    ids = read_fixture()["input_ids"]
    return [list(ids[b, :P]) for b, P in enumerate(PLENS)]


def _gen(model, **kw):
    return SpeculativeGenerator(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8, pad_width=True, **kw)


@pytest.fixture(scope="module")
def plain(model, prompts):
    """Plain greedy decoding (verify 0 drafts per step)."""
    return _gen(model, policy="fixed:0").generate(prompts, NEW)


def oracle_proposer(full, state):
    """Drafts from the known greedy continuation ``full[i]`` of request ``i``, with the first wrong
    draft at a position that cycles through 0..5 (5 = all right) from step to step and request to
    request, so every accepted count occurs; ``state["cut"]`` records the cuts."""

    def propose(i, pos, tok):
        f = full[i]
        assert tok[0] == f[pos]  # the anchor is the committed next token
        cut = (state["step"] // 2 + 3 * i) % 6  # first wrong draft (5 = all right)
        state["step"] += 1
        state["cut"].append(cut)
        for j in range(1, len(tok)):
            tok[j] = f[pos + j] if pos + j < len(f) else 0
            if j - 1 == cut:
                tok[j] = (tok[j] + 1) % 192
        return tok

    return propose


@pytest.fixture(scope="module")
def oracle_run(model, prompts, plain):
    full = [prompts[b] + plain[b] for b in range(2)]
    state = {"step": 0, "cut": []}
    propose = oracle_proposer(full, state)

    gen = _gen(model, propose=propose)
    out, st = gen.generate(prompts, NEW, return_state=True)
    return out, st, gen.stats, state["cut"]


def test_greedy_oracle_drafts_identical(oracle_run, plain):
    out, _, stats, cuts = oracle_run
    assert out == plain
    assert set(cuts) == set(range(6))  # every accepted count 0..5 was exercised
    assert stats.acceptance_length > 2.5


def test_greedy_real_drafter_identical(model, prompts, plain):
    gen = _gen(model)
    assert gen.generate(prompts, NEW) == plain
    assert gen.stats.drafted > 0


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def test_rollback_cache_equals_plain_run(model, prompts, oracle_run):
    """Backbone + DSpark caches after speculative steps with rejections = a plain run that committed
    the same tokens (plain decode stops with the last token unfed: max_new = pos - prompt_len + 1)."""
    _, (cache, dcache, _, pos), _, _ = oracle_run
    mnt = [int(pos[b]) - PLENS[b] + 1 for b in range(2)]
    _, (cache0, dcache0, _, pos0) = _gen(model, policy="fixed:0").generate(prompts, mnt, return_state=True)
    np.testing.assert_array_equal(pos, pos0)
    assert_trees_equal(cache, cache0)
    assert_trees_equal(dcache, dcache0)


def assert_trees_equal(tree, ref):
    """Same paths, same infinities, every finite value bit-exact (in float32)."""
    got, want = _leaves(tree), _leaves(ref)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert (np.isinf(a) == np.isinf(b)).all(), jax.tree_util.keystr(path)
        fin = ~np.isinf(a)
        np.testing.assert_array_equal(a[fin], b[fin], err_msg=jax.tree_util.keystr(path))


def test_sampled_acceptance_rule_is_lossless():
    """Two drafts from q, target p fixed per position; the emitted tokens (first always, second when
    the first draft was accepted) follow p exactly: chi-square over 40000 fixed keys."""
    V, N = 6, 40000
    rng = np.random.default_rng(0)
    lp = rng.normal(size=(3, V)).astype(np.float32) * 1.5
    lq = rng.normal(size=(2, V)).astype(np.float32) * 1.5
    p = np.exp(lp) / np.exp(lp).sum(-1, keepdims=True)
    q = np.exp(lq) / np.exp(lq).sum(-1, keepdims=True)
    keys = jax.random.split(jax.random.PRNGKey(1), N)
    kd = jax.random.split(jax.random.PRNGKey(2), N)
    drafts = jax.vmap(lambda k: jax.random.categorical(k, jnp.asarray(lq), axis=-1))(kd).astype(jnp.int32)  # [N,2]
    logits = jnp.broadcast_to(jnp.asarray(lp), (N, 3, V))
    dlog = jnp.broadcast_to(jnp.asarray(lq), (N, 2, V))
    n_acc, nxt = jax.jit(lambda d, k: accept(logits, d, jnp.full((N,), 2), dlog, k, 1.0, greedy=False))(drafts, keys)
    n_acc, nxt, drafts = np.asarray(n_acc), np.asarray(nxt), np.asarray(drafts)
    first = np.where(n_acc >= 1, drafts[:, 0], nxt)
    second = np.where(n_acc >= 2, drafts[:, 1], nxt)[n_acc >= 1]
    third = nxt[n_acc == 2]  # the bonus token
    for toks, pr in ((first, p[0]), (second, p[1]), (third, p[2])):
        cnt = np.bincount(toks, minlength=V)
        exp = pr * len(toks)
        chi2 = ((cnt - exp) ** 2 / exp).sum()
        assert chi2 < 20.5, (chi2, cnt, exp)  # p = 0.001 at 5 degrees of freedom
    # the acceptance rate of draft 1 is sum(min(p, q))
    np.testing.assert_allclose((n_acc >= 1).mean(), np.minimum(p[0], q[0]).sum(), atol=0.01)


def test_greedy_accept_rule():
    logits = jnp.zeros((3, 4, 5)).at[:, :, 2].set(1.0).at[1, 2, 2].set(0.0).at[1, 2, 4].set(1.0)
    drafts = jnp.array([[2, 2, 2], [2, 2, 2], [2, 3, 2]], jnp.int32)
    n_acc, nxt = accept(logits, drafts, jnp.array([3, 3, 3]), greedy=True)
    assert n_acc.tolist() == [3, 2, 1] and nxt.tolist() == [2, 4, 2]
    n_acc, nxt = accept(logits, drafts, jnp.array([1, 3, 0]), greedy=True)
    assert n_acc.tolist() == [1, 2, 0] and nxt.tolist() == [2, 4, 2]


def test_confidence_policy(model):
    gen = _gen(model, policy="confidence")
    gen.cost = {S: 1.0 + 0.05 * S for S in range(1, 7)}
    act = np.array([True, True])
    room = np.array([100, 100])
    assert gen._choose(np.full((2, 5), 8.0), act, room).tolist() == [5, 5]
    assert gen._choose(np.full((2, 5), -8.0), act, room).tolist() == [0, 0]
    k = gen._choose(np.array([[8.0, 8.0, -8.0, 8.0, 8.0]] * 2), act, room)
    assert k.tolist() == [2, 2]
    assert gen._choose(np.full((2, 5), 8.0), act, np.array([3, 100])).tolist() == [3, 5]


def _logit(p):
    p = np.asarray(p, np.float64)
    return np.log(p / (1 - p))


def test_choose_width_hand_example():
    """Acceptance probabilities 0.9, 0.8, 0.5, 0.2, 0.1 -> prefix survival .9, .72, .36, .072, .0072,
    expected tokens for k = 0..5: 1, 1.9, 2.62, 2.98, 3.052, 3.0592."""
    conf = _logit([[0.9, 0.8, 0.5, 0.2, 0.1]])
    act = np.array([True])
    np.testing.assert_allclose(expected_tokens(conf, act), [1, 1.9, 2.62, 2.98, 3.052, 3.0592], rtol=1e-12)
    # t(S) = 1 + 0.25 (S-1): tokens/s 1, 1.52, 1.747, 1.703, 1.526, 1.360 -> verify 2
    assert choose_width(conf, act, {S: 1 + 0.25 * (S - 1) for S in range(1, 7)}) == 2
    assert choose_width(conf, act, {S: float(S) for S in range(1, 7)}) == 0  # t grows like S: no drafting
    assert choose_width(conf, act, {S: 0.02 for S in range(1, 7)}) == 5  # flat: verify all
    # each verified draft adds 10 % to the step: sure drafts -> all 5 (5.995 / 1.5 > 4.996 / 1.4); p = 0.3
    # -> 1 (1.3 / 1.1 beats 1 and 1.39 / 1.2); p = 0.05 -> none (1.05 / 1.1 < 1)
    lin = {S: 1 + 0.1 * (S - 1) for S in range(1, 7)}
    assert choose_width(_logit([[0.999] * 5]), act, lin) == 5
    assert choose_width(_logit([[0.3] * 5]), act, lin) == 1
    assert choose_width(_logit([[0.05] * 5]), act, lin) == 0
    # the batch's rows add up: one sure row and one hopeless row still verify all
    assert choose_width(_logit([[0.999] * 5, [0.05] * 5]), np.array([True, True]), lin) == 5
    assert choose_width(_logit([[0.999] * 5, [0.05] * 5]), np.array([False, True]), lin) == 0


def test_choose_width_maximizes_expected_tokens_per_second():
    """Random step-cost tables (non-decreasing in width, as calibrate keeps them) and confidences:
    the choice attains the brute-force maximum of expected tokens per second (evaluated here with
    explicit products), the larger k on ties; flat costs always give verify-all."""
    rng = np.random.default_rng(0)
    G = 5
    for _ in range(300):
        B = int(rng.integers(1, 5))
        conf = rng.normal(0.0, 4.0, (B, G))
        conf[rng.random((B, G)) < 0.1] = -800.0  # sigmoid underflows to 0: exact ties in expected tokens
        active = rng.random(B) < 0.8
        cost = dict(zip(range(1, G + 2), np.cumsum(rng.uniform(0.0, 0.5, G + 1) * (rng.random(G + 1) < 0.7)) + 1.0))
        sig = 1.0 / (1.0 + np.exp(-np.maximum(conf, -700.0)))
        tok = []
        for k in range(G + 1):
            e = 0.0
            for b in range(B):
                if active[b]:
                    e += 1.0 + sum(float(np.prod(sig[b, :i + 1])) for i in range(k))
            tok.append(e)
        rate = np.array([tok[k] / cost[k + 1] for k in range(G + 1)])
        k = choose_width(conf, active, cost)
        assert rate[k] >= rate.max() * (1 - 1e-12)
        assert not (rate[k + 1:] >= rate[k] * (1 - 1e-12)).any()  # ties go to the larger count
        assert choose_width(conf, active, {S: 0.7 for S in range(1, G + 2)}) == G


def test_confidence_policy_lossless_under_a_cost_table(model, prompts, plain):
    """With a cost table that makes the chosen count vary with the drafter's confidence, greedy
    output is still the plain decode's (the policy only changes how much is verified)."""
    gen = _gen(model, policy="confidence")
    gen.cost = {S: 1.0 + 0.02 * (S - 1) for S in range(1, 7)}
    assert gen.generate(prompts, NEW) == plain
    assert gen.stats.drafted > 0


# ---------------------------------------------------------------------------------------------
# continuous batching
# ---------------------------------------------------------------------------------------------

CB_LENS = (13, 30, 7, 21, 17)
CB_NEW = (24, 9, 17, 5, 12)


@pytest.fixture(scope="module")
def cb_prompts():
    ids = read_fixture()["input_ids"]
    return [[int(t) for t in ids[i % 2, 3 * i:3 * i + L]] for i, L in enumerate(CB_LENS)]


@pytest.fixture(scope="module")
def engine(model):
    """The plain engine (batch 2, chunk 8, max_seq_len 160: the programs of tests/test_engine.py)."""
    return Engine(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8)


def _engine_greedy(engine, prompts, new, stop_ids=(1,)):
    engine.stop_ids = frozenset(stop_ids)
    try:
        return [r.output_ids for r in engine.generate([Request(p, n) for p, n in zip(prompts, new)])]
    finally:
        engine.stop_ids = frozenset((1,))


def test_continuous_batching_real_drafter_equals_engine(model, engine, cb_prompts):
    want = _engine_greedy(engine, cb_prompts, CB_NEW)
    gen = _gen(model)
    finished = []
    got = gen.generate(cb_prompts, list(CB_NEW), on_finish=lambda i, o, r: finished.append(i))
    assert got == want
    assert sorted(finished) == list(range(5)) and gen.stats.admitted == 5
    assert finished != sorted(finished) or len(set(CB_NEW)) == 1  # requests end out of order


def test_continuous_batching_oracle_drafts_with_stop_token(model, engine, cb_prompts):
    """High acceptance (every accepted count 0..5) in recycled slots, and a stop token that ends two
    requests early (a token the plain run emits mid-sequence)."""
    base = _engine_greedy(engine, cb_prompts, CB_NEW)
    stop = base[0][5]
    stops = (1, stop)
    want = _engine_greedy(engine, cb_prompts, CB_NEW, stops)
    assert sum(w[-1] == stop and len(w) < n for w, n in zip(want, CB_NEW)) >= 1  # the stop token is exercised
    full = [p + w for p, w in zip(cb_prompts, want)]
    state = {"step": 0, "cut": []}
    propose = oracle_proposer(full, state)

    reasons = {}
    gen = _gen(model, propose=propose, stop_ids=stops)
    got = gen.generate(cb_prompts, list(CB_NEW), on_finish=lambda i, o, r: reasons.__setitem__(i, r))
    assert got == want
    assert set(state["cut"]) == set(range(6))
    assert gen.stats.acceptance_length > 2.0
    assert [reasons[i] for i in range(5)] == ["stop" if w[-1] in stops else "length" for w in want]


def test_recycled_slot_keeps_nothing_of_its_previous_occupant(model, cb_prompts):
    """Request C enters the slot of a finished request (a 30-token prompt that wrote window rings,
    compressed entries and DSpark rings well past C's positions). Its output and, at the end, the
    whole slot state (backbone cache row, DSpark rings, Engram history row, position) equal a run
    of C alone in a fresh generator."""
    A, Bq, C = cb_prompts[0], cb_prompts[1], cb_prompts[2]
    gen = _gen(model)
    out, (cache, dcache, hist, pos) = gen.generate([A, Bq, C], [24, 9, 10], return_state=True)
    slot = [b for b in range(2) if list(hist[b, :len(C)]) == C and int(pos[b]) < len(Bq) + 9]
    assert len(slot) == 1 and gen.stats.admitted == 3
    b = slot[0]
    alone = _gen(model)
    out1, (cache1, dcache1, hist1, pos1) = alone.generate([C], [10], return_state=True)
    assert out[2] == out1[0]
    assert int(pos[b]) == int(pos1[0])
    np.testing.assert_array_equal(hist[b], hist1[0])
    for tree, ref in ((cache, cache1), (dcache, dcache1)):
        got, want = _leaves(tree), _leaves(ref)
        assert [p for p, _ in got] == [p for p, _ in want]
        for (path, x), (_, y) in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x, np.float32)[b], np.asarray(y, np.float32)[0],
                                          err_msg=jax.tree_util.keystr(path))


def test_sampled_tokens_do_not_depend_on_the_slot(model, cb_prompts):
    """T = 1 with top-k / top-p: random keys come from (seed, request, the request's own step), so each
    request samples the same tokens alone as among five requests cycling through two slots."""
    from dsv41_jax.sampling import SamplingParams

    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=5)
    new = [8, 3, 6, 4, 7]
    gen = _gen(model)
    crowd = gen.generate(cb_prompts, new, sp)
    assert gen.stats.accepted > 0  # sampled drafts do get accepted: multi-token commits in recycled slots
    alone = [_gen(model).generate([p], [m], sp, sample_ids=[i])[0] for i, (p, m) in enumerate(zip(cb_prompts, new))]
    assert crowd == alone
    assert [len(c) for c in crowd] == new or any(c[-1] == 1 for c in crowd)


def test_cli_speculative_dspark_continuous_batching(tmp_path, engine, cb_prompts, capsys):
    """Five prompts on two slots through ``python -m dsv41_jax.generate --speculative dspark``."""
    import json

    from dsv41_jax import generate

    new = 10
    want = _engine_greedy(engine, cb_prompts, [new] * 5)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in cb_prompts))
    out = tmp_path / "o.jsonl"
    rc = generate.main(["--checkpoint", FIX, "--prompts", str(src), "--output", str(out), "--max-new-tokens", str(new),
                        "--dtype", "float32", "--kv-cache-dtype", "float32", "--batch-size", "2", "--prefill-chunk", "8",
                        "--max-seq-len", "154", "--speculative", "dspark", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == list(range(5))
    assert [r["output_ids"] for r in recs] == want
    assert [r["prompt_tokens"] for r in recs] == list(CB_LENS)
    assert all(r["finish_reason"] == ("stop" if r["output_ids"][-1] == 1 else "length") for r in recs)
    assert "acceptance length" in err and "batch 2 slots for 5 prompts" in err and "5 admissions" in err


def test_cli_speculative_mesh(capsys, monkeypatch):
    """The speculative loop takes a mesh without dp (here dp=1 on one device: the CLI hands the mesh
    to the generator); a dp split it cannot honour is refused in one line that names --mesh, not
    ignored. (DSpark on ep=2 over two devices: tests/test_speculative_mesh.py.)"""
    from dsv41_jax import generate, speculative

    seen = {}

    class Stop(Exception):
        pass

    def fake(model, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(speculative, "SpeculativeGenerator", fake)
    monkeypatch.setenv("DSV41_DEBUG", "1")  # let the stand-in's exception through main()
    with pytest.raises(Stop):
        generate.main(["--checkpoint", FIX, "--prompt", "x", "--speculative", "dspark", "--mesh", "dp=1",
                       "--max-new-tokens", "3", "--no-progress"])
    monkeypatch.delenv("DSV41_DEBUG")
    assert seen["mesh"] is not None and seen["mesh"].devices.size == 1
    rc = generate.main(["--checkpoint", FIX, "--prompt", "x", "--speculative", "dspark", "--mesh", "dp=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--mesh" in err[0] and err[0].startswith("error: ")


@pytest.mark.slow
def test_spec_bench_policy_comparison(tmp_path, capsys):
    """``python -m dsv41_jax.spec_bench --rows engine,policies``: verify-all and the confidence policy
    in one table (acceptance length, drafts verified, tok/s), both token-identical to the engine;
    3 prompts on 2 slots (continuous batching). On a checkpoint of the fixture's first 3 layers and
    its 3 DSpark stages (``tiny_short.cut_layers``): the table and the policies do not depend on the
    layers' attention kinds, and the confidence policy's calibration compiles a verify program per
    width (alone 73.2 -> 40.5 CPU-s; in its module, which shares programs through the compile cache,
    39 -> 26 s)."""
    import os
    import shutil

    from dsv41_jax import spec_bench
    from dsv41_jax.checkpoint import load_checkpoint
    from dsv41_jax.checkpoint.writer import save_checkpoint
    from tests.tiny_short import cut_layers, cut_params

    cfg, params = load_checkpoint(FIX)
    ck = tmp_path / "v41_tiny_a_3_layers"
    save_checkpoint(cut_params(params, 3), cut_layers(cfg, 3), ck)
    shutil.copy(os.path.join(FIX, "tokenizer.json"), ck)
    spec_bench.main(["--checkpoint", str(ck), "--dtype", "float32", "--kv-cache-dtype", "float32", "--prompt-len", "9",
                     "--new-tokens", "6", "--batch-size", "2", "--num-prompts", "3", "--max-seq-len", "160",
                     "--prefill-chunk", "8", "--runs", "1", "--rows", "engine,policies"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| policy |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    assert {"acceptance length", "drafts verified / row-step", "decode tok/s median"} <= set(cols)
    rows = {r[0]: dict(zip(cols, r)) for r in ([c.strip() for c in ln.strip("|").split("|")]
                                                for ln in lines[head + 2:head + 4])}
    assert set(rows) == {"verify-all", "confidence"}
    assert rows["verify-all"]["drafts verified / row-step"] == "5.00"
    assert all(r["identical to engine"] == "True" for r in rows.values())
    assert all(float(r["decode tok/s median"]) > 0 for r in rows.values())
    assert "verify cost table" in out


def test_spec_bench_text_prompts(tmp_path):
    """``spec_bench --text-file``: natural-text prompts are BOS + consecutive pieces of the text's
    tokens (wrapping around a short text); a text shorter than one prompt, or a tokenizer whose ids
    the model cannot embed, is refused with a message naming the flag."""
    import pytest as _pytest

    from dsv41_jax.spec_bench import text_prompts
    from dsv41_jax.tokenizer import encode, load_tokenizer

    text = "The quick brown fox jumps over the lazy dog. " * 3 + "Speculative decoding drafts tokens."
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    ids = encode(load_tokenizer(), text)
    ps = text_prompts(str(f), None, 3, 9, 129280)
    assert [len(p) for p in ps] == [9, 9, 9] and all(p[0] == 0 for p in ps)
    flat = [t for p in ps for t in p[1:]]
    assert flat == [ids[i % len(ids)] for i in range(24)]
    with _pytest.raises(SystemExit, match="--prompt-len"):
        text_prompts(str(f), None, 1, len(ids) + 5, 129280)
    with _pytest.raises(SystemExit, match="outside the model's vocabulary"):
        text_prompts(str(f), None, 1, 5, 10)


def _watch_verify_steps(monkeypatch) -> list:
    """Wrap ``spec_step_io_jit``; each call appends (its donated inputs' buffer addresses equal its
    outputs', the step buffer's address, the width S, every donated input committed to a device).
    The last: an uncommitted first step (fresh caches, a jnp.zeros step buffer) and committed later
    ones are two jit cache entries, i.e. every verify program compiled twice (session 9)."""
    import dsv41_jax.speculative as spec

    ptr = lambda a: a.unsafe_buffer_pointer()  # noqa: E731
    leaves = lambda *t: [ptr(x) for x in jax.tree.leaves(t)]  # noqa: E731
    calls = []
    orig = spec.spec_step_io_jit

    def watched(params, cache, dcache, dl, io, *a, **k):
        before = leaves(cache, dcache, dl, io)
        committed = all(x.committed for x in jax.tree.leaves((cache, dcache, dl, io)))
        out = orig(params, cache, dcache, dl, io, *a, **k)
        calls.append((before == leaves(*out), ptr(out[3]), k["S"], committed))
        return out

    monkeypatch.setattr(spec, "spec_step_io_jit", watched)
    return calls


def test_verify_steps_keep_their_buffers(model, prompts, plain, monkeypatch):
    """Each verify step overwrites its donated caches, draft logits and int32 step buffer in place
    (outputs paired with the donated inputs they are meant for), and the host's per-step inputs
    enter one persistent step buffer, so consecutive verify steps reference the same device
    buffers and XLA need not re-record their CUDA graph (BENCHMARKS.md, session 6); the tokens are
    unchanged (greedy = plain decoding)."""
    calls = _watch_verify_steps(monkeypatch)
    out = _gen(model).generate(prompts, NEW)
    assert out == plain
    assert len(calls) >= 4
    assert all(c[0] for c in calls), "a verify step's outputs must overwrite its donated inputs"
    assert len({c[1] for c in calls}) == 1, "the step buffer must keep one address"
    assert all(c[3] for c in calls), "every verify step's state must be committed (else two compilations)"


def test_calibrate_times_the_loops_verify_program(model, prompts, plain, monkeypatch):
    """calibrate() measures the program the generation loop runs: spec_step_io_jit with its donated
    buffers kept from step to step (the same check as above), one positive cost per verify width
    (with pad_width all from the gamma + 1 program); generate afterwards compiles no new verify
    program and gives the same tokens. A max_seq_len without room for the timed steps is refused
    with the numbers."""
    import dsv41_jax.speculative as spec

    orig = spec.spec_step_io_jit
    calls = _watch_verify_steps(monkeypatch)
    gen = _gen(model)  # pad_width: every width runs (and is timed as) the gamma + 1 program
    cost = gen.calibrate(reps=2)
    G = model.cfg.dspark_block_size
    assert sorted(cost) == list(range(1, G + 2)) and len(set(cost.values())) == 1 and cost[1] > 0
    assert [c[2] for c in calls] == [G + 1] * 3 and all(c[0] and c[3] for c in calls)
    assert len({c[1] for c in calls}) == 1  # one step-buffer address across the timed steps
    n_programs = orig._cache_size()
    assert gen.generate(prompts, NEW) == plain  # verify-all: every step at width G + 1
    assert orig._cache_size() == n_programs, "generate compiled a verify program calibrate had not timed"
    with pytest.raises(ValueError, match=r"max_seq_len 16 .* needs max_seq_len >= 19"):
        SpeculativeGenerator(model, batch_size=1, max_seq_len=16, opts=F32, prefill_chunk=8).calibrate(reps=2)
