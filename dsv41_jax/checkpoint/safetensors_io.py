"""Raw safetensors I/O with numpy memory maps: the header parser, the dtype table, tensor reads
(whole or sliced, never the whole file), and a streaming writer.

Why not ``safetensors.numpy``: it cannot build ``F8_E8M0`` arrays (numpy has no such dtype; it lives
in ``ml_dtypes``), and it reads whole files. The format is simple (8-byte little-endian header
length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{...}}``, then the raw little-endian data, offsets relative to the byte after the header), so we
parse it ourselves and map each tensor's bytes with :class:`numpy.memmap`. Only the pages a read
touches are paged in, and they leave the process's resident set when the memmap is dropped.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model it claims to be. The message lists every
    problem found (by tensor name, expected vs found)."""


# safetensors dtype name <-> numpy dtype (ml_dtypes for the float8 / bfloat16 kinds)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def dtype_name(dtype) -> str:
    """The safetensors name of a numpy / jax dtype."""
    dt = np.dtype(dtype)
    if dt not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dt} has no safetensors name")
    return DTYPE_NAMES[dt]


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``begin``/``end`` are absolute file offsets."""

    name: str
    file: str
    dtype: str  # safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """A parsed safetensors header plus memory-mapped access to its tensors. Opening reads only the
    header; every problem with it (truncated file, bad JSON, offsets past the end, sizes that do not
    match dtype x shape, unknown dtypes) raises :class:`CheckpointError` naming the file and tensor."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise CheckpointError(
                        f"{self.path}: truncated or not a safetensors file (header length {n}, file size {size})"
                    )
                raw = f.read(n)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: is a directory, expected a safetensors file") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.size = size
        self.data_start = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        problems: list[str] = []
        truncated: list[str] = []
        for name, e in header.items():
            try:
                dt, shape, (b, en) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                problems.append(f"{name}: malformed header entry {e!r}")
                continue
            if dt not in DTYPES:
                problems.append(f"{name}: unknown dtype {dt!r}")
                continue
            want = math.prod(shape) * DTYPES[dt].itemsize
            if en - b != want or b < 0:
                problems.append(f"{name}: data_offsets [{b}, {en}] hold {en - b} bytes, {dt}{list(shape)} needs {want}")
                continue
            if self.data_start + en > size:
                truncated.append(name)
                continue
            self.tensors[name] = TensorInfo(name, self.path, dt, shape, self.data_start + b, self.data_start + en)
        if truncated:
            problems.insert(
                0,
                f"file is truncated: {size} bytes, but {len(truncated)} tensor(s) end past it "
                f"(first: {', '.join(sorted(truncated)[:5])})",
            )
        if problems:
            raise CheckpointError(f"{self.path}: " + "; ".join(problems))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def memmap(self, name: str, dtype=None) -> np.ndarray:
        """A read-only memory map of one tensor (no bytes read until touched). ``dtype`` reinterprets
        the bytes (same itemsize), e.g. I8 packed FP4 as uint8."""
        info = self.tensors[name]
        dt = np.dtype(dtype) if dtype is not None else DTYPES[info.dtype]
        if dt.itemsize != DTYPES[info.dtype].itemsize:
            raise CheckpointError(f"{self.path}: {name}: cannot view {info.dtype} as {dt}")
        if info.nbytes == 0:
            return np.zeros(info.shape, dt)
        return np.memmap(self.path, dtype=dt, mode="r", offset=info.begin, shape=info.shape)

    def read(self, name: str, index: Any = (), dtype=None) -> np.ndarray:
        """A copy (in RAM) of ``tensor[index]``; only the pages that slice covers are read."""
        m = self.memmap(name, dtype)
        out = np.array(m[index], copy=True)
        del m
        return out


# ------------------------------------------------------------------------------------------------
# writing


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None):
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dt, shape, nbytes in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
    chunk_bytes: int = 64 << 20,
) -> int:
    """Stream tensors into one safetensors file. ``tensors`` yields ``(name, dtype name, shape,
    getter)``; each getter is called once, in order, when its bytes are written, so only one
    tensor is materialised at a time. Returns the file size."""
    entries = list(tensors)
    sized = [(n, dt, tuple(s), math.prod(s) * DTYPES[dt].itemsize) for n, dt, s, _ in entries]
    with open(path, "wb") as f:
        f.write(_header_bytes(sized, metadata))
        for (name, dt, shape, nbytes), (_, _, _, get) in zip(sized, entries):
            arr = np.ascontiguousarray(get())
            if tuple(arr.shape) != tuple(shape) or arr.dtype.itemsize != DTYPES[dt].itemsize:
                raise CheckpointError(f"writing {name}: got {arr.dtype}{list(arr.shape)}, header says {dt}{list(shape)}")
            flat = arr.reshape(-1).view(np.uint8)
            for i in range(0, flat.size, chunk_bytes):
                f.write(flat[i : i + chunk_bytes].tobytes())
            del arr, flat
        f.flush()
        os.fsync(f.fileno())
        return f.tell()
