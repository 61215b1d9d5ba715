"""Checkpoints: official DeepSeek safetensors in (quantized parameters kept as stored), official
safetensors out (quantizing bf16 weights on write), and Orbax for fast restores onto any mesh.

* :func:`load_checkpoint` – official directory -> ``(cfg, params)`` (memmapped, per-shard, sharded).
* :func:`save_checkpoint` – ``params`` -> official directory (shards + index + config.json).
* :func:`save_params` / :func:`restore_params` – Orbax checkpoint of the parameter tree (atomic).
* CLI: ``python -m dsv41_jax.convert SRC DST`` (official safetensors -> Orbax).
"""

from .layout import leaf_table
from .loader import CheckpointFiles, gather_rows, load_checkpoint, read_official
from .orbax_io import restore_params, save_params
from .safetensors_io import CheckpointError, SafetensorsFile
from .writer import config_to_hf, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "SafetensorsFile",
    "config_to_hf",
    "gather_rows",
    "leaf_table",
    "load_checkpoint",
    "read_official",
    "restore_params",
    "save_checkpoint",
    "save_params",
]
