"""mHC in Pallas-Triton: the mix coefficients (RMS over all hc*D, 24-wide projection, sigmoid /
Sinkhorn split) in one kernel (prefill) or two (decode: a split-K projection, then the split), the
collapse and the expansion in one kernel each.

Layout of the mix vector inside the kernels: the (2+hc)*hc = 24 mixes are padded to G*hc = 32
columns (G = next power of two >= 2+hc = 8 groups of hc): group 0 = pre, 1 = post, 2..hc+1 = the
hc x hc comb logits (row j = group 2+j), the rest padding; the sum of squares of x rides in the
first padding column. Pre, post and the Sinkhorn run on the [BT, G, hc] view with masks, so no
in-register slicing is needed (power-of-two arrays only, ``pallas_triton.md`` §3).

The projection ``fn @ x`` is fp32 in the reference. For bf16 x the kernel splits fn into three bf16
pieces (hi + mid + lo = fn to 24 bits) and runs three bf16 dots with fp32 accumulation: the products
are exact, so only the fp32 summation order differs. For f32 x it uses an fp32 (IEEE) dot.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.quantized_matmul.pallas_triton import next_pow2, pick_block

N_SM = 132
# Sinkhorn layout: "3d" ([BT, G, hc] view, axis reductions) or "2d" (0/1-matrix dots); read at trace time
SPLIT_MODE = "3d"


def _layout(hc: int):
    g = next_pow2(2 + hc)
    return g, g * hc, (2 + hc) * hc  # groups, padded width, mix count


def unsupported_reason(x, fn, *args):
    if x.ndim < 2:
        return f"x must be [..., hc, D], got shape {x.shape}"
    hc, d = x.shape[-2:]
    if hc & (hc - 1) or hc < 2:
        return f"hc={hc} must be a power of two >= 2"
    g, mp, mix = _layout(hc)
    if mp <= mix:
        return f"hc={hc}: no spare column for the RMS statistic ({mix} mixes in {mp})"
    if fn.shape != (mix, hc * d):
        return f"fn must be [{mix}, {hc * d}], got {fn.shape}"
    if d % 64:
        return f"D={d} must be a multiple of 64"
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        return f"x dtype must be bf16/f16/f32, got {x.dtype}"
    return None


def _proj(xt, fnt):
    """[BT, BK] x [MP, BK]^T in fp32 (three exact bf16 dots for 16-bit x, IEEE fp32 otherwise)."""
    dims = (((1,), (1,)), ((), ()))
    if xt.dtype == jnp.float32:
        return jax.lax.dot_general(xt, fnt, dims, precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32)
    xb = xt.astype(jnp.bfloat16)
    hi = fnt.astype(jnp.bfloat16)
    r1 = fnt - hi.astype(jnp.float32)
    mid = r1.astype(jnp.bfloat16)
    lo = (r1 - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    acc = jax.lax.dot_general(xb, hi, dims, preferred_element_type=jnp.float32)
    acc += jax.lax.dot_general(xb, mid, dims, preferred_element_type=jnp.float32)
    acc += jax.lax.dot_general(xb, lo, dims, preferred_element_type=jnp.float32)
    return acc


def _partial(x_ref, fn_ref, *, bk, steps, mix, mp, t):
    """Projection + sum of squares over this program's K range -> [BT, MP] (ssq in column mix).
    Padded rows of x (past T) and of fn (past mix) are loaded as zeros."""
    bt = x_ref.shape[0]
    xrow = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, bk), 0)
    xmask = xrow < t
    fmask = jax.lax.broadcasted_iota(jnp.int32, (mp, bk), 0) < mix

    def body(i, carry):
        acc, ssq = carry
        k0 = pl.multiple_of(i * bk, bk)
        xt = pltriton.load(x_ref.at[:, pl.ds(k0, bk)], mask=xmask, other=0)
        fnt = pltriton.load(fn_ref.at[:, pl.ds(k0, bk)], mask=fmask, other=0)
        xf = xt.astype(jnp.float32)
        return acc + _proj(xt, fnt), ssq + jnp.sum(xf * xf, axis=1)

    acc, ssq = jax.lax.fori_loop(0, steps, body, (jnp.zeros((bt, mp), jnp.float32), jnp.zeros((bt,), jnp.float32)))
    col = jax.lax.broadcasted_iota(jnp.int32, (bt, mp), 1)
    return jnp.where(col == mix, ssq[:, None], jnp.where(col < mix, acc, 0.0))


def _split2d(mraw, scale_ref, base_ref, *, hc, g, mp, mix, width, norm_eps, hc_eps, iters):
    """[BT, MP] raw projection (+ssq in column ``mix``) -> [BT, MP]: columns [0, hc) pre,
    [hc, 2hc) post, [2hc, mix) comb (row-major hc x hc), the rest 0.

    2-D ops only: the per-row (group of hc columns) and per-column (same column of every group)
    sums of the Sinkhorn are products with 0/1 [MP, MP] matrices in fp32 (IEEE dots)."""
    del g
    bt = mraw.shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (bt, mp), 1)
    ssq = jnp.sum(jnp.where(col == mix, mraw, 0.0), axis=1)
    r = jax.lax.rsqrt(ssq / width + norm_eps)
    m = jnp.where(col < mix, mraw, 0.0) * r[:, None]
    s0, s1, s2 = scale_ref[0], scale_ref[1], scale_ref[2]
    base = base_ref[...]
    bcol = jax.lax.broadcasted_iota(jnp.int32, base.shape, 0)
    base = jnp.where(bcol < mix, base, 0.0)
    sv = jnp.where(col < hc, s0, jnp.where(col < 2 * hc, s1, s2))
    z = m * sv + base[None, :]
    sig = jax.nn.sigmoid(z)
    is_c = (col >= 2 * hc) & (col < mix)
    ii = jax.lax.broadcasted_iota(jnp.int32, (mp, mp), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (mp, mp), 1)
    in_c = (ii >= 2 * hc) & (ii < mix) & (jj >= 2 * hc) & (jj < mix)
    same_row = jnp.where(in_c & (ii // hc == jj // hc), 1.0, 0.0).astype(jnp.float32)
    same_col = jnp.where(in_c & (ii % hc == jj % hc), 1.0, 0.0).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    def rows(c):
        return jnp.dot(c, same_row, precision=hi, preferred_element_type=jnp.float32)

    def cols(c):
        return jnp.dot(c, same_col, precision=hi, preferred_element_type=jnp.float32)

    zc = jnp.where(is_c, z, -jnp.inf)
    ex = jnp.where(is_c, jnp.exp(zc - jnp.max(zc, axis=1, keepdims=True)), 0.0)
    c = jnp.where(is_c, ex / jnp.where(is_c, rows(ex), 1.0) + hc_eps, 0.0)
    c = jnp.where(is_c, c / (cols(c) + hc_eps), 0.0)

    def sink(_, c):
        c = jnp.where(is_c, c / (rows(c) + hc_eps), 0.0)
        return jnp.where(is_c, c / (cols(c) + hc_eps), 0.0)

    c = jax.lax.fori_loop(0, iters - 1, sink, c)
    return jnp.where(col < hc, sig + hc_eps, jnp.where(col < 2 * hc, 2.0 * sig, c))


def _split3d(mraw, scale_ref, base_ref, *, hc, g, mp, mix, width, norm_eps, hc_eps, iters):
    """3-D variant: [BT, MP] -> [BT, G, hc] view (group 0 pre, 1 post, 2.. comb rows), returned as [BT, MP]."""
    bt = mraw.shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (bt, mp), 1)
    ssq = jnp.sum(jnp.where(col == mix, mraw, 0.0), axis=1)
    r = jax.lax.rsqrt(ssq / width + norm_eps)
    m = jnp.where(col < mix, mraw, 0.0) * r[:, None]
    s0, s1, s2 = scale_ref[0], scale_ref[1], scale_ref[2]
    base = base_ref[...]
    bcol = jax.lax.broadcasted_iota(jnp.int32, base.shape, 0)
    base = jnp.where(bcol < mix, base, 0.0)
    sv = jnp.where(col < hc, s0, jnp.where(col < 2 * hc, s1, s2))
    z = m * sv + base[None, :]
    sig = jax.nn.sigmoid(z)
    z3 = z.reshape(bt, g, hc)
    grp = jax.lax.broadcasted_iota(jnp.int32, (bt, g, hc), 1)
    valid = (grp >= 2) & (grp < 2 + hc)
    z3 = jnp.where(valid, z3, 0.0)
    ex = jnp.exp(z3 - jnp.max(z3, axis=2, keepdims=True))
    c = ex / jnp.sum(ex, axis=2, keepdims=True) + hc_eps
    c = jnp.where(valid, c, 0.0)
    c = c / (jnp.sum(c, axis=1, keepdims=True) + hc_eps)

    def sink(_, c):
        c = c / (jnp.sum(c, axis=2, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=1, keepdims=True) + hc_eps)

    c = jax.lax.fori_loop(0, iters - 1, sink, c)
    sig3 = sig.reshape(bt, g, hc)
    return jnp.where(grp == 0, sig3 + hc_eps, jnp.where(grp == 1, 2.0 * sig3, c)).reshape(bt, mp)


def _split(mraw, scale_ref, base_ref, **kw):
    return (_split3d if SPLIT_MODE == "3d" else _split2d)(mraw, scale_ref, base_ref, **kw)


def _mix_fused_kernel(x_ref, fn_ref, scale_ref, base_ref, o_ref, *, bk, steps, split_kw, t):
    mraw = _partial(x_ref, fn_ref, bk=bk, steps=steps, mix=split_kw["mix"], mp=split_kw["mp"], t=t)
    o_ref[...] = _split(mraw, scale_ref, base_ref, **split_kw)


def _mix_partial_kernel(x_ref, fn_ref, o_ref, *, bk, steps, mix, mp, t):
    o_ref[...] = _partial(x_ref, fn_ref, bk=bk, steps=steps, mix=mix, mp=mp, t=t)


def _mix_split_kernel(p_ref, scale_ref, base_ref, o_ref, *, n_split, split_kw):
    bt, mp = o_ref.shape[0], split_kw["mp"]
    if n_split & (n_split - 1) == 0 and n_split * bt * mp <= 16384:
        mraw = jnp.sum(p_ref[...], axis=0)
    else:
        mraw = jax.lax.fori_loop(0, n_split, lambda s, a: a + p_ref[s], jnp.zeros((bt, mp), jnp.float32))
    o_ref[...] = _split(mraw, scale_ref, base_ref, **split_kw)


def hc_mixes(x, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters, interpret=False, config=None):
    reason = unsupported_reason(x, fn)
    if reason is not None:
        raise ValueError(f"hc_mixes (pallas): {reason}")
    lead = x.shape[:-2]
    hc, d = x.shape[-2:]
    t = math.prod(lead)
    width = hc * d
    g, mp, mix = _layout(hc)
    xf = x.reshape(t, width)
    fn = fn.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    base = base.astype(jnp.float32)
    if config is None:
        bt = min(64, max(16, next_pow2(t)))
        n_t = -(-t // bt)
        bk = pick_block(width, 256)
        chunks = width // bk
        n_split = 1
        # split K (power of two) until the grid has ~N_SM/8 programs: the projection is small, the
        # split kernel then sums all partials with one load
        while n_t * n_split * 8 < N_SM and chunks % (n_split * 2) == 0 and n_split < 16:
            n_split *= 2
    else:
        bt, bk, n_split = config
    n_t = -(-t // bt)
    chunk = width // n_split
    steps = chunk // bk
    split_kw = dict(hc=hc, g=g, mp=mp, mix=mix, width=width, norm_eps=float(norm_eps), hc_eps=float(hc_eps),
                    iters=int(sinkhorn_iters))
    params = pltriton.CompilerParams(num_warps=4, num_stages=3)
    out_spec = pl.BlockSpec((bt, mp), lambda i, *_: (i, 0))
    out_shape = jax.ShapeDtypeStruct((t, mp), jnp.float32)
    scale_spec = pl.BlockSpec((3,), lambda *_: (0,))
    base_spec = pl.BlockSpec((mp,), lambda *_: (0,))
    if n_split == 1:
        out = pl.pallas_call(
            functools.partial(_mix_fused_kernel, bk=bk, steps=steps, split_kw=split_kw, t=t),
            out_shape=out_shape,
            grid=(n_t,),
            in_specs=[pl.BlockSpec((bt, width), lambda i: (i, 0)), pl.BlockSpec((mp, width), lambda i: (0, 0)),
                      scale_spec, base_spec],
            out_specs=out_spec,
            compiler_params=params,
            interpret=interpret,
            name="hc_mixes_fused",
        )(xf, fn, scale, base)
    else:
        part = pl.pallas_call(
            functools.partial(_mix_partial_kernel, bk=bk, steps=steps, mix=mix, mp=mp, t=t),
            out_shape=jax.ShapeDtypeStruct((n_split, t, mp), jnp.float32),
            grid=(n_t, n_split),
            in_specs=[pl.BlockSpec((bt, chunk), lambda i, s: (i, s)), pl.BlockSpec((mp, chunk), lambda i, s: (0, s))],
            out_specs=pl.BlockSpec((None, bt, mp), lambda i, s: (s, i, 0)),
            compiler_params=params,
            interpret=interpret,
            name="hc_mixes_partial",
        )(xf, fn)
        out = pl.pallas_call(
            functools.partial(_mix_split_kernel, n_split=n_split, split_kw=split_kw),
            out_shape=out_shape,
            grid=(n_t,),
            in_specs=[pl.BlockSpec((n_split, bt, mp), lambda i: (0, i, 0)), scale_spec, base_spec],
            out_specs=out_spec,
            compiler_params=params,
            interpret=interpret,
            name="hc_mixes_split",
        )(part, scale, base)
    pre = out[:, :hc].reshape(*lead, hc)
    post = out[:, hc : 2 * hc].reshape(*lead, hc)
    comb = out[:, 2 * hc : mix].reshape(*lead, hc, hc)
    return pre, post, comb


# --------------------------------------------------------------------------------------------------
# collapse and expand


def _rows_block(t: int, d: int):
    bt = min(8, next_pow2(t))
    bd = pick_block(d, 512 if bt <= 2 else 256)
    return bt, bd


def collapse_reason(x, pre):
    if x.ndim < 2 or pre.shape != x.shape[:-1]:
        return f"x [..., hc, D] and pre [..., hc] do not match: {x.shape} / {pre.shape}"
    hc, d = x.shape[-2:]
    if hc & (hc - 1):
        return f"hc={hc} must be a power of two"
    if d % 64:
        return f"D={d} must be a multiple of 64"
    return None


def expand_reason(f, residual, post, comb):
    if residual.ndim < 2:
        return f"residual must be [..., hc, D], got {residual.shape}"
    hc, d = residual.shape[-2:]
    lead = residual.shape[:-2]
    if f.shape != (*lead, d) or post.shape != (*lead, hc) or comb.shape != (*lead, hc, hc):
        return f"shapes do not match: f {f.shape}, residual {residual.shape}, post {post.shape}, comb {comb.shape}"
    if hc & (hc - 1):
        return f"hc={hc} must be a power of two"
    if d % 64:
        return f"D={d} must be a multiple of 64"
    return None


def _collapse_kernel(x_ref, pre_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    p = pre_ref[...].astype(jnp.float32)
    o_ref[...] = jnp.sum(x * p[:, :, None], axis=1).astype(o_ref.dtype)


def hc_collapse(x, pre, *, interpret=False):
    reason = collapse_reason(x, pre)
    if reason is not None:
        raise ValueError(f"hc_collapse (pallas): {reason}")
    lead = x.shape[:-2]
    hc, d = x.shape[-2:]
    t = math.prod(lead)
    bt, bd = _rows_block(t, d)
    y = pl.pallas_call(
        _collapse_kernel,
        out_shape=jax.ShapeDtypeStruct((t, d), x.dtype),
        grid=(-(-t // bt), d // bd),
        in_specs=[pl.BlockSpec((bt, hc, bd), lambda i, j: (i, 0, j)), pl.BlockSpec((bt, hc), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((bt, bd), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="hc_collapse",
    )(x.reshape(t, hc, d), pre.reshape(t, hc).astype(jnp.float32))
    return y.reshape(*lead, d)


def _expand_kernel(f_ref, r_ref, post_ref, comb_ref, o_ref, *, hc):
    f = f_ref[...].astype(jnp.float32)
    y = post_ref[...][:, :, None] * f[:, None, :]
    for j in range(hc):
        y += comb_ref[:, j, :][:, :, None] * r_ref[:, j, :].astype(jnp.float32)[:, None, :]
    o_ref[...] = y.astype(o_ref.dtype)


def hc_expand(f, residual, post, comb, *, interpret=False):
    reason = expand_reason(f, residual, post, comb)
    if reason is not None:
        raise ValueError(f"hc_expand (pallas): {reason}")
    lead = residual.shape[:-2]
    hc, d = residual.shape[-2:]
    t = math.prod(lead)
    bt, bd = _rows_block(t, d)
    y = pl.pallas_call(
        functools.partial(_expand_kernel, hc=hc),
        out_shape=jax.ShapeDtypeStruct((t, hc, d), f.dtype),
        grid=(-(-t // bt), d // bd),
        in_specs=[pl.BlockSpec((bt, bd), lambda i, j: (i, j)),
                  pl.BlockSpec((bt, hc, bd), lambda i, j: (i, 0, j)),
                  pl.BlockSpec((bt, hc), lambda i, j: (i, 0)),
                  pl.BlockSpec((bt, hc, hc), lambda i, j: (i, 0, 0))],
        out_specs=pl.BlockSpec((bt, hc, bd), lambda i, j: (i, 0, j)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="hc_expand",
    )(f.reshape(t, d), residual.reshape(t, hc, d), post.reshape(t, hc).astype(jnp.float32),
      comb.reshape(t, hc, hc).astype(jnp.float32))
    return y.reshape(*lead, hc, d)
