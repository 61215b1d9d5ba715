"""A shorter tiny V4.1 for tests that check kernel plumbing through whole decode steps.

The tiny preset's first 6 layers (0-1 SWA only, 2-4 ratio 2 with their own KV and indexer, 5
ratio 1 and the candidate source; Engram at 1 and 4) and its 3 DSpark stages on layers 3-5. Every
mHC site kind and the fused MoE occur as in the preset; the reuse and re-index layers 6-8 do not,
and the tests that need them use the preset. Each interpret-mode step then compiles and runs two
thirds of the layers (session 34: the six model-level kernel tests took 325 s of CPU time with 9).

``n_layers=3`` keeps layers 0-2 (0-1 SWA only, 2 ratio 2 with its own KV and indexer; Engram at 1,
no candidate source): still every mHC site kind (the embedding's collapse, an FFN expansion before
an Engram layer, one fused with the next layer's collapse and mixes, the last one with the head's
collapse), for tests of the mHC / deferred-sum plumbing that do not depend on the attention kinds."""

import dataclasses

from dsv41_jax.config import ModelConfig, get_preset


N_LAYERS = 6


def tiny_short(n_layers: int = N_LAYERS, **overrides) -> ModelConfig:
    """The preset cut to its first ``n_layers`` layers: their compress ratios, KV / index sources and
    Engram layers as in the preset (the candidate source only if kept), the DSpark stages' ratios
    after them, and the stages' target layers moved to the last three kept layers."""
    return cut_layers(get_preset("tiny"), n_layers, **overrides)


def cut_params(params: dict, n_layers: int) -> dict:
    """A V4.1 model's params (e.g. a checkpoint's) for :func:`cut_layers`: the first ``n_layers``
    layers' weights; the DSpark stages (``params["mtp"]``), embedding and head unchanged."""
    return {**params, "layers": {k: v for k, v in params["layers"].items() if int(k) < n_layers}}


def cut_layers(cfg: ModelConfig, n_layers: int, **overrides) -> ModelConfig:
    """A V4.1 config (the tiny preset, a tiny checkpoint's) cut to its first ``n_layers`` layers, as
    :func:`tiny_short` describes."""
    n = n_layers
    engram = [(layer, e) for layer, e in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if layer < n]
    return dataclasses.replace(
        cfg, n_layers=n, compress_ratios=cfg.compress_ratios[:n] + cfg.compress_ratios[cfg.n_layers:],
        kv_source_layers=tuple(layer for layer in cfg.kv_source_layers if layer < n),
        index_source_layers=tuple(layer for layer in cfg.index_source_layers if layer < n),
        candidate_source_layer=cfg.candidate_source_layer if cfg.candidate_source_layer < n else -1,
        engram_layer_ids=tuple(layer for layer, _ in engram), engram_num_embeddings=tuple(e for _, e in engram),
        dspark_target_layer_ids=tuple(range(n - len(cfg.dspark_target_layer_ids), n)), **overrides)


def tiny_v4_short(n_layers: int = 3, **overrides) -> ModelConfig:
    """The ``tiny-v4`` preset (layers 0 sliding and hash-routed, 1 and 3 CSA = ratio 4 with their own
    indexer, 2 and 4 HCA = ratio 8; one MTP block) cut to its first ``n_layers`` layers: at 3, every
    V4 layer kind once (the preset's layers 3-4 repeat 1-2), for kernel tests whose checks are per
    layer or per call. The KV / index sources are derived from the ratios (V4: every compressed layer
    owns its caches)."""
    return cut_v4_layers(get_preset("tiny-v4"), n_layers, **overrides)


def cut_v4_layers(cfg: ModelConfig, n_layers: int, **overrides) -> ModelConfig:
    """A V4 config (a preset's, a checkpoint's) cut to its first ``n_layers`` layers: their compress
    ratios, then the MTP blocks' as before (V4 derives the KV / index sources from the ratios)."""
    return cfg.replace(n_layers=n_layers,
                       compress_ratios=cfg.compress_ratios[:n_layers] + cfg.compress_ratios[cfg.n_layers:], **overrides)
