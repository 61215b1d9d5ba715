"""Worker for tests/test_sharding.py (and the 2-GPU benchmark): runs the tiny model's forward and a
few greedy decode steps on one device and on several meshes and prints one JSON line per case.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py \
        --meshes "tp=2;ep=2;dp=2,tp=2,ep=2" --dtype float32 --kv float32

The CPU device count must be set before JAX is imported (hence a subprocess). Prefill and decode
share one compiled step: every call feeds S=CHUNK tokens per row, decode calls with length 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHUNK = 4
ENGINE_BATCH = 4  # engine slots in engine_check (a multiple of every tested dp)

# the tiny preset's layer pattern (9 layers, every V4.1 feature) at V4.1-Flash's real widths,
# 16 experts, no DSpark stages: a "real-width model with fewer layers and experts"
WIDE = dict(dim=5120, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
            window_size=128, moe_inter_dim=2304, n_routed_experts=16, n_activated_experts=6, index_n_heads=32,
            index_head_dim=128, index_topk=64, engram_n_heads=8, engram_head_dim=256, n_mtp_layers=0)


def get_config(preset: str):
    import dataclasses

    from dsv41_jax.config import get_preset

    if preset == "tiny-wide":
        from dsv41_jax.engram_hash import EngramLayout

        c = get_preset("tiny")
        c = dataclasses.replace(c, name="tiny-wide", compress_ratios=c.compress_ratios[:c.n_layers], **WIDE)
        # the Engram table rows follow from the (now 8) heads' prime buckets
        lay = EngramLayout.build(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size,
                                 c.engram_compressed_vocab_size, None)
        rows = tuple(int(sum(p for ng in layer for p in ng)) for layer in lay.primes)
        return dataclasses.replace(c, engram_num_embeddings=rows)
    return get_preset(preset)


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
            # random e4m3 codes with the top exponent bit clear: |v| <= 1.875, never NaN
            data = (rng.integers(0, 256, leaf.shape, dtype=np.uint8) & 0xBF).view(ml_dtypes.float8_e4m3fn)
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


def run_generation(step, params, cache, prompt, n_new, ids_fn, sync, force=None):
    """Prefill ``prompt`` [B, T] in CHUNK-token calls, then ``n_new`` greedy steps (length 1).
    Returns (list of last-position logits per call [B, V] numpy, generated tokens [B, n_new],
    decode seconds per step). ``force`` [B, n_new]: feed these tokens instead of the argmax
    (teacher forcing: every step's logits stay comparable with the run that produced them, even
    where a bf16 near-tie makes the argmax differ); the argmax is still what is returned."""
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
    for i in range(n_new):
        nxt = np.argmax(logits_all[-1], axis=-1).astype(np.int32)
        gen.append(nxt)
        if force is not None:
            nxt = np.asarray(force[:, i], np.int32)
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
    return logits_all, np.stack(gen, 1), times, (cache, hist, pos)


COMM_NAMES = ("nccl", "all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute", "allreduce",
              "alltoall", "memcpyp2p", "memcpy p2p")


def is_comm(line_name: str, event_name: str) -> bool:
    """Whether a profiler event is communication: an NCCL kernel or XLA collective by name, or any
    event on a peer-to-peer copy stream (session 4: the ep=2 all-reduce showed up as ``MemcpyP2P``
    stream activity, which the name test alone missed)."""
    nm = event_name.lower()
    return "memcpyp2p" in line_name.lower().replace(" ", "") or any(c in nm for c in COMM_NAMES)


def profile_decode(step, params, state, n, ids_fn, outdir):
    """``n`` more decode steps under ``jax.profiler.trace``. Returns per-step device time split into
    collectives (NCCL kernels / XLA collective ops) and the rest, per device, in ms, plus the
    wall time per step."""
    import glob

    import jax
    import jax.numpy as jnp
    import numpy as np

    cache, hist, pos = state
    B = hist.shape[0]
    toks = np.zeros((B, CHUNK), np.int32)
    toks[:, 0] = hist[:, -1]

    def one(cache, pos):
        p = np.broadcast_to(pos + np.arange(CHUNK), (B, CHUNK))
        full = np.concatenate([hist, np.repeat(hist[:, -1:], n + 2 + CHUNK, 1)], 1)
        lg, cache = step(params, cache, jnp.asarray(toks), jnp.full((B,), 1, jnp.int32), ids_fn(full, p))
        return lg, cache

    lg, cache = one(cache, pos)  # warm
    jax.block_until_ready(lg)
    import time as _t

    t0 = _t.perf_counter()
    with jax.profiler.trace(outdir):
        for i in range(n):
            lg, cache = one(cache, pos + 1 + i)
        jax.block_until_ready(lg)
    wall = (_t.perf_counter() - t0) / n
    res = {"wall_ms": round(1e3 * wall, 3), "devices": {}}
    try:
        from jax.profiler import ProfileData

        files = sorted(glob.glob(os.path.join(outdir, "**", "*.xplane.pb"), recursive=True))
        pd = ProfileData.from_file(files[-1])
        for plane in pd.planes:
            if not plane.name.startswith("/device:"):
                continue
            comm = busy = 0
            lines = [l for l in plane.lines if l.name.startswith("Stream")] or \
                [l for l in plane.lines if l.name in ("XLA Ops",)]
            for line in lines:
                for e in line.events:
                    busy += e.duration_ns
                    if is_comm(line.name, e.name):
                        comm += e.duration_ns
            res["devices"][plane.name] = {"comm_ms": round(comm / n / 1e6, 4), "busy_ms": round(busy / n / 1e6, 4),
                                          "lines": sorted({l.name for l in plane.lines})[:8]}
    except Exception as err:  # noqa: BLE001
        res["error"] = repr(err)
    return res


def moe_unit(meshes):
    """expert_parallel_moe (psum and all_to_all) vs moe_experts on random MXFP4 / fp32 experts with a
    hidden dim that splits over tp (I=128)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.quant import quantize_mxfp4
    from pallas_kernels.moe import moe_experts
    from sharding.expert_parallel import expert_parallel_moe
    from sharding.mesh import make_mesh

    E, I, D, N, k = 8, 128, 64, 16, 2
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((N, D)), jnp.float32)
    w = jnp.asarray(r.uniform(0.1, 1.0, (N, k)), jnp.float32)
    idx = jnp.asarray(np.stack([r.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    raw = [r.standard_normal(s).astype(np.float32) / np.sqrt(s[-1]) for s in ((E, I, D), (E, D, I), (E, I, D))]
    for fmt in ("fp4", "f32"):
        ws = [quantize_mxfp4(jnp.asarray(a)) for a in raw] if fmt == "fp4" else [jnp.asarray(a) for a in raw]
        ref = moe_experts(x, w, idx, *ws, swiglu_limit=10.0, act_block=32)
        for spec in meshes:
            mesh = make_mesh(spec)
            for path in ("psum", "all_to_all"):
                f = jax.jit(lambda x, w, i, a, b, c: expert_parallel_moe(x, w, i, a, b, c, mesh=mesh, swiglu_limit=10.0,
                                                                         act_block=32, path=path))
                out = f(x, w, idx, *ws)
                err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                print(json.dumps({"event": "moe_unit", "fmt": fmt, "mesh": spec, "path": path, "rel_err": err}),
                      flush=True)


def engine_check(meshes, preset, dtype, kv, part="all"):
    """dsv41_jax.engine.Engine, one device vs ``Engine(..., mesh=mesh)``: the tokens of both loops
    (``device``: Engram tables on the devices, pipelined; ``host``: host tables, synced), greedy and
    sampled, with more requests than slots (continuous batching, slot resets in every dp group),
    and the collectives of each mesh engine's compiled decode step.

    ``part``: ``all`` (one process), or one of ``single`` / ``device`` / ``host`` (the one-device
    reference, the pipelined loop on every mesh, the synced loop on the first mesh): each prints its
    rows, the caller compares the tokens (tests/test_sharding.py runs the three as processes of their
    own, so the longest job is a third as long; ``tokens_equal`` is then left out)."""
    import numpy as np

    from dsv41_jax.engine import Engine, Request
    from dsv41_jax.model import Model
    from dsv41_jax.options import RunOptions
    from dsv41_jax.sampling import SamplingParams
    from sharding.mesh import make_mesh
    from dsv41_jax.compile_cache import enable_compilation_cache
    from sharding.step import collective_ops

    # as tests/conftest.py: compiled_text() below then reads the step the engine compiled from the cache
    enable_compilation_cache(os.environ.get("DSV41_COMPILE_CACHE") or os.path.join(ROOT, ".jax_cache"))
    cfg = get_config(preset)
    model = Model(cfg, fast_init_params(cfg, 0), token_map=np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)
    opts = RunOptions(dtype=dtype, kv_cache_dtype=kv)
    rng = np.random.RandomState(2)
    reqs = [Request(list(rng.randint(0, 50000, n)), 4) for n in (5, 9, 3, 7, 4, 11)]
    samplings = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=5)}

    def gen(mesh, mode):
        t0 = time.perf_counter()
        eng = Engine(model, batch_size=ENGINE_BATCH, max_seq_len=32, opts=opts, prefill_chunk=4, engram_mode=mode,
                     stop_ids=(), mesh=mesh)
        toks = {k: [r.output_ids for r in eng.generate(reqs, sp)] for k, sp in samplings.items()}
        coll = collective_ops(eng.compiled_text(decode=True), mesh) if mesh is not None else None
        return {"tokens": toks, "collectives": coll, "pipelined": eng.pipelined,
                "s": round(time.perf_counter() - t0, 1)}

    # one single-device reference: both Engram modes give the same numbers (tests/test_decode_parity.py)
    ref = None
    if part in ("all", "single"):
        ref = gen(None, "device")
        print(json.dumps({"event": "engine", "mode": "device", "mesh": "single", **ref}), flush=True)
    for i, mode in enumerate(("device", "host")):
        if part not in ("all", mode):
            continue
        for spec in meshes if i == 0 else meshes[:1]:  # the synced loop on the first mesh only (compile time)
            out = gen(make_mesh(spec), mode)
            if ref is not None:
                out["tokens_equal"] = out["tokens"] == ref["tokens"]
            print(json.dumps({"event": "engine", "mode": mode, "mesh": spec, **out}), flush=True)


def main(argv=None):
    import compile_log  # tests/ (this file's directory) is sys.path[0]

    compile_log.install("sharding_worker " + " ".join(sys.argv[1:] if argv is None else argv))
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
    ap.add_argument("--moe-unit", action="store_true")
    ap.add_argument("--engine", action="store_true", help="Engine(mesh=...) vs single device")
    ap.add_argument("--engine-part", default="all", choices=("all", "single", "device", "host"),
                    help="with --engine: only the one-device reference, the pipelined or the synced loop")
    ap.add_argument("--check-collectives", action="store_true",
                    help="also compile the decode step and list its collectives (element types NCCL must carry)")
    ap.add_argument("--profile", type=int, default=0, help="profile this many extra decode steps per run")
    ap.add_argument("--prof-dir", default="/tmp/dsv41_sharding_prof")
    ap.add_argument("--keep-going", action="store_true", help="report a failing mesh and continue")
    ap.add_argument("--repeat-single", action="store_true",
                    help="run the single-device generation twice in this process and report whether it is bit-identical")
    a = ap.parse_args(argv)
    if a.moe_unit:
        return moe_unit([s for s in a.meshes.split(";") if s.strip()])
    if a.engine:
        return engine_check([s for s in a.meshes.split(";") if s.strip()], a.preset, a.dtype, a.kv, a.engine_part)
    if a.ep_path:
        os.environ["DSV41_EP_PATH"] = a.ep_path

    import dataclasses

    import jax
    import numpy as np

    from dsv41_jax.cache import init_cache
    from dsv41_jax.options import RunOptions
    from dsv41_jax.transformer import forward_step

    cfg = get_config(a.preset)
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
    ref_logits, ref_gen, ref_t, ref_state = run_generation(ref_step, params, init_cache(cfg, B, a.max_seq_len, opts), prompt,
                                                a.new, ids_fn, sync)
    row = {"event": "single", "s": round(time.perf_counter() - t0, 2), "tokens": ref_gen.tolist(),
           "decode_ms": [round(1e3 * t, 3) for t in ref_t],
           # a digest of every logit, to compare one device's result between processes
           "logits_sha1": hashlib.sha1(b"".join(np.asarray(x).tobytes() for x in ref_logits)).hexdigest()}
    if a.repeat_single:
        # the same compiled program again in this process: must be bit-identical (a difference means a
        # non-deterministic kernel, e.g. a race or a read of uninitialised memory)
        again = run_generation(ref_step, params, init_cache(cfg, B, a.max_seq_len, opts), prompt, a.new, ids_fn, sync,
                               force=ref_gen)[0]
        row["repeat_bit_identical"] = all(np.array_equal(x, y) for x, y in zip(again, ref_logits))
        row["repeat_max_abs_diff"] = max(float(np.max(np.abs(x - y))) for x, y in zip(again, ref_logits))
    if a.profile:
        row["profile"] = profile_decode(ref_step, params, ref_state, a.profile, ids_fn, os.path.join(a.prof_dir, "single"))
    print(json.dumps(row), flush=True)
    del ref_state

    for spec in [s for s in a.meshes.split(";") if s.strip()]:
        try:
            run_mesh(a, cfg, opts, params, spec, prompt, ids_fn, ref_logits, ref_gen, sync)
        except Exception as err:  # noqa: BLE001 - report and go on with the next mesh
            if not a.keep_going:
                raise
            print(json.dumps({"event": "mesh", "mesh": spec, "error": repr(err)[:2000]}), flush=True)


def run_mesh(a, cfg, opts, params, spec, prompt, ids_fn, ref_logits, ref_gen, sync):
    import time

    import numpy as np

    from sharding.mesh import describe, make_mesh
    from sharding.rules import explain, init_cache_sharded, param_partition_specs, shard_params
    from sharding.step import sharded_forward_step

    B = a.batch
    spec, _, ep_path = spec.partition("@")  # "ep=2@all_to_all": force the expert-parallel path
    os.environ["DSV41_EP_PATH"] = ep_path or a.ep_path or "auto"
    if True:
        mesh = make_mesh(spec)
        param_partition_specs(cfg, mesh)
        notes = explain()
        t0 = time.perf_counter()
        sp = shard_params(params, cfg, mesh)
        cache = init_cache_sharded(cfg, mesh, B, a.max_seq_len, opts)
        step = sharded_forward_step(cfg, opts, mesh, batch=B, max_seq_len=a.max_seq_len, logits_mode="last")
        # teacher-forced with the single device's tokens, so every step's logits are comparable
        logits, gen, ts, state = run_generation(step, sp, cache, prompt, a.new, ids_fn, sync, force=ref_gen)
        diffs = [float(np.max(np.abs(x - r))) for x, r in zip(logits, ref_logits)]
        scale = float(max(np.max(np.abs(r)) for r in ref_logits))
        # where the argmax differs: the single device's top-1 minus top-2 logit there (a flip of a
        # near-tie smaller than the logit difference is rounding, not a wrong computation)
        flips = []
        for i in range(a.new):
            for b in range(B):
                if gen[b, i] != ref_gen[b, i]:
                    top2 = np.sort(ref_logits[i][b])[-2:]
                    flips.append({"step": i, "row": b, "ref_margin": float(top2[1] - top2[0]),
                                  "diff": float(np.max(np.abs(logits[i][b] - ref_logits[i][b])))})
        prof = profile_decode(step, sp, state, a.profile, ids_fn, os.path.join(a.prof_dir, spec.replace(",", "_")
                                                                               .replace("=", ""))) if a.profile else None
        coll = dp_coll = None
        if a.check_collectives:
            import jax.numpy as jnp

            from sharding.step import collective_ops, collectives

            cache_, hist_, pos_ = state
            toks = jnp.zeros((B, CHUNK), jnp.int32)
            ids = ids_fn(np.concatenate([hist_, np.zeros((B, CHUNK), np.int32)], 1),
                         np.broadcast_to(pos_ - CHUNK + np.arange(CHUNK), (B, CHUNK)))
            text = step.compiled_text(sp, cache_, toks, jnp.ones((B,), jnp.int32), ids)
            coll = {f"{k[0]}:{k[1]}": v for k, v in collectives(text).items()}
            dp_coll = [c for c in collective_ops(text, mesh) if "dp" in c["axes"]]  # between dp groups
        del state, sp
        print(json.dumps({
            "dp_collectives": dp_coll,
            "collectives": coll, "profile": prof, "event": "mesh", "mesh": spec + (f"@{ep_path}" if ep_path else ""), "desc": describe(mesh), "s": round(time.perf_counter() - t0, 2),
            "max_abs_diff": max(diffs), "max_abs_ref": scale, "tokens": gen.tolist(), "argmax_flips": flips,
            "tokens_equal": bool(np.array_equal(gen, ref_gen)), "n_replicated_notes": len(notes),
            "decode_ms": [round(1e3 * t, 3) for t in ts],
        }), flush=True)


if __name__ == "__main__":
    main()
