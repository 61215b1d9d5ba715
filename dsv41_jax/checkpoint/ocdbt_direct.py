"""Direct reads of the arrays of an Orbax (OCDBT + Zarr v2, uncompressed) checkpoint.

An Orbax ``PyTreeCheckpointHandler(use_ocdbt=True)`` directory is one OCDBT key-value database
whose keys are ``<param>/.zarray`` (Zarr v2 metadata) and ``<param>/<i>.<j>...`` (chunks). Values
too large to sit inline in the tree nodes are stored verbatim at an ``(offset, length)`` in a data file; an uncompressed Zarr v2
chunk is the C-order little-endian bytes of the chunk. :class:`OcdbtIndex` walks the B+tree once with
TensorStore's public :func:`tensorstore.ocdbt.dump` and records where every value lives, so that a
region of an array can be read with ``os.preadv`` straight into the destination buffer: one copy
(page cache or disk -> final buffer), no intermediate buffers, no per-read TensorStore pipeline.

Everything else (compressed chunks, filters, Fortran order, big-endian dtypes, missing chunks,
several OCDBT versions, ...) makes :meth:`OcdbtIndex.array` return ``None``; the caller then reads
that array through TensorStore (see :mod:`.orbax_io`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np


class Unsupported(Exception):
    """The database or an array is not in the layout this reader handles."""


@dataclass(frozen=True)
class Value:
    inline: bytes | None  # the value itself when stored in the B+tree node
    file: str | None  # else: data file path, byte offset and length
    offset: int = 0
    length: int = 0


def _location(root: str, loc: str) -> tuple[str, int, int]:
    """``value:<base>:<relative path>:<offset>:<length>`` -> (file path, offset, length)."""
    head, off, length = loc.rsplit(":", 2)
    kind, base, rel = head.split(":", 2)
    if kind not in ("value", "btreenode"):
        raise Unsupported(f"unexpected OCDBT location {loc!r}")
    return os.path.join(root, base, rel), int(off), int(length)


def read_values(root: str) -> dict[str, Value]:
    """``{key: Value}`` of the newest version of the OCDBT database in directory ``root``."""
    import tensorstore as ts

    base = ts.KvStore.open({"driver": "file", "path": root.rstrip("/") + "/"}).result()
    manifest = ts.ocdbt.dump(base).result()
    if manifest.get("version_tree_nodes") or not manifest.get("versions"):
        raise Unsupported("OCDBT database with a version tree (several commits)")
    version = max(manifest["versions"], key=lambda v: v["generation_number"])
    out: dict[str, Value] = {}
    root_loc = version["root"].get("location")
    if root_loc is None:  # empty database
        return out
    stack = [(root_loc, b"")]
    while stack:
        loc, prefix = stack.pop()
        node = ts.ocdbt.dump(base, loc).result()
        for e in node["entries"]:
            if node["height"] > 0:
                stack.append((e["location"], prefix + e.get("subtree_common_prefix", b"")))
                continue
            key = (prefix + e["key"]).decode()
            if "inline_value" in e:
                out[key] = Value(inline=bytes(e["inline_value"]), file=None)
            else:
                path, off, length = _location(root, e["indirect_value"])
                out[key] = Value(inline=None, file=path, offset=off, length=length)
    return out


def zarr_dtype(s: str) -> np.dtype:
    """A Zarr v2 dtype string (numpy's ``'<f4'``, ``'|u1'``, or an ml_dtypes name such as
    ``'bfloat16'`` / ``'float8_e4m3fn'``, as TensorStore writes them) -> numpy dtype."""
    if s and s[0] in "<>|=":
        dt = np.dtype(s)
        if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
            raise Unsupported(f"big-endian dtype {s}")
        return dt
    if hasattr(ml_dtypes, s):
        return np.dtype(getattr(ml_dtypes, s))
    return np.dtype(s)


@dataclass
class ZarrArray:
    """One uncompressed C-order Zarr v2 array inside the database."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    sep: str
    values: dict[str, Value] = field(repr=False)

    def _chunk(self, cidx: tuple[int, ...]) -> Value:
        key = f"{self.name}/" + (self.sep.join(str(i) for i in cidx) if cidx else "0")
        v = self.values.get(key)
        if v is None:
            raise Unsupported(f"{key}: chunk not stored")
        return v

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    def first_offset(self) -> tuple[str, int]:
        """(data file, offset) of the first chunk, to order reads along the files."""
        if not all(self.shape):
            return ("", 0)
        v = self._chunk((0,) * len(self.shape))
        return (v.file or "", v.offset)

    def plan(self, box: tuple[slice, ...], out: np.ndarray, piece_bytes: int = 16 << 20) -> list["ReadOp"]:
        """Read operations that fill ``out`` (shape of the ``box`` of slices, ``start``/``stop``
        set) with ``self[box]``. Chunk rows that are contiguous both in the chunk and in ``out``
        are read straight into ``out``, in pieces of at most ``piece_bytes`` (so that one large
        array is read by several threads); other overlaps go through a temporary of the chunk
        rows involved."""
        nd = len(self.shape)
        if nd == 0:
            return [ReadOp(self._chunk(()), 0, self.dtype.itemsize, out.reshape(1).view(np.uint8))]
        lo = [s.start for s in box]
        hi = [s.stop for s in box]
        if any(h <= l for l, h in zip(lo, hi)):
            return []
        ops = []
        ranges = [range(l // c, (h - 1) // c + 1) for l, h, c in zip(lo, hi, self.chunks)]
        row_bytes = math.prod(self.chunks[1:]) * self.dtype.itemsize
        for cidx in itertools.product(*ranges):
            v = self._chunk(cidx)  # sizes checked by OcdbtIndex.array
            c0 = [i * c for i, c in zip(cidx, self.chunks)]
            a = [max(l, s) for l, s in zip(lo, c0)]  # the overlap, in array coordinates
            b = [min(h, s + c) for h, s, c in zip(hi, c0, self.chunks)]
            dst = out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))]
            r0, r1 = a[0] - c0[0], b[0] - c0[0]  # its rows within the chunk
            inner_full = all(x == s and y == s + c for x, y, s, c in zip(a[1:], b[1:], c0[1:], self.chunks[1:]))
            if inner_full and dst.flags.c_contiguous:
                flat = dst.reshape(-1).view(np.uint8)
                step = max(1, piece_bytes)
                for o in range(0, flat.size, step):
                    ops.append(ReadOp(v, r0 * row_bytes + o, min(step, flat.size - o), flat[o : o + step]))
            else:
                sub = tuple(slice(x - s, y - s) for x, y, s in zip(a[1:], b[1:], c0[1:]))
                ops.append(ReadOp(v, r0 * row_bytes, (r1 - r0) * row_bytes, dst, self.chunks[1:], sub))
        return ops


@dataclass
class ReadOp:
    """``length`` bytes at ``offset`` within a stored chunk. Without ``sub`` they go straight into
    the uint8 array ``dst``; with it they are whole chunk rows (inner shape ``inner``), read into a
    temporary, and ``rows[:, *sub]`` is copied into ``dst``."""

    value: Value
    offset: int
    length: int
    dst: np.ndarray
    inner: tuple[int, ...] | None = None
    sub: tuple[slice, ...] | None = None

    def run(self) -> None:
        """Thread-safe; ``os.preadv`` releases the GIL. Each operation opens the file itself: on
        a cold cache that reads faster than threads sharing one descriptor (measured)."""
        buf = self.dst if self.sub is None else np.empty(self.length, np.uint8)
        v = self.value
        if v.inline is not None:
            buf[...] = np.frombuffer(v.inline, np.uint8, count=self.length, offset=self.offset)
        else:
            mv = memoryview(buf).cast("B")
            fd = os.open(v.file, os.O_RDONLY)
            try:
                done = 0
                while done < self.length:
                    n = os.preadv(fd, [mv[done:]], v.offset + self.offset + done)
                    if n <= 0:
                        raise OSError(f"{v.file}: unexpected end of file at {v.offset + self.offset + done}")
                    done += n
            finally:
                os.close(fd)
        if self.sub is not None:
            rows = buf.view(self.dst.dtype).reshape(-1, *self.inner)
            self.dst[...] = rows[(slice(None), *self.sub)]


class OcdbtIndex:
    """Where every array of an Orbax OCDBT checkpoint directory lives (see the module docstring)."""

    def __init__(self, root: str):
        self.root = root
        self.values = read_values(root)

    def array(self, name: str) -> ZarrArray | None:
        """The array stored under ``name`` if this reader can read it directly, else None."""
        v = self.values.get(f"{name}/.zarray")
        if v is None or v.inline is None and v.file is None:
            return None
        try:
            raw = v.inline
            if raw is None:
                with open(v.file, "rb") as f:
                    f.seek(v.offset)
                    raw = f.read(v.length)
            meta = json.loads(raw)
            if (
                meta.get("zarr_format") != 2
                or meta.get("compressor") is not None
                or meta.get("filters")
                or meta.get("order", "C") != "C"
            ):
                return None
            shape = tuple(int(x) for x in meta["shape"])
            chunks = tuple(int(x) for x in meta["chunks"])
            if len(chunks) != len(shape) or any(c <= 0 for c in chunks):
                return None
            dtype = zarr_dtype(meta["dtype"])
        except (Unsupported, ValueError, TypeError, KeyError, AttributeError):
            return None
        arr = ZarrArray(name, shape, dtype, chunks, meta.get("dimension_separator", "."), self.values)
        if all(shape):  # every chunk stored, at full chunk size (Orbax stores fill-value chunks too)
            grid = [range(-(-n // c)) for n, c in zip(shape, chunks)]
            try:
                for cidx in itertools.product(*grid):
                    v = arr._chunk(cidx)
                    if (len(v.inline) if v.inline is not None else v.length) != arr.chunk_bytes:
                        return None
            except Unsupported:
                return None
        return arr
