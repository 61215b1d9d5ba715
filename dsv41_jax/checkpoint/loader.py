"""Load an official DeepSeek-V4.1 safetensors checkpoint into the parameter tree.

``load_checkpoint(path)`` reads ``config.json`` and ``model.safetensors.index.json`` (or one
``model.safetensors``), checks every tensor name, shape and dtype against the config in both
directions (all problems are collected into one :class:`CheckpointError`), then builds each leaf
of the tree straight onto its target sharding from memory-mapped shard bytes:

* quantized data stays as stored: FP8 e4m3 weights + e8m0 32x32 scales, MXFP4 experts (I8 or U8
  packed bytes -> uint8) + e8m0 scales per 32; nothing is expanded to bf16;
* the routed experts ``X.experts.{e}.wN.*`` are stacked into ``[E, ...]`` leaves one device shard
  at a time, so host memory holds at most one device shard of one leaf beyond what mmap pages in;
* leaves are read in shard-file order, so shards are visited one after another.

Engram tables (``layers.L.engram.embed``, ~189 GiB in the real model) stay on the host by default
as read-only ``numpy.memmap`` arrays inside the usual :class:`~dsv41_jax.quant.Fp8Tensor` (data
e4m3 ``[rows, head_dim]``, scale e8m0 ``[rows, head_dim/32]``, block (1, 32)). Nothing is read
until rows are gathered. The engine is expected to gather the rows of each step on the host with
:func:`gather_rows` (numpy fancy indexing on the memmap reads only the touched pages, the OS page
cache keeps hot rows) and ``jax.device_put`` the small ``[..., head_dim]`` result, overlapping the
gather for the next step / layer 14 with compute (row ids depend on token ids only).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ConfigError, ModelConfig
from ..quant import Fp8Tensor
from .layout import LeafEntry, is_engram_table, leaf_table
from .safetensors_io import DTYPES, CheckpointError, SafetensorsFile, TensorInfo

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Tensors of the released checkpoint that the text model does not use: the vision tower and the
# duplicates of embed/head under mtp.K that DeepSeek's convert.py drops.
IGNORED = re.compile(
    r"^(vision\.|aligner\.|(image_start|image_end|image_newline)(\.|$)|mtp\.\d+\.(embed|head)(\.|$))"
)
# HF-style aliases accepted by DeepSeek's convert.py
_ALIASES = ((".weight_scale_inv", ".scale"), (".e_score_correction_bias", ".bias"))

_MAX_LIST = 20
DEFAULT_HOST_BUDGET = 1 << 30  # bytes of host buffers in flight to devices before waiting
CHUNK_ON_CPU = False  # row-chunk large leaves for CPU devices too (only useful in tests: on CPU the
# device memory is host memory, so chunking only adds a copy)


def _canonical(name: str) -> str:
    for a, b in _ALIASES:
        if name.endswith(a):
            return name[: -len(a)] + b
    return name


def _fmt(dt: str, shape) -> str:
    return f"{dt}{list(shape)}"


def accepted_dtypes(dtype) -> tuple[str, ...]:
    """Safetensors dtype names a tensor of this in-memory dtype may be stored as."""
    dt = np.dtype(dtype)
    if dt == np.uint8:  # packed FP4: the real checkpoint uses I8, torch float4_e2m1fn_x2 U8
        return ("I8", "U8")
    if dt == np.int32:  # V4 ffn.gate.tid2eid: I64 in the released checkpoint, int32 in memory
        return ("I32", "I64")
    return tuple(k for k, v in DTYPES.items() if v == dt and k != "U8")


class CheckpointFiles:
    """The tensors of a checkpoint directory: ``{official name: TensorInfo}``, from the index (or the
    single file), with every shard's header parsed (no tensor data read). Problems with the files
    (index naming a missing shard, truncated or corrupt shards, names the index puts in a shard that
    does not hold them) are collected and raised together."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        problems: list[str] = []
        if os.path.isfile(self.path):
            root, weight_map = os.path.dirname(self.path), None
            files = [os.path.basename(self.path)]
        elif os.path.isdir(self.path):
            root = self.path
            ip = os.path.join(root, INDEX_FILE)
            if os.path.exists(ip):
                try:
                    with open(ip) as f:
                        weight_map = json.load(f)["weight_map"]
                    if not isinstance(weight_map, dict):
                        raise TypeError("weight_map is not an object")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{ip}: not a valid safetensors index ({e})") from None
                files = sorted(set(weight_map.values()))
            elif os.path.exists(os.path.join(root, SINGLE_FILE)):
                weight_map, files = None, [SINGLE_FILE]
            else:
                raise CheckpointError(f"{root}: no {INDEX_FILE} and no {SINGLE_FILE}")
        else:
            raise CheckpointError(f"{self.path}: no such checkpoint file or directory")
        self.root = root
        self.files: dict[str, SafetensorsFile] = {}
        by_file = defaultdict(list)
        if weight_map is not None:
            for n, fn in weight_map.items():
                by_file[fn].append(n)
        for fn in files:
            fp = os.path.join(root, fn)
            if not os.path.exists(fp):
                names = sorted(by_file[fn])
                problems.append(
                    f"index names shard {fn!r} for {len(names)} tensor(s) (e.g. {', '.join(names[:3])}), "
                    f"but {fp} does not exist"
                )
                continue
            try:
                self.files[fn] = SafetensorsFile(fp)
            except CheckpointError as e:
                problems.append(str(e))
        self.tensors: dict[str, TensorInfo] = {}
        self.file_order = {fn: i for i, fn in enumerate(files)}
        raw = (
            [(n, fn) for fn in files if fn in self.files for n in self.files[fn].keys()]
            if weight_map is None
            else sorted(weight_map.items())
        )
        not_in_file = []
        for n, fn in raw:
            if fn not in self.files:
                continue
            if n not in self.files[fn]:
                not_in_file.append(f"{n} (index says {fn})")
                continue
            c = _canonical(n)
            if c in self.tensors:
                problems.append(f"tensor {c} appears twice ({self.tensors[c].file} and {fn})")
                continue
            self.tensors[c] = self.files[fn].tensors[n]
        if not_in_file:
            problems.append(
                f"{len(not_in_file)} tensor(s) listed in the index are not in their shard: "
                + ", ".join(not_in_file[:_MAX_LIST])
                + (" ..." if len(not_in_file) > _MAX_LIST else "")
            )
        if problems:
            raise CheckpointError(f"checkpoint {self.path}:\n  " + "\n  ".join(problems))

    def memmap(self, name: str, dtype=None) -> np.ndarray:
        info = self.tensors[name]
        return self.files[os.path.basename(info.file)].memmap(info.name, dtype)

    def file_rank(self, name: str) -> int:
        return self.file_order[os.path.basename(self.tensors[name].file)]


def _section(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    out = [f"{title} ({len(items)}):"]
    out += [f"    {s}" for s in sorted(items)[:_MAX_LIST]]
    if len(items) > _MAX_LIST:
        out.append(f"    ... and {len(items) - _MAX_LIST} more")
    return out


def check_tensors(files: CheckpointFiles, cfg: ModelConfig, entries: list[LeafEntry]) -> tuple[int, list[str]]:
    """Compare the checkpoint's tensors with the config's name table, both ways. Returns
    ``(number of problems, report lines)``; ``(0, [])`` when everything matches."""
    expected: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for e in entries:
        for s in e.sources:
            expected[s] = (e.source_shape, e.dtype)
    missing, unexpected, shape_bad, dtype_bad = [], [], [], []
    hints = defaultdict(int)
    for name, (shape, dt) in expected.items():
        acc = accepted_dtypes(dt)
        info = files.tensors.get(name)
        if info is None:
            missing.append(f"{name} (expected {_fmt(acc[0], shape)})")
            continue
        if info.dtype not in acc:
            dtype_bad.append(f"{name}: expected {' or '.join(acc)}, found {info.dtype} (in {os.path.basename(info.file)})")
            if acc[0] == "F8_E4M3" and info.dtype in ("BF16", "F16", "F32"):
                hints["bf16_for_fp8"] += 1
            elif acc[0] in ("BF16", "F32") and info.dtype == "F8_E4M3":
                hints["fp8_for_bf16"] += 1
            elif acc[0] == "I8" or info.dtype in ("I8", "U8"):
                hints["experts"] += 1
        if tuple(info.shape) != tuple(shape):
            shape_bad.append(f"{name}: expected {list(shape)}, found {list(info.shape)} (in {os.path.basename(info.file)})")
    for name, info in files.tensors.items():
        if name not in expected and not IGNORED.match(name):
            unexpected.append(f"{name} ({_fmt(info.dtype, info.shape)} in {os.path.basename(info.file)})")
            if name.endswith(".scale"):
                hints["extra_scales"] += 1
    lines: list[str] = []
    if hints["bf16_for_fp8"]:
        lines.append(
            f"hint: {hints['bf16_for_fp8']} weight(s) are stored unquantized where the config (dtype='fp8', "
            "from quantization_config) expects FP8 e4m3 + e8m0 scales: a BF16 checkpoint needs a config.json "
            "without quantization_config; or re-save it with save_checkpoint() to quantize it"
        )
    if hints["fp8_for_bf16"] or (hints["extra_scales"] and cfg.dtype == "bf16"):
        lines.append(
            "hint: the checkpoint holds FP8 weights with .scale tensors but the config says dtype='bf16' "
            "(config.json has no quantization_config)"
        )
    if hints["experts"]:
        lines.append(
            f"hint: {hints['experts']} routed-expert tensor(s) are not in the config's expert format "
            f"(expert_dtype={cfg.expert_dtype!r}, dtype={cfg.dtype!r})"
        )
    if shape_bad or (missing and unexpected):
        lines.append(f"hint: the config ({cfg.name}) may not describe this checkpoint")
    lines += _section("missing tensors", missing)
    lines += _section("unexpected tensors", unexpected)
    lines += _section("wrong shape", shape_bad)
    lines += _section("wrong dtype", dtype_bad)
    return len(missing) + len(unexpected) + len(shape_bad) + len(dtype_bad), lines


def open_and_check(path, cfg: ModelConfig | None = None):
    """``(cfg, files, entries, treedef)`` after all checks; raises :class:`CheckpointError`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    files = CheckpointFiles(path)
    if cfg is None:
        root = path if os.path.isdir(path) else os.path.dirname(path)
        try:
            cfg = ModelConfig.from_json(root)
        except ConfigError as e:
            raise CheckpointError(f"checkpoint {path}: bad config.json: {e}") from None
    entries, treedef = leaf_table(cfg)
    n, lines = check_tensors(files, cfg, entries)
    if n:
        raise CheckpointError(
            f"checkpoint {path} does not match its config ({n} problem(s)):\n  " + "\n  ".join(lines)
        )
    return cfg, files, entries, treedef


def _read_block(files: CheckpointFiles, e: LeafEntry, index: tuple) -> np.ndarray:
    """``leaf[index]`` as a fresh host array, read from the memmaps."""
    index = tuple(index) + (slice(None),) * (len(e.shape) - len(index))
    if not e.stacked:
        src = e.sources[0]
        narrow = e.dtype == np.int32 and files.tensors[src].dtype == "I64"
        m = files.memmap(src, None if narrow else e.dtype)
        out = np.array(m[index], copy=True).astype(e.dtype, copy=False)
        del m
        return out
    experts = range(len(e.sources))[index[0]]
    rest = index[1:]
    first = None
    for j, x in enumerate(experts):
        m = files.memmap(e.sources[x], e.dtype)
        blk = m[rest]
        if first is None:
            first = np.empty((len(experts), *blk.shape), e.dtype)
        first[j] = blk
        del m, blk
    if first is None:
        first = np.empty((0,) + tuple(len(range(n)[s]) for n, s in zip(e.shape[1:], rest)), e.dtype)
    return first


@functools.lru_cache(maxsize=None)
def _concat_fn(sharding):
    return jax.jit(lambda *xs: jnp.concatenate(xs, axis=0), out_shardings=sharding)


def _chunked_leaf(files: CheckpointFiles, e: LeafEntry, sh, chunk: int) -> jax.Array:
    """A large leaf on one device (or replicated) built from row blocks of about ``chunk`` bytes,
    each transferred and finished before the next is read, then joined on the device; host memory
    holds one block at a time (device memory twice the leaf, briefly)."""
    row = math.prod(e.shape[1:]) * e.dtype.itemsize
    step = max(1, chunk // max(1, row))
    pieces = []
    for r0 in range(0, e.shape[0], step):
        r1 = min(e.shape[0], r0 + step)

        def cb(idx, r0=r0, r1=r1):
            return _read_block(files, e, (slice(r0, r1),) + tuple(idx)[1:])

        pieces.append(jax.make_array_from_callback((r1 - r0, *e.shape[1:]), sh, cb))
        jax.block_until_ready(pieces[-1])
    if len(pieces) == 1:
        return pieces[0]
    out = _concat_fn(sh)(*pieces)
    jax.block_until_ready(out)
    return out


def _sharding_for(e: LeafEntry, shardings, mesh, flat_sh):
    if flat_sh is not None:
        return flat_sh
    if callable(shardings):
        s = shardings(e.name, jax.ShapeDtypeStruct(e.shape, e.dtype))
        if s is not None:
            return s
    if mesh is not None:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.sharding.make_single_device_sharding(jax.devices()[0])


def flatten_shardings(shardings, treedef, n: int):
    """A sharding pytree (matching the parameter tree) -> a list per leaf; None -> [None]*n."""
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    if shardings is None or callable(shardings):
        return [None] * n
    try:
        return treedef.flatten_up_to(shardings)
    except (ValueError, TypeError) as err:
        raise ValueError(f"shardings do not match the parameter tree: {err}") from None


def load_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    shardings: Any = None,
    engram_on_host: bool = True,
    host_budget_bytes: int = DEFAULT_HOST_BUDGET,
) -> tuple[ModelConfig, dict]:
    """Load an official-format checkpoint directory (or one ``.safetensors`` file) as
    ``(cfg, params)``.

    ``cfg``: use this config instead of ``path/config.json``. ``shardings``: a pytree of
    ``jax.sharding.Sharding`` matching :func:`~dsv41_jax.params.param_specs`, a single sharding
    for everything, or a callable ``(leaf name, ShapeDtypeStruct) -> Sharding | None``, leaf names
    as in :mod:`.layout` (``layers.0.attn.wq_a.weight``, ``...wq_a.scale``,
    ``layers.0.ffn.experts.w1.weight`` for the stacked ``[E, ...]`` experts). ``mesh`` alone
    replicates every leaf over it. With neither, leaves go to the default device. Each leaf is
    created with ``jax.make_array_from_callback``: every device shard is read from the memmaps
    directly. ``engram_on_host``: keep Engram tables as host memmaps (see the module docstring).
    ``host_budget_bytes``: transfers to accelerators are asynchronous and each keeps its host
    buffer alive until done; once this many bytes are in flight the loader waits for them, and
    leaves over a quarter of it that go to one device (or replicated) are sent in row blocks of
    that size and joined on the device. This bounds the host memory a load needs.
    """
    cfg, files, entries, treedef = open_and_check(path, cfg)
    flat_sh = flatten_shardings(shardings, treedef, len(entries))
    order = sorted(range(len(entries)), key=lambda i: (min(files.file_rank(s) for s in entries[i].sources), i))
    chunk = max(1 << 20, host_budget_bytes // 4)
    leaves: list[Any] = [None] * len(entries)
    pending: list[jax.Array] = []
    inflight = 0
    for i in order:
        e = entries[i]
        if engram_on_host and is_engram_table(e.name):
            leaves[i] = files.memmap(e.sources[0], e.dtype)
            continue
        sh = _sharding_for(e, shardings, mesh, flat_sh[i])
        if (
            e.shape
            and e.shape[0] > 1
            and math.prod(e.shape) * e.dtype.itemsize > chunk
            and sh.is_fully_replicated
            and (CHUNK_ON_CPU or any(d.platform != "cpu" for d in sh.device_set))
        ):
            jax.block_until_ready(pending)
            pending, inflight = [], 0
            leaves[i] = _chunked_leaf(files, e, sh, chunk)
            continue
        leaves[i] = jax.make_array_from_callback(e.shape, sh, lambda idx, e=e: _read_block(files, e, idx))
        pending.append(leaves[i])
        inflight += leaves[i].nbytes
        if inflight >= host_budget_bytes:
            jax.block_until_ready(pending)
            pending, inflight = [], 0
    jax.block_until_ready(pending)
    return cfg, jax.tree_util.tree_unflatten(treedef, leaves)


def read_official(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{official name: read-only memmap}`` of every tensor, no checks against a config (tools,
    tests). FP4 bytes keep their stored dtype (I8 or U8)."""
    files = CheckpointFiles(path)
    return {n: files.memmap(n) for n in files.tensors}


def gather_rows(table: Fp8Tensor, ids) -> Fp8Tensor:
    """Host-side Engram row gather: ``table`` (data ``[rows, d]`` e4m3, scale ``[rows, d/32]``
    e8m0, numpy memmaps or arrays) at integer ``ids`` of any shape -> an Fp8Tensor of numpy arrays
    ``[*ids.shape, d]`` / ``[*ids.shape, d/32]`` (block (1, 32)), ready for ``jax.device_put``.
    Only the pages holding the requested rows are read."""
    ids = np.asarray(ids)
    flat = ids.reshape(-1)
    data = np.asarray(table.data[flat]).reshape(*ids.shape, table.data.shape[-1])
    scale = np.asarray(table.scale[flat]).reshape(*ids.shape, table.scale.shape[-1])
    return Fp8Tensor(data=data, scale=scale, block=table.block)
