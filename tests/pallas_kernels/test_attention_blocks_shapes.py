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

import dsv41_jax.quant as quant
from dsv41_jax.attention import _store_v4, deepseek_window_width, ring_window_indices, window_indices
from dsv41_jax.options import RunOptions
from pallas_kernels.lightning_indexer.reference import topk_ascending
from pallas_kernels.sparse_attention import api as attention_api

from test_sparse_attention import check_close

IMPL = os.environ.get("DSV41_TEST_KERNEL_IMPL", "interpret")
GPU = IMPL == "pallas"
H, D, ROPE, WINDOW, RATIO = 64, 512, 64, 128, 4
BLOCK = RunOptions(attention_rounding="kernel_blocks").running_max_block  # DeepSeek's 64 keys

_v4_values = jax.jit(lambda x: _store_v4(x, "comp", RunOptions(), ROPE))


def _case(rng, store, s, kc):
    """Three rows of an ``s``-token chunk: (pos0, valid tokens) = (0, a prompt shorter than the window
    and than s), (0, s), (a later chunk, s); the window store is the ring + the chunk as the model lays
    it out, the compressed list each query's top ``kc`` of random scores over its visible entries
    (ascending, -1 padded)."""
    pos0 = np.asarray([0, 0, 4 * s], np.int32)
    lengths = np.asarray([min(s, WINDOW) - 27, s, s], np.int32)
    b = len(pos0)
    positions = jnp.asarray(pos0[:, None] + np.arange(s, dtype=np.int32)[None])
    widx = window_indices(positions, jnp.asarray(pos0), WINDOW)
    widx = jnp.where(jnp.arange(s)[None, :, None] < jnp.asarray(lengths)[:, None, None], widx, -1)
    ww = deepseek_window_width(jnp.asarray(pos0), jnp.asarray(lengths), WINDOW, s, RunOptions(attention_rounding="kernel_blocks"))
    nc = int(pos0.max() + s) // RATIO
    q = jnp.asarray(rng.standard_normal((b, s, H, D), np.float32)).astype(jnp.bfloat16)
    win = rng.standard_normal((b, WINDOW + s, D)).astype(np.float32)
    comp = rng.standard_normal((b, nc, D)).astype(np.float32)
    if store == "v41":
        win = quant.quantize_fp8(jnp.asarray(win), (1, 32))
        comp = quant.Fp4Tensor(data=jnp.asarray(rng.integers(0, 256, (b, nc, D // 2), np.uint8)),
                               scale=jnp.asarray(rng.uniform(0.05, 0.5, (b, nc, D // 16)).astype(np.float32)).astype(
                                   jnp.float8_e4m3fn), block=16)
    else:
        win, comp = _v4_values(jnp.asarray(win)), _v4_values(jnp.asarray(comp))
    visible = (positions[..., None] + 1) // RATIO
    scores = jnp.where(jnp.arange(nc)[None, None] < visible, jnp.asarray(rng.random((b, s, nc), np.float32)), -jnp.inf)
    cidx = topk_ascending(scores, kc)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, win, widx, sink, comp, cidx, ww


@pytest.mark.parametrize("store", ["v41", "v4"])
def test_prefill_chunk_in_deepseeks_blocks(store):
    """The kernel with DeepSeek's blocks and window widths against the reference's emulation of them:
    every output element within the parity tolerance, for each row kind (short prompt, full first chunk,
    later chunk)."""
    s, kc = (512, 512) if GPU else (40, 24)
    case = _case(np.random.default_rng(), store, s, kc)
    run = jax.jit(lambda impl, q, win, widx, sink, comp, cidx, ww: attention_api.sparse_attention(
        q, win, widx, sink, scale=D ** -0.5, comp_kv=comp, comp_idx=cidx, running_max_block=BLOCK,
        window_width=ww, implementation=impl), static_argnums=0)
    want = run("reference", *case)
    got = run(IMPL, *case)
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
    win = quant.quantize_fp8(jnp.asarray(rng.standard_normal((b, WINDOW, D)).astype(np.float32)), (1, 32))
    comp = quant.Fp4Tensor(data=jnp.asarray(rng.integers(0, 256, (b, nc, D // 2), np.uint8)),
                           scale=jnp.asarray(rng.uniform(0.05, 0.5, (b, nc, D // 16)).astype(np.float32)).astype(
                               jnp.float8_e4m3fn), block=16)
    visible = (positions[..., None] + 1) // RATIO
    scores = jnp.where(jnp.arange(nc)[None, None] < visible, jnp.asarray(rng.random((b, 1, nc), np.float32)), -jnp.inf)
    cidx = topk_ascending(scores, kc)
    cidx = cidx.at[0, 0, kc - 37:].set(-1)  # a short list: -1 padding inside the last blocks
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    rmb = RunOptions(attention_rounding=rounding).running_max_block
    run = jax.jit(lambda impl, *a: attention_api.sparse_attention(
        *a[:4], scale=D ** -0.5, comp_kv=a[4], comp_idx=a[5], running_max_block=rmb, implementation=impl),
        static_argnums=0)
    want = run("reference", q, win, widx, sink, comp, cidx)
    got = run(IMPL, q, win, widx, sink, comp, cidx)
    assert got.shape == (b, 1, H, D)
    check_close(got, want)
