"""The ``tiny-v4`` preset: V4 in the real storage formats (FP8 128x128 weights with 128-wide
activation blocks, MXFP4 experts, Hadamard over 128-wide index heads, FP8/64 KV rounding) on CPU.
No external reference: chunked prefill must reproduce one full pass (the activation fake-quant is
per token, so chunking changes nothing but float summation order)."""

import jax.numpy as jnp
import numpy as np

from dsv41_jax.cache import init_cache
from dsv41_jax.config import get_preset
from dsv41_jax.options import RunOptions
from dsv41_jax.params import init_params
from dsv41_jax.transformer import forward_step_jit


def test_tiny_v4_chunked_equals_full_in_real_formats():
    cfg = get_preset("tiny-v4")
    assert cfg.is_v4 and cfg.dtype == "fp8" and cfg.fp8_block_size == 128 and cfg.expert_dtype == "fp4"
    params = init_params(cfg, seed=0)
    assert params["layers"]["1"]["attn"]["wq_a"].block == (128, 128)
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
    ids = np.random.default_rng(0).integers(3, 5000, (2, 24))
    full, _ = forward_step_jit(params, init_cache(cfg, 2, 64, opts), jnp.asarray(ids, jnp.int32),
                               jnp.full((2,), 24, jnp.int32), cfg=cfg, opts=opts)
    full = np.asarray(full)
    assert np.isfinite(full).all()
    cache, pos = init_cache(cfg, 2, 64, opts), 0
    for n in (7, 8, 1, 8):
        toks = np.zeros((2, 8), np.int64)
        toks[:, :n] = ids[:, pos:pos + n]
        lg, cache = forward_step_jit(params, cache, jnp.asarray(toks, jnp.int32), jnp.full((2,), n, jnp.int32),
                                     cfg=cfg, opts=opts, logits_mode="last")
        pos += n
        np.testing.assert_allclose(np.asarray(lg), full[:, pos - 1], atol=1e-4, rtol=0)
