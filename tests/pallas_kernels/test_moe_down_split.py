"""The fma down kernel's K split (the fma config's 11th entry, ``DSV41_MOE_DOWN=BD,W,S``):
interpret-mode parity with the reference and with the unsplit kernel on fresh random inputs, the
split sums added in order and rounded once, refusal of splits that do not divide the down K steps,
the dispatch's rule (small grids only, MXFP4 only), and cuda / rocm lowering at the real V4.1
expert shapes."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ShapeDtypeStruct as S

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
from pallas_kernels.moe import pallas_triton, reference
from pallas_kernels.quantized_matmul import pallas_triton_fma as fma
from pallas_kernels.testing import assert_split_close, jit_call as run, lower_for, random_moe_case

E, I, D, K = 8, 192, 128, 3  # I = 6 groups of 32: with kg_b 2 the down kernel runs 3 K steps

_reference = jax.jit(reference.moe_experts, static_argnames=("swiglu_limit", "act_block", "path"))


def make(fmt, seed, n, dtype, i_dim=I):
    return random_moe_case(fmt, seed, n, dtype, experts=E, inter=i_dim, dim=D, topk=K)


def config(w1, bt, dsplits, gate_up_splits=1):
    """The default config with two K groups per down step (3 steps), ``bt`` rows per block, 32 output
    rows per down program, the gate/up split and the down split."""
    cfg = list(pallas_triton.default_fma_config(w1))[:8]
    cfg[1], cfg[4], cfg[5] = bt, 32, 2
    return tuple(cfg) + (gate_up_splits, 4, dsplits)


# Same tolerance as the gate/up split's parity: same products, fp32 sums in another order (each
# split's sum, then the splits in order), the down output rounded once to x.dtype.
@pytest.mark.parametrize("fmt,n,bt,dsplits,gsplits,dtype", [
    ("fp4", 1, 1, 3, 1, jnp.bfloat16), ("fp4", 1, 1, 3, 2, jnp.float32), ("fp4", 2, 1, 3, 1, jnp.float32),
    ("fp4", 9, 4, 3, 1, jnp.bfloat16), ("fp8", 1, 1, 3, 1, jnp.float32),
])
def test_down_split_parity_interpret(fmt, n, bt, dsplits, gsplits, dtype):
    x, wts, idx, w1, w2, w3 = make(fmt, np.random.randint(1 << 30), n, dtype)
    kw = dict(swiglu_limit=1.0, interpret=True)
    if gsplits > 1:  # the gate/up split needs K steps it divides: one group per gate/up step (4 steps)
        cfg, cfg1 = (c[:3] + (1,) + c[4:] for c in (config(w1, bt, dsplits, gsplits), config(w1, bt, 1, gsplits)))
    else:
        cfg, cfg1 = config(w1, bt, dsplits), config(w1, bt, 1)
    assert pallas_triton.fma_reason(w1, cfg) is None, pallas_triton.fma_reason(w1, cfg)
    y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, config=cfg, **kw)
    y1 = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, config=cfg1, **kw)
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0)
    assert yr.shape == (n, D)
    assert_split_close(y, y1, yr, 2.0**-7 if dtype == jnp.bfloat16 else 1e-5)


def test_down_split_with_128_wide_activation_blocks_interpret():
    """V4's 128-wide activation blocks (V4-Pro's I = 3072 has 12 down K steps, which 3 splits
    divide): I = 384, 6 K steps of 2 groups, 3 splits; against the reference and the unsplit kernel."""
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), 1, jnp.float32, i_dim=384)
    cfg, cfg1 = config(w1, 1, 3), config(w1, 1, 1)
    assert pallas_triton.fma_reason(w1, cfg) is None
    kw = dict(swiglu_limit=1.0, act_block=128, interpret=True)
    y = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, config=cfg, **kw)
    y1 = run(pallas_triton.moe_experts, x, wts, idx, w1, w2, w3, config=cfg1, **kw)
    yr = _reference(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, act_block=128)
    assert_split_close(y, y1, yr, 1e-5)


def test_down_split_partials_sum_to_the_unsplit_down():
    """The split kernel's stored fp32 partials, added over the splits, are each pair's down GEMM of
    the kernel's own h (float32: exact up to the sum order; 1e-6), and ``deferred_sum.sum_splits``
    adds them in split order (then one rounding)."""
    x, wts, idx, w1, w2, w3 = make("fp4", np.random.randint(1 << 30), 1, jnp.float32)
    from pallas_kernels import deferred_sum

    got = {}
    real = deferred_sum.sum_splits

    def spy(parts):
        got["parts"] = parts
        return real(parts)

    import unittest.mock as mock

    with mock.patch.object(deferred_sum, "sum_splits", spy):
        y = pallas_triton.moe_experts(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, interpret=True,
                                      config=config(w1, 1, 3))  # eager: the spy sees the partials
    parts = np.asarray(got["parts"])
    assert parts.shape == (3, K + 1, D)
    y1 = pallas_triton.moe_experts(x, wts, idx, w1, w2, w3, swiglu_limit=1.0, interpret=True, config=config(w1, 1, 1))
    full = parts[0, :K] + parts[1, :K] + parts[2, :K]  # float32, in split order
    np.testing.assert_allclose(full.sum(0), np.asarray(y1)[0], rtol=1e-6, atol=1e-6 * np.abs(full).max())
    np.testing.assert_array_equal(np.asarray(y)[0], full.sum(0, dtype=np.float32))
    # each split reads only its own third of the K groups: its partial differs from the others
    assert not np.allclose(parts[0, :K], parts[1, :K])
    rng = np.random.default_rng(np.random.randint(1 << 30))
    p = jnp.asarray((rng.standard_normal((3, 4, 64)) * np.exp2(rng.integers(-8, 8, (3, 4, 64)))).astype(np.float32))
    want = ((np.asarray(p[0]) + np.asarray(p[1])) + np.asarray(p[2])).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: real(a).astype(jnp.bfloat16))(p)), want)


@pytest.mark.parametrize("splits,why", [(1, None), (3, None), (2, "down K split (2) must divide its 3 K steps"),
                                        (6, "down K split (6) must divide its 3 K steps"), (0, "down K split (0)")])
def test_down_split_reasons(splits, why):
    """A down split is refused, with the K steps named, unless it divides them; the config without an
    11th entry has none."""
    w1 = make("fp4", 0, 1, jnp.float32)[3]
    cfg = config(w1, 1, splits)
    reason = pallas_triton.fma_reason(w1, cfg)
    if why is None:
        assert reason is None and pallas_triton.fma_down_splits(cfg) == splits
    else:
        assert reason is not None and why in reason, reason
    assert pallas_triton.fma_down_splits(cfg[:10]) == 1


def test_default_down_split_rule(monkeypatch):
    """``DOWN_TILE["splits"]`` reaches the dispatch's config on small grids (one token), not on large
    ones (8 tokens), not where it does not divide the K steps (V4-Flash: I = 2048, 8 steps), and not
    for FP8 experts; with and without the gate/up split."""
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    monkeypatch.setattr(pallas_triton, "DOWN_TILE", pallas_triton._parse_down("64,4,3"))
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 64, 8, 4, 3, 2, 4, 3)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(8, 6)) == ("fma", 1, 32, 16, 64, 8, 4, 3)
    monkeypatch.setitem(pallas_triton.GATE_UP_SPLIT, "splits", 1)
    assert pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6)) == ("fma", 1, 16, 16, 64, 8, 4, 3, 1, 4, 3)
    v4 = Fp4Tensor(S((256, 2048, 4096 // 2), jnp.uint8), S((256, 2048, 4096 // 32), jnp.float8_e8m0fnu), 32)
    assert len(pallas_triton.default_fma_config(v4, 1.0, routing_shape=(1, 6))) == 8
    w8 = Fp8Tensor(S((e, i, d), jnp.float8_e4m3fn), S((e, i // 32, d // 32), jnp.float8_e8m0fnu), (32, 32))
    assert len(pallas_triton.default_fma_config(w8, 1.0, routing_shape=(1, 6))) == 8
    monkeypatch.setattr(pallas_triton, "DOWN_TILE", pallas_triton._parse_down("64,4,1"))
    assert len(pallas_triton.default_fma_config(w1, 1.0, routing_shape=(1, 6))) == 8


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_down_split_cross_lowering_real_shapes(target, monkeypatch):
    """At the real V4.1 expert shapes, one token, the default config with 3 down splits of the 9 K
    steps: one gate/up kernel, its finish, one down kernel (grid axis 2) and the x prologue."""
    e, i, d = 384, 2304, 5120
    w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32)
    w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32)
    monkeypatch.setitem(fma.DECODE_GEMV, "moe", "fma")
    monkeypatch.setattr(pallas_triton, "DOWN_TILE", pallas_triton._parse_down("64,4,3"))
    txt = lower_for(target, lambda x, w, idx, a, b, c: pallas_triton.moe_experts(x, w, idx, a, b, c, swiglu_limit=10.0),
                    S((1, d), jnp.bfloat16), S((1, 6), jnp.float32), S((1, 6), jnp.int32), w1, w2, w1).as_text()
    for name in ("moe_gate_up_fma_fp4", "moe_gate_up_finish", "moe_down_fma_fp4", "fma_act_quant"):
        assert txt.count(f'name = "{name}"') == 1, name


def test_with_down_splits_keeps_the_rest_of_the_config():
    _, _, _, w1, _, _ = make("fp4", 0, 1, jnp.float32)
    base = pallas_triton.default_fma_config(w1)  # 8 entries
    c = pallas_triton.with_down_splits(base, 3)
    assert c == base + (1, base[6], 3) and pallas_triton.fma_down_splits(c) == 3
    split = base + (2, 8)
    assert pallas_triton.with_down_splits(split, 3) == split + (3,)
    assert pallas_triton.with_down_splits(split + (3,), 1) == split + (1,)
    assert pallas_triton.fma_splits(c) == 1 and pallas_triton.fma_gate_up_warps(split + (3,)) == 8
