"""Triton paged-attention kernels for CUDA: decode (split-K) and extend (prefill chunks)."""
