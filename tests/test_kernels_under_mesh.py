"""Pallas kernels under a mesh with automatic (GSPMD) axes run inside a ``shard_map`` on whole
operands (``pallas_kernels.dispatch.call_kernel``): on two H200s a real-width ``tp=2`` step with the
kernels called on split operands was wrong (BENCHMARKS.md, sharding). Checked on 4 virtual CPU
devices (a subprocess: the device count must be set before JAX is imported) with the kernels in
interpret mode: the traced program wraps every kernel call in a shard_map over the automatic axes
(none inside a shard_map that is already manual over them), and the results equal one device's."""

from __future__ import annotations

from multi_device import run_script

SCRIPT = r'''
import dsv41_jax, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dsv41_jax.quant import quantize_fp8
from pallas_kernels import dispatch
from pallas_kernels.mhc import hc_collapse
from pallas_kernels.quantized_matmul import quantized_matmul
from sharding.mesh import make_mesh
from sharding.rules import use_mesh

assert jax.device_count() == 4
rng = np.random.default_rng()
x = jnp.asarray(rng.normal(size=(3, 256)), jnp.float32)
w = quantize_fp8(jnp.asarray(rng.normal(size=(128, 256)) * 0.05, jnp.float32))
h = jnp.asarray(rng.normal(size=(1, 3, 4, 256)), jnp.float32)
pre = jnp.asarray(rng.uniform(size=(1, 3, 4)), jnp.float32)

def f(x, w, h, pre):
    y = quantized_matmul(x, w, implementation="interpret")
    c = hc_collapse(h, pre, implementation="interpret")
    return y, c

want = jax.jit(f)(x, w, h, pre)
mesh = make_mesh("dp=2,tp=2")
with use_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))  # output features split, like wq_b
    hs = jax.device_put(h, NamedSharding(mesh, P(None, None, None, "tp")))
    jaxpr = str(jax.make_jaxpr(f)(x, ws, hs, pre))
    got = jax.jit(f)(x, ws, hs, pre)
assert jaxpr.count("shard_map") == 2, jaxpr.count("shard_map")
for g, r in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))

# inside a shard_map that is manual over every axis (the expert-parallel MoE): no second wrapper
def inner(x, w):
    return quantized_matmul(x, w, implementation="interpret")
with use_mesh(mesh):
    sm = jax.shard_map(inner, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    jaxpr2 = str(jax.make_jaxpr(sm)(x, w))
    got2 = jax.jit(sm)(x, w)
assert jaxpr2.count("shard_map") == 1, jaxpr2.count("shard_map")
np.testing.assert_array_equal(np.asarray(got2), np.asarray(want[0]))
# no mesh: the kernel is called as it is
assert "shard_map" not in str(jax.make_jaxpr(f)(x, w, h, pre))

# the fused GEMV with a normalized output (wq_a + wkv with q_norm): its norm weight is an operand of
# the wrapped call, not a value the shard_map closes over; the results equal one device's
from pallas_kernels.quantized_matmul import quantized_matmul_multi
w2 = quantize_fp8(jnp.asarray(rng.normal(size=(64, 256)) * 0.05, jnp.float32))
nw = jnp.asarray(rng.uniform(0.5, 1.5, size=(128,)), jnp.float32)
def g(x, a, b, nw):
    return quantized_matmul_multi(x[:1], [a, b], norms=[nw, None], norm_eps=1e-6, implementation="interpret")
want3 = jax.jit(g)(x, w, w2, nw)
with use_mesh(mesh):
    jaxpr3 = str(jax.make_jaxpr(g)(x, ws, w2, nw))
    got3 = jax.jit(g)(x, ws, w2, nw)
assert jaxpr3.count("shard_map") == 1 and "qmm_split_finish" in jaxpr3, jaxpr3.count("shard_map")
for g_, r in zip(got3, want3):
    np.testing.assert_array_equal(np.asarray(g_), np.asarray(r))

# a deferred sum (wo_b's K parts) handed from one wrapped kernel to the next (the mHC expansion):
# a pytree through both shard_maps; the results equal one device's
from pallas_kernels.deferred_sum import DeferredSum
from pallas_kernels.mhc import hc_expand_collapse_mixes
x1 = jnp.asarray(rng.normal(size=(1, 1, 2048)), jnp.float32).astype(jnp.bfloat16)
wk = quantize_fp8(jnp.asarray(rng.normal(size=(256, 2048)) * 0.05, jnp.float32))
res = jnp.asarray(rng.normal(size=(1, 1, 4, 256)), jnp.float32).astype(jnp.bfloat16)
post = jnp.asarray(rng.uniform(0.5, 2.0, size=(1, 1, 4)), jnp.float32)
comb = jnp.asarray(rng.uniform(0.0, 0.5, size=(1, 1, 4, 4)), jnp.float32)
fn = jnp.asarray(rng.normal(size=(24, 1024)) * 0.05, jnp.float32)
sc, base = jnp.ones((3,), jnp.float32), jnp.zeros((24,), jnp.float32)
kinds = []
def site(x1, wk, res, post, comb, fn):
    f = quantized_matmul(x1, wk, implementation="interpret", defer=True)
    kinds.append(type(f).__name__)
    return hc_expand_collapse_mixes(f, res, post, comb, post, fn, sc, base, norm_eps=1e-6, hc_eps=1e-6,
                                    sinkhorn_iters=20, implementation="interpret")
want4 = jax.jit(site)(x1, wk, res, post, comb, fn)
with use_mesh(mesh):
    got4 = jax.jit(site)(x1, jax.device_put(wk, NamedSharding(mesh, P("tp", None))), res, post, comb, fn)
assert kinds == ["DeferredSum", "DeferredSum"], kinds
for g_, r in zip(jax.tree.leaves(got4), jax.tree.leaves(want4)):
    np.testing.assert_array_equal(np.asarray(g_, np.float32), np.asarray(r, np.float32))
print("OK")
'''


def test_kernels_run_on_whole_operands_under_a_mesh():
    run_script(SCRIPT, devices=4, timeout=600)


EP_ROWS_SCRIPT = r'''
import dsv41_jax, jax, jax.numpy as jnp, numpy as np
import pallas_kernels.moe as moe_pkg
from dsv41_jax.quant import quantize_mxfp4
from pallas_kernels.moe import pallas_triton
from sharding.expert_parallel import expert_parallel_moe
from sharding.mesh import make_mesh

assert jax.device_count() == 2
seen = []
real = moe_pkg.moe_experts
def spy(*a, **k):
    seen.append((jax.tree.leaves(a[3])[0].shape[0], k.get("routed_experts")))
    return real(*a, **k)
moe_pkg.moe_experts = spy
E, I, D, N, K = 8, 64, 128, 4, 2
rng = np.random.default_rng()
x = jnp.asarray(rng.normal(size=(N, D)), jnp.bfloat16)
w = jnp.asarray(rng.uniform(0.1, 1.0, size=(N, K)), jnp.float32)
idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
w1, w3 = (quantize_mxfp4(jnp.asarray(rng.normal(size=(E, I, D)) * 0.2, jnp.float32)) for _ in range(2))
w2 = quantize_mxfp4(jnp.asarray(rng.normal(size=(E, D, I)) * 0.2, jnp.float32))
want = real(x, w, idx, w1, w2, w3, swiglu_limit=10.0, implementation="reference")
for path in ("psum", "all_to_all"):
    seen.clear()
    got = jax.jit(lambda *a: expert_parallel_moe(*a, mesh=make_mesh("ep=2"), swiglu_limit=10.0, path=path,
                                                 implementation="interpret"))(x, w, idx, w1, w2, w3)
    assert seen and set(seen) == {(E // 2, E)}, (path, seen)  # 4 local experts; the pairs spread over all 8
    tol = 2.0**-7  # the kernels (interpret mode) against the reference in bf16
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * float(np.max(np.abs(want))))
# the estimate: 64 tokens x 6 over 384 experts on 2 shards (192 local) is 1 row per expert (fma), not 2
from jax import ShapeDtypeStruct as S
from dsv41_jax.quant import Fp4Tensor
loc = Fp4Tensor(S((192, 2304, 2560), jnp.uint8), S((192, 2304, 160), jnp.float8_e8m0fnu), 32, "f16pairs")
assert not pallas_triton.takes_fma(loc, 64 * 6) and pallas_triton.takes_fma(loc, 64 * 6, routed_experts=384)
print("OK")
'''


def test_expert_parallel_tells_the_kernels_how_many_experts_the_pairs_spread_over():
    """Under expert parallelism each shard's kernels see every pair with the other shards' as -1
    (psum path), or a worst-case buffer of ep x (tokens x k) slots, the empty ones as -1
    (all-to-all path): they are told the experts over all shards (``routed_experts``), so that the
    rows per local expert, which pick fma or tensor-core kernels and the tiling, are estimated as
    pairs / all experts (batch 64 over 384 experts on ep=2: 1 row, the fma kernels), and the
    kernels' result (interpret mode) equals one device's reference within the kernel tolerance."""
    run_script(EP_ROWS_SCRIPT, devices=2, timeout=600)
