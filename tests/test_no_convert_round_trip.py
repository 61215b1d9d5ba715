"""No f32 -> fp8 -> f32 convert pair in the model's programs, and no f32 -> bf16 -> f32 pair in its
float32 programs.

XLA's GPU compiler removes a convert round trip inside a fusion when excess precision is allowed
(the default): on the H200 ``x.astype(float8_e4m3fn).astype(float32)`` came back unrounded for every
value (session 17, BENCHMARKS.md issue 11), which had made every XLA-side activation fake-quant a
no-op on the GPU. The quantizers now round on the bit pattern (``codecs.e4m3_round``); this test
scans the lowered forward of both generations (reference kernels, quantized KV) for any convert to
an 8-bit float whose result is converted again, which the GPU compiler could fold away. Converts
that store into a cache and reads of a cache are separated by the update and stay. In a float32
forward every bf16 round trip is a deliberate emulation of the reference's bf16 rounding (the fp32
head's three-way bf16 split lost its low parts this way on the GPU); those must use
``codecs.bf16_round`` too. (A bf16 forward's bf16 -> f32 converts of its bf16 activations are the
program's own dtype boundaries; XLA may keep excess precision there, which is its default.)
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


def round_trips(text: str, narrow=("f8",)) -> list[str]:
    """Lines ``b = convert(a)`` where ``a`` is itself a convert from f32 into a type starting with one
    of ``narrow`` (per function)."""
    bad = []
    for func in text.split("func.func")[1:]:
        into = {}
        for m in _CONVERT.finditer(func):
            out, src, frm, dst = m.groups()
            if src in into:
                bad.append(f"{into[src]} ; then {m.group(0)}")
            if frm == "f32" and dst.startswith(narrow):
                into[out] = m.group(0)
    return bad


def test_scanner_finds_a_round_trip():
    text = jax.jit(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32)).lower(jnp.ones((4,), jnp.float32)).as_text()
    assert len(round_trips(text)) == 1
    text = jax.jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)).lower(jnp.ones((4,), jnp.float32)).as_text()
    assert len(round_trips(text, ("bf16",))) == 1 and not round_trips(text)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-v4"])
def test_forward_has_no_convert_round_trip(preset, dtype):
    model = Model.from_preset(preset, seed=0)
    cfg = model.cfg
    opts = RunOptions(dtype=dtype)
    params = jax.eval_shape(lambda: model.params)
    toks = np.random.default_rng().integers(3, 500, (2, 8))
    eids = model.engram_ids(toks, np.broadcast_to(np.arange(8), (2, 8))) if cfg.engram_layer_ids else None
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 32, opts))
    with dispatch.use_implementation("reference"):
        text = jax.jit(lambda p, c, t, e: forward_step(p, c, t, jnp.full((2,), 8, jnp.int32), e, cfg=cfg, opts=opts)).lower(
            params, cache, jnp.asarray(toks, jnp.int32), eids).as_text()
    assert "stablehlo.convert" in text and re.search(r"xf8E4M3FN>", text)  # the scan sees the program's f8 data
    narrow = ("f8", "bf16") if dtype == "float32" else ("f8",)
    assert not round_trips(text, narrow), round_trips(text, narrow)[:5]
