"""Offline instruction counts of the Pallas-Triton kernels: lower a jitted function for ``cuda`` on the
CPU (no GPU), capture the Triton IR of each ``pallas_call``, compile it for sm_90 with an installed
``triton`` package and count the SASS instructions in each kernel's innermost loop.

    PYTHONPATH=. python -m pallas_kernels.inspect_sass moe [--decode fp4=e4m3]
    PYTHONPATH=. python -m pallas_kernels.inspect_sass moe --tokens 4096 --experts 96 --config "(128, 128, 64, 128, 64, 8)"
    PYTHONPATH=. python -m pallas_kernels.inspect_sass gemv
    PYTHONPATH=. python -m pallas_kernels.inspect_sass moe --target rocm   # gfx950 (MI350X) AMDGCN

With ``--target rocm`` the kernels are lowered for ROCm and compiled by Triton's AMD backend for
gfx950 (no ROCm install or AMD GPU needed): the innermost loops' AMDGCN instruction counts, VGPRs
and occupancy -- what the target hardware would run, which no device here has.

Why: the fma decode kernels are bound by their integer and conversion work per weight code, not by
HBM (BENCHMARKS.md, session 7), so the instruction mix of one K step predicts a variant's speed
before any device time is spent: the MoE gate/up loop went from 1,050 instructions per step (e4m3
route) to 609 (f16w route), and the kernel from 103.9 to 76.4 us on the H200.

Needs ``triton`` (its own ``ptxas`` and ``nvdisasm`` come with the wheel); jaxlib does not ship it.
Tested with triton 3.5.0 in a separate virtual environment: the Triton IR text that jax 0.11
emits parses there. The capture and the SASS parsing run without it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile

# jax is imported where it is needed: compile_sass also runs in an interpreter that has triton and
# not jax (--python).

TRITON_HINT = ("the SASS step needs the 'triton' package (e.g. a separate venv: python3.12 -m venv /tmp/tv && "
               "/tmp/tv/bin/pip install triton==3.5.0, then --python /tmp/tv/bin/python)")


@contextlib.contextmanager
def capturing_triton_ir():
    """Inside the block, every Pallas-Triton lowering appends (kernel name, Triton IR text) to the
    yielded list."""
    from jax._src.pallas.triton import lowering

    out = []
    orig = lowering.lower_jaxpr_to_triton_module

    def wrapped(*a, **k):
        res = orig(*a, **k)
        op = res.module.operation
        name = re.search(r"tt\.func (?:public |private )?@(\w+)", op.get_asm())
        out.append((name.group(1) if name else f"kernel{len(out)}", op.get_asm()))
        return res

    lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        yield out
    finally:
        lowering.lower_jaxpr_to_triton_module = orig


def triton_kernels(fn, *specs, target: str = "cuda") -> list[dict]:
    """Lower ``jax.jit(fn)`` on ShapeDtypeStruct ``specs`` for ``target`` on this (CPU) host; one dict
    per Pallas kernel: name, ttir (the Triton IR text), num_warps and num_stages (from its custom call)."""
    import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
    from pallas_kernels.testing import lower_for

    with capturing_triton_ir() as mods:
        text = lower_for(target, fn, *specs).as_text()
    params = re.findall(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    by_name = {n: (int(s), int(w)) for n, s, w in params}
    kernels = []
    for name, ttir in mods:
        stages, warps = by_name.get(name, (3, 4))
        kernels.append(dict(name=name, ttir=ttir, num_warps=warps, num_stages=stages))
    return kernels


_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _loops(text: str, header: str, instr, op_group: int, back) -> list[dict]:
    """Every loop of an assembly listing: from a line matching ``header`` (its group 1 the label) to
    the instruction ``back(op, line, label)`` says branches back to it, counting the opcodes that
    ``instr`` matches (group ``op_group``)."""
    lines = text.splitlines()
    loops = []
    for i, line in enumerate(lines):
        m = re.match(header, line)
        if not m:
            continue
        body = collections.Counter()
        for later in lines[i + 1:]:
            ins = instr.match(later)
            if ins:
                op = ins.group(op_group)
                body[op] += 1
                if back(op, later, m.group(1)):
                    if sum(body.values()) > 1:  # not a trailing self-branch
                        loops.append(dict(label=m.group(1), total=sum(body.values()), counts=dict(body)))
                    break
    return loops


def loop_mix(sass: str) -> list[dict]:
    """Instruction counts of every loop in ``nvdisasm -c`` output: the instructions from a label to
    the branch back to it. One dict per loop: label, total, counts (opcode without modifiers -> n)."""
    return _loops(sass, r"^(\.L_x_\d+):", _INSTR, 2, lambda op, line, label: op == "BRA" and f"({label})" in line)


def strip_cache_policy(ttir: str) -> str:
    """The Triton IR without the ``{cachePolicy = ...}`` attributes jax >= 0.12 prints on loads (no
    effect on the program; triton 3.5's parser refuses them)."""
    return re.sub(r" \{cachePolicy = #tt.cache_policy<[^>]*>\}", "", ttir)


def _triton_compile(ttir: str, backend: str, arch, warp_size: int, num_warps: int, num_stages: int, d: str):
    """Compile Triton IR text with the installed ``triton`` for ``backend`` ("cuda" / "hip") and
    ``arch`` in directory ``d``; returns the compiled kernel (its ``asm`` and ``metadata``)."""
    ttir = strip_cache_policy(ttir)
    try:
        import triton
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise RuntimeError(TRITON_HINT) from e
    if backend == "cuda":
        from triton.backends.nvidia.compiler import CUDABackend as Backend
    else:
        from triton.backends.amd.compiler import HIPBackend as Backend
    path = os.path.join(d, "kernel.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    target = GPUTarget(backend, arch, warp_size)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    # triton.compile starts an IR file after its own stage, so a .ttir source would skip make_ttir
    # (inliner, canonicalizer, combine: e.g. acc + dot(a, b, 0) -> dot(a, b, acc)), which XLA's
    # Triton pipeline does run on the device: run it here first.
    be = Backend(target)
    ctx = ir.context()
    ir.load_dialects(ctx)
    be.load_dialects(ctx)
    mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx  # as triton.compile does for an IR source
    extra = (arch,) if backend == "cuda" else ()
    mod = be.make_ttir(mod, {}, be.parse_options(options), *extra)
    with open(path, "w") as f:
        f.write(str(mod))
    return triton.compile(path, target=target, options=options)


def compile_sass(ttir: str, num_warps: int, num_stages: int, arch: int = 90) -> str:
    """Triton IR text -> ``nvdisasm -c`` text of its sm_``arch`` cubin (needs ``triton``)."""
    with tempfile.TemporaryDirectory() as d:
        k = _triton_compile(ttir, "cuda", arch, 32, num_warps, num_stages, d)
        import triton

        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
        cuobjdump = os.path.join(os.path.dirname(nvdisasm), "cuobjdump")
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+)", usage)
        return f"{RESOURCES} regs={m.group(1) if m else -1} shared={int(k.metadata.shared)}\n" + sass


def compile_amdgcn(ttir: str, num_warps: int, num_stages: int, arch: str = "gfx950") -> str:
    """Triton IR text (lowered for ``rocm``) -> the AMDGCN assembly Triton's AMD backend makes for
    ``arch`` (MI350X: gfx950), offline (needs ``triton``; no ROCm install, no GPU): the MI350X
    counterpart of :func:`compile_sass`, for the target hardware no device here has."""
    with tempfile.TemporaryDirectory() as d:
        k = _triton_compile(ttir, "hip", arch, 64, num_warps, num_stages, d)
        # Triton allocates its shared memory (LDS) at launch: the assembly's own LDS field is 0
        return f"{GCN_RESOURCES} lds={int(k.metadata.shared)}\n" + k.asm["amdgcn"]


GCN_RESOURCES = "; dsv41 resources:"


_GCN_INSTR = re.compile(r"^\s+((?:[sv]|ds|buffer|global|flat|scratch)_[a-z0-9_]+)")


def gcn_loop_mix(asm: str) -> list[dict]:
    """Instruction counts of every innermost loop in AMDGCN assembly (:func:`compile_amdgcn`): the block
    LLVM marks as a loop header and every block it marks as in that loop (``in Loop: Header=...``:
    latches, pipelined parts and conditional blocks alike, wherever they sit in the listing). One dict
    per loop, as :func:`loop_mix`."""
    blocks, header_of, cur = {}, {}, None
    for line in asm.splitlines():
        m = re.match(r"^(\.LBB\w+|; %bb\.\d+):(.*)", line)
        if m:
            cur, note = m.group(1), m.group(2)
            blocks[cur] = collections.Counter()
            inner = re.search(r"in Loop: Header=(BB\w+)", note)
            header_of[cur] = cur if "Loop Header" in note else (".L" + inner.group(1) if inner else None)
            continue
        ins = _GCN_INSTR.match(line)
        if cur and ins:
            blocks[cur][ins.group(1)] += 1
    loops = []
    for h in [b for b, head in header_of.items() if head == b]:
        body = sum((blocks[b] for b, head in header_of.items() if head == h), collections.Counter())
        loops.append(dict(label=h, total=sum(body.values()), counts=dict(body)))
    return loops


def gcn_resources(asm: str) -> dict:
    """VGPRs / AGPRs / scratch bytes per thread (work-item), as the AMDGPU backend reports them in the
    assembly's comments, and LDS bytes per program from :func:`compile_amdgcn`'s first line (Triton's
    launch-time allocation); -1 where absent."""
    def field(name):
        m = re.search(rf";\s*{name}:\s*(\d+)", asm)
        return int(m.group(1)) if m else -1
    lds = re.match(re.escape(GCN_RESOURCES) + r" lds=(\d+)", asm)
    return {"vgprs": field("NumVgprs"), "agprs": field("NumAgprs"), "scratch": field("ScratchSize"),
            "lds": int(lds.group(1)) if lds else -1, "occupancy": field("Occupancy")}


RESOURCES = "// dsv41 resources:"
SM90_REGS, SM90_SMEM, SM90_MAX_WARPS = 65536, 232448, 64


def resources(sass: str, num_warps: int) -> dict | None:
    """Registers per thread and shared bytes per program from :func:`compile_sass`' first line, and
    the programs one sm_90 SM can hold by each (registers are allocated per warp in units of 256)."""
    m = re.match(re.escape(RESOURCES) + r" regs=(-?\d+) shared=(\d+)", sass)
    if not m:
        return None
    regs, shared = int(m.group(1)), int(m.group(2))
    out = {"regs": regs, "shared": shared, "by_shared": SM90_SMEM // max(shared, 1),
           "by_warps": SM90_MAX_WARPS // num_warps}
    if regs > 0:
        per_warp = -(-regs * 32 // 256) * 256
        out["by_regs"] = SM90_REGS // (per_warp * num_warps)
    out["programs_per_sm"] = min(v for k, v in out.items() if k.startswith("by_"))
    return out


def _cases(which: str, tokens: int = 1, experts: int = 384, config=None, packing: str = "nibbles"):
    """(fn, *specs) of a case: "moe" (V4.1 MXFP4 experts in ``packing``: ``tokens`` tokens over
    ``experts`` experts, the default config for that size or ``config``), "moe-bf16" (the same experts in bf16: the kernel
    without its decode) or "gemv" (wq_b at ``tokens`` rows)."""
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as S

    from dsv41_jax.quant import Fp4Tensor, Fp8Tensor
    from pallas_kernels.moe import pallas_triton as moe
    from pallas_kernels.quantized_matmul import pallas_triton as qmm

    if which in ("moe", "moe-bf16"):  # moe-bf16: the same experts as plain bf16 (no decode; a diagnostic)
        e, i, d = experts, 2304, 5120
        if which == "moe-bf16":
            w1, w2 = S((e, i, d), jnp.bfloat16), S((e, d, i), jnp.bfloat16)
        else:
            w1 = Fp4Tensor(S((e, i, d // 2), jnp.uint8), S((e, i, d // 32), jnp.float8_e8m0fnu), 32, packing)
            w2 = Fp4Tensor(S((e, d, i // 2), jnp.uint8), S((e, d, i // 32), jnp.float8_e8m0fnu), 32, packing)
        return (lambda x, w, idx, a, b, c: moe.moe_experts(x, w, idx, a, b, c, swiglu_limit=10.0, config=config),
                S((tokens, d), jnp.bfloat16), S((tokens, 6), jnp.float32), S((tokens, 6), jnp.int32), w1, w2, w1)
    if which == "gemv":
        w = Fp8Tensor(S((32768, 1280), jnp.float8_e4m3fn), S((1024, 40), jnp.float8_e8m0fnu), (32, 32))
        return (lambda x, w: qmm.quantized_matmul(x, w, config=config), S((tokens, 1280), jnp.bfloat16), w)
    if which == "sparse-attn":  # decode: ``tokens`` sequences of one query row, 64 heads x 512, window 128 +
        # top-512 of a 65,536-entry compressed cache; ``config``: keyword overrides, e.g. {"block_h": 32}
        from pallas_kernels.sparse_attention import pallas_triton as sa

        b, h, d, nc = tokens, 64, 512, 65536
        specs = (S((b, 1, h, d), jnp.bfloat16),
                 Fp8Tensor(S((b, 128, d), jnp.float8_e4m3fn), S((b, 128, d // 32), jnp.float8_e8m0fnu), (1, 32)),
                 S((b, 1, 128), jnp.int32), S((h,), jnp.float32),
                 Fp4Tensor(S((b, nc, d // 2), jnp.uint8), S((b, nc, d // 16), jnp.float8_e4m3fn), 16),
                 S((b, 1, 512), jnp.int32))
        kw = dict(config or {})
        if "two_pass" in kw:  # {"two_pass": {...}}: the two-pass kernels with those tiles, at any row count
            from pallas_kernels.sparse_attention import pallas_triton_two_pass as tp

            tiles = kw.pop("two_pass")
            return (lambda q, kv, wi, sink, ck, ci: tp.sparse_attention(q, kv, wi, sink, scale=d ** -0.5, comp_kv=ck,
                                                                         comp_idx=ci, config=tiles), *specs)
        return (lambda q, kv, wi, sink, ck, ci: sa.sparse_attention(q, kv, wi, sink, scale=d ** -0.5, comp_kv=ck,
                                                                     comp_idx=ci, **kw), *specs)
    if which == "indexer":  # decode: ``tokens`` sequences of one query row, 32 MXFP4 heads x 128 against a
        # 1M-entry MXFP4 key cache, top-512 (the streaming pipeline: score, candidate and select kernels)
        from pallas_kernels.lightning_indexer import pallas_triton as li

        b, hi, di, nc = tokens, 32, 128, 1 << 20
        q = Fp4Tensor(S((b, 1, hi, di // 2), jnp.uint8), S((b, 1, hi, di // 32), jnp.float8_e8m0fnu), 32)
        k = Fp4Tensor(S((b, nc, di // 2), jnp.uint8), S((b, nc, di // 32), jnp.float8_e8m0fnu), 32)
        return (lambda q, w, k, vis: li.lightning_indexer(q, w, k, vis, top_k=512, config=config).topk,
                q, S((b, 1, hi), jnp.float32), k, S((b, 1), jnp.int32))
    if which == "mhc":  # a V4.1 decode site (``tokens`` rows, D 5120): the expansion fused with the next
        # site's collapse, mix partial sums and RMSNorm, then the split kernel (Sinkhorn + norm programs)
        from pallas_kernels.mhc import pallas_triton as mhc

        t, hc, d = tokens, 4, 5120
        mix = (2 + hc) * hc
        specs = (S((t, d), jnp.bfloat16), S((t, hc, d), jnp.bfloat16), S((t, hc), jnp.float32),
                 S((t, hc, hc), jnp.float32), S((t, hc), jnp.float32), S((mix, hc * d), jnp.float32),
                 S((3,), jnp.float32), S((mix,), jnp.float32), S((d,), jnp.bfloat16))
        return (lambda *a: mhc.hc_expand_collapse_mixes(*a, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20,
                                                        y_norm_eps=1e-6), *specs)
    if which == "mhc-moe":  # the FFN-side site as the model runs it: f the MoE's output unsummed (6 slot
        # rows + the shared expert's 3 w2 K parts; pallas_kernels.deferred_sum)
        from pallas_kernels.deferred_sum import DeferredSum
        from pallas_kernels.mhc import pallas_triton as mhc

        t, hc, d, k = tokens, 4, 5120, 6
        mix = (2 + hc) * hc
        specs = (S((3, t, d), jnp.float32), S((t * k + 1, d), jnp.bfloat16), S((t, k), jnp.int32),
                 S((t, hc, d), jnp.bfloat16), S((t, hc), jnp.float32), S((t, hc, hc), jnp.float32),
                 S((t, hc), jnp.float32), S((mix, hc * d), jnp.float32), S((3,), jnp.float32), S((mix,), jnp.float32),
                 S((d,), jnp.bfloat16))

        def site(parts, rows, index, *a):
            f = DeferredSum(parts=parts, expert_rows=rows, expert_index=index, dtype=jnp.dtype(jnp.bfloat16),
                            shape=(t, d))
            return mhc.hc_expand_collapse_mixes(f, *a, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, y_norm_eps=1e-6)

        return (site, *specs)
    if which == "route":  # the router's selection: ``tokens`` rows over ``experts`` experts, top-6
        from pallas_kernels.moe_route import pallas_triton as mr

        kw = dict(config or {})
        return (lambda z, b: mr.route_select(z, b, topk=6, score_func="sqrtsoftplus", gate_temp=1.0,
                                             norm_topk_prob=True, route_scale=2.5, **kw),
                S((tokens, experts), jnp.float32), S((experts,), jnp.float32))
    if which == "kv-write":  # the decode window KV write: ``tokens`` rows, D 512, RoPE 64, a 128-slot ring
        from pallas_kernels.window_kv import pallas_triton as kvw

        b, w, d, r = tokens, 128, 512, 64
        ring = Fp8Tensor(S((b, w, d), jnp.float8_e4m3fn), S((b, w, d // 32), jnp.float8_e8m0fnu), (1, 32))
        return (lambda *a: kvw.window_kv_write(*a, eps=1e-6), S((b, d), jnp.bfloat16), S((d,), jnp.bfloat16),
                S((b, r // 2), jnp.float32), ring, S((b,), jnp.int32))
    if which == "qnorm":  # wq_a + wkv at ``tokens`` rows with q_norm: the fused GEMV, then the split-K
        # finish kernel (K parts summed, q normalized, kv handed over whole)
        wa = Fp8Tensor(S((1280, 5120), jnp.float8_e4m3fn), S((40, 160), jnp.float8_e8m0fnu), (32, 32))
        wk = Fp8Tensor(S((512, 5120), jnp.float8_e4m3fn), S((16, 160), jnp.float8_e8m0fnu), (32, 32))
        return (lambda x, a, b, w: qmm.quantized_matmul_multi(x, [a, b], norms=[w, None], norm_eps=1e-6),
                S((tokens, 5120), jnp.bfloat16), wa, wk, S((1280,), jnp.bfloat16))
    raise ValueError(f"unknown case {which!r}: expected moe, moe-bf16, gemv, sparse-attn, indexer, mhc, mhc-moe, route, "
                     "kv-write or qnorm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=["moe", "moe-bf16", "gemv", "sparse-attn", "indexer", "mhc", "mhc-moe", "route",
                                     "kv-write", "qnorm"])
    ap.add_argument("--decode", default=None, help="DSV41_FMA_DECODE for this run, e.g. fp4=e4m3")
    ap.add_argument("--tokens", type=int, default=1, help="tokens (moe, route), rows (gemv, kv-write) or sequences "
                    "(sparse-attn, indexer)")
    ap.add_argument("--experts", type=int, default=384, help="moe, route: routed experts")
    ap.add_argument("--packing", default="nibbles", choices=["nibbles", "f16pairs"],
                    help="moe: how the experts' MXFP4 codes are stored (dsv41_jax.quant.codecs)")
    ap.add_argument("--config", default=None, help="the op's config tuple, e.g. \"(128, 128, 64, 128, 64, 8)\"; "
                    "sparse-attn, indexer, route: keyword arguments, e.g. \"{'block_h': 32, 'num_warps': 4}\"; "
                    "sparse-attn also \"{'two_pass': {'dv': 64}}\" (the two-pass kernels with those tiles)")
    ap.add_argument("--target", default="cuda", choices=["cuda", "rocm"],
                    help="cuda: sm_90 SASS (H100/H200); rocm: gfx950 AMDGCN (MI350X), both compiled offline")
    ap.add_argument("--python", default=None, help="an interpreter with triton installed, for the SASS step")
    ap.add_argument("--out", default=None, help="also write each kernel's .ttir and .sass here")
    ap.add_argument("--mx", choices=["auto", "off", "on"], default=None,
                    help="DSV41_MX_DOT for this run: 'on' lowers the kernels that can take MX dots (the indexer, "
                         "the tiled GEMMs, e.g. gemv --tokens 4096) as they run on gfx950, whatever the target")
    a = ap.parse_args(argv)
    config = None
    if a.config:
        import ast

        try:
            config = ast.literal_eval(a.config)
            config = config if isinstance(config, dict) else tuple(config)
        except (ValueError, SyntaxError, TypeError):
            ap.error(f"--config {a.config!r}: expected a tuple literal such as \"(128, 128, 64, 128, 64, 8)\" "
                     f"(sparse-attn, indexer, route: a dict of keyword arguments, e.g. \"{{'block_h': 32}}\")")
        takes_dict = a.case in ("sparse-attn", "indexer", "route")
        if isinstance(config, dict) != takes_dict:
            ap.error(f"--config {a.config!r}: {a.case} takes a {'dict of keyword arguments' if takes_dict else 'tuple'}")
    import jax

    jax.config.update("jax_platforms", "cpu")
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    if a.decode:
        fma.FMA_DECODE.update(fma._parse_fma_decode(a.decode))
    if a.mx:
        from pallas_kernels import scaled_dot

        scaled_dot.MX_DOT = a.mx
    fn, *specs = _cases(a.case, a.tokens, a.experts, config, a.packing)
    rocm = a.target == "rocm"
    compiler = "compile_amdgcn" if rocm else "compile_sass"
    for k in triton_kernels(fn, *specs, target=a.target):
        if a.python:  # compile in the other interpreter
            with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
                f.write(k["ttir"])
            code = ("import sys; sys.path.insert(0, %r); from pallas_kernels.inspect_sass import %s; "
                    "print(%s(open(%r).read(), %d, %d))" % (os.getcwd(), compiler, compiler, f.name, k["num_warps"],
                                                            k["num_stages"]))
            res = subprocess.run([a.python, "-c", code], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
            if res.returncode:
                print(f"{k['name']}: SASS step failed: {res.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                return 1
            sass = res.stdout
        else:
            sass = (compile_amdgcn if rocm else compile_sass)(k["ttir"], k["num_warps"], k["num_stages"])
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            for ext, txt in (("ttir", k["ttir"]), ("amdgcn" if rocm else "sass", sass)):
                with open(os.path.join(a.out, f"{k['name']}.{ext}"), "w") as f:
                    f.write(txt)
        if rocm:
            r = gcn_resources(sass)
            print(f"{k['name']}: {r['vgprs']} VGPRs, {r['agprs']} AGPRs, {r['scratch']} scratch bytes per work-item, "
                  f"{r['lds']} LDS bytes per program, occupancy {r['occupancy']} waves per SIMD (gfx950)")
            for lp in gcn_loop_mix(sass):
                top = ", ".join(f"{op} {n}" for op, n in sorted(lp["counts"].items(), key=lambda t: -t[1])[:12])
                print(f"{k['name']} (warps {k['num_warps']}, stages {k['num_stages']}) loop {lp['label']}: "
                      f"{lp['total']} instructions per work-item and step: {top}")
            continue
        res = resources(sass, k["num_warps"])
        if res:
            print(f"{k['name']}: {res['regs']} registers per thread, {res['shared']} shared bytes per program -> "
                  f"{res['programs_per_sm']} programs per SM (by registers {res.get('by_regs', '?')}, by shared "
                  f"memory {res['by_shared']}, by warps {res['by_warps']})")
        for lp in loop_mix(sass):
            top = ", ".join(f"{op} {n}" for op, n in sorted(lp["counts"].items(), key=lambda t: -t[1])[:12])
            spills = lp["counts"].get("LDL", 0) + lp["counts"].get("STL", 0)
            print(f"{k['name']} (warps {k['num_warps']}, stages {k['num_stages']}) loop {lp['label']}: "
                  f"{lp['total']} instructions per thread and step ({spills} spill loads/stores): {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
