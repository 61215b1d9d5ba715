"""``python -m dsv41_jax.quant.selfcheck``: the backend-vs-CPU rounding check (run on a GPU to see that
the quantizers round as on the CPU; here it must pass and its inputs must exercise the roundings)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.quant import selfcheck


def test_selfcheck_passes_on_the_cpu_and_prints_every_quantizer(capsys):
    assert selfcheck.main([]) == 0
    out = capsys.readouterr().out
    for name in selfcheck.checks():
        assert name in out
    assert "kept by this backend" in out and "PASS" in out


def test_inputs_hold_ties_subnormals_and_saturating_values():
    x = selfcheck.inputs()
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    grid = np.unique(np.abs(codes[np.isfinite(codes)]))
    mids = (grid[:-1] + grid[1:]) / 2
    a = np.abs(x.astype(np.float64))
    assert np.isin(a, mids).sum() > 100  # exact e4m3 ties (round-half-even decides)
    assert (a < np.finfo(np.float32).tiny).sum() > 0 and (a > 448).sum() > 0
    # a rounding that breaks ties away from zero differs from RNE on these inputs
    rne = np.asarray(jax.jit(selfcheck.e4m3_round)(x))
    away = np.where(np.isin(np.abs(x), mids.astype(np.float32)), np.sign(x) * grid[np.minimum(np.searchsorted(grid, np.abs(x)), grid.size - 1)], rne)
    assert np.count_nonzero(away != rne) > 0


def test_mismatch_count_sees_one_flipped_bit_in_any_output():
    a = (jnp.arange(8, dtype=jnp.float32), jnp.arange(4, dtype=jnp.uint8))
    b = (a[0].at[3].set(jnp.nextafter(a[0][3], 9.0)), a[1])
    assert selfcheck._mismatches(a, a) == 0
    assert selfcheck._mismatches(a, b) == 1
    assert selfcheck._mismatches(jnp.zeros(3, jnp.bfloat16), jnp.zeros(3, jnp.bfloat16).at[1].set(-0.0)) == 1


def test_a_quantizer_that_differs_on_the_device_fails_the_check(monkeypatch):
    """Both 'devices' are the CPU here, so make the device copy of the inputs differ in one element: the
    element-wise roundings must report it (the block quantizers may or may not, depending on the
    row's amax) and the run must fail."""
    real_put = jax.device_put
    calls = []

    def put(x, device=None):
        calls.append(device)
        if len(calls) == 1:  # the device copy
            x = np.array(x, copy=True)
            v = x[x.shape[0] // 2, 7]  # any magnitude (rows span 2**-30 .. 2**30): put an in-range value
            x[x.shape[0] // 2, 7] = 3.0 if abs(v - 3.0) > 0.5 else 6.5  # there, rounding differently anyway
        return real_put(x, device)

    monkeypatch.setattr(selfcheck.jax, "device_put", put)
    lines = []
    bad = selfcheck.run(log=lines.append)
    differs = [line.split("  ")[0] for line in lines if line.endswith("DIFFERS")]
    assert bad == len(differs) >= 2 and {"e4m3_round", "bf16_round"} <= set(differs), lines


def test_selfcheck_reports_the_mx_dot_probe(monkeypatch):
    """The last row: the MX dot probe on a GPU (agrees, or FAILS with its reason and the decode routes
    kept), a dash on the CPU."""
    from pallas_kernels import scaled_dot

    class Dev:
        platform, device_kind, id = "rocm", "AMD Instinct MI355X", 0

    assert selfcheck.mx_dot_line(jax.devices("cpu")[0]).rstrip().endswith("(no Pallas-Triton on the CPU)")
    monkeypatch.setattr(scaled_dot, "probe", lambda device=None, **k: None)
    line = selfcheck.mx_dot_line(Dev())
    assert "agrees" in line and "the kernels' default here" in line, line
    monkeypatch.setattr(scaled_dot, "probe", lambda device=None, **k: "mx_dot e2m1 x e2m1 on rocm:x: RuntimeError: no")
    line = selfcheck.mx_dot_line(Dev())
    assert "FAILS" in line and "decode routes" in line and line.endswith("RuntimeError: no"), line
