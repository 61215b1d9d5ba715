"""dsv41_jax.xla_flags: the CLIs' XLA runtime defaults never override what the user set."""

from dsv41_jax.xla_flags import GPU_RUNTIME_DEFAULTS, apply_runtime_defaults, with_runtime_defaults


def test_defaults_added_to_empty_flags():
    out = with_runtime_defaults("")
    for k, v in GPU_RUNTIME_DEFAULTS.items():
        assert f"--{k}={v}" in out.split()


def test_user_flag_wins_and_others_are_kept():
    user = "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"
    out = with_runtime_defaults(user).split()
    assert "--xla_gpu_enable_command_buffer=" in out and "--xla_dump_to=/tmp/x" in out
    assert sum(t.startswith("--xla_gpu_enable_command_buffer") for t in out) == 1
    assert "--xla_gpu_graph_min_graph_size=1" in out
    assert with_runtime_defaults(" ".join(out)) == " ".join(out)  # idempotent


def test_off_switch(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/y")
    monkeypatch.setenv("DSV41_XLA_DEFAULTS", "off")
    assert apply_runtime_defaults() == "--xla_dump_to=/tmp/y"
    monkeypatch.setenv("DSV41_XLA_DEFAULTS", "")
    assert "--xla_gpu_graph_min_graph_size=1" in apply_runtime_defaults().split()


def test_xla_accepts_every_default_flag():
    """XLA aborts at start-up on a flag it does not know: start a backend with all the defaults."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=with_runtime_defaults(""), JAX_PLATFORMS="cpu")
    code = "import jax.numpy as jnp; print(float(jnp.ones(3).astype(jnp.bfloat16).sum()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-2000:]
    assert "--xla_allow_excess_precision=false" in env["XLA_FLAGS"].split()


def test_autotune_results_dump_then_load(monkeypatch, tmp_path):
    """DSV41_AUTOTUNE_RESULTS: a missing file is written (dump flag), an existing one read (load flag);
    a directory or a file in a missing directory is refused naming the variable; XLA parses both
    flags (a CPU backend starts with each)."""
    import os
    import subprocess
    import sys

    import pytest

    from dsv41_jax.xla_flags import autotune_results_flags

    path = tmp_path / "autotune.txt"
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("DSV41_AUTOTUNE_RESULTS", str(path))
    dump = apply_runtime_defaults().split()
    assert f"--xla_gpu_dump_autotune_results_to={path}" in dump and "--xla_gpu_graph_min_graph_size=1" in dump
    path.write_text("")
    monkeypatch.setenv("XLA_FLAGS", "")
    load = apply_runtime_defaults().split()
    assert f"--xla_gpu_load_autotune_results_from={path}" in load
    assert not [t for t in load if "dump_autotune" in t]
    with pytest.raises(ValueError, match="DSV41_AUTOTUNE_RESULTS=.* is a directory"):
        autotune_results_flags(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        autotune_results_flags(str(tmp_path / "missing" / "a.txt"))
    monkeypatch.delenv("DSV41_AUTOTUNE_RESULTS")
    assert autotune_results_flags() == {}
    for flags in (dump, [f"--xla_gpu_dump_autotune_results_to={tmp_path / 'b.txt'}"]):
        env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-2000:]
