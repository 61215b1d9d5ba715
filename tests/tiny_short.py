"""A shorter tiny V4.1 for tests that check kernel plumbing through whole decode steps.

The tiny preset's first 6 layers (0-1 SWA only, 2-4 ratio 2 with their own KV and indexer, 5
ratio 1 and the candidate source; Engram at 1 and 4) and its 3 DSpark stages on layers 3-5. Every
mHC site kind and the fused MoE occur as in the preset; the reuse and re-index layers 6-8 do not,
and the tests that need them use the preset. Each interpret-mode step then compiles and runs two
thirds of the layers (session 34: the six model-level kernel tests took 325 s of CPU time with 9)."""

import dataclasses

from dsv41_jax.config import ModelConfig, get_preset


N_LAYERS = 6


def tiny_short(**overrides) -> ModelConfig:
    """The preset cut to its first :data:`N_LAYERS` layers: their compress ratios and index sources
    as in the preset, the DSpark stages' ratios after them, and the stages' target layers moved to
    the last three kept layers."""
    cfg = get_preset("tiny")
    n = N_LAYERS
    return dataclasses.replace(
        cfg, n_layers=n, compress_ratios=cfg.compress_ratios[:n] + cfg.compress_ratios[cfg.n_layers:],
        index_source_layers=tuple(layer for layer in cfg.index_source_layers if layer < n),
        dspark_target_layer_ids=tuple(range(n - len(cfg.dspark_target_layer_ids), n)), **overrides)
