"""The H200 benchmark scripts stay runnable: every one parses its flags, and the MoE localisation
tool (``--debug``) runs end to end at a small shape in interpret mode, where the kernels are exact
(so every error it reports must be 0, in both h act-quant placements)."""

import importlib

import pytest

OPS = ["quantized_matmul", "moe", "mhc", "sparse_attention", "lightning_indexer", "moe_route", "window_kv"]



@pytest.mark.parametrize("op", OPS)
def test_benchmark_parses_its_flags(op, capsys):
    mod = importlib.import_module(f"pallas_kernels.{op}.benchmark")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_moe_debug_runs_in_interpret_mode(monkeypatch):
    import pallas_kernels.moe.benchmark as bm

    monkeypatch.setattr(bm, "I", 64)
    monkeypatch.setattr(bm, "D", 128)
    results = bm.debug(n_exp=8, interpret=True, formats=("mxfp4",), sizes=(8,))
    labels = [r[0] for r in results]
    assert len(results) == 3  # 2 placements of h's act-quant + kernel A's rows
    assert any("act_quant_in_kernel=True" in s for s in labels) and any("kernel A" in s for s in labels)
    assert all(err == 0.0 for _, err in results), results
    assert bm.pallas_triton.DEBUG == {"act_quant_in_kernel": False, "return_h": False}  # switches restored


def test_moe_tune_sweep_runs_in_interpret_mode(monkeypatch):
    """``moe.benchmark --tune`` end to end at a small shape (timing stubbed): the default rows with
    the kernels in interpret mode, within the sweep's tolerance of the reference; every sweep row
    carries its config and its error against the reference, a correct config passes and a wrong
    one fails (the sweep's configs through :func:`_recording_moe_kernel`; the tilings themselves are
    test_moe.py::test_tune_configs_interpret's cases)."""
    import functools

    import pallas_kernels.moe.benchmark as bm

    monkeypatch.setattr(bm, "E", 8)
    monkeypatch.setattr(bm, "I", 64)
    monkeypatch.setattr(bm, "D", 128)
    monkeypatch.setattr(bm, "TOPK", 2)
    # decode: a 6- and a 7-entry config with the same tiles, 2 K steps in either kernel (their kernels
    # differ only in warps and stages, which interpret mode ignores: jaxprs equal but for
    # compiler_params); other decode tilings, e.g. the (16, 16, 64, 16, 32, 2) this test ran before,
    # are checked against the reference by test_moe.py::test_tune_configs_interpret
    monkeypatch.setattr(bm, "TUNE_CONFIGS", [(16, 32, 64, 32, 32, 4), (16, 32, 64, 32, 32, 2, 2)])
    monkeypatch.setattr(bm, "TUNE_CONFIGS_PREFILL", [(64, 32, 64, 32, 32, 4)])
    monkeypatch.setattr(bm, "TUNE_PREFILL_TOKENS", 256)  # 64 rows per expert: the prefill tiling's regime
    monkeypatch.setattr(bm, "time_op", lambda *a, **k: (1e-6, 1e-6))
    monkeypatch.setattr(bm, "log", lambda *a: None)
    # the default tiling's rows run the kernels in interpret mode; the sweep's configs go through
    # _recording_moe_kernel (traced abstractly, then the reference; one made wrong must fail its row)
    interpret = functools.partial(bm.pallas_triton.moe_experts, interpret=True)
    calls = _recording_moe_kernel(monkeypatch, bm, wrong=(bm.TUNE_CONFIGS[1],))
    recorded = bm.pallas_triton.moe_experts
    monkeypatch.setattr(bm.pallas_triton, "moe_experts",
                        lambda *a, config=None, **k: (recorded if config else interpret)(*a, config=config, **k))
    rows = bm.run(quick=True, tune=True)
    assert [(r["tokens"], r["rel_err"] < 1e-2) for r in rows if r["op"] == "moe"] == [(1, True), (8, True)], rows
    tune = [r for r in rows if r["op"] == "tune_moe"]
    assert [(r["tokens"], len(r["config"])) for r in tune] == [(1, 6), (1, 7), (8, 6), (8, 7), (256, 6)]
    assert [c["config"] for c in calls] == [r["config"] for r in tune]
    assert [r["ok"] for r in tune] == [True, False, True, False, True], \
        [(r["tokens"], r["config"], r["rel_err"], r["frac_gt_1pct"]) for r in tune]


def _recording_moe_kernel(monkeypatch, bm, wrong=()):
    """``pallas_triton.moe_experts`` replaced by the reference, recording per call the config and the
    switches it was traced under (FMA decode route, float16-product mode, tensor-core MXFP4 route),
    after tracing the real kernels abstractly (``jax.eval_shape``: a config they refuse raises as
    before, nothing compiles); configs in ``wrong`` return the reference times 1.5, which the
    sweep's check must flag. For the sweeps' own logic (which configs, under which switches, checked
    how); every kernel config they build is a kernel test's case (test_moe.py fma parity and tune
    configs, test_moe_down_split.py, test_moe_f16acc.py, test_moe_f16pairs.py)."""
    import jax

    from pallas_kernels.quantized_matmul import pallas_triton_fma

    calls, real = [], bm.pallas_triton.moe_experts

    def fake(x, w, idx, a, b, c, *, swiglu_limit, config=None, act_block=32):
        jax.eval_shape(lambda *t: real(*t, swiglu_limit=swiglu_limit, config=config, act_block=act_block,
                                       interpret=True), x, w, idx, a, b, c)
        calls.append(dict(config=config, via=pallas_triton_fma.FMA_DECODE["fp4"], f16acc=pallas_triton_fma.F16ACC["mode"],
                          mma=bm.pallas_triton.MMA_FP4["route"], act_block=act_block))
        y = bm.reference.moe_experts(x, w, idx, a, b, c, swiglu_limit=swiglu_limit, act_block=act_block)
        return y * 1.5 if config in wrong else y

    monkeypatch.setattr(bm.pallas_triton, "moe_experts", fake)
    return calls


def test_moe_fma_sweep_runs_in_interpret_mode(monkeypatch):
    """``moe.benchmark --fma`` end to end at a small shape (timing stubbed): once with the kernels in
    interpret mode (``--f16acc on`` with two ``--fma-configs``, the tensor-core default and the fma
    configs each checked against the reference and passing), then the sweep's choices of configs and
    switches with the kernel replaced by :func:`_recording_moe_kernel` (the kernels' own tests check
    each config; 148 interpret-mode programs here took 144 CPU-s before session 57)."""
    import functools

    import pallas_kernels.moe.benchmark as bm

    monkeypatch.setattr(bm, "E", 8)
    monkeypatch.setattr(bm, "I", 64)
    monkeypatch.setattr(bm, "D", 256)
    monkeypatch.setattr(bm, "TOPK", 2)
    monkeypatch.setattr(bm, "device_time_op", lambda *a, **k: 1e-6)
    monkeypatch.setattr(bm, "log", lambda *a: None)
    # --f16acc: the fma configs in the float16-product mode (fma.F16ACC, opt-in), recorded as such and
    # within the sweep's tolerance of the reference; the tensor-core row has no mode
    # (with --fma-configs: one more config, 2 warps for both kernels, timed and checked in the mode; one
    # whose gate/up split does not divide its K steps refused, not timed)
    extra = (1, 16, 8, 16, 2, 2, 3, 1, 2)
    with monkeypatch.context() as m:
        m.setattr(bm.pallas_triton, "moe_experts", functools.partial(bm.pallas_triton.moe_experts, interpret=True))
        rows = bm.fma_sweep((1,), default_only=True, f16acc=("on",), fma_extra=[extra, (1, 16, 8, 16, 2, 4, 3, 3)])
    fma16 = [r for r in rows if r["config"][0] == "fma"]
    assert fma16 and {r["f16acc"] for r in fma16} == {"on"} and all(r["ok"] for r in rows), \
        [(r["config"], r["f16acc"], r["rel_err"]) for r in rows]
    assert ("fma",) + extra in [r["config"] for r in fma16] and all(len(r["config"]) != 9 or r["config"][8] != 3 for r in rows)
    assert all(r["f16acc"] is None for r in rows if r["config"][0] != "fma")
    # every config at 4 tokens (one token: the default_only sweeps below), each checked: one config made
    # wrong is flagged and the rest pass
    made_wrong = bm.fma_configs(bm.random_fp4(bm.jax.random.PRNGKey(0), (8, 64, 256)), 4, False)[1]
    calls = _recording_moe_kernel(monkeypatch, bm, wrong=(made_wrong,))
    rows = bm.fma_sweep((4,))
    assert {r["tokens"] for r in rows} == {4} and [c["config"] for c in calls] == [r["config"] for r in rows]
    fma_rows = [r for r in rows if r["config"][0] == "fma"]
    assert any(r["config"][1] == 4 for r in fma_rows)  # 4-row blocks tried at 4 tokens
    assert len(fma_rows) >= 8 and [r["config"] for r in rows if not r["ok"]] == [made_wrong], \
        [(r["config"], r["rel_err"]) for r in rows]
    # I = 192: 3 down K steps of 2 groups: the dispatch's config at one token splits the down kernel
    # in 3 (11th entry); the sweep times it beside the unsplit default, and every split of the 6
    # one-group steps (session 32), each checked
    monkeypatch.setattr(bm, "I", 192)
    rows = bm.fma_sweep((1,), default_only=True)
    downs = sorted((r["config"][5], bm.pallas_triton.fma_down_splits(r["config"])) for r in rows if r["config"][0] == "fma")
    assert downs == [(1, 1), (1, 2), (1, 3), (1, 6), (2, 1), (2, 3)] and all(r["ok"] for r in rows), \
        [(r["config"], r["rel_err"]) for r in rows]
    # V4's activation blocks of 128 (--v4-flash): the reference and every kernel config take them
    monkeypatch.setattr(bm, "I", 128)
    del calls[:]
    rows = bm.fma_sweep((1,), default_only=True, act_block=128)
    assert len(rows) >= 3 and all(r["ok"] for r in rows) and {c["act_block"] for c in calls} == {128}
    seen = {}
    with monkeypatch.context() as m:  # main sets the module's shapes: restored on leaving
        for name in ("E", "I", "D"):
            m.setattr(bm, name, getattr(bm, name))
        m.setattr(bm, "fma_sweep", lambda *a, **k: seen.update(shape=(bm.E, bm.I, bm.D), **k) or [])
        assert bm.main(["--fma", "--v4-flash", "--quick"]) == 0
    assert seen["shape"] == bm.V4_SHAPE and seen["act_block"] == 128 and (bm.E, bm.D) == (8, 256)
    monkeypatch.setattr(bm, "I", 64)
    # --vias e4m3,f16 --default-only: the tensor-core default once, then per route the fma default and
    # the down kernel with half its K step (I = 64: one step of 2 groups -> 2 steps of 1, unsplit and
    # split in 2), each checked and each traced under its route
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    monkeypatch.setattr(pallas_triton_fma, "FMA_DECODE", {"fp4": "e4m3", "fp8": "f16w"})
    del calls[:]
    rows = bm.fma_sweep((1,), vias=["f16w", "e4m3"], default_only=True)
    fma = [(r["via"], r["config"][5], bm.pallas_triton.fma_down_splits(r["config"])) for r in rows if r["config"][0] == "fma"]
    assert len(rows) == 7 and fma == [(v, kgb, ds) for v in ("f16w", "e4m3") for kgb, ds in ((2, 1), (1, 1), (1, 2))], \
        [(r["config"], r["via"]) for r in rows]
    assert [c["via"] for c in calls if c["config"][0] == "fma"] == [v for v, _, _ in fma]
    assert all(r["ok"] for r in rows) and pallas_triton_fma.FMA_DECODE == {"fp4": "e4m3", "fp8": "f16w"}  # restored
    with pytest.raises(ValueError, match="--vias f16: unknown weight decode route"):
        bm.fma_sweep((1,), vias=["f16"], default_only=True)
    # --sizes 8 --experts 2 --wide --mma-fp4 bytes,f16w: the tensor-core kernels (the default tiling and
    # the decode tilings with 64-wide K tiles; one wider than I = 64 here is refused and logged) once
    # per MXFP4 route, then the fma default and the block height the dispatch picks at 8 pairs per
    # expert (also with the down kernel's K step halved, unsplit and split in 2), each checked; the
    # route switch restored
    route = bm.pallas_triton.MMA_FP4["route"]
    del calls[:]
    rows = bm.fma_sweep((8,), vias=["f16w"], default_only=True, experts=2, mma_routes=["bytes", "f16w"], wide=True)
    tc = [(r["mma_fp4"], r["config"]) for r in rows if r["config"][0] != "fma"]
    fit = [c for c in bm.TC_DECODE_CONFIGS if c[1] <= 64]
    assert len(fit) == 3 and [m for m, _ in tc] == ["bytes"] * 4 + ["f16w"] * 4, tc
    traced = {(c["mma"], c["config"]) for c in calls}
    assert all((m, c) in traced for m, c in tc), (tc, traced)
    assert [r["config"][1] for r in rows if r["config"][0] == "fma"] == [1, 4, 4, 4] and {r["experts"] for r in rows} == {2}
    assert all(r["ok"] for r in rows) and bm.pallas_triton.MMA_FP4["route"] == route


def test_moe_fma_config_flags_are_checked(capsys):
    """``--fma-configs`` / ``--tc-configs``: a non-integer entry or a config of the wrong length is a
    usage error naming the flag, before anything is built."""
    import pallas_kernels.moe.benchmark as bm

    assert bm.int_tuples(" 1,16,8 ; 2,3 ;", "--x") == [(1, 16, 8), (2, 3)]
    for argv, words in ((["--fma", "--fma-configs", "1,16,x,64,8,4,3"], "--fma-configs: '1,16,x,64,8,4,3' is not"),
                        (["--fma", "--fma-configs", "1,16,8,64,8,4"], "has 6 entries; expected 7 to 10"),
                        (["--fma", "--tc-configs", "16,64;a"], "--tc-configs: 'a' is not")):
        with pytest.raises(SystemExit):
            bm.main(argv)
        assert words in capsys.readouterr().err


def test_qmm_fma_sweep_runs_in_interpret_mode(monkeypatch):
    """``quantized_matmul.benchmark --fma`` at small shapes: every config is checked (rel err within
    the check tolerance) and timed (stubbed)."""
    import functools

    import pallas_kernels.quantized_matmul.benchmark as bq

    monkeypatch.setattr(bq, "PROJECTIONS", [("wq_a", 64, 512), ("wq_b", 128, 256)])
    monkeypatch.setattr(bq, "device_time_op", lambda *a, **k: 1e-6)
    monkeypatch.setattr(bq.pallas_triton, "quantized_matmul",
                        functools.partial(bq.pallas_triton.quantized_matmul, interpret=True))
    monkeypatch.setattr(bq, "log", lambda *a: None)
    rows = bq.fma_sweep(__import__("jax").random.PRNGKey(0))
    assert {(r["case"].split()[1], r["M"]) for r in rows} == {("wq_a", 1), ("wq_b", 1), ("wq_b", 4)}
    assert sum(r.get("mode") == "fma" for r in rows) >= 6
    assert all(r["rel_err"] <= bq.CHECK_TOL for r in rows), [(r["case"], r.get("rel_err")) for r in rows]
    from pallas_kernels.quantized_matmul import pallas_triton_fma

    monkeypatch.setattr(pallas_triton_fma, "FMA_DECODE", {"fp4": "e4m3", "fp8": "f16w"})
    rows = bq.fma_sweep(__import__("jax").random.PRNGKey(1), quick=True, names=("wq_b",), vias=["f16w", "e4m3"],
                        default_only=True)
    assert [r.get("via") for r in rows] == [None, "f16w", "e4m3"], [r["case"] for r in rows]
    assert all(r["rel_err"] <= bq.CHECK_TOL for r in rows) and pallas_triton_fma.FMA_DECODE == {"fp4": "e4m3", "fp8": "f16w"}


def test_qmm_fma_variants_take_more_k_splits_on_small_grids():
    """The ``--fma`` sweep's GEMV configs for the shared expert's w2 (5120 x 2304, FP8; the default
    splits its 9 K steps in 3: 480 programs) include 9 splits (one step per program, 1,440 programs);
    none beyond 16 programs per SM, each a split that divides the K steps."""
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as S

    import pallas_kernels.quantized_matmul.benchmark as bq
    from dsv41_jax.quant import Fp8Tensor

    w = Fp8Tensor(S((5120, 2304), jnp.float8_e4m3fn), S((160, 72), jnp.float8_e8m0fnu), (32, 32))
    cfgs = bq.fma_variants(1, w)
    assert cfgs[0] == ("fma", 32, 8, 3, 4, 3) and ("fma", 32, 8, 9, 4, 3) in cfgs, cfgs
    assert all((5120 // c[1]) * c[3] <= 16 * 132 for c in cfgs), cfgs
    wo_b = Fp8Tensor(S((5120, 8192), jnp.float8_e4m3fn), S((160, 256), jnp.float8_e8m0fnu), (32, 32))
    splits = sorted({c[3] for c in bq.fma_variants(1, wo_b) if c[1:3] == (32, 8)})
    assert splits == [4, 8], splits  # 16 splits would be 2,560 programs


def test_device_time_op_finds_its_program():
    """The profiler-based timer runs end to end on the CPU backend: it finds the timed program in the
    trace and returns a positive, finite time per op (no timing ratios asserted: a loaded CI host
    makes them noise; the GPU numbers live in BENCHMARKS.md), and refuses too few argument sets."""
    import math

    import jax.numpy as jnp

    from pallas_kernels.benchmarking import device_time_op

    xs = [(jnp.full((128, 128), 0.01 * i),) for i in range(3)]
    t = device_time_op(lambda x: x @ x, xs, reps=3, iters=2)
    assert 0 < t and math.isfinite(t)
    with pytest.raises(AssertionError):
        device_time_op(lambda x: x @ x, xs[:2], reps=3, iters=1)


@pytest.mark.parametrize("counted", ["per_run", "one"])
def test_device_time_op_divides_by_runs_times_reps(monkeypatch, counted):
    """Time per op = the program's kernel time over the trace / (iters x reps), whether the profile
    counted each run (CPU) or saw one execution holding every run (GPU traces without execution ids,
    where the old division by the counted executions gave iters x the per-op time)."""
    import jax.numpy as jnp

    import dsv41_jax.profiling as prof
    from pallas_kernels.benchmarking import device_time_op

    iters, reps, total_ms = 4, 3, 6.0
    execs = iters if counted == "per_run" else 1
    fake = {"programs": [{"module": "jit__device_timed_reps", "executions": execs, "busy_ms": total_ms / execs},
                         {"module": "jit_flush_l2", "executions": iters, "busy_ms": 100.0}]}
    monkeypatch.setattr(prof, "summarize", lambda path, *a, **k: fake)
    monkeypatch.setattr(prof, "trace", lambda fn, outdir: (fn(), outdir))
    xs = [(jnp.full((8, 8), 0.5 + i),) for i in range(reps)]
    assert device_time_op(lambda x: x @ x, xs, reps=reps, iters=iters) == pytest.approx(total_ms / 1e3 / (iters * reps))


def test_moe_prefill_sweep_runs_in_interpret_mode(monkeypatch):
    """``moe.benchmark --prefill`` at a small shape (timing stubbed): the matmul ceiling and every
    tiling (the default and the candidates) are timed, each tiling checked against the reference and
    correct (kernels in interpret mode); then the route, plain and packing options, with the kernel
    replaced by :func:`_recording_moe_kernel` (each traced under its route; the kernels' own tests
    check every route and packing)."""
    import functools

    import pallas_kernels.moe.benchmark as bm

    for name, v in (("I", 64), ("D", 256), ("TOPK", 2)):
        monkeypatch.setattr(bm, name, v)
    timed = []
    monkeypatch.setattr(bm, "device_time_op", lambda f, args, *a, **k: timed.append(len(args)) or 1e-3)
    lines = []
    monkeypatch.setattr(bm, "log", lambda *a: lines.append(" ".join(map(str, a))))
    cfgs = [(16, 32, 64, 64, 32, 4), (32, 64, 64, 128, 64, 4, 2)]
    with monkeypatch.context() as m:
        m.setattr(bm.pallas_triton, "moe_experts", functools.partial(bm.pallas_triton.moe_experts, interpret=True))
        rows = bm.prefill_sweep(tokens=24, experts=4, configs=cfgs)
    assert [r["config"] for r in rows] == [None] + cfgs and all(r["ok"] for r in rows), \
        [(r["config"], r["rel_err"], r["frac_gt_1pct"]) for r in rows]
    assert len(timed) == 1 + len(rows) and all(r["tflops"] > 0 and r["ceiling_tflops"] > 0 for r in rows)
    assert lines[-1].startswith("# best:")
    # --mma-fp4 bytes,f16w: every tiling once per decode route, each checked and traced under its
    # route; the switch restored after
    calls = _recording_moe_kernel(monkeypatch, bm)
    rows = bm.prefill_sweep(tokens=24, experts=4, configs=cfgs[:1], routes=["bytes", "f16w"])
    assert [(r["route"], r["config"]) for r in rows] == [("bytes", None), ("bytes", cfgs[0]), ("f16w", None),
                                                          ("f16w", cfgs[0])]
    assert [(c["mma"], c["config"]) for c in calls] == [(r["route"], r["config"]) for r in rows]
    assert all(r["ok"] for r in rows) and bm.pallas_triton.MMA_FP4["route"] == "auto"
    # --plain: every tiling also on bf16 copies of the experts, checked against their own reference
    rows = bm.prefill_sweep(tokens=24, experts=4, configs=cfgs[:1], plain=True)
    assert [r["route"] for r in rows] == ["auto", "auto", "plain", "plain"] and all(r["ok"] for r in rows)
    # --packings nibbles,f16pairs: every tiling on both packings of the same codes, each checked
    rows = bm.prefill_sweep(tokens=24, experts=4, configs=cfgs[:1], packings=("nibbles", "f16pairs"))
    assert [(r["packing"], r["route"]) for r in rows] == [("nibbles", "auto")] * 2 + [("f16pairs", "auto")] * 2
    assert all(r["ok"] for r in rows)
    # --packings f16pairs --mma-fp4 auto,f16dots: the f16pairs experts once per route (session 44's call
    # ran only the default route: the routes applied to nibbles alone), each checked
    rows = bm.prefill_sweep(tokens=24, experts=4, configs=cfgs[:1], packings=("f16pairs",), routes=["auto", "f16dots"])
    assert [(r["packing"], r["route"]) for r in rows] == [("f16pairs", "auto")] * 2 + [("f16pairs", "f16dots")] * 2
    assert all(r["ok"] for r in rows) and bm.pallas_triton.MMA_FP4["route"] == "auto"
    with pytest.raises(SystemExit):
        bm.main(["--prefill", "--packings", "nibbles,f16"])


def test_moe_tc_only_sweep_times_each_route_and_extra_tiling(monkeypatch):
    """``moe.benchmark --fma --tc-only --mma-fp4 phases,f16dots --tc-configs ...`` at a small shape
    (interpret mode, timing stubbed): only tensor-core rows, the dispatch's tiling and the extra
    (swapped) tiling once per route, each checked against the reference and passing. The sweep's
    experts are marked f16_exact as the Engine marks the model's, so under f16dots and auto the
    dispatch's tiling is the swapped one (float16 phases take the weight tile first, session 44) and
    is timed once."""
    import functools

    import pallas_kernels.moe.benchmark as bm

    for name, v in (("E", 8), ("I", 128), ("D", 256), ("TOPK", 2)):
        monkeypatch.setattr(bm, name, v)
    monkeypatch.setattr(bm, "device_time_op", lambda *a, **k: 1e-6)
    monkeypatch.setattr(bm.pallas_triton, "moe_experts", functools.partial(bm.pallas_triton.moe_experts, interpret=True))
    monkeypatch.setattr(bm, "log", lambda *a: None)
    swapped = (16, 64, 256, 64, 128, 4, 3, 1)
    rows = bm.fma_sweep((4,), tc_only=True, mma_routes=["phases", "f16dots", "auto"], packings=("f16pairs",),
                        tc_configs=[swapped])
    assert all(r["config"][0] != "fma" for r in rows)
    assert sorted((r["mma_fp4"], r["config"] == swapped) for r in rows) == [
        ("auto", True), ("f16dots", True), ("phases", False), ("phases", True)]
    assert all(r["ok"] for r in rows), [(r["config"], r["mma_fp4"], r["rel_err"]) for r in rows]


def test_indexer_check_covers_every_decode_route(monkeypatch):
    """``lightning_indexer.benchmark``'s GPU check (small cases, interpret mode): every case passes
    with every MXFP4 decode route (words into bf16 phase dots, the same in float16, bytes, and the
    codes as stored into one MX dot), and a wrong word decode in either word route would fail it."""
    import functools

    import pallas_kernels.lightning_indexer.benchmark as bm
    from pallas_kernels.lightning_indexer import pallas_triton as pt

    monkeypatch.setattr(pt, "lightning_indexer", functools.partial(pt.lightning_indexer, interpret=True))
    lines = []
    assert bm.check(lines.append, cases=[(2, 1, 3000, True, False), (1, 2, 2500, False, True)])
    assert [ln.split("fp4_read=")[1].split(":")[0] for ln in lines] == ["phases", "f16phases", "bytes", "mx"] * 2, lines
    for name in ("fp4_word_pairs_f32", "fp4_word_pairs_f16"):
        real = getattr(pt, name)
        with monkeypatch.context() as m:
            m.setattr(pt, name, lambda w, real=real: [(lo, lo) for lo, _ in real(w)])  # codes j + 4 lost
            lines = []
            assert not bm.check(lines.append, cases=[(1, 1, 3000, True, False)])
            assert [("OK" in ln) for ln in lines] == [name.endswith("f16"), name.endswith("f32"), True, True], lines


def test_indexer_prefill_and_decode_topk_run_in_interpret_mode(monkeypatch, tmp_path):
    """``lightning_indexer.benchmark --prefill-model --decode-topk`` at small shapes (tile kernel in
    interpret mode, timing stubbed): every case of both tables runs, and the kernel's and the grouped
    top-k's positions equal the reference's in every row."""
    import json

    import pallas_kernels.lightning_indexer.benchmark as bm
    from pallas_kernels.lightning_indexer import pallas_triton_prefill as pf

    monkeypatch.setitem(bm.PREFILL_SHAPE, "rows", 64)
    monkeypatch.setitem(bm.PREFILL_SHAPE, "prompt", 256)
    monkeypatch.setattr(bm, "PREFILL_TILES", bm.PREFILL_TILES[:1])
    monkeypatch.setattr(bm, "DECODE_TOPK_ENTRIES", (8192,))
    monkeypatch.setattr(bm, "timed", lambda *a, **k: (1e-3, 0.0, 0.0))
    orig = pf.index_scores
    monkeypatch.setattr(pf, "index_scores", lambda *a, **k: orig(*a, **{**k, "interpret": True}))
    assert bm.main(["--prefill-model", "--decode-topk", "--out", str(tmp_path)]) == 0
    pre = json.loads((tmp_path / "lightning_indexer_prefill.json").read_text())["rows"]
    assert [r["tag"].split(" chunk")[0] for r in pre] == [
        "HI 32 ratio 1 Nc=258 last", "HI 32 ratio 1 Nc=258 middle", "HI 32 ratio 2 Nc=129 last",
        "HI 32 ratio 2 Nc=129 middle", "HI 64 ratio 4 Nc=64 last"]
    for r in pre:
        (t_p, t_ps, same_mask, err, same_rows), = [v for v in r.values() if isinstance(v, list)]
        assert same_mask and err < 1e-5 and same_rows == 1.0, r
    dec = json.loads((tmp_path / "lightning_indexer_decode_topk.json").read_text())
    assert dec["device"] and dec["jax"]
    dec = dec["rows"]
    assert len(dec) == 2 and all(r["same"] for r in dec)


def test_indexer_read_ab_runs_in_interpret_mode(monkeypatch, tmp_path):
    """``lightning_indexer.benchmark --read-ab`` at a small case (kernels in interpret mode, timing
    stubbed): every read timed in every round, in turn (pipeline, then score kernel), the median per
    read written, and the two reads pick the same top-k positions; a read name it does not know is
    refused with the flag."""
    import json

    import pallas_kernels.lightning_indexer.benchmark as bm
    from pallas_kernels.lightning_indexer import pallas_triton as pt

    monkeypatch.setattr(bm, "READ_AB_CASES", ((4096, 1),))
    calls = []
    monkeypatch.setattr(bm, "timed", lambda f, *a, **k: calls.append(f.__name__) or (len(calls) * 1e-6, 0.0, 0.0))
    orig_li, orig_bm = pt.lightning_indexer, pt.index_block_maxima
    monkeypatch.setattr(pt, "lightning_indexer", lambda *a, **k: orig_li(*a, **{**k, "interpret": True}))
    monkeypatch.setattr(pt, "index_block_maxima", lambda *a, **k: orig_bm(*a, **{**k, "interpret": True}))
    assert bm.main(["--read-ab", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert calls == ["whole", "op"] * 4  # the pipeline, then score_kernel_op's op
    rows = json.loads((tmp_path / "lightning_indexer_read_ab.json").read_text())["rows"]
    assert [r["read"] for r in rows] == ["phases", "f16phases"] and all(len(r["rounds"]) == 2 for r in rows)
    # the stub's times are the call numbers: phases 1, 5 (pipeline) and 2, 6 (score), f16phases 3, 7 and 4, 8
    assert [(r["pipeline_us"], r["score_us"]) for r in rows] == [(3.0, 4.0), (5.0, 6.0)]
    assert rows[0]["same_positions"] == 1.0 and rows[1]["same_positions"] >= 0.99  # the same products, sums in another order
    with pytest.raises(SystemExit):
        bm.main(["--read-ab", "--reads", "phases,f16", "--out", str(tmp_path)])


def test_indexer_path_ab_runs_in_interpret_mode(monkeypatch, tmp_path):
    """``lightning_indexer.benchmark --path-ab`` at small caches (kernels in interpret mode, device
    time stubbed to count each program's Pallas launches): the reference, the pipeline and the direct
    path timed per case, all three pick the reference's positions, and the direct path runs 2 Pallas
    launches where the pipeline runs more."""
    import json

    import jax

    import pallas_kernels.benchmarking as bmk
    import pallas_kernels.lightning_indexer.benchmark as bm
    from pallas_kernels.lightning_indexer import pallas_triton as pt

    monkeypatch.setattr(bm, "PATH_AB_CASES", ((300, 1), (2500, 2)))

    def fake_time(fn, inputs, *, reps, kernels):
        assert len(inputs) == reps
        kernels.extend(("k", 1e-6) for _ in range(str(jax.make_jaxpr(fn)(*inputs[0])).count("pallas_call[")))
        return 1e-6 * (1 + len(kernels))

    monkeypatch.setattr(bmk, "device_time_op", fake_time)
    orig_li = pt.lightning_indexer
    monkeypatch.setattr(pt, "lightning_indexer", lambda *a, **k: orig_li(*a, **{**k, "interpret": True}))
    assert bm.main(["--path-ab", "--reps", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "lightning_indexer_path_ab.json").read_text())["rows"]
    assert [(r["entries"], r["batch"]) for r in rows] == [(300, 1), (2500, 2)]
    for r in rows:
        assert r["reference_kernels"] == 0 and r["direct_kernels"] == 2 < r["pipeline_kernels"], r
        assert r["pipeline_same"] == r["direct_same"] == 1.0, r


def test_qmm_grouped_sweep_runs_in_interpret_mode(monkeypatch):
    """``quantized_matmul.benchmark --grouped`` at a small wo_a shape (interpret mode, timing stubbed):
    each row count's default and alternative configs are checked against the reference and pass."""
    import functools

    import pallas_kernels.quantized_matmul.benchmark as bq

    monkeypatch.setattr(bq, "WO_A", (4, 64, 512))
    monkeypatch.setattr(bq, "device_time_op", lambda *a, **k: 1e-6)
    monkeypatch.setattr(bq.pallas_triton, "grouped_matmul",
                        functools.partial(bq.pallas_triton.grouped_matmul, interpret=True))
    monkeypatch.setattr(bq, "log", lambda *a: None)
    rows = bq.grouped_sweep(__import__("jax").random.PRNGKey(0), rows_list=(1, 8), reps=2)
    assert {r["M"] for r in rows} == {1, 8} and len(rows) >= 6
    assert all(r["ok"] for r in rows), [(r["M"], r["config"], r["rel_err"]) for r in rows]


def test_qmm_finish_sweep_runs_in_interpret_mode(monkeypatch):
    """``quantized_matmul.benchmark --finish`` at small wq_a / wkv shapes (interpret mode, timing
    stubbed): the finish kernel, XLA's sum + norm and the reference, each checked, all pass."""
    import functools

    import pallas_kernels.quantized_matmul.benchmark as bq
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    monkeypatch.setattr(bq, "PROJECTIONS", [("wq_a", 160, 512), ("wkv", 64, 512)])
    monkeypatch.setattr(bq, "device_time_op", lambda *a, kernels=None, **k: kernels.append(("k", 1e-6)) or 1e-6)
    monkeypatch.setattr(bq.pallas_triton, "quantized_matmul_multi",
                        functools.partial(bq.pallas_triton.quantized_matmul_multi, interpret=True))
    monkeypatch.setattr(bq, "log", lambda *a: None)
    rows = bq.finish_sweep(__import__("jax").random.PRNGKey(0), rows_list=(1, 4), reps=2)
    assert [r["M"] for r in rows] == [1, 4]
    assert all(r["ok"] and {"finish_s", "xla_after_s", "reference_s"} <= set(r) for r in rows), rows


def test_qmm_pair_sweep_runs_in_interpret_mode(monkeypatch):
    """``quantized_matmul.benchmark --pair wq_b,idx_wq_b`` at small shapes (interpret mode, timing
    stubbed): the fused launch, one launch each and the reference, each checked, all pass; the fused
    variant runs one kernel, the separate one two; a bad pair is refused by name."""
    import functools

    import pallas_kernels.quantized_matmul.benchmark as bq
    from pallas_kernels.quantized_matmul import pallas_triton_fma as fma

    monkeypatch.setitem(fma.DECODE_GEMV, "qmm", "fma")
    monkeypatch.setattr(bq, "PROJECTIONS", [("wq_b", 256, 512), ("idx_wq_b", 64, 512), ("wo_b", 64, 256)])
    launches = []

    def fake_time(fn, args, shared, *, reps, kernels):
        import jax

        jaxpr = str(jax.make_jaxpr(fn)(*args[0], *shared))
        kernels.extend(("qmm", 1e-6) for _ in range(jaxpr.count("name=qmm_fma")))
        launches.append(len(kernels))
        return 1e-6

    monkeypatch.setattr(bq, "device_time_op", fake_time)
    for name in ("quantized_matmul_multi", "quantized_matmul"):
        monkeypatch.setattr(bq.pallas_triton, name, functools.partial(getattr(bq.pallas_triton, name), interpret=True))
    monkeypatch.setattr(bq, "log", lambda *a: None)
    rows = bq.pair_sweep(__import__("jax").random.PRNGKey(0), rows_list=(1, 4), reps=2)
    assert [r["M"] for r in rows] == [1, 4]
    assert all(r["ok"] and {"fused_s", "separate_s", "reference_s"} <= set(r) for r in rows), rows
    assert launches == [1, 2, 0] * 2, launches  # fused, separate, reference per row count
    with pytest.raises(ValueError, match="must share K"):
        bq.pair_sweep(__import__("jax").random.PRNGKey(0), names=("wq_b", "wo_b"), rows_list=(1,), reps=2)
    with pytest.raises(SystemExit):
        bq.main(["--pair", "wq_b,nope"])


def test_mhc_sweep_runs_in_interpret_mode(monkeypatch):
    """``mhc.benchmark --sweep`` at a small width (interpret mode, timing stubbed): every decode config
    of hc_mixes is checked against the reference (max abs err <= 1e-5), and the site is timed for both
    implementations."""
    import functools

    import pallas_kernels.mhc.benchmark as bm

    monkeypatch.setattr(bm, "D", 256)
    monkeypatch.setattr(bm, "SWEEP_CONFIGS", {1: [(1, 128, 2)], 8: [(1, 64, 4)]})
    monkeypatch.setattr(bm, "device_time_op", lambda *a, **k: 1e-6)
    for name in ("hc_mixes", "hc_collapse", "hc_expand"):
        monkeypatch.setattr(bm.pallas_triton, name, functools.partial(getattr(bm.pallas_triton, name), interpret=True))
    rows = bm.sweep(tokens=(1, 8), reps=2)
    mixes = [r for r in rows if r["op"] == "hc_mixes"]
    assert [(r["T"], r["config"]) for r in mixes][1::2] == [(1, (1, 128, 2)), (8, (1, 64, 4))]
    assert len(mixes) == 4 and all(r["err"] <= 1e-5 for r in mixes), mixes
    assert sum(r["op"] == "mhc_site" for r in rows) == 4


def test_qmm_prefill_sweep_runs_in_interpret_mode(monkeypatch):
    """``quantized_matmul.benchmark --prefill`` at a small shape (interpret mode, timing stubbed): the
    default tiled config and an alternative, for V4.1's 32x32 and V4's 128x128 weight blocks, are
    checked against the reference and pass; the ceiling and XLA rows are timed."""
    import functools

    import pallas_kernels.quantized_matmul.benchmark as bq

    monkeypatch.setattr(bq, "PROJECTIONS", [("wo_b", 256, 256)])
    timed = []
    monkeypatch.setattr(bq, "device_time_op", lambda *a, **k: timed.append(1) or 1e-6)
    monkeypatch.setattr(bq.pallas_triton, "quantized_matmul",
                        functools.partial(bq.pallas_triton.quantized_matmul, interpret=True))
    monkeypatch.setattr(bq, "log", lambda *a: None)
    rows = bq.prefill_sweep(__import__("jax").random.PRNGKey(0), m=128, names=("wo_b",),
                            configs=[(64, 128, 64, 1, 4, 3)], reps=2)
    assert [(r["block"], r["config"]) for r in rows] == [
        ((32, 32), (128, 128, 64, 1, 8, 3)), ((32, 32), (64, 128, 64, 1, 4, 3)),
        ((128, 128), (128, 128, 64, 1, 8, 3)), ((128, 128), (64, 128, 64, 1, 4, 3))]
    assert all(r["ok"] for r in rows), [(r["block"], r["config"], r.get("rel_err"), r.get("error")) for r in rows]
    assert len(timed) == 2 * (2 + 2)  # per block: XLA, ceiling, two configs
    # with mma8: the 32x32 block also runs each config in the mma8 scale mode, checked like the others,
    # and the switch is restored afterwards
    timed.clear()
    rows = bq.prefill_sweep(__import__("jax").random.PRNGKey(1), m=128, names=("wo_b",),
                            configs=[(64, 128, 64, 1, 4, 3)], reps=2, mma8=True)
    assert [(r["block"], r["mode"]) for r in rows] == [
        ((32, 32), "expand"), ((32, 32), "expand"), ((32, 32), "mma8"), ((32, 32), "mma8"),
        ((128, 128), "expand"), ((128, 128), "expand")]
    assert all(r["ok"] for r in rows), [(r["block"], r["mode"], r.get("rel_err"), r.get("error")) for r in rows]
    assert bq.pallas_triton.SCALE_MODE["fp8"] == "expand"


def test_moe_fma_sweep_packings_and_phase_route(monkeypatch):
    """``moe.benchmark --fma --mma-fp4 bytes,phases --packings nibbles,f16pairs``: the tensor-core default
    tiling per route and packing (f16pairs on the word route takes 64-wide K tiles, on the phase
    route the 256-wide ones) and the fma configs once per packing, each checked."""
    import functools

    import pallas_kernels.moe.benchmark as bm

    for name, v in (("E", 8), ("I", 256), ("D", 256), ("TOPK", 2)):
        monkeypatch.setattr(bm, name, v)
    monkeypatch.setattr(bm, "device_time_op", lambda *a, **k: 1e-6)
    monkeypatch.setattr(bm.pallas_triton, "moe_experts", functools.partial(bm.pallas_triton.moe_experts, interpret=True))
    monkeypatch.setattr(bm, "log", lambda *a: None)
    monkeypatch.setattr(bm, "fma_configs", lambda w1, n, wide: [])
    monkeypatch.setattr(bm.pallas_triton, "default_fma_config", lambda *a, **k: ("fma", 1, 16, 8, 64, 8, 4, 3))
    rows = bm.fma_sweep((1,), default_only=True, packings=("nibbles", "f16pairs"), mma_routes=["bytes", "phases"])
    tc = [(r["packing"], r["mma_fp4"], r["config"][2]) for r in rows if r["config"][0] != "fma"]
    assert tc == [("nibbles", "bytes", 256), ("nibbles", "phases", 256), ("f16pairs", "bytes", 64),
                  ("f16pairs", "phases", 256)], tc
    fma = {pk: [r["config"] for r in rows if r["config"][0] == "fma" and r["packing"] == pk] for pk in ("nibbles", "f16pairs")}
    assert fma["nibbles"] == fma["f16pairs"] and fma["nibbles"]
    assert all(r["ok"] for r in rows), [(r["packing"], r["config"], r["rel_err"]) for r in rows if not r["ok"]]


def test_sparse_attention_model_like_prefill_inputs():
    """``sparse_attention.benchmark.make_prefill_inputs`` lays out a first prefill chunk as the model
    does: window rows in concat(ring, chunk) named by the model's own lists (valid first), and per
    query the min(kc, (p + 1) // ratio) visible compressed picks, ascending, then -1; the reference op
    and the Pallas kernel (interpret mode) take them and agree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.sparse_attention import pallas_triton, reference
    from pallas_kernels.sparse_attention.benchmark import make_prefill_inputs

    s, ratio, window, kc = 48, 2, 16, 8
    q, win, widx, sink, ck, cidx = make_prefill_inputs(jax.random.PRNGKey(np.random.randint(1 << 30)), s, ratio,
                                                       window=window, kc=kc, h=16, d=64)
    assert q.shape == (1, s, 16, 64) and win.data.shape == (1, window + s, 64) and ck.data.shape == (1, s // ratio, 32)
    widx, cidx = np.asarray(widx[0]), np.asarray(cidx[0])
    for p in range(s):
        want = np.arange(max(p - window + 1, 0), p + 1) + window  # chunk rows after the empty ring
        assert list(widx[p][:len(want)]) == list(want) and (widx[p][len(want):] == -1).all()
        n = min(kc, (p + 1) // ratio)
        picks = cidx[p][:n]
        assert (np.diff(picks) > 0).all() and (picks < (p + 1) // ratio).all() and (cidx[p][n:] == -1).all()
    args = (q, win, jnp.asarray(widx)[None], sink)
    kw = dict(scale=0.125, comp_kv=ck, comp_idx=jnp.asarray(cidx)[None])
    want = np.asarray(reference.sparse_attention(*args, **kw), np.float32)
    got = np.asarray(pallas_triton.sparse_attention(*args, **kw, interpret=True), np.float32)
    assert np.isfinite(want).all() and np.abs(got - want).max() <= 2 ** -6 * np.abs(want).max()


def test_qmm_read_ceiling_sweep_runs_in_interpret_mode(monkeypatch, capsys):
    """``quantized_matmul.benchmark --read-ceiling`` at small shapes (interpret mode, timing stubbed):
    every read variant is checked against XLA's word sums and timed; a projection row has the GEMV
    time, a stream row none; the walk is the GEMV's default config; bad --names / --read-sizes are
    refused by name."""
    import functools

    import pallas_kernels.quantized_matmul.benchmark as bq
    from pallas_kernels import read_ceiling as rc

    monkeypatch.setattr(bq, "PROJECTIONS", [("wq_b", 64, 512)])
    timed = []
    monkeypatch.setattr(bq, "device_time_op", lambda fn, args, *a, **k: timed.append(len(args)) or 1e-6)
    monkeypatch.setattr(bq.pallas_triton, "quantized_matmul",
                        functools.partial(bq.pallas_triton.quantized_matmul, interpret=True))
    monkeypatch.setattr(rc, "stream_read", functools.partial(rc.stream_read, interpret=True))
    monkeypatch.setattr(bq, "log", lambda *a: None)
    rows = bq.read_ceiling_sweep(__import__("jax").random.PRNGKey(0), names=("wq_b",), sizes_mb=(0.1,), reps=3)
    assert [r["case"] for r in rows] == ["wq_b", "stream 0.1 MB"] and not any("error" in r for r in rows), rows
    assert "gemv_s" in rows[0] and "gemv_s" not in rows[1]
    assert all(r["walk"] == list(r["best_read"]) or r["walk_s"] >= r["best_read_s"] for r in rows)
    assert all(len(r["reads_s"]) >= 4 for r in rows) and all(n == 3 for n in timed), timed
    for bad, why in ((["--names", "wq_x"], "--names wq_x"), (["--read-sizes", "1,a"], "--read-sizes 1,a"),
                     (["--read-sizes", "0"], "must be positive")):
        with pytest.raises(SystemExit):
            bq.main(["--read-ceiling", *bad])
        assert why in capsys.readouterr().err
