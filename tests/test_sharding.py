"""Sharding: mesh specs, the partition-rule table, expert parallelism, sharded forward + greedy
generation equal to one device on several meshes (tp, ep, dp x tp x ep), and the engine on a mesh
(``Engine(..., mesh=)``: same tokens as one device, no cache row crossing dp groups).

Multi-device checks run tests/sharding_worker.py in subprocesses with
``--xla_force_host_platform_device_count=8`` (it must be set before JAX is imported, and must not
leak into the other tests). The subprocesses are started together, once per test run, as soon as
collection has finished (``start_jobs``, called by tests/conftest.py; under xdist by worker gw0,
whichever worker then runs these tests reads their results), so they overlap the whole suite.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import jax
import pytest
from jax.sharding import PartitionSpec as P

import multi_device
from dsv41_jax.config import get_preset
from dsv41_jax.options import RunOptions
from dsv41_jax.params import param_specs
from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
from sharding import distributed
from sharding.mesh import MeshSpecError, make_mesh, parse_mesh_spec
from sharding.rules import cache_partition_specs, explain, param_partition_specs
from sharding.step import collective_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "sharding_worker.py")

F32_MESHES = "tp=4;ep=4;dp=2,tp=2,ep=2"  # tp=2 is inside dp x tp x ep
QUANT_MESHES = "dp=2,tp=2,ep=2"
MOE_MESHES = "ep=2,tp=2;dp=2,ep=2,tp=2;ep=8;tp=4"
ENGINE_MESHES = "dp=2,tp=2,ep=2"  # the engine has 4 slots (sharding_worker.ENGINE_BATCH); dp alone is a subcase

_ENGINE = ["--engine", "--meshes", ENGINE_MESHES, "--kv", "reference"]
JOBS = {
    "f32": ["--meshes", F32_MESHES, "--dtype", "float32", "--kv", "float32"],
    "quant": ["--meshes", QUANT_MESHES, "--dtype", "float32", "--kv", "reference", "--check-collectives"],
    "moe": ["--moe-unit", "--meshes", MOE_MESHES],
    # the engine check in three processes (one device; the pipelined loop; the synced loop): one
    # process took 682 CPU-s alone (12 programs of 40-90 s), the longest path of the suite
    "engine:single": [*_ENGINE, "--engine-part", "single"],
    "engine:device": [*_ENGINE, "--engine-part", "device"],
    "engine:host": [*_ENGINE, "--engine-part", "host"],
}
# each job's exit status is written to <dir>/<job>.rc when it ends, so a process that did not start
# the jobs (the other xdist worker) can wait for them
_WRAP = ("import os, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
         "open(sys.argv[1] + '.tmp', 'w').write(str(rc)); os.replace(sys.argv[1] + '.tmp', sys.argv[1])")
_STARTED: dict = {}  # job name -> Popen, in the process that started them
_DIR: list = []  # the job directory this process uses


def fake_mesh(**sizes):
    return types.SimpleNamespace(shape={"dp": 1, "ep": 1, "tp": 1, **sizes})


# ------------------------------------------------------------------------------------------------
# mesh specs


def test_parse_mesh_spec():
    assert parse_mesh_spec("dp=1,tp=2,ep=2") == {"dp": 1, "ep": 2, "tp": 2}
    assert parse_mesh_spec("tp=4") == {"dp": 1, "ep": 1, "tp": 4}
    assert parse_mesh_spec("") == {"dp": 1, "ep": 1, "tp": 1}
    assert parse_mesh_spec({"ep": 8}) == {"dp": 1, "ep": 8, "tp": 1}
    assert parse_mesh_spec("dp=-1 tp=2")["dp"] == -1
    for bad, msg in (("tp=2,xx=2", "unknown axis"), ("tp=0", ">= 1"), ("tp=two", "integer"), ("tp", "AXIS=SIZE"),
                     ("tp=2,tp=4", "twice"), ("dp=-1,tp=-1", "at most one")):
        with pytest.raises(MeshSpecError, match=msg):
            parse_mesh_spec(bad)


def test_make_mesh_device_count():
    n = jax.device_count()
    with pytest.raises(MeshSpecError, match="needs .* devices"):
        make_mesh(f"tp={n + 1}")
    m = make_mesh("dp=-1")
    assert m.axis_names == ("dp", "ep", "tp") and m.shape["dp"] == n


def test_engine_batch_must_split_over_dp():
    from dsv41_jax.engine import Engine

    model = types.SimpleNamespace(cfg=get_preset("tiny"))  # the check comes before the model is used
    with pytest.raises(ValueError, match=r"batch size 3 .* dp=2 \(--batch-size / --mesh\)"):
        Engine(model, batch_size=3, max_seq_len=32, mesh=fake_mesh(dp=2, tp=2))


def test_collective_ops_device_groups():
    """Which mesh axes a collective's device groups span, in the HLO spellings XLA uses."""
    mesh = fake_mesh(dp=2, ep=2, tp=2)  # device id = (dp, ep, tp) position, tp innermost
    hlo = "\n".join([
        "  %a = f32[2,64]{1,0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%r",
        "  %b = s32[2,2]{0,1} all-gather(%y), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={1}",
        "  %c = f32[2,64]{1,0} all-reduce(%z), replica_groups=mesh['dp'=2,'ep'=2,'tp'=2] {'ep'}, to_apply=%r",
        "  %d = (f32[2]{0}, u8[2,8]{1,0}) collective-permute(%w), source_target_pairs={{0,4},{4,0}}",
        "  %e = f32[8]{0} all-reduce(%v), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%r",
        "  %f = f32[8]{0} all-reduce(%u), replica_groups={}, to_apply=%r",
        "  %g = (f32[2]{0}, s32[2]{0}) fusion(%all-gather.10, %all-gather.9), kind=kLoop",
    ])
    ops = [(c["op"], c["dtype"], c["shape"], c["axes"]) for c in collective_ops(hlo, mesh)]
    assert ops == [("all-reduce", "f32", [2, 64], ["tp"]), ("all-gather", "s32", [2, 2], ["dp"]),
                   ("all-reduce", "f32", [2, 64], ["ep"]), ("collective-permute", "f32", [2], ["dp"]),
                   ("collective-permute", "u8", [2, 8], ["dp"]), ("all-reduce", "f32", [8], ["dp", "ep"]),
                   ("all-reduce", "f32", [8], ["dp", "ep", "tp"])]


# ------------------------------------------------------------------------------------------------
# the rule table


def _assert_scales_follow(specs, shapes):
    """Every quantized node's scale spec equals its data spec, and every split dim divides."""
    def check(spec, shp):
        if isinstance(shp, (Fp8Tensor, Fp4Tensor)):
            assert spec.data == spec.scale
            for arr, sp in ((shp.data, spec.data), (shp.scale, spec.scale)):
                check(sp, arr)
            return
        assert isinstance(spec, P)
        assert len(spec) <= len(shp.shape)
    jax.tree.map(check, specs, shapes, is_leaf=lambda x: isinstance(x, (P, Fp8Tensor, Fp4Tensor)))


def test_param_rules_real_model():
    cfg = get_preset("v41-flash")
    shapes = param_specs(cfg)
    specs = param_partition_specs(cfg, fake_mesh(ep=8, tp=8))
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        jax.tree.map(lambda _: P(), shapes))
    _assert_scales_follow(specs, shapes)
    L = specs["layers"]["3"]
    assert L["ffn"]["experts"]["w1"].data == P("ep", "tp")  # 384 experts / 8, 2304 hidden / (8 x 32)
    assert L["ffn"]["experts"]["w2"].data == P("ep", None, "tp")
    assert L["attn"]["wq_b"].data == P("tp")  # 64 heads / 8
    assert L["attn"]["wo_a"].data == P("tp") and L["attn"]["wo_b"].data == P(None, "tp")
    assert L["attn"]["wq_a"].data == P() and L["attn"]["attn_sink"] == P()
    assert L["ffn"]["shared_experts"]["w1"].data == P("tp")
    assert specs["embed"]["weight"] == P("tp") and specs["head"]["weight"] == P("tp")
    assert L["ffn"]["gate"]["weight"] == P() and L["hc_attn_fn"] == P()
    # Engram tables: replicated on devices (row-split gathers would all-reduce e8m0 scales, which
    # NCCL rejects); the engine / loader keep them on the host by default
    e1 = specs["layers"]["1"]["engram"]["embed"]
    assert e1.data == e1.scale == P()


def test_param_rules_tiny_fall_back_to_replication():
    cfg = get_preset("tiny")  # dim 64, 4 heads, 8 experts, hidden 32: most tp splits do not divide
    shapes = param_specs(cfg)
    specs = param_partition_specs(cfg, fake_mesh(dp=2, ep=4, tp=8))
    _assert_scales_follow(specs, shapes)
    notes = explain()
    assert notes and all(isinstance(n, tuple) for n in notes)
    L = specs["layers"]["0"]
    assert L["ffn"]["experts"]["w1"].data == P("ep")  # 8 experts / 4; hidden 32 < 8 x 32 -> replicated
    assert L["attn"]["wq_b"].data == P()  # 4 heads cannot split 8 ways
    assert specs["embed"]["weight"] == P("tp")  # vocab 129280 / 8
    specs4 = param_partition_specs(cfg, fake_mesh(tp=4))
    assert specs4["layers"]["0"]["attn"]["wq_b"].data == P("tp")  # 4 heads of 64 rows, 32-row blocks


def test_cache_rules():
    cfg = get_preset("tiny")
    for kv in ("float32", "reference"):
        opts = RunOptions(dtype="float32", kv_cache_dtype=kv)
        s = cache_partition_specs(cfg, fake_mesh(dp=2, tp=2), 4, 32, opts)
        assert s["pos"] == P("dp")
        leaves = jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, P))
        assert all(x == P("dp") for x in leaves)
        s3 = cache_partition_specs(cfg, fake_mesh(dp=2), 3, 32, opts)  # 3 rows: replicated
        assert all(x == P() for x in jax.tree.leaves(s3, is_leaf=lambda x: isinstance(x, P)))


def test_distributed_env():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
           "JAX_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed.env_config(env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2,
                                          "process_id": 1, "local_device_ids": [0, 1]}
    assert distributed.env_config({"DSV41_PROCESS_ID": "3"}) == {"process_id": 3}
    assert distributed.env_config({}) == {}
    assert not distributed.in_cluster({})


# ------------------------------------------------------------------------------------------------
# 8 virtual CPU devices (subprocesses)


def _job_dir() -> str:
    if not _DIR:
        uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every xdist worker of one run
        _DIR.append(os.path.join(tempfile.gettempdir(), f"dsv41_sharding_{uid}") if uid else
                    tempfile.mkdtemp(prefix="dsv41_sharding_"))
    return _DIR[0]


def start_jobs(force: bool = False) -> None:
    """Start every job of ``JOBS`` in the background (all at once: one after another they took 898
    and 995 s in two CI runs on the 2-core host, 874 s at once in session 8). Under xdist only worker
    gw0 starts them (``force``: this process, whatever it is; the fixture's fallback)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if _STARTED or (worker not in (None, "gw0") and not force):
        return
    d = _job_dir()
    if worker is not None:  # a shared directory per xdist run, kept after it: drop those a day old
        for old in glob.glob(os.path.join(tempfile.gettempdir(), "dsv41_sharding_*")):
            if time.time() - os.path.getmtime(old) > 86400:
                shutil.rmtree(old, ignore_errors=True)
    os.makedirs(d, exist_ok=True)
    env = multi_device.env(8)
    for k, args in JOBS.items():
        base = os.path.join(d, k)
        with open(base + ".out", "w") as so, open(base + ".err", "w") as se:
            _STARTED[k] = subprocess.Popen([sys.executable, "-c", _WRAP, base + ".rc", sys.executable, WORKER, *args],
                                           cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)


def finish_jobs(interrupted: bool) -> None:
    """End of this process's session: jobs it started are waited for (another xdist worker may be
    reading them), or ended when the run was interrupted; without xdist their directory is removed."""
    for p in _STARTED.values():
        if p.poll() is None and interrupted:
            os.killpg(p.pid, signal.SIGTERM)
        p.wait()
    if _DIR and "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(_DIR[0], ignore_errors=True)


@pytest.fixture(scope="module")
def worker_results():
    d = _job_dir()
    if not os.path.exists(os.path.join(d, next(iter(JOBS)) + ".out")):
        start_jobs(force=True)  # not started at collection (e.g. the module imported another way)
    deadline = time.monotonic() + 3600  # they share the 2 cores with the rest of the suite
    out = {}
    for k in JOBS:
        base = os.path.join(d, k)
        while not os.path.exists(base + ".rc"):
            assert time.monotonic() < deadline, f"sharding worker {k} did not finish"
            time.sleep(1.0)
        rc = int(pathlib.Path(base + ".rc").read_text())
        so, se = pathlib.Path(base + ".out").read_text(), pathlib.Path(base + ".err").read_text()
        if rc:
            raise AssertionError(f"sharding worker {k} failed ({rc}):\n{se[-4000:]}")
        out.setdefault(k.split(":")[0], []).extend(json.loads(line) for line in so.splitlines() if line.startswith("{"))
    return out


def test_expert_parallel_matches_single_device(worker_results):
    rows = worker_results["moe"]
    assert len(rows) == 2 * 2 * len(MOE_MESHES.split(";"))
    for r in rows:
        assert r["rel_err"] < 2e-6, r


def _by_mesh(rows):
    return {r["mesh"]: r for r in rows if r["event"] == "mesh"}


def test_sharded_generation_float32(worker_results):
    rows = worker_results["f32"]
    assert rows[0]["devices"] == 8
    single = next(r for r in rows if r["event"] == "single")
    meshes = _by_mesh(rows)
    assert set(meshes) == set(F32_MESHES.split(";"))
    for spec, r in meshes.items():
        assert r["tokens"] == single["tokens"], spec
        assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["max_abs_ref"]), (spec, r["max_abs_diff"])


def test_sharded_generation_reference_quant(worker_results):
    rows = worker_results["quant"]
    single = next(r for r in rows if r["event"] == "single")
    for spec, r in _by_mesh(rows).items():
        assert r["tokens"] == single["tokens"], spec
        assert r["max_abs_diff"] <= 1e-3 * max(1.0, r["max_abs_ref"]), (spec, r["max_abs_diff"])


def _engine_rows(worker_results):
    rows = worker_results["engine"]
    single = next(r for r in rows if r["mesh"] == "single")
    meshed = [r for r in rows if r["mesh"] != "single"]
    first = ENGINE_MESHES.split(";")[0]
    assert sorted((r["mode"], r["mesh"]) for r in meshed) == sorted(
        [("device", m) for m in ENGINE_MESHES.split(";")] + [("host", first)])
    return single, meshed


def test_engine_on_mesh(worker_results):
    """Engine(..., mesh=) gives one device's tokens, greedy and sampled, in the pipelined loop
    (Engram tables on the devices) and the synced one (host tables), with more requests than slots."""
    single, meshed = _engine_rows(worker_results)
    assert single["pipelined"]
    for r in meshed:
        assert r["pipelined"] == (r["mode"] == "device"), r["mesh"]
        assert r["tokens"] == single["tokens"], (r["mode"], r["mesh"])


def test_engine_decode_step_moves_no_cache_rows(worker_results):
    """The engine's compiled decode step on a dp mesh: nothing crosses data-parallel groups (each
    group's cache rows stay on its devices; with dp alone there is no collective at all), no
    collective-permute, no u8 / FP8 / e8m0 buffer anywhere; what tp / ep move is f32 activations,
    plus the s32 per-row indices of sampling over the tp-split vocabulary (at most B/dp x tp)."""
    _, meshed = _engine_rows(worker_results)
    for r in meshed:
        sizes = parse_mesh_spec(r["mesh"])
        coll = r["collectives"]
        where = (r["mode"], r["mesh"])
        if sizes["tp"] == sizes["ep"] == 1:
            assert coll == [], where
            continue
        assert coll, where
        for c in coll:
            assert "dp" not in c["axes"], (where, c)
            assert c["op"] != "collective-permute", (where, c)
            if c["dtype"] == "s32":
                n = 1
                for d in c["shape"]:
                    n *= d
                assert c["axes"] == ["tp"] and n <= 4 // sizes["dp"] * sizes["tp"], (where, c)
            else:
                assert c["dtype"] in ("f32", "bf16"), (where, c)


def test_collectives_carry_only_float_activations(worker_results):
    """The compiled dp x tp x ep forward step communicates activations only: f32 all-reduces /
    all-gathers (no FP8/e8m0 element types, which NCCL rejects at run time, and no cache rows:
    the dp shard_map keeps each row's cache on its devices; across dp groups only the logits)."""
    from sharding.step import NCCL_UNSUPPORTED

    rows = [r for r in worker_results["quant"] if r["event"] == "mesh"]
    assert rows
    for r in rows:
        coll = r["collectives"]
        assert coll, r["mesh"]
        types = {k.split(":")[1] for k in coll}
        assert not types & set(NCCL_UNSUPPORTED), coll
        assert types <= {"f32", "bf16"}, coll
        # between dp groups only the logits, which this step returns replicated (logits_layout)
        vocab = get_preset("tiny").vocab_size
        for c in r["dp_collectives"]:
            assert c["op"] == "all-gather" and c["dtype"] == "f32" and c["shape"][-1] == vocab, (r["mesh"], c)


def test_profile_comm_classification():
    """The worker's profile counts NCCL kernels, XLA collectives and peer-to-peer copy streams as
    communication, and nothing else."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sharding_worker_mod", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.is_comm("Stream #30(MemcpyP2P)", "MemcpyP2P")
    assert mod.is_comm("Stream #12(Compute)", "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert mod.is_comm("XLA Ops", "all-reduce-start.3")
    assert not mod.is_comm("Stream #12(Compute)", "moe_gate_up_fma_fp4")
    assert not mod.is_comm("Stream #24(Compute,MemcpyD2D,Memset)", "loop_add_fusion")
