"""Tensor-parallel Pallas linears (``sharding.tensor_parallel``): on 4 virtual CPU devices (a
subprocess: the device count must be set before JAX is imported), mesh ``dp=2,tp=2``, kernels in
interpret mode: a column-parallel projection (``attn.wq_b``: N split) runs the kernel on each shard
with no collective and gives one device's result up to fp32 summation order; a row-parallel one (``attn.wo_b``: K
split) adds the fp32 partials with one psum (one device's result up to fp32 summation order); with
the XLA reference (plain ``auto`` on a CPU) nothing changes (GSPMD splits the dot itself)."""

from __future__ import annotations

from multi_device import run_script

SCRIPT = r'''
import dsv41_jax, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dsv41_jax.layers import linear
from dsv41_jax.quant import quantize_fp8
from pallas_kernels.dispatch import use_implementation
from sharding.mesh import make_mesh
from sharding.rules import use_mesh

rng = np.random.default_rng()
x = jnp.asarray(rng.normal(size=(2, 3, 256)), jnp.float32)
w = quantize_fp8(jnp.asarray(rng.normal(size=(256, 256)) * 0.05, jnp.float32))
mesh = make_mesh("dp=2,tp=2")

def f(path):
    return lambda x, w: linear(x, w, path=path)

for path, split in (("attn.wq_b", P("tp", None)), ("attn.wo_b", P(None, "tp"))):
    with use_implementation("interpret"):
        want = np.asarray(jax.jit(f(path))(x, w))
        with use_mesh(mesh):
            ws = jax.device_put(w, NamedSharding(mesh, split))
            jaxpr = str(jax.make_jaxpr(f(path))(x, ws))
            got = np.asarray(jax.jit(f(path))(x, ws))
    assert "shard_map" in jaxpr, path
    # a shard's GEMV may take another kernel configuration than one device's (3 rows per dp shard:
    # the fma GEMV; 6 rows on one device: the tensor-core GEMV; another K split): the same products,
    # fp32 sums in another order
    assert ("psum" in jaxpr) == (path == "attn.wo_b"), path
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # the XLA reference (auto on a CPU): left to GSPMD, no shard_map
    with use_mesh(mesh):
        assert "shard_map" not in str(jax.make_jaxpr(f(path))(x, ws))
print("OK")
'''


def test_tp_linears_run_the_kernel_per_shard():
    run_script(SCRIPT, devices=4, timeout=600)
