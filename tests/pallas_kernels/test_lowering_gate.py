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


def test_lowering_gate_refuses_blocks_that_do_not_divide_their_arrays():
    """A [1, 8] block on an [N, 6] output: jax >= 0.12 masks its stores at the row's edge, jax 0.11.2
    (the H200's) does not, so columns 6-7 of row r land in columns 0-1 of row r + 1, racing with
    that row's program (session 24: ``moe_route``'s irreproducibility). ``lower_for`` refuses such a
    block whatever the installed JAX does, naming the operand; the same kernel on an [N, 8] output
    (the block divides the array) lowers."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def call(width):
        return lambda x: pl.pallas_call(
            kernel, grid=(4,), in_specs=[pl.BlockSpec((1, 8), lambda r: (r, 0))],
            out_specs=pl.BlockSpec((1, 8), lambda r: (r, 0)),
            out_shape=jax.ShapeDtypeStruct((4, width), jnp.float32))(x)

    spec = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    for target in ("cuda", "rocm"):
        assert "triton" in lower_for(target, call(8), spec).as_text()
        with pytest.raises(AssertionError, match=r"outputs: block \(1, 8\) on array \(4, 6\)"):
            lower_for(target, call(6), spec)
