"""No f32 -> fp8 -> f32 convert pair in the model's programs.

XLA's GPU compiler removes a convert round trip inside a fusion when excess precision is allowed
(the default): on the H200 ``x.astype(float8_e4m3fn).astype(float32)`` came back unrounded for every
value (session 17, BENCHMARKS.md issue 11), which had made every XLA-side activation fake-quant a
no-op on the GPU. The quantizers now round on the bit pattern (``codecs.e4m3_round``); this test
scans the lowered forward of both generations (reference kernels, quantized KV) for any convert to
an 8-bit float whose result is converted again, which the GPU compiler could fold away. Converts
that store into a cache and reads of a cache are separated by the update and stay.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.cache import init_cache
from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions
from dsv41_jax.transformer import forward_step
from pallas_kernels import dispatch

_CONVERT = re.compile(r"(%[\w#.]+) = stablehlo\.convert (%[\w#.]+) : \(tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>")


def fp8_round_trips(text: str) -> list[str]:
    """Lines ``b = convert(a)`` where ``a`` is itself a convert into an 8-bit float type (per function)."""
    bad = []
    for func in text.split("func.func")[1:]:
        into_f8 = {}
        for m in _CONVERT.finditer(func):
            out, src, _, dst = m.groups()
            if src in into_f8:
                bad.append(f"{into_f8[src]} ; then {m.group(0)}")
            if dst.startswith("f8"):
                into_f8[out] = m.group(0)
    return bad


def test_scanner_finds_a_round_trip():
    text = jax.jit(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32)).lower(jnp.ones((4,), jnp.float32)).as_text()
    assert len(fp8_round_trips(text)) == 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-v4"])
def test_forward_has_no_fp8_convert_round_trip(preset):
    model = Model.from_preset(preset, seed=0)
    cfg = model.cfg
    opts = RunOptions(dtype="bfloat16")
    params = jax.eval_shape(lambda: model.params)
    toks = np.random.default_rng().integers(3, 500, (2, 8))
    eids = model.engram_ids(toks, np.broadcast_to(np.arange(8), (2, 8))) if cfg.engram_layer_ids else None
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 32, opts))
    with dispatch.use_implementation("reference"):
        text = jax.jit(lambda p, c, t, e: forward_step(p, c, t, jnp.full((2,), 8, jnp.int32), e, cfg=cfg, opts=opts)).lower(
            params, cache, jnp.asarray(toks, jnp.int32), eids).as_text()
    assert "stablehlo.convert" in text and re.search(r"xf8E4M3FN>", text)  # the scan sees the program's f8 data
    assert not fp8_round_trips(text), fp8_round_trips(text)[:5]
