"""mHC in Pallas-Triton (V4.1: hc = 4, D = 5120): the mix coefficients (one RMS over all hc*D,
the 24-wide projection, sigmoid / Sinkhorn split) in one kernel (prefill) or two (decode: a split-K
projection, then the split), the collapse and the expansion in one kernel each.

The 24 mix rows of ``fn`` are read as two in-bounds 16-row tiles: rows 0..15 (pre in 0..3, post in
4..7) and rows 8..23 (the 4x4 comb logits), so nothing is padded or masked. Pre/post are computed on
the first tile with column masks; the Sinkhorn runs on the [BT, 4, 4] view of the second (axis
reductions). Decode (T <= 8) uses one row per program and exact fp32 FMAs for the projection; larger
T uses 16/64-row tiles and, for bf16 x, three bf16 dots against fn split into hi + mid + lo (exact
products, fp32 accumulation; IEEE fp32 dots for f32 x).

At decode sizes the expansion is fused with the next site's collapse, mix partial sums and RMSNorm
statistics (:func:`hc_expand_collapse_mixes`, two kernels per site). Its layer output ``f`` may come
unsummed (:class:`~pallas_kernels.deferred_sum.DeferredSum`: a GEMV's K parts, the MoE's slot rows);
the kernel then sums it on its own columns. It issues every load before its first use and runs 2
warps per program (:data:`EXPAND_MIX`; 6.55 -> 3.62 us at one row on the H200, session 27).

Layout rule learned on the H200 (jax 0.11.2): no partial (bounds-masked) blocks and no squeezed
block dims; rows are padded by XLA where needed and every ref is indexed in bounds.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.deferred_sum import DeferredSum, sum_splits
from pallas_kernels.quantized_matmul.pallas_triton import pick_block
from pallas_kernels.triton_compat import TRITON_OFFSETS_PATCHED  # noqa: F401  (applies the fix)



def unsupported_reason(x, fn, *args):
    if x.ndim < 2:
        return f"x must be [..., hc, D], got shape {x.shape}"
    hc, d = x.shape[-2:]
    if hc != 4:
        return f"hc={hc}: the kernel is written for hc = 4 (mix rows 0..15 and 8..23 as two 16-row tiles)"
    mix = (2 + hc) * hc
    if fn.shape != (mix, hc * d):
        return f"fn must be [{mix}, {hc * d}], got {fn.shape}"
    if d % 64:
        return f"D={d} must be a multiple of 64"
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        return f"x dtype must be bf16/f16/f32, got {x.dtype}"
    return None


def auto_reason(op: str):
    """Plain 'auto' uses every mHC kernel: hc_mixes, hc_collapse and hc_expand matched the reference
    on an H200 at T = 1, 8, 64 and 300 (BENCHMARKS.md, mHC); hc_expand_collapse at T = 1, 8, 64, 300
    and hc_expand_collapse_mixes at T = 1 and 8 for D = 5120, 4096 and 7168 (session 16), the latter
    two timed faster than the kernels they replace (4.0 vs 5.1 us and 13.4 vs 14.4 us at one row)."""
    del op
    return None


def _proj(xt, fnt):
    """[BT, BK] x [R, BK]^T in fp32 (three exact bf16 dots for 16-bit x, IEEE fp32 otherwise)."""
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


def _partial(x_ref, fn_ref, t0, kbase, *, bt, bk, steps, hc):
    """Over this program's K range: a = x . fn[0:16]^T, b = x . fn[2hc:2hc+hc*hc]^T ([bt, 16] each)
    and ss = sum x^2 ([bt]). All loads are in bounds (no masks). bt == 1 (decode: no row padding)
    uses exact fp32 FMAs and carries the per-lane products [16, bk] through the loop, reduced over K
    once after it: a reduction over K inside the loop is a cross-warp reduction (barriers) per step,
    which made the decode kernel latency-bound (36 us at 8 rows on the H200, session 8)."""
    rows = pl.ds(t0, bt)

    def load(i):  # x [bt, bk] as stored, fn rows [16, bk] and [hc*hc, bk]
        k0 = pl.multiple_of(kbase + i * bk, bk)
        return (x_ref[rows, pl.ds(k0, bk)], fn_ref[pl.ds(0, 16), pl.ds(k0, bk)],
                fn_ref[pl.ds(2 * hc, hc * hc), pl.ds(k0, bk)])

    if bt == 1:
        def lanes(i, carry):
            a, b, ss = carry
            xt, fa, fb = load(i)
            xf = xt.astype(jnp.float32)
            return a + fa * xf, b + fb * xf, ss + xf * xf

        z = jnp.zeros((16, bk), jnp.float32)
        a, b, ss = jax.lax.fori_loop(0, steps, lanes, (z, z, jnp.zeros((1, bk), jnp.float32)))
        return jnp.sum(a, axis=1)[None, :], jnp.sum(b, axis=1)[None, :], jnp.sum(ss, axis=1)

    def body(i, carry):
        a, b, ss = carry
        xt, fa, fb = load(i)
        xf = xt.astype(jnp.float32)
        return a + _proj(xt, fa), b + _proj(xt, fb), ss + jnp.sum(xf * xf, axis=1)

    z = jnp.zeros((bt, 16), jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (z, z, jnp.zeros((bt,), jnp.float32)))


def _columns(x, k: int, hc: int):
    """Columns [k*hc, (k+1)*hc) of x [bt, 16] as [bt, hc] (Triton has no slices of a register tile:
    a masked sum over the 16 / hc groups, exact -- one term, the rest zeros)."""
    g = x.reshape(x.shape[0], 16 // hc, hc)
    return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, g.shape, 1) == k, g, 0.0), axis=1)


def _split(a, b, ss, scale_ref, base_ref, *, hc, width, norm_eps, hc_eps, iters):
    """(a, b, ss) -> (pre [bt, hc], post [bt, hc], C [bt, hc*hc] comb). pre and post are separate
    outputs so that the next kernel reads them as they are: as columns of one [T, 16] array they
    were two XLA slices per site, which XLA runs as two device copies (memcpy) before the next
    custom call (session 25: 160 of the batch-1 step's 170 copies, 0.17 ms)."""
    bt = a.shape[0]
    r = jax.lax.rsqrt(ss / width + norm_eps)[:, None]
    s0, s1, s2 = scale_ref[0], scale_ref[1], scale_ref[2]
    col = jax.lax.broadcasted_iota(jnp.int32, (bt, 16), 1)
    za = a * r * jnp.where(col < hc, s0, s1) + base_ref[pl.ds(0, 16)][None, :]
    sa = jax.nn.sigmoid(za)
    pp = jnp.where(col < hc, sa + hc_eps, jnp.where(col < 2 * hc, 2.0 * sa, 0.0))
    zb = (b * r * s2 + base_ref[pl.ds(2 * hc, hc * hc)][None, :]).reshape(bt, hc, hc)
    ex = jnp.exp(zb - jnp.max(zb, axis=2, keepdims=True))
    c = ex / jnp.sum(ex, axis=2, keepdims=True) + hc_eps
    c = c / (jnp.sum(c, axis=1, keepdims=True) + hc_eps)

    def sink(_, c):
        c = c / (jnp.sum(c, axis=2, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=1, keepdims=True) + hc_eps)

    c = jax.lax.fori_loop(0, iters - 1, sink, c)
    return _columns(pp, 0, hc), _columns(pp, 1, hc), c.reshape(bt, hc * hc)


def _mix_fused_kernel(x_ref, fn_ref, scale_ref, base_ref, pre_ref, post_ref, c_ref, *, bt, bk, steps, split_kw):
    t0 = pl.multiple_of(pl.program_id(0) * bt, bt)
    a, b, ss = _partial(x_ref, fn_ref, t0, 0, bt=bt, bk=bk, steps=steps, hc=split_kw["hc"])
    pre, post, c = _split(a, b, ss, scale_ref, base_ref, **split_kw)
    pre_ref[pl.ds(t0, bt), :] = pre
    post_ref[pl.ds(t0, bt), :] = post
    c_ref[pl.ds(t0, bt), :] = c


def _mix_partial_kernel(x_ref, fn_ref, pa_ref, pb_ref, ps_ref, *, bt, bk, steps, hc):
    t0 = pl.multiple_of(pl.program_id(0) * bt, bt)
    sp = pl.program_id(1)
    a, b, ss = _partial(x_ref, fn_ref, t0, sp * (steps * bk), bt=bt, bk=bk, steps=steps, hc=hc)
    pa_ref[sp, pl.ds(t0, bt), :] = a
    pb_ref[sp, pl.ds(t0, bt), :] = b
    ps_ref[sp, pl.ds(t0, bt)] = ss


def _sum_over_splits(load, n_split: int):
    """The sum over axis 0 (the K splits) of each array of ``load(splits)`` (a tuple, ``splits`` a
    ``pl.ds`` over the first axis), read in power-of-two groups of splits (Triton's block shapes)
    and summed over the groups."""
    grp = min(n_split & -n_split, 64)

    def part(i):
        sp = pl.ds(i * grp if isinstance(i, int) else pl.multiple_of(i * grp, grp), grp)
        return tuple(jnp.sum(v, axis=0) for v in load(sp))

    if grp == n_split:
        return part(0)
    if n_split // grp <= 8:  # unrolled: every group's loads issue before the first sum waits on them
        acc = part(0)
        for i in range(1, n_split // grp):
            acc = tuple(u + v for u, v in zip(acc, part(i)))
        return acc
    return jax.lax.fori_loop(1, n_split // grp, lambda i, c: tuple(u + v for u, v in zip(c, part(i))), part(0))


def _mix_split_kernel(pa_ref, pb_ref, ps_ref, scale_ref, base_ref, pre_ref, post_ref, c_ref, *, bt, n_split, split_kw):
    _mix_split_rows(pl.multiple_of(pl.program_id(0) * bt, bt), pa_ref, pb_ref, ps_ref, scale_ref, base_ref,
                    (pre_ref, post_ref, c_ref), bt=bt, n_split=n_split, split_kw=split_kw)


def _mix_split_rows(t0, pa_ref, pb_ref, ps_ref, scale_ref, base_ref, out_refs, *, bt, n_split, split_kw):
    """The split kernel's work for rows [t0, t0 + bt): (pre, post, comb) into ``out_refs``."""
    rows = pl.ds(t0, bt)
    a, b, ss = _sum_over_splits(lambda sp: (pa_ref[sp, rows, :], pb_ref[sp, rows, :], ps_ref[sp, rows]), n_split)
    for ref, v in zip(out_refs, _split(a, b, ss, scale_ref, base_ref, **split_kw)):
        ref[rows, :] = v


def _mix_config(t: int, width: int):
    """(bt, bk, n_split): one row per program for decode (T <= 8), 16/64-row dot tiles otherwise;
    K split (power of two) so that a decode site has ~256 programs (dot tiles: ~32). On the H200
    (session 8) at 8 rows: 16 splits 13.9 us, 32 splits 11.7 us; at 1 row 32 splits (the most that
    divide 160 K blocks) 10.9 us. (Session 14: 80 or 160 splits halve the partial kernel but cost
    the split kernel more than that.) The split kernel's warps: :func:`_split_warps`."""
    if t <= 8:
        bt, bk = 1, pick_block(width, 128)
    else:
        bt, bk = (16 if t <= 256 else 64), pick_block(width, 128)
    n_t = -(-t // bt)
    chunks = width // bk
    n_split = 1
    target = 256 if bt == 1 else 32
    while n_t * n_split < target and chunks % (n_split * 2) == 0 and n_split * 2 * bt * 16 <= 8192:
        n_split *= 2
    return bt, bk, n_split


def _split_warps(bt: int) -> int:
    """Warps of the split kernel (the 20-round Sinkhorn on each row's 4 x 4 matrix, a chain of small
    reductions): one for one-row programs, 4.57 -> 3.66 us at 1 row on the H200 (session 14)."""
    return 1 if bt == 1 else 4


def hc_mixes(x, fn, scale, base, *, norm_eps, hc_eps, sinkhorn_iters, interpret=False, config=None):
    reason = unsupported_reason(x, fn)
    if reason is not None:
        raise ValueError(f"hc_mixes (pallas): {reason}")
    lead = x.shape[:-2]
    hc, d = x.shape[-2:]
    t = math.prod(lead)
    width = hc * d
    xf = x.reshape(t, width)
    fn = fn.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    base = base.astype(jnp.float32)
    bt, bk, n_split, *rest = config or _mix_config(t, width)
    split_warps = rest[0] if rest else _split_warps(bt)  # an optional 4th config entry
    if width % (bk * n_split):
        raise ValueError(f"hc_mixes (pallas): config {(bt, bk, n_split)}: the width {width} (hc x D) must split into "
                         f"{n_split} parts of whole {bk}-wide K blocks")
    tp = -(-t // bt) * bt
    if tp != t:
        xf = jnp.pad(xf, ((0, tp - t), (0, 0)))
    steps = width // n_split // bk
    split_kw = dict(hc=hc, width=width, norm_eps=float(norm_eps), hc_eps=float(hc_eps), iters=int(sinkhorn_iters))
    params = pltriton.CompilerParams(num_warps=4, num_stages=3)
    out_shape = _mixes_shapes(tp, hc)
    if n_split == 1:
        pre, post, c = pl.pallas_call(
            functools.partial(_mix_fused_kernel, bt=bt, bk=bk, steps=steps, split_kw=split_kw),
            out_shape=out_shape, grid=(tp // bt,), compiler_params=params, interpret=interpret,
            name="hc_mixes_fused",
        )(xf, fn, scale, base)
    else:
        pa, pb, ps = pl.pallas_call(
            functools.partial(_mix_partial_kernel, bt=bt, bk=bk, steps=steps, hc=hc),
            out_shape=(jax.ShapeDtypeStruct((n_split, tp, 16), jnp.float32),
                       jax.ShapeDtypeStruct((n_split, tp, hc * hc), jnp.float32),
                       jax.ShapeDtypeStruct((n_split, tp), jnp.float32)),
            grid=(tp // bt, n_split), compiler_params=params, interpret=interpret, name="hc_mixes_partial",
        )(xf, fn)
        pre, post, c = _split_call(pa, pb, ps, scale, base, bt=bt, split_kw=split_kw, warps=split_warps,
                                   interpret=interpret)
    return _unpack_mixes(pre, post, c, lead, hc)


def _mixes_shapes(tp: int, hc: int):
    """The mix kernels' outputs: pre [T, hc], post [T, hc], comb [T, hc*hc] (f32)."""
    return tuple(jax.ShapeDtypeStruct((tp, w), jnp.float32) for w in (hc, hc, hc * hc))


def _split_call(pa, pb, ps, scale, base, *, bt, split_kw, warps, interpret):
    """hc_mixes' split kernel over the K-split partial sums ([n_split, T, .]): (pre [T, hc],
    post [T, hc], c [T, hc*hc])."""
    n_split, tp, _ = pa.shape
    return pl.pallas_call(
        functools.partial(_mix_split_kernel, bt=bt, n_split=n_split, split_kw=split_kw),
        out_shape=_mixes_shapes(tp, split_kw["hc"]),
        grid=(tp // bt,), interpret=interpret, name="hc_mixes_split",
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
    )(pa, pb, ps, scale, base)


def _unpack_mixes(pre, post, c, lead, hc):
    """(pre, post, comb) of the first prod(lead) rows of the split kernel's outputs (no slice when
    there are no pad rows)."""
    t = math.prod(lead)
    if pre.shape[0] != t:
        pre, post, c = pre[:t], post[:t], c[:t]
    return pre.reshape(*lead, hc), post.reshape(*lead, hc), c.reshape(*lead, hc, hc)


# --------------------------------------------------------------------------------------------------
# collapse and expand


def _rows_block(t: int, d: int):
    bt = 8
    while t % bt:  # a divisor of T: no partial (masked) row blocks
        bt //= 2
    bd = pick_block(d, 512 if bt <= 2 else 256)
    return bt, bd


def _site_layout(op: str, reason: str | None, streams):
    """Raise ``op``'s unsupported ``reason`` (if any); else (lead dims, hc, D, T rows, row block,
    column block) of the streams [..., hc, D]."""
    if reason is not None:
        raise ValueError(f"{op} (pallas): {reason}")
    lead = streams.shape[:-2]
    hc, d = streams.shape[-2:]
    t = math.prod(lead)
    return (lead, hc, d, t, *_rows_block(t, d))


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


def _collapse_block(x, p):
    """sum_k p[:, k] * x[:, k, :] in fp32 for a block x [bt, hc, bd] (any float dtype), p [bt, hc]."""
    return jnp.sum(x.astype(jnp.float32) * p.astype(jnp.float32)[:, :, None], axis=1)


def _collapse_kernel(x_ref, pre_ref, o_ref):
    o_ref[...] = _collapse_block(x_ref[...], pre_ref[...]).astype(o_ref.dtype)


def hc_collapse(x, pre, *, interpret=False):
    lead, hc, d, t, bt, bd = _site_layout("hc_collapse", collapse_reason(x, pre), x)
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


def _expand_loads(r_ref, post_ref, comb_ref, hc, rows=slice(None), cols=slice(None)):
    """The expansion's inputs of rows ``rows`` and columns ``cols`` of the refs (the whole block by
    default): (post [bt, hc], [comb[:, j, :] for j], [residual stream j [bt, bd] fp32 for j])."""
    return (post_ref[rows, :], [comb_ref[rows, j, :] for j in range(hc)],
            [r_ref[rows, j, cols].astype(jnp.float32) for j in range(hc)])


def _expand_values(f, loads):
    """The expanded streams [bt, hc, bd] (fp32): post * f + sum_j comb[j] * residual[j] in this order;
    ``f`` the layer output's values [bt, bd] (fp32), ``loads`` from :func:`_expand_loads`."""
    post, combs, rs = loads
    y = post[:, :, None] * f[:, None, :]
    for c, r in zip(combs, rs):
        y += c[:, :, None] * r[:, None, :]
    return y


def _expand_block(f, r_ref, post_ref, comb_ref, hc, rows=slice(None), cols=slice(None)):
    """The expanded streams [bt, hc, bd] (fp32) of rows ``rows`` and columns ``cols`` of the refs
    (the whole block by default): :func:`_expand_values` of :func:`_expand_loads`."""
    return _expand_values(f, _expand_loads(r_ref, post_ref, comb_ref, hc, rows, cols))


def _pick(x, j: int, axis: int):
    """x's index j along ``axis`` as a masked sum (Triton has no slices of a register tile): exact,
    one term and zeros."""
    return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, axis) == j, x, 0.0), axis=axis)


def _expand_tiles(f, r, post, comb):
    """:func:`_expand_block`'s streams (the same operations in the same order) from tiles loaded
    whole: f [bt, bd], r [bt, hc, bd] (fp32), post [bt, hc], comb [bt, hc, hc]. One load per operand
    instead of one per stream (:func:`_expand_mix_kernel`)."""
    y = post[:, :, None] * f[:, None, :]
    for j in range(r.shape[1]):
        y += _pick(comb, j, 1)[:, :, None] * _pick(r, j, 1)[:, None, :]
    return y


def _expand_kernel(f_ref, r_ref, post_ref, comb_ref, o_ref, *, hc):
    o_ref[...] = _expand_block(f_ref[...].astype(jnp.float32), r_ref, post_ref, comb_ref, hc).astype(o_ref.dtype)


def hc_expand(f, residual, post, comb, *, interpret=False):
    lead, hc, d, t, bt, bd = _site_layout("hc_expand", expand_reason(f, residual, post, comb), residual)
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


def _expand_collapse_kernel(f_ref, r_ref, post_ref, comb_ref, pre_ref, o_ref, y_ref, *, hc):
    h = _expand_block(f_ref[...].astype(jnp.float32), r_ref, post_ref, comb_ref, hc).astype(o_ref.dtype)
    o_ref[...] = h
    # the collapse of the stored (rounded) streams, as hc_collapse would read them back
    y_ref[...] = _collapse_block(h, pre_ref[...]).astype(y_ref.dtype)


def expand_collapse_reason(f, residual, post, comb, pre):
    reason = expand_reason(f, residual, post, comb)
    if reason is None and pre.shape != post.shape:
        reason = f"pre {pre.shape} must have the shape of post {post.shape}"
    return reason


def hc_expand_collapse(f, residual, post, comb, pre, *, interpret=False):
    """(hc_expand(f, residual, post, comb), hc_collapse(of that, pre)) in one kernel: the expanded
    streams [..., hc, D] in f.dtype and their collapse [..., D] in f.dtype. One launch and no
    read-back of the streams instead of two kernels."""
    lead, hc, d, t, bt, bd = _site_layout("hc_expand_collapse", expand_collapse_reason(f, residual, post, comb, pre), residual)
    h, y = pl.pallas_call(
        functools.partial(_expand_collapse_kernel, hc=hc),
        out_shape=(jax.ShapeDtypeStruct((t, hc, d), f.dtype), jax.ShapeDtypeStruct((t, d), f.dtype)),
        grid=(-(-t // bt), d // bd),
        in_specs=[pl.BlockSpec((bt, bd), lambda i, j: (i, j)),
                  pl.BlockSpec((bt, hc, bd), lambda i, j: (i, 0, j)),
                  pl.BlockSpec((bt, hc), lambda i, j: (i, 0)),
                  pl.BlockSpec((bt, hc, hc), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((bt, hc), lambda i, j: (i, 0))],
        out_specs=(pl.BlockSpec((bt, hc, bd), lambda i, j: (i, 0, j)), pl.BlockSpec((bt, bd), lambda i, j: (i, j))),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="hc_expand_collapse",
    )(f.reshape(t, d), residual.reshape(t, hc, d), post.reshape(t, hc).astype(jnp.float32),
      comb.reshape(t, hc, hc).astype(jnp.float32), pre.reshape(t, hc).astype(jnp.float32))
    return h.reshape(*lead, hc, d), y.reshape(*lead, d)


# --------------------------------------------------------------------------------------------------
# the expansion, the next collapse and the next site's mix coefficients (decode sizes)

MIX_FUSED_MAX_T = 8  # rows: one row per program, as hc_mixes' decode configuration
MIX_FUSED_BD = 64  # columns of every stream per program: D / 64 programs per row, as many K splits
# How the expansion kernel is written (trace time): "tiles" "stream" (one load per residual stream
# and comb row) or "whole" (one load each, _expand_tiles); "order" "uses" (loads beside their uses,
# stores as soon as computed: up to session 26) or "loads" (every load first, stores last); "warps"
# per program (4 up to session 26). The sm_90 SASS of the old kernel issued its ~50 loads in ~15
# groups, each waiting for the last (ptxas reuses the registers; no load moves above a store).
# H200, one row, D 5120, L2 flushed (session 27, .gpu/expand_variants.py, device time of the kernel,
# f as an array / as the MoE's deferred pieces): stream/uses/4 6.55 / 7.90 us; stream/loads/4 6.65 /
# 7.93; whole/loads/4 3.48 / 3.81 (the mix partials' bits differ: another reduction layout);
# **stream/loads/2 3.62 / 4.24, bit-identical outputs**; whole/loads/2 3.86 / 4.16; 1 warp 4.7-5.0.
# In the 7-layer probe 5.1 / 6.7 -> 3.82 us per call inside the step.
EXPAND_MIX = {"tiles": "stream", "order": "loads", "warps": 2}


def _f_values(f_refs, t, row, cols, *, layout):
    """The layer output f's values [1, bd] (fp32) of row t, columns ``cols``: read from f as stored,
    or summed here from a :class:`~pallas_kernels.deferred_sum.DeferredSum`'s pieces (``layout`` =
    (parts P, slots k, dtype), see :func:`_f_operands`): the GEMV's K parts in order, rounded to
    dtype; the routed experts' k slot rows (those with an expert) in order -- each row first summed
    over its ``row_splits`` split-K sums in order and rounded to ``rows_dtype`` when the down kernel
    was split --, plus the rounded parts, rounded again: the producers' own sums
    (``DeferredSum.value``), on these columns only."""
    n_parts, k, dtype, row_splits, rows_dtype = layout
    if n_parts == 0 and k == 0:
        return f_refs[0][row, cols].astype(jnp.float32)
    y = None
    if n_parts:
        y = sum_splits([f_refs[0][p, row, cols] for p in range(n_parts)]).astype(dtype).astype(jnp.float32)
    if k:
        rows_ref, index_ref = f_refs[-2:]
        routed = None
        for s in range(k):
            if row_splits:
                v = sum_splits([rows_ref[j, pl.ds(t * k + s, 1), cols] for j in range(row_splits)])
                v = v.astype(rows_dtype).astype(jnp.float32)
            else:
                v = rows_ref[pl.ds(t * k + s, 1), cols].astype(jnp.float32)
            r = jnp.where(index_ref[t * k + s] >= 0, v, 0.0)
            routed = r if routed is None else routed + r
        y = routed if y is None else (routed + y).astype(dtype).astype(jnp.float32)
    return y


def _f_operands(f, t: int, d: int):
    """(operands, layout) of the layer output f for :func:`_f_values`: f [T, D] itself, layout (0, 0,
    dtype, 0, None); or a DeferredSum's parts [P, T, D] f32, expert rows [R, D] (or split-K sums
    [S, R, D] f32) and expert index [T*k]."""
    if not isinstance(f, DeferredSum):
        return (f.reshape(t, d),), (0, 0, f.dtype, 0, None)
    ops = []
    n_parts = k = 0
    if f.parts is not None:
        n_parts = f.parts.shape[0]
        ops.append(f.parts.astype(jnp.float32))
    if f.expert_rows is not None:
        k = f.expert_index.shape[1]
        ops += [f.expert_rows, f.expert_index.reshape(-1).astype(jnp.int32)]
    return tuple(ops), (n_parts, k, jnp.dtype(f.dtype), f.row_splits, f.rows_dtype)


def deferred_reason(f, t: int, d: int) -> str | None:
    """Why the expansion kernel cannot sum this DeferredSum's pieces itself (None: it can)."""
    if not isinstance(f, DeferredSum):
        return None
    if f.parts is not None and (f.parts.ndim != 3 or f.parts.shape[1:] != (t, d)):
        return f"the GEMV's K parts must be [P, {t}, {d}], got {tuple(f.parts.shape)}"
    if f.expert_rows is not None:
        n, k = f.expert_index.shape
        rows = f.expert_rows.shape[f.expert_rows.ndim - 2:] if f.expert_rows.ndim in (2, 3) else (0, 0)
        if n != t or rows[0] < t * k or rows[1] != d:
            return (f"the experts' slot rows [{tuple(f.expert_rows.shape)}] / index {tuple(f.expert_index.shape)} "
                    f"do not fit {t} rows of width {d}")
    return None


def _expand_mix_kernel(*refs, hc, bd, n_f, layout):
    """Program (t, j): row t, columns [j*bd, +bd) of every stream: the expansion (as
    :func:`_expand_kernel`; f's values from :func:`_f_values`, the first ``n_f`` refs), the
    collapse of the stored streams with ``pre`` (as :func:`_collapse_kernel`), and the next mixes'
    partial sums over these hc*bd inputs (as :func:`_partial`'s one-row path: exact fp32 products of
    the stored streams and fn), written as K split j of :func:`_mix_split_kernel`'s inputs; with
    ``py_ref`` also the sum of squares of the stored collapse over these columns (split j of the next
    RMSNorm's statistics)."""
    f_refs = refs[:n_f]
    r_ref, post_ref, comb_ref, pre_ref, fn_ref, o_ref, y_ref, pa_ref, pb_ref, ps_ref, *py_ref = refs[n_f:]
    t = pl.program_id(0)
    j = pl.program_id(1)
    row = pl.ds(t, 1)
    cols = pl.ds(pl.multiple_of(j * bd, bd), bd)
    loads_first = EXPAND_MIX["order"] == "loads"
    f = _f_values(f_refs, t, row, cols, layout=layout)
    if EXPAND_MIX["tiles"] == "whole":
        ins = (r_ref[row, :, cols].astype(jnp.float32), post_ref[row, :], comb_ref[row, :, :])
        expand = lambda: _expand_tiles(f, *ins)  # noqa: E731
    else:
        ins = _expand_loads(r_ref, post_ref, comb_ref, hc, row, cols)
        expand = lambda: _expand_values(f, ins)  # noqa: E731
    pre = pre_ref[row, :]

    def load_fn():  # [16, hc, bd] each: the pre and post rows of fn, its comb rows
        return fn_ref[pl.ds(0, 16), :, cols], fn_ref[pl.ds(2 * hc, hc * hc), :, cols]

    def store(h, y):
        o_ref[row, :, cols] = h
        y_ref[row, cols] = y

    if loads_first:
        fa, fb = load_fn()
    h = expand().astype(o_ref.dtype)  # [1, hc, bd]
    hf = h.astype(jnp.float32)
    y = _collapse_block(hf, pre).astype(y_ref.dtype)
    if not loads_first:
        store(h, y)
        fa, fb = load_fn()
    a = jnp.sum(jnp.sum(fa * hf, axis=2), axis=1)
    b = jnp.sum(jnp.sum(fb * hf, axis=2), axis=1)
    ss = jnp.sum(jnp.sum(hf * hf, axis=2), axis=1)  # [1]
    if loads_first:
        store(h, y)
    if py_ref:  # the next norm's partial sum of squares over these columns of the stored (rounded) collapse
        yf = y.astype(jnp.float32)
        py_ref[0][pl.ds(j, 1), row] = jnp.sum(yf * yf, axis=1)[None, :]
    pa_ref[pl.ds(j, 1), row, :] = a[None, None, :]
    pb_ref[pl.ds(j, 1), row, :] = b[None, None, :]
    ps_ref[pl.ds(j, 1), row] = ss[None, :]


NORM_COLS = 512  # columns of the collapse each norm program of the split kernel normalizes (at most)


def _mix_split_norm_kernel(pa_ref, pb_ref, ps_ref, scale_ref, base_ref, py_ref, y_ref, w_ref, pre_ref, post_ref, c_ref,
                           yn_ref, *,
                           t, n_split, split_kw, d, cb, eps):
    """Programs 0..t-1: :func:`_mix_split_kernel` for row i. Programs t..: the next site's RMSNorm of
    the collapse, row (i - t) // (d / cb), columns ``cb`` wide: the row's sum of squares from the
    expansion kernel's ``n_split`` partials, then ``w * (y * rsqrt(ss / d + eps))`` as
    ``layers.rms_norm``. The norm programs need nothing from the Sinkhorn and run beside it."""
    i = pl.program_id(0)

    @pl.when(i < t)
    def _():
        _mix_split_rows(i, pa_ref, pb_ref, ps_ref, scale_ref, base_ref, (pre_ref, post_ref, c_ref), bt=1, n_split=n_split,
                        split_kw=split_kw)

    @pl.when(i >= t)
    def _():
        q = i - t
        nc = d // cb
        row = pl.ds(q // nc, 1)
        cols = pl.ds(pl.multiple_of((q % nc) * cb, cb), cb)
        (ss,) = _sum_over_splits(lambda sp: (py_ref[sp, row],), n_split)
        r = jax.lax.rsqrt(ss / d + eps)  # [1]
        z = y_ref[row, cols].astype(jnp.float32) * r[:, None]
        yn_ref[row, cols] = (w_ref[cols].astype(jnp.float32)[None, :] * z).astype(yn_ref.dtype)


def expand_mix_reason(f, residual, post, comb, pre, fn, y_norm=None):
    """Why :func:`hc_expand_collapse_mixes` cannot take this call (None: it can); ``f`` an array or a
    :class:`~pallas_kernels.deferred_sum.DeferredSum`."""
    reason = expand_collapse_reason(f, residual, post, comb, pre) or unsupported_reason(residual, fn)
    if reason is None:
        reason = deferred_reason(f, math.prod(residual.shape[:-2]), residual.shape[-1])
    if reason is None and y_norm is not None and tuple(y_norm[0].shape) != (residual.shape[-1],):
        reason = f"the norm weight {tuple(y_norm[0].shape)} must be [D] = ({residual.shape[-1]},)"
    if reason is not None:
        return reason
    t = math.prod(residual.shape[:-2])
    if t > MIX_FUSED_MAX_T:
        return f"{t} rows: the fused expansion + mixes is for decode sizes (<= {MIX_FUSED_MAX_T} rows)"
    if residual.shape[-1] % MIX_FUSED_BD:
        return f"D={residual.shape[-1]} must be a multiple of {MIX_FUSED_BD}"
    return None


def hc_expand_collapse_mixes(f, residual, post, comb, pre, fn, scale, base, y_norm_weight=None, *, norm_eps, hc_eps,
                             sinkhorn_iters, y_norm_eps=0.0, interpret=False):
    """(h, y, (pre', post', comb')): h = hc_expand(f, residual, post, comb), y = hc_collapse(h, pre)
    and the next site's hc_mixes(h, fn, scale, base), in two kernels (the expansion kernel also
    forms the mixes' split-K partial sums; then hc_mixes' split kernel) instead of four. With
    ``y_norm_weight`` [D], y comes back RMS-normalized (eps ``y_norm_eps``): the expansion kernel
    also writes the sums of squares of its columns of y, and the split kernel's extra programs
    normalize y beside the Sinkhorn (the norm's two XLA kernels gone). ``f`` may be a
    :class:`~pallas_kernels.deferred_sum.DeferredSum`: the expansion kernel then sums its pieces on
    its own columns (:func:`_f_values`) instead of XLA before it."""
    y_norm = None if y_norm_weight is None else (y_norm_weight, y_norm_eps)
    lead, hc, d, t, _, _ = _site_layout("hc_expand_collapse_mixes",
                                        expand_mix_reason(f, residual, post, comb, pre, fn, y_norm), residual)
    bd = MIX_FUSED_BD
    ns = d // bd
    f32 = jnp.float32
    f_ops, layout = _f_operands(f, t, d)
    h, y, pa, pb, ps, *py = pl.pallas_call(
        functools.partial(_expand_mix_kernel, hc=hc, bd=bd, n_f=len(f_ops), layout=layout),
        out_shape=(jax.ShapeDtypeStruct((t, hc, d), f.dtype), jax.ShapeDtypeStruct((t, d), f.dtype),
                   jax.ShapeDtypeStruct((ns, t, 16), f32), jax.ShapeDtypeStruct((ns, t, hc * hc), f32),
                   jax.ShapeDtypeStruct((ns, t), f32)) + ((jax.ShapeDtypeStruct((ns, t), f32),) if y_norm else ()),
        grid=(t, ns),
        compiler_params=pltriton.CompilerParams(num_warps=EXPAND_MIX["warps"], num_stages=1),
        interpret=interpret,
        name="hc_expand_mix",
    )(*f_ops, residual.reshape(t, hc, d), post.reshape(t, hc).astype(f32),
      comb.reshape(t, hc, hc).astype(f32), pre.reshape(t, hc).astype(f32),
      fn.astype(f32).reshape(fn.shape[0], hc, d))
    split_kw = dict(hc=hc, width=hc * d, norm_eps=float(norm_eps), hc_eps=float(hc_eps), iters=int(sinkhorn_iters))
    if y_norm is None:
        pre, post, c = _split_call(pa, pb, ps, scale.astype(f32), base.astype(f32), bt=1, split_kw=split_kw,
                                   warps=_split_warps(1), interpret=interpret)
        return h.reshape(*lead, hc, d), y.reshape(*lead, d), _unpack_mixes(pre, post, c, lead, hc)
    cb = pick_block(d, NORM_COLS)
    pre, post, c, y = pl.pallas_call(
        functools.partial(_mix_split_norm_kernel, t=t, n_split=ns, split_kw=split_kw, d=d, cb=cb, eps=float(y_norm_eps)),
        out_shape=(*_mixes_shapes(t, hc), jax.ShapeDtypeStruct((t, d), f.dtype)),
        grid=(t + t * (d // cb),), interpret=interpret, name="hc_mixes_split_norm",
        compiler_params=pltriton.CompilerParams(num_warps=_split_warps(1), num_stages=1),
    )(pa, pb, ps, scale.astype(f32), base.astype(f32), py[0], y, y_norm_weight)
    return h.reshape(*lead, hc, d), y.reshape(*lead, d), _unpack_mixes(pre, post, c, lead, hc)
