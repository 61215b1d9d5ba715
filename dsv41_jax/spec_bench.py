"""``python -m dsv41_jax.spec_bench``: batch-1 decode tok/s with and without DSpark speculation.

    python -m dsv41_jax.spec_bench --checkpoint tests/fixtures/v41_tiny_a --dtype float32 \\
        --kv-cache-dtype float32 --prompt-len 64 --new-tokens 64

Rows: the plain engine (no DSpark), then :class:`dsv41_jax.speculative.SpeculativeGenerator` with
verify-all (greedy; checked token-identical to the engine), the simulated-acceptance protocol of the
published numbers (``--simulate 5.5``: 4 or 5 drafts forced accepted per step, not lossless), T=1
sampling, and the confidence scheduler (after measuring each verify width). Prompt: BOS + random ids
(``--seed``). Best of ``--runs`` timed runs after one warm-up run each.
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.spec_bench")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="reference")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--simulate", type=float, default=5.5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default="engine,all,simulate,sampled,confidence")
    a = ap.parse_args(argv)

    from .engine import Engine, Request
    from .model import Model
    from .options import RunOptions
    from .sampling import SamplingParams
    from .speculative import SpeculativeGenerator

    model = Model.from_checkpoint(a.checkpoint) if a.checkpoint else Model.from_preset(a.preset, seed=a.seed)
    cfg = model.cfg
    opts = RunOptions(dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype)
    rng = np.random.default_rng(a.seed)
    prompt = [0] + [int(t) for t in rng.integers(3, cfg.vocab_size, a.prompt_len - 1)]
    cap = a.prompt_len + a.new_tokens + cfg.dspark_block_size + 1
    cap += -cap % 16
    rows = a.rows.split(",")
    base = None
    if "engine" in rows:
        eng = Engine(model, batch_size=1, max_seq_len=cap, opts=opts, prefill_chunk=a.prompt_len)
        eng.generate([Request(prompt, a.new_tokens)])
        best = 0.0
        for _ in range(a.runs):
            eng.stats = type(eng.stats)()
            base = eng.generate([Request(prompt, a.new_tokens)])[0].output_ids
            best = max(best, eng.stats.decode_tokens / eng.stats.decode_s)
        print(f"engine, no DSpark: decode {best:.1f} tok/s", flush=True)

    def run(name, sampling=None, **kw):
        g = SpeculativeGenerator(model, batch_size=1, max_seq_len=cap, opts=opts, prefill_chunk=a.prompt_len, **kw)
        if kw.get("policy") == "confidence":
            cost = g.calibrate(sampling)
            print("  verify step s by width: " + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in cost.items()))
        g.generate([prompt], a.new_tokens, sampling)
        best, line, out = 0.0, "", None
        for _ in range(a.runs):
            g.stats = type(g.stats)()
            out = g.generate([prompt], a.new_tokens, sampling)
            t = g.stats.committed / g.stats.decode_s
            if t > best:
                best, line = t, g.stats.summary()
        same = "" if base is None or sampling is not None or "simulate_accept" in kw else \
            f"; identical to engine: {out[0] == base}"
        print(f"{name}: best {best:.1f} tok/s | {line}{same}", flush=True)

    if "all" in rows:
        run("dspark verify-all, greedy", policy="all")
    if "simulate" in rows:
        run(f"dspark verify-all, simulated acceptance {a.simulate}", policy="all", simulate_accept=a.simulate)
    if "sampled" in rows:
        run("dspark verify-all, T=1", SamplingParams(temperature=1.0, seed=a.seed), policy="all")
    if "confidence" in rows:
        run("dspark confidence scheduler, greedy", policy="confidence")


if __name__ == "__main__":
    main()
