"""Fused Triton kernels (placeholder package init, replaced by the kernels work)."""
