"""The MI350X portability gate itself (``pallas_kernels.testing.lower_for``): it lowers for cuda and
rocm on a CPU host and runs the MLIR verifier on each Triton module."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.testing import lower_for


def test_lowering_gate_runs_the_triton_verifier():
    """``lower_for`` fails on a Triton module that the GPU's Triton would refuse although the
    lowering itself succeeds: a ``fori_loop`` with a traced trip count (``scf.for`` with bounds of
    mixed types; the H200 refused the first indexer prefill kernel for this, session 11)."""
    def kernel(n_ref, x_ref, o_ref):
        n = jnp.where(jnp.max(x_ref[...]) > 0, 4, 0)  # as the first indexer prefill kernel: a traced trip count
        o_ref[...] = jax.lax.fori_loop(0, n, lambda i, acc: acc + x_ref[...], jnp.zeros((16,), jnp.float32))

    def good(n_ref, x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, 4, lambda i, acc: acc + x_ref[...], jnp.zeros((16,), jnp.float32))

    specs = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.float32))
    for target in ("cuda", "rocm"):
        call = lambda k: (lambda n, x: pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32))(n, x))  # noqa: E731
        assert "triton" in lower_for(target, call(good), *specs).as_text()
        with pytest.raises(Exception, match="failed to verify"):
            lower_for(target, call(kernel), *specs)
