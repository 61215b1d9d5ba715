"""Opt-in record of where the suite's CPU time goes: with ``DSV41_COMPILE_LOG=<dir>`` set, every
jit trace, lowering and backend compile (or compilation-cache hit) of this process is appended to
``<dir>/<pid>.jsonl`` as ``{"test", "event", "fun", "s", "cpu"}``, tagged with the running test
(conftest) or the worker's command line (sharding_worker), plus each test's start and end. ``cpu`` is
this process's CPU seconds so far: a compile's CPU cost is its ``cpu`` minus the previous event's (on
a loaded host its wall seconds ``s`` overstate it), a test's is its end minus its start.
``python tests/compile_log.py <dir>`` prints the totals per test and the longest programs."""

from __future__ import annotations

import json
import os
import sys
import time

_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
}
current = {"test": "import"}
_PATH: list = []  # this process's log file, once installed


def _write(row: dict) -> None:
    with open(_PATH[0], "a") as fh:
        fh.write(json.dumps({**row, "cpu": round(time.process_time(), 3)}) + "\n")


def test_bounds(name: str, event: str) -> None:
    """Record the start (``event="start"``) or end (``"end"``) of test ``name`` with this process's CPU
    seconds, so the summary gives each test's CPU time (this process's; subprocesses not counted)."""
    if _PATH:
        _write({"test": name, "event": event, "fun": "", "s": 0.0})


def install(tag: str | None = None) -> bool:
    """Register the listener if ``DSV41_COMPILE_LOG`` is set; ``tag`` names this process's work."""
    out = os.environ.get("DSV41_COMPILE_LOG")
    if not out:
        return False
    import jax.monitoring

    os.makedirs(out, exist_ok=True)
    _PATH[:] = [os.path.join(out, f"{os.getpid()}.jsonl")]
    if tag:
        current["test"] = tag

    def listener(event, duration, **kw):
        kind = _EVENTS.get(event)
        if kind:
            _write({"test": current["test"], "event": kind, "fun": str(kw.get("fun_name", "")),
                    "s": round(duration, 3)})

    jax.monitoring.register_event_duration_secs_listener(listener)
    return True


def summary(out: str, top: int = 40) -> None:
    rows = []
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as fh:
            prev = None
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    # CPU seconds since the previous event of this process (logs without "cpu": none)
                    r["cpu_s"] = r["cpu"] - prev if "cpu" in r and prev is not None else None
                    prev = r.get("cpu")
                    rows.append(r)
    per_test: dict = {}
    for r in rows:
        t = per_test.setdefault(r["test"], {"compile": 0.0, "trace": 0.0, "lower": 0.0, "n": 0, "slow": 0, "ccpu": 0.0,
                                            "cpu": 0.0})
        if r["event"] in ("start", "end"):  # the test's own CPU time: end minus start
            t["cpu"] += r["cpu"] if r["event"] == "end" else -r["cpu"]
            continue
        t[r["event"]] += r["s"]
        if r["event"] == "compile":
            t["n"] += 1
            t["slow"] += r["s"] > 2.0
            t["ccpu"] += r["cpu_s"] or 0.0
    tot = {k: sum(t[k] for t in per_test.values()) for k in ("compile", "ccpu", "trace", "lower")}
    print(f"total: compile {tot['compile']:.0f} s ({tot['ccpu']:.0f} CPU-s), trace {tot['trace']:.0f} s, "
          f"lower {tot['lower']:.0f} s")
    print("| test | test CPU-s | compile s | compile CPU-s | programs (> 2 s) | trace s | lower s |")
    for name, t in sorted(per_test.items(), key=lambda kv: -max(kv[1]["compile"], kv[1]["cpu"]))[:top]:
        print(f"| {name} | {t['cpu']:.1f} | {t['compile']:.1f} | {t['ccpu']:.1f} | {t['n']} ({t['slow']}) | "
              f"{t['trace']:.1f} | {t['lower']:.1f} |")
    print("\nlongest compiles (wall s, CPU-s):")
    for r in sorted((r for r in rows if r["event"] == "compile"), key=lambda r: -r["s"])[:top]:
        cpu = f"{r['cpu_s']:7.1f}" if r["cpu_s"] is not None else "      -"
        print(f"  {r['s']:7.1f} s {cpu}  {r['fun'][:60]:60s}  {r['test']}")


if __name__ == "__main__":
    summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
