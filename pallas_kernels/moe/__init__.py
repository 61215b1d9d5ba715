"""Routed-expert computation of the MoE: grouped SwiGLU experts with the clamp, weighted combine."""

from .api import moe_experts

__all__ = ["moe_experts"]
