"""The tiny V4-Flash model (tests/fixtures/v4_tiny_a: Hugging Face transformers 5.24.0
``deepseek_v4``, float32, official checkpoint names) on our V4 code path, in the HF comparison mode:
float32, unquantized KV (``kv_cache_dtype="float32"``) and no Hadamard rotation in the indexer
(``RunOptions(hadamard=False)``; transformers leaves it out). README tolerance: 1e-4 on logits.

Layers: 0 sliding-only + hash-routed MoE; 1, 3 CSA (ratio 4, overlapping compressor, own indexer);
2, 4 HCA (ratio 8, dense over complete blocks)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.cache import init_cache
from dsv41_jax.checkpoint import load_checkpoint, read_official
from dsv41_jax.options import RunOptions
from dsv41_jax.transformer import forward_step_jit

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "v4_tiny_a")
HF = RunOptions(dtype="float32", kv_cache_dtype="float32", hadamard=False)
CAP = 160  # cache capacity: 128 prompt + 16 generated + slack, a multiple of 4 and 8


@pytest.fixture(scope="module")
def fx():
    return {k: np.asarray(v) for k, v in read_official(os.path.join(FIX, "fixture.safetensors")).items()}


@pytest.fixture(scope="module")
def model():
    return load_checkpoint(FIX)


def _full(cfg, params, ids, opts):
    B, S = ids.shape
    cache = init_cache(cfg, B, CAP, opts)
    return forward_step_jit(params, cache, jnp.asarray(ids, jnp.int32), jnp.full((B,), S, jnp.int32),
                            cfg=cfg, opts=opts, return_aux=True)


@pytest.fixture(scope="module")
def hf_forward(model, fx):
    cfg, params = model
    logits, _, aux = _full(cfg, params, fx["input_ids"], HF)
    return np.asarray(logits), aux


def test_config_read_from_hf_deepseek_v4(model):
    cfg, params = model
    assert cfg.family == "v4" and cfg.is_v4
    assert cfg.compress_ratios == (0, 4, 8, 4, 8) and cfg.n_mtp_layers == 0
    assert cfg.kv_source_layers == (1, 2, 3, 4) and cfg.index_source_layers == (1, 3)
    assert cfg.n_hash_layers == 1 and cfg.rope_head_dim == 16 and cfg.window_size == 16
    assert cfg.original_seq_len == 4096 and cfg.rope_factor == 16.0 and cfg.compress_rope_theta == 160000.0
    assert cfg.norm_eps == 1e-6 and cfg.swiglu_limit == 1.5 and cfg.dtype == "bf16"
    g0, g1 = params["layers"]["0"]["ffn"]["gate"], params["layers"]["1"]["ffn"]["gate"]
    assert set(g0) == {"weight", "tid2eid"} and g0["tid2eid"].dtype == jnp.int32
    assert set(g1) == {"weight", "bias"}
    assert params["layers"]["1"]["attn"]["compressor"]["ape"].shape == (4, 2 * 64)  # overlap: coff = 2
    assert params["layers"]["2"]["attn"]["compressor"]["ape"].shape == (8, 64)
    assert params["layers"]["1"]["attn"]["indexer"]["compressor"]["wkv"]["weight"].shape == (2 * 32, 64)
    assert "indexer" not in params["layers"]["2"]["attn"]
    assert params["hc_head_fn"].shape == (4, 4 * 64)


def test_logits_every_position(hf_forward, fx):
    logits, _ = hf_forward
    err = np.abs(logits - fx["logits"])
    assert err.max() < 1e-4, f"max |dlogits| {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}"


def test_residual_streams_per_layer(hf_forward, fx):
    _, aux = hf_forward
    ref = fx["resid_after_layer_b0"]
    assert len(aux["resid"]) == ref.shape[0] == 5
    for l in range(ref.shape[0]):
        got = np.asarray(aux["resid"][l][0])
        err = np.abs(got - ref[l]).max()
        assert err < 1e-4 * max(1.0, np.abs(ref[l]).max()), f"layer {l}: residual error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(aux["hidden"]), np.asarray(aux["resid"][-1]))


def test_hash_layer_routes_by_token(hf_forward, fx, model):
    cfg, params = model
    _, aux = hf_forward
    _, idx = aux["routing"][0]
    table = np.asarray(params["layers"]["0"]["ffn"]["gate"]["tid2eid"])
    np.testing.assert_array_equal(np.asarray(idx), table[fx["input_ids"]])


def _step(cfg, params, cache, toks, lens, opts):
    return forward_step_jit(params, cache, jnp.asarray(toks, jnp.int32), jnp.asarray(lens, jnp.int32), cfg=cfg,
                            opts=opts, logits_mode="last")


def _prefill(cfg, params, ids, sched, opts, check=None):
    """Prefill row b along ids[b] by the chunk lengths sched[k] = (len_row0, len_row1), in 8-wide
    programs (idle rows and partial chunks included). check(b, pos, logits_row) after each chunk."""
    cache = init_cache(cfg, 2, CAP, opts)
    pos = [0, 0]
    for lens in sched:
        toks = np.zeros((2, 8), np.int64)
        for b in range(2):
            toks[b, :lens[b]] = ids[b, pos[b]:pos[b] + lens[b]]
        lg, cache = _step(cfg, params, cache, toks, lens, opts)
        for b in range(2):
            pos[b] += lens[b]
            if check is not None and lens[b]:
                check(b, pos[b], np.asarray(lg[b]))
    return cache, pos


def test_chunked_prefill_matches_full_forward(model, fx, hf_forward):
    """Irregular chunks from arbitrary positions (open overlap blocks, ratio-8 blocks and the
    16-token window crossing chunk boundaries; idle rows): last-token logits = the full forward's."""
    cfg, params = model
    full, _ = hf_forward
    sched = [(3, 8), (8, 1), (0, 5), (5, 7), (1, 0), (8, 2), (7, 8), (2, 8), (8, 3), (4, 6)]
    checked = []

    def check(b, pos, lg):
        np.testing.assert_allclose(lg, full[b, pos - 1], atol=1e-4, rtol=0, err_msg=f"row {b} pos {pos}")
        checked.append((b, pos))

    _, pos = _prefill(cfg, params, fx["input_ids"], sched, HF, check)
    assert pos == [46, 48] and len(checked) == 18


def test_cached_greedy_decode_reproduces_generate(model, fx):
    """The 128-token prompts (chunked prefill by 8), then 16 greedy single-token steps: HF's
    ``gen_ids`` token for token and ``step_logits`` within 1e-4."""
    cfg, params = model
    ids = fx["input_ids"]
    last = []
    cache, pos = _prefill(cfg, params, ids, [(8, 8)] * 16, HF, check=lambda b, p, lg: last.append(lg))
    assert pos == [128, 128]
    lg = np.stack(last[-2:])  # the last chunk's logits (position 127) produce generated token 0
    step_logits, gen = [lg], [lg.argmax(-1)]
    for _ in range(15):
        lg, cache = _step(cfg, params, cache, gen[-1][:, None], np.array([1, 1]), HF)
        step_logits.append(np.asarray(lg))
        gen.append(np.asarray(lg).argmax(-1))
    gen = np.stack(gen, 1)
    step_logits = np.stack(step_logits, 1)
    np.testing.assert_array_equal(gen, fx["gen_ids"])
    err = np.abs(step_logits - fx["step_logits"])
    assert err.max() < 1e-4, f"max |dstep_logits| {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}"


def test_engine_generates_gen_ids(model, fx):
    """The batched engine (slot reset, chunked prefill, sampling program) on the V4 model."""
    from dsv41_jax.engine import Engine, Request
    from dsv41_jax.model import Model

    cfg, params = model
    eng = Engine(Model(cfg, params), batch_size=2, max_seq_len=CAP, opts=HF, prefill_chunk=8)
    res = eng.generate([Request(fx["input_ids"][b], max_new_tokens=16) for b in range(2)], return_logits=True)
    for b, r in enumerate(res):
        assert r.output_ids == fx["gen_ids"][b].tolist()
        np.testing.assert_allclose(np.stack(r.logits), fx["step_logits"][b], atol=1e-4, rtol=0)


def test_hadamard_is_a_rounding_level_change_without_kv_rounding(model, fx, hf_forward):
    """The default (DeepSeek's reference) rotates indexer q and k by an orthonormal Hadamard; with
    unquantized index keys the scores, hence the picks and logits, stay the same up to float noise."""
    cfg, params = model
    ref, _ = hf_forward
    logits, _, _ = _full(cfg, params, fx["input_ids"], RunOptions(dtype="float32", kv_cache_dtype="float32"))
    assert np.abs(np.asarray(logits) - ref).max() < 1e-4


def test_reference_kv_rounding_runs_and_is_visible(model, fx, hf_forward):
    """Reference mode (FP8 nope dims, bf16 RoPE dims, MXFP4 index q/k after Hadamard): finite, and
    a perturbation of the unrounded model (no reference numbers exist for it: HF has no fake-quant)."""
    cfg, params = model
    ref, _ = hf_forward
    logits, _, _ = _full(cfg, params, fx["input_ids"], RunOptions(dtype="float32", kv_cache_dtype="reference"))
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    d = np.abs(logits - ref)
    assert d.max() > 1e-3  # the rounding is applied (routing flips make it chaotic: aggregate checks only)
    assert d.mean() < 0.25 * np.abs(ref).mean()  # measured: 0.12 vs 0.80
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() > 0.6  # measured: 0.84


def test_default_numerics_bf16_reference(model, fx):
    """The default run options (bfloat16 compute, DeepSeek's KV rounding, Hadamard on) through
    Model.forward: finite and mostly the same next-token choices as the float32 reference."""
    from dsv41_jax.model import Model

    cfg, params = model
    logits = np.asarray(Model(cfg, params).forward(fx["input_ids"]))
    assert logits.shape == fx["logits"].shape and np.isfinite(logits).all()
    assert (logits.argmax(-1) == fx["logits"].argmax(-1)).mean() > 0.6
