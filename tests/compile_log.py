"""Opt-in record of where the suite's CPU time goes: with ``DSV41_COMPILE_LOG=<dir>`` set, every
jit trace, lowering and backend compile (or compilation-cache hit) of this process is appended to
``<dir>/<pid>.jsonl`` as ``{"test", "event", "fun", "s"}``, tagged with the running test (conftest)
or the worker's command line (sharding_worker). ``python tests/compile_log.py <dir>`` prints the
totals per test and the longest programs."""

from __future__ import annotations

import json
import os
import sys

_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
}
current = {"test": "import"}


def install(tag: str | None = None) -> bool:
    """Register the listener if ``DSV41_COMPILE_LOG`` is set; ``tag`` names this process's work."""
    out = os.environ.get("DSV41_COMPILE_LOG")
    if not out:
        return False
    import jax.monitoring

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{os.getpid()}.jsonl")
    if tag:
        current["test"] = tag

    def listener(event, duration, **kw):
        kind = _EVENTS.get(event)
        if kind:
            with open(path, "a") as fh:
                fh.write(json.dumps({"test": current["test"], "event": kind, "fun": str(kw.get("fun_name", "")),
                                     "s": round(duration, 3)}) + "\n")

    jax.monitoring.register_event_duration_secs_listener(listener)
    return True


def summary(out: str, top: int = 40) -> None:
    rows = []
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    per_test: dict = {}
    for r in rows:
        t = per_test.setdefault(r["test"], {"compile": 0.0, "trace": 0.0, "lower": 0.0, "n": 0, "slow": 0})
        t[r["event"]] += r["s"]
        if r["event"] == "compile":
            t["n"] += 1
            t["slow"] += r["s"] > 2.0
    tot = {k: sum(t[k] for t in per_test.values()) for k in ("compile", "trace", "lower")}
    print(f"total: compile {tot['compile']:.0f} s, trace {tot['trace']:.0f} s, lower {tot['lower']:.0f} s")
    print("| test | compile s | programs (> 2 s) | trace s | lower s |")
    for name, t in sorted(per_test.items(), key=lambda kv: -kv[1]["compile"])[:top]:
        print(f"| {name} | {t['compile']:.1f} | {t['n']} ({t['slow']}) | {t['trace']:.1f} | {t['lower']:.1f} |")
    print("\nlongest compiles:")
    for r in sorted((r for r in rows if r["event"] == "compile"), key=lambda r: -r["s"])[:top]:
        print(f"  {r['s']:7.1f} s  {r['fun'][:60]:60s}  {r['test']}")


if __name__ == "__main__":
    summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
