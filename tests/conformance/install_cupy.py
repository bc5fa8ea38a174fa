"""Install the real CuPy wheels the conformance tests run against, side by side.

    python tests/conformance/install_cupy.py [DIR]      # default: <repo>/.conformance

Each CuPy major version goes into its own ``pip install --target`` folder, and NCCL
(the ``nvidia-nccl-cu13`` wheel, which CuPy finds through its package metadata) into
a third one that both share; a child process selects one CuPy by ``PYTHONPATH``. NumPy
and the rest come from the running environment. A folder whose requirements are
already installed is kept as it is, so a second run costs nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: folder -> the requirements installed into it (without their dependencies, which
#: are listed where the environment may lack them).
TARGETS = {
    "cupy13": ["cupy-cuda13x==13.*", "fastrlock>=0.5"],
    "cupy14": ["cupy-cuda13x==14.*", "cuda-pathfinder>=1.3.4,<2"],
    # CuPy's wheels for CUDA 13 want NCCL 2.27.7 or later, major version 2.
    "nccl": ["nvidia-nccl-cu13>=2.27.7,<3"],
}
MARKER = ".gpustrat-requirements.json"


def install(root: Path) -> dict:
    """Install every missing target under ``root``; returns seconds and MiB per target."""
    root.mkdir(parents=True, exist_ok=True)
    done = {}
    for name, reqs in TARGETS.items():
        target = root / name
        marker = target / MARKER
        if marker.exists() and json.loads(marker.read_text()) == reqs:
            done[name] = {"seconds": 0.0, "mib": _mib(target), "kept": True}
            continue
        shutil.rmtree(target, ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--disable-pip-version-check", "--target", str(target), *reqs],
                       check=True)
        marker.write_text(json.dumps(reqs))
        done[name] = {"seconds": round(time.perf_counter() - t0, 1), "mib": _mib(target),
                      "kept": False}
    return done


def _mib(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) >> 20


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else REPO / ".conformance"
    for name, info in install(root).items():
        how = "kept" if info["kept"] else f"installed in {info['seconds']} s"
        print(f"{root / name}: {' '.join(TARGETS[name])}: {how}, {info['mib']} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
