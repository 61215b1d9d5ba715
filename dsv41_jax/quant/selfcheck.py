"""Do the quantizers round the same on this machine's accelerator as on the CPU?

``python -m dsv41_jax.quant.selfcheck`` runs every quantizer of :mod:`dsv41_jax.quant` jitted on the
default device and on the CPU, on the same fresh float32 inputs (random magnitudes over many
binades, values around every e4m3 / e2m1 midpoint, e4m3 subnormals, saturating values), and compares
the results bit for bit. The CPU backend is the reference: its f32 -> f8 conversions are exact RNE
(checked against ml_dtypes in ``tests/test_quant.py``).

Why this exists: on an H200, XLA's GPU compiler removed the convert pair of
``x.astype(float8_e4m3fn).astype(float32)`` inside a fusion, so the rounding did nothing
(BENCHMARKS.md, issue 11, session 17). The quantizers now round on bit patterns; this check is how
a new backend (ROCm on MI350X, a new JAX) shows that they still agree with the CPU. The table's last
row is a canary, not a quantizer: that naive round trip on the device (``folded`` on the H200).

Exit status 0 when every quantizer agrees bit for bit, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import act_quant, bf16_round, e4m3_round, fake_quant_fp4_e4m3, fake_quant_fp8, fake_quant_mxfp4
from .codecs import E2M1_VALUES
from .tensors import quantize_fp8, quantize_mxfp4


def _near(grid: np.ndarray, rng, n: int) -> np.ndarray:
    mids = (grid[:-1] + grid[1:]) / 2
    return np.concatenate([mids, (mids * (1 + rng.uniform(-2.0**-12, 2.0**-12, (n, mids.size)))).ravel()])


def inputs(seed: int | None = None, rows: int = 256, cols: int = 1024) -> np.ndarray:
    """float32 [rows, cols]: per-row magnitudes 2**-30 .. 2**30, with e4m3 and e2m1 near-midpoint
    values (at the block scale the row's amax gives) and subnormal-range values mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-30, 30, (rows, 1))
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    e4m3 = np.unique(np.abs(codes[np.isfinite(codes)]))
    specials = np.concatenate([_near(e4m3, rng, 4), _near(np.asarray(E2M1_VALUES, np.float64), rng, 64) * 74.0])
    specials = specials * rng.choice([-1.0, 1.0], specials.size)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, min(specials.size, flat.size // 4), replace=False)
    flat[idx] = specials[: idx.size] * 2.0 ** rng.integers(-8, 8, idx.size)
    # blocks under the FP8 scale floor (e >= -22: values land in e4m3's subnormals or round to 0),
    # kept in float32's normal range: float32 subnormals (|x| < 2**-126) are flushed to zero by the
    # XLA CPU backend (denormals-are-zero on input and output) but kept by the H200, so the
    # quantizers cannot agree bit for bit there (session 18: 1,004 MXFP4 elements, all in blocks
    # of float32 subnormals). Real weights and activations are never that small.
    x[: rows // 8] *= 2.0**-40
    x[rows // 8, :8] = [448.0, 449.0, 480.0, -1e30, 3e38, 0.0, -0.0, 1e-30]
    mids = (e4m3[:-1] + e4m3[1:]) / 2  # exact e4m3 ties, unscaled (block amax 448 -> scale 1), both signs
    x[-1, : 2 * mids.size] = np.concatenate([mids, -mids])
    x[-1, 2 * mids.size] = 448.0
    return x.astype(np.float32)


def checks() -> dict:
    """name -> function of a float32 [R, C] array returning an array (or a tuple of arrays)."""
    return {
        "e4m3_round": e4m3_round,
        "bf16_round": bf16_round,
        "fake_quant_fp8 (block 32)": lambda x: fake_quant_fp8(x, 32),
        "act_quant (block 128, V4)": lambda x: act_quant(x, 128),
        "fake_quant_mxfp4 (block 32)": lambda x: fake_quant_mxfp4(x, 32),
        "fake_quant_fp4_e4m3 (block 16)": lambda x: fake_quant_fp4_e4m3(x, 16),
        "quantize_fp8 32x32 (codes, scales)": lambda x: _fp8_parts(quantize_fp8(x, (32, 32))),
        "quantize_fp8 128x128 (codes, scales)": lambda x: _fp8_parts(quantize_fp8(x, (128, 128))),
        "quantize_mxfp4 (codes, scales)": lambda x: _fp4_parts(quantize_mxfp4(x, 32)),
    }


def _fp8_parts(t):
    return (jax.lax.bitcast_convert_type(t.data, jnp.uint8), jax.lax.bitcast_convert_type(t.scale, jnp.uint8))


def _fp4_parts(t):
    return t.data, jax.lax.bitcast_convert_type(t.scale, jnp.uint8)


def _naive_round_trip(x):
    return jnp.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _bits(out) -> list[np.ndarray]:
    """Each output array's elements as unsigned integers of the same width (compared bit for bit)."""
    arrays = [np.asarray(o) for o in (out if isinstance(out, tuple) else (out,))]
    return [a.view(_UINT[a.dtype.itemsize]).reshape(-1) for a in arrays]


def _mismatches(a, b) -> int:
    return int(sum(np.count_nonzero(x != y) for x, y in zip(_bits(a), _bits(b))))


def run(device=None, seed: int | None = None, log=print) -> int:
    """Compare every quantizer on ``device`` (default: JAX's default device) with the CPU; log a
    table; return the number of quantizers that differ."""
    device = device or jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    x = inputs(seed)
    xd, xc = jax.device_put(x, device), jax.device_put(x, cpu)
    log(f"# quantizers on {device.platform}:{device.device_kind} against the CPU, bit for bit "
        f"(jax {jax.__version__}; {x.size:,} float32 values)")
    log(f"{'quantizer':40s} {'elements that differ':>22s}")
    bad = 0
    for name, fn in checks().items():
        f = jax.jit(fn)
        n = _mismatches(f(xd), f(xc))
        bad += n > 0
        log(f"{name:40s} {n:>22,d}{'   DIFFERS' if n else ''}")
    f = jax.jit(_naive_round_trip)
    n = _mismatches(f(xd), f(xc))
    log(f"{'canary: astype(e4m3).astype(f32), naive':40s} {n:>22,d}   "
        f"({'folded away by this backend' if n else 'kept by this backend'}; not used by the quantizers)")
    log(mx_dot_line(device, seed))
    return bad


def mx_dot_line(device, seed: int | None = None) -> str:
    """The MX dot (``tt.dot_scaled`` in a Pallas-Triton kernel, ``pallas_kernels.scaled_dot.probe``, on
    operands from ``seed``) on ``device``: agrees with the decoded dot, or why not. Not counted as a quantizer difference: where
    it fails, the kernels keep their decode routes (``DSV41_MX_DOT``)."""
    from pallas_kernels import scaled_dot

    name = "mx_dot (tt.dot_scaled) in a kernel"
    if device.platform == "cpu":
        return f"{name:40s} {'-':>22s}   (no Pallas-Triton on the CPU)"
    reason = scaled_dot.probe(device, seed=seed)
    used = "the kernels' default here" if scaled_dot.has_mx_dot(device) else "opt-in here (DSV41_MX_DOT=on)"
    if reason is None:
        return f"{name:40s} {'agrees':>22s}   ({used})"
    return f"{name:40s} {'FAILS':>22s}   ({used}; the kernels keep their decode routes): {reason}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.quant.selfcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    a = ap.parse_args(argv)
    bad = run(seed=a.seed)
    print("PASS: every quantizer rounds as on the CPU" if not bad else f"FAIL: {bad} quantizer(s) differ from the CPU")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
