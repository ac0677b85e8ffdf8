"""Triton kernels for CUDA outside attention: the weight-only int8 and int4 products
(``quant_matmul.py``). Imported only where a CUDA model is quantized (or by the tests, under
Triton's CPU interpreter), so CPU-only runs never import Triton."""
