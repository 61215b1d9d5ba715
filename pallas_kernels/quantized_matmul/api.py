"""Dispatch for the weight GEMMs. The model calls :func:`quantized_matmul` only."""

from __future__ import annotations

from pallas_kernels import dispatch

from dsv41_jax.quant import is_quantized

from . import reference


def _kernel():
    from . import pallas_triton

    return pallas_triton


def _choose(x, w, act_block, implementation):
    return dispatch.choose(
        "quantized_matmul", implementation, _kernel,
        lambda k: k.unsupported_reason(x, w, act_block=act_block), lambda k: k.auto_reason(x, w))


def quantized_matmul(x, w, *, act_block=32, out_dtype=None, implementation=None, defer=False):
    """y = x @ W.T. x [..., K]; w an Fp8Tensor [N, K] (32x32 blocks: V4.1, 128x128: V4), Fp4Tensor
    [N, K] (packed [N, K/2]) or a plain [N, K] array. Quantized weights get DeepSeek's FP8 activation
    fake-quant per ``act_block`` (32 in V4.1, 128 in V4; equal to the FP8 weight block).

    ``defer``: where the decode GEMV runs, y may come back as a
    :class:`~pallas_kernels.deferred_sum.DeferredSum` (its K parts, unsummed) for a consumer that sums
    them itself; ``deferred_sum.materialize`` gives the same value as without ``defer``."""
    kernel, interpret = _choose(x, w, act_block, implementation)
    if kernel is not None:
        return dispatch.call_kernel(kernel.quantized_matmul, x, w, act_block=act_block, out_dtype=out_dtype,
                                    interpret=interpret, defer=defer)
    return reference.quantized_matmul(x, w, act_block=act_block, out_dtype=out_dtype)


def uses_kernel(x, w, *, act_block=32, implementation=None) -> bool:
    """Whether :func:`quantized_matmul` with these arguments would run the Pallas kernel (the same
    dispatch decision, without running anything)."""
    return _choose(x, w, act_block, implementation)[0] is not None


def quantized_matmul_multi(x, ws, *, act_block=32, out_dtype=None, norms=None, norm_eps=0.0,
                           implementation=None) -> list:
    """``[quantized_matmul(x, w) for w in ws]``, the same values, in one kernel launch where the decode
    GEMV can take every weight together (1-4 rows, one format, block and K: the projections that read
    the same input, such as wq_a and wkv, or the shared expert's w1 and w3). Otherwise, and on the
    reference path, one call per weight. At batch-1 decode the host's launch cost per kernel limits
    the step rate (BENCHMARKS.md, session 5), so each launch saved counts.

    ``norms``: per weight an RMSNorm weight [N_j] or None; output j is then
    ``rms_norm(y_j, norms[j], norm_eps)`` (:func:`dsv41_jax.layers.rms_norm`: fp32 statistics of the
    rounded output, rounded again). In the one-launch case a finish kernel sums the GEMV's K parts
    and normalizes (``pallas_triton_finish``: wq_a's q_norm, one kernel where XLA ran three)."""
    ws = list(ws)
    norms = list(norms) if norms is not None else [None] * len(ws)
    if len(norms) != len(ws):
        raise ValueError(f"quantized_matmul_multi: {len(norms)} norm weights for {len(ws)} weights")
    fused = _fused_kernel(x, ws, act_block, implementation)
    if fused is not None:
        kernel, interpret = fused
        finish = any(nw is not None for nw in norms) and dispatch.choose(
            "quantized_matmul", implementation, _kernel, lambda k: k.finish_reason(x, ws, norms))[0] is not None
        # the norm weights travel as an operand (None leaves for the outputs without one): call_kernel's
        # keywords are for static values
        ys = dispatch.call_kernel(lambda x, ws, norms, **kw: kernel.quantized_matmul_multi(x, ws, norms=norms, **kw),
                                  x, tuple(ws), tuple(norms) if finish else None, act_block=act_block,
                                  out_dtype=out_dtype, interpret=interpret, norm_eps=norm_eps)
        if finish:
            return ys
    else:
        ys = [quantized_matmul(x, w, act_block=act_block, out_dtype=out_dtype, implementation=implementation)
              for w in ws]
    return [y if nw is None else reference.rms_norm(y, nw, norm_eps) for y, nw in zip(ys, norms)]


def _fused_kernel(x, ws, act_block, implementation):
    """(kernel module, interpret) when one GEMV launch can compute every weight of ``ws`` (two or more,
    each taken by the kernel, a shared fma configuration), else None."""
    if len(ws) < 2:
        return None
    kernel, interpret = _choose(x, ws[0], act_block, implementation)
    if (kernel is None or any(_choose(x, w, act_block, implementation)[0] is None for w in ws[1:])
            or kernel.fused_gemv_config(x, ws, act_block=act_block) is None):
        return None
    return kernel, interpret


def grouped_matmul(x, w, *, groups: int, out_dtype=None, implementation=None):
    """V4's grouped low-rank output projection (``wo_a``): x [..., G, K], w [G*N, K] (FP8/MXFP4, or
    plain) -> [..., G, N] with ``y[..., g, :] = x[..., g, :] @ W_g.T`` and no activation fake-quant
    (as the reference). The Pallas kernel is the decode-size vector-unit GEMV over every group in one
    launch (at most 8 rows per group); other sizes run the reference (dequantize + one batched dot).
    Under a mesh with a ``tp`` axis the reference runs, so that GSPMD splits it by group."""
    from sharding.tensor_parallel import tp_active

    if is_quantized(w) and not tp_active():
        kernel, interpret = dispatch.choose(
            "quantized_matmul", implementation, _kernel, lambda k: k.grouped_reason(x, w, groups=groups),
            lambda k: k.grouped_auto_reason(x, w))
        if kernel is not None:
            return dispatch.call_kernel(kernel.grouped_matmul, x, w, groups=groups, out_dtype=out_dtype,
                                        interpret=interpret)
    return reference.grouped_matmul(x, w, groups=groups, out_dtype=out_dtype)
