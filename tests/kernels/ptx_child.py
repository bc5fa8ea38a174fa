"""Compile every kernel specialisation to PTX (run by test_kernels_ptx.py).

Exit status 77 with a ``SKIP:`` line when no CUDA toolkit (libNVVM) is found; any
other failure is an ordinary error. Prints one ``COMPILED`` line per kernel module.

Each specialisation is compiled the way a GPU launch compiles it
(``_launch.Kernel.ptx``), and its entry's parameters are checked against the
arguments the launchers pass through CuPy (``_launch.flatten``): one parameter per
argument word, of the same size, in the same order.
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.exit("ptx_child.py must run without NUMBA_ENABLE_CUDASIM (the simulator "
             "cannot compile to PTX)")

try:
    from numba import cuda  # noqa: F401
    from numba.cuda.cudadrv import nvvm
except ImportError as e:
    print(f"SKIP: Numba CUDA is not installed ({e}): pip install -e '.[kernels]'")
    sys.exit(77)
try:
    nvvm.NVVM()
    nvvm.LibDevice()
except Exception as e:  # NvvmSupportError, a missing libdevice, a broken library path
    print(f"SKIP: no CUDA toolkit with libNVVM and libdevice found ({type(e).__name__}: {e}); install "
          "the CUDA toolkit or point CUDA_HOME at it to compile the kernels to PTX")
    sys.exit(77)

from gpustrat.kernels import _launch, pack, split  # noqa: E402

CCS = [(8, 0), (9, 0)]
PARAM = re.compile(r"\.param\s+\.[bsuf](\d+)\s")


def entry_params(ptx: str, entry: str) -> list[int]:
    """The sizes in bytes of the parameters of kernel ``entry``, in order."""
    start = ptx.index(entry + "(")
    return [int(bits) // 8 for bits in PARAM.findall(ptx[start:ptx.index(")", start)])]


for module in (split, pack):
    count = 0
    for kernel in module.specialisations():
        dummy = [(0, (1,) * a.ndim) if a.ndim else 0 for a in kernel.signature]
        passed = [p.dtype.itemsize for p in _launch.flatten(kernel.signature, dummy)]
        for cc in CCS:
            ptx, entry = kernel.ptx(cc)
            target = f".target sm_{cc[0]}{cc[1]}"
            if target not in ptx:
                sys.exit(f"{module.__name__}.{kernel.name}{kernel.signature} for cc {cc}: "
                         f"the PTX has no {target!r}")
            declared = entry_params(ptx, entry)
            if declared != passed:
                sys.exit(f"{module.__name__}.{kernel.name}{kernel.signature} for cc {cc}: "
                         f"the kernel declares parameters of {declared} bytes, the "
                         f"launcher passes {passed}")
            count += 1
    print(f"COMPILED {module.__name__} {count}", flush=True)
