"""Work-arounds for the Pallas-Triton lowering, applied once for every kernel in the process.

Imported by every ``pallas_triton.py``; each fix checks that the JAX it patches still has the
exact code it fixes and leaves the lowering untouched otherwise.
"""

from __future__ import annotations


def _patch_triton_offsets() -> bool:
    """Work around a Pallas-Triton lowering bug: ``_compute_offsets_from_indices`` uses 32-bit element
    offsets whenever the array has at most 2**32 *bytes*, but Triton's ``addptr`` sign-extends i32
    offsets, so an element offset >= 2**31 wraps negative (illegal address). This hits uint8 arrays
    of 2-4 GB, e.g. the stacked MXFP4 experts [384, 2304, 2560] (2.26 GB). Re-define the function
    with the 64-bit threshold at 2**31 bytes. Returns whether the patch was applied."""
    import inspect
    import textwrap

    from jax._src.pallas.triton import lowering as tl

    fn = tl._compute_offsets_from_indices
    if getattr(fn, "_dsv41_patched", False):
        return True
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    old = "64 if full_size > 2**32 else 32"
    if old not in src:
        return False
    ns: dict = {}
    try:
        exec(compile(src.replace(old, "64 if full_size > 2**31 else 32"), tl.__file__, "exec"), tl.__dict__, ns)
        new = ns["_compute_offsets_from_indices"]
    except Exception:  # noqa: BLE001  (a different JAX version: leave the lowering untouched)
        return False
    new._dsv41_patched = True
    tl._compute_offsets_from_indices = new
    return True


TRITON_OFFSETS_PATCHED = _patch_triton_offsets()
