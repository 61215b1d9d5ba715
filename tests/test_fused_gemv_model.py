"""The decode step's same-input projections share one kernel launch (wq_a + wkv, the shared expert's
w1 + w3; ``layers.linear_multi``), wo_a runs one grouped launch, and the step's logits still equal
the reference path's.

The weight GEMMs run on the Pallas kernels in interpret mode (every other op on its reference, to
keep the CPU time small). A 1-token decode step is the case the fused launch exists for (the host's
launch cost per kernel limits batch-1 decode on the H200, BENCHMARKS.md session 5); a prefill chunk
(more than 4 rows) keeps one call per weight."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.cache import init_cache
from dsv41_jax.config import get_preset
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params
from dsv41_jax.transformer import forward_step
from pallas_kernels import dispatch


def _only_qmm_kernels(monkeypatch):
    choose = dispatch.choose

    def choose_qmm(op, implementation, *a, **k):
        return choose(op, implementation if op == "quantized_matmul" else "reference", *a, **k)

    monkeypatch.setattr(dispatch, "choose", choose_qmm)


def test_decode_step_fuses_same_input_projections(monkeypatch):
    from dsv41_jax import moe

    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    _only_qmm_kernels(monkeypatch)
    # every MoE layer's routing, as each path decides it (a debug callback inside the jitted step)
    routes = []
    route = moe.route

    def recording_route(*a, **k):
        w, idx = route(*a, **k)
        jax.debug.callback(lambda i: routes.append(np.asarray(i)), idx)
        return w, idx

    monkeypatch.setattr(moe, "route", recording_route)
    cfg = get_preset("tiny-v4")
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    B, P = 2, 9
    one = jnp.ones((B,), jnp.int32)
    f = functools.partial(forward_step, cfg=cfg, opts=opts)
    # traced under "reference" only (JAX caches traces per function object, and the implementation
    # is read at trace time: every other trace below gets a fresh partial)
    ref_step = jax.jit(f)
    kernel_step = jax.jit(functools.partial(forward_step, cfg=cfg, opts=opts))

    def draw():
        """Fresh weights and tokens; (reference logits and routes, kernel-path logits and routes).
        The prompt is fed one token per step: the reference decode program fills the cache (9
        positions), so the test compiles no prefill program (one forward program fewer, ~20 CPU-s)."""
        params = init_params(cfg, seed=np.random.randint(1 << 30))
        rng = np.random.default_rng()
        prompt = jnp.asarray(rng.integers(3, 5000, (B, P)), jnp.int32)
        cache = init_cache(cfg, B, 32, opts)
        with dispatch.use_implementation("reference"):
            for t in range(P):
                _, cache = ref_step(params, cache, prompt[:, t:t + 1], one)
        tok = jnp.asarray(rng.integers(3, 5000, (B, 1)), jnp.int32)
        out = []
        for impl, step in (("reference", ref_step), ("interpret", kernel_step)):
            jax.effects_barrier()  # the callbacks of every step dispatched so far have run
            routes.clear()
            with dispatch.use_implementation(impl):
                logits, _ = step(params, cache, tok, one)
            logits = np.asarray(logits)
            jax.effects_barrier()
            out.append((logits, list(routes)))
        return params, cache, tok, out

    # A draw whose two paths route some token to different experts has a near-tie in the gate scores:
    # the kernels' fp32 sums in another order move an FP8 activation rounding, the MoE input by ~1e-3,
    # and the top-k picks the other expert (one draw in ~30: seed 6 of 0..29 in session 26, before and
    # after the split-K finish kernel alike). Such a draw is legitimately far apart; draw again.
    for _ in range(4):
        params, cache, tok, ((ref, ref_routes), (out, out_routes)) = draw()
        assert len(ref_routes) == len(out_routes) == cfg.n_layers  # hash layers too (route returns tid2eid)
        if all(np.array_equal(a, b) for a, b in zip(ref_routes, out_routes)):
            break
    else:
        raise AssertionError("4 draws in a row routed differently on the kernel path: not a near-tie")
    with dispatch.use_implementation("reference"):
        ref_jaxpr = str(jax.make_jaxpr(functools.partial(forward_step, cfg=cfg, opts=opts))(params, cache, tok, one))
    with dispatch.use_implementation("interpret"):
        jaxpr = str(jax.make_jaxpr(functools.partial(forward_step, cfg=cfg, opts=opts))(params, cache, tok, one))
    assert "qmm_fma" not in ref_jaxpr
    # per layer: wq_a + wkv in one launch, the shared expert's w1 + w3 in another
    assert jaxpr.count("name=qmm_fma_fp8_x2") == 2 * cfg.n_layers, jaxpr.count("name=qmm_fma_fp8_x2")
    # and wo_a, the grouped projection, one launch over its groups per layer
    assert jaxpr.count("name=qmm_fma_fp8_grouped") == cfg.n_layers, jaxpr.count("name=qmm_fma_fp8_grouped")
    # and wq_a's K parts summed and q_norm applied by the split-K finish kernel
    assert jaxpr.count("name=qmm_split_finish") == cfg.n_layers, jaxpr.count("name=qmm_split_finish")
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-3 * float(np.max(np.abs(ref))))

    # a prefill chunk (B x 9 rows > 4) keeps one launch per weight
    with dispatch.use_implementation("interpret"):
        pre = str(jax.make_jaxpr(functools.partial(forward_step, cfg=cfg, opts=opts))(
            params, init_cache(cfg, B, 32, opts), jnp.ones((B, P), jnp.int32), jnp.full((B,), P, jnp.int32)))
    assert "qmm_fma_fp8_x2" not in pre and "qmm_fma_fp8_grouped" not in pre  # 18 rows: XLA's dot
