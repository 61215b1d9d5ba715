"""The quantizers and the MoE references round like DeepSeek's even where XLA keeps excess precision.

XLA's GPU compiler may remove an ``f32 -> bf16 -> f32`` convert pair inside a fusion and hand the
consumer the unrounded float32 value (``xla_allow_excess_precision``, on by default). On the H200
that made the MoE reference at decode sizes 1.7e-2 away from the kernels, which round in-kernel
(BENCHMARKS.md, issue 11, session 18): one skipped bf16 rounding before an FP8 act-quant moves
about 1 in 30 e4m3 roundings by a step. The CPU backend keeps the pairs, so this module emulates
the GPU compiler: it evaluates a function's jaxpr with every such pair removed (through nested
``jit`` calls, which XLA inlines) and asks for the same bits as the ordinary evaluation. The
canary test shows that the emulation does remove a pair; without ``quant.exact_f32`` at the
quantizers' inputs and the SwiGLU's upcasts the other tests fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from dsv41_jax.quant import act_quant, fake_quant_fp4_e4m3, fake_quant_mxfp4, quantize_fp8, quantize_mxfp4
from pallas_kernels.moe import reference as moe_reference

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
_CALLS = ("jit", "pjit", "closed_call", "core_call")


def _eval_folded(jaxpr, consts, args, wide_args):
    """Evaluate ``jaxpr`` where ``convert(convert(v: f32) -> bf16) -> f32`` yields ``v`` itself.
    ``wide``: for a bf16 value made by such a convert, the float32 value it was rounded from."""
    env, wide = {}, {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    def read_wide(v):
        return None if isinstance(v, Literal) else wide.get(v)

    env.update(zip(jaxpr.constvars, consts))
    for v, a, w in zip(jaxpr.invars, args, wide_args):
        env[v], wide[v] = a, w
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        wides = [read_wide(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "convert_element_type":
            src, dst = jnp.dtype(eqn.invars[0].aval.dtype), jnp.dtype(eqn.params["new_dtype"])
            if src == BF16 and dst == F32 and wides[0] is not None:
                outs, out_wides = [wides[0]], [None]  # the pair removed: the unrounded f32
            else:
                outs = [eqn.primitive.bind(*vals, **eqn.params)]
                out_wides = [vals[0] if (src == F32 and dst == BF16) else None]
        elif name in _CALLS:
            sub = eqn.params["jaxpr"]
            outs, out_wides = _eval_folded(sub.jaxpr, sub.consts, vals, wides)
        else:
            outs = eqn.primitive.bind(*vals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            out_wides = [None] * len(outs)
        for v, o, w in zip(eqn.outvars, outs, out_wides):
            env[v], wide[v] = o, w
    return [read(v) for v in jaxpr.outvars], [read_wide(v) for v in jaxpr.outvars]


def folded(fn, *args):
    """``fn(*args)`` as XLA's GPU compiler with excess precision would compute it (emulated)."""
    closed = jax.make_jaxpr(fn)(*args)
    leaves = jax.tree.leaves(args)
    outs, _ = _eval_folded(closed.jaxpr, closed.consts, leaves, [None] * len(leaves))
    return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *args)), outs)


def _bits(tree):
    return [np.asarray(jax.lax.bitcast_convert_type(t, jnp.uint8) if t.dtype.itemsize == 1 else t).view(np.uint8)
            for t in jax.tree.leaves(tree)]


def assert_same_bits(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _input(rng, shape):
    """float32 values over a few binades whose bf16 rounding is never exact (so a skipped rounding
    shows) -- fresh per run."""
    v = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0) ** rng.integers(-3, 4, (shape[0], 1))
    return jnp.asarray(v * np.float32(1 + 2.0**-12))


def test_the_emulation_removes_a_convert_pair():
    v = _input(np.random.default_rng(), (4, 64))
    fn = lambda v: (v * 3.0).astype(jnp.bfloat16).astype(jnp.float32) * 0.5  # noqa: E731
    assert not np.array_equal(np.asarray(folded(fn, v)), np.asarray(fn(v)))
    np.testing.assert_array_equal(np.asarray(folded(fn, v)), np.asarray(v * 3.0 * 0.5))


@pytest.mark.parametrize("name,quantizer", [
    ("act_quant 32", lambda x: act_quant(x, 32)),
    ("act_quant 128", lambda x: act_quant(x, 128)),
    ("fake_quant_mxfp4", lambda x: fake_quant_mxfp4(x, 32)),
    ("fake_quant_fp4_e4m3", lambda x: fake_quant_fp4_e4m3(x, 16)),
    ("quantize_fp8", lambda x: quantize_fp8(x, (32, 32))),
    ("quantize_mxfp4", lambda x: quantize_mxfp4(x, 32)),
])
def test_quantizers_round_the_bf16_value(name, quantizer):
    """A quantizer fed a bf16 value computed in float32 quantizes that bf16 value, folded or not."""
    v = _input(np.random.default_rng(), (64, 256))
    fn = lambda v: quantizer((v * 1.5).astype(jnp.bfloat16))  # noqa: E731
    assert_same_bits(folded(fn, v), fn(v))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_moe_reference_under_excess_precision(fmt):
    """The routed experts' reference (decode-size gather path and the scan path) with its bf16 GEMM
    outputs, SwiGLU upcasts and h's act-quant: the same bits with the pairs removed."""
    rng = np.random.default_rng()
    e, i, d, n, k = 4, 64, 128, 3, 2
    q = (lambda w: quantize_fp8(w, (32, 32))) if fmt == "fp8" else (lambda w: quantize_mxfp4(w, 32))
    w1, w2, w3 = (q(jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.2)) for s in
                  ((e, i, d), (e, d, i), (e, i, d)))
    v = _input(rng, (n, d))
    wts = jnp.asarray(rng.uniform(0.05, 1.0, (n, k)).astype(np.float32))
    idx = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k].astype(np.int32))
    for path in ("gather", "scan"):
        fn = lambda v: moe_reference.moe_experts((v * 1.5).astype(jnp.bfloat16), wts, idx, w1, w2, w3,  # noqa: E731
                                                 swiglu_limit=1.0, act_block=32, path=path)
        assert_same_bits(folded(fn, v), fn(v))
