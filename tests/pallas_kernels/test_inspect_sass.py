"""pallas_kernels.inspect_sass: the Triton IR capture (CPU lowering for cuda), the SASS and AMDGCN
loop parsers and the error without triton. (The SASS compile itself needs the optional triton package; its
output for the fma kernels is quoted in BENCHMARKS.md, session 7.)"""

import builtins

import pytest

from pallas_kernels import inspect_sass


def test_captures_each_kernels_triton_ir():
    from jax._src.pallas.triton import lowering

    import pallas_kernels.triton_compat  # noqa: F401  (its patches, applied once at import, come first)

    before = lowering.lower_jaxpr_to_triton_module
    fn, *specs = inspect_sass._cases("moe")
    ks = inspect_sass.triton_kernels(fn, *specs)
    # the decode MoE at one token: x's act-quant prologue (DSV41_MOE_ACT_QUANT default), the split
    # gate/up kernel, its finish (h's act-quant prologue), the down kernel
    assert [k["name"] for k in ks] == ["fma_act_quant", "moe_gate_up_fma_fp4", "moe_gate_up_finish", "moe_down_fma_fp4"]
    for k in ks:
        assert "tt.func" in k["ttir"] and f"@{k['name']}" in k["ttir"]
        if k["name"].startswith("moe_") and k["name"] != "moe_gate_up_finish":
            assert (k["num_warps"], k["num_stages"]) == (4, 3)
    assert lowering.lower_jaxpr_to_triton_module is before  # the capture is undone


def test_sparse_attn_case_takes_two_pass_tiles():
    """``sparse-attn --config "{'two_pass': {...}}"``: the two-pass kernels with those tiles at any row
    count (64 rows, where 'auto' would not pick them); other configs stay the flash kernel's keywords."""
    fn, *specs = inspect_sass._cases("sparse-attn", tokens=64, config={"two_pass": {"dv": 128}})
    ks = inspect_sass.triton_kernels(fn, *specs)
    assert [k["name"] for k in ks] == ["sparse_attention_logits", "sparse_attention_pv"]
    fn, *specs = inspect_sass._cases("sparse-attn", tokens=64, config={"block_h": 32})
    assert [k["name"] for k in inspect_sass.triton_kernels(fn, *specs)] == ["sparse_attention_sink"]


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LOP3.LUT R6, R4, 0x80008000, RZ, 0xc0, !PT ;
        /*0030*/                   HADD2.F32 R7, -RZ, R6.H0_H0 ;
        /*0040*/                   FFMA R8, R7, R9, R8 ;
        /*0050*/                   FFMA R8, R7, R10, R8 ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
.L_x_1:
        /*0080*/                   BRA `(.L_x_1);
"""


def test_loop_mix_counts_the_loop_body():
    (lp,) = inspect_sass.loop_mix(SASS)  # the trailing self-branch is not a loop
    assert lp["label"] == ".L_x_0" and lp["total"] == 6
    assert lp["counts"] == {"LDG": 1, "LOP3": 1, "HADD2": 1, "FFMA": 2, "BRA": 1}


GCN = """
	s_branch .LBB0_1
.LBB0_1:                                ; %outer
	v_mov_b32_e32 v0, 0
.LBB0_2:                                ; =>This Inner Loop Header: Depth=1
	global_load_dwordx4 v[4:7], v[2:3], off
	s_waitcnt vmcnt(0)
	v_and_b32_e32 v8, 0x8e008e00, v4
	v_pk_fma_f16 v9, v8, v10, v9
	v_pk_fma_f16 v9, v8, v11, v9
	s_add_i32 s4, s4, 1
	s_cmp_lg_u32 s4, 10
	s_cbranch_scc1 .LBB0_2
; %bb.3:
	s_endpgm
	.section	.AMDGPU.csdata
; Kernel info:
; NumVgprs: 81
; NumAgprs: 0
; ScratchSize: 0
; Occupancy: 5
"""


GCN_LATCH = """
	s_branch .LBB0_4
.LBB0_3:                                ;   in Loop: Header=BB0_4 Depth=1
	s_add_i32 s4, s4, 1
	s_cmp_lg_u32 s4, 10
	s_cbranch_scc0 .LBB0_6
.LBB0_4:                                ; =>This Inner Loop Header: Depth=1
	global_load_dwordx4 v[4:7], v[2:3], off
	v_mfma_scale_f32_32x32x64_f8f6f4 v[0:15], v[4:11], v[12:19], v[0:15], v20, v21
	s_cbranch_execz .LBB0_3
; %bb.5:                                ;   in Loop: Header=BB0_4 Depth=1
	v_max_f32_e32 v30, v31, v30
	s_branch .LBB0_3
.LBB0_6:                                ; %.loopexit
	s_endpgm
"""


def test_gcn_loop_mix_counts_the_loop_body():
    """The AMDGCN parser (gfx950, MI350X): the LLVM-marked loop header and every block marked as in its
    loop -- a latch placed before the header and an unlabelled block included, the exit left out."""
    (lp,) = inspect_sass.gcn_loop_mix(GCN)
    assert lp["label"] == ".LBB0_2" and lp["total"] == 8
    assert lp["counts"] == {"global_load_dwordx4": 1, "s_waitcnt": 1, "v_and_b32_e32": 1, "v_pk_fma_f16": 2,
                            "s_add_i32": 1, "s_cmp_lg_u32": 1, "s_cbranch_scc1": 1}
    (lp,) = inspect_sass.gcn_loop_mix(GCN_LATCH)
    assert lp["label"] == ".LBB0_4" and lp["total"] == 8
    assert lp["counts"] == {"s_add_i32": 1, "s_cmp_lg_u32": 1, "s_cbranch_scc0": 1, "global_load_dwordx4": 1,
                            "v_mfma_scale_f32_32x32x64_f8f6f4": 1, "s_cbranch_execz": 1, "v_max_f32_e32": 1,
                            "s_branch": 1}
    r = inspect_sass.gcn_resources(GCN)
    assert (r["vgprs"], r["agprs"], r["scratch"], r["occupancy"], r["lds"]) == (81, 0, 0, 5, -1)
    assert inspect_sass.gcn_resources(f"{inspect_sass.GCN_RESOURCES} lds=16384\n" + GCN)["lds"] == 16384


@pytest.mark.parametrize("compile_fn", ["compile_sass", "compile_amdgcn"])
def test_compile_without_triton_names_the_fix(monkeypatch, compile_fn):
    real_import = builtins.__import__

    def no_triton(name, *a, **k):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    with pytest.raises(RuntimeError, match="pip install triton"):
        getattr(inspect_sass, compile_fn)("module {}", 4, 3)


def test_prefill_case_takes_its_config():
    """--tokens / --experts / --config reach the lowering: the prefill-size MoE runs the tensor-core
    kernels with the given warps; a malformed --config is refused by argparse, naming the flag."""
    fn, *specs = inspect_sass._cases("moe", tokens=256, experts=8, config=(64, 128, 64, 128, 64, 8))
    ks = inspect_sass.triton_kernels(fn, *specs)
    assert [k["name"] for k in ks] == ["moe_gate_up_fp4", "moe_down_fp4"]
    assert all(k["num_warps"] == 8 for k in ks)
    with pytest.raises(SystemExit):
        inspect_sass.main(["moe", "--config", "(1, 2"])


def test_resources_line_gives_programs_per_sm():
    """compile_sass' first line (registers from cuobjdump, shared bytes from Triton's metadata) ->
    programs per sm_90 SM by registers (allocated per warp in units of 256), shared memory and warps."""
    r = inspect_sass.resources(f"{inspect_sass.RESOURCES} regs=255 shared=73728\n" + SASS, num_warps=4)
    assert (r["by_regs"], r["by_shared"], r["by_warps"], r["programs_per_sm"]) == (2, 3, 16, 2)
    r = inspect_sass.resources(f"{inspect_sass.RESOURCES} regs=128 shared=61440\n", num_warps=4)
    assert (r["by_regs"], r["by_shared"], r["programs_per_sm"]) == (4, 3, 3)
    r = inspect_sass.resources(f"{inspect_sass.RESOURCES} regs=-1 shared=1024\n", num_warps=8)
    assert "by_regs" not in r and r["programs_per_sm"] == 8  # no register count: warps and shared memory only
    assert inspect_sass.resources(SASS, num_warps=4) is None


def test_sparse_attention_case_takes_keyword_config():
    """The sparse-attn case lowers the decode kernel with its keyword overrides; a tuple --config for
    it (or a dict for the MoE) is refused by argparse."""
    fn, *specs = inspect_sass._cases("sparse-attn", tokens=2, config={"block_h": 32, "num_warps": 4})
    ks = inspect_sass.triton_kernels(fn, *specs)
    assert [k["name"] for k in ks] == ["sparse_attention_sink"] and ks[0]["num_warps"] == 4
    for argv in (["sparse-attn", "--config", "(1, 2)"], ["moe", "--config", "{'block_h': 32}"]):
        with pytest.raises(SystemExit):
            inspect_sass.main(argv)


def test_indexer_case_lowers_the_decode_pipeline():
    """The indexer case lowers the streaming decode pipeline at 1M entries (score kernel, candidate
    rescoring, selects) with its keyword config; a tuple --config for it is refused."""
    fn, *specs = inspect_sass._cases("indexer", tokens=1, config={"score_warps": 4})
    ks = inspect_sass.triton_kernels(fn, *specs)
    names = [k["name"] for k in ks]
    assert names[0] == "indexer_block_maxima" and ks[0]["num_warps"] == 4
    assert {"indexer_select_topk", "indexer_candidate_scores"} <= set(names)
    with pytest.raises(SystemExit):
        inspect_sass.main(["indexer", "--config", "(1, 2)"])


def test_mhc_case_lowers_a_decode_site():
    """The mhc case lowers a V4.1 decode site: the expansion fused with the next site's collapse,
    mixes and norm, then the one-warp split kernel whose partial sums (80 K splits, 5 groups of 16)
    are loaded unrolled (one load per group and array in the Triton IR, no loop around them)."""
    fn, *specs = inspect_sass._cases("mhc", tokens=1)
    ks = {k["name"]: k for k in inspect_sass.triton_kernels(fn, *specs)}
    assert set(ks) == {"hc_expand_mix", "hc_mixes_split_norm"}
    split = ks["hc_mixes_split_norm"]
    assert split["num_warps"] == 1
    assert split["ttir"].count("tt.load") >= 3 * 5 and split["ttir"].count("scf.for") == 1  # the Sinkhorn loop


def test_mhc_moe_case_loads_everything_before_the_first_store():
    """The FFN-side site with the MoE's deferred pieces (6 slot rows, their index, 3 w2 parts): the
    expansion kernel's default (EXPAND_MIX: every load first, 2 warps; 6.55 -> 3.62 us on the H200,
    session 27) has no load after its first store in the Triton IR."""
    fn, *specs = inspect_sass._cases("mhc-moe", tokens=1)
    ks = {k["name"]: k for k in inspect_sass.triton_kernels(fn, *specs)}
    mix = ks["hc_expand_mix"]
    assert mix["num_warps"] == 2
    lines = mix["ttir"].splitlines()
    first_store = min(i for i, line in enumerate(lines) if "tt.store" in line)
    loads = [i for i, line in enumerate(lines) if "tt.load" in line]
    # Pallas lowers each store as a swap, whose old-value load sits right before its store
    assert sum(i < first_store for i in loads) >= 6 + 6 + 3 + 4
    assert all(i < first_store or "tt.store" in lines[i + 1] for i in loads)


def test_route_and_kv_write_cases_lower():
    """The route case (the router's selection: one warp, one (value, index) reduction per round, no
    sort) and the kv-write case (one program per row storing into the aliased ring) lower to one
    kernel each with their Triton IR captured."""
    fn, *specs = inspect_sass._cases("route", tokens=1, experts=384)
    (k,) = inspect_sass.triton_kernels(fn, *specs)
    assert k["name"] == "moe_route_select" and k["num_warps"] == 1 and "tt.reduce" in k["ttir"]
    fn, *specs = inspect_sass._cases("kv-write", tokens=2)
    (k,) = inspect_sass.triton_kernels(fn, *specs)
    assert k["name"] == "window_kv_write" and k["ttir"].count("tt.store") == 2


def test_qnorm_case_lowers():
    """The qnorm case (wq_a + wkv with q_norm at 4 rows): the fused GEMV writing its K parts, then the
    split-K finish kernel, which stores 1280 / 512 = 5 + 1 chunks per output row with no mask."""
    from pallas_kernels import lowering_census as lc

    fn, *specs = inspect_sass._cases("qnorm", tokens=4)
    ks = {k["name"]: k for k in inspect_sass.triton_kernels(fn, *specs)}
    assert set(ks) == {"qmm_fma_fp8_x2", "qmm_split_finish"}
    fin = lc.count(ks["qmm_split_finish"]["ttir"])
    assert fin["ops"]["tt.store"] == 6 and fin["masked_stores"] == 0 and fin["masked_loads"] == 0


@pytest.mark.parametrize("mx", ["on", "off"])
def test_mx_flag_reaches_the_lowering(monkeypatch, capsys, mx):
    """--mx sets DSV41_MX_DOT for the run: with "on" the tiled GEMM (gemv at 4,096 rows) is lowered as on
    gfx950, one tt.dot_scaled a K tile, whatever the target; the compile step is stubbed here."""
    from pallas_kernels import scaled_dot

    seen = []
    monkeypatch.setattr(scaled_dot, "MX_DOT", scaled_dot.MX_DOT)  # restored after the test
    monkeypatch.setattr(inspect_sass, "compile_amdgcn", lambda ttir, w, s: seen.append(ttir) or "")
    assert inspect_sass.main(["gemv", "--tokens", "4096", "--mx", mx, "--target", "rocm"]) == 0
    assert len(seen) == 1 and ("tt.dot_scaled" in seen[0]) == (mx == "on")
    assert ("qmm_fp8_mx" in capsys.readouterr().out) == (mx == "on")
