"""Build the optional compiled kernels; gradcoll works without them (Numba/NumPy fallbacks)."""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension(
    "gradcoll.kernels._cython_kernels",
    ["gradcoll/kernels/_cython_kernels.pyx"],
    include_dirs=[np.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    depends=["gradcoll/kernels/_fused.h"],
    # No contraction into fused multiply-adds: every backend must round each operation as IEEE does.
    extra_compile_args=["-O3", "-ffp-contract=off"] if os.name != "nt" else [],
)

# The tcp transport's send/receive/wait loops (gradcoll/transport/_tcp_io.pyx); POSIX sockets only.
tcp_io = Extension(
    "gradcoll.transport._tcp_io",
    ["gradcoll/transport/_tcp_io.pyx"],
    extra_compile_args=["-O3"] if os.name != "nt" else [],
)

setup(ext_modules=cythonize([ext] + ([tcp_io] if os.name == "posix" else []),
                            compiler_directives={"language_level": "3"}))
