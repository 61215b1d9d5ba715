"""Live comparison with Hugging Face transformers' ``deepseek_v4`` (optional: skipped, with the
reason, when torch / transformers with DeepSeek-V4 are not installed; a skip covers nothing — the
committed fixture test ``tests/test_v4_fixture.py`` is what runs everywhere).

Writes fresh tiny official-named weights with ``tests/fixtures/make_v4_fixture.py`` (another seed
than the committed fixture), runs transformers on them, loads the same files with our checkpoint
loader and compares logits, residual streams and greedy generation in the HF comparison mode."""

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the live HF comparison needs torch (not installed)")
transformers = pytest.importorskip("transformers", reason="the live HF comparison needs transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM (needs >= 5.23)",
                allow_module_level=True)
pytest.importorskip("safetensors.torch", reason="the live HF comparison needs safetensors")

import jax.numpy as jnp  # noqa: E402

from dsv41_jax.cache import init_cache  # noqa: E402
from dsv41_jax.checkpoint import load_checkpoint, read_official  # noqa: E402
from dsv41_jax.options import RunOptions  # noqa: E402
from dsv41_jax.transformer import forward_step_jit  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "make_v4_fixture", os.path.join(os.path.dirname(__file__), "fixtures", "make_v4_fixture.py"))
make_v4_fixture = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_v4_fixture)


def test_live_against_transformers(tmp_path):
    out = str(tmp_path / "v4_live")
    make_v4_fixture.write(out, seed=11)
    fx = {k: np.asarray(v) for k, v in read_official(os.path.join(out, "fixture.safetensors")).items()}
    cfg, params = load_checkpoint(out)
    opts = RunOptions(dtype="float32", kv_cache_dtype="float32", hadamard=False)
    ids = fx["input_ids"]
    B, S = ids.shape
    logits, _, aux = forward_step_jit(params, init_cache(cfg, B, 160, opts), jnp.asarray(ids, jnp.int32),
                                      jnp.full((B,), S, jnp.int32), cfg=cfg, opts=opts, return_aux=True)
    assert np.abs(np.asarray(logits) - fx["logits"]).max() < 1e-4
    for l in range(cfg.n_layers):
        ref = fx["resid_after_layer_b0"][l]
        assert np.abs(np.asarray(aux["resid"][l][0]) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
