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


def _deepseek_dspark_topk_idxs(window, block, start_pos):
    """DeepSeek's ``get_dspark_topk_idxs`` (V4.1 inference/model.py) for one row, transcribed: the
    ring's slots 0 .. min(window, start_pos + 1) - 1, then the block's rows at window + i."""
    return np.concatenate([np.arange(min(window, start_pos + 1)), window + np.arange(block)]).astype(np.int32)


@pytest.mark.parametrize("window,block", [(128, 6), (16, 6)])
def test_stage_key_indices_are_deepseeks_list(window, block):
    """The stage attention's index list is DeepSeek's, padded with -1 at the end: DeepSeek's stage
    at ``start_pos`` has written position start_pos into its ring, so its block's first position is
    P = start_pos + 1. The order matters under 64-key blocks: checked with the attention itself below."""
    from dsv41_jax.dspark import stage_key_indices

    P = np.array([1, 2, 37, window - 1, window, window + 1, 5 * window + 3], np.int32)
    got = np.asarray(stage_key_indices(P, window, block))
    assert got.shape == (len(P), window + block)
    for row, p in zip(got, P):
        want = _deepseek_dspark_topk_idxs(window, block, int(p) - 1)
        np.testing.assert_array_equal(row[:len(want)], want)
        assert np.all(row[len(want):] == -1)


def test_stage_attention_rounds_as_deepseeks_blocks():
    """Under 64-key rounding the stage attention over our list equals the attention over DeepSeek's own
    list (``--attention-rounding kernel_blocks``), where the ring is not yet full (P < window): the
    list carries its -1 slots at the end, so the 64-key blocks hold DeepSeek's keys."""
    import jax.numpy as jnp

    from dsv41_jax.dspark import stage_key_indices
    from pallas_kernels.sparse_attention import reference

    rng = np.random.default_rng()
    window, block, h, d = 128, 6, 16, 64
    P = np.array([40, 100, 300], np.int32)
    q = jnp.asarray(rng.standard_normal((len(P), block, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((len(P), window + block, d)) * 2, jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    ours = jnp.broadcast_to(stage_key_indices(P, window, block)[:, None, :], (len(P), block, window + block))
    got = reference.sparse_attention(q, kv, ours, sink, scale=d ** -0.5, running_max_block=64)
    for b, p in enumerate(P):
        ds = np.broadcast_to(_deepseek_dspark_topk_idxs(window, block, int(p) - 1), (1, block, min(window, p) + block))
        want = reference.sparse_attention(q[b:b + 1], kv[b:b + 1], jnp.asarray(ds), sink, scale=d ** -0.5,
                                          running_max_block=64)
        np.testing.assert_array_equal(np.asarray(got[b:b + 1], np.float32), np.asarray(want, np.float32))
