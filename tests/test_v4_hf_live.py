"""Live comparison with Hugging Face transformers' ``deepseek_v4`` on fresh weights (optional: a skip
covers nothing -- the committed fixture test ``tests/test_v4_fixture.py`` is what runs everywhere).

``tests/fixtures/make_v4_fixture.py`` writes tiny official-named weights (another seed than the
committed fixture) and transformers' logits, residual streams and greedy generation for them; our
checkpoint loader reads the same files and the model must reproduce all three in the HF comparison
mode (float32, no fake-quant, no Hadamard).

Two ways to run it:

* with torch and transformers (>= 5.23) installed beside JAX, the test writes the directory itself;
* with ``DSV41_HF_LIVE_DIR=<dir>`` set, it reads a directory that ``make_v4_fixture.py --out <dir>``
  wrote in another Python (torch's CPU build may exist only for another Python version than JAX's),
  and needs neither torch nor transformers here::

      python3.11 -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors numpy
      /tmp/hf/bin/python tests/fixtures/make_v4_fixture.py --out /tmp/v4_live --seed 11
      DSV41_HF_LIVE_DIR=/tmp/v4_live .venv/bin/python -m pytest -q tests/test_v4_hf_live.py
"""

import importlib.util
import json
import os

import numpy as np
import pytest

LIVE_DIR = os.environ.get("DSV41_HF_LIVE_DIR")
if not LIVE_DIR:
    torch = pytest.importorskip("torch", reason="the live HF comparison needs torch (not installed), or "
                                                "DSV41_HF_LIVE_DIR (see this module's docstring)")
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

HF = RunOptions(dtype="float32", kv_cache_dtype="float32", hadamard=False)
CAP = 160  # cache capacity: 128 prompt + 16 generated + slack (as tests/test_v4_fixture.py)
FILES = ("model.safetensors", "fixture.safetensors", "config.json", "versions.json")


def _live_dir(tmp_path) -> str:
    if LIVE_DIR:
        missing = [f for f in FILES if not os.path.exists(os.path.join(LIVE_DIR, f))]
        assert not missing, (f"DSV41_HF_LIVE_DIR={LIVE_DIR}: no {', '.join(missing)} there; write it with "
                             f"tests/fixtures/make_v4_fixture.py --out {LIVE_DIR}")
        return LIVE_DIR
    spec = importlib.util.spec_from_file_location(
        "make_v4_fixture", os.path.join(os.path.dirname(__file__), "fixtures", "make_v4_fixture.py"))
    make_v4_fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_v4_fixture)
    out = str(tmp_path / "v4_live")
    make_v4_fixture.write(out, seed=11)
    return out


def test_live_against_transformers(tmp_path):
    from dsv41_jax.engine import Engine, Request
    from dsv41_jax.model import Model

    out = _live_dir(tmp_path)
    versions = json.load(open(os.path.join(out, "versions.json")))
    print("transformers side:", versions)
    fx = {k: np.asarray(v) for k, v in read_official(os.path.join(out, "fixture.safetensors")).items()}
    cfg, params = load_checkpoint(out)
    ids = fx["input_ids"]
    B, S = ids.shape
    logits, _, aux = forward_step_jit(params, init_cache(cfg, B, CAP, HF), jnp.asarray(ids, jnp.int32),
                                      jnp.full((B,), S, jnp.int32), cfg=cfg, opts=HF, return_aux=True)
    err = np.abs(np.asarray(logits) - fx["logits"])
    assert err.max() < 1e-4, f"max |dlogits| {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}"
    for l in range(cfg.n_layers):
        ref = fx["resid_after_layer_b0"][l]
        assert np.abs(np.asarray(aux["resid"][l][0]) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), l
    # greedy generation through the engine (chunked prefill, cached decode): transformers' tokens and
    # the logits of every step (transformers generates with min_new_tokens, so through EOS: no stop ids)
    eng = Engine(Model(cfg, params), batch_size=B, max_seq_len=CAP, opts=HF, prefill_chunk=8, stop_ids=())
    n_new = fx["gen_ids"].shape[1]
    res = eng.generate([Request(ids[b], max_new_tokens=n_new) for b in range(B)], return_logits=True)
    for b, r in enumerate(res):
        assert r.output_ids == fx["gen_ids"][b].tolist(), b
        np.testing.assert_allclose(np.stack(r.logits), fx["step_logits"][b], atol=1e-4, rtol=0)
