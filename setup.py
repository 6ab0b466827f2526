"""Build the optional compiled extensions; gradcoll works without them (Numba/NumPy/Python fallbacks).

* ``gradcoll.kernels._cython_kernels``: the reduction kernels with the lowest per-call cost;
* ``gradcoll.transport._window_c``: the waiting protocol of shared windows (futex, liveness probes);
* ``gradcoll.algorithms._direct_c``: the direct allreduce over a window, one ``nogil`` call per collective.
* ``gradcoll.transport._tcp_io``: the tcp transport's send/receive/wait loops, without the GIL, and its
  small exchange-and-reduce step (``_fused.h``'s accumulate).

Floating-point contraction is off: the kernels and the deterministic reduction rely on every
multiply and add being rounded on its own, as IEEE says (an FMA would change its bits).
"""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

flags = ["-O3"] if os.name != "nt" else []
# No contraction into fused multiply-adds: every backend must round each operation as IEEE does.
exact = flags + (["-ffp-contract=off"] if os.name != "nt" else [])
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
exts = [
    Extension("gradcoll.kernels._cython_kernels", ["gradcoll/kernels/_cython_kernels.pyx"],
              include_dirs=[np.get_include()], define_macros=macros, depends=["gradcoll/kernels/_fused.h", "gradcoll/kernels/_wide.h"],
              extra_compile_args=exact),
    Extension("gradcoll.transport._window_c", ["gradcoll/transport/_window_c.pyx"], extra_compile_args=exact),
    Extension("gradcoll.algorithms._direct_c", ["gradcoll/algorithms/_direct_c.pyx"],
              include_dirs=[np.get_include()], define_macros=macros,
              depends=["gradcoll/kernels/_fused.h", "gradcoll/kernels/_wide.h", "gradcoll/kernels/_window_kernels.h"],
              extra_compile_args=exact + (["-Wno-unused-function"] if os.name != "nt" else [])),  # uses a few of _fused.h's
]

# The tcp transport's send/receive/wait loops and its small exchange-and-reduce step
# (gradcoll/transport/_tcp_io.pyx, with a few of _fused.h's loops); POSIX sockets only.
if os.name == "posix":
    exts.append(Extension("gradcoll.transport._tcp_io", ["gradcoll/transport/_tcp_io.pyx"],
                          include_dirs=[np.get_include()], define_macros=macros, depends=["gradcoll/kernels/_fused.h", "gradcoll/kernels/_wide.h"],
                          extra_compile_args=exact + ["-Wno-unused-function"]))

setup(ext_modules=cythonize(exts, compiler_directives={"language_level": "3"}))
