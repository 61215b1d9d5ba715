"""dsv41_jax.profiling: device time per program and per model part (named scope) from a trace."""

import jax
import jax.numpy as jnp

from dsv41_jax.profiling import format_report, part_of, summarize, trace


def test_part_of_takes_the_most_specific_scope():
    assert part_of("jit(step)/jit(main)/attention/indexer/dot_general") == "indexer"
    assert part_of("jit(step)/moe/routed_experts/pallas_call") == "routed_experts"
    assert part_of("jit(step)/attention/add") == "attention"
    assert part_of("jit(step)/transpose") == "other"
    assert part_of("") == "other"


def test_summarize_splits_programs_and_parts(tmp_path):
    @jax.jit
    def f(x):
        with jax.named_scope("moe"):
            y = jnp.sin(x) @ x
        with jax.named_scope("head"):
            return jnp.tanh(y) @ y

    @jax.jit
    def g(x):
        with jax.named_scope("engram"):
            return jnp.cos(x) * 2.0

    x = jax.random.normal(jax.random.PRNGKey(0), (256, 256))
    texts = {"jit_f": f.lower(x).compile().as_text(), "jit_g": g.lower(x).compile().as_text()}
    f(x).block_until_ready(), g(x).block_until_ready()

    def run():
        outs = [f(x) for _ in range(3)] + [g(x) for _ in range(2)]
        return outs

    _, path = trace(run, str(tmp_path))
    rep = summarize(path, hlo_texts=texts)
    progs = {p["module"]: p for p in rep["programs"]}
    assert progs["jit_f"]["executions"] == 3 and progs["jit_g"]["executions"] == 2
    assert set(progs["jit_f"]["parts_ms"]) == {"moe", "head"}
    assert all(v > 0 for v in progs["jit_f"]["parts_ms"].values())
    assert set(progs["jit_g"]["parts_ms"]) == {"engram"}
    assert abs(sum(progs["jit_f"]["parts_ms"].values()) - progs["jit_f"]["busy_ms"]) < 1e-9
    # f has at least its two matmuls per execution; the kernel count is a per-execution figure
    f_kernels = sum(k["launches"] for k in progs["jit_f"]["kernels"])
    assert abs(sum(progs["jit_f"]["parts_launches"].values()) - progs["jit_f"]["launches"]) < 1e-9
    assert progs["jit_f"]["launches"] >= 2 and abs(progs["jit_f"]["launches"] - f_kernels) < 1e-9
    if progs["jit_f"]["span_ms"] is not None:  # an execution's span covers at least its kernels' busy time
        assert progs["jit_f"]["span_ms"] > 0
    text = format_report(rep)
    assert "jit_f" in text and "moe" in text


def test_set_executions_rescales_totals():
    from dsv41_jax.profiling import set_executions

    prog = {"executions": 1, "busy_ms": 40.0, "parts_ms": {"moe": 30.0, "head": 10.0}, "launches": 130.0,
            "kernels": [{"kernel": "k", "ms": 30.0, "launches": 120.0, "hlo": ""}]}
    set_executions(prog, 10)
    assert prog["executions"] == 10 and prog["busy_ms"] == 4.0
    assert prog["parts_ms"] == {"moe": 3.0, "head": 1.0} and prog["launches"] == 13.0
    assert prog["kernels"][0]["ms"] == 3.0 and prog["kernels"][0]["launches"] == 12.0


def test_kernel_events_map_by_kernel_name():
    """A Pallas-Triton kernel is found under its backend-config name (escaped or not, with the
    ``__N`` suffix the runtime adds to tell kernels of one name apart), and a fusion's kernel under
    its own name when the event's HLO op is something else (e.g. a command buffer)."""
    from dsv41_jax.profiling import lookup, parse_hlo_text

    text = "\n".join([
        '  %fusion.7 = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop, metadata={op_name="jit(s)/attention/indexer/add"}',
        '  %custom-call.3 = bf16[16,64]{1,0} custom-call(bf16[16,64]{1,0} %a), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(s)/moe/routed_experts/pallas_call"}, backend_config={"name":"moe_gate_up_fp4","ir":"x"}',
        '  %custom-call.4 = bf16[1,64]{1,0} custom-call(bf16[1,64]{1,0} %b), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(s)/attention/pallas_call"}, backend_config="{\\"name\\":\\"qmm_fp8\\",\\"ir\\":\\"y\\"}"',
    ])
    t = parse_hlo_text(text)
    assert lookup(t, "command_buffer.1", "fusion_7")[0].endswith("indexer/add")
    assert "routed_experts" in lookup(t, "?", "moe_gate_up_fp4")[0]
    assert lookup(t, "?", "qmm_fp8__4")[0] == "jit(s)/attention/pallas_call"
    assert lookup(t, "custom-call.3", "whatever")[0] == "jit(s)/moe/routed_experts/pallas_call"
    assert lookup(t, "nothing", "unknown_kernel") == ("", "")


def test_a_kernel_name_shared_by_parts_is_marked_ambiguous():
    """Calls of one kernel name in several model parts (the FP8 GEMV in attention and Engram) map to
    "attention+engram", not to whichever call the HLO lists first; one part stays that part."""
    from dsv41_jax.profiling import lookup, parse_hlo_text

    def call(n, scope, name):
        return (f'  %custom-call.{n} = bf16[1,64]{{1,0}} custom-call(bf16[1,64]{{1,0}} %a), '
                f'custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(s)/{scope}/pallas_call"}}, '
                f'backend_config={{"name":"{name}","ir":"x"}}')

    t = parse_hlo_text("\n".join([call(1, "engram", "qmm_fma_fp8"), call(2, "attention", "qmm_fma_fp8"),
                                  call(3, "attention", "qmm_fma_fp8"), call(4, "moe/shared_expert", "qmm_fma_fp8"),
                                  call(5, "attention/wo_a", "qmm_fma_fp8_grouped"),
                                  call(6, "attention/wo_a", "qmm_fma_fp8_grouped")]))
    assert part_of(lookup(t, "command_buffer.1", "qmm_fma_fp8__2")[0]) == "attention+engram+shared_expert"
    assert part_of(lookup(t, "?", "qmm_fma_fp8_grouped")[0]) == "wo_a"
    assert part_of(lookup(t, "custom-call.1", "qmm_fma_fp8")[0]) == "engram"  # its own HLO op: exact
