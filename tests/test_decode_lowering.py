"""The tiny model's decode forward (batch 1, one token) lowered for cuda on the CPU with the kernels
plain ``auto`` runs on a GPU: no kernel reads another kernel's output through an XLA slice where
the kernels could hand it over whole. XLA materializes such a slice before the consumer (a device
copy when contiguous): session 25 found the mHC mixes' pre / post columns as 160 of the batch-1
step's 170 copies (0.17 ms). ``sliced_kernel_operands`` is checked on a hand-written program too."""

import re

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.testing import lower_for, sliced_kernel_operands

PROGRAM = '''
  func.func public @main(%arg0: tensor<1x16xf32>) -> tensor<1x4xf32> {
    %0:2 = stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0) {name = "producer"} : (tensor<1x16xf32>) -> (tensor<1x16xf32>, tensor<1x16xf32>)
    %1 = stablehlo.slice %0#0 [0:1, 4:8] : (tensor<1x16xf32>) -> tensor<1x4xf32>
    %2 = stablehlo.reshape %1 : (tensor<1x4xf32>) -> tensor<4xf32>
    %3 = sdy.sharding_constraint %2 <@mesh, [{}]> : tensor<4xf32>
    %4 = stablehlo.slice %arg0 [0:1, 0:4] : (tensor<1x16xf32>) -> tensor<1x4xf32>
    %5 = stablehlo.custom_call @__gpu$xla.gpu.triton(%4, %3) {name = "consumer"} : (tensor<1x4xf32>, tensor<4xf32>) -> tensor<1x4xf32>
    return %5 : tensor<1x4xf32>
  }
'''


def test_sliced_kernel_operands_finds_a_slice_between_kernels():
    """Operand 1 of 'consumer' is a slice (through a reshape and a sharding constraint) of
    'producer''s first result; operand 0 slices an argument, which XLA fuses elsewhere: not listed."""
    assert sliced_kernel_operands(PROGRAM) == [
        "consumer operand 1: stablehlo.slice  [0:1, 4:8] : (tensor<1x16xf32>) -> tensor<1x4xf32> of producer"]


def test_decode_step_hands_the_mixes_to_the_next_kernel_whole(monkeypatch):
    from dsv41_jax import transformer
    from dsv41_jax.cache import init_cache
    from dsv41_jax.config import get_preset
    from dsv41_jax.options import RunOptions
    from dsv41_jax.params import init_params

    monkeypatch.delenv("DSV41_KERNELS", raising=False)  # plain 'auto' as on a GPU: the kernels auto_reason lets run
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    cfg, opts = get_preset("tiny"), RunOptions()
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 64, opts))
    ids = {str(l): jax.ShapeDtypeStruct((1, 1, cfg.engram_n_hash_cols), jnp.int32) for l in cfg.engram_layer_ids}
    text = lower_for("cuda", lambda p, c, t, n, e: transformer.forward_step(p, c, t, n, e, cfg=cfg, opts=opts,
                                                                           logits_mode="last"),
                     params, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
                     ids).as_text()
    assert text.count("hc_expand_mix") >= cfg.n_layers  # the fused mHC path is the one lowered
    # wq_a / wkv: the GEMV's K parts go whole to the split-K finish kernel, which hands q (normalized)
    # and kv to the next kernels as separate outputs (before session 26 window_kv_write read the kv
    # columns of the GEMV's output through an XLA slice)
    assert text.count("qmm_split_finish") >= cfg.n_layers
    assert sliced_kernel_operands(text) == []
    # wo_b's K parts (f32 [P, 1, D]) go to the attention side's expansion kernel unsummed
    # (pallas_kernels.deferred_sum): no XLA sum between the two kernels
    firsts = [re.search(r"\(tensor<[^>]*>", line).group(0)[1:] for line in text.splitlines()
              if "custom_call" in line and "hc_expand_mix" in line]
    assert sum(re.fullmatch(r"tensor<\d+x1x%dxf32>" % cfg.dim, f) is not None for f in firsts) == cfg.n_layers, firsts
