"""The one place that picks reference vs kernel (``pallas_kernels.dispatch``): precedence, and
per-op entries in ``DSV41_KERNELS`` (e.g. ``auto,mhc=reference``, for runs that put single ops
back on their XLA reference)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.quant import quantize_fp8
from pallas_kernels import dispatch
from pallas_kernels.mhc import api as mhc_api
from pallas_kernels.quantized_matmul import api as qmm_api


def test_parse_kernels_env():
    assert dispatch.parse_kernels_env("auto") == ("auto", {})
    d, per = dispatch.parse_kernels_env("pallas, mhc=reference, moe_experts=interpret")
    assert d == "pallas" and per == {"hc_mixes": "reference", "hc_collapse": "reference", "hc_expand": "reference",
                                     "hc_expand_collapse": "reference", "hc_expand_collapse_mixes": "reference",
                                     "moe_experts": "interpret"}
    assert dispatch.parse_kernels_env("quantized_matmul=interpret") == ("auto", {"quantized_matmul": "interpret"})
    with pytest.raises(ValueError, match="unknown op 'mlp'"):
        dispatch.parse_kernels_env("auto,mlp=pallas")
    with pytest.raises(ValueError, match="unknown kernel implementation 'fast'"):
        dispatch.parse_kernels_env("mhc=fast")


def test_per_op_entries_pick_per_op(monkeypatch):
    """``reference,quantized_matmul=interpret``: the weight GEMM runs its (interpret-mode) kernel, the
    mHC ops their references; an explicit argument and use_implementation() still win."""
    monkeypatch.setenv("DSV41_KERNELS", "reference,quantized_matmul=interpret")
    w = quantize_fp8(jnp.asarray(np.random.default_rng().normal(size=(64, 256)) * 0.05, jnp.float32))
    x = jnp.ones((2, 256), jnp.float32)
    assert qmm_api.uses_kernel(x, w)
    assert dispatch.resolve(None, "hc_mixes") == "reference" and dispatch.resolve(None, "quantized_matmul") == "interpret"
    assert not qmm_api.uses_kernel(x, w, implementation="reference")
    with dispatch.use_implementation("reference"):
        assert not qmm_api.uses_kernel(x, w)
    monkeypatch.setenv("DSV41_KERNELS", "interpret,mhc=reference")
    h = jnp.asarray(np.random.default_rng().normal(size=(1, 4, 64)), jnp.float32)
    pre = jnp.full((1, 4), 0.25, jnp.float32)
    kernel, _ = dispatch.choose("hc_collapse", None, mhc_api._kernel, lambda k: k.collapse_reason(h, pre))
    assert kernel is None  # the reference, by the per-op entry
    assert qmm_api.uses_kernel(x, w)  # the default entry: interpret
