"""Running :class:`dsv41_jax.engine.Engine` and the CLI on a mesh, without changes to them beyond
one call each.

    from sharding.engine_support import add_mesh_argument, mesh_from_args, shard_engine
    add_mesh_argument(parser)                       # --mesh dp=1,tp=2,ep=2 (and multi-host init)
    mesh = mesh_from_args(args)                     # None without --mesh
    eng = Engine(model, ...)
    if mesh is not None:
        shard_engine(eng, mesh)                     # before eng.warmup()

:func:`shard_engine` re-places the engine's parameters (rule table) and creates its cache directly
in its shardings (batch over ``dp``), then runs every later ``step`` / ``reset`` under
``use_mesh(mesh)``, which makes the MoE expert-parallel and keys jit's cache on the mesh. Inputs
the engine builds per step (tokens, Engram ids or host-gathered rows) are uncommitted arrays and
are moved by jit. The checkpoint loader places shards directly with
``load_checkpoint(path, shardings=param_shardings(cfg, mesh))``.
"""

from __future__ import annotations

import functools

from .mesh import make_mesh
from .rules import init_cache_sharded, shard_params, use_mesh


def shard_engine(engine, mesh):
    """Move an Engine onto ``mesh`` (in place; returns it)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    engine.params = shard_params(engine.params, engine.cfg, mesh)
    engine.cache = init_cache_sharded(engine.cfg, mesh, engine.B, engine.max_seq_len, engine.opts)
    engine.mesh = mesh
    # the engine's other device state (Engram history / hash tables, per-step inputs it places on
    # ``_dev``) goes to every device of the mesh, replicated
    rep = NamedSharding(mesh, P())
    if hasattr(engine, "_dev"):
        engine._dev = rep
    for name, val in list(vars(engine).items()):
        if name in ("params", "cache") or val is None:
            continue
        leaves = jax.tree.leaves(val)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            setattr(engine, name, jax.device_put(val, rep))
    for name in ("step", "reset"):
        fn = getattr(type(engine), name).__get__(engine)

        @functools.wraps(fn)
        def wrapped(*a, _fn=fn, **k):
            with use_mesh(mesh):
                return _fn(*a, **k)

        setattr(engine, name, wrapped)
    return engine


def add_mesh_argument(parser):
    parser.add_argument("--mesh", default=None, metavar="SPEC",
                        help="device mesh, e.g. 'dp=1,tp=2,ep=2' (axes dp, ep, tp; one may be -1 = the rest); "
                             "multi-host: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID")
    return parser


def mesh_from_args(args):
    """``jax.distributed`` start-up from the environment (multi-host), then the mesh of ``--mesh``
    (None when not given)."""
    from .distributed import initialize

    initialize()
    spec = getattr(args, "mesh", None)
    return make_mesh(spec) if spec else None
