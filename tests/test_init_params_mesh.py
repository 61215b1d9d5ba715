"""Random weights built straight onto a mesh (``init_params(cfg, seed, mesh=)``, what the benchmark
uses for models larger than one device) equal the single-device ones bit for bit, with the
partition rules' shardings; and ``python -m dsv41_jax.bench --mesh`` runs end to end. On 4
virtual CPU devices in a subprocess (the device count must be set before JAX is imported)."""

from __future__ import annotations

import json
import subprocess
import sys

from multi_device import ROOT, env, run_script

SCRIPT = r'''
import jax, numpy as np
from dsv41_jax.config import get_preset
from dsv41_jax.params import init_params
from sharding.mesh import make_mesh
from sharding.rules import param_shardings

cfg = get_preset("tiny")
mesh = make_mesh("dp=1,tp=2,ep=2")
a = init_params(cfg, 3)
b = init_params(cfg, 3, mesh=mesh)
want = jax.tree.leaves(param_shardings(cfg, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
assert len(la) == len(lb) == len(want)
split = 0
for x, y, s in zip(la, lb, want):
    assert y.sharding.is_equivalent_to(s, y.ndim), (y.sharding, s)
    split += not s.is_fully_replicated
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()
assert split > 50, split
print(split, "OK")
'''


def test_init_params_on_a_mesh_equals_one_device():
    run_script(SCRIPT, devices=4, timeout=600)


def test_bench_on_a_mesh(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.bench", "--preset", "tiny", "--mesh", "dp=2,tp=2",
                        "--batch-sizes", "2", "--new-tokens", "4", "--runs", "1", "--prompt-len", "16",
                        "--prefill-lens", "0", "--prefill-tokens", "16", "--json", str(out)], cwd=ROOT, env=env(4),
                       capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert "4 x" in res["device"] and "dp=2,tp=2" in res["device"]
    (row,) = res["decode"]
    assert row["batch"] == 2 and row["median_tok_s"] > 0 and row["prefill_tok_s"] > 0
    assert any("mesh dp=2" in n for n in res["notes"])
    # 16 prefill tokens per step over 2 rows: 8 per row, and the bench says so
    assert any("batch 2: prompts prefilled 8 tokens per row per step" in n for n in res["notes"]), res["notes"]
    assert row["host_dispatch_ms"] > 0 and row["host_wait_ms"] >= 0
    # a batch that does not split over dp is refused with the flag to fix
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.bench", "--preset", "tiny", "--mesh", "dp=2",
                        "--batch-sizes", "3"], cwd=ROOT, env=env(4), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "multiple of dp=2" in r.stderr and "Traceback" not in r.stderr
