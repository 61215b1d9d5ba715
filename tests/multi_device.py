"""Run a check on several virtual CPU devices: ``--xla_force_host_platform_device_count`` must be set
before JAX is imported, so such checks run as a Python subprocess of the test."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(devices: int) -> dict:
    """The environment of a subprocess with ``devices`` CPU devices and the checkout importable (the
    test session's other XLA flags kept, but for its backend optimization level: at -O0 an 8-device
    all-reduce hung, tests/conftest.py)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f and "xla_backend_optimization_level" not in f]
    return dict(os.environ, XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
                JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_script(script: str, devices: int, timeout: int = 900) -> str:
    """Run ``script`` (Python source ending by printing ``OK``) on ``devices`` CPU devices; fail the
    test with the end of its output otherwise. Returns its stdout."""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(devices), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout
