"""Run-time numerics switches (static under jit)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
KV_CACHE_DTYPES = ("reference", "bfloat16", "float32")
ATTENTION_ROUNDINGS = ("row_max", "kernel_blocks")
# DeepSeek's sparse_attn kernel takes 64 keys per step of its online softmax (inference/kernel.py)
KERNEL_BLOCK_KEYS = 64


@dataclass(frozen=True)
class RunOptions:
    """``dtype``: compute dtype of activations (``bfloat16``, the reference's, or ``float32``).

    ``kv_cache_dtype``: ``reference`` stores the window KV as FP8 e4m3 (ue8m0 scale per 32, RoPE dims
    included), the compressed KV as FP4 with an e4m3 scale per 16 and the index keys as MXFP4, and
    fake-quantizes the indexer queries to MXFP4 — exactly the rounding DeepSeek's code applies;
    ``bfloat16`` / ``float32`` store them unquantized (no KV / indexer rounding at all).

    ``attention_rounding`` (bf16 only): how the sparse attention rounds its unnormalised P.V weights
    ``exp(l - m)`` to bf16. ``row_max`` (the default) takes m as the row's maximum in the XLA
    reference; where the Pallas kernel runs instead (under ``auto`` on a GPU: prefill chunks of >= 256
    rows over V4.1's stores, since session 41), m is its online softmax's running maximum over 64-key
    blocks, DeepSeek's loop over our 128-slot window list (without DeepSeek's narrower window list for
    a prompt shorter than the window, which ``kernel_blocks`` adds). ``kernel_blocks``
    emulates DeepSeek's kernel bit for bit up to fp32 summation order: m is the running maximum over
    blocks of 64 keys of the index list. The two differ only for keys in blocks before the one
    holding the row's maximum, by one or two bf16 ulps in 14-19 % of the outputs of a 640-key list
    (tests/pallas_kernels/test_sparse_attention.py). ``kernel_blocks`` costs time on an H200
    (BENCHMARKS.md, issue 5, sessions 36-37), so it is for numerics comparisons, not the default.
    The blocks are DeepSeek's also for a prompt shorter than the window, whose prefill window list
    DeepSeek makes as wide as the prompt (``attention.deepseek_window_width``), and for the DSpark
    stages' lists (``dspark.stage_key_indices``).
    Wherever the Pallas sparse attention runs it, the kernel walks the lists in 64-key blocks with one
    split, which is DeepSeek's loop. Under ``auto`` on a GPU that is from 256 query rows on (prefill
    steps): on the H200 (session 37) the 4096-token prefill 5,604 (row max, XLA) -> 5,388 tok/s,
    against 4,790 with the XLA emulation; on an H100 (session 41, with the kernel's word decode)
    5,362 (row max, XLA) / 5,543 (row max, kernel) -> 5,591 tok/s. Decode steps of fewer rows keep
    the XLA emulation: batch-1 decode 143.5 -> 138.8 tok/s."""

    dtype: str = "bfloat16"
    kv_cache_dtype: str = "reference"
    # V4 only: the Hadamard rotation of the indexer q and k (DeepSeek's reference, the default).
    # ``False`` is the HF comparison mode: transformers' ``deepseek_v4`` leaves the rotation out
    # (with unquantized index keys the rotation changes only float rounding: H is orthonormal).
    hadamard: bool = True
    attention_rounding: str = "row_max"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r} (flag --dtype)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r} "
                "(flag --kv-cache-dtype)"
            )
        if self.attention_rounding not in ATTENTION_ROUNDINGS:
            raise ValueError(f"attention_rounding must be one of {', '.join(ATTENTION_ROUNDINGS)}, got "
                             f"{self.attention_rounding!r} (flag --attention-rounding)")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def quantized_kv(self) -> bool:
        return self.kv_cache_dtype == "reference"

    @property
    def running_max_block(self) -> int | None:
        """The sparse attention's ``running_max_block`` argument for this rounding."""
        return KERNEL_BLOCK_KEYS if self.attention_rounding == "kernel_blocks" else None

    @property
    def kv_dtype(self):
        """Storage dtype of unquantized caches."""
        return DTYPES.get(self.kv_cache_dtype, jnp.float32)


def add_numerics_args(parser) -> None:
    """The numerics flags every CLI takes (``generate``, ``bench``, ``spec_bench``): ``--dtype``,
    ``--kv-cache-dtype`` and ``--attention-rounding``, on an argparse parser or argument group;
    :func:`run_options_from_args` turns them into :class:`RunOptions`."""
    defaults = RunOptions()
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=defaults.dtype, help="compute dtype")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype,
                        help="reference = DeepSeek's FP8/FP4 cache rounding; bfloat16 / float32 store unrounded values")
    parser.add_argument("--attention-rounding", choices=ATTENTION_ROUNDINGS, default=defaults.attention_rounding,
                        help="bf16 P.V weights of the sparse attention: row_max (fast) or kernel_blocks (as DeepSeek's "
                             "kernel: running maximum over blocks of 64 keys; slower at decode)")


def run_options_from_args(args, **extra) -> RunOptions:
    """:class:`RunOptions` from the flags :func:`add_numerics_args` declared (plus ``extra`` fields)."""
    return RunOptions(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                      attention_rounding=args.attention_rounding, **extra)
