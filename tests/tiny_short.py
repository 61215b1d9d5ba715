"""A shorter tiny V4.1 for tests that check kernel plumbing through whole decode steps.

The tiny preset's first 6 layers (0-1 SWA only, 2-4 ratio 2 with their own KV and indexer, 5
ratio 1 and the candidate source; Engram at 1 and 4) and its 3 DSpark stages on layers 3-5. Every
mHC site kind and the fused MoE occur as in the preset; the reuse and re-index layers 6-8 do not,
and the tests that need them use the preset. Each interpret-mode step then compiles and runs two
thirds of the layers (session 34: the six model-level kernel tests took 325 s of CPU time with 9)."""

import dataclasses

from dsv41_jax.config import ModelConfig, get_preset


def tiny_short(**overrides) -> ModelConfig:
    cfg = get_preset("tiny")
    return dataclasses.replace(cfg, n_layers=6, compress_ratios=(0, 0, 2, 2, 2, 1, 0, 0, 0),
                               index_source_layers=(2, 4, 5), dspark_target_layer_ids=(3, 4, 5), **overrides)
