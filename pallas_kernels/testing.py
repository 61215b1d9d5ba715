"""Test utilities shared by every kernel package.

``assert_close(y, yr)`` checks a kernel output against its reference element by element with the
kernels' stated tolerances (``GEMM_TOL``: bf16 outputs rtol 2^-7 + 2^-9 of max|ref|, f32 rtol 1e-5
+ 1e-6 of max|ref|), after checking shape, dtype and finiteness.

``lower_for(target, fn, *specs)`` runs the full Pallas -> Triton-IR lowering on a CPU-only host for
one GPU target (``"cuda"`` = an NVIDIA H200, ``"rocm"`` = an AMD MI350X, gfx950), under an abstract
mesh whose abstract device names that GPU (see ``shared/spec/pallas_triton.md`` §5, method A). No
device memory is touched; the inputs are ``jax.ShapeDtypeStruct``s. It raises what the backend's
lowering raises (non-power-of-two blocks, scalar prefetch, fnuz casts, ...), which interpret mode
would silently accept. Every Triton module it produces is also run through the MLIR verifier
(which the device's Triton runs when it parses the module: session 11's first indexer kernel lowered
here but was refused on the H200 with "'scf.for' op failed to verify"). This is the MI350X
portability gate: no AMD GPU is lent to us.
"""

from __future__ import annotations

import re

import jax
from jax.sharding import AxisType

# AbstractDevice lives in a private module; keep that dependency in this one place.
from jax._src.mesh import AbstractDevice, AbstractMesh  # noqa: PLC2701
from jax._src.pallas.triton import lowering as _triton_lowering  # noqa: PLC2701

TARGETS = {
    "cuda": ("NVIDIA H200", "cuda"),
    "rocm": ("gfx950", "rocm"),
}


def abstract_mesh(target: str) -> AbstractMesh:
    kind, platform = TARGETS[target]
    device = AbstractDevice(kind, 1, platform)
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)


def lower_for(target: str, fn, *specs):
    """Lower ``jax.jit(fn)`` on ShapeDtypeStruct ``specs`` for ``target`` ('cuda' or 'rocm').

    Returns the ``Lowered`` object; its ``as_text()`` holds the Triton custom call.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {sorted(TARGETS)}")
    lower_module = _triton_lowering.lower_jaxpr_to_triton_module

    def verified(jaxpr, grid_mapping, *args, **kwargs):
        overhang = partial_blocks(grid_mapping)
        if overhang:
            raise AssertionError(
                "blocks that do not divide their arrays (jax 0.11.2's Triton lowering, the H200's, does not "
                "mask the accesses of such a block: its stores land in the next row or past the array, "
                "BENCHMARKS.md issue 6, session 24; pad the array or mask explicitly): " + "; ".join(overhang))
        result = lower_module(jaxpr, grid_mapping, *args, **kwargs)
        if not result.module.operation.verify():  # raises with the diagnostics on failure
            raise AssertionError("the Triton module did not verify")
        return result

    _triton_lowering.lower_jaxpr_to_triton_module = verified
    try:
        with jax.sharding.use_abstract_mesh(abstract_mesh(target)):
            return jax.jit(fn).trace(*specs).lower(lowering_platforms=(target,))
    finally:
        _triton_lowering.lower_jaxpr_to_triton_module = lower_module


def partial_blocks(grid_mapping) -> list[str]:
    """The block specs of one ``pallas_call`` whose block does not divide its array along some
    dimension (a block larger than the array, or a last block that runs past its end), as readable
    strings. jax >= 0.12 masks such a block's loads and stores at the array's edges; jax 0.11.2 (the
    GPU machines') emits them unmasked, so a store past the end of a row writes the next row's first
    elements, racing with that row's program (session 24: ``moe_route`` wrote zeros into columns 0-1
    of a random subset of rows on the H200). Memory-space-ANY refs (no blocking) are not checked."""
    from jax._src.pallas import core as pallas_core  # noqa: PLC2701

    found = []
    for bm in grid_mapping.block_mappings:
        shape = tuple(bm.array_aval.shape)
        sizes = []
        for b in bm.block_shape:
            if isinstance(b, pallas_core.Blocked):
                sizes.append(b.block_size)
            elif isinstance(b, int):
                sizes.append(b)
            else:  # squeezed (None), element-indexed or sliced dimensions: not checked
                sizes.append(1)
        if len(sizes) != len(shape):
            continue
        if any(n % b for b, n in zip(sizes, shape)):
            found.append(f"{bm.origin}: block {tuple(sizes)} on array {shape}")
    return found


GEMM_TOL = {"bfloat16": (2.0**-7, 2.0**-9), "float32": (1e-5, 1e-6)}


def assert_close(y, yr, tol=None):
    """Every element of ``y`` within ``rtol * |yr| + atol_rel * max|yr|`` of ``yr`` (same shape and
    dtype, all finite); ``tol`` {dtype name: (rtol, atol_rel)} defaults to :data:`GEMM_TOL`."""
    import numpy as np

    assert y.shape == yr.shape and y.dtype == yr.dtype, (y.shape, y.dtype, yr.shape, yr.dtype)
    rtol, atol_rel = (tol or GEMM_TOL)[str(np.dtype(yr.dtype))]
    yf = np.asarray(y, np.float32)
    rf = np.asarray(yr, np.float32)
    assert np.all(np.isfinite(yf))
    np.testing.assert_allclose(yf, rf, rtol=rtol, atol=atol_rel * float(np.max(np.abs(rf))))


def fake_device_time(seconds: float):
    """A stand-in for :func:`pallas_kernels.benchmarking.device_time_op` in CPU tests of the benchmark
    scripts: ``seconds`` per op, one kernel reported."""
    def device_time_op(fn, per_rep_args, shared_args=(), *, reps=5, iters=5, outdir=None, kernels=None):
        if kernels is not None:
            kernels.append(("kernel", seconds))
        return seconds
    return device_time_op


_PASS_THROUGH = ("stablehlo.reshape", "stablehlo.bitcast_convert", "sdy.sharding_constraint")


def sliced_kernel_operands(text: str) -> list[str]:
    """In the StableHLO ``text`` of a program lowered for a GPU (``lower_for(...).as_text()``), the
    kernel operands that are a slice of another kernel's result (followed through reshapes, bitcasts
    and sharding constraints). XLA cannot fuse a slice into a custom call, so it materializes it
    before the kernel: as a device-to-device copy when the slice is contiguous (session 25: the mHC
    mixes' pre and post columns were 160 of the batch-1 step's 170 copies, 0.17 ms). One readable
    line per such operand: consumer kernel, operand position, the slice, producer kernel."""
    found = []
    for func in re.split(r"\n\s*func\.func ", text):
        defs = {}
        for line in func.split("\n"):
            m = re.match(r"\s*(%[\w]+)(?::\d+)? = ([\w.\"]+)", line)
            if m:
                defs[m.group(1)] = (m.group(2), line.strip())

        def origin(value, depth=0):
            d = defs.get(value.split("#")[0])
            if d and d[0] in _PASS_THROUGH and depth < 16:
                src = re.search(r"= [\w.]+ (%[\w#]+)", d[1])
                return origin(src.group(1), depth + 1) if src else d
            return d

        def kernel_name(line):
            m = re.search(r'name = "(\w+)"', line)
            return m.group(1) if m else "?"

        for line in func.split("\n"):
            call = re.search(r"stablehlo\.custom_call @[\w$.]+\(([^)]*)\)", line)
            if not call:
                continue
            for pos, operand in enumerate(v.strip() for v in call.group(1).split(",")):
                d = origin(operand)
                if not d or d[0] != "stablehlo.slice":
                    continue
                src = origin(re.search(r"stablehlo\.slice (%[\w#]+)", d[1]).group(1))
                if src and "custom_call" in src[0]:
                    piece = re.sub(r"%[\w#]+ = |%[\w#]+", "", d[1]).strip()
                    found.append(f"{kernel_name(line)} operand {pos}: {piece} of {kernel_name(src[1])}")
    return found


def random_moe_case(fmt: str, seed: int, n: int, dtype, *, experts: int, inter: int, dim: int, topk: int):
    """Fresh random inputs of the fused MoE for interpret-mode tests: x [n, dim] in ``dtype``, routing
    weights in [0.05, 1), ``topk`` distinct experts per token, and w1 / w3 [experts, inter, dim], w2
    [experts, dim, inter] from N(0, 0.2²) quantized to FP8 (``fmt`` "fp8", 32×32 blocks) or MXFP4.
    -> (x, weights, indices, w1, w2, w3)."""
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.quant import quantize_fp8, quantize_mxfp4

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, dim), np.float32).astype(np.dtype(dtype)))
    wts = jnp.asarray(rng.uniform(0.05, 1.0, (n, topk)).astype(np.float32))
    idx = jnp.asarray(np.argsort(rng.random((n, experts)), axis=1)[:, :topk].astype(np.int32))
    quant = jax.jit(quantize_fp8 if fmt == "fp8" else quantize_mxfp4)

    def w(shape):
        return quant(jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(0.2)))

    return x, wts, idx, w((experts, inter, dim)), w((experts, dim, inter)), w((experts, inter, dim))


def jit_call(fn, *args, **kw):
    """``fn(*args, **kw)`` under ``jax.jit`` (the keywords static)."""
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def assert_split_close(y, y_unsplit, y_ref, tol: float):
    """A K-split kernel's output ``y``: finite, the reference's shape, and within ``tol`` (relative,
    plus ``tol`` of max|reference|) of both the reference and the unsplit kernel's output."""
    import numpy as np

    y, y_unsplit, y_ref = (np.asarray(a, np.float32) for a in (y, y_unsplit, y_ref))
    assert np.all(np.isfinite(y)) and y.shape == y_ref.shape, (y.shape, y_ref.shape)
    scale = float(np.max(np.abs(y_ref)))
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(y, y_unsplit, rtol=tol, atol=tol * scale)


def only_kernels(monkeypatch, keep):
    """Route every op for which ``keep(op)`` is false to its reference: the model tests that check
    some kernels inside a whole forward step run the rest on references (the CPU time of interpret
    mode). ``keep`` is called at trace time, so it may read state the test changes."""
    from pallas_kernels import dispatch

    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, impl, *a, **k: choose(op, impl if keep(op) else "reference", *a, **k))


def draw_until_logits_agree(draw, tries: int = 4, rtol: float = 2e-3):
    """Model tests that compare a step's logits on kernels with the reference path's: ``draw()``
    makes fresh weights and tokens, runs both paths (checking each kernel call on its own inputs)
    and returns a tuple ending ``(..., ref, out)``. Every linear fake-quantizes its input to e4m3, so
    now and then a one-ulp summation difference crosses a rounding boundary (or flips a top-k pick)
    and the logits move by 1e-2 to 1e-1 of their scale: about one draw in 30 (session 26), and one
    CI run of the two-pass model test (session 58). A draw whose logits moved by more than ``rtol``
    of their scale is drawn again, up to ``tries`` draws; a kernel that is wrong moves every draw.
    Returns the agreeing draw's tuple."""
    import numpy as np

    for _ in range(tries):
        got = draw()
        ref, out = got[-2], got[-1]
        assert np.all(np.isfinite(out))
        if np.max(np.abs(out - ref)) <= rtol * float(np.max(np.abs(ref))):
            return got
    raise AssertionError(f"the logits differed on {tries} draws in a row: more than a rounding flip")
