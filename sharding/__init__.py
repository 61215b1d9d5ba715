"""Sharding for dsv41_jax: device meshes (:mod:`.mesh`), one partition-rule table for parameters,
caches and activations (:mod:`.rules`), expert-parallel MoE (:mod:`.expert_parallel`), the dp row
``shard_map`` and a sharded forward step (:mod:`.step`), the ``--mesh`` flag (:mod:`.engine_support`)
and multi-host start-up (:mod:`.distributed`). :class:`dsv41_jax.engine.Engine` takes a mesh itself
(``mesh=``). All communication is JAX's own: ``jax.sharding`` / GSPMD, ``jax.shard_map`` with XLA
collectives, ``jax.distributed``.
"""

from .mesh import AXES, MeshSpecError, describe, make_mesh, mesh_sizes, parse_mesh_spec
from .rules import (cache_shardings, constrain, explain, init_cache_sharded, logical_spec, param_partition_specs,
                    param_shardings, shard_params, use_mesh)

__all__ = [
    "AXES", "MeshSpecError", "describe", "make_mesh", "mesh_sizes", "parse_mesh_spec", "cache_shardings", "constrain",
    "explain", "init_cache_sharded", "logical_spec", "param_partition_specs", "param_shardings", "shard_params",
    "use_mesh",
]
