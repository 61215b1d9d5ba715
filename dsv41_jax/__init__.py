"""DeepSeek-V4.1-Flash in JAX: config, formats, model, caches, engine, checkpoints."""

from .config import ModelConfig, get_preset
from .model import Model
from .options import RunOptions

__all__ = ["Model", "ModelConfig", "RunOptions", "get_preset"]
