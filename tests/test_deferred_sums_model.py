"""The decode step hands wo_b's split-K parts, and the MoE's slot rows with the shared expert's w2
parts, to the fused mHC expansion kernel unsummed (``pallas_kernels.deferred_sum``,
``transformer.DEFER_SUMS``), and its logits equal those of the step that sums them with XLA first.

The tiny V4.1 model (its first 3 layers, ``tiny_short(n_layers=3)``: every mHC site kind) with 64-wide experts (so that the fused MoE and the shared expert's w2 GEMV take
it; the preset's 32 are below their K tile); the weight GEMVs, the MoE and the mHC ops on their
Pallas kernels in interpret mode, every other op on its reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import Model, transformer
from dsv41_jax.cache import init_cache
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params
from pallas_kernels import dispatch
from pallas_kernels.testing import only_kernels
from pallas_kernels.deferred_sum import DeferredSum
from pallas_kernels.mhc import pallas_triton as mhc_kernel
from tiny_short import tiny_short

KERNEL_OPS = ("quantized_matmul", "moe_experts")


# 64-wide experts: one down K step (unsplit slot rows); 192: 3 down K steps, which the default down
# split (pallas_kernels.moe.pallas_triton.DEFAULT_DOWN_SPLITS) divides, so the expansion kernel
# also sums the down kernel's split-K rows
@pytest.mark.parametrize("inter,row_splits", [(64, 0), (192, 3)])
def test_deferred_sums_give_the_logits_of_the_summed_step(inter, row_splits, monkeypatch):
    only_kernels(monkeypatch, lambda op: op.startswith("hc_") or op in KERNEL_OPS)
    pieces, splits = [], []
    real = mhc_kernel.hc_expand_collapse_mixes

    def spy(f, *a, **k):
        if isinstance(f, DeferredSum):
            splits.append(f.row_splits)
        pieces.append((f.parts is not None, f.expert_rows is not None) if isinstance(f, DeferredSum) else None)
        return real(f, *a, **k)

    monkeypatch.setattr(mhc_kernel, "hc_expand_collapse_mixes", spy)
    cfg = tiny_short(n_layers=3, moe_inter_dim=inter)
    assert cfg.engram_layer_ids == (1,)
    params = init_params(cfg, np.random.randint(1 << 30))
    opts = RunOptions(dtype="bfloat16")
    rng = np.random.default_rng()
    toks = jnp.asarray(rng.integers(3, 5000, (1, 1)), jnp.int32)
    ids = Model(cfg, params).engram_ids(np.asarray(toks), np.zeros((1, 1), np.int32))

    def run(defer):
        monkeypatch.setattr(transformer, "DEFER_SUMS", "on" if defer else "off")
        pieces.clear()
        step = jax.jit(functools.partial(transformer.forward_step, cfg=cfg, opts=opts))  # traced afresh
        with dispatch.use_implementation("interpret"):
            logits, _ = step(params, init_cache(cfg, 1, 16, opts), toks, jnp.asarray([1], jnp.int32), ids)
        return list(pieces), np.asarray(logits, np.float32)

    deferred_pieces, deferred = run(True)
    # every layer's attention expansion gets wo_b's parts; the FFN expansion that fuses the next
    # layer's mixes (layer 1: not before an Engram layer, not the last) the MoE's pieces
    n = cfg.n_layers
    assert deferred_pieces.count((True, False)) == n and deferred_pieces.count((True, True)) == n - 2
    assert sorted(set(splits)) == sorted({0, row_splits}), splits  # wo_b's parts: 0; the MoE's rows
    summed_pieces, summed = run(False)
    assert summed_pieces == [None] * len(deferred_pieces)
    assert np.all(np.isfinite(deferred)) and np.std(deferred) > 0
    np.testing.assert_array_equal(deferred, summed)


def test_defer_sums_switch_names_a_wrong_value():
    """``DSV41_DEFER_SUMS`` is read at import: a value other than on / attn / off stops the import with
    the variable and the accepted values named."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import dsv41_jax.transformer"], capture_output=True, text=True,
                       env={**os.environ, "DSV41_DEFER_SUMS": "yes", "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode != 0 and "DSV41_DEFER_SUMS='yes': expected on, attn or off" in r.stderr, r.stderr[-2000:]
