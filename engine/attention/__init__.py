"""Paged attention backends: the interface, the torch backend (CPU), Triton kernels (GPU)."""
