"""The ncu driver (pallas_kernels/ncu_targets.py): every target lowers for cuda on the CPU with the
dispatch's default kernels, and bad arguments are refused with a message."""

import pytest

from pallas_kernels import ncu_targets


@pytest.mark.parametrize("target,ops,calls", [("moe8", 1, 4), ("gemv", 3, 1), ("wqb", 1, 1)])
def test_targets_lower_for_cuda(target, ops, calls, capsys):
    assert ncu_targets.main([target, "--lower-only"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # the fused MoE at one token: act-quant prologue, gate/up, its split finish, down; one GEMV each
    assert len(lines) == ops
    assert all(line.endswith(f"{calls} Triton calls") for line in lines), lines


def test_unknown_target_and_bad_calls_are_refused(capsys):
    with pytest.raises(ValueError, match="unknown target 'mhc'"):
        ncu_targets.cases("mhc")
    with pytest.raises(SystemExit):
        ncu_targets.main(["wqb", "--calls", "0"])
    assert "--calls must be at least 1" in capsys.readouterr().err
