"""DSpark speculative decoding on a mesh (``SpeculativeGenerator(..., mesh=)``, ``spec_bench
--mesh``): on 2 virtual CPU devices (a subprocess: the device count must be set before JAX is
imported) the fixture model with its routed experts split over ``ep=2`` generates exactly the
single-device tokens (float32), with the experts really split; ``dp > 1`` is refused with the flag
to change.

The model is the fixture's first 3 layers (``tiny_short.cut_layers``: SWA, SWA + Engram, ratio 2)
and its 3 DSpark stages, retargeted to those layers: ``ep`` splits only the routed experts, which
every layer and stage has (the attention kinds of layers 3-8 run replicated, as without a mesh).
The subprocess compiles at XLA's default level (``multi_device.env``): 62.6 -> 40.5 CPU-s."""

from __future__ import annotations

from multi_device import run_script

SCRIPT = r'''
import os, jax, numpy as np
from dsv41_jax.model import Model
from dsv41_jax.options import RunOptions
from dsv41_jax.speculative import SpeculativeGenerator
from sharding.mesh import make_mesh

assert jax.device_count() == 2
from tests.tiny_short import cut_layers, cut_params
full = Model.from_checkpoint(os.path.join("tests", "fixtures", "v41_tiny_a"))
model = Model(cut_layers(full.cfg, 3), cut_params(full.params, 3), tokenizer=full.tokenizer)
assert model.cfg.n_layers == 3 and len(model.params["mtp"]) == 3
opts = RunOptions(dtype="float32", kv_cache_dtype="float32")
rng = np.random.default_rng(5)
prompts = [[0] + rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (19, 33, 7)]
kw = dict(batch_size=2, max_seq_len=96, opts=opts, prefill_chunk=16, stop_ids=())
one = SpeculativeGenerator(model, **kw).generate(prompts, 10)
mesh = make_mesh("ep=2")
g = SpeculativeGenerator(model, mesh=mesh, **kw)
w1 = jax.tree.leaves(g.params["layers"]["2"]["ffn"]["experts"]["w1"])[0]  # [E, I, D] (fixture: plain f32)
assert not w1.sharding.is_fully_replicated and w1.sharding.shard_shape(w1.shape)[0] == w1.shape[0] // 2
two = g.generate(prompts, 10)
assert two == one, (two, one)
try:
    SpeculativeGenerator(model, mesh=make_mesh("dp=2"), **kw)
    raise SystemExit("dp=2 was accepted")
except ValueError as e:
    assert "dp=1" in str(e) and "--mesh" in str(e), e
print("OK")
'''


def test_dspark_on_an_ep_mesh_equals_one_device():
    run_script(SCRIPT, devices=2)
