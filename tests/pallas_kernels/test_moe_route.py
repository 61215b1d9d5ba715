"""moe_route Pallas-Triton kernel (the router's scores, biased top-k and weights in one launch):
interpret-mode parity with the reference on fresh random logits for every score function, the
tie rule of jax.lax.top_k, the bias that selects without weighting, shape-support reasons,
dispatch, the model's router on the op, and cross-lowering for cuda (H200) and rocm (gfx950)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.moe_route import api, pallas_triton, reference
from pallas_kernels.testing import fake_device_time, lower_for

KW = dict(gate_temp=1.3, norm_topk_prob=True, route_scale=2.5)


def _pair(z, b, **kw):
    """(kernel in interpret mode, reference), each jitted."""
    got = jax.jit(lambda z, b: pallas_triton.route_select(z, b, interpret=True, **kw))(z, b)
    want = jax.jit(lambda z, b: reference.route_select(z, b, **kw))(z, b)
    return [np.asarray(a) for a in got], [np.asarray(a) for a in want]


def _case(rng, n, e, spread=3.0):
    return (jnp.asarray(rng.standard_normal((n, e)) * spread, jnp.float32),
            jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32))


@pytest.mark.parametrize("score_func", reference.SCORE_FUNCS)
@pytest.mark.parametrize("n,e,k", [(1, 96, 6), (7, 384, 6), (3, 256, 8), (2, 20, 1)])
def test_parity_interpret(score_func, n, e, k):
    """Indices equal; weights within 4 f32 ulps of the reference (the normalising sum's order), 16 for
    the softmax (its sum over E terms in another order too); with and without the normalisation."""
    rng = np.random.default_rng()
    z, b = _case(rng, n, e)
    for norm in (True, False):
        (w, i), (wr, ir) = _pair(z, b, topk=k, score_func=score_func, **{**KW, "norm_topk_prob": norm})
        assert w.shape == (n, k) and i.shape == (n, k) and w.dtype == np.float32 and i.dtype == np.int32
        np.testing.assert_array_equal(i, ir)
        np.testing.assert_allclose(w, wr, rtol=(16 if score_func == "softmax" else 4) * 2.0**-23, atol=0)
        assert all(len(set(r)) == k for r in i.tolist())  # k distinct experts per row


def test_ties_go_to_the_lower_index_and_the_bias_only_selects():
    """Equal biased scores: the lower expert index first, as jax.lax.top_k; a large bias picks an
    expert whose weight is still its unbiased score."""
    e = 40
    z = np.zeros((2, e), np.float32) - 4.0
    z[0, [3, 17, 29]] = 1.5  # a three-way tie for the top
    z[1, 5] = 2.0
    bias = np.zeros(e, np.float32)
    bias[30] = 10.0  # selects expert 30 first in every row, whatever its score
    kw = dict(topk=4, score_func="sigmoid", gate_temp=1.0, norm_topk_prob=False, route_scale=1.0)
    (w, i), (wr, ir) = _pair(jnp.asarray(z), jnp.asarray(bias), **kw)
    np.testing.assert_array_equal(i, ir)
    assert i[0].tolist() == [30, 3, 17, 29] and i[1][:2].tolist() == [30, 5]
    np.testing.assert_allclose(w[0, 0], 1.0 / (1.0 + np.exp(4.0)), rtol=1e-6)  # sigmoid(-4), not the bias
    np.testing.assert_array_equal(w, wr)


def test_unsupported_reasons_and_errors():
    z = jnp.ones((2, 8), jnp.float32)
    b = jnp.ones((8,), jnp.float32)
    assert "float32" in pallas_triton.unsupported_reason(z.astype(jnp.bfloat16), b, 2, "sigmoid")
    assert "does not match E=8" in pallas_triton.unsupported_reason(z, jnp.ones((7,)), 2, "sigmoid")
    assert "topk=9" in pallas_triton.unsupported_reason(z, b, 9, "sigmoid")
    assert "score_func 'relu'" in pallas_triton.unsupported_reason(z, b, 2, "relu")
    assert "[N, E]" in pallas_triton.unsupported_reason(z[0], b, 2, "sigmoid")
    with pytest.raises(ValueError, match=r"moe_route \(pallas\): topk=9"):
        pallas_triton.route_select(z, b, topk=9, score_func="sigmoid", interpret=True, **KW)


def test_warps_change_nothing_and_no_row_spills_into_the_next():
    """num_warps changes the warps and not the result; rows whose picks differ in every column keep
    their own (session 24's race wrote a row's pad into the next row's columns 0-1)."""
    z = jax.random.normal(jax.random.PRNGKey(5), (5, 16), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(6), (16,), jnp.float32) * 0.1
    w1, i1 = pallas_triton.route_select(z, b, topk=6, score_func="sigmoid", interpret=True, **KW)
    w4, i4 = pallas_triton.route_select(z, b, topk=6, score_func="sigmoid", interpret=True, num_warps=4, **KW)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i4))
    np.testing.assert_array_equal(np.asarray(w1), np.asarray(w4))
    wr, ir = reference.route_select(z, b, topk=6, score_func="sigmoid", **KW)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(ir))
    assert np.all(np.asarray(w1) > 0)  # no pad weight (0) anywhere


def test_dispatch_auto_picks_the_kernel_on_a_gpu(monkeypatch):
    """Plain 'auto' has no objection (auto_reason None: measured on the H200 in session 25), so on
    the CPU the reference runs only because there is no GPU; 'interpret' runs the kernel; DSV41_KERNELS=moe_route=... picks it per op; an unsupported shape under a context falls
    back to the reference."""
    rng = np.random.default_rng()
    z, b = _case(rng, 3, 96)
    kw = dict(topk=6, score_func="sqrtsoftplus", **KW)
    assert pallas_triton.auto_reason(z) is None
    calls = []
    real = pallas_triton.route_select
    monkeypatch.setattr(pallas_triton, "route_select", lambda *a, **k: calls.append(k["interpret"]) or real(*a, **k))
    w0, i0 = api.route_select(z, b, **kw)  # auto on the CPU: the reference
    assert calls == []
    w1, i1 = api.route_select(z, b, implementation="interpret", **kw)
    assert calls == [True]
    np.testing.assert_array_equal(np.asarray(i0), np.asarray(i1))
    monkeypatch.setenv("DSV41_KERNELS", "auto,moe_route=interpret")
    api.route_select(z, b, **kw)
    assert calls == [True, True]
    assert dispatch.parse_kernels_env("moe_route=pallas") == ("auto", {"moe_route": "pallas"})
    with dispatch.use_implementation("interpret"):  # bf16 logits: unsupported, the reference instead
        api.route_select(z.astype(jnp.bfloat16), b, **kw)
    assert calls == [True, True]
    monkeypatch.delenv("DSV41_KERNELS")  # plain auto on a (pretended) GPU: the kernel, compiled
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.choose("moe_route", None, api._kernel, lambda k: k.unsupported_reason(z, b, 6, "sqrtsoftplus"),
                           lambda k: k.auto_reason(z)) == (pallas_triton, False)


def test_model_router_runs_on_the_op():
    """dsv41_jax.moe.route: the biased top-k goes through the op (the kernel under
    'interpret', the reference otherwise) with the same result; a V4 hash layer keeps its table."""
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.moe import route

    cfg = ModelConfig()
    rng = np.random.default_rng()
    d, e = 64, cfg.n_routed_experts
    p_gate = {"weight": jnp.asarray(rng.standard_normal((e, d)) * 0.2, jnp.bfloat16),
              "bias": jnp.asarray(rng.standard_normal(e) * 0.05, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.bfloat16)
    k = cfg.n_activated_experts
    wr, ir = jax.jit(lambda x: route(p_gate, x, cfg, k))(x)
    with dispatch.use_implementation("interpret"):
        wk, ik = jax.jit(lambda x: route(p_gate, x, cfg, k))(x)
    np.testing.assert_array_equal(np.asarray(ik), np.asarray(ir))
    np.testing.assert_allclose(np.asarray(wk), np.asarray(wr), rtol=4 * 2.0**-23)
    tid2eid = jnp.asarray(rng.integers(0, e, (50, k)), jnp.int32)
    tokens = jnp.asarray([4, 9, 31], jnp.int32)
    with dispatch.use_implementation("interpret"):
        wh, ih = jax.jit(lambda x: route({**p_gate, "tid2eid": tid2eid}, x, cfg, k, tokens))(x)
    np.testing.assert_array_equal(np.asarray(ih), np.asarray(tid2eid)[[4, 9, 31]])
    assert np.all(np.asarray(wh) > 0)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("n,e,score_func", [(1, 384, "sqrtsoftplus"), (64, 96, "sigmoid"), (4096, 384, "softmax"),
                                            (8, 4096, "sqrtsoftplus")])
def test_cross_lowering(target, n, e, score_func):
    S = jax.ShapeDtypeStruct
    text = lower_for(target, lambda z, b: pallas_triton.route_select(z, b, topk=6, score_func=score_func, **KW),
                     S((n, e), jnp.float32), S((e,), jnp.float32)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "sort" not in text


def test_benchmark_checks_then_times_each_size(monkeypatch, capsys, tmp_path):
    """benchmark.main on the CPU: the kernel in interpret mode, the profiler timing stubbed; every
    size is checked before it is timed, and the rows are written."""
    import functools
    import json

    import pallas_kernels.benchmarking as bm
    from pallas_kernels.moe_route import benchmark

    monkeypatch.setattr(bm, "device_time_op", fake_device_time(2e-6))
    monkeypatch.setattr(pallas_triton, "route_select", functools.partial(pallas_triton.route_select, interpret=True))
    assert benchmark.main(["--quick", "--repeat", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(" PASS ") == 2 and "moe_route check: ALL PASS" in out
    rows = json.loads((tmp_path / "moe_route.json").read_text())["rows"]
    assert [(r["tokens"], r["experts"], r["ok"], r["reproducible"]) for r in rows] == [(1, 96, True, True),
                                                                                       (1, 384, True, True)]
    assert all(r["xla_us"] == 2.0 and r["pallas_kernels"] == 1 for r in rows)
    assert "pallas_4w_us" not in rows[0] and rows[1]["pallas_4w_us"] == 2.0  # 4 warps tried at E = 384


def test_benchmark_reproducibility_check_catches_a_kernel_that_varies(capsys):
    """benchmark.repeats_identical: identical bits every call pass; a kernel whose weights move by
    one ulp on every other call (a host callback adds the noise, in row 1, columns 0-1: where
    session 24's race wrote) fails, and the check names those rows and columns."""
    from pallas_kernels.moe_route import benchmark

    rng = np.random.default_rng()
    z, b = _case(rng, 3, 96)
    kw = dict(topk=6, score_func="sqrtsoftplus", **KW)
    steady = lambda z, b: reference.route_select(z, b, **kw)
    assert benchmark.repeats_identical(steady, z, b, 3, rng, 96)
    calls = []

    def noise():
        calls.append(1)
        n = np.zeros((3, 6), np.float32)
        n[1, :2] = len(calls) % 2
        return n

    def varying(z, b):
        w, i = reference.route_select(z, b, **kw)
        return jnp.nextafter(w, w + jax.pure_callback(noise, jax.ShapeDtypeStruct(w.shape, jnp.float32))), i

    assert not benchmark.repeats_identical(varying, z, b, 8, rng, 96)
    assert "differing rows [1] (1), columns [0, 1]" in capsys.readouterr().out
