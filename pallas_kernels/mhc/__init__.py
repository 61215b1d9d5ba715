"""Manifold-constrained hyper-connections: mix coefficients (Sinkhorn), collapse and expand."""

from .api import SiteMixes, SitePartials, hc_collapse, hc_expand, hc_mixes, hc_site_in, hc_site_out

__all__ = ["SiteMixes", "SitePartials", "hc_collapse", "hc_expand", "hc_mixes", "hc_site_in", "hc_site_out"]
