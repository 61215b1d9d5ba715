"""Work-arounds for the Pallas-Triton lowering, applied once for every kernel in the process.

Imported by every ``pallas_triton.py``; each fix checks that the JAX it patches still has the
exact code it fixes and leaves the lowering untouched otherwise.
"""

from __future__ import annotations


def _patch_triton_offsets() -> bool:
    """Work around a Pallas-Triton lowering bug: ``_compute_offsets_from_indices`` uses 32-bit element
    offsets whenever the array has at most 2**32 *bytes*, but Triton's ``addptr`` sign-extends i32
    offsets, so an element offset >= 2**31 wraps negative (illegal address). This hits uint8 arrays
    of 2-4 GB, e.g. the stacked MXFP4 experts [384, 2304, 2560] (2.26 GB). Re-define the function
    with the 64-bit threshold at 2**31 bytes. Returns whether the patch was applied."""
    import inspect
    import textwrap

    from jax._src.pallas.triton import lowering as tl

    fn = tl._compute_offsets_from_indices
    if getattr(fn, "_dsv41_patched", False):
        return True
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    old = "64 if full_size > 2**32 else 32"
    if old not in src:
        return False
    ns: dict = {}
    try:
        exec(compile(src.replace(old, "64 if full_size > 2**31 else 32"), tl.__file__, "exec"), tl.__dict__, ns)
        new = ns["_compute_offsets_from_indices"]
    except Exception:  # noqa: BLE001  (a different JAX version: leave the lowering untouched)
        return False
    new._dsv41_patched = True
    tl._compute_offsets_from_indices = new
    return True


TRITON_OFFSETS_PATCHED = _patch_triton_offsets()


def _patch_cache_modifiers(table=None) -> bool:
    """Make the load cache modifiers (``cache_modifier=".cg"`` etc., the PTX spelling) work on every
    supported lowering. jax 0.12 checks the dotted name and strips the dot before its table lookup;
    jax 0.11.2 checks the dotted name too but looks it up unstripped in a table keyed without the
    dot, so ".cg" raised KeyError on the H200 and "cg" is refused as unsupported (session 22). Adds
    the dotted keys to that table (``table``: the lowering's, or a given dict). Returns whether the
    table was found."""
    if table is None:
        from jax._src.pallas.triton import lowering as tl

        table = getattr(tl, "_STR_TO_CACHE_MODIFIER", None)
    if not isinstance(table, dict):
        return False
    for key in [k for k in table if not k.startswith(".")]:
        table.setdefault("." + key, table[key])
    return True


CACHE_MODIFIERS_PATCHED = _patch_cache_modifiers()


# ------------------------------------------------------------------------------------------------
# Opt-in: software-pipeline the loads of loops without a dot.
#
# Triton pipelines (cp.async into shared memory, ``num_stages - 1`` steps ahead) only the loads that
# feed a dot, unless the loop carries its own ``tt.num_stages`` attribute (``tl.range(...,
# num_stages=)``): then every load of a dot-free innermost loop that is at least 32 bits wide per
# thread is pipelined too (Triton's AssignLatencies, "pipelineWithoutDot"). Pallas-Triton's
# ``fori_loop`` lowering never sets that attribute, so the weight-streaming fma kernels have no load
# in flight while they decode (BENCHMARKS.md, issue 6, session 7). ``DSV41_TRITON_LOOP_STAGES``
# (e.g. ``qmm_fma=3,moe_gate_up_fma=3``: kernel-name prefix = stages) sets it on every scf.for of
# the kernels whose name starts with a listed prefix. Read at lowering time; unset = no change. The
# attribute overrides the kernel's own ``num_stages`` for its loops (a 1-stage config is pipelined too).
# Timed on the H200 (BENCHMARKS.md, issue 6, session 15): every pipelined fma GEMV and MoE config was
# 19-60 % slower than the unmarked loop, so nothing sets it by default; it stays for experiments.

LOOP_STAGES_ENV = "DSV41_TRITON_LOOP_STAGES"


def parse_loop_stages(text: str | None) -> dict[str, int]:
    """``DSV41_TRITON_LOOP_STAGES`` -> {kernel-name prefix: stages}; a clear error for bad entries."""
    out: dict[str, int] = {}
    for part in filter(None, (t.strip() for t in (text or "").split(","))):
        name, sep, stages = part.partition("=")
        if not sep or not name.strip() or not stages.strip().isdigit() or int(stages) < 1:
            raise ValueError(f"{LOOP_STAGES_ENV}={text!r}: entry {part!r} is not KERNEL_PREFIX=STAGES "
                             "(e.g. qmm_fma=3; stages >= 1)")
        out[name.strip()] = int(stages)
    return out


def loop_stages_for(kernel_name: str, table: dict[str, int]) -> int | None:
    """The stages of the longest listed prefix of ``kernel_name`` (None: not listed)."""
    hits = [p for p in table if kernel_name.startswith(p)]
    return table[max(hits, key=len)] if hits else None


def _ops_named(module, name: str) -> list:
    """Every operation of ``module`` (nested too) whose name is ``name``, e.g. "scf.for"."""
    from jax._src.lib.mlir import ir

    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def _set_loop_stages(module, stages: int) -> None:
    """Set ``tt.num_stages`` on every scf.for of ``module``."""
    from jax._src.lib.mlir import ir

    marked = _ops_named(module, "scf.for")
    with module.context:
        attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)
        for op in marked:
            op.attributes["tt.num_stages"] = attr


# Triton's sm_90 matmul pass takes the Hopper tensor cores' asynchronous FP8 path (wgmma) only when a
# dot allows that many K elements to be summed at the tensor core's reduced internal precision
# (``maxNumImpreciseAcc`` >= 32); Pallas never sets it, so every e4m3 dot falls back to the older
# mma path, with each FP8 code converted to f16 in registers first (offline SASS, session 20: F2FP
# 96 of 360 instructions per step of the decode GEMV). Kernels whose name starts with a prefix in
# FP8_IMPRECISE_ACC_KERNELS, and only those, get ``maxNumImpreciseAcc`` = K on every FP8 dot. The
# kernels registered here apply the block scales to each dot's fp32 result and sum across K blocks
# in fp32 themselves, so the imprecise part is one 32-element dot, finer than DeepSeek's own
# promotion interval (128). ``DSV41_FP8_IMPRECISE_ACC=off`` keeps the exact mma path.
FP8_IMPRECISE_ACC_ENV = "DSV41_FP8_IMPRECISE_ACC"
FP8_IMPRECISE_ACC_KERNELS: set[str] = set()


def fp8_imprecise_acc_enabled() -> bool:
    import os

    v = os.environ.get(FP8_IMPRECISE_ACC_ENV, "on").lower()
    if v not in ("on", "off"):
        raise ValueError(f"{FP8_IMPRECISE_ACC_ENV}={v!r}: expected on or off")
    return v == "on"


def set_fp8_imprecise_acc(module) -> int:
    """Set ``maxNumImpreciseAcc`` = K on every ``tt.dot`` of ``module`` whose operands are FP8; the
    number of dots marked."""
    from jax._src.lib.mlir import ir

    dots = _ops_named(module, "tt.dot")
    n = 0
    with module.context:
        for op in dots:
            a = ir.RankedTensorType(op.operands[0].type)
            if "f8" not in str(a.element_type).lower():
                continue
            op.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), a.shape[-1])
            n += 1
    return n


def _patch_loop_stages() -> bool:
    """Wrap the Triton module lowering with this module's edits of a lowered kernel: listed kernels'
    loops carry ``tt.num_stages`` (:data:`LOOP_STAGES_ENV`), and the FP8 dots of registered kernels
    allow imprecise accumulation (:data:`FP8_IMPRECISE_ACC_KERNELS`)."""
    import os

    from jax._src.pallas.triton import lowering as tl

    orig = tl.lower_jaxpr_to_triton_module
    if getattr(orig, "_dsv41_loop_stages", False):
        return True

    def lower(*args, **kwargs):
        res = orig(*args, **kwargs)
        table = parse_loop_stages(os.environ.get(LOOP_STAGES_ENV))
        name = str(res.module.operation.attributes["sym_name"]).strip('"')  # the kernel's name
        if table:
            stages = loop_stages_for(name, table)
            if stages is not None:
                _set_loop_stages(res.module, stages)
        if any(name.startswith(p) for p in FP8_IMPRECISE_ACC_KERNELS) and fp8_imprecise_acc_enabled():
            set_fp8_imprecise_acc(res.module)
        return res

    lower._dsv41_loop_stages = True
    try:
        tl.lower_jaxpr_to_triton_module = lower
    except Exception:  # noqa: BLE001
        return False
    return True


LOOP_STAGES_PATCHED = _patch_loop_stages()
fp8_imprecise_acc_enabled()  # a bad DSV41_FP8_IMPRECISE_ACC fails at import, with its name, not inside a lowering
