"""Side-by-side decode (or prefill) profiles of several ``bench --json`` files (A/B runs of one configuration).

    python -m dsv41_jax.bench ... --profile-tokens 16 --json a.json      # and b.json, c.json with a switch changed
    python -m dsv41_jax.profile_compare a.json b.json c.json [--labels base,flag,other] [--batch 1]
    python -m dsv41_jax.profile_compare a.json b.json --prefill [4096]   # runs made with --profile-prefill

For each file it takes the decode row of the given batch and, of its profile, the decode step's
program: the program that ran most often (a generate of N new tokens runs it N - 1 times; the
prefill program runs once per prompt chunk), the busiest one on a tie. It prints one markdown
table: device ms per step, kernels per step and tok/s, then each model part (``jax.named_scope``
names, :mod:`dsv41_jax.profiling`) in ms and kernels, with every later file's difference from the
first. The tok/s of a short profiling run is mostly the host's dispatch (BENCHMARKS.md, session
18): compare device time.
"""

from __future__ import annotations

import argparse
import json
import sys


def decode_program(profile: dict) -> dict:
    """The decode step's program of a ``profiling.summarize`` report (see the module docstring)."""
    progs = profile.get("programs") or []
    if not progs:
        raise ValueError("the profile has no programs (was the run made with --profile-tokens?)")
    return max(progs, key=lambda p: (p.get("executions", 0), p.get("busy_ms", 0.0)))


def _profiled_row(report: dict, section: str, key: str, value, path: str, want: str, have: str, pick: str,
                  name, profile_flag: str) -> dict:
    """The one row of ``report[section]`` whose ``key`` is ``value`` (the only row when None), which
    must carry a profile; the errors name the file, what was found and the flag that fixes it."""
    rows = report.get(section) or []
    if value is not None:
        rows = [r for r in rows if r.get(key) == value]
    if len(rows) != 1:
        found = [r.get(key) for r in report.get(section) or []]
        raise ValueError(f"{path}: expected one {section} row{want if value is not None else ''}, "
                         f"found {have} {found} (pick one with {pick})")
    if not rows[0].get("profile"):
        raise ValueError(f"{path}: the {name(rows[0].get(key))} row has no profile (run bench with {profile_flag})")
    return rows[0]


def decode_row(report: dict, batch: int | None, path: str = "") -> dict:
    """The decode row of ``batch`` (the only one when None) from a ``bench --json`` report."""
    return _profiled_row(report, "decode", "batch", batch, path, f" for batch {batch}", "batches", "--batch",
                         lambda b: f"batch {b}", "--profile-tokens")


def prefill_program(profile: dict) -> dict:
    """The prefill's step program of a ``bench --profile-prefill`` report, scaled to the whole prefill:
    the program with the most device time over its executions (one per prompt chunk), its per-step
    figures times its executions."""
    progs = profile.get("programs") or []
    if not progs:
        raise ValueError("the profile has no programs (was the run made with --profile-prefill?)")
    p = max(progs, key=lambda p: p.get("busy_ms", 0.0) * max(p.get("executions", 1), 1))
    n = max(p.get("executions", 1), 1)
    return {**p, "busy_ms": p.get("busy_ms", 0.0) * n, "launches": p.get("launches", 0) * n,
            "parts_ms": {k: v * n for k, v in p.get("parts_ms", {}).items()},
            "parts_launches": {k: v * n for k, v in p.get("parts_launches", {}).items()}}


def prefill_row(report: dict, prompt_len: int | None, path: str = "") -> dict:
    """The prefill row of ``prompt_len`` (the only one when None) from a ``bench --json`` report."""
    return _profiled_row(report, "prefill", "prompt_len", prompt_len, path, f" for a {prompt_len}-token prompt",
                         "prompt lengths", "--prefill LEN", lambda n: f"{n}-token prefill", "--profile-prefill")


def compare(reports: list[dict], labels: list[str], batch: int | None = None, paths=None,
            prefill: int | None = None) -> str:
    """The markdown table of :func:`decode_program` of each report's decode row, the first as the base;
    with ``prefill`` (a prompt length, or 0 for the only prefill row) :func:`prefill_program` of the
    prefill rows instead, per whole prefill."""
    paths = paths or [""] * len(reports)
    if prefill is not None:
        rows = [prefill_row(r, prefill or None, p) for r, p in zip(reports, paths)]
        progs = [prefill_program(r["profile"]) for r in rows]
        unit, rate, rate_key = "prefill", "prefill tok/s", "tok_s"
    else:
        rows = [decode_row(r, batch, p) for r, p in zip(reports, paths)]
        progs = [decode_program(r["profile"]) for r in rows]
        unit, rate, rate_key = "step", "tok/s (short run)", "median_tok_s"
    parts = sorted({k for p in progs for k in p.get("parts_ms", {})}, key=lambda k: -progs[0].get("parts_ms", {}).get(k, 0.0))

    def cell(v, v0, fmt, i):
        if v is None:
            return "—"
        s = format(v, fmt)
        return s if i == 0 or v0 is None else f"{s} ({v - v0:+{fmt}})"

    head = "| | " + " | ".join(labels) + " |"
    sep = "|---|" + "---:|" * len(labels)
    out = [head, sep]
    lines = [(f"device ms / {unit}", [p.get("busy_ms") for p in progs], ".3f"),
             (f"kernels / {unit}", [p.get("launches") for p in progs], ".0f"),
             (rate, [r.get(rate_key) for r in rows], ".1f")]
    for part in parts:
        lines.append((f"{part} ms", [p.get("parts_ms", {}).get(part) for p in progs], ".3f"))
        lines.append((f"{part} kernels", [p.get("parts_launches", {}).get(part) for p in progs], ".0f"))
    for name, vals, fmt in lines:
        out.append(f"| {name} | " + " | ".join(cell(v, vals[0], fmt, i) for i, v in enumerate(vals)) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench --json files, the first is the base")
    ap.add_argument("--labels", default=None, help="comma-separated column names (default: the file names)")
    ap.add_argument("--batch", type=int, default=None, help="the decode batch to compare (needed if a file has several)")
    ap.add_argument("--prefill", type=int, nargs="?", const=0, default=None, metavar="LEN",
                    help="compare the prefill rows' profiles (bench --profile-prefill) instead, per whole prefill: "
                         "the row of this prompt length, or the only one")
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else list(a.files)
    if len(labels) != len(a.files):
        ap.error(f"--labels has {len(labels)} names for {len(a.files)} files")
    reports = []
    for f in a.files:
        try:
            with open(f) as fh:
                reports.append(json.load(fh))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{f}: {e}")
    try:
        print(compare(reports, labels, a.batch, a.files, prefill=a.prefill))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
