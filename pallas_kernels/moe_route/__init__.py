"""MoE routing selection: the router's scores, the biased top-k and the normalised weights."""

from .api import route_select

__all__ = ["route_select"]
