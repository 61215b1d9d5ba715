"""End-to-end benchmark with the protocol of the published V4.1-Flash results
(``shared/spec/performance.md`` §2): a prompt of 4096 random token ids (seeded, special tokens
excluded), 1024 output tokens with EOS ignored, greedy, one warm-up then 6 runs, median; the decode
rate counts from the first generated token to the last (prefill excluded).

    python -m dsv41_jax.bench                                  # v41-flash width/depth, 1 device
    python -m dsv41_jax.bench --routed-experts 64 --batch-sizes 1,8,32 --prefill-lens 4096,65536
    python -m dsv41_jax.bench --preset tiny --new-tokens 32 --runs 2    # CPU smoke run

Real width and depth. Where the model does not fit the devices, only the number of routed experts
(``--routed-experts``) and the Engram table rows (``--engram-vocab``: the per-column prime buckets,
so the hashing is the real one with smaller primes) are reduced; at batch 1 that leaves the bytes
read per decoded token unchanged (6 experts per layer, 24 Engram rows per layer), and the script
says so. Beside every result: the HBM-bandwidth floor for the same configuration and its ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import statistics
import sys
import time

import numpy as np

from .config import get_preset
from .xla_flags import apply_runtime_defaults

HBM_BW = {"H200": 4.8e12, "H100": 3.35e12, "MI350X": 8.0e12, "MI355X": 8.0e12}
# dense bf16 tensor-core peaks (vendor data sheets), the prefill rows' compute floor
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "MI350X": 2.3e15, "MI355X": 2.5e15}


def bench_config(preset: str, routed_experts: int | None, engram_vocab: int | None, *, dspark: bool = False,
                 probe_layers: bool = False):
    """The preset with only the routed experts / Engram table rows reduced; the DSpark stages are
    dropped unless ``dspark`` (``python -m dsv41_jax.spec_bench`` keeps them); ``probe_layers``: 7
    real-width layers, one of each kind, for profiling. Returns (cfg, notes)."""
    from .engram_hash import EngramLayout

    cfg = get_preset(preset)
    kw = {} if dspark else {"n_mtp_layers": 0, "compress_ratios": cfg.compress_ratios[: cfg.n_layers],
                            "dspark_block_size": 0, "dspark_target_layer_ids": ()}
    notes = []
    if routed_experts and routed_experts != cfg.n_routed_experts:
        kw["n_routed_experts"] = routed_experts
        notes.append(f"routed experts reduced {cfg.n_routed_experts} -> {routed_experts} per layer "
                     f"(top-{cfg.n_activated_experts} unchanged: batch-1 bytes per token unchanged)")
    if engram_vocab and engram_vocab != cfg.engram_vocab_size and cfg.engram_layer_ids:
        lay = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, engram_vocab,
                                 cfg.engram_compressed_vocab_size, None)
        rows = tuple(int(sum(p for ng in layer for p in ng)) for layer in lay.primes)
        kw["engram_vocab_size"] = engram_vocab
        kw["engram_num_embeddings"] = rows
        notes.append(f"Engram table rows reduced {cfg.engram_num_embeddings} -> {rows} (prime buckets from "
                     f"{engram_vocab}; 24 rows per layer per token read either way)")
    if not dspark:
        what = "MTP block" if cfg.family == "v4" else "DSpark stages"
        notes.append(f"{what} not built (no speculative decoding in this benchmark)")
    if probe_layers and cfg.family == "v41" and cfg.n_layers >= 21 and not dspark:
        # one layer of each kind at real width, for profiling only: ratio 0 (incl. an Engram layer),
        # a ratio-2 KV + index source and a ratio-2 reader, a ratio-1 source that also picks the
        # candidate blocks, a ratio-1 reader and a ratio-1 index source that uses the candidates
        kw.update(n_layers=7, compress_ratios=(0, 0, 2, 2, 1, 1, 1), kv_source_layers=(2, 4),
                  index_source_layers=(2, 4, 6), candidate_source_layer=4, engram_layer_ids=(1,),
                  engram_num_embeddings=kw.get("engram_num_embeddings", cfg.engram_num_embeddings)[:1])
        notes.append("PROBE: 7 layers (one of each kind), not the published protocol: per-layer costs only")
    return cfg.replace(name=f"{preset}-bench", **kw), notes


def memory_stat(devices, key: str, reduce=max) -> int | None:
    """``reduce`` over ``devices`` of one of their memory statistics (``bytes_limit``,
    ``peak_bytes_in_use``, ...); None where the backend reports none (CPU)."""
    try:
        vals = [(d.memory_stats() or {}).get(key) for d in devices]
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    vals = [v for v in vals if v is not None]
    return reduce(vals) if vals else None


def fit_problem(param_bytes: int, n_devices: int, limit: int | None, headroom: float = 0.9) -> str | None:
    """Why random weights of ``param_bytes`` cannot fit ``n_devices`` devices of ``limit`` bytes each
    (even split evenly, the best case of any mesh), or None. Checked before anything is allocated: a
    model that does not fit otherwise fails deep inside XLA (session 4: the probe with the full Engram
    table asked for a 484 GiB program)."""
    if limit is None:
        return None
    per_dev = param_bytes / n_devices
    if per_dev <= headroom * limit:
        return None
    return (f"the random weights need {param_bytes / 1e9:.1f} GB ({per_dev / 1e9:.1f} GB per device over {n_devices}) "
            f"but a device holds {limit / 1e9:.1f} GB: reduce --routed-experts and/or --engram-vocab (the bytes read "
            f"per decoded token at batch 1 stay the same), or spread the model with --mesh"
            + ("" if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ else
               "; JAX's allocator takes 75 % of a GPU by default: XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 gives it more")
            + f" (the weights may fill {headroom:.0%} of it, the rest is for activations and caches)")


def _stored_bytes(node, per_device: bool = False) -> int:
    """Bytes of the arrays in ``node``; ``per_device``: of one device's shard (the whole array for
    host arrays and single-device ones)."""
    import jax

    def shape(a):
        sh = getattr(a, "sharding", None)
        return sh.shard_shape(a.shape) if per_device and sh is not None else a.shape

    return int(sum(np.prod(shape(a)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(node)))


def _per_token_and_expert(cfg, params, measure) -> tuple[float, float]:
    """``measure`` (bytes, elements, ...) summed over the layers' weights every token uses (all but
    the routed experts and the Engram tables, whose rows are looked up), and of one routed expert
    of a layer. Head, final norm and embedding are left to the caller."""
    per_token, per_expert = 0, 0
    for l in range(cfg.n_layers):
        for k, v in params["layers"][str(l)].items():
            if k == "ffn":
                for kk, vv in v.items():
                    if kk == "experts":
                        per_expert = measure(vv) / cfg.n_routed_experts
                    else:
                        per_token += measure(vv)
            elif k == "engram":
                per_token += measure({kk: vv for kk, vv in v.items() if kk != "embed"})
            else:
                per_token += measure(v)
    return per_token, per_expert


def decode_bytes(cfg, params, batch: int, context: int, dp: int | None = None) -> float:
    """HBM bytes one decode step must read for ``batch`` sequences at ``context`` tokens: every
    weight except the routed experts, the Engram tables and the embedding table (one row per token),
    plus the routed experts touched (expected distinct experts under uniform routing), plus the KV /
    index-key reads (window + top-k compressed entries per layer, indexer keys scanned).

    ``dp``: the parameters are placed on a mesh with this many data-parallel groups; the result is
    then one device's bytes: its shard of every weight (replicated weights whole; the touched
    experts spread evenly over the ep/tp shards) and its dp group's share of the KV reads."""
    per_dev = dp is not None
    _bytes = functools.partial(_stored_bytes, per_device=per_dev)
    total, per_expert = _per_token_and_expert(cfg, params, _bytes)
    total += _bytes(params["head"]) + _bytes(params["norm"])
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = e * (1 - (1 - k / e) ** batch)
    total += cfg.n_layers * distinct * per_expert
    # caches: window rows (FP8 + scale per 32) and top-k compressed entries (FP4 + e4m3/16) per layer
    win = (cfg.head_dim + cfg.head_dim // 32)
    comp = cfg.head_dim // 2 + cfg.head_dim // 16
    idx = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    kv = 0.0
    for l in range(cfg.n_layers):
        kv += min(context, cfg.window_size) * win
        m = cfg.ratio(l)
        if m:
            kv += min(cfg.index_topk, context // m) * comp
            if l in cfg.index_source_layers:
                n = context // m
                if cfg.uses_candidates(l):
                    n = min(n, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                kv += n * idx
    return total + batch * kv / (dp or 1)


def _matmul_elements(node) -> int:
    """Logical weight elements of the matrices in ``node`` (quantized tensors unpacked; vectors such
    as norms and biases left out)."""
    import jax

    from .quant.tensors import Fp4Tensor, Fp8Tensor

    leaves = jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, (Fp8Tensor, Fp4Tensor)))
    return int(sum(np.prod(a.shape) for a in leaves if len(a.shape) >= 2))


def prefill_flops(cfg, params, prompt_len: int) -> float:
    """Matmul FLOPs of one exact prefill of ``prompt_len`` tokens (every token through every layer,
    as the reference): 2 x the weight elements each token multiplies (dense matrices, the shared and
    ``n_activated_experts`` routed experts; no embedding or Engram table lookups, no head: logits
    for one position), plus the sparse attention (QK and PV over the window and the top-k
    compressed entries, or all of them without an indexer) and the indexer's score dots over the
    compressed keys (the candidate blocks where the layer uses them)."""
    per_token, per_expert = _per_token_and_expert(cfg, params, _matmul_elements)
    total = 2.0 * prompt_len * (per_token + cfg.n_layers * cfg.n_activated_experts * per_expert)
    seen = np.arange(1, prompt_len + 1, dtype=np.float64)  # tokens visible to each position
    for l in range(cfg.n_layers):
        keys = np.minimum(seen, cfg.window_size)
        m = cfg.ratio(l)
        if m:
            comp = np.floor(seen / m)
            keys = keys + (np.minimum(comp, cfg.index_topk) if cfg.index_source_of(l) is not None else comp)
            if l in cfg.index_source_layers:
                scan = comp
                if cfg.uses_candidates(l):
                    scan = np.minimum(scan, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                total += 2.0 * cfg.index_n_heads * cfg.index_head_dim * scan.sum()
        total += 4.0 * cfg.n_heads * cfg.head_dim * keys.sum()
    return total


def device_bandwidth() -> tuple[str, float | None]:
    import jax

    kind = jax.devices()[0].device_kind
    for k, bw in HBM_BW.items():
        if k in kind:
            return kind, bw
    return kind, None


def random_prompt(n: int, seed: int, vocab: int, n_special_floor: int = 128000) -> list[int]:
    """``n`` token ids uniform over the ordinary vocabulary (special/added tokens, ids >= 128000 in
    the DeepSeek tokenizer, and ids 0-2 excluded), seeded."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, min(vocab, n_special_floor), size=n).tolist()


def with_hlo_dump(xla_flags: str, dump_dir: str) -> str:
    """``XLA_FLAGS`` plus an optimized-HLO dump of the engine's step programs into ``dump_dir``
    (unless a dump is already asked for): the profiler maps XLA's kernels to model parts through it.
    Without it every XLA fusion of run H (session 4) was reported as "other"."""
    if "--xla_dump_to" in xla_flags:
        return xla_flags
    extra = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*engine_step.*"
    return f"{xla_flags} {extra}".strip()


def profile_generate(eng, reqs, new_tokens: int, outdir: str, max_prompt_tokens: int | None = None) -> dict:
    """Device time of one ``generate`` of ``reqs`` with ``new_tokens`` outputs, per compiled program
    (prefill and decode come apart), model part and kernel (:mod:`dsv41_jax.profiling`). The HLO
    names map to model parts through the runtime's name stacks or, when ``XLA_FLAGS`` holds
    ``--xla_dump_to``, through the dump.

    ``max_prompt_tokens``: when the prompts hold more tokens than this in all, each is cut to its
    first ``max_prompt_tokens // len(reqs)`` tokens for the profile (the report says so under
    ``prompt_cut``). A real-width prefill step launches ~48,000 kernels, and session 37's batch-32
    trace (4,096-token prompts) kept only about 150,000 kernel events: 3 of the 32 prefill steps,
    and 251 kernels per decode execution where a step launches ~1,400 (BENCHMARKS.md, issue 8,
    session 37)."""
    import dataclasses
    import os
    import re

    from .profiling import format_report, set_executions, summarize, trace
    from .sampling import SamplingParams

    short = [dataclasses.replace(r, max_new_tokens=new_tokens) for r in reqs]
    total = sum(len(r.prompt_ids) for r in short)
    cut = None
    if max_prompt_tokens and total > max_prompt_tokens:
        keep = max(1, max_prompt_tokens // len(short))
        cut = {"prompt_tokens": total, "kept_per_prompt": keep,
               "why": f"{total} prompt tokens > {max_prompt_tokens} (--profile-prompt-tokens): the profiler's "
                      "event buffer would not hold the prefill and the decode steps"}
        short = [dataclasses.replace(r, prompt_ids=list(r.prompt_ids[:keep])) for r in short]
        print(f"note: profile: prompts cut to their first {keep} tokens ({cut['why']})", flush=True)
    t = time.perf_counter()
    _, path = trace(lambda: eng.generate(short, SamplingParams()), outdir)
    wall = time.perf_counter() - t
    m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    rep = summarize(path, m.group(1) if m else None, top=400)  # the JSON keeps every kernel; the log the top 25
    rep["wall_s"] = wall
    if cut:
        rep["prompt_cut"] = cut
    # the runtime may not record executions per program: the decode program (most launches) ran
    # new_tokens - 1 times, the prefill program ceil(prompt / chunk) times (one step per chunk, the
    # rows' chunks together); with new_tokens == 1 only the prefill program ran
    progs = [p for p in rep["programs"] if p["executions"] == 1 and "engine_step" in p["module"]]
    if len(progs) >= 2 or (progs and new_tokens == 1):
        if new_tokens > 1:
            dec = set_executions(max(progs, key=lambda p: p["launches"]), new_tokens - 1)
            dec["note"] = "decode program: per-step figures from the step count (the trace kept no execution ids)"
            progs = [p for p in progs if p is not dec]
        chunks = max(-(-len(r.prompt_ids) // eng.chunk) for r in short)
        for p in progs:
            set_executions(p, chunks)["note"] = ("prefill program: per-step figures from ceil(prompt / chunk) "
                                                 "steps (the trace kept no execution ids)")
    print(format_report(rep), flush=True)
    return rep


def run(args) -> dict:
    import jax

    from .compile_cache import enable_compilation_cache
    from .engine import Engine, Request
    from .model import Model
    from .options import run_options_from_args
    from .params import init_params, param_specs
    from .sampling import SamplingParams

    enable_compilation_cache()
    cfg, notes = bench_config(args.preset, args.routed_experts, args.engram_vocab, probe_layers=args.probe_layers)
    for n in notes:
        print(f"note: {n}", flush=True)
    kind, bw = device_bandwidth()
    bw = args.hbm_bw or bw
    peak = next((v for k, v in PEAK_BF16.items() if k in kind), None)
    from sharding.engine_support import mesh_from_args

    mesh, dp = mesh_from_args(args), None  # multi-host start-up + the --mesh mesh (None without)
    if mesh is not None:
        from sharding.mesh import describe, mesh_sizes

        dp = mesh_sizes(mesh)["dp"]
        notes.append(f"mesh {describe(mesh)}: floors use one device's bytes (its weight shards, its dp share of KV)")
        if any(B % dp for B in args.batch_sizes):
            raise ValueError(f"--batch-sizes {args.batch_sizes}: every batch size must be a multiple of dp={dp} "
                             f"(--mesh {args.mesh})")
    devs = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    n_dev = len(devs)
    problem = fit_problem(_stored_bytes(param_specs(cfg)), n_dev, memory_stat(devs, "bytes_limit", min))
    if problem:
        raise ValueError(problem)
    t = time.perf_counter()
    params = init_params(cfg, seed=args.seed, mesh=mesh)
    jax.block_until_ready(params)
    print(f"random weights in the real formats: {time.perf_counter() - t:.1f} s on {n_dev} x {kind}", flush=True)
    model = Model(cfg, params)
    opts = run_options_from_args(args)
    out = {"device": kind if n_dev == 1 else f"{n_dev} x {kind} ({args.mesh})", "jax": jax.__version__,
           "config": cfg.name, "notes": notes, "decode": [], "prefill": []}

    def mem():
        """Peak bytes in use on the busiest device (None on CPU)."""
        return memory_stat(devs, "peak_bytes_in_use", max)

    for B, packing in [(b, p) for b in args.batch_sizes for p in args.expert_packings or [None]]:
        eng = Engine(model, batch_size=B, max_seq_len=args.prompt_len + args.new_tokens + 1, opts=opts,
                     prefill_chunk=args.prefill_chunk, stop_ids=(), mesh=mesh, prefill_tokens=args.prefill_tokens,
                     expert_packing=packing)
        if args.expert_packings:
            print(f"batch {B}: routed experts packed as {eng.expert_packing}", flush=True)
        if eng.chunk < min(args.prefill_chunk, args.prompt_len):
            out["notes"].append(f"batch {B}: prompts prefilled {eng.chunk} tokens per row per step "
                                f"(--prefill-tokens {args.prefill_tokens} per step over the batch)")
            print(f"note: {out['notes'][-1]}", flush=True)
        reqs = [Request(random_prompt(args.prompt_len, args.seed + i, cfg.vocab_size), max_new_tokens=args.new_tokens,
                        sample_id=i) for i in range(B)]
        ctx = args.prompt_len + args.new_tokens // 2
        step_bytes = decode_bytes(cfg, params, B, ctx, dp=dp)
        floor = B * bw / step_bytes if bw else None
        warm_reqs = reqs if not args.warmup_tokens else [dataclasses.replace(q, max_new_tokens=args.warmup_tokens)
                                                          for q in reqs]
        rates, prefill_s, host, digests = [], [], [], []
        for r in range(args.warmup + args.runs):
            st0 = dataclasses.replace(eng.stats)
            res = eng.generate(warm_reqs if r < args.warmup else reqs, SamplingParams())
            st = eng.stats
            if r >= args.warmup and st.timed_decode_steps > st0.timed_decode_steps:  # host side per decode step
                n = st.timed_decode_steps - st0.timed_decode_steps
                host.append(((st.dispatch_s - st0.dispatch_s) / n, (st.wait_s - st0.wait_s) / n))
            # decode rate: tokens after the first, over the time from the first token to the last
            t_first = max(x.timings["queue_s"] + x.timings["prefill_s"] for x in res)
            t_last = max(x.timings["total_s"] for x in res)
            n = sum(len(x.output_ids) - 1 for x in res)
            rate = n / max(t_last - t_first, 1e-9)
            if r >= args.warmup:
                rates.append(rate)
                prefill_s.append(t_first)
                digests.append(output_digest(res))
            print(f"  batch {B} run {r}{' (warm-up)' if r < args.warmup else ''}: {rate:.2f} tok/s, prefill "
                  f"{t_first:.3f} s (compile so far {eng.stats.compile_s:.1f} s)"
                  f"{', output ' + digests[-1][:16] if r >= args.warmup else ''}", flush=True)
            if rates and args.json:  # a call stopped by a time limit keeps the runs it finished
                save_json(args.json, out, partial={**decode_row(B, rates, floor, step_bytes, eng.stats.compile_s),
                                                   "output_sha256": sorted(set(digests)), "partial": True})
        prof = None
        if args.profile_tokens:
            prof = profile_generate(eng, reqs, args.profile_tokens, args.profile_dir or f"/tmp/dsv41_prof_b{B}",
                                    max_prompt_tokens=args.profile_prompt_tokens)
        if len(set(digests)) > 1:
            out["notes"].append(f"batch {B}: the timed runs generated different tokens ({len(set(digests))} "
                                f"distinct outputs over {len(digests)} greedy runs)")
            print(f"note: {out['notes'][-1]}", flush=True)
        row = {**decode_row(B, rates, floor, step_bytes, eng.stats.compile_s), "peak_bytes": mem(), "profile": prof,
               # greedy output of the timed runs (sha256 of every request's token ids): the same digest
               # across runs, flags and kernel variants means the same tokens were generated
               "output_sha256": sorted(set(digests)),
               # the prompts' prefill in the same runs (B x prompt_len tokens, until every row's first token)
               "prefill_tok_s": B * args.prompt_len / statistics.median(prefill_s),
               # host side per engine step (median over the timed runs): dispatch (input copies + the
               # jit call) and time blocked on the previous step's tokens (device still busy)
               "host_dispatch_ms": 1e3 * statistics.median(h[0] for h in host) if host else None,
               "host_wait_ms": 1e3 * statistics.median(h[1] for h in host) if host else None,
               "expert_packing": eng.expert_packing}
        out["decode"].append(row)

    for L in args.prefill_lens:
        eng = Engine(model, batch_size=dp or 1, max_seq_len=L + 2, opts=opts, prefill_chunk=args.prefill_chunk,
                     stop_ids=(), mesh=mesh)
        times = []
        req = Request(random_prompt(L, args.seed, cfg.vocab_size), max_new_tokens=1)
        for r in range(args.warmup + max(1, args.runs // 3)):
            res = eng.generate([req], SamplingParams())
            if r >= args.warmup:
                times.append(res[0].timings["prefill_s"])
        med = statistics.median(times)
        flops = prefill_flops(cfg, params, L)
        floor = peak * L / flops if peak else None
        prof = (profile_generate(eng, [req], 1, args.profile_dir or f"/tmp/dsv41_prof_p{L}")
                if args.profile_prefill else None)
        out["prefill"].append({"prompt_len": L, "median_s": med, "runs_s": times, "tok_s": L / med, "peak_bytes": mem(),
                               "flops": flops, "floor_tok_s": floor, "ratio_to_floor": L / med / floor if floor else None,
                               "profile": prof})
    return out


def output_digest(results) -> str:
    """sha256 over the generated token ids of ``results`` (``Engine.generate``'s, in request order; each
    list framed by its length), to compare greedy outputs across runs, flags and kernel variants."""
    h = hashlib.sha256()
    for x in results:
        ids = [int(t) for t in x.output_ids]
        h.update(len(ids).to_bytes(4, "little"))
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in ids))
    return h.hexdigest()


def decode_row(batch: int, rates: list, floor: float | None, step_bytes: float, compile_s: float) -> dict:
    """A decode row's timed runs and what follows from them: median and ratio to the floor."""
    med = statistics.median(rates)
    return {"batch": batch, "median_tok_s": med, "runs": list(rates), "bytes_per_step": step_bytes,
            "floor_tok_s": floor, "ratio_to_floor": med / floor if floor else None, "compile_s": compile_s}


def save_json(path: str, out: dict, partial: dict | None = None) -> None:
    """Write ``out`` to ``path``; with ``partial`` (the decode row of a batch still running, its runs
    so far) appended and ``complete`` false, so that a run cut short leaves its finished runs."""
    doc = {**out, "decode": out["decode"] + ([partial] if partial else []), "complete": partial is None}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def merge(docs: list[dict], names: list[str]) -> dict:
    """One result from several ``--json`` files of the same benchmark (same device, jax, config and
    notes), e.g. the protocol's runs split over two device calls: per batch size every timed run of
    every file, the median and the ratio to the floor recomputed; a partial row (a call cut short)
    contributes the runs it finished. The other fields come from the first file that has the row."""
    if len(docs) < 2:
        raise ValueError("--merge needs at least two result files")
    for name, d in zip(names, docs):
        missing = [k for k in ("device", "jax", "config", "notes", "decode", "prefill") if k not in d]
        if missing:
            raise ValueError(f"--merge: {name} is not a python -m dsv41_jax.bench --json result (no {', '.join(missing)})")
    first = docs[0]
    for name, d in zip(names[1:], docs[1:]):
        for key in ("device", "jax", "config", "notes"):
            if d.get(key) != first.get(key):
                raise ValueError(f"--merge: {name} has {key} {d.get(key)!r}, {names[0]} has {first.get(key)!r}; "
                                 "only runs of the same benchmark can be merged")
    rows: dict[int, dict] = {}
    for name, d in zip(names, docs):
        for r in d["decode"]:
            if r["batch"] not in rows:
                rows[r["batch"]] = {**r, "runs": list(r["runs"]), "merged_from": [name]}
            else:
                rows[r["batch"]]["runs"] += r["runs"]
                rows[r["batch"]]["merged_from"].append(name)
                outs = set(rows[r["batch"]].get("output_sha256") or []) | set(r.get("output_sha256") or [])
                rows[r["batch"]]["output_sha256"] = sorted(outs)
    for r in rows.values():
        r["median_tok_s"] = statistics.median(r["runs"])
        r["ratio_to_floor"] = r["median_tok_s"] / r["floor_tok_s"] if r.get("floor_tok_s") else None
        r.pop("partial", None)
    prefill = next((d["prefill"] for d in docs if d["prefill"]), [])
    return {**first, "decode": [rows[b] for b in sorted(rows)], "prefill": prefill, "complete": True,
            "notes": first["notes"] + [f"merged from {', '.join(names)}"]}


def merge_files(paths: list[str]) -> dict:
    """:func:`merge` of the ``--json`` results at ``paths``."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    return merge(docs, paths)


def table(out: dict) -> str:
    lines = [f"device {out['device']}, jax {out['jax']}, config {out['config']}"]
    lines += [f"note: {n}" for n in out["notes"]]
    if out["decode"]:
        lines.append("| batch | decode tok/s (median) | floor tok/s | ratio | GB/step | peak GB | compile s | prompt prefill "
                     "tok/s | host dispatch / wait ms per decode step |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["decode"]:
        fl = f"{r['floor_tok_s']:.0f}" if r["floor_tok_s"] else "n/a"
        ra = f"{r['ratio_to_floor']:.3f}" if r["ratio_to_floor"] else "n/a"
        pk = f"{r['peak_bytes'] / 1e9:.1f}" if r["peak_bytes"] else "n/a"
        hw = (f"{r['host_dispatch_ms']:.2f} / {r['host_wait_ms']:.2f}" if r.get("host_dispatch_ms") is not None
              else "n/a")
        lines.append(f"| {r['batch']} | {r['median_tok_s']:.2f} | {fl} | {ra} | {r['bytes_per_step'] / 1e9:.2f} | {pk} "
                     f"| {r['compile_s']:.1f} | {r['prefill_tok_s']:.0f} | {hw} |")
    if out["prefill"]:
        lines.append("| prompt | prefill s (median) | prefill tok/s | TFLOP per prompt | bf16 floor tok/s | ratio | peak GB |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|")
        for r in out["prefill"]:
            pk = f"{r['peak_bytes'] / 1e9:.1f}" if r["peak_bytes"] else "n/a"
            fl = f"{r['floor_tok_s']:.0f}" if r.get("floor_tok_s") else "n/a"
            ra = f"{r['ratio_to_floor']:.3f}" if r.get("ratio_to_floor") else "n/a"
            lines.append(f"| {r['prompt_len']} | {r['median_s']:.3f} | {r['tok_s']:.1f} | {r['flops'] / 1e12:.1f} | {fl} "
                         f"| {ra} | {pk} |")
    return "\n".join(lines)


def _packings(text: str) -> list[str]:
    from .engine import EXPERT_PACKINGS

    vals = [t.strip() for t in text.split(",") if t.strip()]
    if not vals or any(v not in EXPERT_PACKINGS for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(EXPERT_PACKINGS)}")
    return vals


def _ints_or_off(s: str) -> list[int]:
    """``0`` (or ``none``): no prefill rows; otherwise :func:`positive_ints`."""
    return [] if s.strip().lower() in ("0", "none", "") else positive_ints(s)


def _int_at_least(s: str, least: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {v}")
    return v


def _positive_int(s: str) -> int:
    return _int_at_least(s, 1)


def _nonnegative_int(s: str) -> int:
    return _int_at_least(s, 0)


def positive_ints(s: str) -> list[int]:
    """An argparse type: "96,65536" -> [96, 65536]; an empty list, a non-integer or a value below 1 is
    a usage error naming the text (also ``pallas_kernels.sparse_attention.benchmark --contexts``)."""
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if any(x < 1 for x in v):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {s!r}")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v41-flash", choices=["v41-flash", "v4-flash", "v4-pro", "tiny", "tiny-v4"])
    ap.add_argument("--routed-experts", type=int, default=None, help="reduce routed experts per layer to fit")
    ap.add_argument("--engram-vocab", type=int, default=None, help="Engram prime-bucket start (reduces table rows)")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--batch-sizes", type=_ints_or_off, default=[1, 8, 32],
                    help="decode rows (0: none, e.g. for the prefill rows alone)")
    ap.add_argument("--expert-packings", type=_packings, default=None,
                    help="run every decode batch size once per routed-expert MXFP4 packing, in this order, e.g. "
                    "nibbles,f16pairs (an A/B in one process; default: the engine's choice, DSV41_EXPERT_PACKING "
                    "or auto). f16pairs repacks the model's experts in place: put nibbles first")
    ap.add_argument("--prefill-lens", type=_ints_or_off, default=[4096, 65536],
                    help="prompt lengths of the prefill rows (0: none; the decode rows report their prompts' prefill too)")
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=_positive_int, default=4096,
                    help="most tokens one prefill step runs over the whole batch: the chunk per row shrinks "
                         "with the batch size, bounding the prefill program's activation memory")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--warmup-tokens", type=_positive_int, default=None,
                    help="new tokens per row of the warm-up runs (default --new-tokens): a short warm-up still "
                         "compiles or loads every program, e.g. in the second call of a split protocol (--merge)")
    ap.add_argument("--seed", type=int, default=42)
    from .options import add_numerics_args

    add_numerics_args(ap)
    ap.add_argument("--hbm-bw", type=float, default=None, help="bytes/s for the floor (default: by device kind)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile-tokens", type=int, default=0,
                    help="after each batch size, profile one generate with this many new tokens (0: off) and print "
                         "device time per program, model part and kernel")
    ap.add_argument("--probe-layers", action="store_true",
                    help="diagnostics: 7 real-width layers, one of each kind (not the protocol; compiles in a fraction "
                         "of the time)")
    ap.add_argument("--profile-prompt-tokens", type=_nonnegative_int, default=4096,
                    help="with --profile-tokens: cut the profiled generate's prompts to this many tokens in all "
                         "(0: never), so that the profiler's event buffer holds the decode steps (a real-width "
                         "prefill step is ~48,000 kernels; default: one prefill step at the default "
                         "--prefill-tokens)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="after each prefill row, profile one more prefill of its prompt and print device time per "
                         "program, model part and kernel")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine the decode runs of several --json results of the same benchmark (e.g. the "
                         "protocol's runs split over two device calls), print the table, and exit; --json writes it")
    ap.add_argument("--profile-dir", default=None,
                    help="where the profiler traces go (default /tmp/dsv41_prof_b<B>, /tmp/dsv41_prof_p<prompt> for prefill)")
    from sharding.engine_support import add_mesh_argument

    add_mesh_argument(ap)  # --mesh: random parameters are built on their shardings, never whole on one device
    args = ap.parse_args(argv)
    if not args.merge:
        apply_runtime_defaults()
        if args.profile_tokens or args.profile_prefill:  # read when the backend starts (not if a caller started it)
            os.environ["XLA_FLAGS"] = with_hlo_dump(os.environ.get("XLA_FLAGS", ""),
                                                    os.path.join(args.profile_dir or "/tmp/dsv41_prof", "hlo"))
    try:
        out = merge_files(args.merge) if args.merge else run(args)
    except (OSError, ValueError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(out))
    if args.json:
        save_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
