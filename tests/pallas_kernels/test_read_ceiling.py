"""The read-only streaming kernel behind ``quantized_matmul.benchmark --read-ceiling``: its word sums
equal XLA's bit for bit (so no load was dropped), it walks FP8 and MXFP4 weights in the words the fma
GEMV reads, refuses walks it cannot do by name, and lowers for cuda and rocm."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import read_ceiling as rc
from pallas_kernels.benchmarking import random_fp4, random_fp8
from pallas_kernels.testing import lower_for


@pytest.mark.parametrize("config", [(32, 8, 1, 4, 3), (16, 4, 2, 4, 1), (64, 16, 1, 8, 3), (32, 2, 4, 2, 2)])
def test_stream_read_sums_every_word(config):
    seed = np.random.SeedSequence().entropy % (2**31)
    words = jax.random.bits(jax.random.PRNGKey(seed), (64, 16, 8), jnp.uint32)
    y = rc.stream_read(words, config, interpret=True)
    splits = config[2]
    host = np.asarray(words, np.uint64).reshape(64, splits, -1).sum(axis=2) % 2**32
    np.testing.assert_array_equal(np.asarray(y, np.uint64), host.T, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(rc.reference(words, splits)), np.asarray(y))


def test_stream_read_sees_a_flipped_bit_in_any_word():
    """One flipped bit in a random word changes that row's sum in that K part and nothing else: every
    word is read, into the right sum."""
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, (32, 8, 8), dtype=np.uint32)
    base = np.asarray(rc.stream_read(jnp.asarray(words), (32, 4, 2, 4, 1), interpret=True))
    for _ in range(4):
        r, g, c = rng.integers(32), rng.integers(8), rng.integers(8)
        changed = words.copy()
        changed[r, g, c] ^= np.uint32(1 << int(rng.integers(32)))
        out = np.asarray(rc.stream_read(jnp.asarray(changed), (32, 4, 2, 4, 1), interpret=True))
        same = out == base
        assert not same[g // 4, r] and same.sum() == same.size - 1


def test_words_of_is_the_gemv_word_view():
    w8 = random_fp8(jax.random.PRNGKey(1), 64, 256)
    words = rc.words_of(w8)
    assert words.shape == (64, 8, 8) and words.dtype == jnp.uint32
    raw = np.asarray(jax.lax.bitcast_convert_type(w8.data, jnp.uint8)).reshape(64, 8, 8, 4).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(words), raw[..., 0] | raw[..., 1] << 8 | raw[..., 2] << 16 | raw[..., 3] << 24)
    w4 = random_fp4(jax.random.PRNGKey(2), (32, 512))
    assert rc.words_of(w4).shape == (32, 16, 4)
    with pytest.raises(TypeError, match="FP8 or MXFP4"):
        rc.words_of(jnp.zeros((4, 4)))


def test_stream_read_refuses_walks_it_cannot_do():
    words = jnp.ones((48, 16, 8), jnp.uint32)
    with pytest.raises(ValueError, match="N=48 must be a multiple of bn=32"):
        rc.stream_read(words, (32, 8, 1, 4, 3))
    with pytest.raises(ValueError, match="16 groups must split into 3"):
        rc.stream_read(jnp.ones((32, 16, 8), jnp.uint32), (32, 4, 3, 4, 3))
    with pytest.raises(ValueError, match="must be uint32"):
        rc.stream_read(jnp.ones((32, 16, 8), jnp.int32), (32, 8, 1, 4, 3))


def test_read_variants_start_with_the_gemv_walk():
    shape = (5120, 256, 8)  # wo_b's words
    walk = rc.gemv_walk(("fma", 32, 8, 4, 4, 3))
    vs = rc.variants(shape, walk)
    assert vs[0] == (32, 8, 4, 4, 3) and len(vs) == len(set(vs)) > 5
    assert all(rc.unsupported_reason(shape, v) is None for v in vs)


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_stream_read_lowers(target):
    spec = jax.ShapeDtypeStruct((64, 16, 8), jnp.uint32)
    assert "triton" in lower_for(target, lambda a: rc.stream_read(a, (32, 8, 1, 4, 3)), spec).as_text()
