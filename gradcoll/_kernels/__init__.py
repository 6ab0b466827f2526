"""Kernel implementations of the fused mean-reduce + finite-check.

Each backend lives in its own module and is imported lazily by
``gradcoll._kernels.select``; nothing here imports Numba, the compiled
extension or CUDA at import time.
"""
