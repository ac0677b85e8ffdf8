"""C kernels for the CPU (compiled on first use, called through ctypes) and CPU feature probes."""
