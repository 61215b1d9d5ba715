"""The sparse-attention and lightning-indexer kernels on V4-Flash's and V4-Pro's attention shapes.

V4 (issue 11) feeds these kernels other inputs than V4.1: its caches are plain arrays of rounded
values (``attention._store_v4``: FP8 non-RoPE dims + bf16 RoPE dims for the window and compressed KV,
MXFP4-rounded index keys and queries, all held in bf16), 64 indexer heads after a Hadamard rotation,
top-512 (Flash) or top-1024 (Pro) index lists, 64 or 128 attention heads, and dense lists over every
complete ratio-128 block in the HCA layers. Under ``auto`` on a GPU the indexer's prefill chunks take
the tile score kernel on these plain keys; decode and sparse attention keep their XLA references, but
``DSV41_KERNELS=pallas`` runs the kernels, so both must be right at these shapes.

Every case goes through the op's dispatch (``api``) with an explicit implementation, so a shape the
kernel would decline fails here with its reason instead of silently taking the reference:
``interpret`` on the CPU (CI: real head counts and widths, small contexts), and on a GPU
``JAX_PLATFORMS=cuda,cpu DSV41_TEST_KERNEL_IMPL=pallas`` compiles the same cases at real contexts (a
64K-token prompt's 16,384 CSA entries or 512 HCA blocks, 512-row attention and 4,096-row indexer
prefill chunks; ``JAX_DEFAULT_MATMUL_PRECISION=highest`` for the float32 reference). On an H100
(session 40) all 30 passed.

Tolerances: the inputs are exactly representable in bf16 (as V4's stores are), so the kernel and the
reference form the same products and differ in fp32 summation order (and, for bf16 attention, in
where the running maximum rounds the P.V weights; ``test_sparse_attention.TOL``). Float32 attention
checks the kernel and the reference each against a float64 oracle, every element within its own
first-order error bound (``_attention_float64``). Index top-k sets
are compared where the reference's scores leave a margin above that order's error at the k-th value.
"""

import os

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.attention import _store_v4, hadamard
from dsv41_jax.options import RunOptions
from pallas_kernels.lightning_indexer import api as indexer_api
from pallas_kernels.lightning_indexer import reference as indexer_reference
from pallas_kernels.sparse_attention import api as attention_api

from test_lightning_indexer import check_result
from test_sparse_attention import check_close

IMPL = os.environ.get("DSV41_TEST_KERNEL_IMPL", "interpret")
GPU = IMPL == "pallas"

# name: (attention heads, indexer top-k); both presets: D = 512 (64 RoPE), 64 indexer heads of 128
V4 = {"v4-flash": (64, 512), "v4-pro": (128, 1024)}
D, ROPE, HI, DI, WINDOW = 512, 64, 64, 128, 128


# V4's stored values, made by the model's own store (``attention._store_v4``, reference KV rounding):
# KV with FP8 e4m3 per 64 on the 448 non-RoPE dims and bf16 RoPE dims; index keys and queries
# Hadamard-rotated and rounded to MXFP4 (block 32); all held in bf16
_kv_values = jax.jit(lambda x: _store_v4(x, "comp", RunOptions(), ROPE))
_index_values = jax.jit(lambda x: _store_v4(hadamard(x), "index", RunOptions(), ROPE))


# ---------------------------------------------------------------------------------------------
# sparse attention


def _attention_case(rng, *, b, s, h, nc, kc, dense, dtype):
    """Query rows at the end of a long context: a full 128-slot window ring (row 0's ring still
    filling: its last slots -1), and compressed lists of ``kc`` distinct entries ascending with -1
    padding (CSA) or, ``dense``, every entry below a per-row count and -1 after it (HCA)."""
    q = jnp.asarray(rng.standard_normal((b, s, h, D), np.float32)).astype(dtype)
    kv = _kv_values(jnp.asarray(rng.standard_normal((b, WINDOW, D), np.float32)))
    ck = _kv_values(jnp.asarray(rng.standard_normal((b, nc, D), np.float32)))
    widx = np.broadcast_to(np.arange(WINDOW, dtype=np.int32), (b, s, WINDOW)).copy()
    widx[0, :, WINDOW - 37:] = -1
    if dense:
        counts = rng.integers(nc // 2, nc + 1, (b, s))
        cidx = np.where(np.arange(nc)[None, None] < counts[..., None], np.arange(nc, dtype=np.int32), -1)
    else:
        cidx = np.full((b, s, kc), -1, np.int32)
        for i in range(b):
            for j in range(s):
                n = int(rng.integers(kc * 3 // 4, kc + 1)) if (i, j) != (0, 0) else kc
                cidx[i, j, :n] = np.sort(rng.choice(nc, n, replace=False))
    sink = jnp.asarray(rng.standard_normal((h,), np.float32))
    if dtype == jnp.float32:
        kv, ck = kv.astype(jnp.float32), ck.astype(jnp.float32)
    return q, kv, jnp.asarray(widx), sink, ck, jnp.asarray(cidx.astype(np.int32))


def _attention(impl, q, kv, widx, sink, ck, cidx):
    return jax.jit(lambda *a: attention_api.sparse_attention(
        *a[:4], scale=D ** -0.5, comp_kv=a[4], comp_idx=a[5], implementation=impl))(q, kv, widx, sink, ck, cidx)


_F32_EPS = float(np.finfo(np.float32).eps) / 2  # float32 unit roundoff, 2**-24

# (rows per sequence, batch, compressed entries on the GPU / on the CPU)
ATT_SHAPES = {"decode": (1, 8, 16384, 96), "mtp_verify": (2, 4, 16384, 96), "prefill": (512, 1, 4096, 64)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("layer", ["csa", "hca"])
@pytest.mark.parametrize("shape", list(ATT_SHAPES))
@pytest.mark.parametrize("preset", list(V4))
def test_sparse_attention_v4(preset, shape, layer, dtype):
    """The kernel against the reference on V4's plain bf16 stores: every output element within the
    sparse-attention parity tolerance; the HCA lists are dense over every complete ratio-128 block
    (a 64K prompt's 512 on the GPU), the CSA lists the indexer's top-k with -1 padding."""
    h, topk = V4[preset]
    s, b, nc_gpu, nc_cpu = ATT_SHAPES[shape]
    if not GPU:  # interpret mode: real heads and widths, few rows and keys
        s, b = min(s, 16), min(b, 2)
    nc = nc_gpu if GPU else nc_cpu
    if layer == "hca":
        nc, kc = (512 if GPU else 40), None
    else:
        kc = topk if GPU else 48
    rng = np.random.default_rng()
    case = _attention_case(rng, b=b, s=s, h=h, nc=nc, kc=kc, dense=layer == "hca", dtype=dtype)
    want = _attention("reference", *case)
    got = _attention(IMPL, *case)
    assert got.shape == (b, s, h, D) and got.dtype == dtype
    if dtype == jnp.bfloat16:
        check_close(got, want)  # finite, within the sparse-attention parity tolerance (test_sparse_attention.TOL)
        return
    # float32: both against a float64 oracle, each element within its first-order error bound
    exact, cond, lcond = _attention_float64(*case, scale=D ** -0.5)
    bound = _F32_EPS * (4.0 * lcond + 16.0 * cond)
    for name, x in (("kernel", got), ("reference", want)):
        err = np.abs(np.asarray(x, np.float64) - exact)
        assert np.all(np.isfinite(err)), name
        worst = np.unravel_index(np.argmax(err - bound), err.shape)  # the largest excess
        assert np.all(err <= bound), (f"{name}: float32 output off the float64 oracle by {err[worst]:.3g} at "
                                      f"{worst}, bound {bound[worst]:.3g}")



def _attention_float64(q, kv, widx, sink, ck, cidx, *, scale):
    """Sparse attention in float64 (numpy) on the same stored values, per query row: the window keys
    then the compressed keys its lists pick (-1 skipped), the sink in the softmax's denominator, the
    keys as values. Also each output element's first-order float32 error scales:
    ``cond = sum_k p_k |v_k|`` (rounding the weights and the P.V sum, relative) and
    ``lcond = sum_k p_k L_k |v_k|`` with ``L_k = scale * sum_d |q_d k_d|`` (a logit's float32
    summation error is at most about ``L_k`` times the unit roundoff, and moves ``p_k`` by as much,
    relative).

    Why not the float32 reference alone: with D = 512 an output element that cancels (a weighted mean
    of keys of both signs) carries the logits' summation error relative to ``cond``, not to its own
    size or the output's maximum; one element in a million fell 1.4x outside the max-scaled tolerance
    in CI (v4-pro prefill CSA, 0.0100775 against 0.0100745). Against this oracle the float32
    reference's worst element was 1.3-2.2 eps * lcond and the kernel's 0.5-0.9 (16 draws, CPU), so
    the bound, 4 eps * lcond + 16 eps * cond, holds both with margin without loosening the test."""
    q, kv, ck, sink = (np.asarray(a, np.float64) for a in (q, kv, ck, sink))
    widx, cidx = np.asarray(widx), np.asarray(cidx)
    out, cond, lcond = (np.zeros_like(q) for _ in range(3))
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            rows = np.concatenate([kv[i, widx[i, j][widx[i, j] >= 0]], ck[i, cidx[i, j][cidx[i, j] >= 0]]])
            if len(rows) == 0:
                continue  # no key: output 0 (both implementations)
            logits = scale * q[i, j] @ rows.T  # [H, K]
            mag = scale * np.abs(q[i, j]) @ np.abs(rows).T
            m = logits.max(-1, keepdims=True)
            e = np.exp(logits - m)
            p = e / (e.sum(-1, keepdims=True) + np.exp(sink[:, None] - m))
            out[i, j], cond[i, j], lcond[i, j] = p @ rows, p @ np.abs(rows), (p * mag) @ np.abs(rows)
    return out, cond, lcond


# ---------------------------------------------------------------------------------------------
# lightning indexer


def _index_case(rng, *, b, s, nc, offsets):
    """Index queries and keys as V4 stores them, weights as the model scales them, and causal
    visibility for rows ending at ``offsets + s`` (ratio 4: entries j < (pos + 1) // 4)."""
    q = _index_values(jnp.asarray(rng.standard_normal((b, s, HI, DI), np.float32)))
    k = _index_values(jnp.asarray(rng.standard_normal((b, nc, DI), np.float32)))
    w = jnp.asarray((rng.standard_normal((b, s, HI)) * (DI ** -0.5 * HI ** -0.5)).astype(np.float32))
    pos = np.arange(s)[None, :] + np.asarray(offsets)[:, None]
    vis = jnp.asarray(np.minimum((pos + 1) // 4, nc).astype(np.int32))
    return q, w, k, vis


# (rows per sequence, batch, entries, position of row 0 per sequence) on the GPU / on the CPU
IDX_SHAPES = {"decode": ((1, 8, 16384, 65000), (1, 2, 300, 1100)),
              "mtp_verify": ((2, 4, 16384, 65000), (2, 2, 300, 1100)),
              "prefill": ((4096, 1, 4096, 12288), (64, 2, 200, 700))}


@pytest.mark.parametrize("shape", list(IDX_SHAPES))
@pytest.mark.parametrize("preset", list(V4))
def test_lightning_indexer_v4(preset, shape):
    """The indexer on V4's 64 rotated MXFP4-valued bf16 heads against the reference: top-k sets
    (k = 512 / 1,024 on the GPU, 48 on the CPU) where margins are clear, ascending with -1 padding.
    Prefill-sized calls (>= PREFILL_MIN_ROWS rows) run the tile score kernel -- what ``auto`` runs on
    a GPU for V4's prefill chunks -- decode-sized calls the streaming pipeline's plain-key loads."""
    _, topk = V4[preset]
    (s, b, nc, pos0) = IDX_SHAPES[shape][0 if GPU else 1]
    top_k = topk if GPU else 48
    rng = np.random.default_rng()
    offsets = [pos0 - s + 1 - 40 * i for i in range(b)]  # rows end near 4 * nc, some earlier
    q, w, k, vis = _index_case(rng, b=b, s=s, nc=nc, offsets=offsets)
    run = jax.jit(lambda impl, *a: indexer_api.lightning_indexer(*a, top_k=top_k, implementation=impl),
                  static_argnums=0)
    want = run("reference", q, w, k, vis)
    got = run(IMPL, q, w, k, vis)
    scores = jax.jit(indexer_reference.index_scores)(q, w, k, vis)
    # fp32 dots in another summation order than the reference's: sets compared above a 1e-5 margin
    assert check_result(got, want, scores, top_k, rel_slack=1e-5) >= max(1, b * s // 2)
