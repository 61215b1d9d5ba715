"""The ``tiny-v4`` model (FP8 128x128 weights with 128-wide activation blocks, MXFP4 experts) with
its weight GEMMs on the Pallas kernels in interpret mode.

Kernels under test: ``quantized_matmul`` (every FP8 linear: attention, indexer, shared expert) and
``moe_experts`` (routed MXFP4 experts, act_block 128), selected the way the model sees them
(``use_implementation("interpret")``, i.e. ``DSV41_KERNELS=interpret``; on a GPU ``pallas`` runs the
same kernels compiled). The other ops stay on their references here (see below). Both checks run on
the preset's first 3 layers (``tiny_short.tiny_v4_short``: sliding + hash routing, CSA, HCA, every V4
layer kind once; the preset's layers 3-4 repeat 1-2): 44.8 -> 31.1 CPU-s for the two tests. The
observations below were made on all 5 layers.

Two checks, float32 compute and KV throughout:

1. Logits: the forward with the kernels gives the reference forward's logits within
   ``1e-5 * max|logit|`` (observed: max |diff| 7e-7 at max |logit| 5.3, 1.3e-7 relative). The kernels
   form the reference's products exactly and differ only in fp32 summation order. Caveat, measured
   while writing this test: the FP8 activation fake-quant before every linear makes the model
   piecewise constant, and a ~1e-7 difference occasionally lands on an e4m3 rounding boundary (or
   flips a top-k choice); the run then diverges from that token on by ~1e-2..1e-1. This fixed case
   (init seed 0, fixed tokens) has no such flip; with the mHC kernels switched on too it has one in
   layer 2, and a 2**-22 relative perturbation of the reference's own ``hc_expand`` output gives the
   very same flip, so that is the model's sensitivity, not a kernel error. Hence mHC / attention /
   indexer stay on their references in this test. If this check fails after an unrelated change,
   look at check 2 first.
2. Every kernel call of a forward, compared with its reference on the same inputs inside the jitted
   forward (immune to such flips), on weights whose 128x128 blocks carry distinct scales (random-init
   weights have the same scale in every block, which would hide a scale read from the wrong block):
   max |diff| <= 1e-5 * max |reference| per call.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.cache import init_cache
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params
from dsv41_jax.quant import Fp8Tensor
from dsv41_jax.transformer import forward_step
from pallas_kernels import dispatch
from pallas_kernels.deferred_sum import materialize
from pallas_kernels.moe import pallas_triton as moe_kernel
from pallas_kernels.moe import reference as moe_reference
from pallas_kernels.quantized_matmul import pallas_triton as qmm_kernel
from pallas_kernels.quantized_matmul import reference as qmm_reference
from tiny_short import tiny_v4_short

KERNEL_OPS = ("quantized_matmul", "moe_experts")
# "interpret" on the CPU (CI); on a GPU, DSV41_TEST_KERNEL_IMPL=pallas runs the same checks with the
# kernels compiled (then also set JAX_PLATFORMS=cuda,cpu -- the error records are jax.debug.callbacks,
# which need the cpu platform -- and JAX_DEFAULT_MATMUL_PRECISION=highest). On the H200 (session 16)
# both tests failed there: 128x128 FP8 calls up to 1.5e-3 of max|ref| off. Cause (session 17): XLA's
# GPU compiler folded the activation fake-quant's f32 -> e4m3 -> f32 converts away, so the kernel got
# bf16(x) and the reference f32 x, both unquantized; codecs.e4m3_round now rounds on bit patterns.
# Not yet re-run on a GPU with the fix (BENCHMARKS.md, issue 11).
IMPL = os.environ.get("DSV41_TEST_KERNEL_IMPL", "interpret")
TOL = 1e-5  # relative to max |reference|, float32 outputs


def spread_fp8_scales(params, key):
    """Multiply every 128x128 block's e8m0 scale by 2**r, r in {-1, 0, 1} at random: the model keeps
    its magnitudes and every block gets its own scale."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=lambda t: isinstance(t, Fp8Tensor))
    out, n = [], 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Fp8Tensor) and leaf.block == (128, 128):
            u = jax.lax.bitcast_convert_type(leaf.scale, jnp.uint8).astype(jnp.int32)
            u = u + jax.random.randint(jax.random.fold_in(key, i), u.shape, -1, 2)
            leaf = Fp8Tensor(leaf.data, jax.lax.bitcast_convert_type(u.astype(jnp.uint8), jnp.float8_e8m0fnu), leaf.block)
            n += 1
        out.append(leaf)
    assert n >= 20
    return jax.tree.unflatten(treedef, out)


def _rel_err(y, yr):
    y = y.astype(jnp.float32)
    yr = yr.astype(jnp.float32)
    return jnp.max(jnp.abs(y - yr)), jnp.max(jnp.abs(yr))


@pytest.fixture
def kernels_on_weight_gemms(monkeypatch):
    """Route only quantized_matmul and moe_experts to the kernels; record every kernel call (trace
    time) and its error against the reference on the same inputs (run time)."""
    choose = dispatch.choose

    def choose_only_weight_gemms(op, implementation, *a, **k):
        if op not in KERNEL_OPS:
            implementation = "reference"
        return choose(op, implementation, *a, **k)

    monkeypatch.setattr(dispatch, "choose", choose_only_weight_gemms)
    rec = {"qmm": [], "moe": [], "fallback_fp8": [], "errors": []}
    qmm, qmm_ref, moe = qmm_kernel.quantized_matmul, qmm_reference.quantized_matmul, moe_kernel.moe_experts

    def qmm_checked(x, w, *, act_block=32, out_dtype=None, interpret=False, config=None, defer=False):
        rec["qmm"].append((w.block if isinstance(w, Fp8Tensor) else type(w).__name__, act_block, interpret))
        y = qmm(x, w, act_block=act_block, out_dtype=out_dtype, interpret=interpret, config=config, defer=defer)
        d, s = _rel_err(materialize(y), qmm_ref(x, w, act_block=act_block, out_dtype=out_dtype))
        jax.debug.callback(lambda d, s, n=tuple(w.shape): rec["errors"].append(("qmm", n, float(d), float(s))), d, s)
        return y

    def qmm_ref_spy(x, w, *a, **k):
        if isinstance(w, Fp8Tensor):
            rec["fallback_fp8"].append(tuple(w.shape))
        return qmm_ref(x, w, *a, **k)

    def moe_checked(x, weights, indices, w1, w2, w3, *, swiglu_limit, act_block=32, interpret=False, config=None,
                    defer=False):
        rec["moe"].append((type(w1).__name__, act_block, interpret))
        y = moe(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit, act_block=act_block,
                interpret=interpret, config=config, defer=defer)
        d, s = _rel_err(materialize(y), moe_reference.moe_experts(x, weights, indices, w1, w2, w3, swiglu_limit=swiglu_limit,
                                                     act_block=act_block))
        jax.debug.callback(lambda d, s: rec["errors"].append(("moe", tuple(x.shape), float(d), float(s))), d, s)
        return y

    monkeypatch.setattr(qmm_kernel, "quantized_matmul", qmm_checked)
    monkeypatch.setattr(qmm_reference, "quantized_matmul", qmm_ref_spy)
    monkeypatch.setattr(moe_kernel, "moe_experts", moe_checked)
    return rec


def _forward(params, cfg, opts, ids, impl):
    f = jax.jit(functools.partial(forward_step, cfg=cfg, opts=opts))  # a fresh jit: traced per implementation
    with dispatch.use_implementation(impl):
        logits, _ = f(params, init_cache(cfg, ids.shape[0], 32, opts), ids, jnp.full((ids.shape[0],), ids.shape[1], jnp.int32))
        return np.asarray(logits)


def _check_calls(rec, cfg):
    # every FP8 linear ran the 128x128 kernel (only plain weights fell back); every MoE ran the kernel
    assert len(rec["qmm"]) >= 6 * cfg.n_layers and all(c == ((128, 128), 128, IMPL == "interpret") for c in rec["qmm"]), rec["qmm"]
    assert not rec["fallback_fp8"], rec["fallback_fp8"]
    assert rec["moe"] == [("Fp4Tensor", 128, IMPL == "interpret")] * cfg.n_layers
    assert len(rec["errors"]) == len(rec["qmm"]) + len(rec["moe"])
    bad = [e for e in rec["errors"] if not e[2] <= TOL * e[3]]
    assert not bad, bad


def test_tiny_v4_logits_with_weight_kernels_match_reference(kernels_on_weight_gemms):
    rec = kernels_on_weight_gemms
    cfg = tiny_v4_short(3)  # every V4 layer kind once (sliding + hash routing, CSA, HCA)
    assert cfg.fp8_block_size == 128 and cfg.expert_dtype == "fp4"
    params = init_params(cfg, seed=0)
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 5000, (2, 12)), jnp.int32)
    ref = _forward(params, cfg, opts, ids, "reference")
    assert not rec["qmm"] and not rec["moe"] and len(rec["fallback_fp8"]) >= 6 * cfg.n_layers
    rec["fallback_fp8"].clear()
    out = _forward(params, cfg, opts, ids, IMPL)
    _check_calls(rec, cfg)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOL * float(np.max(np.abs(ref))))


def test_tiny_v4_every_kernel_call_matches_reference_distinct_block_scales(kernels_on_weight_gemms):
    rec = kernels_on_weight_gemms
    cfg = tiny_v4_short(3)
    params = spread_fp8_scales(init_params(cfg, seed=0), jax.random.PRNGKey(np.random.randint(1 << 30)))
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    ids = jnp.asarray(np.random.default_rng().integers(3, 5000, (1, 12)), jnp.int32)
    out = _forward(params, cfg, opts, ids, IMPL)
    assert np.all(np.isfinite(out))
    _check_calls(rec, cfg)
