"""Sparse attention under DeepSeek's 64-key blocks (``--attention-rounding kernel_blocks``) at the
model's prefill shapes, on V4.1's stores (FP8 window, FP4 compressed cache) and V4's (rounded values in
bf16), through the dispatch with an explicit implementation.

With ``running_max_block`` and a chunk of more than one row the model passes DeepSeek's window width
(``attention.deepseek_window_width``), and the kernel then walks DeepSeek's concatenated list, one of
its blocks holding the end of the window list and the start of the compressed one. That kernel had
never run on a GPU until session 41, where it failed to compile on the H100 (262,144 bytes of shared
memory asked for, 232,448 available): interpret mode cannot see such limits, so these cases also run
compiled: ``JAX_PLATFORMS=cuda,cpu DSV41_TEST_KERNEL_IMPL=pallas`` (512-row chunks, 64 heads of 512,
a top-512 compressed list), as ``test_v4_attention_shapes`` does for the other attention shapes.

Beside them, decode steps over V4.1's stores under either rounding (the kernel's decode tilings,
which ``DSV41_KERNELS=pallas`` runs; session 41's GPU scan compiled them).

Prefill rows: a prompt shorter than the window prefilled from position 0 (DeepSeek's window list is as wide as
the prompt, so the straddling block is taken), a full first chunk (width 128) and a later chunk of a
long prompt (ring + chunk). Tolerance: ``test_sparse_attention.check_close`` (the kernel and the
reference's emulation of the blocks differ in fp32 summation order).
"""

import os

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.attention import _store_v4, cache_store, deepseek_window_width, ring_window_indices, window_indices
from dsv41_jax.options import RunOptions
from pallas_kernels.lightning_indexer.reference import topk_ascending
from pallas_kernels.sparse_attention import api as attention_api

from test_sparse_attention import check_close

IMPL = os.environ.get("DSV41_TEST_KERNEL_IMPL", "interpret")
GPU = IMPL == "pallas"
H, D, ROPE, WINDOW, RATIO = 64, 512, 64, 128, 4
BLOCK = RunOptions(attention_rounding="kernel_blocks").running_max_block  # DeepSeek's 64 keys

# each generation's stored values, made by the model's own stores (reference KV rounding): V4.1's FP8
# window (ue8m0 per 32) and FP4 compressed cache (e4m3 per 16); V4's rounded values held in bf16
_STORES = {"v41": lambda x, kind: cache_store(x, kind, RunOptions()),
           "v4": lambda x, kind: _store_v4(x, kind, RunOptions(), ROPE)}
_store = jax.jit(lambda x, store, kind: _STORES[store](x, kind), static_argnums=(1, 2))


def _stores(rng, store, b, nw, nc):
    """Window [b, nw, D] and compressed [b, nc, D] stores of random values."""
    return tuple(_store(jnp.asarray(rng.standard_normal((b, n, D)).astype(np.float32)), store, kind)
                 for n, kind in ((nw, "window"), (nc, "comp")))


def _topk_lists(rng, positions, nc, kc):
    """Each query's top ``kc`` of random scores over its visible compressed entries (ratio 4),
    ascending with -1 padding, as the indexer returns them."""
    visible = (positions[..., None] + 1) // RATIO
    scores = jnp.asarray(rng.random((*positions.shape, nc), np.float32))
    return topk_ascending(jnp.where(jnp.arange(nc) < visible, scores, -jnp.inf), kc)


def _both(q, win, widx, sink, comp, cidx, **kw):
    """(reference, ``IMPL``) outputs of the dispatch on the same inputs."""
    run = jax.jit(lambda impl, *a: attention_api.sparse_attention(
        *a[:4], scale=D ** -0.5, comp_kv=a[4], comp_idx=a[5], implementation=impl, **kw), static_argnums=0)
    return run("reference", q, win, widx, sink, comp, cidx), run(IMPL, q, win, widx, sink, comp, cidx)


def _case(rng, store, s, kc):
    """Three rows of an ``s``-token chunk: (pos0, valid tokens) = (0, a prompt shorter than the window
    and than s), (0, s), (a later chunk, s); the window store is the ring + the chunk as the model lays
    it out. Returns the inputs and DeepSeek's window widths."""
    pos0 = np.asarray([0, 0, 4 * s], np.int32)
    lengths = np.asarray([min(s, WINDOW) - 27, s, s], np.int32)
    b = len(pos0)
    positions = jnp.asarray(pos0[:, None] + np.arange(s, dtype=np.int32)[None])
    widx = window_indices(positions, jnp.asarray(pos0), WINDOW)
    widx = jnp.where(jnp.arange(s)[None, :, None] < jnp.asarray(lengths)[:, None, None], widx, -1)
    ww = deepseek_window_width(jnp.asarray(pos0), jnp.asarray(lengths), WINDOW, s, RunOptions(attention_rounding="kernel_blocks"))
    nc = int(pos0.max() + s) // RATIO
    q = jnp.asarray(rng.standard_normal((b, s, H, D), np.float32)).astype(jnp.bfloat16)
    win, comp = _stores(rng, store, b, WINDOW + s, nc)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return (q, win, widx, sink, comp, _topk_lists(rng, positions, nc, kc)), ww


@pytest.mark.parametrize("store", ["v41", "v4"])
def test_prefill_chunk_in_deepseeks_blocks(store):
    """The kernel with DeepSeek's blocks and window widths against the reference's emulation of them:
    every output element within the parity tolerance, for each row kind (short prompt, full first chunk,
    later chunk)."""
    s, kc = (512, 512) if GPU else (40, 24)
    case, ww = _case(np.random.default_rng(), store, s, kc)
    want, got = _both(*case, running_max_block=BLOCK, window_width=ww)
    assert got.shape == (3, s, H, D)
    for row in range(3):
        check_close(got[row], want[row])


@pytest.mark.parametrize("rounding", ["row_max", "kernel_blocks"])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_rows_over_v41_stores(rounding, batch):
    """Decode steps over V4.1's stores (the 128-slot FP8 ring in DeepSeek's decode order, a 64K
    prompt's FP4 compressed cache, top-512 lists with -1 padding) through the dispatch, under either
    rounding: ``auto`` keeps XLA here, ``DSV41_KERNELS=pallas`` runs the kernel with its decode
    tilings (flash-decoding splits and column blocks at batch 1; one split in 64-key blocks under
    ``kernel_blocks``), which must compile on a GPU (session 41's scan compiled them on an H100) and
    agree with the reference."""
    rng = np.random.default_rng()
    b = batch if GPU else min(batch, 2)
    nc, kc = (16384, 512) if GPU else (96, 24)
    positions = jnp.asarray(rng.integers(4 * nc - 400, 4 * nc, (b, 1)), jnp.int32)
    widx = ring_window_indices(positions, WINDOW)
    q = jnp.asarray(rng.standard_normal((b, 1, H, D), np.float32)).astype(jnp.bfloat16)
    win, comp = _stores(rng, "v41", b, WINDOW, nc)
    cidx = _topk_lists(rng, positions, nc, kc)
    cidx = cidx.at[0, 0, kc - 37:].set(-1)  # a short list: -1 padding inside the last blocks
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    rmb = RunOptions(attention_rounding=rounding).running_max_block
    want, got = _both(q, win, widx, sink, comp, cidx, running_max_block=rmb)
    assert got.shape == (b, 1, H, D)
    check_close(got, want)
