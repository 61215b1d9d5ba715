"""Pure-jnp definition of mHC (``shared/spec/model.md`` §4.1-4.3), all in fp32.

``hc_mixes``: one RMS statistic over the flattened ``hc*D`` stream (no weight), the 24-wide
projection, then the split of DeepSeek's ``hc_split_sinkhorn`` kernel: ``pre = sigmoid + eps``,
``post = 2 sigmoid``, ``comb`` = row softmax + eps, a column normalisation, then ``iters - 1``
rounds of (row, column) normalisation, each dividing by ``sum + eps``. Exactly this truncated
schedule, not "to convergence".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.layers import rms_norm  # the model's RMSNorm: the next site's norm of the fused op


def hc_mixes(x, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters):
    hc = x.shape[-2]
    xf = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    m = jnp.einsum("...k,mk->...m", xf, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * r
    scale = scale.astype(jnp.float32)
    base = base.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*m.shape[:-1], hc, hc)
    c = jax.nn.softmax(logits, axis=-1) + hc_eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)
    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    # On a CPU a loop (not 19 unrolled copies in the HLO: compile time). On a GPU unrolled: each
    # iteration of an XLA while loop there waits for the host to read its condition (the indexer's
    # head loop left an H200 idle half of each decode step), and the reference path
    # (DSV41_KERNELS=reference, or shapes the kernels do not take) has two mHC sites per layer.
    unroll = jax.default_backend() not in ("cpu",)
    c = jax.lax.fori_loop(0, sinkhorn_iters - 1, round_, c, unroll=unroll)
    return pre, post, c


def hc_collapse(x, pre):
    """[..., hc, D] x [..., hc] -> [..., D] in x.dtype (fp32 multiply-add)."""
    y = jnp.sum(pre.astype(jnp.float32)[..., None] * x.astype(jnp.float32), axis=-2)
    return y.astype(x.dtype)


def hc_expand(f, residual, post, comb):
    """out[k] = post[k] * f + sum_j comb[j, k] * residual[j], fp32, -> f.dtype. comb rows = source."""
    y = post[..., :, None] * f.astype(jnp.float32)[..., None, :] + jnp.einsum(
        "...jk,...jd->...kd", comb, residual.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return y.astype(f.dtype)


def hc_expand_collapse(f, residual, post, comb, pre):
    """(h, y): h = hc_expand(f, residual, post, comb), y = hc_collapse(h, pre) (the next site's
    collapse of the expanded streams, as stored in f.dtype)."""
    h = hc_expand(f, residual, post, comb)
    return h, hc_collapse(h, pre)


def hc_expand_collapse_mixes(f, residual, post, comb, pre, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters,
                             y_norm=None):
    """(h, y, hc_mixes(h, fn, scale, base)) with (h, y) = :func:`hc_expand_collapse`; with
    ``y_norm = (weight, eps)`` y is returned RMS-normalized (the next site's input norm)."""
    h, y = hc_expand_collapse(f, residual, post, comb, pre)
    if y_norm is not None:
        y = rms_norm(y, *y_norm)
    return h, y, hc_mixes(h, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
