"""The two-pass sparse-attention decode kernels in the model (``DSV41_SPARSE_DECODE=two_pass``):
every layer's decode-step attention runs them (interpret mode; every other op on its reference, to
keep the CPU time small), each call equals the reference on its own inputs to float32 summation
order, and the step's logits equal the reference path's. The tiny V4.1 preset with the reference
KV formats reaches them through the model's real stores: the FP8 window ring and the FP4
compressed cache with the indexer's top-k lists."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import attention
from dsv41_jax.cache import init_cache
from dsv41_jax.config import get_preset
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params
from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
from dsv41_jax.transformer import forward_step
from pallas_kernels import dispatch
from pallas_kernels.testing import only_kernels
from pallas_kernels.sparse_attention import pallas_triton


@pytest.mark.parametrize("method,B", [("two_pass", 2), ("auto", 1)], ids=["two_pass_b2", "auto_default_b1"])
def test_decode_step_runs_the_two_pass_kernels(monkeypatch, method, B):
    """``two_pass`` at batch 2, and the default ``auto`` at batch 1 (where it takes them)."""
    only_kernels(monkeypatch, lambda op: op == "sparse_attention")
    monkeypatch.setattr(pallas_triton, "DECODE_METHOD", method)
    call_errors, stores = [], []
    real = attention.sparse_attention

    def checked(q, kv, kv_idx, sink, **kw):
        o = real(q, kv, kv_idx, sink, **kw)
        with dispatch.use_implementation("reference"):  # read at trace time
            r = real(q, kv, kv_idx, sink, **kw)
        stores.append((type(kv), type(kw["comp_kv"])))
        err = jnp.max(jnp.abs(o - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
        jax.debug.callback(lambda e: call_errors.append(float(e)), err)
        return o

    monkeypatch.setattr(attention, "sparse_attention", checked)
    cfg = dataclasses.replace(get_preset("tiny"), engram_layer_ids=(), engram_num_embeddings=())  # no Engram ids per step
    opts = RunOptions(dtype="float32", kv_cache_dtype="reference")
    P = 9
    one = jnp.ones((B,), jnp.int32)
    params = init_params(cfg, seed=np.random.randint(1 << 30))
    rng = np.random.default_rng()
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, P)), jnp.int32)
    ref_step = jax.jit(functools.partial(forward_step, cfg=cfg, opts=opts))
    cache = init_cache(cfg, B, 32, opts)
    with dispatch.use_implementation("reference"):  # the prompt one token per step: no prefill program
        for t in range(P):
            _, cache = ref_step(params, cache, prompt[:, t:t + 1], one)
        tok = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, 1)), jnp.int32)
        ref = np.asarray(ref_step(params, cache, tok, one)[0])
    jax.effects_barrier()
    call_errors.clear()
    stores.clear()
    with dispatch.use_implementation("interpret"):
        step = functools.partial(forward_step, cfg=cfg, opts=opts)
        jaxpr = str(jax.make_jaxpr(step)(params, cache, tok, one))
        out = np.asarray(jax.jit(step)(params, cache, tok, one)[0])
    jax.effects_barrier()
    # one two-pass call per layer, over the model's FP8 window and, where the layer has one, its FP4
    # compressed cache
    assert jaxpr.count("name=sparse_attention_logits") == cfg.n_layers == jaxpr.count("name=sparse_attention_pv")
    assert "sparse_attention_sink" not in jaxpr
    assert all(w is Fp8Tensor for w, _ in stores) and any(c is Fp4Tensor for _, c in stores), stores
    assert len(call_errors) == cfg.n_layers and max(call_errors) <= 1e-5, call_errors
    # the logits: the calls differ by <= 3.5e-7 and the logits came out identical in session 46's runs
    # (wo_a's FP8 activation fake-quant absorbs the difference); a one-ulp change that crosses an FP8
    # rounding boundary would move them by ~1e-2 of their scale (test_fused_gemv_model), hence 2e-2
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref)) <= 2e-2 * float(np.max(np.abs(ref)))
