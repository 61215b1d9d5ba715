"""DSpark draft forward against DeepSeek's reference (tests/fixtures/v41_tiny_a, README §4):
prefill 128 tokens (the stages only fill their window rings from main_x), then for each of the 16
greedy decode calls feed the token, take the target's features at that position and draft from the
anchor (argmax of that call's logits). Float32 with unquantized KV: draft ids exact, draft logits
(Markov bias included) and raw confidence logits within 2e-4.

The run goes through :class:`dsv41_jax.speculative.SpeculativeGenerator` with ``policy="fixed:0"``
(verify no drafts = plain one-token decode steps, in the gamma+1-wide program padded), whose step
program updates the DSpark rings with the fed token's features and drafts after it, exactly the
fixture's protocol. It shares its compiled programs with tests/test_speculative.py (same batch 2,
max_seq_len 160, prefill chunk 8)."""

import numpy as np
import pytest

from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions
from dsv41_jax.speculative import SpeculativeGenerator
from tests.test_model_fixture import FIX, read_fixture

F32 = RunOptions(dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def fx():
    return read_fixture()


@pytest.fixture(scope="module")
def model():
    return Model.from_checkpoint(FIX)


@pytest.fixture(scope="module")
def traced(model, fx):
    gen = SpeculativeGenerator(model, batch_size=2, max_seq_len=160, opts=F32, prefill_chunk=8, policy="fixed:0",
                               pad_width=True)
    trace = []
    out = gen.generate([list(p) for p in fx["input_ids"]], 17, trace=trace)
    return out, trace


def test_greedy_tokens_match_reference(traced, fx):
    out, _ = traced
    for b in range(2):
        assert out[b][:16] == fx["gen_ids_noquant"][b].tolist()


def test_draft_ids_logits_confidence_match_reference(traced, fx):
    _, trace = traced
    assert len(trace) == 17  # after the first token, then after each of the 16 decode steps
    for j in range(16):
        ids, logits, conf = trace[j + 1]
        np.testing.assert_array_equal(ids, fx["dspark_draft_ids_noquant"][j], err_msg=f"call {j}")
        np.testing.assert_allclose(conf, fx["dspark_confidence_noquant"][j], atol=2e-4, rtol=0, err_msg=f"call {j}")
        if j < 8:
            np.testing.assert_allclose(logits, fx["dspark_logits_noquant"][j], atol=2e-4, rtol=0, err_msg=f"call {j}")
