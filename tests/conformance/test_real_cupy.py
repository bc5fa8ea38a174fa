"""Conformance of the GPU path with the real CuPy 13 and 14 wheels, NCCL and
numba-cuda, on a machine without a GPU.

``cupy_probe.py`` calls every entry point gpustrat uses with the argument types
gpustrat passes, in a child process per CuPy version. A call may fail for lack of a
device; it must never fail with TypeError or AttributeError, which would mean gpustrat
calls the package in a way that version does not accept. The wheels come from
``python tests/conformance/install_cupy.py`` (``.ci/run`` runs it); without them these
tests skip, and fail when ``GPUSTRAT_TEST_CONFORMANCE=1`` says they must be there.
"""

from __future__ import annotations

import ast
import configparser
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))
from mpi_util import repo_env  # noqa: E402
from cupy_probe import COVERED_ELSEWHERE, ENTRY_POINTS  # noqa: E402
from install_cupy import TARGETS  # noqa: E402

ENV_DIR = "GPUSTRAT_CONFORMANCE_DIR"
ENV_REQUIRED = "GPUSTRAT_TEST_CONFORMANCE"
VERSIONS = ("13", "14")
TIMEOUT_S = 240

#: What a call may raise on a machine without a GPU: the packages' own "no device"
#: errors. NCCL answers a call without a device with ncclUnhandledCudaError, and a
#: call on the null communicator with ncclInvalidArgument.
NO_DEVICE = {
    "cupy_backends.cuda.api.runtime.CUDARuntimeError",
    "cupy_backends.cuda.api.driver.CUDADriverError",
    "cupy_backends.cuda.libs.nccl.NcclError",
    "numba.cuda.cudadrv.error.CudaSupportError",
}
NCCL_NO_DEVICE = ("NCCL_ERROR_UNHANDLED_CUDA_ERROR", "NCCL_ERROR_INVALID_ARGUMENT")


def conformance_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or REPO / ".conformance")


def child_path(version: str) -> str | None:
    """``PYTHONPATH`` selecting CuPy ``version`` and NCCL, or None when not installed."""
    root = conformance_dir()
    dirs = [root / f"cupy{version}", root / "nccl"]
    if not all(d.is_dir() for d in dirs):
        return None
    return os.pathsep.join([*(str(d) for d in dirs), str(REPO)])


def require(version: str) -> str:
    path = child_path(version)
    if path is None:
        reason = (f"CuPy {version} and NCCL are not installed under {conformance_dir()}: "
                  "run python tests/conformance/install_cupy.py")
        if os.environ.get(ENV_REQUIRED, "").strip() == "1":
            pytest.fail(f"{ENV_REQUIRED}=1 says the real wheels must be there, but {reason}",
                        pytrace=False)
        pytest.skip(reason)
    return path


def run_child(version: str, args: list) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=require(version))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def _probe(version: str) -> dict:
    proc = run_child(version, [str(HERE / "cupy_probe.py")])
    assert proc.returncode == 0, f"probe for CuPy {version} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(version: str) -> dict:
    require(version)
    report = _probe(version)
    if report.get("gpus"):
        pytest.skip(f"{report['gpus']} GPU(s) visible: the conformance probes use made-up "
                    "device addresses; tests/gpu runs the real calls on this machine")
    return report


# --- every entry point -------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("version", VERSIONS)
def test_entry_point_accepts_gpustrats_arguments(version, name):
    report = probe(version)
    assert report["cupy"].split(".")[0] == version
    got = report["entries"][name]
    if got["outcome"] == "returned":
        return
    kind = got["type"]
    why = f"{name} on CuPy {report['cupy']}: {kind}: {got['message']}\n{got['traceback']}"
    if kind in NO_DEVICE:
        if kind.endswith("NcclError"):
            assert got["message"].startswith(NCCL_NO_DEVICE), why
        return
    # CuPy swallowed a no-device error inside the call (a Cython function without an
    # exception clause goes on with a default value), and that default then failed:
    # the call got past the argument checks. CuPy 13's from_dlpack does this.
    assert set(got["swallowed"]) & NO_DEVICE, why


@pytest.mark.parametrize("version", VERSIONS)
def test_no_entry_point_is_deprecated(version):
    # A deprecated call works today and is gone in a later major version.
    warned = {name: got["warnings"] for name, got in probe(version)["entries"].items()
              if any(w.startswith(("DeprecationWarning", "FutureWarning"))
                     for w in got["warnings"])}
    assert not warned, warned


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("version", VERSIONS)
def test_multi_worker_nccl_construction_reaches_nccl(version):
    # gpustrat's own constructor, with the real unique id and the real
    # NcclCommunicator: on a machine without a GPU NCCL itself refuses, after the id
    # was accepted (CuPy 14 refused the tuple id with a TypeError).
    got = probe(version)["entries"]["gpustrat.collectives.nccl.NcclCommunicator(workers=2)"]
    assert got["outcome"] == "raised", got
    assert (got["type"], got["message"].split(":")[0]) == (
        "cupy_backends.cuda.libs.nccl.NcclError", "NCCL_ERROR_UNHANDLED_CUDA_ERROR"), got


@pytest.mark.parametrize("version,form", [("13", "tuple"), ("14", "bytes")])
def test_unique_id_form_per_version(version, form):
    got = probe(version)["entries"]["cupy.cuda.nccl.get_unique_id"]
    assert got["outcome"] == "returned" and got["value"] == repr(f"{form} of 128 bytes"), got


# ncclDataType_t and ncclRedOp_t (nccl.h): the numbers NCCL reads. gpustrat passes
# CuPy's constants; they must be these.
NCCL_H = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3,
          "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7,
          "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9,
          "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}


@pytest.mark.parametrize("version", VERSIONS)
def test_nccl_enums_are_nccl_hs(version):
    from gpustrat.collectives import nccl
    report = probe(version)
    assert report["nccl_available"] is True
    used = set(nccl.NCCL_DTYPES.values()) | set(nccl.NCCL_OPS.values())
    assert used <= set(NCCL_H)
    assert {n: report["nccl_constants"].get(n) for n in NCCL_H} == NCCL_H


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("version", VERSIONS)
def test_info_says_nccl_loaded_and_its_version(version):
    report = probe(version)
    proc = run_child(version, ["-m", "gpustrat", "info", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout)
    assert f"cupy-cuda13x {report['cupy']}" in info["cupy"]
    assert info["nccl"] == "loaded"
    runtime, built = (int(v) for v in report["entries"]["cupy.cuda.nccl.get_version"]
                      ["value"].strip("()").split(", "))

    def text(v):
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    assert info["nccl version"] == f"{text(runtime)} (CuPy built against {text(built)})"
    assert str(conformance_dir().resolve() / "nccl") in info["nccl library"]
    assert info["gpu count"] == 0 and info["nccl communicators"].startswith("unusable")


DESCRIBE = r"""
import json, sys
import numpy as np
import cupy as cp
sys.path.insert(0, "tests/conformance")
from cupy_probe import fake_array
from gpustrat.kernels import _launch

shapes = [(3,), (5, 2), (1, 1), (0, 4), (7, 3, 2)]
tensors = [fake_array(cp, s, ptr=0x10000 * (k + 1)) for k, s in enumerate(shapes)]
fast = hasattr(tensors[0], "_c_contiguous")
d = _launch.describe(tensors, np.float32)
out = {"fast": fast, "ptrs": d.ptrs.tolist(), "sizes": d.sizes.tolist(),
       "devices": sorted(d.devices), "all_host": d.all_host, "errors": []}
# what each array says through the public attributes
out["expected"] = [[t.data.ptr for t in tensors], [t.size for t in tensors]]
bad = {
    "strided then dtype": [tensors[0], fake_array(cp, (4, 8)).T,
                           fake_array(cp, (2,), np.float64)],
    "dtype then strided": [tensors[0], tensors[1], fake_array(cp, (2,), np.float64),
                           fake_array(cp, (4, 8))[:, ::2]],
    "misaligned": [tensors[0], fake_array(cp, (2,), ptr=0x10002)],
}
for name, arrays in bad.items():
    try:
        _launch.describe(arrays, np.float32, what="out")
        out["errors"].append([name, "returned", ""])
    except Exception as e:
        out["errors"].append([name, type(e).__name__, str(e)])
print(json.dumps(out))
"""


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("version", VERSIONS)
def test_describe_reads_real_cupy_arrays(version):
    # The launchers read a fusion bucket's arrays through CuPy's contiguity flag and
    # comprehensions over the list; what they read must be what the public attributes
    # say, and a bad array is named by its index in the list.
    proc = run_child(version, ["-c", DESCRIBE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["fast"], f"CuPy {version} arrays have no _c_contiguous: the general path runs"
    assert [got["ptrs"], got["sizes"]] == got["expected"]
    assert got["sizes"] == [3, 10, 1, 0, 42] and got["devices"] == [0]
    assert got["all_host"] is False
    assert got["errors"] == [
        ["strided then dtype", "ValueError", "out 1 (shape (8, 4)) is not C-contiguous"],
        ["dtype then strided", "TypeError", "out 2 has dtype float64, expected float32: "
         "one launch handles one dtype (bucket tensors by dtype)"],
        ["misaligned", "ValueError", "out 1 at address 0x10002 is not aligned to its item "
         "size 4"]]


# --- the list is complete (no wheels needed) ---------------------------------------------

def _chain(node) -> list | None:
    """``a.b.c`` as ``[root, "b", "c"]`` with root a Name id or ``"cupy()"``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        root = node.id
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "cupy"):
        root = "cupy()"
    else:
        return None
    return [root] + parts[::-1]


def used_entry_points() -> dict:
    """Every CuPy, NCCL and Numba attribute the package's source reaches, by name,
    with a file that uses it."""
    roots = {"cp": "cupy", "xp": "cupy", "cupy()": "cupy"}
    found = {}
    files = sorted((REPO / "gpustrat").rglob("*.py")) + sorted((REPO / "kernels").glob("*.py"))
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("gpustrat/testing/"):
            continue                             # the sanitizer's fakes of these packages
        local = dict(roots)
        if rel in ("gpustrat/collectives/nccl.py", "gpustrat/collectives/rendezvous.py"):
            local["nccl"] = "cupy.cuda.nccl"     # the module, bound by nccl_module()
        if rel.startswith("kernels/"):
            local["cuda"] = "numba.cuda"         # bound to numba.cuda on first launch
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or isinstance(parents.get(node),
                                                                 ast.Attribute):
                continue
            chain = _chain(node)
            if chain and chain[:2] == ["self", "_nccl"]:
                chain = ["nccl"] + chain[2:]
                local.setdefault("nccl", "cupy.cuda.nccl")
            if not chain or chain[0] not in local or len(chain) < 2:
                continue
            rest = chain[1:]
            if local[chain[0]] == "numba.cuda":
                rest = rest[:1]                  # cuda.blockIdx.x -> numba.cuda.blockIdx
            found.setdefault(".".join([local[chain[0]], *rest]), rel)
    return found


def test_every_entry_point_the_source_uses_is_probed():
    used = used_entry_points()
    # The scan sees the calls it should (a scan finding nothing passes anything).
    assert {"cupy.cuda.Device", "cupy.empty", "cupy.cuda.nccl.NcclCommunicator",
            "numba.cuda.compile_ptx", "cupy.RawModule", "numba.cuda.blockIdx"} <= set(used), used
    missing = {n: f for n, f in used.items()
               if n not in ENTRY_POINTS and n not in COVERED_ELSEWHERE}
    assert not missing, ("add a probe to tests/conformance/cupy_probe.py (and a row to "
                         f"docs/kernels.md) for: {missing}")


def test_cuda_extras_bring_nccl():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extras = {k: v.split() for k, v in cfg["options.extras_require"].items()}
    for cuda in ("12", "13"):
        reqs = " ".join(extras[f"cuda{cuda}"])
        assert f"cupy-cuda{cuda}x" in reqs and f"nvidia-nccl-cu{cuda}>=" in reqs, reqs
    assert "nvidia-nccl-cu13>=2.27.7,<3" in TARGETS["nccl"]


def test_info_without_cupy_says_nccl_is_not_loaded():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, json; sys.modules['cupy'] = None\n"
         "import importlib.util as u; real = u.find_spec\n"
         "u.find_spec = lambda n, *a: None if n.split('.')[0] == 'cupy' else real(n, *a)\n"
         "from gpustrat.cli import collect_info; print(json.dumps(collect_info()))"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env=repo_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["nccl"] == "not loaded (CuPy not installed)"
    assert "nccl version" not in info
