"""pallas_kernels.triton_compat: the opt-in ``tt.num_stages`` attribute on the loops of listed
kernels (``DSV41_TRITON_LOOP_STAGES``), which lets Triton software-pipeline the loads of dot-free
loops. Checked on the Triton IR of a CPU lowering for cuda and rocm; the device effect is measured
on a GPU (BENCHMARKS.md, issue 6)."""

import pytest

from pallas_kernels import inspect_sass, triton_compat


def test_parse_loop_stages():
    assert triton_compat.parse_loop_stages(None) == {}
    assert triton_compat.parse_loop_stages(" qmm_fma=3, moe_down=2 ,") == {"qmm_fma": 3, "moe_down": 2}
    for bad in ("qmm_fma", "qmm_fma=x", "=3", "qmm_fma=0", "qmm_fma=-1"):
        with pytest.raises(ValueError, match="DSV41_TRITON_LOOP_STAGES.*KERNEL_PREFIX=STAGES"):
            triton_compat.parse_loop_stages(bad)


def test_longest_prefix_wins():
    table = {"moe_": 2, "moe_gate_up": 4}
    assert triton_compat.loop_stages_for("moe_gate_up_fma_fp4", table) == 4
    assert triton_compat.loop_stages_for("moe_down_fma_fp4", table) == 2
    assert triton_compat.loop_stages_for("qmm_fma_fp8", table) is None


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_listed_kernels_loops_carry_num_stages(monkeypatch, target):
    assert triton_compat.LOOP_STAGES_PATCHED
    fn, *specs = inspect_sass._cases("moe")  # two fma kernels, each with one K loop
    monkeypatch.delenv(triton_compat.LOOP_STAGES_ENV, raising=False)
    # a new function object each time: the env var is read when a kernel is lowered, and a cached
    # lowering (the same jitted function) would not lower again
    plain = {k["name"]: k["ttir"] for k in inspect_sass.triton_kernels(lambda *a: fn(*a), *specs, target=target)}
    assert plain and all("tt.num_stages" not in t for t in plain.values())
    monkeypatch.setenv(triton_compat.LOOP_STAGES_ENV, "moe_gate_up=2")
    marked = {k["name"]: k["ttir"] for k in inspect_sass.triton_kernels(lambda *a: fn(*a), *specs, target=target)}
    up, down = marked["moe_gate_up_fma_fp4"], marked["moe_down_fma_fp4"]
    assert up.count("scf.for") >= 1 and up.count("tt.num_stages = 2 : i32") == up.count("scf.for")
    assert "tt.num_stages" not in down  # not listed
    # the attribute is the only change
    assert up.replace(" {tt.num_stages = 2 : i32}", "") == plain["moe_gate_up_fma_fp4"]


@pytest.mark.parametrize("target", ["cuda", "rocm"])
@pytest.mark.parametrize("mode", ["mma8", "mma8t"])
def test_fp8_dots_of_listed_kernels_allow_imprecise_acc(monkeypatch, target, mode):
    """The mma8 GEMV kernels' e4m3 dots carry maxNumImpreciseAcc = 32 (their K), which lets Triton
    take the sm_90 wgmma FP8 path; DSV41_FP8_IMPRECISE_ACC=off leaves them unmarked; kernels not
    listed (the bf16-operand 'expand' GEMV) never get it; a bad value is a clear error."""
    from pallas_kernels.quantized_matmul import pallas_triton

    assert f"qmm_fp8_{mode}" in triton_compat.FP8_IMPRECISE_ACC_KERNELS
    fn, *specs = inspect_sass._cases("gemv", tokens=1, config=(16, 128, 128, 1, 4, 4))

    def ttir(env, scale_mode):
        monkeypatch.setenv(triton_compat.FP8_IMPRECISE_ACC_ENV, env)
        monkeypatch.setitem(pallas_triton.SCALE_MODE, "fp8", scale_mode)
        (k,) = inspect_sass.triton_kernels(lambda *a: fn(*a), *specs, target=target)
        return k["name"], k["ttir"]

    name, on = ttir("on", mode)
    assert name == f"qmm_fp8_{mode}"
    dots = on.count("tt.dot ")
    assert dots == 4 and on.count("maxNumImpreciseAcc = 32") == dots  # bk 128: four 32-wide dots
    _, off = ttir("off", mode)
    assert "maxNumImpreciseAcc" not in off and off.count("tt.dot ") == dots
    name, expand = ttir("on", "expand")
    assert name == "qmm_fp8" and "maxNumImpreciseAcc" not in expand
    monkeypatch.setenv(triton_compat.FP8_IMPRECISE_ACC_ENV, "maybe")
    with pytest.raises(ValueError, match="DSV41_FP8_IMPRECISE_ACC='maybe'"):
        triton_compat.fp8_imprecise_acc_enabled()


def test_bad_imprecise_acc_value_fails_at_import():
    """A bad ``DSV41_FP8_IMPRECISE_ACC`` stops the import with the variable named, before any kernel."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import dsv41_jax, pallas_kernels.triton_compat"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "DSV41_FP8_IMPRECISE_ACC": "yes"})
    assert out.returncode != 0 and "DSV41_FP8_IMPRECISE_ACC='yes': expected on or off" in out.stderr


def test_cache_modifier_works_with_both_lookups():
    """jax 0.12 strips the dot before its table lookup; jax 0.11.2 looks ".cg" up as is in a table
    keyed "cg" (KeyError on the H200). After the patch both lookups find CG, in a table keyed the
    old way and in the installed lowering's."""
    from jax._src.pallas.triton import lowering

    from pallas_kernels import triton_compat

    table = {k: v for k, v in lowering._STR_TO_CACHE_MODIFIER.items() if not k.startswith(".")}
    assert triton_compat._patch_cache_modifiers(table)
    assert table[".cg"].name == "CG" and table["cg"].name == "CG"
    assert triton_compat.CACHE_MODIFIERS_PATCHED and lowering._STR_TO_CACHE_MODIFIER[".cg"].name == "CG"
