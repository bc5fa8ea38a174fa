"""Data-parallel training of a two-layer MLP with hand-written gradients.

The logic lives in :mod:`gpustrat.demo` (so that ``python -m gpustrat demo`` runs the
same code from an installed package); read that module for the training loop.

    python examples/train_mlp.py                              # default devices
    python examples/train_mlp.py --devices cpu:0 cpu:1        # 2 replicas, one process
    mpiexec -n 2 python examples/train_mlp.py --multi-worker --devices cpu:0 cpu:1
"""

import sys

from gpustrat.demo import main, train  # noqa: F401 - train is the API for callers

if __name__ == "__main__":
    main(sys.argv[1:], prog="train_mlp.py")
