"""MXFP4 "f16pairs" packing (``dsv41_jax.quant.codecs.repack_f16pairs``): the same codes re-laid inside
each 32-bit word for the GPU decode. Exactness of the layout and its decode for every code at every
position, the tensor type, the engine's in-place repack of the routed experts, and that checkpoints
and sharding specs keep working with repacked trees (checkpoints always hold nibbles)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import (
    E2M1_VALUES,
    FP4_PACKINGS,
    Fp4Tensor,
    quantize_mxfp4,
    repack_f16pairs,
    unpack_f16pairs,
    with_fp4_packing,
)
from dsv41_jax.quant.codecs import F16PAIRS_MAG, F16PAIRS_SIGN
from dsv41_jax.quant.tensors import dotted_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _words(b):
    return np.asarray(b).reshape(-1, 4).view("<u4").reshape(-1)


def test_repack_is_a_bijection_on_random_bytes():
    rng = np.random.default_rng()
    raw = rng.integers(0, 256, (3, 5, 16), dtype=np.uint8)
    packed = np.asarray(repack_f16pairs(jnp.asarray(raw)))
    assert packed.shape == raw.shape and packed.dtype == np.uint8
    assert np.array_equal(np.asarray(unpack_f16pairs(jnp.asarray(packed))), raw)
    # a permutation of the bits inside each word: the population count of every word is kept
    pop = lambda a: np.unpackbits(np.asarray(a).reshape(-1, 4), axis=1).sum(1)  # noqa: E731
    assert np.array_equal(pop(packed), pop(raw))
    assert not np.array_equal(packed, raw)


@pytest.mark.parametrize("j", range(8))
def test_each_code_lands_at_its_documented_bits(j):
    """Code j alone in a word (every one of the 16 values): its sign at F16PAIRS_SIGN[j % 4] and its
    magnitude from F16PAIRS_MAG[j % 4], +16 for codes 4..7; nothing else set."""
    for c in range(16):
        word = np.array([c << (4 * j)], "<u4").view(np.uint8)
        got = int(_words(repack_f16pairs(jnp.asarray(word)))[0])
        h = 16 * (j // 4)
        want = ((c >> 3) << (F16PAIRS_SIGN[j % 4] + h)) | ((c & 7) << (F16PAIRS_MAG[j % 4] + h))
        assert got == want, (j, c, hex(got), hex(want))


@pytest.mark.parametrize("packing", FP4_PACKINGS)
def test_word_decode_is_exact_for_every_code_at_every_position(packing):
    """The fma kernels' word decode (pallas_triton_fma.fp4_word_pairs_f32, here on plain arrays):
    pair p = (code p, code p + 4) of each word, each e2m1 value * 2**-14, for all 16 codes in all
    8 positions (random words, so every position sees every code)."""
    from pallas_kernels.quantized_matmul.pallas_triton_fma import fp4_word_pairs_f32

    rng = np.random.default_rng()
    codes = np.concatenate([np.repeat(np.arange(16, dtype=np.uint8)[:, None], 8, axis=1),
                            rng.integers(0, 16, (240, 8), dtype=np.uint8)])  # [words, 8]
    rng.shuffle(codes, axis=1)
    nib = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(-1)  # element 2k low nibble
    data = jnp.asarray(nib) if packing == "nibbles" else repack_f16pairs(jnp.asarray(nib))
    words = jnp.asarray(_words(data))
    lut = np.concatenate([E2M1_VALUES, -E2M1_VALUES]) * np.float32(2.0**-14)
    for p, (lo, hi) in enumerate(fp4_word_pairs_f32(words, packing)):
        np.testing.assert_array_equal(np.asarray(lo), lut[codes[:, p]])
        np.testing.assert_array_equal(np.asarray(hi), lut[codes[:, p + 4]])


def test_fp4_tensor_packing():
    x = jax.random.normal(jax.random.PRNGKey(np.random.randint(1 << 30)), (3, 4, 96)) * 3
    t = quantize_mxfp4(x)
    r = t.with_packing("f16pairs")
    assert r.packing == "f16pairs" and r.shape == t.shape and r.with_packing("f16pairs") is r
    np.testing.assert_array_equal(np.asarray(r.dequantize()), np.asarray(t.dequantize()))
    np.testing.assert_array_equal(np.asarray(r.nibble_data()), np.asarray(t.data))
    np.testing.assert_array_equal(np.asarray(r.with_packing("nibbles").data), np.asarray(t.data))
    assert not np.array_equal(np.asarray(r.data), np.asarray(t.data))
    with pytest.raises(ValueError, match="packing must be one of nibbles, f16pairs, got 'f16'"):
        t.with_packing("f16")
    with pytest.raises(ValueError, match="packing must be one of"):
        Fp4Tensor(data=t.data, scale=t.scale, packing="bytes")
    with pytest.raises(ValueError, match=r"multiple of 4 bytes \(8 codes\), got shape \(2, 18\)"):
        repack_f16pairs(jnp.ones((2, 18), jnp.uint8))


def test_with_fp4_packing_converts_the_selected_nodes():
    k1, k2 = jax.random.split(jax.random.PRNGKey(np.random.randint(1 << 30)))
    tree = {"a": {"experts": {"w1": quantize_mxfp4(jax.random.normal(k1, (2, 8, 64)))},
                  "shared": quantize_mxfp4(jax.random.normal(k2, (8, 64)))}, "n": jnp.ones(3)}
    out = with_fp4_packing(tree, "f16pairs", only=lambda name, node: ".experts." in f".{name}.")
    assert out["a"]["experts"]["w1"].packing == "f16pairs" and out["a"]["shared"] is tree["a"]["shared"]
    assert out["n"] is tree["n"]
    back = with_fp4_packing(out, "nibbles")
    np.testing.assert_array_equal(np.asarray(back["a"]["experts"]["w1"].data), np.asarray(tree["a"]["experts"]["w1"].data))
    # donate: the converted node's old buffer is given up; the result still holds the same codes
    src = quantize_mxfp4(jax.random.normal(k1, (2, 8, 64)))
    want = np.asarray(src.dequantize())
    done = with_fp4_packing({"x": src}, "f16pairs", donate=True)["x"]
    np.testing.assert_array_equal(np.asarray(done.dequantize()), want)


def test_sharding_specs_keep_the_packing():
    from jax.sharding import PartitionSpec as P

    from sharding.rules import node_specs

    t = quantize_mxfp4(jnp.ones((4, 8, 64))).with_packing("f16pairs")
    spec = node_specs(t, (None, None, None), {})
    assert isinstance(spec, Fp4Tensor) and spec.packing == "f16pairs" and spec.data == P()
    assert jax.tree.structure(spec) == jax.tree.structure(t)


def test_checkpoints_hold_nibbles_when_the_params_are_repacked(tmp_path):
    """Orbax save and the official safetensors writer take params whose experts are repacked and
    write the nibble layout: what they write equals what the un-repacked params give, and restores
    as nibbles."""
    from dsv41_jax.checkpoint import load_checkpoint, restore_params, save_checkpoint, save_params
    from dsv41_jax.checkpoint.synthetic import random_params
    from dsv41_jax.config import get_preset

    cfg = get_preset("tiny")
    params = random_params(cfg, seed=np.random.randint(1 << 16))
    rep = with_fp4_packing(params, "f16pairs")
    assert {n.packing for n in jax.tree.leaves(rep, is_leaf=lambda x: isinstance(x, Fp4Tensor))
            if isinstance(n, Fp4Tensor)} == {"f16pairs"}
    save_params(rep, str(tmp_path / "orbax"), cfg)
    restored = restore_params(str(tmp_path / "orbax"), cfg)
    save_checkpoint(rep, cfg, str(tmp_path / "st"))
    _, loaded = load_checkpoint(str(tmp_path / "st"), cfg)
    for tree in (restored, loaded):
        a = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp4Tensor))
        b = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Fp4Tensor))
        fp4 = [(x, y) for x, y in zip(a, b) if isinstance(x, Fp4Tensor)]
        assert fp4 and all(y.packing == "nibbles" for _, y in fp4)
        for x, y in fp4:
            np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))


def test_engine_repacks_the_routed_experts_in_place():
    """Engine(expert_packing="f16pairs"): the engine's and the model's routed experts are repacked
    (the shared expert is FP8 and untouched), the old nibble buffers given up, and greedy decoding
    gives the tokens of the nibble engine; the packing goes back to nibbles for an engine that asks
    for them."""
    from dsv41_jax import Model
    from dsv41_jax.engine import Engine, Request
    from dsv41_jax.sampling import SamplingParams

    from dsv41_jax.params import init_params
    from tiny_short import tiny_short

    cfg = tiny_short(n_layers=3)  # the preset's first 3 layers: the routed experts in every layer
    model = Model(cfg, init_params(cfg, np.random.randint(1 << 16)))
    reqs = [Request(prompt_ids=[5, 6, 7, 8], max_new_tokens=3), Request(prompt_ids=[9, 10], max_new_tokens=3)]
    eng = Engine(model, batch_size=2, max_seq_len=32, prefill_chunk=8, expert_packing="nibbles")
    assert eng.expert_packing == "nibbles"
    want = [r.output_ids for r in eng.generate(reqs, SamplingParams(temperature=0.0))]
    old = model.params["layers"]["0"]["ffn"]["experts"]["w1"]
    eng = Engine(model, batch_size=2, max_seq_len=32, prefill_chunk=8, expert_packing="f16pairs")
    experts = model.params["layers"]["0"]["ffn"]["experts"]
    assert {w.packing for w in experts.values()} == {"f16pairs"}
    assert eng.params["layers"]["0"]["ffn"]["experts"]["w1"].packing == "f16pairs"
    assert old.data.is_deleted()  # donated: no second copy of the experts
    np.testing.assert_array_equal(np.asarray(experts["w1"].nibble_data()), np.asarray(experts["w1"].with_packing("nibbles").data))
    assert [r.output_ids for r in eng.generate(reqs, SamplingParams(temperature=0.0))] == want
    # back to nibbles for an engine that asks for them (construction only: the codes, not a decode)
    codes = np.asarray(experts["w1"].nibble_data())
    Engine(model, batch_size=2, max_seq_len=32, prefill_chunk=8, expert_packing="nibbles")
    back = model.params["layers"]["0"]["ffn"]["experts"]
    assert {w.packing for w in back.values()} == {"nibbles"} and experts["w1"].data.is_deleted()
    np.testing.assert_array_equal(np.asarray(back["w1"].data), codes)
    with pytest.raises(ValueError, match="expert packing 'f16' .*DSV41_EXPERT_PACKING.*auto, nibbles, f16pairs"):
        Engine(model, batch_size=2, max_seq_len=32, expert_packing="f16")


def test_auto_packing_follows_the_moe_dispatch(monkeypatch):
    from dsv41_jax.engine import expert_packing_for
    from pallas_kernels import dispatch

    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    assert expert_packing_for("auto") == ("f16pairs" if gpu else "nibbles")  # the CPU runs the references
    with dispatch.use_implementation("interpret"):
        assert expert_packing_for(None) == "f16pairs"
    monkeypatch.setenv("DSV41_KERNELS", "auto,moe_experts=interpret")
    assert expert_packing_for(None) == "f16pairs"
    monkeypatch.setenv("DSV41_EXPERT_PACKING", "nibbles")
    assert expert_packing_for(None) == "nibbles" and expert_packing_for("f16pairs") == "f16pairs"


def test_bench_expert_packings_flag():
    out = subprocess.run([sys.executable, "-m", "dsv41_jax.bench", "--expert-packings", "nibbles,f16"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "--expert-packings: 'nibbles,f16': expected a comma-separated list" in out.stderr


def test_f16_dots_refuses_routed_experts_outside_the_exact_window(monkeypatch):
    """DSV41_MMA_FP4=f16dots (the MoE kernels' float16 dot operands) is exact only for MXFP4 scales in
    2**-23 .. 2**1: ``f16_dots_reason`` passes the tiny model's routed experts, names the tensor whose
    scales leave the window, says nothing while the route is not forced; an Engine whose MoE runs the
    kernels refuses such experts with that message (instead of wrong rows)."""
    from dsv41_jax import Model
    from dsv41_jax.engine import Engine, f16_dots_reason
    from dsv41_jax.params import init_params
    from pallas_kernels import dispatch
    from pallas_kernels.moe import pallas_triton as moe_pt
    from tiny_short import tiny_short

    cfg = tiny_short(n_layers=3)  # routed experts in every layer, layer 1's altered below
    params = init_params(cfg, np.random.randint(1 << 16))
    monkeypatch.setitem(moe_pt.MMA_FP4, "route", "f16dots")
    assert f16_dots_reason(params) is None
    w1 = params["layers"]["1"]["ffn"]["experts"]["w1"]
    big = np.asarray(jax.lax.bitcast_convert_type(w1.scale, jnp.uint8)).copy()
    big.reshape(-1)[np.random.randint(big.size)] = 140  # one block at 2**13
    params["layers"]["1"]["ffn"]["experts"]["w1"] = Fp4Tensor(
        w1.data, jnp.asarray(big).view(jnp.float8_e8m0fnu), w1.block, w1.packing)
    reason = f16_dots_reason(params)
    assert "routed expert layers.1.ffn.experts.w1:" in reason and "140]" in reason
    assert "use DSV41_MMA_FP4=auto" in reason
    real = dispatch.resolve
    monkeypatch.setattr(dispatch, "resolve", lambda impl=None, op=None: "pallas" if op == "moe_experts" else real(impl, op))
    with pytest.raises(ValueError, match=r"DSV41_MMA_FP4=f16dots: routed expert layers.1.ffn.experts.w1: .*2\*\*-23"):
        Engine(Model(cfg, params), batch_size=2, max_seq_len=32, expert_packing="nibbles")
    monkeypatch.setitem(moe_pt.MMA_FP4, "route", "auto")
    assert f16_dots_reason(params) is None
    # under auto the Engine marks every routed expert whose scales allow the float16 read (session 44)
    # and leaves that one unmarked (bf16 reads) instead of refusing it; with the reference MoE none
    def marks(eng):
        return {dotted_path(path): node.f16_exact for path, node in
                jax.tree_util.tree_flatten_with_path(eng.params, is_leaf=lambda n: isinstance(n, Fp4Tensor))[0]
                if isinstance(node, Fp4Tensor) and ".experts." in dotted_path(path)}

    got = marks(Engine(Model(cfg, params), batch_size=2, max_seq_len=32, expert_packing="nibbles"))
    assert len(got) >= 3 * cfg.n_layers and not got["layers.1.ffn.experts.w1"]
    assert all(v for k, v in got.items() if k != "layers.1.ffn.experts.w1"), got
    monkeypatch.setattr(dispatch, "resolve", real)
    got = marks(Engine(Model(cfg, params), batch_size=2, max_seq_len=32, expert_packing="nibbles"))
    assert got and not any(got.values())
