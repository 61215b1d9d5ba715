"""Fast random parameters in the real storage formats, made with numpy (no per-leaf jit), for
checkpoint tests and multi-GB benchmarks. Magnitudes follow the init recipes of
:func:`dsv41_jax.params.init_params` (linear ~ 1/sqrt(fan_in), norms ~ 1, ...), and quantized
leaves hold valid codes: e4m3 data within ±448 and power-of-two e8m0 scales chosen so the
dequantized weight has the linear init's scale; FP4 bytes are random e2m1 code pairs."""

from __future__ import annotations

import math

import jax
import ml_dtypes
import numpy as np

from ..config import ModelConfig
from ..params import Leaf, _scale_draft, param_layout
from ..quant import Fp4Tensor, Fp8Tensor
from ..quant.tensors import fp8_scale_shape

def _plain(rng, leaf: Leaf, hc_dim: int) -> np.ndarray:
    draft = (rng.random(leaf.shape, dtype=np.float32) if leaf.init == "hc_scale"
             else rng.standard_normal(leaf.shape, dtype=np.float32))
    x = _scale_draft(leaf.init, draft, leaf.shape[-1], hc_dim)  # the same recipes as init_params
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16 if leaf.fmt == "bf16" else np.float32)


def _target_std(leaf: Leaf) -> float:
    return 0.5 if leaf.init == "engram_table" else 1.0 / math.sqrt(leaf.shape[-1])


def _fp8(rng, leaf: Leaf) -> Fp8Tensor:
    block = leaf.block or (32, 32)
    # data ~ N(0, 64^2) in e4m3 (|x| <= 448), scale 2^e with 64 * 2^e ~ target std
    data = np.clip(rng.standard_normal(leaf.shape, dtype=np.float32) * 64.0, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    e = int(round(math.log2(_target_std(leaf) / 64.0)))
    sshape = fp8_scale_shape(leaf.shape, block)
    ebytes = (127 + e + rng.integers(-1, 2, sshape)).astype(np.uint8)
    return Fp8Tensor(data=data, scale=ebytes.view(ml_dtypes.float8_e8m0fnu), block=tuple(block))


def _fp4(rng, leaf: Leaf) -> Fp4Tensor:
    block = leaf.block or 32
    shape = leaf.shape
    data = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
    e = int(round(math.log2(_target_std(leaf) / 2.5)))
    ebytes = (127 + e + rng.integers(-1, 2, (*shape[:-1], shape[-1] // block))).astype(np.uint8)
    return Fp4Tensor(data=data, scale=ebytes.view(ml_dtypes.float8_e8m0fnu), block=block)


def random_params(cfg: ModelConfig, seed: int = 0, *, to_device: bool = False) -> dict:
    """Random parameters for ``cfg`` as numpy arrays (``to_device``: jax arrays) in the tree of
    :func:`~dsv41_jax.params.param_specs`."""
    rng = np.random.default_rng(seed)
    hc_dim = cfg.hc_mult * cfg.dim

    def make(leaf: Leaf):
        if leaf.fmt == "fp8":
            out = _fp8(rng, leaf)
        elif leaf.fmt == "fp4":
            out = _fp4(rng, leaf)
        else:
            out = _plain(rng, leaf, hc_dim)
        return jax.tree.map(jax.numpy.asarray, out) if to_device else out

    return jax.tree.map(make, param_layout(cfg), is_leaf=lambda x: isinstance(x, Leaf))
