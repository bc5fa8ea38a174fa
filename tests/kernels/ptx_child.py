"""Compile every kernel specialisation to PTX (run by test_kernels_ptx.py).

Exit status 77 with a ``SKIP:`` line when no CUDA toolkit (libNVVM) is found; any
other failure is an ordinary error. Prints one ``COMPILED`` line per kernel module.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.exit("ptx_child.py must run without NUMBA_ENABLE_CUDASIM (the simulator "
             "cannot compile to PTX)")

try:
    from numba import cuda
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

from gpustrat.kernels import pack, split, sum_buffers  # noqa: E402

CCS = [(8, 0), (9, 0)]
for module in (split, pack, sum_buffers):
    count = 0
    for fn, sig in module.ptx_signatures():
        for cc in CCS:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
            target = f".target sm_{cc[0]}{cc[1]}"
            if target not in ptx or ".entry" not in ptx:
                sys.exit(f"{module.__name__}.{fn.__name__}{sig} for cc {cc}: the PTX has "
                         f"no {target!r} or no kernel entry")
            count += 1
    print(f"COMPILED {module.__name__} {count}", flush=True)
