"""Our V4.1 model against DeepSeek's own V4.1 model code on a checkpoint in the real formats (FP8 e4m3
linears with e8m0 32x32 scales, MXFP4 experts, FP8 wo_a that the reference dequantizes to bf16), with
the reference's KV / indexer rounding on: ``tests/fixtures/v41_quant_xcheck`` (its README says how
the numbers were made). The shared fixture ``v41_tiny_a`` has unquantized weights, so it checks the
structure but none of the formats' arithmetic; this one checks both, in float32 and in bf16."""

import os

import multi_device

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v41_quant_xcheck")


# the subprocess scripts' common start: the fixture's expected values and its checkpoint
_LOAD = r"""
import os
import jax.numpy as jnp, numpy as np
from dsv41_jax.cache import init_cache
from dsv41_jax.checkpoint import load_checkpoint, read_official
from dsv41_jax.options import RunOptions
from dsv41_jax.transformer import forward_step_jit
FIX = %r
fx = {k: np.asarray(v, np.float32) for k, v in read_official(os.path.join(FIX, "fixture.safetensors")).items()}
cfg, params = load_checkpoint(FIX)
"""

F32_SCRIPT = _LOAD + r"""ids = fx["input_ids"].astype(np.int32)
B, S = ids.shape
opts = RunOptions(dtype="float32", kv_cache_dtype="reference")
logits, _, aux = forward_step_jit(params, init_cache(cfg, B, 128, opts), jnp.asarray(ids), jnp.full((B,), S, jnp.int32),
                                  cfg=cfg, opts=opts, return_aux=True)
for l, want in enumerate(fx["resid_after_layer_b0_f32"]):
    got = np.asarray(aux["resid"][l][0], np.float32)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), l
want = fx["logits_f32"]
err = np.abs(np.asarray(logits, np.float32) - want).max(axis=(1, 2))
assert np.all(err <= 1e-5 * np.abs(want).max()), err
print("OK")
"""


def test_float32_every_layer_matches_deepseeks_code():
    """float32 activations, quantized weights, FP8 window KV / FP4 compressed KV / MXFP4 index keys
    and queries: the residual streams after each of the 9 layers (SWA, ratio-2 and ratio-1 sources,
    reuse, candidate selection and re-index) and the logits of a 48-token prefill agree to fp32
    summation order (measured 3e-7 and 4e-7 of the largest value).
    In a subprocess at XLA's default CPU optimization level, as the bf16 check below: at the suite's
    -O0 (tests/conftest.py) jax 0.12.1's CPU code rounds some fp32 operation differently (0.12.0.1's
    did not), which flips one of layer 4's top-8 index picks for batch row 1 from position 31 on
    (its logits 0.82 off; session 46)."""
    multi_device.run_script(F32_SCRIPT % FIX, devices=1, timeout=600)


BF16_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"  # as the CLIs
""" + _LOAD + r"""opts = RunOptions(dtype="bfloat16", kv_cache_dtype="reference")
def run(ids, cache=None):
    B, S = ids.shape
    cache = init_cache(cfg, B, 128, opts) if cache is None else cache
    logits, cache, aux = forward_step_jit(params, cache, jnp.asarray(ids), jnp.full((B,), S, jnp.int32),
                                          cfg=cfg, opts=opts, return_aux=True)
    return np.asarray(logits, np.float32), [np.asarray(h, np.float32) for h in aux["resid"]], cache
ids = fx["input_ids"].astype(np.int32)
# the first token alone: every bf16 rounding, FP8 / FP4 fake-quant and the P.V weights as DeepSeek's
logits, resid, cache = run(ids[:, :1])
for l, want in enumerate(fx["resid_after_layer_bf16_first_token"]):
    assert np.array_equal(resid[l], want), ("first token, layer", l, float(np.mean(resid[l] != want)))
assert np.abs(logits - fx["logits_bf16_first_token"]).max() <= 1e-6 * np.abs(logits).max()
# then one token per step through the caches (FP8 window ring, compressor states, FP4 compressed KV,
# MXFP4 index keys) for positions 1..11, before the candidate selection's first bf16 tie (position 12:
# two blocks with equal maxima, which torch's and XLA's top-k break differently): measured 0 or 1 of
# the 512 elements of a layer's streams differing (summation order), never more
for t in range(1, 12):
    logits, resid, cache = run(ids[:, t:t + 1], cache)
    for l, want in enumerate(fx["resid_after_layer_bf16_decode"][t - 1]):
        assert np.mean(resid[l] != want) <= 0.01, ("decode position", t, "layer", l, float(np.mean(resid[l] != want)))
    want = fx["logits_bf16_decode"][:, t - 1]
    assert np.abs(logits[:, -1] - want).max() <= 1e-3 * np.abs(want).max(), ("decode position", t)
# the 48-token prefill: equal up to rounding flips from fp32 summation order, which the FP8 / FP4
# fake-quants then spread (measured: 0.01, 0.07, 0.17 percent of the elements after layers 0-2)
logits, resid, _ = run(ids)
shares = [float(np.mean(resid[l][0] != fx["resid_after_layer_b0_bf16"][l])) for l in range(3)]
assert shares[0] < 2e-3 and max(shares) < 1e-2, shares
print(shares, "OK")
"""


def test_bf16_matches_deepseeks_code_to_its_rounding():
    """bf16, the reference's numerics (the CLIs' XLA flags: no excess precision): the first token's
    residual streams after every layer are bit-identical to DeepSeek's code, so are the next 11
    decode steps' up to single-element summation flips, and in the 48-token
    prefill the first layers differ only in the rare elements that fp32 summation order flips (before
    session 35 the sparse attention's weights were rounded after normalising: 92.5 % of the first
    layer's elements differed, 18 % by more than 1 % of the largest)."""
    multi_device.run_script(BF16_SCRIPT % FIX, devices=1, timeout=600)
