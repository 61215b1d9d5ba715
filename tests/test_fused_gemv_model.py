"""The decode step's same-input projections share one kernel launch (wq_a + wkv, the shared expert's
w1 + w3, and in a layer with its own indexer wq_b + the indexer's wq_b; ``layers.linear_multi``), wo_a runs one grouped launch, every fused call equals the
reference on its inputs, and the step's logits equal the reference path's (up to the FP8 rounding
flips described in the test).

The weight GEMMs run on the Pallas kernels in interpret mode (every other op on its reference, to
keep the CPU time small). A 1-token decode step is the case the fused launch exists for (the host's
launch cost per kernel limits batch-1 decode on the H200, BENCHMARKS.md session 5); a prefill chunk
(more than 4 rows) keeps one call per weight."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.cache import init_cache
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params
from dsv41_jax.transformer import forward_step
from pallas_kernels import dispatch
from pallas_kernels.testing import draw_until_logits_agree
from tiny_short import tiny_v4_short


def _only_qmm_kernels(monkeypatch):
    choose = dispatch.choose

    def choose_qmm(op, implementation, *a, **k):
        return choose(op, implementation if op == "quantized_matmul" else "reference", *a, **k)

    monkeypatch.setattr(dispatch, "choose", choose_qmm)


def test_decode_step_fuses_same_input_projections(monkeypatch):
    from dsv41_jax import layers
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    _only_qmm_kernels(monkeypatch)
    # every fused call (wq_a + wkv with q_norm, the shared expert's w1 + w3) checked inside the jitted
    # step against the reference path on the same inputs: immune to what the FP8 activation roundings
    # make of one-ulp differences further on (see the logits check below)
    call_errors = []
    fused = layers.quantized_matmul_multi

    def checked_multi(x, ws, **kw):
        ys = fused(x, ws, **kw)
        with dispatch.use_implementation("reference"):  # read at trace time
            yrs = fused(x, ws, **kw)
        errs = [jnp.max(jnp.abs(y.astype(jnp.float32) - r.astype(jnp.float32))) / jnp.max(jnp.abs(r.astype(jnp.float32)))
                for y, r in zip(ys, yrs)]
        jax.debug.callback(lambda *e: call_errors.append([float(v) for v in e]), *errs)
        return ys

    monkeypatch.setattr(layers, "quantized_matmul_multi", checked_multi)
    # the preset's first 3 layers: sliding (hash-routed), CSA (ratio 4, its own indexer) and HCA (ratio 8),
    # each layer kind and fused site once (the preset's layers 3-4 repeat 1-2)
    cfg = tiny_v4_short(3)
    assert [cfg.compress_ratios[layer] for layer in range(cfg.n_layers)] == [0, 4, 8] and cfg.n_hash_layers == 1
    n_csa = sum(cfg.overlap(layer) for layer in range(cfg.n_layers))  # layers with their own indexer
    assert n_csa >= 1
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    B, P = 2, 9
    one = jnp.ones((B,), jnp.int32)
    f = functools.partial(forward_step, cfg=cfg, opts=opts)
    # traced under "reference" only (JAX caches traces per function object, and the implementation
    # is read at trace time: every other trace below gets a fresh partial)
    ref_step = jax.jit(f)
    kernel_step = jax.jit(functools.partial(forward_step, cfg=cfg, opts=opts))

    def draw():
        """Fresh weights and tokens: (reference logits, kernel-path logits). The prompt is fed one
        token per step: the reference decode program fills the cache (9 positions), so the test
        compiles no prefill program (one forward program fewer, ~20 CPU-s)."""
        params = init_params(cfg, seed=np.random.randint(1 << 30))
        rng = np.random.default_rng()
        prompt = jnp.asarray(rng.integers(3, 5000, (B, P)), jnp.int32)
        cache = init_cache(cfg, B, 32, opts)
        with dispatch.use_implementation("reference"):
            for t in range(P):
                _, cache = ref_step(params, cache, prompt[:, t:t + 1], one)
        tok = jnp.asarray(rng.integers(3, 5000, (B, 1)), jnp.int32)
        with dispatch.use_implementation("reference"):
            ref = np.asarray(ref_step(params, cache, tok, one)[0])
        jax.effects_barrier()  # the reference steps' callbacks (their fused calls are the reference's)
        call_errors.clear()
        with dispatch.use_implementation("interpret"):
            out = np.asarray(kernel_step(params, cache, tok, one)[0])
        jax.effects_barrier()
        # per layer: wq_a + wkv and w1 + w3, per CSA layer also wq_b + the indexer's wq_b, each output
        # within float32 summation-order noise
        assert len(call_errors) == 2 * cfg.n_layers + n_csa, len(call_errors)
        assert max(max(e) for e in call_errors) <= 1e-5, call_errors
        return params, cache, tok, ref, out

    # The logits: every linear fake-quantizes its input to e4m3, so a one-ulp summation difference
    # now and then crosses a rounding boundary (or flips a top-k pick) and the logits move by 1e-2 to
    # 1e-1 of their scale: about one draw in 30 (session 26: 2 of 60 with single-threaded Eigen, as
    # the tests run, with every MoE and indexer pick equal; one seed of 30 with a routing flip). The
    # per-call checks above hold on every draw; a draw whose logits moved is drawn again (4 draws).
    params, cache, tok, ref, out = draw_until_logits_agree(draw)
    with dispatch.use_implementation("reference"):
        ref_jaxpr = str(jax.make_jaxpr(functools.partial(forward_step, cfg=cfg, opts=opts))(params, cache, tok, one))
    with dispatch.use_implementation("interpret"):
        jaxpr = str(jax.make_jaxpr(functools.partial(forward_step, cfg=cfg, opts=opts))(params, cache, tok, one))
    assert "qmm_fma" not in ref_jaxpr
    # per layer: wq_a + wkv in one launch, the shared expert's w1 + w3 in another; per CSA layer wq_b
    # and the indexer's wq_b in a third (no separate launch for either)
    assert jaxpr.count("name=qmm_fma_fp8_x2") == 2 * cfg.n_layers + n_csa, jaxpr.count("name=qmm_fma_fp8_x2")
    # and wo_a, the grouped projection, one launch over its groups per layer
    assert jaxpr.count("name=qmm_fma_fp8_grouped") == cfg.n_layers, jaxpr.count("name=qmm_fma_fp8_grouped")
    # and wq_a's K parts summed and q_norm applied by the split-K finish kernel
    assert jaxpr.count("name=qmm_split_finish") == cfg.n_layers, jaxpr.count("name=qmm_split_finish")

    # a prefill chunk (B x 9 rows > 4) keeps one launch per weight
    with dispatch.use_implementation("interpret"):
        pre = str(jax.make_jaxpr(functools.partial(forward_step, cfg=cfg, opts=opts))(
            params, init_cache(cfg, B, 32, opts), jnp.ones((B, P), jnp.int32), jnp.full((B,), P, jnp.int32)))
    assert "qmm_fma_fp8_x2" not in pre and "qmm_fma_fp8_grouped" not in pre  # 18 rows: XLA's dot
