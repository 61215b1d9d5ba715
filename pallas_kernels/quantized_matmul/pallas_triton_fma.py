"""Weight-streaming GEMV on the vector units (no tensor cores) for 1-4 activation rows: the
``"fma"`` configuration of :func:`pallas_kernels.quantized_matmul.pallas_triton.quantized_matmul`,
and the tile arithmetic the fused MoE's decode kernels share (:mod:`pallas_kernels.moe.pallas_triton`).

Why a second GEMV. The tensor-core GEMV pads the rows to a 16-row MMA tile and must bring every
decoded weight tile into the MMA operand layout; at one or two rows that costs more than the
products themselves (session 3: the MXFP4 MoE at batch 1 ran at 0.5 TB/s, about 16 integer/float
operations per weight element). Here each weight element is decoded once and used by one fused
multiply-add per row, with no layout change:

* the weight is viewed (by XLA, free) as ``[N, K/G, G]`` groups: G = the FP8 block (32 in V4.1,
  128 in V4) or, for MXFP4, 16 bytes = 32 elements (one e8m0 scale);
* a program owns ``bn`` rows and steps over K ``kg`` groups at a time; the tile ``[bn, kg, G]`` is
  multiplied by the activation group ``[kg, G]``, summed over G (inside a thread's registers or
  one shuffle), multiplied by the per-(row, group) power-of-two scale and summed over the groups;
* how a code becomes a float32 is the route of ``FMA_DECODE`` (below): the kernels are bound by
  that integer and conversion work, not by HBM (session 7). MXFP4 by default reads 32-bit words of
  eight codes and the activation arrives split by XLA into the 8 matching phases (element 8q + j in
  phase j, ``[M, K/32, 4]`` each); the e4m3 route reads bytes, whose low and high nibbles are the even
  and odd elements (activation halves ``[M, K/32, 16]``);
* K can be split across programs (fp32 partial sums added by one small XLA fusion) so that small
  projections still fill the GPU.

Numerics equal the reference up to fp32 summation order: the decoded weights and the fake-quantized
activations are the same values as in :mod:`.reference` (products exact in fp32), and a power-of-two
scale applied to a partial sum instead of to each product changes no rounding.

FP8 rows per program: ``bn <= G`` (one scale row per tile, no in-kernel reshape). The power of two
of a route (2**6, 2**8, 2**14) is added to the e8m0 exponent, so scale bytes above 255 minus it
(weight scales above 2**114 for f16w MXFP4) are outside the kernels' range; checkpoint scales are
far below (MXFP4 expert scales near 2**-8).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.quant import Fp4Tensor, Fp8Tensor, act_quant, exact_f32, fp4_packing
from dsv41_jax.quant.codecs import E4M3_MAX, FP4_WORD_BITS, le_words, pow2
from dsv41_jax.quant.fake_quant import fp8_block_scale

from pallas_kernels.deferred_sum import gemv_parts

from .pallas_triton_finish import split_finish

FMA_MAX_ROWS = 4  # activation rows one program handles (a static loop sharing each decoded tile)
# The fused MoE takes the fma kernels by default up to this many (token, slot) pairs where the
# tensor-core kernels would read FP8 or MXFP4 bytes / words. H200, 96 MXFP4 experts (session 9): 192
# pairs (batch 32) fma 1.41 ms vs tensor cores (bytes) 2.11; 384 pairs fma 2.75 vs 2.40. MXFP4 experts
# that the tensor cores read by phases follow a rows-per-expert rule alone
# (pallas_kernels.moe.pallas_triton.takes_fma; session 34).
FMA_MOE_MAX_PAIRS = 256


def _parse_decode_gemv(text: str) -> dict:
    """``DSV41_DECODE_GEMV``: "mma" / "fma" (both ops) or "qmm=fma,moe=mma"."""
    out = {"qmm": "fma", "moe": "fma"}
    for part in filter(None, (t.strip() for t in text.split(","))):
        op, _, impl = part.rpartition("=")
        ops = [op] if op else list(out)
        if impl not in ("mma", "fma") or any(o not in out for o in ops):
            raise ValueError(f"DSV41_DECODE_GEMV={text!r}: expected mma, fma or e.g. qmm=fma,moe=mma")
        for o in ops:
            out[o] = impl
    return out


# Which GEMV decode sizes use when no config is given (read at trace time): "fma" = the vector-unit
# kernels of this module (default since session 4: on the H200 the 40-layer decode step went from
# 16.7 to 11.2 ms of device time, the fused MoE from 192 to 92 us per layer at batch 1, the FP8
# GEMVs from 3.3 to 2.2 ms per step; BENCHMARKS.md), "mma" = the tensor-core kernels. Per op:
# "qmm" (quantized_matmul, <= 4 rows) and "moe" (fused MoE, where pallas_kernels.moe.pallas_triton.takes_fma).
DECODE_GEMV = _parse_decode_gemv(os.environ.get("DSV41_DECODE_GEMV", "fma"))
# Projections that read one input share one launch at decode sizes (quantized_matmul_fma_multi);
# DSV41_FUSED_GEMV=off makes one launch per weight again (for A/B measurements of the launch count).
FUSED_GEMV = os.environ.get("DSV41_FUSED_GEMV", "on").lower() != "off"
FP4_GROUP_BYTES = 16  # one MXFP4 scale covers 32 elements = 16 packed bytes


ROUTES = ("e4m3", "f16w")


def _parse_fma_decode(text: str) -> dict:
    """``DSV41_FMA_DECODE``: "f16w" / "e4m3" (both weight formats) or per format, e.g.
    "fp4=f16w,fp8=e4m3" (how the fma kernels turn weight codes into float32)."""
    out = {"fp4": "f16w", "fp8": "e4m3"}
    for part in filter(None, (t.strip() for t in text.split(","))):
        fmt, _, via = part.rpartition("=")
        fmts = [fmt] if fmt else list(out)
        if via not in ROUTES or any(f not in out for f in fmts):
            raise ValueError(f"DSV41_FMA_DECODE={text!r}: expected one of {', '.join(ROUTES)} or e.g. fp4=f16w,fp8=e4m3")
        for f in fmts:
            out[f] = via
    return out


# How the fma kernels turn weight codes into float32, per weight format (read at trace time;
# DSV41_FMA_DECODE):
# * "e4m3" (sessions 4-6; default for FP8): MXFP4 nibbles placed into e4m3 bit patterns, then the
#   compiler's e4m3 -> f32 conversion (FP8 weights: that conversion directly; on sm_90 a packed
#   e4m3x2 -> f16x2 convert and one f16 -> f32 per code);
# * "f16w" (default for MXFP4): the codes read as uint32 words and placed into float16 bit patterns
#   by integer ops, two codes 16 bits apart per shift-mask-or (MXFP4: nibbles j and j+4 of a word,
#   e2m1 -> f16 * 2**-14; FP8: bytes 0/2 and 1/3, e4m3 -> f16 * 2**-8; subnormal codes land on f16
#   subnormals, exact), then f16 -> f32, the power of two folded into the block scale; the
#   activation is split into the matching phases (8 for MXFP4, 4 for FP8) by XLA. sm_90 SASS of
#   the MoE gate/up loop: 609 instructions per K step against 1,050 for the e4m3 route.
# Defaults from the H200 A/B (session 7, BENCHMARKS.md): MXFP4 fused MoE at 1 token 76.4 us (f16w)
# against 103.9 (e4m3), at 8 tokens 417 against 624 us; FP8 wq_b 16.9 us (e4m3) against 18.4
# (f16w), wo_b 18.4 against 22.9 us. (A third route, the f16 placement byte by byte, measured in
# between for MXFP4 and slowest for FP8 and was dropped.)
FMA_DECODE = _parse_fma_decode(os.environ.get("DSV41_FMA_DECODE", ""))


# Where the fma kernels' activation fake-quant runs (read at trace time; DSV41_FMA_ACT_QUANT).
# Default "kernel" since session 20: 7-layer batch-1 probe on the H200, device time per step 2.027 ->
# 1.990 ms against "xla" and 2.001 for "pallas" (another run), with the GPU checks bit-identical.
# * "xla": ``act_quant`` as XLA ops before the kernel. On the H200 that is two small
#   kernels per call (a block-amax reduction, then the scaling), about 2.6 us together: 0.66 ms of
#   the 9.31 ms batch-1 step (session 18 profile, ~200 calls per step with the MoE's);
# * "kernel": the GEMV's programs quantize every activation group in registers as they load it
#   (:func:`quant_phases`), so no XLA op runs before the kernel. Every program repeats this for its
#   K range: the sm_90 loop of the FP8 GEMV goes from 241 to 271 instructions per K step (+12 %,
#   ``inspect_sass gemv``, session 18), against two XLA kernels (~2.6 us) saved per call. Only
#   where the activation block is the weight's K group (V4.1: 32, V4's FP8: 128); elsewhere "xla".
#   The fused MoE keeps the XLA op (its loops grew 1.8-2.4x: pallas_kernels.moe.pallas_triton).
#   Built in session 18 without a GPU (prediction: under 0.1 ms per batch-1 step); session 20
#   measured -0.037 ms per 7-layer step (about -0.2 ms over 40 layers).
# * "pallas": one small Pallas kernel before the GEMV and before each of the fused MoE's kernels
#   (:func:`act_quant_view`) quantizes the activation and writes it straight in the phase layout
#   the kernel reads: one launch instead of XLA's two, no change to the GEMV / MoE loops. Same
#   condition as "kernel". Session 20: -0.048 ms per 7-layer step against "xla" where "kernel" gave
#   -0.068 in the same run.
ACT_QUANTS = ("xla", "kernel", "pallas")
ACT_QUANT = os.environ.get("DSV41_FMA_ACT_QUANT", "kernel").lower()
if ACT_QUANT not in ACT_QUANTS:
    raise ValueError(f"DSV41_FMA_ACT_QUANT={ACT_QUANT!r}: expected one of {', '.join(ACT_QUANTS)}")


# The fused MoE's act-quants (x before kernel A, h before kernel B): "xla" or "pallas" (the prologue
# kernel of :func:`act_quant_view`); DSV41_MOE_ACT_QUANT, read at trace time. Unset: "xla" when
# ACT_QUANT is "xla", else "pallas" (the MoE has no in-kernel variant: its loops grew 1.8-2.4x).
# Session 20's 7-layer probes: the MoE's XLA act-quants ~5.1 us per layer, the two prologue
# launches that replace them ~3 us (DSV41_FMA_ACT_QUANT=pallas run). Session 21, beside the
# GEMV's "kernel": -0.030 ms per 7-layer step and 28 fewer kernels (routed_experts 0.507 ->
# 0.476 ms), so "pallas" became the default; the prologue's numerics were checked on the H200 in
# session 19 (moe.benchmark --check identical under each act-quant).
MOE_ACT_QUANTS = ("xla", "pallas")
MOE_ACT_QUANT = os.environ.get("DSV41_MOE_ACT_QUANT", "").lower() or None
if MOE_ACT_QUANT is not None and MOE_ACT_QUANT not in MOE_ACT_QUANTS:
    raise ValueError(f"DSV41_MOE_ACT_QUANT={MOE_ACT_QUANT!r}: expected one of {', '.join(MOE_ACT_QUANTS)}")


# Whether default_config may split a GEMV down to one K step per program where programs of two
# steps would be fewer than the SMs (read at trace time; DSV41_FMA_FILL_SMS, "on" / "off"). "on"
# (default since session 32): idx_wq_b (4096 x 1280 FP8, 128 row blocks) on 640 one-step programs,
# 6.1 -> 5.2 us on the H200; "off": the session-31 rule (at least two steps per program), for A/Bs.
FILL_SMS = os.environ.get("DSV41_FMA_FILL_SMS", "on").lower()
if FILL_SMS not in ("on", "off"):
    raise ValueError(f"DSV41_FMA_FILL_SMS={FILL_SMS!r}: expected on or off")


# The fused MoE's MXFP4 products in float16 (read at trace time; DSV41_FMA_F16ACC, "off" (the
# default), "on", "ptx" or "gcn"). "on": the activation (x before the gate/up kernel, h before the down kernel) goes
# in as float16 ``q * 2**7`` (q its e4m3 value, exact: |q * 2**7| <= 57,344) with its block scale
# ``2**(e - 7)`` beside it as a float32 array [M, K/32] (:func:`quant_phases` with ``f16``), and each
# word's four placed f16 pairs (``e2m1 * 2**-14``, :func:`fp4_word_pairs_f16`) are multiplied by it
# and summed in float16 over the word's four pairs (two chains of four products per word: codes
# j and j + 4), then widened to float32, summed over the group and scaled as before. Every product
# is exact in float16 (<= 6 significant bits, >= 2**-17: inside the subnormal grid of 2**-24); the
# chains round to float16 (11 bits) where the float32 route rounds to 24 -- a different summation,
# not the reference's fp32 one, hence opt-in (BENCHMARKS.md, issue 6, session 50: its error against
# a float64 evaluation beside the float32 route's). Why: the float32 route spends one f16 -> f32
# conversion and one FFMA per weight code (sm_90 SASS of the one-token gate/up loop: 128 HADD2 +
# 116 FFMA of 538 instructions per step), and the MoE kernels are issue-bound (66 % of a pure read
# of their bytes on the H100, session 49). MXFP4 experts read as words with V4.1's 32-element
# activation blocks only (:func:`f16acc_for`).
F16ACC_MODES = ("off", "on", "ptx", "gcn")
F16ACC_ASM = {"ptx": ("mul.rn.f16x2 $0, $1, $2;", "fma.rn.f16x2 $0, $1, $2, $3;", "r"),
              "gcn": ("v_pk_mul_f16 $0, $1, $2", "v_pk_fma_f16 $0, $1, $2, $3", "v")}


def _parse_f16acc(text: str) -> dict:
    """``DSV41_FMA_F16ACC`` -> ``{"mode": one of F16ACC_MODES}``; a ValueError naming the flag."""
    v = (text.strip() or "off").lower()
    if v not in F16ACC_MODES:
        raise ValueError(f"DSV41_FMA_F16ACC={text!r}: expected one of {', '.join(F16ACC_MODES)}")
    return {"mode": v}


# "ptx" / "gcn": the same arithmetic with each word's f16x2 multiply-adds written as inline assembly
# on the placed word and the activation pair word -- ``fma.rn.f16x2`` (NVIDIA PTX) or
# ``v_pk_fma_f16`` (AMD gfx9 / gfx950, the MI350X) -- one vendor each. The portable form leaves the
# pairing to LLVM, which pairs halves of neighbouring words instead and spends a byte permute per
# pair (PRMT / v_perm_b32: sm_90 462 against 382 instructions per gate/up step, gfx950 250 against
# the asm form's count in BENCHMARKS.md, issue 6, session 50).
F16ACC = _parse_f16acc(os.environ.get("DSV41_FMA_F16ACC", ""))
F16_X_SHIFT = 7  # the activation's float16 form is q * 2**7 (q: its e4m3 value, |q| <= 448)


@contextlib.contextmanager
def use_f16acc(on):
    """Within the block the fused MoE traces with :data:`F16ACC` ``on`` (a mode name or a bool; None:
    as it is); restored after it, also on errors."""
    saved = dict(F16ACC)
    if on is not None:
        F16ACC.update(_parse_f16acc(on if isinstance(on, str) else "on" if on else "off"))
    try:
        yield
    finally:
        F16ACC.update(saved)


def f16acc_for(w, act_block: int, interpret: bool = False):
    """The fused MoE kernels' float16-product mode for expert weight ``w``: False (the float32 route),
    "on", "ptx" or "gcn" (:data:`F16ACC`; MXFP4 read as words with activation blocks of one K group
    only). The assembly modes run their portable twin ("on", the same arithmetic) in interpret mode,
    and are refused on the other vendor's device with the flag to use instead."""
    mode = F16ACC["mode"]
    if not (mode != "off" and isinstance(w, Fp4Tensor) and fp4_words(w) and act_block == group_size(w)):
        return False
    if mode == "on" or interpret:
        return "on"
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    amd = "rocm" in version or "hip" in version
    if amd != (mode == "gcn") and version and "cpu" not in version:
        raise ValueError(f"DSV41_FMA_F16ACC={mode} is inline {'AMD gfx9' if mode == 'gcn' else 'NVIDIA PTX'} assembly "
                         f"and cannot run on this device ({version}); use DSV41_FMA_F16ACC=on (the same arithmetic, "
                         f"portable){'' if amd else ' or ptx'} or off")
    return mode


def moe_act_quant_site(w, act_block: int) -> str:
    """Where the fused MoE's activations for expert weights ``w`` are fake-quantized: "pallas" (the
    prologue kernel) or "xla" (see :data:`MOE_ACT_QUANT`); "xla" where an activation block is not
    one K group of ``w``."""
    if act_block != group_size(w):
        return "xla"
    return MOE_ACT_QUANT or ("xla" if ACT_QUANT == "xla" else "pallas")


def act_quant_site(w, act_block: int) -> str:
    """Where the fma kernels' activation for weight ``w`` is fake-quantized: :data:`ACT_QUANT`
    ("kernel": in the GEMV's loop; "pallas": :func:`act_quant_view`) where one activation block is
    exactly one K group of ``w`` (every block a K step loads is whole), else "xla"."""
    return ACT_QUANT if act_block == group_size(w) else "xla"


def checked_routes(vias) -> list:
    """``vias`` (route names, or None for the current routes) as a list, each a known route (a
    ValueError naming the unknown ones and the known ones otherwise); empty / None -> [None]."""
    vias = list(vias or [None])
    bad = [v for v in vias if v is not None and v not in ROUTES]
    if bad:
        raise ValueError(f"--vias {','.join(bad)}: unknown weight decode route; expected {', '.join(ROUTES)}")
    return vias


@contextlib.contextmanager
def use_decode_route(via):
    """Within the block both weight formats trace with route ``via`` (None: the routes as they are);
    ``FMA_DECODE`` is restored after it, also on errors."""
    saved = dict(FMA_DECODE)
    if via is not None:
        FMA_DECODE.update(fp4=via, fp8=via)
    try:
        yield
    finally:
        FMA_DECODE.clear()
        FMA_DECODE.update(saved)


def _half(t):
    """The low 16 bits of integer ``t`` as float16."""
    return jax.lax.bitcast_convert_type(t.astype(jnp.uint16), jnp.float16)


def _f16_bits_to_f32(t):
    return _half(t).astype(jnp.float32)


def _e4m3_bits_to_f32(t):
    return jax.lax.bitcast_convert_type(t.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def fp4_byte_decode_f32(b):
    """int32 bytes holding two e2m1 codes -> (low nibble, high nibble, 6): float32 ``e2m1 * 2**-6``,
    the e4m3 bit placement of ``pallas_triton._fp4_decode`` (sign to bit 7, magnitude to bits 4..2)
    taken straight from the byte (shift + mask + or) and the e4m3 conversion; the route "e4m3"."""
    lo = ((b << 4) & 0x80) | ((b << 2) & 0x1C)
    hi = (b & 0x80) | ((b >> 2) & 0x1C)
    return _e4m3_bits_to_f32(lo), _e4m3_bits_to_f32(hi), 6


def e8m0_f32(s_u8, bias_shift: int = 0):
    """uint8 e8m0 bytes -> float32 2**(s - 127 + bias_shift), by writing the exponent field (also the
    tensor-core kernels' scale decode)."""
    e = s_u8.astype(jnp.int32) + bias_shift
    return jax.lax.bitcast_convert_type(e << 23, jnp.float32)


def group_size(w) -> int:
    return int(w.block[0]) if isinstance(w, Fp8Tensor) else 2 * FP4_GROUP_BYTES


def fp4_route(w) -> str:
    """How the fma kernels decode MXFP4 weight ``w``: "f16pairs" where its codes are stored in that
    packing (the layout dictates the decode), else :data:`FMA_DECODE`'s route ("f16w" or "e4m3")."""
    return "f16pairs" if fp4_packing(w) == "f16pairs" else FMA_DECODE["fp4"]


def fp4_words(w) -> bool:
    """Whether the fma kernels read MXFP4 weight ``w`` as uint32 words (routes "f16w" and "f16pairs";
    the activation then in 8 phases)."""
    return fp4_route(w) in ("f16w", "f16pairs")


# ------------------------------------------------------------------------------------------------
# views (XLA, outside the kernels)


_words = le_words  # [..., B] uint8 -> [..., B/4] uint32 little-endian words


def weight_view(w):
    """(data [..., N, K/G, G'], scale [..., N or N/G, K/G] uint8): FP8 e4m3 codes with G' = G (uint8)
    or G/4 (uint32 words, route "f16w"); MXFP4 packed bytes with G' = 16 (uint8) or 4 (uint32 words,
    route "f16w"). Pure reshapes and bitcasts of the stored arrays."""
    if isinstance(w, Fp8Tensor):
        g = group_size(w)
        *lead, n, k = w.data.shape
        data = jax.lax.bitcast_convert_type(w.data, jnp.uint8).reshape(*lead, n, k // g, g)
        return (_words(data) if FMA_DECODE["fp8"] == "f16w" else data), jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    if isinstance(w, Fp4Tensor):
        data = w.data if w.data.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(w.data, jnp.uint8)
        *lead, n, kb = data.shape
        data = data.reshape(*lead, n, kb // FP4_GROUP_BYTES, FP4_GROUP_BYTES)
        return (_words(data) if fp4_words(w) else data), jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    raise TypeError(f"fma GEMV takes FP8 or MXFP4 weights, got {type(w).__name__}")


def act_view(xq, w, widen: bool = True):
    """The activation [M, K] as the kernel reads it (float32, or ``xq``'s own dtype when not
    ``widen``: the kernel then upcasts what it loads), a tuple of phases: FP8 -> one array
    [M, K/G, G] (route "f16w": 4 phases [M, K/G, G/4], element 4q + j in phase j); MXFP4 -> the
    (even, odd) halves [M, K/32, 16] (route "f16w": 8 phases [M, K/32, 4], element 8q + j in phase
    j). ``xq`` is fake-quantized already, or raw where the kernel quantizes (:data:`ACT_QUANT`);
    a bf16 ``xq`` keeps its own rounding (``exact_f32``) even where XLA fuses its producer.

    Where the kernel quantizes (``widen=False`` from the GEMV under :data:`ACT_QUANT` "kernel") the
    raw bf16 activation goes in as it is: widening it in XLA was a kernel of its own before every
    GEMV (about 1.2 us each, ~0.24 ms of the batch-1 step in the session-20 profile), and an upcast
    of loaded bf16 bits inside the kernel is exact by construction."""
    m, k = xq.shape
    xf = exact_f32(xq) if widen else xq
    if isinstance(w, Fp8Tensor):
        g = group_size(w)
        if FMA_DECODE["fp8"] == "f16w":
            xr = xf.reshape(m, k // g, g // 4, 4)
            return tuple(xr[..., j] for j in range(4))
        return (xf.reshape(m, k // g, g),)
    if fp4_words(w):
        xr = xf.reshape(m, k // 32, 4, 8)
        return tuple(xr[..., j] for j in range(8))
    pairs = xf.reshape(m, k // 32, FP4_GROUP_BYTES, 2)
    return pairs[..., 0], pairs[..., 1]


def _phase_layout(w) -> tuple[int, int]:
    """(phases, elements per phase and K group) of :func:`act_view` for weight ``w``."""
    g = group_size(w)
    if isinstance(w, Fp8Tensor):
        return (4, g // 4) if FMA_DECODE["fp8"] == "f16w" else (1, g)
    return (8, 4) if fp4_words(w) else (2, 16)


def phase_cols(nph: int, per: int) -> list:
    """The column index of each of the ``nph`` phases inside one K group of G = nph * per elements
    (phase j = elements j, j + nph, ...: strided loads), for kernels that write :func:`act_view`'s
    layout."""
    return [slice(None)] if nph == 1 else [pl.ds(j, per, stride=nph) for j in range(nph)]


def view_groups_per_program(groups: int) -> int:
    """K groups one program of a view-writing kernel handles: the largest power of two <= 32
    dividing ``groups``."""
    nb = 32
    while groups % nb:
        nb //= 2
    return nb


def store_view(out_refs, r, b0, nb, quantized, f16: bool):
    """Store one row's quantized phases (:func:`quant_phases`) of K groups [b0, b0+nb). With ``f16``
    the float16 view: phases j and j + 4 as the halves of uint32 words ([K/G, 4]) in the first 4
    refs, the block scales [M, K/G] (float32) in the last."""
    if f16:
        *q, scale = quantized
        out_refs[-1][r, pl.ds(b0, nb)] = scale[:, 0]
        for j in range(4):
            out_refs[j][r, pl.ds(b0, nb), :] = f16_pair_word(q[j], q[j + 4])
        return
    for o_ref, q in zip(out_refs, quantized):
        o_ref[r, pl.ds(b0, nb), :] = q


def view_shapes(m: int, groups: int, nph: int, per: int, f16: bool) -> tuple:
    """The out shapes of a view-writing kernel: ``nph`` phases [M, K/G, per] float32, or with ``f16``
    (MXFP4 words: 8 phases of 4) the 4 phase-pair words [M, K/G, 4] (uint32: float16 phase j low,
    j + 4 high) and the block scales [M, K/G] float32."""
    if f16:
        return (tuple(jax.ShapeDtypeStruct((m, groups, per), jnp.uint32) for _ in range(nph // 2))
                + (jax.ShapeDtypeStruct((m, groups), jnp.float32),))
    return tuple(jax.ShapeDtypeStruct((m, groups, per), jnp.float32) for _ in range(nph))


def _act_quant_view_kernel(x_ref, *out_refs, nph, per, nb, f16=False):
    """Program (r, c): row r, K groups [c*nb, +nb) of x [M, K/G, G] -> act_quant of each group,
    stored as the ``nph`` phases (:func:`phase_cols`; with ``f16`` their float16 form and scales)."""
    r = pl.program_id(0)
    b0 = pl.multiple_of(pl.program_id(1) * nb, nb)
    phases = [x_ref[r, pl.ds(b0, nb), c].astype(jnp.float32) for c in phase_cols(nph, per)]
    store_view(out_refs, r, b0, nb, quant_phases(phases, f16=f16), f16)


def act_quant_view(x2, w, *, interpret=False, f16=False):
    """``act_view(act_quant(x2, G), w)`` in one Pallas launch (ACT_QUANT "pallas"; the activation
    block must be the K group G of ``w``): each program quantizes up to 32 K groups of one row,
    read from memory (so a bf16 input is its stored value) and written as float32 phases; with
    ``f16`` (:data:`F16ACC`) as float16 ``q * 2**7`` phases and the block scales after them
    (:func:`act_view16` is its XLA twin)."""
    m, k = x2.shape
    g = group_size(w)
    nph, per = _phase_layout(w)
    groups = k // g
    nb = view_groups_per_program(groups)
    outs = pl.pallas_call(
        functools.partial(_act_quant_view_kernel, nph=nph, per=per, nb=nb, f16=f16),
        out_shape=view_shapes(m, groups, nph, per, f16),
        grid=(m, groups // nb),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="fma_act_quant",
    )(x2.reshape(m, groups, g))
    return tuple(outs)


def act_view16(x2, w):
    """XLA: the activation [M, K] fake-quantized per K group of ``w`` in the float16 form of
    :data:`F16ACC` -- phases j and j + 4 of ``q * 2**7`` (float16) as the low / high halves of 4
    uint32 arrays [M, K/32, 4], and the block scales [M, K/32] (float32 ``2**(e - 7)``); the same
    values as :func:`act_quant_view` with ``f16``."""
    *q, scale = quant_phases(list(act_view(x2, w)), f16=True)  # act_view: the raw 8 phases, widened exactly
    return tuple(f16_pair_word(q[j], q[j + 4]) for j in range(len(q) // 2)) + (scale[..., 0],)


def f16_pair_word(lo, hi):
    """Two float16 arrays -> uint32 words with ``lo`` in bits 0..15 and ``hi`` in bits 16..31."""
    def bits(h):
        return jax.lax.bitcast_convert_type(h, jnp.uint16).astype(jnp.uint32)
    return bits(lo) | (bits(hi) << np.uint32(16))


# ------------------------------------------------------------------------------------------------
# tile arithmetic (inside kernels)

_SIGNS = np.uint32(0x80008000)  # the sign bits of both f16 halves of a word


def _f16_pair_bits(w, sign_at: int, mag_at: int):
    """Codes whose sign sits at bit ``sign_at`` (and + 16) and magnitude at bits ``mag_at`` .. + 2 of
    words ``w`` placed into f16 halves (sign to bit 15 / 31, magnitude to bits 9..11 / 25..27): one
    mask when both are in place, one shift + mask when they are 6 bits apart, else two of each."""
    def shifted(t, by):
        return t if by == 0 else (t << np.uint32(by)) if by > 0 else (t >> np.uint32(-by))
    if 15 - sign_at == 9 - mag_at:
        return shifted(w, 15 - sign_at) & np.uint32(0x8E008E00)
    return (shifted(w, 15 - sign_at) & _SIGNS) | (shifted(w, 9 - mag_at) & np.uint32(0x0E000E00))


def fp4_word_pairs_f32(w, packing: str = "nibbles"):
    """uint32 words of eight e2m1 codes (element 8q + j) -> four (element j, element j + 4) pairs of
    float32 ``e2m1 * 2**-14``: codes j and j + 4 sit 16 bits apart, so one shift-mask-or places both
    into the f16 halves of a word (sign to bit 15 / 31, magnitude to bits 11..9 / 27..25).
    ``packing`` "nibbles": code j in nibble j (15 integer ops per word); "f16pairs"
    (:func:`~dsv41_jax.quant.codecs.repack_f16pairs`): 11 per word."""
    return [(_f16_bits_to_f32(t), _f16_bits_to_f32(t >> 16)) for t in _placed(w, packing)]


def _placed(w, packing: str):
    """The four placed words of ``w``, one at a time (a generator: the pair readers convert each word
    right after placing it, the program order the kernels were tuned with)."""
    return (_f16_pair_bits(w, s, m) for s, m in zip(*FP4_WORD_BITS[packing]))


def fp4_placed_words(w, packing: str = "nibbles"):
    """uint32 words of eight e2m1 codes -> the four placed words (each an f16x2: element j low,
    element j + 4 high, ``e2m1 * 2**-14``), still as uint32: what :func:`fp4_word_pairs_f32` and
    :func:`fp4_word_pairs_f16` read their halves from."""
    return list(_placed(w, packing))


def f16x2_dot4(words, xwords, asm: str | None = None):
    """Four weight f16x2 words [bn, kg, 4] against four activation f16x2 words [kg, 4] (uint32 bit
    patterns): per word position the float16 chains ``lo = sum_j w_j.lo * x_j.lo`` and ``hi`` alike
    (four products each, in order j = 0..3, each add rounded to float16), returned as the float32
    ``lo + hi``. ``asm`` ("ptx" / "gcn", :data:`F16ACC_ASM`): the chains as packed multiply(-add)
    inline assembly on the words (one vendor each), else float16 jnp arithmetic on the halves
    (products exact, each add rounded: the same values)."""
    if asm is not None:
        mul, fma_, reg = F16ACC_ASM[asm]
        acc = None
        for w, x in zip(words, xwords):
            w = jax.lax.bitcast_convert_type(w, jnp.int32)  # (the op's results are signless integers)
            xb = jnp.broadcast_to(jax.lax.bitcast_convert_type(x, jnp.int32)[None], w.shape)
            out = [jax.ShapeDtypeStruct(w.shape, jnp.int32)]
            if acc is None:
                acc, = pltriton.elementwise_inline_asm(mul, args=[w, xb], constraints=f"={reg},{reg},{reg}",
                                                       pack=1, result_shape_dtypes=out)
            else:
                acc, = pltriton.elementwise_inline_asm(fma_, args=[w, xb, acc], constraints=f"={reg},{reg},{reg},{reg}",
                                                       pack=1, result_shape_dtypes=out)
        acc = jax.lax.bitcast_convert_type(acc, jnp.uint32)
        return _half(acc).astype(jnp.float32) + _half(acc >> np.uint32(16)).astype(jnp.float32)
    lo = hi = None
    for w, x in zip(words, xwords):
        pl_, ph = _half(w) * _half(x)[None], _half(w >> np.uint32(16)) * _half(x >> np.uint32(16))[None]
        lo, hi = (pl_, ph) if lo is None else (lo + pl_, hi + ph)
    return lo.astype(jnp.float32) + hi.astype(jnp.float32)


def fp4_word_pairs_f16(w, packing: str = "nibbles"):
    """:func:`fp4_word_pairs_f32` without the conversion to float32: the four (element j, element
    j + 4) pairs as float16 ``e2m1 * 2**-14`` (the low / high halves of each placed word; code +-1 is
    an f16 subnormal, which f16 arithmetic and the tensor cores keep)."""
    return [(_half(t), _half(t >> 16)) for t in _placed(w, packing)]


def fp8_word_pairs_f32(w):
    """uint32 words of four e4m3 codes (byte j = element 4q + j) -> ((element 0, element 2),
    (element 1, element 3)) as float32 ``e4m3 * 2**-8``: bytes 0 and 2 (1 and 3) sit 16 bits apart
    and are placed into the f16 halves of a word by one shift-mask-or."""
    b02 = ((w << 8) & _SIGNS) | ((w << 7) & np.uint32(0x3F803F80))
    b13 = (w & _SIGNS) | ((w >> 1) & np.uint32(0x3F803F80))
    return [(_f16_bits_to_f32(t), _f16_bits_to_f32(t >> 16)) for t in (b02, b13)]


def load_tile(fmt, w_ref, s_ref, lead, row0, bn, g0, kg, g):
    """The raw weight codes [bn, kg, G'] and scale bytes ([1, kg] for FP8, one scale row since
    ``bn <= g``; [bn, kg] for MXFP4) of rows [row0, row0+bn) x K groups [g0, g0+kg)."""
    raw = w_ref[(*lead, pl.ds(row0, bn), pl.ds(g0, kg), slice(None))]
    srows = pl.ds(row0 // g, 1) if fmt == "fp8" else pl.ds(row0, bn)
    return raw, s_ref[(*lead, srows, pl.ds(g0, kg))]


def fp8_tile_partial(raw, sraw, xs):
    """FP8 tile codes [bn, kg, G] u8 (or [bn, kg, G/4] u32 words) with scale bytes [1, kg]: for each
    activation row's phases in ``xs`` (:func:`act_view`, [kg, G] or 4 x [kg, G/4] f32) the scaled
    partial sums [bn, kg], one per K group (see :func:`tile_partials`)."""
    if FMA_DECODE["fp8"] == "f16w":
        (a0, a2), (a1, a3) = fp8_word_pairs_f32(raw)
        sf = e8m0_f32(sraw, 8)
        return [jnp.sum(a0 * x[0][None] + a1 * x[1][None] + a2 * x[2][None] + a3 * x[3][None], axis=2) * sf
                for x in xs]
    w = _e4m3_bits_to_f32(raw.astype(jnp.int32))
    sf = e8m0_f32(sraw)  # [1, kg]
    return [jnp.sum(w * x[0][None], axis=2) * sf for x in xs]


def fp4_tile_partial(raw, sraw, xs, route=None, f16=False):
    """MXFP4 tile: packed bytes [bn, kg, 16] (or words [bn, kg, 4], routes "f16w" / "f16pairs") with
    scale bytes [bn, kg]; ``xs`` each activation row's phases (:func:`act_view`). Returns the scaled
    partial sums [bn, kg] per row. ``route``: :func:`fp4_route` of the weight (None: FMA_DECODE's).
    With ``f16`` (an :func:`f16acc_for` mode) the rows are the float16 view of :data:`F16ACC`
    (:func:`load_x`: 4 phase-pair words and the block scales) and take the float16 products
    (:func:`f16x2_dot4`, in the mode's :func:`f16acc_asm` form); a word route is required (the
    caller's :func:`f16acc_for` checks it)."""
    route = route or FMA_DECODE["fp4"]
    if f16:
        if route not in ("f16w", "f16pairs") or any(len(x) != 5 for x in xs):
            raise ValueError(f"the float16 products take a word route (f16w / f16pairs) and rows of 4 words + scales; "
                             f"got route {route!r} and rows of {sorted({len(x) for x in xs})} entries")
        words = fp4_placed_words(raw, "f16pairs" if route == "f16pairs" else "nibbles")
        sf = e8m0_f32(sraw, 14)
        asm = f16acc_asm(f16)
        return [jnp.sum(f16x2_dot4(words, x[:4], asm), axis=2) * (sf * x[4][None]) for x in xs]
    if route in ("f16w", "f16pairs"):
        pairs = fp4_word_pairs_f32(raw, "f16pairs" if route == "f16pairs" else "nibbles")
        sf = e8m0_f32(sraw, 14)
        out = []
        for x in xs:
            acc = pairs[0][0] * x[0][None]
            for j, (lo, hi) in enumerate(pairs):  # one multiply-add per element
                acc = (acc if j == 0 else acc + lo * x[j][None]) + hi * x[j + 4][None]
            out.append(jnp.sum(acc, axis=2) * sf)
        return out
    lo, hi, shift = fp4_byte_decode_f32(raw.astype(jnp.int32))
    sf = e8m0_f32(sraw, shift)  # [bn, kg]; undoes the 2**-shift
    return [jnp.sum(lo * x[0][None] + hi * x[1][None], axis=2) * sf for x in xs]


def quant_phases(phases, f16: bool = False):
    """DeepSeek's activation fake-quant (:func:`dsv41_jax.quant.act_quant`) of one row's loaded
    phases (:func:`act_view`, each [kg, L]; together they hold whole blocks, one per K group):
    ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, ``q = e4m3(clip(x / s, ±448)) * s``, bit-exact:
    the scale exponent is the quantizer's own (``fp8_block_scale``, read from amax's bits without a
    division); the e4m3 rounding is the converts, which round inside a Triton kernel (session 17).
    With ``f16`` (:data:`F16ACC`): the phases as float16 ``q * 2**7`` and, after them, the block
    scales ``s * 2**-7`` [kg, 1] (float32); their product is the same fake-quantized value."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(p), axis=-1, keepdims=True) for p in phases])
    e = fp8_block_scale(amax)
    inv, fwd = pow2(-e), pow2(e)
    qs = [jnp.clip(p * inv, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) for p in phases]
    if f16:
        return [(q * float(2 ** F16_X_SHIFT)).astype(jnp.float16) for q in qs] + [pow2(e - F16_X_SHIFT)]
    return [q * fwd for q in qs]


def load_x(x_refs, rows, g0, kg, quant=False, f16=False):
    """Each activation row's phases of K groups [g0, g0+kg) (``rows``: indices into ``x_refs``, the
    phases of :func:`act_view`), fake-quantized here when ``quant`` (:func:`act_quant_site` "kernel").
    With ``f16`` (:data:`F16ACC`) ``x_refs`` is the float16 view (phases, then the block scales) and
    each row's list is its 4 phase-pair words [kg, 4] (uint32) followed by its scales [kg]."""
    if f16:
        return [[xr[r, pl.ds(g0, kg), :] for xr in x_refs[:-1]] + [x_refs[-1][r, pl.ds(g0, kg)]] for r in rows]
    xs = [[xr[r, pl.ds(g0, kg), :].astype(jnp.float32) for xr in x_refs] for r in rows]
    return [quant_phases(x) for x in xs] if quant else xs


def partials(fmt, tile, xs, route=None, f16=False):
    """The scaled partial sums [bn, kg] of one loaded tile against each row's phases ``xs``;
    ``route``: an MXFP4 weight's :func:`fp4_route` (None: FMA_DECODE's); ``f16``: an
    :func:`f16acc_for` mode, the rows then being the float16 view (:data:`F16ACC`, MXFP4 only)
    multiplied in its form (:func:`f16acc_asm`: "ptx" / "gcn" inline assembly, else portable)."""
    if fmt == "fp8":
        if f16:
            raise ValueError("the float16 products (DSV41_FMA_F16ACC) take MXFP4 weights only")
        return fp8_tile_partial(*tile, xs)
    return fp4_tile_partial(*tile, xs, route, f16)


def tile_partials(fmt, tile, x_refs, rows, g0, kg, quant=False, route=None, f16=False):
    """The scaled partial sums [bn, kg] (one per weight row and K group) of one loaded tile
    (:func:`load_tile`) against each activation row in ``rows`` (indices into ``x_refs``, the phases
    of :func:`act_view`; K groups [g0, g0+kg)); the decoded tile is shared by all rows. The kernels
    add them up over the K steps and sum over the kg groups once, after the loop: a sum over kg
    inside the loop is a reduction across warps (shared memory and barriers) every step."""
    return partials(fmt, tile, load_x(x_refs, rows, g0, kg, quant, bool(f16)), route, f16)


def f16acc_asm(mode):
    """The inline-assembly form of an :func:`f16acc_for` mode (None: portable or off)."""
    return mode if mode in F16ACC_ASM else None


def k_loop(steps, load, compute, init):
    """``fori_loop`` over ``steps`` K steps: ``compute(i, load(i), acc)``. (Loading step i + 1's tiles
    into registers before decoding step i's was measured slower on the H200, session 7:
    BENCHMARKS.md.)"""
    return jax.lax.fori_loop(0, steps, lambda i, acc: compute(i, load(i), acc), init)


# ------------------------------------------------------------------------------------------------
# the GEMV


def unsupported_reason(m: int, w, config, *, max_rows: int = FMA_MAX_ROWS) -> str | None:
    """Why the fma configuration cannot take this call (None: it can)."""
    _, bn, kg, splits, _, _ = config
    if not isinstance(w, (Fp8Tensor, Fp4Tensor)):
        return "the fma GEMV takes FP8 or MXFP4 weights only"
    if m > max_rows:
        return f"the fma GEMV takes at most {max_rows} rows, got {m}"
    n, k = w.shape
    g = group_size(w)
    if isinstance(w, Fp8Tensor) and bn > g:
        return f"FP8 rows per program bn={bn} must be <= the weight block {g}"
    if n % bn:
        return f"N={n} must be a multiple of bn={bn}"
    groups = k // g
    if k % g or groups % (kg * splits):
        return f"K={k} must split into {splits} x (a multiple of {kg}) groups of {g}"
    return None


def default_config(m: int, n, k: int, w) -> tuple:
    """("fma", bn, kg, splits, warps, stages): 32-row programs (FP8) / 16 (MXFP4), K split until
    about four programs per SM (132 on an H200), at least two K steps per program unless that leaves
    fewer programs than SMs (then down to one step each). ``n``: N, or the
    tuple of every weight's N for :func:`quantized_matmul_fma_multi` (bn then divides each)."""
    ns = tuple(n) if isinstance(n, (tuple, list)) else (n,)
    g = group_size(w)
    bn = 32 if isinstance(w, Fp8Tensor) else 16
    while any(v % bn for v in ns):
        bn //= 2
    groups = k // g
    kg = 1
    while kg * 2 * g <= 256 and groups % (kg * 2) == 0:  # about 256 elements per row per step
        kg *= 2
    steps = groups // kg
    blocks = sum(v // bn for v in ns)
    splits = 1
    for cand in range(1, steps + 1):
        if steps % cand == 0 and steps // cand >= 2:
            splits = cand
            if blocks * cand >= 4 * 132:
                break
    if blocks * splits < 132 and FILL_SMS == "on":
        # fewer programs than SMs even at two steps each: split down to one step per program
        # (idx_wq_b, 4096 x 1280 FP8 at one row, H200 session 32: 128 programs of 5 steps 6.1 us,
        # 640 of one step 5.2 us; wq_a's 400 programs of 2 steps beat 800 of one, 5.8 vs 6.1 us)
        splits = next(c for c in range(splits, steps + 1) if steps % c == 0 and (blocks * c >= 4 * 132 or c == steps))
    return ("fma", bn, kg, splits, 4, 3)


def multi_reason(m: int, ws, config) -> str | None:
    """Why one launch of the fma GEMV cannot compute ``x @ W.T`` for every W in ``ws`` (None: it can):
    each must take the configuration alone, and all must share the format, block, K and (MXFP4) packing."""
    for i, w in enumerate(ws):
        reason = unsupported_reason(m, w, config)
        if reason is not None:
            return f"weight {i}: {reason}"
    w0 = ws[0]
    for i, w in enumerate(ws[1:], 1):
        if (type(w) is not type(w0) or group_size(w) != group_size(w0) or w.shape[1] != w0.shape[1]
                or getattr(w, "packing", None) != getattr(w0, "packing", None)):
            return (f"weight {i} ({type(w).__name__} {tuple(w.shape)}, group {group_size(w)}, packing "
                    f"{getattr(w, 'packing', '-')}) does not share the format, block, K and packing of weight 0 "
                    f"({type(w0).__name__} {tuple(w0.shape)}, group {group_size(w0)}, packing {getattr(w0, 'packing', '-')})")
    return None


def _fma_kernel(*refs, fmt, m, bn, kg, steps, g, split, nblocks, group_blocks=None, quant=False, route=None):
    """Programs (i_n, i_s): output rows [i_n*bn, +bn) of the concatenation of every weight's output,
    K part i_s. ``nblocks``: each weight's number of bn-row blocks; program i_n reads the weight whose
    blocks hold it (a static branch per weight, one taken). ``group_blocks`` (grouped GEMV, one
    weight): each group's number of bn-row blocks; the activation then holds the groups' rows one
    group after another ([G*M, ...]) and program i_n reads group i_n // group_blocks's M rows.
    ``quant``: the activation arrives raw and is fake-quantized per K group here (:func:`quant_phases`)."""
    nw = len(nblocks)
    x_refs = refs[:-(2 * nw + 1)]
    w_refs = refs[-(2 * nw + 1):-1]
    o_ref = refs[-1]
    i_n = pl.program_id(0)
    i_s = pl.program_id(1)
    out0 = pl.multiple_of(i_n * bn, bn)
    gbase = i_s * (steps * kg)

    def run(w_ref, s_ref, first):
        row0 = pl.multiple_of((i_n - first) * bn, bn)

        def g0_of(i):
            return pl.multiple_of(gbase + i * kg, kg)

        xrow0 = 0 if group_blocks is None else (i_n // group_blocks) * m

        def compute(i, tile, accs):
            parts = tile_partials(fmt, tile, x_refs, [xrow0 + r for r in range(m)], g0_of(i), kg, quant, route)
            return tuple(a + p for a, p in zip(accs, parts))

        accs = k_loop(steps, lambda i: load_tile(fmt, w_ref, s_ref, (), row0, bn, g0_of(i), kg, g), compute,
                      tuple(jnp.zeros((bn, kg), jnp.float32) for _ in range(m)))
        accs = [jnp.sum(a, axis=1) for a in accs]
        for r in range(m):
            if split:
                o_ref[i_s, r, pl.ds(out0, bn)] = accs[r]
            else:
                o_ref[r, pl.ds(out0, bn)] = accs[r].astype(o_ref.dtype)

    if nw == 1:
        run(w_refs[0], w_refs[1], 0)
        return
    first = 0
    for j, nb in enumerate(nblocks):
        pl.when((i_n >= first) & (i_n < first + nb))(functools.partial(run, w_refs[2 * j], w_refs[2 * j + 1], first))
        first += nb


def _fma_launch(xs, operands, *, fmt, m, n, k, g, config, nblocks, out_dtype, interpret, name, group_blocks=None,
                quant=False, raw=False, route=None):
    """One launch of :func:`_fma_kernel` over ``n`` output rows (grid: bn-row blocks x K parts), the K
    parts summed by XLA after it -> [m, n] out_dtype; with ``raw`` the K parts as they are, [splits,
    m, n] float32 (also for one part), for :func:`pallas_triton_finish.split_finish`."""
    _, bn, kg, splits, warps, stages = config
    split = raw or splits > 1
    out_shape = (jax.ShapeDtypeStruct((splits, m, n), jnp.float32) if split
                 else jax.ShapeDtypeStruct((m, n), out_dtype))
    y = pl.pallas_call(
        functools.partial(_fma_kernel, fmt=fmt, m=m, bn=bn, kg=kg, steps=(k // g) // kg // splits, g=g,
                          split=split, nblocks=nblocks, group_blocks=group_blocks, quant=quant, route=route),
        out_shape=out_shape,
        grid=(n // bn, splits),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=name,
    )(*xs, *operands)
    if raw:
        return y
    # the K parts' sum and rounding as a deferred consumer would do them (one definition)
    return gemv_parts(y, out_dtype, y.shape[1:]).value() if split else y


def quantized_matmul_fma_multi(x2, ws, *, act_block, out_dtype, config, interpret=False, norms=None,
                               norm_eps=0.0, raw=False) -> list:
    """x2 [M, K] (M <= FMA_MAX_ROWS), ws FP8/MXFP4 weights [N_j, K] sharing format, block and K ->
    [x2 @ W_j.T as [M, N_j] out_dtype], in one kernel launch (plus the activation fake-quant and, when
    K is split, one sum): the projections that read one input (wq_a and wkv; the shared expert's w1
    and w3) cost one launch instead of one each. ``norms``: per weight an RMSNorm weight [N_j] or
    None; where any is given the K parts are summed, rounded and normalized by one finish kernel
    (:func:`pallas_triton_finish.split_finish`) instead of XLA's sum and norm. ``raw`` (one weight,
    no norms): the K parts [splits, M, N] float32 as the kernel wrote them."""
    ws = list(ws)
    if raw and (len(ws) != 1 or norms is not None):
        raise ValueError("quantized_matmul (pallas, fma): raw K parts are for one weight without norms")
    reason = multi_reason(x2.shape[0], ws, config)
    if reason is not None:
        raise ValueError(f"quantized_matmul (pallas, fma): {reason}")
    bn = config[1]
    m, k = x2.shape
    ns = [w.shape[0] for w in ws]
    n = sum(ns)
    g = group_size(ws[0])
    fmt = "fp8" if isinstance(ws[0], Fp8Tensor) else "fp4"
    site = act_quant_site(ws[0], act_block)
    quant = site == "kernel"
    if site == "pallas":
        xs = act_quant_view(x2, ws[0], interpret=interpret)
    else:
        xs = act_view(x2, ws[0], widen=False) if quant else act_view(act_quant(x2, act_block).astype(jnp.bfloat16), ws[0])
    operands = [v for w in ws for v in weight_view(w)]
    finish = norms is not None and any(nw is not None for nw in norms)
    y = _fma_launch(xs, operands, fmt=fmt, m=m, n=n, k=k, g=g, config=config, nblocks=tuple(v // bn for v in ns),
                    out_dtype=out_dtype, interpret=interpret, quant=quant, raw=finish or raw,
                    route=None if fmt == "fp8" else fp4_route(ws[0]),
                    name=f"qmm_fma_{fmt}" if len(ws) == 1 else f"qmm_fma_{fmt}_x{len(ws)}")
    if finish:
        return split_finish(y, ns, norms, eps=norm_eps, out_dtype=out_dtype, interpret=interpret)
    if len(ws) == 1:
        return [y]
    offs = [0]
    for v in ns:
        offs.append(offs[-1] + v)
    return [y[:, a:b] for a, b in zip(offs[:-1], offs[1:])]


def quantized_matmul_fma(x2, w, *, act_block, out_dtype, config, interpret=False, raw=False):
    """x2 [M, K] (M <= FMA_MAX_ROWS), w FP8/MXFP4 [N, K] -> [M, N] out_dtype; with ``raw`` the K parts
    [splits, M, N] float32 before XLA's sum (for a consumer that sums them: ``deferred_sum``)."""
    return quantized_matmul_fma_multi(x2, [w], act_block=act_block, out_dtype=out_dtype, config=config,
                                      interpret=interpret, raw=raw)[0]


GROUPED_MAX_ROWS = 8  # rows per group of the grouped GEMV (wo_a at batch 8: one kernel instead of XLA's
#                       dequantize of the whole weight + a batched dot)


def grouped_config(m: int, w, groups: int):
    """The fma configuration of :func:`quantized_matmul_fma_grouped` for ``m`` rows per group against
    ``w`` [G*N, K], or None when it cannot take it: :func:`default_config` over G weights of N rows,
    so that bn divides each group's N (a program never straddles two groups) and the K split counts
    every group's blocks."""
    n, k = w.shape
    if n % groups:
        return None
    cfg = default_config(m, (n // groups,) * groups, k, w)
    return cfg if unsupported_reason(m, w, cfg, max_rows=GROUPED_MAX_ROWS) is None else None


def quantized_matmul_fma_grouped(x3, w, *, out_dtype, config, interpret=False):
    """x3 [M, G, K] (M <= GROUPED_MAX_ROWS), w FP8/MXFP4 [G*N, K] (group-major rows) -> y [M, G, N]
    out_dtype with ``y[:, g] = x3[:, g] @ W[g*N:(g+1)*N].T``: V4's grouped low-rank output projection
    (``wo_a``), which has **no** activation fake-quant (the reference multiplies the bf16 activation
    by the dequantized weight). One launch over every group; fp32 products and sums as the
    reference's dot, in another order."""
    m, groups, k = x3.shape
    n = w.shape[0]
    reason = ("w rows must split into the groups" if n % groups or w.shape[1] != k
              else unsupported_reason(m, w, config, max_rows=GROUPED_MAX_ROWS))
    if reason is not None:
        raise ValueError(f"grouped GEMV (pallas, fma): x {tuple(x3.shape)}, w {tuple(w.shape)}: {reason}")
    bn = config[1]
    if (n // groups) % bn:
        raise ValueError(f"grouped GEMV (pallas, fma): bn={bn} must divide each group's {n // groups} rows")
    fmt = "fp8" if isinstance(w, Fp8Tensor) else "fp4"
    xs = act_view(jnp.swapaxes(x3, 0, 1).reshape(groups * m, k), w)  # group-major rows, as read by the kernel
    y = _fma_launch(xs, weight_view(w), fmt=fmt, m=m, n=n, k=k, g=group_size(w), config=config,
                    nblocks=(n // bn,), out_dtype=out_dtype, interpret=interpret, name=f"qmm_fma_{fmt}_grouped",
                    group_blocks=(n // groups) // bn, route=None if fmt == "fp8" else fp4_route(w))
    return y.reshape(m, groups, n // groups)
