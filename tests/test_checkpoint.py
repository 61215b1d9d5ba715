"""Checkpoints: official safetensors <-> parameter tree <-> Orbax, bit-exact, with clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors

from dsv41_jax.checkpoint import (
    CheckpointError,
    config_to_hf,
    SafetensorsFile,
    gather_rows,
    load_checkpoint,
    restore_params,
    save_checkpoint,
    save_params,
)
from dsv41_jax.checkpoint.layout import check_table, leaf_table
from dsv41_jax.checkpoint.safetensors_io import write_file
from dsv41_jax.checkpoint.synthetic import random_params
from dsv41_jax.config import ModelConfig, get_preset
from dsv41_jax.params import official_shapes
from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, quantize_fp8, quantize_mxfp4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "v41_tiny_a")
SHARD = 6 << 20  # tiny checkpoint (~43 MB) -> several shards


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.reshape(-1).view(np.uint8)


def assert_trees_bit_equal(a, b):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, "tree structures differ"
    for (path, x), y in zip(la, lb):
        name = jax.tree_util.keystr(path)
        assert np.dtype(x.dtype) == np.dtype(y.dtype), (name, x.dtype, y.dtype)
        assert tuple(x.shape) == tuple(y.shape), (name, x.shape, y.shape)
        assert np.array_equal(bits(x), bits(y)), name


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny")
    return cfg, random_params(cfg, seed=3)


@pytest.fixture(scope="module")
def tiny_ckpt(tiny, tmp_path_factory):
    cfg, params = tiny
    path = str(tmp_path_factory.mktemp("ck") / "tiny")
    save_checkpoint(params, cfg, path, max_shard_bytes=SHARD)
    return path


def test_name_table_covers_official_names():
    for cfg in (get_preset("tiny"), get_preset("v41-flash"), ModelConfig.from_json(FIXTURE)):
        check_table(cfg)
        # the HF composite config.json the writer emits reads back as the same config
        assert ModelConfig.from_dict(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def test_hf_style_aliases_and_single_file(tmp_path):
    """convert.py's aliases (weight_scale_inv -> scale, e_score_correction_bias -> bias) and a
    single .safetensors file with an explicit config."""
    cfg = get_preset("tiny")
    params = random_params(cfg, seed=5)
    d = str(tmp_path / "one")
    save_checkpoint(params, cfg, d, max_shard_bytes=1 << 40)
    (fn,) = [f for f in os.listdir(d) if f.endswith(".safetensors")]

    def rename(t):
        t["layers.0.attn.wq_a.weight_scale_inv"] = t.pop("layers.0.attn.wq_a.scale")
        t["layers.2.ffn.gate.e_score_correction_bias"] = t.pop("layers.2.ffn.gate.bias")

    _rewrite(d, fn, rename)
    _, loaded = load_checkpoint(os.path.join(d, fn), cfg)
    assert_trees_bit_equal(params, loaded)


# ------------------------------------------------------------------------------------------------
# round trips


def test_official_roundtrip_bit_exact(tiny, tiny_ckpt, monkeypatch):
    cfg, params = tiny
    files = sorted(f for f in os.listdir(tiny_ckpt) if f.endswith(".safetensors"))
    assert len(files) >= 3
    assert ModelConfig.from_json(tiny_ckpt) == cfg  # HF composite with quantization_config
    with open(os.path.join(tiny_ckpt, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [32, 32]
    cfg2, loaded = load_checkpoint(tiny_ckpt)
    assert cfg2 == cfg
    assert_trees_bit_equal(params, loaded)
    from dsv41_jax.checkpoint import loader

    monkeypatch.setattr(loader, "CHUNK_ON_CPU", True)  # large leaves in row blocks joined on the device
    assert_trees_bit_equal(params, load_checkpoint(tiny_ckpt, host_budget_bytes=1 << 16)[1])
    monkeypatch.setattr(loader, "CHUNK_ON_CPU", False)
    assert isinstance(loaded["layers"]["0"]["attn"]["wq_b"], Fp8Tensor)
    assert isinstance(loaded["layers"]["0"]["ffn"]["experts"]["w1"], Fp4Tensor)
    # Engram tables stay on the host, memory-mapped
    tbl = loaded["layers"]["1"]["engram"]["embed"]
    assert isinstance(tbl.data, np.memmap) and tbl.data.dtype == ml_dtypes.float8_e4m3fn
    rows = gather_rows(tbl, np.array([[0, 5], [433, 7]]))
    assert rows.data.shape == (2, 2, 32) and rows.scale.shape == (2, 2, 1)
    assert np.array_equal(bits(rows.data[1, 0]), bits(params["layers"]["1"]["engram"]["embed"].data[433]))


def test_official_files_match_safetensors_library(tiny, tiny_ckpt):
    """The official safetensors library reads our shards; names, dtypes, shapes and bytes agree."""
    cfg, params = tiny
    shapes = official_shapes(cfg)
    seen = {}
    for fn in sorted(os.listdir(tiny_ckpt)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(tiny_ckpt, fn), "rb") as f:
                for name, t in safetensors.deserialize(f.read()):
                    seen[name] = t
    assert set(seen) == set(shapes)
    assert seen["layers.0.ffn.experts.3.w1.weight"]["dtype"] == "I8"  # packed FP4, as released
    assert seen["layers.0.ffn.experts.3.w1.scale"]["dtype"] == "F8_E8M0"
    assert seen["layers.0.attn.wq_b.weight"]["dtype"] == "F8_E4M3"
    assert seen["layers.0.attn.wq_b.scale"]["shape"] == [8, 1]  # [ceil(256/32), ceil(32/32)]
    assert seen["layers.0.hc_attn_fn"]["dtype"] == "F32"
    e3 = params["layers"]["0"]["ffn"]["experts"]["w1"]
    assert bytes(seen["layers.0.ffn.experts.3.w1.weight"]["data"]) == np.asarray(e3.data[3]).tobytes()
    assert bytes(seen["layers.0.ffn.experts.3.w1.scale"]["data"]) == np.asarray(e3.scale[3]).tobytes()
    with open(os.path.join(tiny_ckpt, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    assert set(idx["weight_map"]) == set(shapes)
    assert idx["metadata"]["total_size"] == sum(len(t["data"]) for t in seen.values())


def test_quantize_on_write(tiny, tmp_path):
    """bf16 weights given for an fp8/fp4 config are quantized on write, in DeepSeek's format."""
    cfg, params = tiny
    p = jax.tree.map(lambda x: x, params)  # shallow copy of the containers
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 32)) / 6).astype(ml_dtypes.bfloat16)
    ex = (rng.standard_normal((8, 32, 64)) / 8).astype(ml_dtypes.bfloat16)
    p["layers"]["2"]["attn"]["wq_b"] = {"weight": w}
    p["layers"]["2"]["ffn"]["experts"]["w1"] = {"weight": ex}
    save_checkpoint(p, cfg, str(tmp_path / "q"), max_shard_bytes=SHARD)
    _, loaded = load_checkpoint(str(tmp_path / "q"))
    want = quantize_fp8(jax.numpy.asarray(w), (32, 32))
    got = loaded["layers"]["2"]["attn"]["wq_b"]
    assert np.array_equal(bits(got.data), bits(want.data)) and np.array_equal(bits(got.scale), bits(want.scale))
    want4 = quantize_mxfp4(jax.numpy.asarray(ex), 32)
    got4 = loaded["layers"]["2"]["ffn"]["experts"]["w1"]
    assert np.array_equal(bits(got4.data), bits(want4.data)) and np.array_equal(bits(got4.scale), bits(want4.scale))
    # the bf16 -> fp8 -> dequant error is the format's (<= half an e4m3 ulp relative)
    deq = np.asarray(got.dequantize())
    assert np.max(np.abs(deq - w.astype(np.float32))) <= np.max(np.abs(w.astype(np.float32))) / 8


def test_orbax_roundtrip_and_atomicity(tiny, tmp_path, monkeypatch):
    cfg, params = tiny
    dst = str(tmp_path / "orbax")
    from dsv41_jax.engine import mark_f16_exact_experts

    marked = mark_f16_exact_experts(params)  # an engine's marks (static fields) are not part of a checkpoint
    assert marked["layers"]["2"]["ffn"]["experts"]["w1"].f16_exact
    save_params(marked, dst, cfg)
    assert not os.path.exists(dst + ".partial")
    restored = restore_params(dst, cfg)
    assert_trees_bit_equal(params, restored)
    # a budget of 1 MB (few reads in flight), one thread; TensorStore reads; Orbax's own restore in
    # many partial-restore groups of <= 1 MB
    assert_trees_bit_equal(params, restore_params(dst, cfg, host_budget_bytes=1 << 20, threads=1))
    assert_trees_bit_equal(params, restore_params(dst, cfg, method="tensorstore"))
    # the default restore reads every array of a save_params checkpoint directly (no TensorStore)
    from dsv41_jax.checkpoint.ocdbt_direct import OcdbtIndex

    idx = OcdbtIndex(os.path.join(dst, "params"))
    names = {k.rsplit("/", 1)[0] for k in idx.values}
    assert len(names) > 100 and all(idx.array(n) is not None for n in names)
    assert_trees_bit_equal(params, restore_params(dst, cfg, method="orbax", host_budget_bytes=1 << 20))
    assert isinstance(restored["layers"]["4"]["engram"]["embed"].data, np.memmap)
    with pytest.raises(CheckpointError, match="already exists"):
        save_params(params, dst, cfg)
    with pytest.raises(CheckpointError, match="different config"):
        restore_params(dst, cfg.replace(route_scale=2.0))

    # an interrupted conversion leaves nothing that looks complete
    from dsv41_jax.checkpoint import orbax_io

    def boom(*a, **k):  # interrupted after the Orbax part, while writing the Engram tables
        raise KeyboardInterrupt

    bad = str(tmp_path / "interrupted")
    monkeypatch.setattr(orbax_io, "_write_npy_u8", boom)
    with pytest.raises(KeyboardInterrupt):
        save_params(params, bad, cfg)
    assert not os.path.exists(bad)
    with pytest.raises(CheckpointError, match="interrupted"):
        restore_params(bad, cfg)


def _resave(src: str, dst: str, **save_kw) -> None:
    """Copy of the Orbax checkpoint ``src`` with its arrays re-written by Orbax with other options."""
    import orbax.checkpoint as ocp

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("params"))
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    tree = ckptr.restore(os.path.join(src, "params"))
    handler = ocp.PyTreeCheckpointHandler(use_compression=save_kw.pop("use_compression", False))
    sa = jax.tree.map(lambda _: ocp.SaveArgs(**save_kw), tree)
    ocp.Checkpointer(handler).save(os.path.join(dst, "params"), args=ocp.args.PyTreeSave(tree, save_args=sa))


def test_orbax_restore_other_layouts(tiny, tmp_path):
    """The direct reader handles several chunks per array (split on any axis) and leaves arrays
    it cannot read directly (zstd-compressed) to TensorStore; all bit-exact."""
    from dsv41_jax.checkpoint import orbax_io

    cfg, params = tiny
    dst = str(tmp_path / "orbax")
    save_params(params, dst, cfg)
    chunked = str(tmp_path / "chunked")
    _resave(dst, chunked, chunk_byte_size=4096)  # Orbax splits the largest axes first
    idx = orbax_io.OcdbtIndex(os.path.join(chunked, "params"))
    w = idx.array("layers.0.ffn.experts.w1.data")
    assert w is not None and any(c < n for c, n in zip(w.chunks[1:], w.shape[1:]))  # not whole rows
    assert_trees_bit_equal(params, restore_params(chunked, cfg))
    compressed = str(tmp_path / "zstd")
    _resave(dst, compressed, use_compression=True)
    assert orbax_io.OcdbtIndex(os.path.join(compressed, "params")).array("embed.weight") is None
    assert_trees_bit_equal(params, restore_params(compressed, cfg))


def test_ocdbt_index_walks_a_deep_btree(tmp_path):
    """read_values against TensorStore's own reads on a database with a B+tree of several levels,
    inline and out-of-line values."""
    import tensorstore as ts

    from dsv41_jax.checkpoint.ocdbt_direct import read_values

    root = str(tmp_path / "db")
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/",
                          "config": {"max_decoded_node_bytes": 256, "max_inline_value_bytes": 16}}).result()
    want = {f"p/{'x' * (i % 3)}key{i:03d}/0.{i % 2}": bytes([i]) * (1 + (i * 7) % 40) for i in range(80)}
    with ts.Transaction() as txn:
        for k, v in want.items():
            kv.with_transaction(txn)[k] = v
    got = read_values(root)
    assert sorted(got) == sorted(want)
    for k, v in got.items():
        if v.inline is not None:
            data = v.inline
        else:
            with open(v.file, "rb") as f:
                f.seek(v.offset)
                data = f.read(v.length)
        assert data == want[k], k
    assert any(v.inline is None for v in got.values()) and any(v.inline is not None for v in got.values())
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{root}/").result()).result()
    assert manifest["versions"][-1]["root_height"] >= 2


_MESH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax, numpy as np
    assert jax.device_count() == 8, jax.devices()
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv41_jax.config import get_preset
    from dsv41_jax.checkpoint import load_checkpoint, save_params, restore_params
    from dsv41_jax.checkpoint.orbax_io import default_shardings
    from dsv41_jax.checkpoint.synthetic import random_params
    from dsv41_jax.params import param_specs
    src, out = sys.argv[1], sys.argv[2]
    cfg = get_preset("tiny")
    ref = random_params(cfg, seed=3)
    def same(a, b):
        la, ta = jax.tree.flatten(a); lb, tb = jax.tree.flatten(b)
        assert ta == tb
        for x, y in zip(la, lb):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    # official safetensors straight onto a (2, 4) mesh: experts over 'x', rest over 'y' / replicated
    m24 = jax.make_mesh((2, 4), ("x", "y"))
    def rule(name, sds):
        if ".experts." in name:
            return NamedSharding(m24, P("x"))
        if len(sds.shape) == 2 and sds.shape[0] % 4 == 0:
            return NamedSharding(m24, P("y", None))
        return None  # -> replicated over the mesh
    _, p = load_checkpoint(src, mesh=m24, shardings=rule, engram_on_host=False)
    w1 = p["layers"]["0"]["ffn"]["experts"]["w1"].data
    assert w1.sharding.spec == P("x") and len(w1.addressable_shards) == 8
    assert w1.addressable_shards[0].data.shape == (4, 32, 32)
    assert p["embed"]["weight"].sharding.spec == P("y", None)
    tbl = p["layers"]["1"]["engram"]["embed"].data  # engram_on_host=False: on the mesh (434 rows: replicated)
    assert isinstance(tbl, jax.Array) and tbl.sharding.spec == P() and len(tbl.sharding.device_set) == 8
    same(ref, p)
    # Orbax written from that mesh, restored onto another mesh (8,) with a sharding pytree
    save_params(p, out, cfg)
    m8 = jax.make_mesh((8,), ("d",))
    rule8 = default_shardings(m8)
    from dsv41_jax.checkpoint.layout import leaf_table
    entries, treedef = leaf_table(cfg)
    sh_tree = jax.tree_util.tree_unflatten(treedef, [rule8(e.name, jax.ShapeDtypeStruct(e.shape, e.dtype)) for e in entries])
    r = restore_params(out, cfg, shardings=sh_tree, engram_on_host=False)
    same(ref, r)
    leaves = jax.tree.leaves(r); shs = jax.tree.leaves(sh_tree, is_leaf=lambda s: isinstance(s, NamedSharding))
    assert all(x.sharding == s for x, s in zip(leaves, shs))
    assert r["layers"]["0"]["ffn"]["experts"]["w1"].data.sharding.spec == P("d", None, None)
    # and onto a single device
    r1 = restore_params(out, cfg, shardings=jax.sharding.make_single_device_sharding(jax.devices()[5]))
    same(ref, r1)
    assert r1["head"]["weight"].devices() == {jax.devices()[5]}
    # onto a (4, 2) mesh split along the last axis (reads a box, slices it per device), and the
    # TensorStore / Orbax restore paths onto the same target
    m42 = jax.make_mesh((4, 2), ("a", "b"))
    def last(name, sds):
        if sds.shape and sds.shape[-1] % 2 == 0:
            return NamedSharding(m42, P(*([None] * (len(sds.shape) - 1)), "b"))
        return NamedSharding(m42, P())
    for method in ("direct", "tensorstore", "orbax"):
        r2 = restore_params(out, cfg, shardings=last, method=method, engram_on_host=False)
        same(ref, r2)
        e = r2["embed"]["weight"]
        assert e.sharding.spec == P(None, "b") and e.addressable_shards[0].data.shape == (e.shape[0], e.shape[1] // 2)
    # large replicated leaves in row blocks joined on the devices (the accelerator path)
    from dsv41_jax.checkpoint import loader
    loader.CHUNK_ON_CPU = True
    r3 = restore_params(out, cfg, mesh=m42, host_budget_bytes=1 << 16)
    loader.CHUNK_ON_CPU = False
    same(ref, r3)
    assert r3["embed"]["weight"].sharding.is_fully_replicated
    print("MESH_OK")
    """
)


def test_roundtrips_on_virtual_mesh(tiny_ckpt, tmp_path):
    from multi_device import env

    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, tiny_ckpt, str(tmp_path / "o")], env=env(8),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "MESH_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# the golden fixture (DeepSeek's own layout, BF16 weights + FP8 Engram tables)


def test_fixture_loads_exactly():
    cfg, params = load_checkpoint(FIXTURE)
    assert cfg.dtype == "bf16" and cfg.expert_dtype is None and not cfg.gate_bias_vl
    with open(os.path.join(FIXTURE, "model.safetensors"), "rb") as f:
        ref = dict(safetensors.deserialize(f.read()))
    assert len(ref) == 545
    entries, treedef = leaf_table(cfg)
    leaves = treedef.flatten_up_to(params)
    n = 0
    for e, x in zip(entries, leaves):
        x = np.asarray(x)
        for i, s in enumerate(e.sources):
            t = ref.pop(s)
            part = x[i] if e.stacked else x
            assert list(part.shape) == t["shape"], s
            assert part.tobytes() == bytes(t["data"]), s
            n += 1
    assert n == 545 and not ref
    assert params["layers"]["0"]["attn"]["wq_a"]["weight"].dtype == jax.numpy.bfloat16
    assert params["layers"]["1"]["engram"]["embed"].data.dtype == ml_dtypes.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# corruption: each case names the problem


def _copy(src, tmp_path, name="bad"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _index(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)


def _rewrite(path, fn, mutate):
    """Rewrite shard ``fn`` with ``mutate(dict name -> (dtype, array))`` applied; keep the index in step."""
    fp = os.path.join(path, fn)
    sf = SafetensorsFile(fp)
    tensors = {n: (i.dtype, sf.read(n)) for n, i in sf.tensors.items()}
    del sf
    mutate(tensors)
    write_file(fp + ".new", [(n, dt, a.shape, lambda a=a: a) for n, (dt, a) in tensors.items()])
    os.replace(fp + ".new", fp)
    idx = _index(path)
    wm = {n: f for n, f in idx["weight_map"].items() if f != fn}
    wm.update({n: fn for n in tensors})
    idx["weight_map"] = wm
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)


def _shard_of(path, name):
    return _index(path)["weight_map"][name]


def _error(path, cfg=None) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path, cfg)
    return str(ei.value)


def test_truncated_shard(tiny_ckpt, tmp_path):
    p = _copy(tiny_ckpt, tmp_path)
    fn = _shard_of(p, "norm.weight")
    fp = os.path.join(p, fn)
    os.truncate(fp, os.path.getsize(fp) - 100)
    msg = _error(p)
    assert fn in msg and "truncated" in msg


def test_wrong_dtype(tiny_ckpt, tmp_path):
    p = _copy(tiny_ckpt, tmp_path)
    name = "layers.3.attn.wq_a.weight"

    def mutate(t):
        t[name] = ("BF16", np.asarray(t[name][1]).astype(np.float32).astype(ml_dtypes.bfloat16))

    _rewrite(p, _shard_of(p, name), mutate)
    msg = _error(p)
    assert "wrong dtype (1)" in msg and f"{name}: expected F8_E4M3, found BF16" in msg
    assert "stored unquantized where the config (dtype='fp8'" in msg


def test_wrong_shape(tiny_ckpt, tmp_path):
    p = _copy(tiny_ckpt, tmp_path)
    name = "layers.5.attn.indexer.k_norm.weight"

    def mutate(t):
        t[name] = ("BF16", t[name][1][:31])

    _rewrite(p, _shard_of(p, name), mutate)
    msg = _error(p)
    assert "wrong shape (1)" in msg and f"{name}: expected [32], found [31]" in msg


def test_missing_and_unexpected_tensors(tiny_ckpt, tmp_path):
    p = _copy(tiny_ckpt, tmp_path)
    gone = "layers.7.ffn.experts.5.w2.scale"
    extra = "layers.0.attn.wq_c.weight"
    fn = _shard_of(p, gone)

    def mutate(t):
        del t[gone]
        t[extra] = ("F32", np.zeros((4, 4), np.float32))
        t["vision.blocks.0.attn.weight"] = ("BF16", np.zeros((2,), ml_dtypes.bfloat16))  # ignored
        t["mtp.0.embed.weight"] = ("BF16", np.zeros((2,), ml_dtypes.bfloat16))  # ignored duplicate

    _rewrite(p, fn, mutate)
    msg = _error(p)
    assert "missing tensors (1)" in msg and f"{gone} (expected F8_E8M0[64, 1])" in msg
    assert "unexpected tensors (1)" in msg and extra in msg
    assert "vision." not in msg and "mtp.0.embed" not in msg


def test_index_names_missing_file(tiny_ckpt, tmp_path):
    p = _copy(tiny_ckpt, tmp_path)
    idx = _index(p)
    idx["weight_map"]["head.weight"] = "model-00099-of-00099.safetensors"
    with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)
    msg = _error(p)
    assert "model-00099-of-00099.safetensors" in msg and "does not exist" in msg and "head.weight" in msg


def test_config_inconsistent_with_tensors(tiny_ckpt, tmp_path):
    p = _copy(tiny_ckpt, tmp_path)
    with open(os.path.join(p, "config.json")) as f:
        c = json.load(f)
    c["text_config"]["n_routed_experts"] = 6
    with open(os.path.join(p, "config.json"), "w") as f:
        json.dump(c, f)
    msg = _error(p)
    assert "may not describe this checkpoint" in msg
    assert "layers.0.ffn.gate.weight: expected [6, 64], found [8, 64]" in msg
    assert "layers.0.ffn.experts.7.w1.weight" in msg  # unexpected
    # a quantized checkpoint with a config that says bf16 (no quantization_config)
    del c["quantization_config"]
    c["text_config"]["n_routed_experts"] = 8
    with open(os.path.join(p, "config.json"), "w") as f:
        json.dump(c, f)
    msg = _error(p)
    assert "config says dtype='bf16'" in msg and "layers.0.attn.wq_a.scale" in msg


def test_bf16_checkpoint_with_fp8_config(tmp_path):
    p = _copy(FIXTURE, tmp_path)
    cfg = ModelConfig.from_json(FIXTURE).replace(dtype="fp8", expert_dtype="fp4")
    msg = _error(p, cfg)
    assert "stored unquantized where the config (dtype='fp8'" in msg
    assert "layers.0.attn.wq_a.weight: expected F8_E4M3, found BF16" in msg
    assert "missing tensors" in msg and "layers.0.attn.wq_a.scale" in msg


def test_cli(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    run = lambda *a: subprocess.run([sys.executable, "-m", "dsv41_jax.convert", *a], env=env, capture_output=True,
                                    text=True, timeout=300)
    dst = str(tmp_path / "fx_orbax")
    r = run(FIXTURE, dst, "-q")
    assert r.returncode == 0, r.stderr
    cfg, ref = load_checkpoint(FIXTURE)
    assert_trees_bit_equal(ref, restore_params(dst))
    for args, what in (
        ((str(tmp_path / "nope"), str(tmp_path / "o1")), "no such checkpoint"),
        ((FIXTURE, dst), "already exists"),
        ((str(tmp_path), str(tmp_path / "o2")), "no model.safetensors.index.json"),
    ):
        r = run(*args)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and what in lines[0], r.stderr
        assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------
# the model gives the same logits from a written-and-reloaded official checkpoint


def test_quantized_checkpoint_same_logits(tmp_path):
    from dsv41_jax.model import Model

    # the tiny preset cut to 4 layers (SWA, ratio-2 source + Engram, ratio-1 source + candidates,
    # re-index) and a 1024 vocab to keep the compile short; FP8 32x32 weights, MXFP4 experts
    cfg = get_preset("tiny").replace(
        n_layers=4, n_mtp_layers=1, compress_ratios=(0, 2, 1, 1, 0), kv_source_layers=(1, 2),
        index_source_layers=(1, 2, 3), candidate_source_layer=2, engram_layer_ids=(1,),
        engram_num_embeddings=(434,), dspark_target_layer_ids=(1, 2, 3), vocab_size=1024,
    )
    params = jax.device_put(random_params(cfg, seed=11), jax.devices()[0])
    save_checkpoint(params, cfg, str(tmp_path / "ck"), max_shard_bytes=SHARD)
    cfg2, loaded = load_checkpoint(str(tmp_path / "ck"), engram_on_host=False)
    toks = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, 20))
    a = np.asarray(Model(cfg, params).forward(toks, dtype="float32"))
    b = np.asarray(Model(cfg2, loaded).forward(toks, dtype="float32"))
    assert np.isfinite(a).all() and a.std() > 0.1
    assert np.array_equal(a, b)


def test_v4_checkpoint_round_trip(tmp_path):
    """A V4 model (the v4_tiny_a fixture with an MTP block added) written by save_checkpoint loads
    back as the same config and tensors. The writer's HF composite is V4.1's, so a V4 config is
    written flat (before session 22 the write raised ConfigError on V4's ratio-8 layers)."""
    from tests.test_mtp import v4_with_mtp

    cfg, params = v4_with_mtp()
    save_checkpoint(params, cfg, tmp_path / "v4")
    assert json.loads((tmp_path / "v4" / "config.json").read_text())["family"] == "v4"
    cfg1, back = load_checkpoint(str(tmp_path / "v4"))
    assert cfg1.replace(name=cfg.name) == cfg
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                jax.tree_util.tree_flatten_with_path(back)[0]):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                      err_msg=jax.tree_util.keystr(pa))
