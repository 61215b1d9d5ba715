"""Where a compiled step spends its device time: a ``jax.profiler`` trace read back and summed per
program, per model part (the ``jax.named_scope`` names in ``transformer`` / ``attention`` / ``moe``)
and per kernel.

    from dsv41_jax.profiling import trace, summarize
    path = trace(lambda: engine.generate(reqs), "/tmp/prof")
    report = summarize(path)          # {"programs": [...]} , one entry per compiled program
    print(format_report(report))

Each compiled program (``program_id``) is reported separately, with its number of executions
(``run_id`` values), so a generate call's prefill and decode programs come apart without touching
the engine. Kernel events are read from the device planes; each carries its HLO module, program
and run ids, and the HLO op it implements; the model part comes from the op's name stack
(``tf_op`` / ``long_name`` stats when the runtime records them, else the ``op_name`` metadata of an
HLO dump given by ``hlo_dump_dir``).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import statistics

# most specific first: the first scope name found in an op's name stack is its part
PARTS = ("indexer", "compressor", "sparse_attn", "wo_a", "attention", "route", "routed_experts", "shared_expert",
         "moe", "attn_mhc", "ffn_mhc", "engram", "head", "embed")


def trace(fn, outdir: str):
    """Run ``fn()`` under ``jax.profiler.trace(outdir)``; return (fn's result, xplane path)."""
    import jax

    with jax.profiler.trace(outdir):
        out = fn()
        jax.block_until_ready(out)
    files = sorted(glob.glob(os.path.join(outdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {outdir}")
    return out, files[-1]


AMBIGUOUS = "ambiguous:"  # op_name of a kernel name shared by call sites in several parts


def part_of(name_stack: str) -> str:
    if (name_stack or "").startswith(AMBIGUOUS):  # e.g. "attention+engram": the kernel name cannot tell
        return name_stack[len(AMBIGUOUS):]
    segs = set(re.split(r"[/()]", name_stack or ""))
    for p in PARTS:
        if p in segs:
            return p
    return "other"


_HLO_ANY = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)")


def _key(name: str) -> str:
    """HLO instruction names appear as ``fusion.12`` in HLO text and ``fusion_12`` in kernel names."""
    return re.sub(r"[.\-]", "_", name)


_KERNEL_NAME = re.compile(r'\\?"name\\?"\s*:\s*\\?"([\w.\-]+)\\?"|\bname\s*=\s*\\?"([\w.\-]+)\\?"')


def parse_hlo_text(text: str, table: dict | None = None) -> dict[str, tuple[str, str]]:
    """{hlo instruction: (op_name metadata, result type)} of an optimized HLO module's text. A
    Pallas-Triton custom call is also entered under its kernel's name (``name`` in its backend
    config, e.g. ``moe_gate_up_fp4``): the profiler names the kernel so. Kernels of one name compiled
    from the same IR are one kernel shared by every call site, so where calls of that name sit in
    different model parts, the name maps to ``"ambiguous:<part>+<part>"`` (:func:`part_of` returns
    ``"<part>+<part>"``) rather than to whichever call came first (session 8: the attention's FP8
    GEMVs were booked to the Engram that way)."""
    table = {} if table is None else table
    for line in text.splitlines():
        mm = _HLO_ANY.match(line)
        if not mm:
            continue
        on = re.search(r'op_name="([^"]*)"', line)
        entry = (on.group(1) if on else "", mm.group(2)[:48])
        table.setdefault(_key(mm.group(1)), entry)
        if "xla.gpu.triton" in line:
            kn = _KERNEL_NAME.search(line[line.index("backend_config"):] if "backend_config" in line else line)
            if kn:
                key = _key(kn.group(1) or kn.group(2))
                seen = table.get(key)
                if seen is None:
                    table[key] = entry
                elif part_of(seen[0]) != part_of(entry[0]):
                    parts = set(part_of(seen[0]).split("+")) | {part_of(entry[0])}
                    table[key] = (AMBIGUOUS + "+".join(sorted(parts)), seen[1])
    return table


def lookup(table: dict, hlo_op: str, kernel: str) -> tuple[str, str]:
    """(op_name, type) of a kernel event: by its HLO op; else by the kernel's own name (the kernel of
    a fusion is named after it; inside a command buffer the event's HLO op can be the buffer's),
    also without the ``__N`` suffix that tells apart kernels of one name."""
    for k in (hlo_op, kernel, re.sub(r"__\d+$", "", kernel)):
        hit = table.get(_key(k))
        if hit is not None:
            return hit
    return ("", "")


def hlo_tables(dump_dir: str | None) -> list[tuple[str, dict]]:
    """[(module name, {instruction: (op_name, type)})] for each ``*after_optimizations.txt`` of an
    XLA dump (``XLA_FLAGS=--xla_dump_to=DIR``), one per compiled program."""
    out: list[tuple[str, dict]] = []
    if not dump_dir or not os.path.isdir(dump_dir):
        return out
    for f in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        m = re.match(r"module_\d+\.(.+?)\.", os.path.basename(f))
        with open(f, errors="replace") as fh:
            out.append((m.group(1) if m else os.path.basename(f), parse_hlo_text(fh.read())))
    return out


def _stats(event) -> dict:
    d = {}
    try:
        for k, v in event.stats:
            d.setdefault(k, v)
    except Exception:  # noqa: BLE001 - stats are best effort
        pass
    return d


def _pick_table(tables, module: str, hlo_ops: set) -> dict:
    """The program's HLO table: among the tables of its module name, the one that names the most of
    the HLO ops seen in its kernels (a step compiled at two widths gives two same-named modules)."""
    best, score = {}, -1
    for name, t in tables:
        if not (name == module or name.endswith(module) or module.endswith(name)):
            continue
        sc = sum(1 for o, n in hlo_ops if lookup(t, o, n)[1])
        if sc > score:
            best, score = t, sc
    return best


def summarize(xplane_path: str, hlo_dump_dir: str | None = None, top: int = 25,
              hlo_texts: dict[str, str] | None = None) -> dict:
    """Device time per program, per model part and per kernel (ms per execution of the program).
    ``hlo_texts`` {module name: optimized HLO text} adds name stacks (e.g. from
    ``jitted.lower(...).compile().as_text()``) to those of ``hlo_dump_dir``."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    tables = hlo_tables(hlo_dump_dir) + [(m, parse_hlo_text(t)) for m, t in (hlo_texts or {}).items()]
    planes = [p for p in pd.planes if p.name.startswith("/device:")]
    cpu = not planes  # CPU backend: the XLA thunks run on host threads
    if cpu:
        planes = [p for p in pd.planes if p.name == "/host:CPU"]
    events: dict = {}
    module_runs: collections.Counter = collections.Counter()
    for plane in planes:
        for l in plane.lines:
            if l.name == "XLA Modules":
                for e in l.events:
                    st = _stats(e)
                    module_runs[(plane.name, st.get("program_id", e.name))] += 1
        if cpu:
            lines = [l for l in plane.lines if l.name.startswith("tf_XLA")]
        else:
            lines = ([l for l in plane.lines if l.name.startswith("Stream")]
                     or [l for l in plane.lines if l.name == "XLA Ops"])
        for line in lines:
            for e in line.events:
                st = _stats(e)
                if "hlo_op" not in st:
                    continue  # not a kernel/thunk (e.g. an "end:" marker)
                key = (plane.name, st.get("program_id", -1))
                events.setdefault(key, []).append((e.name, e.duration_ns, str(st["hlo_op"]),
                                                   str(st.get("hlo_module", "?")), st.get("run_id"),
                                                   str(st.get("tf_op", "") or ""), e.start_ns))
    out = []
    for (dev, pid), evs in events.items():
        mod = evs[0][3]
        table = _pick_table(tables, mod, {(e[2], e[0]) for e in evs})
        runs = module_runs.get((dev, pid)) or len({e[4] for e in evs if e[4] is not None}) or 1
        parts: collections.Counter = collections.Counter()
        part_launches: collections.Counter = collections.Counter()
        kern: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        what: dict = {}
        busy = 0
        spans: dict = {}  # run id -> (first kernel start, last kernel end)
        for name, dur, hop, _, run, tf, t0 in evs:
            if run is not None:
                a, b = spans.get(run, (t0, t0 + dur))
                spans[run] = (min(a, t0), max(b, t0 + dur))
            op_name, typ = lookup(table, hop, name)
            stack = tf if "/" in tf else op_name
            part = part_of(stack)
            parts[part] += dur
            part_launches[part] += 1
            k = f"{part}: {name[:64]}"
            kern[k] += dur
            count[k] += 1
            what.setdefault(k, f"{typ} {stack[-90:]}".strip())
            busy += dur
        out.append({
            "device": dev, "program_id": pid, "module": mod, "executions": runs, "busy_ms": busy / runs / 1e6,
            # kernels (thunks on CPU) per execution, and the median time from an execution's first kernel's
            # start to its last one's end: span - busy is the device idle inside a step (launch gaps)
            "launches": len(evs) / runs,
            "span_ms": statistics.median(b - a for a, b in spans.values()) / 1e6 if spans else None,
            "parts_ms": {k: v / runs / 1e6 for k, v in parts.most_common()},
            "parts_launches": {k: part_launches[k] / runs for k, _ in parts.most_common()},
            "kernels": [{"kernel": k, "ms": v / runs / 1e6, "launches": count[k] / runs, "hlo": what[k]}
                        for k, v in kern.most_common(top)],
        })
    out.sort(key=lambda r: -r["busy_ms"] * r["executions"])
    return {"programs": out}


def set_executions(prog: dict, n: int) -> dict:
    """Re-express a :func:`summarize` program entry per one of ``n`` executions, for traces that kept
    no execution ids (its figures are then totals over every execution)."""
    scale = prog["executions"] / n
    prog["executions"] = n
    prog["busy_ms"] *= scale
    prog["parts_ms"] = {k: v * scale for k, v in prog["parts_ms"].items()}
    prog["launches"] = prog.get("launches", 0) * scale
    prog["parts_launches"] = {k: v * scale for k, v in prog.get("parts_launches", {}).items()}
    for k in prog["kernels"]:
        k["ms"] *= scale
        k["launches"] *= scale
    return prog


def format_report(rep: dict, max_programs: int = 3, max_kernels: int = 25) -> str:
    lines = []
    for p in rep["programs"][:max_programs]:
        span = f", first kernel start to last end {p['span_ms']:.3f} ms" if p.get("span_ms") else ""
        lines.append(f"program {p['program_id']} ({p['module']}, {p['device']}): {p['executions']} executions, "
                     f"{p['busy_ms']:.3f} ms device time each, {p.get('launches', 0):.0f} kernels each{span}")
        pl_ = p.get("parts_launches", {})
        lines.append("  by part (ms, kernels): " + ", ".join(
            f"{k} {v:.3f}" + (f" ({pl_[k]:.0f})" if k in pl_ else "") for k, v in p["parts_ms"].items()))
        for k in p["kernels"][:max_kernels]:
            lines.append(f"    {k['ms']:8.3f} ms  x{k['launches']:.1f}  {k['kernel']}  [{k['hlo']}]")
    return "\n".join(lines)
