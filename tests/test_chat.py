"""Chat prompt encoding (model.md §11)."""

import pytest

from dsv41_jax import chat
from dsv41_jax.tokenizer import load_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYS, USR, AST = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
EFFORT50 = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7", "reasoning_content": "small ones"},
    {"role": "user", "content": "Another?"},
]


def test_one_turn():
    m = [{"role": "user", "content": "Hi there"}]
    assert chat.encode_messages(m) == BOS + USR + "Hi there" + AST + "</think>"
    assert chat.encode_messages(m, flavor="v4") == BOS + USR + "Hi there" + AST + "</think>"
    assert chat.encode_messages(m, flavor="v4", thinking=True) == BOS + USR + "Hi there" + AST + "<think>"
    assert chat.encode_messages(m, thinking=True) == BOS + SYS + EFFORT50 + USR + "Hi there" + AST + "<think>"
    ms = [{"role": "system", "content": "S."}] + m
    assert chat.encode_messages(ms) == BOS + SYS + "S." + USR + "Hi there" + AST + "</think>"
    assert chat.encode_messages(ms, flavor="v4") == BOS + "S." + USR + "Hi there" + AST + "</think>"
    assert chat.encode_messages(m, add_bos=False) == USR + "Hi there" + AST + "</think>"


def test_multi_turn_chat():
    assert chat.encode_messages(CONV) == (
        BOS + SYS + "You are terse." + USR + "Name a prime." + AST + "</think>" + "7" + EOS
        + USR + "Another?" + AST + "</think>")
    assert chat.encode_messages(CONV, flavor="v4") == (
        BOS + "You are terse." + USR + "Name a prime." + AST + "</think>" + "7" + EOS
        + USR + "Another?" + AST + "</think>")


def test_multi_turn_thinking():
    # earlier reasoning is dropped; only the turn being generated opens <think>
    assert chat.encode_messages(CONV, thinking=True) == (
        BOS + SYS + EFFORT50 + "You are terse." + USR + "Name a prime." + AST + "</think>" + "7" + EOS
        + USR + "Another?" + AST + "<think>")
    done = CONV + [{"role": "assistant", "content": "11", "reasoning_content": "next one"}]
    assert chat.encode_messages(done, thinking=True, reasoning_effort=100, add_generation_prompt=False) == (
        BOS + SYS + EFFORT50.replace("50", "100") + "You are terse." + USR + "Name a prime." + AST
        + "</think>" + "7" + EOS + USR + "Another?" + AST + "<think>" + "next one</think>11" + EOS)
    # drop_thinking=False keeps every turn's reasoning
    assert chat.encode_messages(CONV, thinking=True, drop_thinking=False, reasoning_effort="max") == (
        BOS + SYS + EFFORT50.replace("50", "100") + "You are terse." + USR + "Name a prime." + AST
        + "<think>" + "small ones</think>7" + EOS + USR + "Another?" + AST + "<think>")


def test_mid_system_and_merged_users():
    m = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
         {"role": "assistant", "content": "c"}, {"role": "system", "content": "new rule"}]
    assert chat.encode_messages(m) == (
        BOS + USR + "a\n\nb" + AST + "</think>c" + EOS + SYS + "new rule" + AST + "</think>")
    with pytest.raises(ValueError, match="only allowed first"):
        chat.encode_messages(m, flavor="v4")


def test_errors():
    with pytest.raises(ValueError, match="unknown role 'bot'"):
        chat.encode_messages([{"role": "bot", "content": "x"}])
    with pytest.raises(ValueError, match="no 'role'"):
        chat.encode_messages([{"content": "x"}])
    with pytest.raises(chat.UnsupportedChatFeature, match="out of scope"):
        chat.encode_messages([{"role": "tool", "content": "x"}])
    with pytest.raises(chat.UnsupportedChatFeature, match="tools"):
        chat.encode_messages([{"role": "user", "content": "x", "tools": [{"type": "function"}]}])
    with pytest.raises(ValueError, match="empty"):
        chat.encode_messages([])
    with pytest.raises(TypeError, match="content must be a string"):
        chat.encode_messages([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        chat.encode_messages(CONV[:3])
    with pytest.raises(ValueError, match="reasoning_effort"):
        chat.encode_messages(CONV, thinking=True, reasoning_effort=101)
    with pytest.raises(ValueError, match="flavor"):
        chat.encode_messages(CONV, flavor="v5")


def test_encode_chat_ids():
    tok = load_tokenizer()
    ids = chat.encode_chat(tok, CONV, flavor="v4")
    assert ids[0] == 0 and ids[-2:] == [128804, 128822]
    assert ids.count(128803) == 2 and ids.count(1) == 1
    # the packaged (V4) tokenizer has no <｜System｜>, so a V4.1 system prompt must not be spelled out
    if tok.token_to_id(SYS) is None:
        with pytest.raises(ValueError, match="System"):
            chat.encode_chat(tok, CONV)
    no_sys = chat.encode_chat(tok, CONV[1:])
    assert no_sys == chat.encode_chat(tok, CONV[1:], flavor="v4")
