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
* the confidence scheduler picks long blocks when confident, short ones when not.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions
from dsv41_jax.speculative import SpeculativeGenerator, accept
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


@pytest.fixture(scope="module")
def oracle_run(model, prompts, plain):
    full = [prompts[b] + plain[b] for b in range(2)]
    state = {"step": 0, "cut": []}

    def propose(b, pos, tok):
        f = full[b]
        assert tok[0] == f[pos]  # the anchor is the committed next token
        cut = (state["step"] // 2 + 3 * b) % 6  # first wrong draft (5 = all right)
        state["step"] += 1
        state["cut"].append(cut)
        for i in range(1, len(tok)):
            tok[i] = f[pos + i] if pos + i < len(f) else 0
            if i - 1 == cut:
                tok[i] = (tok[i] + 1) % 192
        return tok

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
    for tree, ref in ((cache, cache0), (dcache, dcache0)):
        got, want = _leaves(tree), _leaves(ref)
        assert [p for p, _ in got] == [p for p, _ in want]
        for (path, a), (_, b) in zip(got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            same_inf = np.isinf(a) == np.isinf(b)
            assert same_inf.all(), jax.tree_util.keystr(path)
            fin = ~np.isinf(a)
            np.testing.assert_array_equal(a[fin], b[fin], err_msg=jax.tree_util.keystr(path))  # bit-exact


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


def test_cli_speculative_dspark(tmp_path, prompts, plain, capsys):
    import json

    from dsv41_jax import generate

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [int(t) for t in p]}) + "\n" for p in prompts))
    out = tmp_path / "o.jsonl"
    rc = generate.main(["--checkpoint", FIX, "--prompts", str(src), "--output", str(out), "--max-new-tokens", str(NEW),
                        "--dtype", "float32", "--kv-cache-dtype", "float32", "--batch-size", "2", "--prefill-chunk", "8",
                        "--max-seq-len", "154", "--speculative", "dspark", "--no-progress"])
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_ids"] for r in recs] == plain
    assert "acceptance length" in capsys.readouterr().err
