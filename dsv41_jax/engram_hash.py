"""Engram n-gram hash ids (V4.1 only), host-side numpy int64.  Spec: model.md §9.1.

Semantics follow DeepSeek's ``inference/engram.py`` (V4.1-Flash, rev dba1be0a); this is an
independent implementation.  Everything here runs on the host outside ``jit``: the model receives the
resulting ``[B, S, n_layers, (max_ngram-1)*n_heads]`` int64 row ids (table offsets included).

Pieces:

* :func:`build_compressed_token_map` -- token id -> compressed id (tokens that normalise alike share
  one id).  Its size (99,092 for the DeepSeek tokenizer) feeds the multipliers, so the exact
  tokenizer matters.
* :class:`EngramLayout` -- primes, column offsets and multipliers per Engram layer.
* :func:`ngram_hash_ids` -- the hash of every requested position given each sequence's full
  compressed history.
* :class:`EngramHasher` -- the three bundled, built from a model config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "DEAD", "NORMALIZER_SENTINEL", "is_prime", "next_unused_prime", "make_normalizer",
    "build_compressed_token_map", "hash_multipliers", "EngramLayout", "compress_ids",
    "ngram_hash_ids", "EngramHasher",
]

#: compressed id of a token that takes no part in any n-gram (image spans); it blocks look-back.
DEAD = -1
#: private-use char protecting a token that is exactly " " from ``Strip``.
NORMALIZER_SENTINEL = "\ue000"
_INT64_MAX = int(np.iinfo(np.int64).max)

# --------------------------------------------------------------------------------------------
# primes
# --------------------------------------------------------------------------------------------

# Deterministic Miller-Rabin: these 12 prime bases are exact for every n < 3.3e24 (covers int64).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality test for 0 <= n < 3.3e24 (deterministic Miller-Rabin)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, used: set[int] | frozenset[int]) -> int:
    """Smallest prime strictly greater than ``start`` that is not in ``used``."""
    c = int(start) + 1
    while c in used or not is_prime(c):
        c += 1
    return c


# --------------------------------------------------------------------------------------------
# compressed token map
# --------------------------------------------------------------------------------------------

def make_normalizer():
    """The key normaliser: NFKC, NFD, StripAccents, Lowercase, ``[ \\t\\r\\n]+`` -> " ",
    exactly " " -> sentinel, Strip, sentinel -> " " (``tokenizers.normalizers`` objects, so the
    Unicode tables are the same Rust ones the reference uses)."""
    from tokenizers import Regex, normalizers as N

    return N.Sequence([
        N.NFKC(),
        N.NFD(),
        N.StripAccents(),
        N.Lowercase(),
        N.Replace(Regex(r"[ \t\r\n]+"), " "),
        N.Replace(Regex(r"^ $"), NORMALIZER_SENTINEL),
        N.Strip(),
        N.Replace(NORMALIZER_SENTINEL, " "),
    ])


def _backend_and_size(tokenizer) -> tuple[Any, int]:
    # A HF fast tokenizer wraps the Rust one; the reference iterates over len(hf_tokenizer),
    # which counts the added tokens too.  For a bare `tokenizers.Tokenizer` the equivalent is
    # get_vocab_size(with_added_tokens=True).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend, len(tokenizer)
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "decode"):
        return tokenizer, int(tokenizer.get_vocab_size(with_added_tokens=True))
    raise TypeError(f"expected a tokenizers.Tokenizer (or a HF fast tokenizer), got {type(tokenizer)!r}")


def build_compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """Map every token id to a compressed id; returns ``(lookup int64 [vocab], n_compressed)``.

    For each id in ``range(vocab)`` (ascending): decode it alone with the raw backend
    (``skip_special_tokens=False``); if the text contains U+FFFD (a partial UTF-8 byte token) the key
    is the raw token string (``id_to_token``), otherwise the key is the normalised text
    (:func:`make_normalizer`), or the raw text if normalisation leaves nothing.  Equal keys share a
    compressed id; ids are handed out in order of first appearance.

    Vocab length: the reference uses ``len(tokenizer)`` of the HF fast tokenizer, which *includes*
    the added tokens; for a ``tokenizers.Tokenizer`` this is
    ``get_vocab_size(with_added_tokens=True)``.  With the DeepSeek tokenizer that is 129,280 ids ->
    99,092 compressed ids (the spec's check).  Without added tokens it would be 128,000 ids -> 97,812,
    which is wrong.  The fixture tokenizer has no added tokens (192 either way).
    """
    backend, n = _backend_and_size(tokenizer)
    norm = make_normalizer()
    keys: dict[str, int] = {}
    lookup = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(tid)
            if key is None:  # hole in the id space: keep it distinct
                key = f"\x00<missing id {tid}>"
        else:
            key = norm.normalize_str(text) or text
        cid = keys.get(key)
        if cid is None:
            cid = len(keys)
            keys[key] = cid
        lookup[tid] = cid
    return lookup, len(keys)


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------

def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd per-(layer, lookback) multipliers, int64 ``[n_layers, max_ngram_size]``.

    ``default_rng(10007*layer_id).integers(0, bound, size=max_ngram_size, dtype=int64) * 2 + 1`` with
    ``bound = max(1, (2**63-1) // compressed_vocab_size // 2)``, so ``id * multiplier`` cannot
    overflow int64 for ``0 <= id < compressed_vocab_size``.
    """
    if compressed_vocab_size < 1:
        raise ValueError(f"compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
    bound = max(1, _INT64_MAX // int(compressed_vocab_size) // 2)
    rows = []
    for lid in layer_ids:
        rng = np.random.default_rng(10007 * int(lid))
        rows.append(rng.integers(0, bound, size=int(max_ngram_size), dtype=np.int64) * 2 + 1)
    if not rows:
        return np.zeros((0, int(max_ngram_size)), dtype=np.int64)
    return np.stack(rows).astype(np.int64)


@dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of the Engram hash tables (all ints are plain Python ints, nested tuples).

    * ``primes[l][n-2][h]``: bucket modulus for layer ``l``, n-gram size ``n``, head ``h``; drawn in
      (layer, n, head) order, each the next prime above a running value that restarts at
      ``engram_vocab_size - 1`` for every n-gram size, never reusing a prime.
    * ``offsets[l][c]``: exclusive prefix sum of layer ``l``'s primes over columns
      ``c = (n-2)*n_heads + h``; each layer's table is addressed from row 0.
    * ``multipliers[l][j]``: see :func:`hash_multipliers` (j = lookback 0..max_ngram_size-1).
    * ``num_embeddings[l]``: rows of layer ``l``'s table == sum of its primes (checked).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    engram_vocab_size: int
    compressed_vocab_size: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    num_embeddings: tuple[int, ...]

    @classmethod
    def build(cls, layer_ids: Sequence[int], max_ngram_size: int, n_heads: int,
              engram_vocab_size: int, compressed_vocab_size: int,
              num_embeddings: Sequence[int] | int | None) -> "EngramLayout":
        """Compute primes/offsets/multipliers; ``num_embeddings`` (per layer, or one int for all)
        must equal each layer's prime sum, else ``ValueError``.  ``None`` = take the prime sums."""
        layer_ids = tuple(int(x) for x in layer_ids)
        max_ngram_size, n_heads = int(max_ngram_size), int(n_heads)
        if max_ngram_size < 2:
            raise ValueError(f"engram max_ngram_size must be >= 2, got {max_ngram_size}")
        if n_heads < 1:
            raise ValueError(f"engram n_heads must be >= 1, got {n_heads}")
        if engram_vocab_size < 1:
            raise ValueError(f"engram_vocab_size must be >= 1, got {engram_vocab_size}")
        used: set[int] = set()
        primes = []
        for _ in layer_ids:
            per_n = []
            for _n in range(max_ngram_size - 1):
                cur, heads = int(engram_vocab_size) - 1, []
                for _h in range(n_heads):
                    cur = next_unused_prime(cur, used)
                    used.add(cur)
                    heads.append(cur)
                per_n.append(tuple(heads))
            primes.append(tuple(per_n))
        sums = [sum(sum(t) for t in layer) for layer in primes]

        if num_embeddings is None:
            num_emb = tuple(sums)
        elif isinstance(num_embeddings, (int, np.integer)):
            num_emb = (int(num_embeddings),) * len(layer_ids)
        else:
            num_emb = tuple(int(x) for x in num_embeddings)
            if len(num_emb) != len(layer_ids):
                raise ValueError(
                    f"engram_num_embeddings has {len(num_emb)} entries {list(num_emb)} but there are "
                    f"{len(layer_ids)} engram layers {list(layer_ids)}")
        for lid, want, got in zip(layer_ids, num_emb, sums):
            if want != got:
                raise ValueError(
                    f"Engram layer {lid}: engram_num_embeddings = {want} but the sum of its "
                    f"{(max_ngram_size - 1) * n_heads} primes is {got} (difference {got - want}); "
                    f"check engram_vocab_size={engram_vocab_size}, engram_max_ngram_size="
                    f"{max_ngram_size}, engram_n_heads={n_heads}, engram_layer_ids={list(layer_ids)}")

        offsets = []
        for layer in primes:
            flat = [p for t in layer for p in t]
            offsets.append(tuple(int(x) for x in np.cumsum([0] + flat[:-1])))
        mult = hash_multipliers(layer_ids, max_ngram_size, compressed_vocab_size)
        return cls(
            layer_ids=layer_ids, max_ngram_size=max_ngram_size, n_heads=n_heads,
            engram_vocab_size=int(engram_vocab_size), compressed_vocab_size=int(compressed_vocab_size),
            primes=tuple(primes), offsets=tuple(offsets),
            multipliers=tuple(tuple(int(v) for v in row) for row in mult),
            num_embeddings=num_emb,
        )

    # ---- convenience views ----
    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        """Hash columns per layer: ``(max_ngram_size - 1) * n_heads``."""
        return (self.max_ngram_size - 1) * self.n_heads

    def primes_array(self) -> np.ndarray:
        """int64 ``[n_layers, max_ngram_size-1, n_heads]``."""
        return np.array(self.primes, dtype=np.int64).reshape(self.n_layers, self.max_ngram_size - 1, self.n_heads)

    def offsets_array(self) -> np.ndarray:
        """int64 ``[n_layers, n_cols]``."""
        return np.array(self.offsets, dtype=np.int64).reshape(self.n_layers, self.n_cols)

    def multipliers_array(self) -> np.ndarray:
        """int64 ``[n_layers, max_ngram_size]``."""
        return np.array(self.multipliers, dtype=np.int64).reshape(self.n_layers, self.max_ngram_size)


# --------------------------------------------------------------------------------------------
# hashing
# --------------------------------------------------------------------------------------------

def compress_ids(token_ids, token_map: np.ndarray, token_mask=None) -> np.ndarray:
    """``token_map[token_ids]`` as int64, with :data:`DEAD` where ``token_mask`` is False."""
    ids = np.asarray(token_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    n = len(token_map)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)]
        raise ValueError(f"token ids out of range for a {n}-entry Engram token map: e.g. {bad[:5].tolist()}")
    out = np.asarray(token_map, dtype=np.int64)[ids]
    if token_mask is not None:
        mask = np.asarray(token_mask, dtype=bool)
        if mask.shape != ids.shape:
            raise ValueError(f"token_mask shape {mask.shape} != token ids shape {ids.shape}")
        out = np.where(mask, out, DEAD)
    return out


def ngram_hash_ids(compressed_ids, positions, layout: EngramLayout, pad_compressed_id: int) -> np.ndarray:
    """Engram row ids for the requested positions.

    Args:
      compressed_ids: int ``[B, T]``: compressed ids of each sequence's whole history from position
        0 (``DEAD`` = -1 for tokens outside every n-gram).  Only entries at or before the hashed
        positions are read.
      positions: int ``[B, S]`` absolute positions to hash (``0 <= p < T``).
      layout: the :class:`EngramLayout`.
      pad_compressed_id: compressed id used for blocked look-back (``token_map[engram_pad_id]``).

    Returns:
      int64 ``[B, S, n_layers, (max_ngram_size-1)*n_heads]``, table offsets included.

    For lookback ``j = 0..max_ngram_size-1`` the token is ``c[p-j]``; once ``p-j < 0`` or a DEAD token
    is met, that lookback and all larger ones use the pad id ("blocked" latches; j = 0 included).
    ``P_j = tok_j * mult[l, j]``; ``R_1 = P_0 ^ P_1``, ``R_k = R_{k-1} ^ P_k``; column
    ``(n-2)*n_heads + h`` = ``R_{n-1} mod primes[l][n-2][h] + offsets[l][col]``.
    """
    c = np.asarray(compressed_ids)
    pos = np.asarray(positions)
    if c.ndim != 2 or pos.ndim != 2:
        raise ValueError(f"compressed_ids must be [B, T] and positions [B, S]; got {c.shape} and {pos.shape}")
    if c.shape[0] != pos.shape[0]:
        raise ValueError(f"batch mismatch: compressed_ids {c.shape} vs positions {pos.shape}")
    if c.dtype.kind not in "iu" or pos.dtype.kind not in "iu":
        raise TypeError(f"integer arrays required, got {c.dtype} and {pos.dtype}")
    c = c.astype(np.int64, copy=False)
    pos = pos.astype(np.int64, copy=False)
    B, T = c.shape
    V = layout.compressed_vocab_size
    if pos.size and (pos.min() < 0 or pos.max() >= T):
        raise ValueError(f"positions must lie in [0, {T}) (history length); got range "
                         f"[{int(pos.min())}, {int(pos.max())}]")
    # Products must not overflow int64: ids have to be < compressed_vocab_size (or DEAD).
    if c.size and (c.min() < DEAD or c.max() >= V):
        raise ValueError(f"compressed ids must lie in [0, {V}) or be DEAD (-1); got range "
                         f"[{int(c.min())}, {int(c.max())}]")
    if not 0 <= int(pad_compressed_id) < V:
        raise ValueError(f"pad_compressed_id {pad_compressed_id} not in [0, {V})")

    S = pos.shape[1]
    L, ncols = layout.n_layers, layout.n_cols
    mult = layout.multipliers_array()          # [L, J]
    primes = layout.primes_array()             # [L, J-1, H]
    offsets = layout.offsets_array()           # [L, ncols]

    blocked = np.zeros((B, S), dtype=bool)
    toks = []
    for j in range(layout.max_ngram_size):
        src = pos - j
        got = np.take_along_axis(c, np.maximum(src, 0), axis=1)
        blocked |= (src < 0) | (got == DEAD)
        toks.append(np.where(blocked, np.int64(pad_compressed_id), got))
    tok = np.stack(toks, axis=-1)              # [B, S, J]

    prod = tok[:, :, None, :] * mult[None, None, :, :]   # [B, S, L, J]
    rolling = prod[..., 0]
    cols = []
    for k in range(1, layout.max_ngram_size):
        rolling = rolling ^ prod[..., k]                  # hash of the (k+1)-gram, >= 0
        cols.append(rolling[..., None] % primes[None, None, :, k - 1, :])  # [B, S, L, H]
    out = np.concatenate(cols, axis=-1) if cols else np.zeros((B, S, L, 0), np.int64)
    return (out + offsets[None, None]).astype(np.int64, copy=False).reshape(B, S, L, ncols)


# --------------------------------------------------------------------------------------------
# hasher
# --------------------------------------------------------------------------------------------

_CFG_FIELDS = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_vocab_size",
               "engram_compressed_vocab_size", "engram_num_embeddings", "engram_pad_id")


class EngramHasher:
    """Token map + layout + pad id; ``hasher(ids, positions)`` -> Engram row ids."""

    def __init__(self, token_map, layout: EngramLayout, pad_compressed_id: int):
        tm = np.asarray(token_map)
        if tm.ndim != 1 or tm.dtype.kind not in "iu":
            raise ValueError(f"token_map must be a 1-D integer array, got shape {tm.shape} dtype {tm.dtype}")
        self.token_map = tm.astype(np.int64)
        self.layout = layout
        self.pad_compressed_id = int(pad_compressed_id)

    @classmethod
    def from_config(cls, cfg, tokenizer=None, token_map=None) -> "EngramHasher":
        """Build from any object with the ``engram_*`` attributes of the model config.

        ``token_map`` (int array, e.g. a fixture's ``engram_token_map``) wins over ``tokenizer``; with
        neither, the default tokenizer of :func:`dsv41_jax.tokenizer.load_tokenizer` is used.
        Raises ``ValueError`` if the map's compressed size differs from
        ``cfg.engram_compressed_vocab_size`` or the primes do not sum to ``engram_num_embeddings``.
        """
        missing = [f for f in _CFG_FIELDS if not hasattr(cfg, f)]
        if missing:
            raise TypeError(f"config object {type(cfg).__name__} lacks Engram fields {missing}")
        want = int(cfg.engram_compressed_vocab_size)
        source = None
        if token_map is not None:
            tm = np.asarray(token_map)
            if tm.ndim != 1 or tm.dtype.kind not in "iu" or tm.size == 0:
                raise ValueError(f"token_map must be a non-empty 1-D integer array, got shape {tm.shape} dtype {tm.dtype}")
            tm = tm.astype(np.int64)
            n_comp = int(np.unique(tm).size)
            if tm.min() != 0 or tm.max() != n_comp - 1:
                raise ValueError(f"token_map values must be exactly 0..n-1; got {n_comp} distinct values "
                                 f"in [{int(tm.min())}, {int(tm.max())}]")
            n_tok = tm.size
            source = "the given token_map"
        else:
            if tokenizer is None:
                from .tokenizer import load_tokenizer
                tokenizer = load_tokenizer()
            tm, n_comp = build_compressed_token_map(tokenizer)
            n_tok = tm.size
            source = f"tokenizer {getattr(tokenizer, 'source_path', None) or type(tokenizer).__name__}"
        if n_comp != want:
            raise ValueError(
                f"Engram compressed vocab mismatch: {source} gives {n_comp} compressed ids "
                f"(from {n_tok} token ids incl. added tokens) but the config says "
                f"engram_compressed_vocab_size = {want} (difference {n_comp - want:+d}). The hash "
                f"multipliers depend on this number, so hashing would silently address the wrong rows. "
                f"Engram needs the exact tokenizer the checkpoint was trained with: probably the wrong "
                f"tokenizer.json was given; pass the checkpoint's own with --tokenizer PATH (or put "
                f"tokenizer.json in the checkpoint directory).")
        pad_tok = int(cfg.engram_pad_id)
        if not 0 <= pad_tok < tm.size:
            raise ValueError(f"engram_pad_id {pad_tok} outside the token map (size {tm.size})")
        layout = EngramLayout.build(
            cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
            cfg.engram_vocab_size, n_comp, cfg.engram_num_embeddings)
        return cls(tm, layout, int(tm[pad_tok]))

    @property
    def compressed_vocab_size(self) -> int:
        return self.layout.compressed_vocab_size

    def compress(self, token_ids, token_mask=None) -> np.ndarray:
        """Compressed ids (int64, DEAD where ``token_mask`` is False) of token ids ``[B, T]``."""
        return compress_ids(token_ids, self.token_map, token_mask)

    def hash_compressed(self, compressed_ids, positions=None) -> np.ndarray:
        """:func:`ngram_hash_ids` on already-compressed histories (positions default: all)."""
        c = np.asarray(compressed_ids)
        if positions is None:
            positions = np.broadcast_to(np.arange(c.shape[-1], dtype=np.int64), c.shape)
        return ngram_hash_ids(c, positions, self.layout, self.pad_compressed_id)

    def __call__(self, ids, positions=None, token_mask=None) -> np.ndarray:
        """Hash ids ``[B, S, n_layers, n_cols]`` for token ids ``ids [B, T]`` (each row the whole
        history from position 0) at ``positions [B, S]`` (default: every position 0..T-1)."""
        return self.hash_compressed(self.compress(ids, token_mask), positions)
