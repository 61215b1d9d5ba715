"""lightning_indexer Pallas-Triton pipeline: interpret-mode parity with the reference (top-k sets on
inputs with clear score margins, ascending order, -1 padding, block maxima element by element),
the hierarchical selection paths, the select kernel, shape-support reasons, dispatch, and
cross-lowering for cuda (H200) and rocm (gfx950) at the real V4.1 shapes (decode, verify, prefill)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import Fp4Tensor, quantize_mxfp4
from pallas_kernels.lightning_indexer import api, pallas_triton, pallas_triton_prefill, reference
from pallas_kernels.testing import lower_for

_mx = jax.jit(quantize_mxfp4)
# Small-config knobs that force every code path at tiny sizes: several score tiles, a select program
# smaller than the row (hierarchical descent), and g0 = block_size**2 maxima (the prefill path).
HIER = dict(select_max=64, tile_n=128, chunk=64)
PREFILL = dict(select_max=64, tile_n=128, chunk=64, maxima_budget_bytes=0)


def margin_case(seed, *, b=2, s=3, hi=16, di=64, nc=300, quant=False):
    """Scores with clear margins: every key is c_j * u for one direction u, with distinct |c_j| on a
    grid of step 1 (shuffled), and every head sees q_h = u; with w >= 0 the score of key j is
    W * relu(c_j) * |u|^2 -- distinct positive scores, ratios >= 4/3 apart. In MXFP4 the magnitudes
    {1, 1.5} x 2^e are exact (one key row = its own 32-blocks and e8m0 scales), so the quantized case
    keeps the margins. Drawn with numpy (jax.random compiled each draw on its own)."""
    rng = np.random.default_rng(seed)
    u = np.zeros((di,), np.float32)
    u[: di // 2] = 1.0
    if quant:
        # exactly representable, all distinct: {1, 1.5} x 2^e, e in -80..79
        mags = np.sort(np.outer([1.0, 1.5], 2.0 ** np.arange(-80, 80)).ravel())[:nc]
    else:
        mags = np.arange(1, nc + 1, dtype=np.float32)
    vals = np.resize(mags, nc).astype(np.float32)
    vals = vals * np.where(np.arange(nc) % 5 == 0, -1.0, 1.0)  # some negatives -> relu 0 (ties at 0)
    c = vals[rng.permutation(nc)]
    keys = jnp.asarray(np.broadcast_to(c[None, :, None] * u[None, None, :], (b, nc, di)))
    q = jnp.asarray(np.broadcast_to(u, (b, s, hi, di)))
    w = jnp.asarray(rng.uniform(0.1, 1.0, (b, s, hi)).astype(np.float32))
    if quant:
        keys, q = _mx(keys), _mx(q)
    return q, w, keys, jnp.asarray(c)


def random_fp4(rng, shape, di, scale_bytes, every_byte=False, top=None):
    """MXFP4 [*shape, di] from random code bytes (``every_byte``: the first 256 are 0..255, so every
    e2m1 code sits in both nibbles) and random e8m0 scale bytes in ``scale_bytes`` [lo, hi); ``top``:
    each row's first block scale set to it."""
    data = rng.integers(0, 256, (*shape, di // 2), dtype=np.uint8)
    if every_byte:
        data.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    sc = rng.integers(*scale_bytes, (*shape, di // 32), dtype=np.uint8)
    if top is not None:
        sc[..., 0] = top
    return Fp4Tensor(jnp.asarray(data), jnp.asarray(sc.view(jnp.float8_e8m0fnu)), 32)


def _bernoulli(seed, p, shape):
    return jnp.asarray(np.random.default_rng(seed).random(shape) < p)


def _ref(q, w, k, vis, cb, top_k, wbs):
    f = jax.jit(lambda q, w, k, v, c: reference.lightning_indexer(q, w, k, v, top_k=top_k, candidate_blocks=c,
                                                                  want_block_scores=wbs))
    return f(q, w, k, vis, cb)


def _ref_and_scores(q, w, k, vis, cb, top_k, wbs):
    """The reference's result and its scores (``reference.index_scores``), as one jitted program."""
    f = jax.jit(lambda q, w, k, v, c: (
        reference.lightning_indexer(q, w, k, v, top_k=top_k, candidate_blocks=c, want_block_scores=wbs),
        reference.index_scores(q, w, k, v, candidate_blocks=c)))
    return f(q, w, k, vis, cb)


def _pal(q, w, k, vis, cb, top_k, wbs, cfg=None):
    f = jax.jit(lambda q, w, k, v, c: pallas_triton.lightning_indexer(q, w, k, v, top_k=top_k, candidate_blocks=c,
                                                                      want_block_scores=wbs, interpret=True,
                                                                      config=cfg))
    return f(q, w, k, vis, cb)


def check_result(o, r, scores, top_k, rel_slack=0.0):
    """``o`` against the reference result ``r`` and its ``scores``: ascending positions, -1 padded, as
    many as min(top_k, finite scores); every selected score at least every unselected one (less
    ``rel_slack`` x the row's largest |score|, where the two sum in different orders), and the
    reference's set wherever the k-th score clears the next by more than that. Returns the number
    of rows whose sets were compared."""
    ot, rt = np.asarray(o.topk), np.asarray(r.topk)
    assert ot.shape == rt.shape and ot.dtype == np.int32
    sc = np.asarray(scores, np.float64)
    compared = 0
    for i in range(ot.shape[0]):
        for j in range(ot.shape[1]):
            row = ot[i, j]
            n = int(np.sum(row >= 0))
            assert np.all(row[n:] == -1), "padding must be at the end"
            assert np.all(np.diff(row[:n]) > 0), "positions must be ascending"
            fin = np.isfinite(sc[i, j])
            assert n == min(top_k, int(fin.sum()))
            slack = rel_slack * float(np.abs(sc[i, j][fin]).max(initial=0.0))
            # sets: every selected score >= every unselected finite score (ties allowed at the boundary)
            sel = row[:n]
            rest = np.setdiff1d(np.nonzero(fin)[0], sel)
            if n and rest.size:
                assert sc[i, j][sel].min() >= sc[i, j][rest].max() - slack
            # with clear margins (no tie at the k-th value) the set equals the reference's set
            if n and rest.size and sc[i, j][sel].min() > sc[i, j][rest].max() + slack:
                assert set(sel.tolist()) == set(rt[i, j][rt[i, j] >= 0].tolist())
                compared += 1
    if r.block_scores is not None:
        bo, br = np.asarray(o.block_scores), np.asarray(r.block_scores)
        assert np.array_equal(np.isfinite(bo), np.isfinite(br))
        np.testing.assert_allclose(bo[np.isfinite(br)], br[np.isfinite(br)], rtol=1e-5, atol=1e-6)
    return compared


@pytest.mark.parametrize(
    "quant,cfg,cand,wbs",
    [
        (False, dict(decode_path="pipeline"), False, True),  # plain f32, pipeline, one select, block maxima
        (True, HIER, True, True),       # MXFP4, hierarchical descent, candidate-block mask
        (True, PREFILL, False, False),  # MXFP4, g0 = 64 maxima (prefill path) + rescoring of 64-groups
        # decode_path "direct" (the default): every score, one select (block maxima from the scores)
        (True, dict(tile_n=128, chunk=64), True, True),
        (False, None, False, False),
    ],
    ids=["plain_pipeline", "mxfp4_hier_candmask", "mxfp4_prefill_path", "mxfp4_direct_path_candmask",
         "plain_direct_path"],
)
def test_parity_margins(quant, cfg, cand, wbs):
    top_k = 16
    q, w, k, _ = margin_case(int(quant) + 3 * int(cand), quant=quant)
    b, s, nc = 2, 3, 300
    # visible: all, few (< top_k -> -1 padding), none (all -1), partial
    vis = jnp.array([[nc, 5, 0], [100, 233, nc - 1]], jnp.int32)
    cb = _bernoulli(9, 0.6, (b, s, -(-nc // 8))) if cand else None
    r, scores = _ref_and_scores(q, w, k, vis, cb, top_k, wbs)
    o = _pal(q, w, k, vis, cb, top_k, wbs, cfg)
    assert check_result(o, r, scores, top_k) >= 3  # rows whose set was compared with the reference
    assert np.all(np.asarray(o.topk)[0, 2] == -1)  # nothing visible


def test_random_mxfp4_and_top_k_not_pow2():
    """Fresh random MXFP4 q/k (the real format), top_k = 24 (padded to 32 inside), S = 2."""
    rng = np.random.default_rng(11)
    b, s, hi, di, nc = 1, 2, 16, 64, 200
    q = _mx(jnp.asarray(rng.standard_normal((b, s, hi, di), np.float32)))
    k = _mx(jnp.asarray(rng.standard_normal((b, nc, di), np.float32)))
    w = jnp.asarray(rng.random((b, s, hi), np.float32))
    vis = jnp.array([[nc, 150]], jnp.int32)
    r, scores = _ref_and_scores(q, w, k, vis, None, 24, True)
    o = _pal(q, w, k, vis, None, 24, True, dict(decode_path="pipeline"))
    check_result(o, r, scores, 24)
    # the direct decode path (every score, one select; the default) picks what the pipeline picks,
    # and its block maxima are the pipeline's, bit for bit (the same score kernel arithmetic, the
    # same select); above select_max it is the pipeline
    for cfg in (None, dict(decode_path="direct", tile_n=64, chunk=32)):
        d = _pal(q, w, k, vis, None, 24, True, cfg)
        assert np.array_equal(np.asarray(d.topk), np.asarray(o.topk))
        assert np.array_equal(np.asarray(d.block_scores), np.asarray(o.block_scores))
    big = jax.make_jaxpr(lambda *a: pallas_triton.lightning_indexer(
        *a, top_k=24, config=dict(decode_path="direct", select_max=128)).topk)(q, w, k, vis)
    assert str(big).count("name=indexer_select_topk") > 1  # 200 entries > select_max: the pipeline
    small = jax.make_jaxpr(lambda *a: pallas_triton.lightning_indexer(
        *a, top_k=24, config=dict(decode_path="direct")).topk)(q, w, k, vis)
    assert str(small).count("name=indexer_select_topk") == 1 and "indexer_candidate_scores" not in str(small)
    with pytest.raises(ValueError, match="decode_path='fast'"):
        pallas_triton.lightning_indexer(q, w, k, vis, top_k=24, config=dict(decode_path="fast"))


@pytest.mark.parametrize("s,di,fp4_read,dot_order", [
    (1, 64, "phases", "keys"), (2, 64, "phases", "keys"), (1, 128, "phases", "keys"), (2, 128, "phases", "keys"),
    (1, 128, "bytes", "keys"), (2, 128, "phases", "q"), (1, 128, "f16phases", "keys"), (2, 128, "f16phases", "q"),
    (1, 128, "mx", "keys"), (2, 64, "mx", "q")],
    ids=["decode_q_once", "rows", "words_decode", "words_rows", "bytes_128", "words_q_first", "f16_decode",
         "f16_rows_q_first", "mx_decode", "mx_rows_q_first"])
def test_every_fp4_code_block_maxima(s, di, fp4_read, dot_order, monkeypatch):
    """q and keys from random bytes (all 16 e2m1 codes in both nibbles, -0 included) and random e8m0
    scales: the kernels' decode (q decoded once per program at S = 1) gives the reference's block
    maxima element by element and its top-k sets -- the e4m3-placement byte decode (64-wide heads, and
    ``fp4_read="bytes"``) and the word decode into 8 phase dots (128-wide heads: phase dots of K >= 16),
    with the keys or q as the dots' first operand; and the same words left in float16 with each row's
    largest scale factored out (``f16phases``; these scales lie 18 binades apart at most, inside its
    exact range); and the codes as stored, handed to one MX dot (``mx``: tt.dot_scaled on the GPU, the
    float32 decode of ``pallas_kernels.scaled_dot`` here)."""
    calls = []
    real = pallas_triton._load_rows
    monkeypatch.setattr(pallas_triton, "_load_rows", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    rng = np.random.default_rng()
    b, hi, nc = 1, 16, 256

    q, k = (random_fp4(rng, shape, di, (118, 136), every_byte=True) for shape in ((b, s, hi), (b, nc)))
    w = jnp.asarray(rng.uniform(0.1, 1.0, (b, s, hi)), jnp.float32)
    vis = jnp.asarray(np.full((b, s), nc, np.int32))
    r, scores = _ref_and_scores(q, w, k, vis, None, 32, True)
    o = _pal(q, w, k, vis, None, 32, True, cfg=dict(tile_n=128, chunk=64, fp4_read=fp4_read, dot_order=dot_order))
    # the route taken (word reads need phase dots of K >= 16)
    assert set(calls) == {fp4_read if (fp4_read in pallas_triton.WORD_READS and di == 128) or fp4_read == "mx" else None}
    rb, ob = np.asarray(r.block_scores), np.asarray(o.block_scores)
    np.testing.assert_allclose(ob, rb, rtol=1e-5, atol=1e-5 * np.abs(rb[np.isfinite(rb)]).max())
    check_result(o, r, scores, 32)


def test_f16phases_wide_scale_spread():
    """``f16phases`` where its exactness bound does not hold: block scales 0..45 binades apart within a
    key and within a head (the blocks more than 23 below their row's largest round to f16 subnormals
    or 0). The block maxima stay within 1e-6 of the largest score magnitude of the reference, and the
    top-k sets agree where the margins are clear; fresh random codes and scales."""
    rng = np.random.default_rng()
    b, s, hi, di, nc = 1, 1, 16, 128, 256

    # every row has a block at the top of the range
    q, k = (random_fp4(rng, shape, di, (95, 141), top=140) for shape in ((b, s, hi), (b, nc)))
    w = jnp.asarray(rng.uniform(0.1, 1.0, (b, s, hi)), jnp.float32)
    vis = jnp.asarray(np.full((b, s), nc, np.int32))
    r, scores = _ref_and_scores(q, w, k, vis, None, 32, True)
    o = _pal(q, w, k, vis, None, 32, True, cfg=dict(tile_n=128, chunk=64, fp4_read="f16phases"))
    rb, ob = np.asarray(r.block_scores), np.asarray(o.block_scores)
    np.testing.assert_allclose(ob, rb, rtol=0, atol=1e-6 * np.abs(rb[np.isfinite(rb)]).max())
    check_result(o, r, scores, 32)


def test_select_kernel():
    v = jnp.array([[1.0, 5.0, -jnp.inf, 3.0, 2.0, -1.0, 0.5, 7.0, jnp.nan, 3.0]], jnp.float32)
    sel = jax.jit(lambda v: pallas_triton.select_topk(v, 3, interpret=True))(v)
    assert np.asarray(sel).tolist() == [[1, 3, 7]]  # 7, 5 and the first of the tied 3s
    sel = jax.jit(lambda v: pallas_triton.select_topk(v, 12, interpret=True))(v)
    assert np.asarray(sel).tolist() == [[0, 1, 3, 4, 5, 6, 7, 9, -1, -1, -1, -1]]  # -inf, NaN never picked


@pytest.mark.parametrize("case", ["distinct", "tied_kth", "few_valid", "exactly_k", "negative"])
def test_select_early_exit_equals_full_bisection(case):
    """The bisection that stops at the first threshold with exactly k values at or above it selects
    what the full 32-step bisection selects, and both select the k largest (ties to the lowest
    positions): fresh random rows, a tie spanning the k-th value, fewer or exactly k finite values,
    all-negative values."""
    rng = np.random.default_rng()
    n, k = 300, 40
    v = rng.normal(size=(3, n)).astype(np.float32)
    if case == "tied_kth":  # 12 copies of the value that lands at rank ~k
        kth = np.sort(v, axis=1)[:, ::-1][:, k - 5]
        for r in range(3):
            v[r, rng.choice(n, 12, replace=False)] = kth[r]
    elif case == "few_valid":
        v[:, rng.permutation(n)[: n - 25]] = -np.inf
    elif case == "exactly_k":
        v[:, rng.permutation(n)[: n - k]] = -np.inf
    elif case == "negative":
        v = -np.abs(v) - 1.0
    want = []
    for row in v:  # stable order: larger first, then lower position; finite only
        order = [i for i in np.lexsort((np.arange(n), -row)) if np.isfinite(row[i])][:k]
        want.append(sorted(order) + [-1] * (k - len(order)))
    vj = jnp.asarray(v)
    full = jax.jit(lambda a: pallas_triton.select_topk(a, k, interpret=True, early_exit=False))(vj)
    early = jax.jit(lambda a: pallas_triton.select_topk(a, k, interpret=True, early_exit=True))(vj)
    assert np.asarray(full).tolist() == want
    assert np.asarray(early).tolist() == want


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("early_exit", [True, False])
def test_select_lowers_with_and_without_early_exit(target, early_exit):
    """Both bisections lower to Triton for both vendors at the decode pipeline's select sizes. (The
    32-step one once yielded a literal False from its loop body, which interpret mode runs but the
    Triton lowering refuses: 'Operand 3 of operation scf.yield must be a Value', found on an H100 in
    session 40.)"""
    for n in (4096, 16384):
        lower_for(target, lambda a: pallas_triton.select_topk(a, 512, early_exit=early_exit),
                  jax.ShapeDtypeStruct((8, n), jnp.float32))


def test_api_routes_and_reasons():
    q, w, k, _ = margin_case(5, b=1, s=1, nc=64)
    vis = jnp.array([[64]], jnp.int32)
    r = jax.jit(lambda *a: api.lightning_indexer(*a, top_k=8))(q, w, k, vis)
    o = jax.jit(lambda *a: api.lightning_indexer(*a, top_k=8, implementation="interpret"))(q, w, k, vis)
    assert np.array_equal(np.asarray(r.topk), np.asarray(o.topk))
    bad_q = jnp.zeros((1, 1, 12, 64))
    bad_w = jnp.zeros((1, 1, 12))
    reason = pallas_triton.unsupported_reason(bad_q, bad_w, k, vis, top_k=8)
    assert reason is not None and "power of two" in reason
    with pytest.raises(ValueError, match="power of two"):
        api.lightning_indexer(bad_q, bad_w, k, vis, top_k=8, implementation="pallas")
    assert "block_size" in pallas_triton.unsupported_reason(q, w, k, vis, top_k=8, block_size=6)
    qm, km = _mx(jnp.ones((1, 1, 16, 64))), _mx(jnp.ones((1, 64, 64)))
    assert pallas_triton.unsupported_reason(qm, w, km, vis, top_k=8) is None
    # codes in another layout than nibbles: refused (the kernels decode nibbles)
    assert "'f16pairs'" in pallas_triton.unsupported_reason(qm, w, km.with_packing("f16pairs"), vis, top_k=8)
    assert "select program" in pallas_triton.unsupported_reason(q, w, k, vis, top_k=4096, block_size=8)


SD = jax.ShapeDtypeStruct


def _real_specs(b, s, nc, cand):
    hi, di = 32, 128
    specs = [
        Fp4Tensor(SD((b, s, hi, di // 2), jnp.uint8), SD((b, s, hi, di // 32), jnp.float8_e8m0fnu), block=32),
        SD((b, s, hi), jnp.float32),
        Fp4Tensor(SD((b, nc, di // 2), jnp.uint8), SD((b, nc, di // 32), jnp.float8_e8m0fnu), block=32),
        SD((b, s), jnp.int32),
    ]
    if cand:
        specs.append(SD((b, s, -(-nc // 8)), jnp.bool_))
    return specs


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize(
    "shape,wbs",
    [
        ((1, 1, 1 << 20, False), False),   # decode, 1M entries (hierarchical descent, 3 selects)
        ((8, 1, 65536 + 5, True), True),   # decode batch 8, candidate-block mask, block scores (layer 20)
        ((1, 6, 262144, False), False),    # speculative verify rows
        ((1, 4096, 1 << 20, False), False),  # prefill chunk, 1M cache: tile scores in 512-row blocks
        ((1, 4096, 65538, True), True),    # prefill chunk of a 64K prompt at layer 20 / 24: one block
    ],
    ids=["decode_1M", "decode_b8_cand_blockscores", "verify_s6_256K", "prefill_4096_1M", "prefill_4096_64K_cand"],
)
def test_cross_lowering(target, shape, wbs):
    def f(q, w, k, v, cb=None):
        res = pallas_triton.lightning_indexer(q, w, k, v, top_k=512, candidate_blocks=cb, want_block_scores=wbs)
        return res.topk if res.block_scores is None else (res.topk, res.block_scores)

    text = lower_for(target, f, *_real_specs(*shape)).as_text()
    assert "triton" in text
    if shape[1] == 1 and not wbs:  # the other decode routes (fp4_read "bytes", "f16phases") lower too
        for read in set(pallas_triton.FP4_READS) - {pallas_triton.DEFAULTS["fp4_read"]}:
            lower_for(target, lambda q, w, k, v, read=read: pallas_triton.lightning_indexer(
                q, w, k, v, top_k=512, config=dict(fp4_read=read)).topk, *_real_specs(*shape))


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("shape", [(1, 1, 1280, False), (8, 1, 5121, True)], ids=["b1_1280", "b8_5121_cand"])
def test_direct_decode_path_lowers(target, shape):
    """decode_path "direct" at the protocol's cache sizes (1,280 and 5,121 compressed entries): the
    score kernel at group size 1 and one select, for cuda and rocm."""
    def f(q, w, k, v, cb=None):
        res = pallas_triton.lightning_indexer(q, w, k, v, top_k=512, candidate_blocks=cb, want_block_scores=cb is not None,
                                              config=dict(decode_path="direct"))
        return res.topk if res.block_scores is None else (res.topk, res.block_scores)

    text = lower_for(target, f, *_real_specs(*shape)).as_text()
    assert text.count("indexer_block_maxima") >= 1 and "indexer_candidate_scores" not in text
    # the pipeline (DSV41_INDEXER_DECODE=pipeline) at the same sizes: block maxima, rescoring, selects
    text = lower_for(target, lambda q, w, k, v: pallas_triton.lightning_indexer(
        q, w, k, v, top_k=512, config=dict(decode_path="pipeline")).topk, *_real_specs(*shape)[:4]).as_text()
    assert "indexer_candidate_scores" in text


@pytest.mark.parametrize("budget", [1 << 25, 3 * 200 * 2, 200])
def test_index_scores_head_groups_equal_per_head_float64(budget, monkeypatch):
    """The scores, whatever the head grouping (all heads at once, unrolled groups, the loop over
    single heads), equal sum_h w_h relu(q_h . k_j) computed per head in float64 (rel 1e-6)."""
    monkeypatch.setattr(reference, "SCORE_BUDGET", budget)
    rng = np.random.default_rng()
    b, s, hi, di, nc = 1, 3, 16, 64, 200
    q = _mx(jnp.asarray(rng.normal(size=(b, s, hi, di)), jnp.float32))
    k = _mx(jnp.asarray(rng.normal(size=(b, nc, di)), jnp.float32))
    w = jnp.asarray(rng.uniform(size=(b, s, hi)), jnp.float32)
    vis = jnp.array([[nc, 150, 7]], jnp.int32)
    from dsv41_jax.quant import dequantize

    qf, kf = (np.asarray(a, np.float64) for a in jax.jit(lambda a, b: (dequantize(a, jnp.float32),
                                                                  dequantize(b, jnp.float32)))(q, k))
    want = np.einsum("bsh,bshn->bsn", np.asarray(w, np.float64),
                     np.maximum(np.einsum("bshd,bnd->bshn", qf, kf), 0.0))
    want = np.where(np.arange(nc)[None, None] < np.asarray(vis)[..., None], want, -np.inf)
    # a fresh function per case: jit / make_jaxpr cache traces by function, and the budget is a global
    got = np.asarray(jax.jit(lambda *a: reference.index_scores(*a))(q, w, k, vis))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6 * np.abs(want[fin]).max())
    g = reference.head_group(b, s, hi, nc, budget)
    jaxpr = str(jax.make_jaxpr(lambda *a: reference.index_scores(*a))(q, w, k, vis))
    # decode-sized problems (<= 8 head groups) must not compile to a while loop (a host sync per
    # iteration on a GPU); only the long-prefill fallback loops
    loops = "while" in jaxpr or "scan" in jaxpr  # fori_loop with static bounds is a scan in the jaxpr
    assert loops == (hi // g > 8), (g, budget)


def test_head_group_sizes():
    assert reference.head_group(1, 1, 32, 2048) == 32  # decode: every head in one einsum
    assert reference.head_group(8, 1, 32, 1 << 19) == 8  # 1M context at ratio 2, batch 8: 4 groups
    assert reference.head_group(1, 4096, 32, 16384) == 1  # 64K prefill chunk: one head at a time


def test_index_scores_dot_is_bf16_for_mxfp4_and_fp32_otherwise():
    """MXFP4 q and k dequantize exactly to bf16: the score dot takes bf16 operands (fp32
    accumulation, tensor cores); float32 operands keep the fp32 dot."""
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(1, 1, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 40, 64)), jnp.float32)
    w = jnp.ones((1, 1, 4), jnp.float32)
    vis = jnp.array([[40]], jnp.int32)

    def dots(q, k):
        jx = jax.make_jaxpr(lambda *a: reference.index_scores(*a))(q, w, k, vis)
        return [[str(v.aval.dtype) for v in e.invars] for e in jx.jaxpr.eqns if e.primitive.name == "dot_general"]

    assert dots(_mx(q), _mx(k)) == [["bfloat16", "bfloat16"]]
    assert dots(q, k) == [["float32", "float32"]]


# ------------------------------------------------------------------------------------------------
# prefill chunks (>= PREFILL_MIN_ROWS query rows): the tile score kernel + the grouped top-k

S_PRE = pallas_triton.PREFILL_MIN_ROWS + 32  # 96 query rows: one padded row tile at block_s 64


def _causal_vis(b, s, nc, ratio=1, offsets=(0, 37)):
    pos = np.arange(s, dtype=np.int32)[None, :] + np.asarray(offsets[:b], np.int32)[:, None]
    return jnp.asarray(np.minimum((pos + 1) // ratio, nc).astype(np.int32))


@pytest.mark.parametrize("quant,mx", [(True, False), (True, True), (False, False)], ids=["mxfp4", "mxfp4_mx", "f32"])
def test_prefill_tile_scores_equal_float64(quant, mx):
    """The tile kernel's masked scores on fresh random inputs (MXFP4 -> bf16 dots, or with ``mx`` the
    codes and scales as stored into one MX dot a head; float32 -> IEEE fp32 dots) against
    sum_h w_h relu(q_h . k_j) in float64, every element; tiles past every row's causal limit are -inf
    without their dots; rows and keys not multiples of the tile (the MX operands padded with code 0
    and scale 2**0)."""
    rng = np.random.default_rng()
    b, s, hi, di, nc = 2, S_PRE, 16, 64, 333
    q = jnp.asarray(rng.normal(size=(b, s, hi, di)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, nc, di)), jnp.float32)
    if quant:
        q, k = _mx(q), _mx(k)
    w = jnp.asarray(rng.uniform(size=(b, s, hi)), jnp.float32)
    vis = _causal_vis(b, s, nc, ratio=1, offsets=(0, 200))
    from dsv41_jax.quant import dequantize

    qf, kf = (np.asarray(a, np.float64) for a in jax.jit(lambda a, b: (dequantize(a, jnp.float32),
                                                                  dequantize(b, jnp.float32)))(q, k))
    want = np.einsum("bsh,bshn->bsn", np.asarray(w, np.float64), np.maximum(np.einsum("bshd,bnd->bshn", qf, kf), 0))
    want = np.where(np.arange(nc)[None, None] < np.asarray(vis)[..., None], want, -np.inf)
    got = np.asarray(jax.jit(lambda *a: pallas_triton_prefill.index_scores(
        *a, interpret=True, config=dict(block_s=32, block_n=64, mx=mx)))(q, w, k, vis))
    jaxpr = str(jax.make_jaxpr(lambda *a: pallas_triton_prefill.index_scores(
        *a, interpret=True, config=dict(block_s=32, block_n=64, mx=mx)))(q, w, k, vis))
    assert ("dsv41_mx_dot" in jaxpr) == mx
    assert got.shape == (b, s, nc) and got.dtype == np.float32
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6 * np.abs(want[fin]).max())


@pytest.mark.parametrize("budget", [None, 40 * 300 * 4], ids=["one_block", "row_blocks"])
def test_prefill_path_matches_reference(budget):
    """A prefill-sized call (causal visibility, candidate-block mask, block maxima) through the tile
    kernel gives the reference's top-k sets where margins are clear and its block maxima, in one
    block of rows or in blocks of 32 rows under a small score budget (padded last block)."""
    q, w, k, _ = margin_case(21, b=2, s=S_PRE, nc=300, quant=True)
    vis = _causal_vis(2, S_PRE, 300, ratio=2, offsets=(0, 250))
    cb = _bernoulli(4, 0.7, (2, S_PRE, -(-300 // 8)))
    cfg = dict(block_s=32, block_n=64) if budget is None else dict(block_s=32, block_n=64, prefill_score_budget=budget)
    r, scores = _ref_and_scores(q, w, k, vis, cb, 16, True)
    o = _pal(q, w, k, vis, cb, 16, True, cfg)
    assert check_result(o, r, scores, 16) >= S_PRE  # rows whose set was compared with the reference
    if budget is not None:  # the blocked run gives the one-block run's result exactly
        one = _pal(q, w, k, vis, cb, 16, True, dict(block_s=32, block_n=64))
        np.testing.assert_array_equal(np.asarray(o.topk), np.asarray(one.topk))
        np.testing.assert_array_equal(np.asarray(o.block_scores), np.asarray(one.block_scores))


@pytest.mark.parametrize("seed", range(4))
def test_topk_by_groups_equals_reference_with_ties(seed):
    """The two-level top-k returns exactly the reference's positions, ties included: scores drawn
    from a handful of values (most rows tie at the k-th value), -inf entries, an all -inf row, k
    above the finite count, k * group >= n (direct path), n not a multiple of the group."""
    rng = np.random.default_rng(seed)
    n = [300, 1001, 64, 4097][seed]
    sc = rng.integers(0, [4, 50, 3, 1000][seed], size=(3, 5, n)).astype(np.float32)
    sc[rng.random(sc.shape) < 0.3] = -np.inf
    sc[0, 0] = -np.inf
    ks = (1, 7, 16, 100)
    # every k's direct and two-level top-k in one jitted program
    both = jax.jit(lambda x: [(reference.topk_ascending(x, k), reference.topk_by_groups(x, k, 8)) for k in ks])(
        jnp.asarray(sc))
    for k, (want, got) in zip(ks, both):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"n={n} k={k}")


def test_prefill_dispatch_and_reasons():
    """'auto' takes the tile kernel for prefill chunks and the kernel for decode over MXFP4 keys (V4.1)
    at every size (the direct path below select_max); with decode_path "pipeline" (the env var's
    A/B switch) decode below DECODE_MIN_ENTRIES keeps the reference; plain float keys (V4) keep it
    always; shapes the tile kernel cannot run are named."""
    q1 = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.float32)
    qp = jax.ShapeDtypeStruct((1, pallas_triton.PREFILL_MIN_ROWS, 32, 128), jnp.float32)
    def fp4_keys(n):
        return Fp4Tensor(jax.ShapeDtypeStruct((1, n, 64), jnp.uint8), jax.ShapeDtypeStruct((1, n, 4), jnp.uint8), 32)

    k_fp4 = fp4_keys(pallas_triton.DECODE_MIN_ENTRIES)
    k_bf16 = jax.ShapeDtypeStruct((1, 64, 128), jnp.bfloat16)
    assert pallas_triton.DEFAULTS["decode_path"] == "direct"  # session 46's default
    assert pallas_triton.auto_reason(q1, k_fp4) is None and pallas_triton.auto_reason(qp, k_bf16) is None
    assert pallas_triton.auto_reason(qp, fp4_keys(64)) is None  # prefill: any cache size
    assert pallas_triton.auto_reason(q1, fp4_keys(1280)) is None  # the direct path
    assert "plain float keys" in pallas_triton.auto_reason(q1, k_bf16)
    with pytest.MonkeyPatch.context() as mp:  # DSV41_INDEXER_DECODE=pipeline
        mp.setitem(pallas_triton.DEFAULTS, "decode_path", "pipeline")
        assert "1280 compressed entries" in pallas_triton.auto_reason(q1, fp4_keys(1280))
        assert "2047 compressed entries" in pallas_triton.auto_reason(q1, fp4_keys(pallas_triton.DECODE_MIN_ENTRIES - 1))
        assert pallas_triton.auto_reason(q1, k_fp4) is None
        assert "plain float keys" in pallas_triton.auto_reason(q1, k_bf16)
    cfg = dict(pallas_triton_prefill.PREFILL_DEFAULTS)
    assert "power of two" in pallas_triton_prefill.unsupported_reason((1, 64, 24, 128), (1, 100, 128), cfg)
    assert "do not match" in pallas_triton_prefill.unsupported_reason((1, 64, 32, 128), (2, 100, 128), cfg)
    assert "block_n" in pallas_triton_prefill.unsupported_reason((1, 64, 32, 128), (1, 100, 128), {**cfg, "block_n": 96})


def test_reference_takes_the_grouped_top_k_above_its_threshold(monkeypatch):
    """Above GROUPED_TOPK_MIN scores per call the reference's top-k runs two-level (measured faster
    on the H200 for long rows); the positions are the direct top-k's, here with ties, -inf entries
    and a candidate-block mask."""
    q, w, k, _ = margin_case(8, b=2, s=3, nc=300, quant=True)
    vis = jnp.array([[300, 5, 0], [100, 233, 299]], jnp.int32)
    cb = _bernoulli(2, 0.6, (2, 3, -(-300 // 8)))
    direct = _ref(q, w, k, vis, cb, 16, True)
    monkeypatch.setattr(reference, "GROUPED_TOPK_MIN", 1)
    jx = str(jax.make_jaxpr(lambda *a: reference.lightning_indexer(*a, top_k=16, candidate_blocks=cb))(q, w, k, vis))
    assert jx.count("top_k") == 2  # block maxima, then the chosen blocks' scores
    grouped = jax.jit(lambda q, w, k, v, c: reference.lightning_indexer(q, w, k, v, top_k=16, candidate_blocks=c,
                                                                        want_block_scores=True))(q, w, k, vis, cb)
    np.testing.assert_array_equal(np.asarray(grouped.topk), np.asarray(direct.topk))
    np.testing.assert_array_equal(np.asarray(grouped.block_scores), np.asarray(direct.block_scores))
