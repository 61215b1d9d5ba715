"""Manifold-constrained hyper-connections: mix coefficients (Sinkhorn), collapse and expand."""

from .api import hc_collapse, hc_expand, hc_expand_collapse, hc_expand_collapse_mixes, hc_mixes

__all__ = ["hc_collapse", "hc_expand", "hc_expand_collapse", "hc_expand_collapse_mixes", "hc_mixes"]
