"""Numeric formats of DeepSeek-V4.1: FP8 e4m3 with e8m0 block scales, MXFP4, FP4 with e4m3 scales,
and the fake-quantizers (Q8 / Q4e8 / Q4e4) the reference applies in place.

* :mod:`.codecs`     – element codecs: e8m0 <-> f32, e4m3 rounding, e2m1 (FP4) codes, nibble packing.
* :mod:`.fake_quant` – quantize-then-dequantize functions with the reference's exact scale rules.
* :mod:`.tensors`    – the pytree types that keep packed data + scales in memory (weights, caches).
"""

from .codecs import (
    E2M1_VALUES,
    FP4_PACKINGS,
    bf16_round,
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    e8m0_decode,
    e8m0_encode_exponent,
    exact_f32,
    pack_nibbles,
    repack_f16pairs,
    round_to_dtype,
    unpack_f16pairs,
    unpack_nibbles,
)
from .fake_quant import act_quant, fake_quant_fp4_e4m3, fake_quant_fp8, fake_quant_mxfp4
from .tensors import (
    Fp4Tensor,
    Fp8Tensor,
    dequantize,
    exact_in_bf16,
    fp4_packing,
    is_quantized,
    quantize_fp4_e4m3,
    quantize_fp8,
    quantize_mxfp4,
    with_fp4_packing,
)

__all__ = [
    "E2M1_VALUES",
    "FP4_PACKINGS",
    "Fp4Tensor",
    "Fp8Tensor",
    "act_quant",
    "bf16_round",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_round",
    "e8m0_decode",
    "e8m0_encode_exponent",
    "exact_f32",
    "round_to_dtype",
    "fake_quant_fp4_e4m3",
    "fake_quant_fp8",
    "fake_quant_mxfp4",
    "exact_in_bf16",
    "fp4_packing",
    "is_quantized",
    "pack_nibbles",
    "quantize_fp4_e4m3",
    "quantize_fp8",
    "quantize_mxfp4",
    "repack_f16pairs",
    "unpack_f16pairs",
    "unpack_nibbles",
    "with_fp4_packing",
]
