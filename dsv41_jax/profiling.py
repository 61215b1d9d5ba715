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


def part_of(name_stack: str) -> str:
    segs = set(re.split(r"[/()]", name_stack or ""))
    for p in PARTS:
        if p in segs:
            return p
    return "other"


_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name=\"([^\"]*)\"")


def parse_hlo_text(text: str, table: dict | None = None) -> dict[str, str]:
    """{hlo instruction: op_name metadata} of an optimized HLO module's text."""
    table = {} if table is None else table
    for line in text.splitlines():
        mm = _HLO_LINE.match(line)
        if mm:
            table.setdefault(mm.group(1), mm.group(2))
    return table


def hlo_op_names(dump_dir: str | None) -> dict[str, dict[str, str]]:
    """{module name: {hlo instruction: op_name}} from the ``*after_optimizations.txt`` files of an
    XLA dump (``XLA_FLAGS=--xla_dump_to=DIR``). Programs of one name (a step compiled for two
    widths) share a table: an instruction name found in both keeps the first one's op."""
    out: dict[str, dict[str, str]] = {}
    if not dump_dir or not os.path.isdir(dump_dir):
        return out
    for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        m = re.match(r"module_\d+\.(.+?)\.", os.path.basename(f))
        mod = m.group(1) if m else os.path.basename(f)
        with open(f, errors="replace") as fh:
            parse_hlo_text(fh.read(), out.setdefault(mod, {}))
    return out


def _stats(event) -> dict:
    d = {}
    try:
        for k, v in event.stats:
            d.setdefault(k, v)
    except Exception:  # noqa: BLE001 - stats are best effort
        pass
    return d


def summarize(xplane_path: str, hlo_dump_dir: str | None = None, top: int = 25,
              hlo_texts: dict[str, str] | None = None) -> dict:
    """Device time per program, per model part and per kernel (ms per execution of the program).
    ``hlo_texts`` {module name: optimized HLO text} adds name stacks (e.g. from
    ``jitted.lower(...).compile().as_text()``) to those of ``hlo_dump_dir``."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    ops = hlo_op_names(hlo_dump_dir)
    for mod, text in (hlo_texts or {}).items():
        parse_hlo_text(text, ops.setdefault(mod, {}))
    progs: dict = {}
    planes = [p for p in pd.planes if p.name.startswith("/device:")]
    cpu = not planes  # CPU backend: the XLA thunks run on host threads
    if cpu:
        planes = [p for p in pd.planes if p.name == "/host:CPU"]
    for plane in planes:
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
                pid = st.get("program_id", -1)
                mod = str(st.get("hlo_module", "?"))
                p = progs.setdefault((plane.name, pid), {"device": plane.name, "program_id": pid, "module": mod,
                                                         "runs": set(), "parts": collections.Counter(),
                                                         "kernels": collections.Counter(), "count": collections.Counter(),
                                                         "busy_ns": 0})
                if "run_id" in st:
                    p["runs"].add(st["run_id"])
                hop = str(st.get("hlo_op", ""))
                stack = str(st.get("tf_op", "") or st.get("long_name", "") or "")
                if "/" not in stack:
                    stack = ops.get(mod, {}).get(hop, "") or next(
                        (t.get(hop, "") for m, t in ops.items() if mod.endswith(m) or m.endswith(mod)), "")
                part = part_of(stack)
                p["parts"][part] += e.duration_ns
                key = f"{part}: {e.name[:80]}"
                p["kernels"][key] += e.duration_ns
                p["count"][key] += 1
                p["busy_ns"] += e.duration_ns
    out = []
    for p in progs.values():
        n = max(len(p["runs"]), 1)
        out.append({
            "device": p["device"], "program_id": p["program_id"], "module": p["module"], "executions": n,
            "busy_ms": p["busy_ns"] / n / 1e6,
            "parts_ms": {k: v / n / 1e6 for k, v in p["parts"].most_common()},
            "kernels": [{"kernel": k, "ms": v / n / 1e6, "launches": p["count"][k] / n}
                        for k, v in p["kernels"].most_common(top)],
        })
    out.sort(key=lambda r: -r["busy_ms"] * r["executions"])
    return {"programs": out}


def format_report(rep: dict, max_programs: int = 3) -> str:
    lines = []
    for p in rep["programs"][:max_programs]:
        lines.append(f"program {p['program_id']} ({p['module']}, {p['device']}): {p['executions']} executions, "
                     f"{p['busy_ms']:.3f} ms device time each")
        lines.append("  by part: " + ", ".join(f"{k} {v:.3f}" for k, v in p["parts_ms"].items()))
        for k in p["kernels"]:
            lines.append(f"    {k['ms']:8.3f} ms  x{k['launches']:.0f}  {k['kernel']}")
    return "\n".join(lines)
