"""The sliding-window ring at decode: writing the token first and attending over the ring alone
(``write_ring_token`` + ``ring_window_indices``, the one-token path of ``attention``) gives the same
window keys, in the same order, and the same new ring as the general path (concatenate ring and
chunk, ``window_indices``, ``update_ring``), for FP8 stores, idle rows and positions before the ring
has filled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.attention import (concat_rows, ring_window_indices, take_rows, update_ring, window_indices,
                                 write_ring_token)
from dsv41_jax.quant import quantize_fp8


def _keys(store, idx):
    """Rows of ``store`` picked by idx [B,1,W] (-1: a zero row), as float32 [B,W,D]."""
    rows = take_rows(store, jnp.maximum(idx[:, 0], 0)).dequantize(jnp.float32)
    return jnp.where(idx[:, 0, :, None] >= 0, rows, 0.0)


@pytest.mark.parametrize("valid_first", [False, True], ids=["v41_order", "v4_order"])
@pytest.mark.parametrize("window", [8, 16])
def test_one_token_path_equals_the_chunk_path(window, valid_first):
    b, d = 5, 64
    key = jax.random.PRNGKey(window)
    ring = quantize_fp8(jax.random.normal(key, (b, window, d)), (1, 32))
    token = quantize_fp8(jax.random.normal(jax.random.fold_in(key, 1), (b, 1, d)), (1, 32))
    # positions: before the ring fills (0, 3), exactly full, wrapped several times; row 4 idle
    pos0 = jnp.array([0, 3, window - 1, 5 * window + 2, 2 * window + 1], jnp.int32)
    lengths = jnp.array([1, 1, 1, 1, 0], jnp.int32)
    positions = pos0[:, None]

    new_ref = update_ring(ring, token, pos0, lengths, window)
    keys_ref = _keys(concat_rows(ring, token), window_indices(positions, pos0, window, valid_first))
    new = write_ring_token(ring, token, pos0, lengths, window)
    idx = ring_window_indices(positions, window, valid_first)
    keys = _keys(new, idx)

    for a, r in zip(jax.tree.leaves(new), jax.tree.leaves(new_ref)):
        np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(r.view(jnp.uint8)))
    active = np.asarray(lengths) > 0
    np.testing.assert_array_equal(np.asarray(keys)[active], np.asarray(keys_ref)[active])
    # the same positions are empty (-1) in both index lists
    np.testing.assert_array_equal(np.asarray(idx) < 0,
                                  np.asarray(window_indices(positions, pos0, window, valid_first)) < 0)
    # the idle row's ring is untouched; an active row's token sits in slot pos0 % W
    np.testing.assert_array_equal(np.asarray(new.data[4].view(jnp.uint8)), np.asarray(ring.data[4].view(jnp.uint8)))
    s = int(pos0[3]) % window
    np.testing.assert_array_equal(np.asarray(new.data[3, s].view(jnp.uint8)), np.asarray(token.data[3, 0].view(jnp.uint8)))
    # and the token is the last key of its own window (valid_first: the last valid one)
    last = np.minimum(np.asarray(pos0)[:4], window - 1) if valid_first else np.full(4, window - 1)
    np.testing.assert_array_equal(np.asarray(keys)[np.arange(4), last], np.asarray(token.dequantize(jnp.float32))[:4, 0])


def test_window_lists_in_deepseeks_order():
    """The index lists name positions in the order of DeepSeek's ``get_window_topk_idxs``: prefill
    (and V4's decode) 0..t then -1 padding while t < W - 1, V4.1's decode the -1 slots first; from
    t = W - 1 on both are t-W+1..t. Its kernel's blocks of 64 keys make the order part of the bf16
    result."""
    w = 8
    pos0 = jnp.zeros((1,), jnp.int32)
    positions = jnp.arange(10, dtype=jnp.int32)[None]
    got = np.asarray(window_indices(positions, pos0, w))[0]  # chunk from position 0: slot = w + position
    for t in range(10):
        want = [w + p if p <= t else -1 for p in range(max(t - w + 1, 0), max(t - w + 1, 0) + w)]
        assert got[t].tolist() == want, t
    ring = np.asarray(ring_window_indices(jnp.asarray([[3], [12]], jnp.int32), w))[:, 0]
    assert ring.tolist() == [[-1, -1, -1, -1, 0, 1, 2, 3], [5, 6, 7, 0, 1, 2, 3, 4]]
    ring4 = np.asarray(ring_window_indices(jnp.asarray([[3], [12]], jnp.int32), w, valid_first=True))[:, 0]
    assert ring4.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [5, 6, 7, 0, 1, 2, 3, 4]]
