"""Worker for tests/test_sharding.py (and the 2-GPU benchmark): runs the tiny model's forward and a
few greedy decode steps on one device and on several meshes and prints one JSON line per case.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py \
        --meshes "tp=2;ep=2;dp=2,tp=2,ep=2" --dtype float32 --kv float32

The CPU device count must be set before JAX is imported (hence a subprocess). Prefill and decode
share one compiled step: every call feeds S=CHUNK tokens per row, decode calls with length 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK = 4


def fast_init_params(cfg, seed=0):
    """Random parameters in the real formats, made in numpy (init_params compiles one program per
    leaf, minutes on a loaded CPU). Same magnitudes as init_params' recipes; quantized leaves get
    random e4m3 / e2m1 codes with one power-of-two scale per tensor."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from dsv41_jax import params as P
    from dsv41_jax.quant import Fp4Tensor, Fp8Tensor

    rng = np.random.default_rng(seed)
    hc_dim = cfg.hc_mult * cfg.dim
    gains = {"linear": None, "norm": 0.1, "sink": 0.5, "hc_base": 0.5, "gate_bias": 0.5, "engram_table": 0.5}

    def f32(leaf):
        n = rng.standard_normal(leaf.shape, np.float32)
        fan = leaf.shape[-1]
        k = leaf.init
        if k == "linear":
            return n / np.sqrt(fan)
        if k == "norm":
            return 1.0 + 0.1 * n
        if k in ("sink", "hc_base", "gate_bias", "engram_table"):
            return 0.5 * n
        if k == "hc_fn":
            return n / np.sqrt(hc_dim)
        if k == "hc_scale":
            return rng.uniform(0.5, 1.5, leaf.shape).astype(np.float32)
        if k == "gate_weight":
            return 4.0 * n / np.sqrt(fan)
        if k == "weights_proj":
            return 16.0 * n / np.sqrt(fan)
        if k == "engram_qk":
            return 1.0 + 0.3 * n
        raise ValueError(k)

    def e8m0(shape, exp):
        return np.full(shape, 127 + exp, np.uint8).view(ml_dtypes.float8_e8m0fnu)

    def make(leaf):
        fan = leaf.shape[-1]
        if leaf.fmt == "fp8":
            spec = leaf.spec()
            g = 0.5 if leaf.init == "engram_table" else 1.0 / np.sqrt(fan)
            exp = int(np.round(np.log2(g)))
            data = rng.standard_normal(leaf.shape, np.float32).astype(ml_dtypes.float8_e4m3fn)
            return Fp8Tensor(data=jnp.asarray(data), scale=jnp.asarray(e8m0(spec.scale.shape, exp)), block=spec.block)
        if leaf.fmt == "fp4":
            spec = leaf.spec()
            exp = int(np.round(np.log2(1.0 / np.sqrt(fan)))) - 2
            data = rng.integers(0, 256, spec.data.shape, dtype=np.uint8)
            return Fp4Tensor(data=jnp.asarray(data), scale=jnp.asarray(e8m0(spec.scale.shape, exp)), block=spec.block)
        x = f32(leaf)
        return jnp.asarray(x.astype(ml_dtypes.bfloat16 if leaf.fmt == "bf16" else np.float32))

    return jax_tree_map_leaves(make, P.param_layout(cfg), P._is_leaf)


def jax_tree_map_leaves(fn, tree, is_leaf):
    import jax

    return jax.tree.map(fn, tree, is_leaf=is_leaf)


def engram_ids_fn(cfg):
    import numpy as np

    from dsv41_jax.engram_hash import EngramHasher

    if not cfg.engram_layer_ids:
        return lambda hist, pos: None
    hasher = EngramHasher.from_config(cfg, token_map=np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)

    def ids(hist, pos):
        import jax.numpy as jnp

        out = hasher(np.asarray(hist), np.asarray(pos))
        return {str(l): jnp.asarray(out[:, :, i].astype(np.int32)) for i, l in enumerate(cfg.engram_layer_ids)}

    return ids


def run_generation(step, params, cache, prompt, n_new, ids_fn, sync):
    """Prefill ``prompt`` [B, T] in CHUNK-token calls, then ``n_new`` greedy steps (length 1).
    Returns (list of last-position logits per call [B, V] numpy, generated tokens [B, n_new],
    decode seconds per step)."""
    import jax.numpy as jnp
    import numpy as np

    B, T = prompt.shape
    hist = prompt.copy()
    logits_all = []
    pos = 0
    while pos < T:
        n = min(CHUNK, T - pos)
        toks = np.zeros((B, CHUNK), np.int32)
        toks[:, :n] = hist[:, pos:pos + n]
        p = np.broadcast_to(pos + np.arange(CHUNK), (B, CHUNK))
        full = np.concatenate([hist, np.zeros((B, CHUNK), np.int32)], 1)
        lg, cache = step(params, cache, jnp.asarray(toks), jnp.full((B,), n, jnp.int32), ids_fn(full, p))
        pos += n
    logits_all.append(np.asarray(lg))
    gen = []
    times = []
    for _ in range(n_new):
        nxt = np.argmax(logits_all[-1], axis=-1).astype(np.int32)
        gen.append(nxt)
        hist = np.concatenate([hist, nxt[:, None]], 1)
        toks = np.zeros((B, CHUNK), np.int32)
        toks[:, 0] = nxt
        p = np.broadcast_to(pos + np.arange(CHUNK), (B, CHUNK))
        full = np.concatenate([hist, np.zeros((B, CHUNK), np.int32)], 1)
        t0 = time.perf_counter()
        lg, cache = step(params, cache, jnp.asarray(toks), jnp.full((B,), 1, jnp.int32), ids_fn(full, p))
        sync(lg)
        times.append(time.perf_counter() - t0)
        pos += 1
        logits_all.append(np.asarray(lg))
    return logits_all, np.stack(gen, 1), times


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshes", default="tp=2;ep=2;dp=2,tp=2,ep=2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv", default="float32")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--new", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=32)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--override", default="", help="config overrides k=v,k=v (ints)")
    ap.add_argument("--ep-path", default=None)
    a = ap.parse_args(argv)
    if a.ep_path:
        os.environ["DSV41_EP_PATH"] = a.ep_path

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.cache import init_cache
    from dsv41_jax.config import get_preset
    from dsv41_jax.options import RunOptions
    from dsv41_jax.transformer import forward_step
    from sharding.mesh import describe, make_mesh
    from sharding.rules import explain, init_cache_sharded, param_partition_specs, shard_params
    from sharding.step import sharded_forward_step

    cfg = get_preset(a.preset)
    if a.override:
        kw = {}
        for item in a.override.split(","):
            k, v = item.split("=")
            kw[k] = int(v)
        cfg = dataclasses.replace(cfg, **kw)
    opts = RunOptions(dtype=a.dtype, kv_cache_dtype=a.kv)
    B = a.batch
    t0 = time.perf_counter()
    params = fast_init_params(cfg, 0)
    jax.block_until_ready(params)
    print(json.dumps({"event": "init", "s": round(time.perf_counter() - t0, 2), "devices": jax.device_count(),
                      "platform": jax.devices()[0].platform}), flush=True)
    ids_fn = engram_ids_fn(cfg)
    prompt = np.random.RandomState(1).randint(0, min(cfg.vocab_size, 50000), (B, a.prompt)).astype(np.int32)
    sync = jax.block_until_ready

    ref_step = jax.jit(lambda p, c, t, l, i: forward_step(p, c, t, l, i, None, cfg=cfg, opts=opts, logits_mode="last"),
                       donate_argnums=(1,))
    t0 = time.perf_counter()
    ref_logits, ref_gen, ref_t = run_generation(ref_step, params, init_cache(cfg, B, a.max_seq_len, opts), prompt,
                                                a.new, ids_fn, sync)
    print(json.dumps({"event": "single", "s": round(time.perf_counter() - t0, 2), "tokens": ref_gen.tolist(),
                      "decode_ms": [round(1e3 * t, 3) for t in ref_t]}), flush=True)

    for spec in [s for s in a.meshes.split(";") if s.strip()]:
        mesh = make_mesh(spec)
        param_partition_specs(cfg, mesh)
        notes = explain()
        t0 = time.perf_counter()
        sp = shard_params(params, cfg, mesh)
        cache = init_cache_sharded(cfg, mesh, B, a.max_seq_len, opts)
        step = sharded_forward_step(cfg, opts, mesh, batch=B, max_seq_len=a.max_seq_len, logits_mode="last")
        logits, gen, ts = run_generation(step, sp, cache, prompt, a.new, ids_fn, sync)
        diffs = [float(np.max(np.abs(x - r))) for x, r in zip(logits, ref_logits)]
        scale = float(max(np.max(np.abs(r)) for r in ref_logits))
        print(json.dumps({
            "event": "mesh", "mesh": spec, "desc": describe(mesh), "s": round(time.perf_counter() - t0, 2),
            "max_abs_diff": max(diffs), "max_abs_ref": scale, "tokens": gen.tolist(),
            "tokens_equal": bool(np.array_equal(gen, ref_gen)), "n_replicated_notes": len(notes),
            "decode_ms": [round(1e3 * t, 3) for t in ts],
        }), flush=True)


if __name__ == "__main__":
    main()
