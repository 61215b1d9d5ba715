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

``DST/params`` is a plain Orbax checkpoint (``PyTreeCheckpointHandler().restore`` reads it). By
default :func:`restore_params` does not go through Orbax's restore pipeline, which reads each
array into a TensorStore buffer, copies it into a staging numpy array, then copies that into the
device buffer: it looks up where each array's bytes lie in the OCDBT data files
(:mod:`.ocdbt_direct`) and reads every device shard with ``os.preadv``, from a thread pool,
straight into the buffer handed to the device (adopted without a copy by CPU devices). See
BENCHMARKS.md ("Checkpoints") for the measurements.
"""

from __future__ import annotations

import collections
import json
import math
import mmap
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from ..config import ModelConfig
from ..quant import Fp4Tensor, Fp8Tensor, with_fp4_packing
from . import loader as _loader
from .layout import leaf_table
from .loader import DEFAULT_HOST_BUDGET, _concat_fn, _sharding_for, flatten_shardings
from .ocdbt_direct import OcdbtIndex, Unsupported
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
    params = with_fp4_packing(params, "nibbles")  # checkpoints hold the nibble layout (an engine may have repacked)
    # nor an engine's f16_exact marks (static fields: the config's tree has them unset)
    params = jax.tree.map(lambda n: n.replace(f16_exact=False) if isinstance(n, Fp4Tensor) else n, params,
                          is_leaf=lambda n: isinstance(n, Fp4Tensor))
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
    method: str = "direct",
    threads: int | None = None,
) -> dict:
    """Restore the tree saved by :func:`save_params`. ``shardings``/``mesh`` as in
    :func:`~dsv41_jax.checkpoint.load_checkpoint` (a pytree matching the parameter tree, one
    sharding, or a callable ``(leaf name, ShapeDtypeStruct) -> Sharding``); every array is read
    straight into its target sharding, whatever mesh the checkpoint was written from. Engram
    tables come back as host memmaps when ``engram_on_host`` (else onto their sharding).

    ``method``:

    * ``"direct"`` (default): the B+tree of the OCDBT database is read once and every device shard
      is read with ``os.preadv`` (``threads`` workers, default ``min(16, 2 x cores)``) straight
      into a 64-byte-aligned host buffer that becomes the device buffer (without a copy on CPU
      devices). Arrays stored in another encoding (e.g. compressed) are read through TensorStore.
    * ``"tensorstore"``: the same pipeline, every array read through TensorStore.
    * ``"orbax"``: Orbax's own ``PyTreeCheckpointHandler.restore``, in partial-restore groups of at
      most ``host_budget_bytes`` (the reference path; slower, see BENCHMARKS.md).

    ``host_budget_bytes`` bounds the host buffers in flight (being read, or being transferred to
    an accelerator); leaves over a quarter of it that go whole to one accelerator (or replicated)
    are read and transferred in row blocks of that size and joined on the device."""
    if method not in ("direct", "tensorstore", "orbax"):
        raise ValueError(f"method must be 'direct', 'tensorstore' or 'orbax', not {method!r}")
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
    params_dir = os.path.abspath(os.path.join(path, "params"))
    if method == "orbax":
        restored = _restore_in_groups(params_dir, abstract_tree, host_budget_bytes)
    else:
        restored = _restore_direct(params_dir, abstract_tree, host_budget_bytes, direct=method == "direct", threads=threads)
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


def _orbax_name(path) -> str:
    """Orbax's parameter name for a tree path (keys / field names joined with '.')."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        else:
            raise TypeError(f"unexpected key {k!r} in the parameter tree")
    return ".".join(out)


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is ``align``-byte aligned: XLA's CPU client
    adopts such a numpy buffer as the device buffer instead of copying it.

    Arrays of 4 MiB and more get their own anonymous ``mmap`` (page aligned, unmapped when the
    last reference goes) rather than ``np.empty``: numpy asks for transparent huge pages for such
    allocations (``madvise(MADV_HUGEPAGE)``), and on the benchmark VM faulting in gigabytes of
    fresh huge pages cost 2-3x the CPU time of ordinary pages (see BENCHMARKS.md); the mapping
    follows the system's THP setting like any malloc'd memory (XLA's own buffers included). It is
    populated when mapped (``MAP_POPULATE``): one pass in the kernel instead of a page fault per
    page during the read (about 30 % less CPU time for a restore on that VM)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    if n >= _MMAP_MIN:
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
        return np.frombuffer(m, np.uint8).view(dtype).reshape(shape)
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + n].view(dtype).reshape(shape)


_MMAP_MIN = 4 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


def _box(index, shape) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape))


class _TsReader:
    """TensorStore reads of arrays the direct reader does not handle (one shared context)."""

    def __init__(self, ckpt_dir: str):
        import tensorstore as ts
        from etils import epath

        ocp = _orbax()
        try:
            with open(os.path.join(ckpt_dir, "_METADATA")) as f:
                m = json.load(f)
            self.use_ocdbt, self.use_zarr3 = bool(m.get("use_ocdbt", True)), bool(m.get("use_zarr3", False))
        except (OSError, ValueError):
            self.use_ocdbt, self.use_zarr3 = True, False
        self.ts, self.ocp, self.dir = ts, ocp, epath.Path(ckpt_dir)
        self.ctx = ocp.type_handlers.get_ts_context(use_ocdbt=self.use_ocdbt)
        self.stores: dict[str, Any] = {}

    def read(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...], out: np.ndarray):
        """A future that fills ``out`` with ``array[box]`` (the array must have ``shape``)."""
        t = self.stores.get(name)
        if t is None:
            info = self.ocp.type_handlers.ParamInfo(name=name, parent_dir=self.dir, use_zarr3=self.use_zarr3,
                                                     ts_context=self.ctx)
            spec = self.ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.use_ocdbt)
            try:
                t = self.ts.open(spec, context=self.ctx, open=True, read=True).result()
            except ValueError as e:
                raise CheckpointError(f"{self.dir}: cannot open array {name}: {e}") from None
            if np.dtype(t.dtype.numpy_dtype) != out.dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(
                    f"{self.dir}: {name} is stored as {t.dtype.numpy_dtype}{list(t.shape)}, expected {out.dtype}{list(shape)}"
                )
            self.stores[name] = t
        return self.ts.array(out).write(t[box] if box else t)


_ADOPTS: dict = {}


def _cpu_adopts(device) -> bool:
    """Whether ``jax.device_put`` of an aligned numpy array onto ``device`` (a CPU device) uses the
    numpy buffer itself (XLA's CPU client does, for 64-byte aligned data) rather than a copy."""
    if device.platform != "cpu":
        return False
    key = device
    if key not in _ADOPTS:
        a = _aligned_empty((1024,), np.uint8)
        a[:] = 1
        b = jax.device_put(a, device)
        _ADOPTS[key] = b.addressable_data(0).unsafe_buffer_pointer() == a.ctypes.data
    return _ADOPTS[key]


def _restore_direct(ckpt_dir: str, abstract: dict, budget: int, *, direct: bool, threads: int | None) -> dict:
    """See :func:`restore_params` (``method`` "direct" / "tensorstore")."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    names = [_orbax_name(p) for p, _ in flat]
    sds = [x for _, x in flat]
    index = None
    if direct:
        try:
            index = OcdbtIndex(ckpt_dir)
        except (Unsupported, ValueError, OSError):  # not OCDBT, or a layout we do not read directly
            index = None
    arrays = [index.array(n) if index is not None else None for n in names]
    for n, a, x in zip(names, arrays, sds):
        if a is not None and (a.shape != tuple(x.shape) or a.dtype != np.dtype(x.dtype)):
            raise CheckpointError(f"{ckpt_dir}: {n} is stored as {a.dtype}{list(a.shape)}, expected {x.dtype}{list(x.shape)}")
    ts_reader = None
    # read along the data files (sequential I/O on a cold cache), then the TensorStore ones
    order = sorted(range(len(flat)), key=lambda i: (arrays[i] is None, arrays[i].first_offset() if arrays[i] else ("", 0), i))
    threads = threads or min(16, 2 * (os.cpu_count() or 1))
    chunk = max(1 << 20, budget // 4)
    out: list[Any] = [None] * len(flat)
    pending: collections.deque = collections.deque()  # (leaf i, [(buffer, devices, index per device)], futures, nbytes)
    inflight = 0
    transfers: list[jax.Array] = []  # accelerator transfers not yet known finished
    t_bytes = 0

    def read(i, box, buf) -> tuple[list, bool]:
        """(futures filling ``buf`` with leaf i's ``box``, whether the read stages data elsewhere)."""
        nonlocal ts_reader
        a = arrays[i]
        if a is not None:
            try:
                ops = a.plan(box, buf)
                return [pool.submit(op.run) for op in ops], any(op.sub is not None for op in ops)
            except Unsupported:
                arrays[i] = None
        if ts_reader is None:
            ts_reader = _TsReader(ckpt_dir)
        return [ts_reader.read(names[i], tuple(sds[i].shape), box, buf)], True

    def wait_transfers(limit):
        nonlocal transfers, t_bytes
        if t_bytes > limit:
            jax.block_until_ready(transfers)
            transfers, t_bytes = [], 0

    def finish():
        nonlocal inflight, t_bytes
        i, units, futs, nbytes = pending.popleft()
        for f in futs:
            f.result()
        inflight -= nbytes
        x = sds[i]
        shards = []
        mk = x.sharding.memory_kind
        for buf, devs, idxs in units:
            for d, idx in zip(devs, idxs):
                target = jax.sharding.make_single_device_sharding(d, memory_kind=mk)
                shards.append(jax.device_put(buf if idx is None else buf[idx], target))
        arr = jax.make_array_from_single_device_arrays(tuple(x.shape), x.sharding, shards)
        out[i] = arr
        if any(d.platform != "cpu" for d in x.sharding.device_set):
            transfers.append(arr)
            t_bytes += nbytes
            wait_transfers(budget)

    with ThreadPoolExecutor(threads, thread_name_prefix="restore") as pool:
        for i in order:
            x = sds[i]
            sh, shape = x.sharding, tuple(x.shape)
            nbytes = math.prod(shape) * np.dtype(x.dtype).itemsize
            groups: dict = collections.defaultdict(list)
            for d, idx in sh.addressable_devices_indices_map(shape).items():
                groups[_box(idx, shape)].append(d)
            row_only = all(all(s.start == 0 and s.stop == n for s, n in zip(b[1:], shape[1:])) for b in groups)
            on_accel = any(d.platform != "cpu" for d in sh.device_set)
            if (
                len(groups) == 1
                and shape
                and shape[0] > 1
                and nbytes > chunk
                and (on_accel or _loader.CHUNK_ON_CPU)
            ):
                # one device / replicated, large, to an accelerator: row blocks, joined on the device
                while pending:
                    finish()
                wait_transfers(0)
                (box, devs), = groups.items()
                out[i] = _row_blocks(i, x, box, devs, read, chunk)
                continue
            units, futs, held = [], [], 0
            if row_only:
                for box, devs in groups.items():
                    buf = _aligned_empty(tuple(s.stop - s.start for s in box), x.dtype)
                    fs, staged = read(i, box, buf)
                    futs += fs
                    units.append((buf, devs, [None] * len(devs)))
                    # a buffer read in place that CPU devices adopt is the restored array itself,
                    # not host memory in flight
                    held += 0 if not staged and all(_cpu_adopts(d) for d in devs) else buf.nbytes
            else:  # e.g. split along a later axis: read the bounding box once, slice per device
                lo = [min(b[k].start for b in groups) for k in range(len(shape))]
                hi = [max(b[k].stop for b in groups) for k in range(len(shape))]
                bbox = tuple(slice(l, h) for l, h in zip(lo, hi))
                buf = _aligned_empty(tuple(h - l for l, h in zip(lo, hi)), x.dtype)
                futs += read(i, bbox, buf)[0]
                devs = [d for ds in groups.values() for d in ds]
                idxs = [tuple(slice(s.start - l, s.stop - l) for s, l in zip(b, lo)) for b, ds in groups.items() for _ in ds]
                units.append((buf, devs, idxs))
                held += buf.nbytes
            pending.append((i, units, futs, held))
            inflight += held
            while pending and inflight > budget:
                finish()
        while pending:
            finish()
    jax.block_until_ready([o for o in out if o is not None])
    return jax.tree_util.tree_unflatten(treedef, out)


def _row_blocks(i, x, box, devs, read, chunk) -> jax.Array:
    """Leaf ``i`` (whole on ``devs``) read and transferred in row blocks of about ``chunk`` bytes,
    then joined on the device(s): host memory holds one block at a time."""
    shape = tuple(x.shape)
    row = math.prod(shape[1:]) * np.dtype(x.dtype).itemsize
    step = max(1, chunk // max(1, row))
    pieces = []
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        buf = _aligned_empty((r1 - r0, *shape[1:]), x.dtype)
        for f in read(i, (slice(r0, r1), *box[1:]), buf)[0]:
            f.result()
        targets = [jax.sharding.make_single_device_sharding(d, memory_kind=x.sharding.memory_kind) for d in devs]
        piece = jax.make_array_from_single_device_arrays(buf.shape, x.sharding, [jax.device_put(buf, t) for t in targets])
        jax.block_until_ready(piece)
        pieces.append(piece)
    if len(pieces) == 1:
        return pieces[0]
    joined = _concat_fn(x.sharding)(*pieces)
    jax.block_until_ready(joined)
    return joined


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
