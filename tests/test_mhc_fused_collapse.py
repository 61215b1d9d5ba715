"""V4.1's mHC expansion fused with the next site's collapse and mixes (``transformer.block``,
``hc_expand_collapse_mixes`` / ``hc_expand_collapse``): which sites fuse, and that the model's output
does not change, at a decode size (the fused mixes kernel) and a prefill size (its fallback).

V4.1 collapses a site's input with the previous site's ``pre``, so the FFN input's collapse is
computed in the attention expansion's kernel, and the next layer's attention input in the FFN
expansion's kernel unless Engram changes the streams in between (and the head's collapse after the
last layer). The mHC ops run on their Pallas kernels in interpret mode, every other op on its
reference; the fused and unfused forwards must give the same logits: the fused kernel performs the
expansion kernel's operations and then the collapse kernel's on the streams rounded to their dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import transformer
from dsv41_jax import Model
from dsv41_jax.cache import init_cache
from dsv41_jax.options import RunOptions
from pallas_kernels import dispatch
from pallas_kernels.mhc import pallas_triton as mhc_kernel


@pytest.mark.parametrize("B,S", [(2, 3), (1, 9)])
def test_fused_expand_collapse_sites_and_same_logits(monkeypatch, B, S):
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, impl, *a, **k: choose(
        op, impl if op.startswith("hc_") else "reference", *a, **k))
    calls = {"hc_expand_collapse_mixes": 0, "hc_expand_collapse": 0, "hc_collapse": 0, "hc_expand": 0, "hc_mixes": 0}
    for name in calls:
        real = getattr(mhc_kernel, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mhc_kernel, name, spy)

    model = Model.from_preset("tiny", seed=np.random.randint(1 << 30))
    cfg, params = model.cfg, model.params
    assert not cfg.is_v4 and set(cfg.engram_layer_ids) == {1, 4}
    opts = RunOptions(dtype="bfloat16")
    rng = np.random.default_rng()
    toks = rng.integers(3, 5000, (B, S))
    ids = model.engram_ids(toks, np.broadcast_to(np.arange(S), (B, S)))

    def run(fused):
        monkeypatch.setattr(transformer, "FUSE_EXPAND_COLLAPSE", fused)
        for k in calls:
            calls[k] = 0
        step = jax.jit(functools.partial(transformer.forward_step, cfg=cfg, opts=opts))  # traced afresh
        with dispatch.use_implementation("interpret"):
            logits, _ = step(params, init_cache(cfg, B, 16, opts), jnp.asarray(toks, jnp.int32),
                             jnp.asarray([S, S - 1][:B], jnp.int32), ids)
        return dict(calls), np.asarray(logits)

    n = cfg.n_layers
    fused_calls, fused = run(True)
    # fused: every layer's attention expansion (with the FFN site's mixes), and its FFN expansion
    # unless layer l + 1 has Engram (l = 0, 3): with the next layer's mixes for l = 1, 2, 4..7, the
    # head's collapse alone for l = 8. Separate: layer 0's attention input (the embedding) and the two
    # Engram layers' (collapse and mixes), the expansions of layers 0 and 3.
    fused_sites = n + (n - 3)
    if B * S <= mhc_kernel.MIX_FUSED_MAX_T:  # decode sizes: the expansion + collapse + mixes kernels
        want = {"hc_expand_collapse_mixes": fused_sites, "hc_expand_collapse": 1, "hc_mixes": 3}
    else:  # prefill sizes: the op falls back to hc_expand_collapse + hc_mixes
        want = {"hc_expand_collapse_mixes": 0, "hc_expand_collapse": fused_sites + 1, "hc_mixes": 3 + fused_sites}
    assert fused_calls == {**want, "hc_collapse": 3, "hc_expand": 2}
    plain_calls, plain = run(False)
    assert plain_calls == {"hc_expand_collapse_mixes": 0, "hc_expand_collapse": 0, "hc_collapse": 2 * n + 1,
                           "hc_expand": 2 * n, "hc_mixes": 2 * n}
    assert np.all(np.isfinite(fused)) and np.std(fused) > 0
    np.testing.assert_array_equal(fused, plain)
