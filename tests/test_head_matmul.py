"""transformer.head_matmul: fp32 logits from a bf16 head without an fp32 weight copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.transformer import head_matmul


@pytest.mark.parametrize("ydtype", [jnp.float32, jnp.bfloat16])
def test_head_matmul_equals_float64(ydtype):
    k = jax.random.PRNGKey(11)
    w = (jax.random.normal(k, (777, 384)) * 0.05).astype(jnp.bfloat16)
    y = (jax.random.normal(jax.random.fold_in(k, 1), (2, 5, 384)) * 3).astype(ydtype)
    out = np.asarray(head_matmul(y, w))
    assert out.dtype == np.float32 and out.shape == (2, 5, 777)
    ref = np.einsum("bsd,vd->bsv", np.asarray(y.astype(jnp.float32), np.float64),
                    np.asarray(w.astype(jnp.float32), np.float64))
    # fp32 rounding of a 384-term sum only (the bf16 split of an fp32 y is exact)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_head_matmul_fp32_weight_path():
    k = jax.random.PRNGKey(12)
    w = jax.random.normal(k, (64, 32))
    y = jax.random.normal(jax.random.fold_in(k, 1), (3, 32))
    ref = np.asarray(y, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(head_matmul(y, w)), ref, rtol=1e-5, atol=1e-5)
