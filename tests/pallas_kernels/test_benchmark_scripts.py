"""The H200 benchmark scripts stay runnable: every one parses its flags, and the MoE localisation
tool (``--debug``) runs end to end at a small shape in interpret mode, where the kernels are exact
(so every error it reports must be 0, in both h act-quant placements)."""

import importlib

import pytest

OPS = ["quantized_matmul", "moe", "mhc", "sparse_attention", "lightning_indexer"]


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
