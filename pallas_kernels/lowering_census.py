"""What each kernel lowers to, counted, so that two JAX versions' lowerings can be compared.

    PYTHONPATH=. python -m pallas_kernels.lowering_census OUT.json            # this JAX's census
    python -m pallas_kernels.lowering_census --compare A.json B.json          # the differences

For each of the standard cases of :mod:`pallas_kernels.inspect_sass` (every op at decode size, and
the MoE, GEMM, sparse attention, route and window-write cases at a multi-row size), the Triton IR
of every kernel is lowered on this CPU host for ``cuda`` and reduced to counts: the operations
(``tt.load``, ``arith.select``, ...), the attributes, how many loads and stores carry a mask, and
the warps and stages. Two versions that lower a kernel differently show up as differing counts.

Why: jax 0.11.2 (the GPU machines') and jax 0.12 (CI) lowered ``moe_route``'s edge blocks
differently -- 0.12 masked the stores of a block wider than its array, 0.11.2 did not -- and the
difference only showed as a race on the H200 (BENCHMARKS.md, issue 8, session 24). Run this under
both versions before trusting CPU tests for a GPU whose JAX differs. Session 24, after the fix:
the 18 kernels of these cases have identical counts under jax 0.11.2 and 0.12.0.1.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

CASES = (("moe", 1), ("moe", 64), ("gemv", 1), ("gemv", 8), ("sparse-attn", 1), ("sparse-attn", 8), ("indexer", 1),
         ("mhc", 1), ("mhc-moe", 1), ("route", 1), ("route", 64), ("kv-write", 1), ("kv-write", 8), ("qnorm", 1), ("qnorm", 4))


def count(ttir: str) -> dict:
    """Counts of one Triton IR module: operations, attribute names, masked loads and stores."""
    from pallas_kernels.inspect_sass import strip_cache_policy

    ttir = strip_cache_policy(ttir)
    ops = collections.Counter(re.findall(r"= ([a-z_]+\.[a-z_]+)", ttir)
                              + re.findall(r"^\s*([a-z_]+\.[a-z_]+) ", ttir, re.M))
    loads = re.findall(r"tt\.load ([^:]*):", ttir)
    stores = re.findall(r"tt\.store ([^:]*):", ttir)
    return {"ops": dict(sorted(ops.items())),
            "attrs": dict(sorted(collections.Counter(re.findall(r"\{([a-zA-Z_]+) = ", ttir)).items())),
            "masked_loads": sum(a.count(",") >= 1 for a in loads),
            "masked_stores": sum(a.count(",") >= 2 for a in stores)}


def census(cases=CASES) -> dict:
    """{"case/size/kernel": counts, warps, stages} for this JAX, and its version under "jax"."""
    import jax

    from pallas_kernels.inspect_sass import _cases, triton_kernels

    out = {"jax": jax.__version__, "kernels": {}}
    for case, size in cases:
        fn, *specs = _cases(case, tokens=size, experts=96 if case == "route" else 384)
        for k in triton_kernels(fn, *specs):
            out["kernels"][f"{case}/{size}/{k['name']}"] = {**count(k["ttir"]), "warps": k["num_warps"],
                                                            "stages": k["num_stages"]}
    return out


def compare(a: dict, b: dict) -> list[str]:
    """Readable differences between two censuses (empty: the same counts for every kernel)."""
    diffs = []
    ka, kb = a["kernels"], b["kernels"]
    for name in sorted(set(ka) | set(kb)):
        if name not in ka or name not in kb:
            diffs.append(f"{name}: only under jax {a['jax'] if name in ka else b['jax']}")
            continue
        for field in sorted(set(ka[name]) | set(kb[name])):
            x, y = ka[name].get(field), kb[name].get(field)
            if x == y:
                continue
            if isinstance(x, dict) and isinstance(y, dict):
                d = {k: (x.get(k, 0), y.get(k, 0)) for k in sorted(set(x) | set(y)) if x.get(k, 0) != y.get(k, 0)}
                diffs.append(f"{name}: {field} {d}")
            else:
                diffs.append(f"{name}: {field} {x} vs {y}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="write this JAX's census here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print the differences of two censuses")
    args = ap.parse_args(argv)
    if args.compare:
        docs = []
        for path in args.compare:
            try:
                with open(path) as f:
                    docs.append(json.load(f))
            except (OSError, ValueError) as e:
                ap.error(f"{path}: cannot read a census ({e})")
        diffs = compare(*docs)
        print(f"jax {docs[0]['jax']} vs {docs[1]['jax']}: {len(docs[0]['kernels'])} / {len(docs[1]['kernels'])} "
              f"kernels, {len(diffs)} differences")
        for d in diffs:
            print("  " + d)
        return 1 if diffs else 0
    if not args.out:
        ap.error("give OUT.json (a census of this JAX) or --compare A B")
    import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)

    doc = census()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"jax {doc['jax']}: {len(doc['kernels'])} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
