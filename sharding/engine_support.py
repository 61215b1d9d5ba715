"""The command-line side of running on a mesh: the ``--mesh`` flag and multi-host start-up.

    from sharding.engine_support import add_mesh_argument, mesh_from_args
    add_mesh_argument(parser)                       # --mesh dp=1,tp=2,ep=2 (and multi-host init)
    mesh = mesh_from_args(args)                     # None without --mesh
    eng = Engine(model, ..., mesh=mesh)             # the engine places itself on the mesh

:class:`dsv41_jax.engine.Engine` takes the mesh itself (``mesh=``): parameters placed by the rule
table, the cache created in its shardings, rows split over ``dp`` in every compiled step. The
checkpoint loader can place shards directly with
``load_checkpoint(path, shardings=param_shardings(cfg, mesh))``.
"""

from __future__ import annotations

from .mesh import make_mesh


def add_mesh_argument(parser):
    """Add ``--mesh SPEC`` to an argparse parser (or argument group)."""
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
