"""The parameter tree as an Orbax checkpoint: written atomically, restored onto any mesh.

Layout of a converted directory ``DST``::

    DST/params/          Orbax (PyTreeCheckpointHandler, OCDBT, uncompressed) checkpoint of the tree without
                         the Engram tables. float8_e4m3fn / float8_e8m0fnu / uint8 are stored
                         natively and come back bit-exact (the tests check the bits).
    DST/host_tables/     the Engram tables (layers.L.engram.embed.{weight,scale}) as raw uint8
                         .npy files, so they can be memory-mapped on the host again.
    DST/dsv41_meta.json  format tag, the model config, every leaf's dtype and shape.

Everything is written into ``DST.partial`` and renamed to ``DST`` only when complete, so an
interrupted conversion leaves nothing that :func:`restore_params` accepts (it also requires the
meta file, which is written last).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from ..config import ModelConfig
from ..quant import Fp4Tensor, Fp8Tensor
from .layout import leaf_table
from .loader import DEFAULT_HOST_BUDGET, _sharding_for, flatten_shardings
from .safetensors_io import CheckpointError

FORMAT = "dsv41_jax.orbax/1"
META = "dsv41_meta.json"
PARTIAL = ".partial"


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def _split_host(tree: dict) -> tuple[dict, dict[str, Any]]:
    """(tree without the Engram table nodes, {node name: node})."""
    host = {}

    def rec(node, prefix):
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            name = f"{prefix}.{k}" if prefix else k
            if k == "embed" and prefix.endswith("engram"):
                host[name] = v
                continue
            out[k] = rec(v, name)
        return out

    return rec(tree, ""), host


def _insert(tree: dict, name: str, value) -> None:
    parts = name.split(".")
    node = tree
    for p in parts[:-1]:
        node = node[p]
    node[parts[-1]] = value


def _write_npy_u8(path: str, arr) -> None:
    a = np.asarray(arr) if not isinstance(arr, np.ndarray) else arr
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(*a.shape[:-1], a.shape[-1] * a.dtype.itemsize))
    rows = max(1, (64 << 20) // max(1, out[0:1].nbytes)) if out.ndim and out.shape[0] else 1
    for i in range(0, a.shape[0] if a.ndim else 1, rows):
        out[i : i + rows] = np.ascontiguousarray(a[i : i + rows]).view(np.uint8)
    out.flush()
    del out


def save_params(params: dict, path: str | os.PathLike, cfg: ModelConfig, *, overwrite: bool = False) -> None:
    """Write ``params`` (the tree of ``param_specs(cfg)``) as an Orbax checkpoint directory."""
    path = os.fspath(path).rstrip("/")
    if os.path.exists(path) and not overwrite:
        raise CheckpointError(f"{path} already exists (pass overwrite=True to replace it)")
    entries, treedef = leaf_table(cfg)
    try:
        leaves = treedef.flatten_up_to(params)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"parameters do not match the config's tree: {e}") from None
    bad = [
        f"{e.name}: {getattr(x, 'dtype', type(x))}{list(getattr(x, 'shape', ()))}, expected {e.dtype}{list(e.shape)}"
        for e, x in zip(entries, leaves)
        if tuple(getattr(x, "shape", ())) != e.shape or np.dtype(getattr(x, "dtype", object)) != e.dtype
    ]
    if bad:
        raise CheckpointError(f"parameters do not match the config ({len(bad)}):\n  " + "\n  ".join(bad[:40]))
    tmp = path + PARTIAL
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "host_tables"))
    tree, host = _split_host(params)
    ocp = _orbax()
    # uncompressed: FP8/FP4 codes barely compress and zstd costs restore time (see BENCHMARKS.md)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    ckptr.save(os.path.abspath(os.path.join(tmp, "params")), args=ocp.args.PyTreeSave(tree))  # synchronous
    tables = {}
    for name, node in host.items():
        for part, field in (("weight", "data"), ("scale", "scale")):
            a = getattr(node, field)
            fn = f"{name}.{part}.npy"
            _write_npy_u8(os.path.join(tmp, "host_tables", fn), a)
            tables[f"{name}.{part}"] = {"file": fn, "dtype": str(np.dtype(a.dtype)), "shape": list(a.shape)}
    meta = {
        "format": FORMAT,
        "config": cfg.to_dict(),
        "host_tables": tables,
        "leaves": {e.name: {"dtype": str(e.dtype), "shape": list(e.shape)} for e in entries},
    }
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)


def read_meta(path: str | os.PathLike) -> dict:
    path = os.fspath(path).rstrip("/")
    mp = os.path.join(path, META)
    if not os.path.isdir(path):
        hint = " (an interrupted conversion left only .partial)" if os.path.isdir(path + PARTIAL) else ""
        raise CheckpointError(f"{path}: no such Orbax checkpoint directory{hint}")
    if not os.path.exists(mp):
        raise CheckpointError(f"{path}: not a complete dsv41_jax Orbax checkpoint (no {META})")
    with open(mp) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def restore_config(path: str | os.PathLike) -> ModelConfig:
    return ModelConfig.from_dict(read_meta(path)["config"], name=os.fspath(path))


def restore_params(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    shardings: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    engram_on_host: bool = True,
    host_budget_bytes: int = DEFAULT_HOST_BUDGET,
) -> dict:
    """Restore the tree saved by :func:`save_params`. ``shardings``/``mesh`` as in
    :func:`~dsv41_jax.checkpoint.load_checkpoint` (a pytree matching the parameter tree, one
    sharding, or a callable ``(leaf name, ShapeDtypeStruct) -> Sharding``); every array is read
    straight into its target sharding. Engram tables come back as host memmaps when
    ``engram_on_host`` (else onto their sharding). ``host_budget_bytes``: Orbax stages a restore
    in host memory, so the tree is restored in groups of at most this many bytes (partial
    restores), each finished before the next starts; peak host memory is about one group."""
    path = os.fspath(path).rstrip("/")
    meta = read_meta(path)
    saved = ModelConfig.from_dict(meta["config"], name=path)
    if cfg is None:
        cfg = saved
    elif cfg != saved:
        diff = [k for k, v in cfg.to_dict().items() if saved.to_dict().get(k) != v]
        raise CheckpointError(f"{path}: saved with a different config (fields differ: {', '.join(diff)})")
    entries, treedef = leaf_table(cfg)
    flat_sh = flatten_shardings(shardings, treedef, len(entries))
    for e in entries:
        rec = meta["leaves"].get(e.name)
        if rec is None or rec["dtype"] != str(e.dtype) or tuple(rec["shape"]) != e.shape:
            raise CheckpointError(f"{path}: leaf {e.name} recorded as {rec}, expected {e.dtype}{list(e.shape)}")
    abstract_leaves = [
        jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=_sharding_for(e, shardings, mesh, s))
        for e, s in zip(entries, flat_sh)
    ]
    abstract = jax.tree_util.tree_unflatten(treedef, abstract_leaves)
    abstract_tree, host_abs = _split_host(abstract)
    restored = _restore_in_groups(os.path.abspath(os.path.join(path, "params")), abstract_tree, host_budget_bytes)
    for name, node in host_abs.items():
        parts = {}
        for part, field in (("weight", "data"), ("scale", "scale")):
            rec = meta["host_tables"][f"{name}.{part}"]
            sds = getattr(node, field)
            m = np.load(os.path.join(path, "host_tables", rec["file"]), mmap_mode="r").view(np.dtype(rec["dtype"]))
            if m.shape != tuple(sds.shape) or m.dtype != sds.dtype:
                raise CheckpointError(f"{path}: host table {name}.{part} is {m.dtype}{list(m.shape)}, expected {sds}")
            if engram_on_host:
                parts[field] = m
            else:
                parts[field] = jax.make_array_from_callback(m.shape, sds.sharding, lambda idx, m=m: np.array(m[idx]))
        _insert(restored, name, type(node)(data=parts["data"], scale=parts["scale"], block=node.block))
    # exact dtypes (Orbax restores to the abstract dtype; check no silent cast happened)
    out_leaves = treedef.flatten_up_to(restored)
    for e, x in zip(entries, out_leaves):
        if np.dtype(x.dtype) != e.dtype or tuple(x.shape) != e.shape:
            raise CheckpointError(f"{path}: restored {e.name} as {x.dtype}{list(x.shape)}, expected {e.dtype}{list(e.shape)}")
    return restored


def _nodes(tree) -> list[tuple[tuple[str, ...], Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, (Fp8Tensor, Fp4Tensor)))[0]
    return [(tuple(str(k.key) for k in p), n) for p, n in flat]


def _nest(items) -> dict:
    out: dict = {}
    for path, node in items:
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = node
    return out


def _restore_in_groups(ckpt_dir: str, abstract: dict, budget: int) -> dict:
    ocp = _orbax()
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    groups, cur, size = [], [], 0
    for path, node in _nodes(abstract):
        nb = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(node))
        if cur and size + nb > budget:
            groups.append(cur)
            cur, size = [], 0
        cur.append((path, node))
        size += nb
    if cur:
        groups.append(cur)
    out_items = []
    for g in groups:
        item = _nest(g)
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=len(groups) > 1,
        )
        got = ckptr.restore(ckpt_dir, args=args)
        jax.block_until_ready(jax.tree.leaves(got))
        gn = dict(_nodes(got))
        out_items += [(p, gn[p]) for p, _ in g]
    return _nest(out_items)


def default_shardings(mesh: jax.sharding.Mesh, axis: str | None = None):
    """A callable sharding rule for :func:`restore_params` / ``load_checkpoint``: each leaf split
    along its first dimension divisible by the mesh axis size (largest leaves spread over all
    devices), replicated when none is."""
    P = jax.sharding.PartitionSpec
    axis = axis or mesh.axis_names[0]
    n = mesh.shape[axis]

    def rule(name, sds):
        for d, s in enumerate(sds.shape):
            if s % n == 0 and s >= n:
                spec = [None] * len(sds.shape)
                spec[d] = axis
                return jax.sharding.NamedSharding(mesh, P(*spec))
        return jax.sharding.NamedSharding(mesh, P())

    return rule
