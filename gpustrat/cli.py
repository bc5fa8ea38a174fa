"""``python -m gpustrat``: the demo, an environment report and the benchmark suites.

    python -m gpustrat demo [--devices cpu:0 cpu:1] [--epochs N] [--quick] [--[no-]multi-worker]
    python -m gpustrat info [--json]
    python -m gpustrat bench [NAME ...] [--quick] [--json FILE] [--plot FILE.png]
    python -m gpustrat timeline summary FILE [--json] [--plot OUT.png] | merge PATH

Importing this module does nothing; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

USAGE = """\
usage: python -m gpustrat COMMAND [ARGS]

commands:
  demo    train a two-layer MLP data-parallel on every GPU, else on two CPU replicas;
          under an MPI launcher (`mpiexec -n W python -m gpustrat demo`, `srun`) over
          the W workers
  info    versions, MPI, NCCL, devices and CUDA simulator state, for bug reports
          (--json for JSON)
  bench   run the benchmark suites of a source checkout's benchmarks/ folder
  timeline  summarize a timeline (GPUSTRAT_TIMELINE=PATH): step times, waits, the
          rank the others waited for, bytes/s, a Gantt chart; or merge its rank files

`python -m gpustrat COMMAND --help` tells more about each.
"""


def main(argv=None) -> int:
    """Run one command; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        from gpustrat import __version__  # noqa: PLC0415
        print(f"gpustrat {__version__}")
        return 0
    commands = {"demo": cmd_demo, "info": cmd_info, "bench": cmd_bench,
                "timeline": cmd_timeline}
    if argv[0] not in commands:
        print(f"gpustrat: unknown command {argv[0]!r}; choose one of "
              f"{', '.join(commands)}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


# --- demo ---------------------------------------------------------------------------------

def cmd_demo(argv) -> int:
    from gpustrat import demo  # noqa: PLC0415
    demo.main(argv, prog="python -m gpustrat demo")
    return 0


def cmd_timeline(argv) -> int:
    from gpustrat.timeline import summary  # noqa: PLC0415
    return summary.main(argv)


# --- info ---------------------------------------------------------------------------------

NOT_INSTALLED = "not installed"


def _dist_version(*names: str) -> str:
    from importlib import metadata  # noqa: PLC0415
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def _cupy_version() -> str:
    from importlib import metadata  # noqa: PLC0415
    found = sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith("cupy"))
    return ", ".join(found) if found else NOT_INSTALLED


def _mpi_info() -> dict:
    """mpi4py's MPI library, asked before MPI_Init (which these two calls allow), so
    that ``info`` starts no MPI runtime; if that is refused, ``from mpi4py import MPI``
    initialises MPI as usual."""
    try:
        import mpi4py  # noqa: PLC0415
    except ImportError:
        return {"mpi library": NOT_INSTALLED}
    try:
        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
        from mpi4py import MPI  # noqa: PLC0415
        # The first line names the library and version; MPICH adds a page of build flags.
        lib = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        major, minor = MPI.Get_version()
        return {"mpi library": lib, "mpi standard": f"{major}.{minor}"}
    except Exception as e:  # a broken MPI install is worth reporting, not dying on
        return {"mpi library": f"error: {type(e).__name__}: {e}"}


def _mpiexec() -> str:
    from gpustrat.launch import find_mpiexec  # noqa: PLC0415
    return find_mpiexec() or "not found"


def _nccl_info() -> dict:
    """Whether CuPy loaded an NCCL library, its version and file, and whether NCCL
    communicators can be made here (that also needs a GPU). Asked of CuPy directly:
    a machine without a GPU still tells whether the library is installed right."""
    import importlib.util  # noqa: PLC0415
    if importlib.util.find_spec("cupy") is None:
        return {"nccl": "not loaded (CuPy not installed)"}
    try:
        import warnings  # noqa: PLC0415
        with warnings.catch_warnings():
            # CuPy warns when it finds no NCCL library; "not loaded" below says so.
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl  # noqa: PLC0415
        if not getattr(nccl, "available", False):
            return {"nccl": "not loaded: CuPy found no NCCL library (install the "
                            "nvidia-nccl-cu12 or -cu13 wheel matching the CuPy wheel, "
                            "e.g. pip install 'gpustrat[cuda13]')"}
        out = {"nccl": "loaded",
               "nccl version": f"{_nccl_version_text(nccl.get_version())} (CuPy built "
                               f"against {_nccl_version_text(nccl.get_build_version())})",
               "nccl library": _loaded_library("libnccl") or "unknown"}
    except Exception as e:  # a broken CUDA install is worth reporting, not dying on
        return {"nccl": f"not loaded ({type(e).__name__}: {e})"}
    from gpustrat.collectives import nccl as gpustrat_nccl  # noqa: PLC0415
    out["nccl communicators"] = ("usable" if gpustrat_nccl.is_available()
                                 else "unusable: no GPU is visible")
    return out


def _nccl_version_text(code) -> str:
    v = int(code)
    # NCCL encodes 2.18.3 as 21803 (and versions before 2.9 as 2183).
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)


def _loaded_library(stem: str) -> str | None:
    """The file of the shared library ``stem*`` mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith(stem + "."):
                    return path
    except OSError:
        pass
    return None


def collect_info() -> dict:
    """Everything ``info`` reports, as a flat dict of strings and numbers."""
    from gpustrat import __version__  # noqa: PLC0415
    from gpustrat import devices  # noqa: PLC0415
    info = {
        "gpustrat": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
                  f"{sys.executable})",
        "platform": platform.platform(),
        "cpu count": os.cpu_count(),
        "numpy": _dist_version("numpy"),
        "cupy": _cupy_version(),
        "numba": _dist_version("numba"),
        "numba-cuda": _dist_version("numba-cuda", "numba_cuda"),
        "mpi4py": _dist_version("mpi4py"),
    }
    info.update(_mpi_info())
    info["mpiexec"] = _mpiexec()
    info.update(_nccl_info())
    info["gpu count"] = devices.gpu_count()
    info["default devices"] = ", ".join(d.name for d in devices.default_devices())
    # The demo shows distribution even without a GPU: two CPU replicas, not one.
    from gpustrat.demo import default_devices as demo_devices  # noqa: PLC0415
    info["demo devices"] = ", ".join(demo_devices())
    info["cuda simulator"] = ("on (NUMBA_ENABLE_CUDASIM=1)"
                              if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "off")
    return info


def cmd_info(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m gpustrat info",
                                description="Report versions, MPI, NCCL and devices: "
                                "paste this into a bug report.")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of key: value lines (default: off)")
    args = p.parse_args(argv)
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


# --- bench --------------------------------------------------------------------------------

BENCH_HELP = """\
Run the benchmark suites in the benchmarks/ folder of a gpustrat source checkout
(benchmarks/ is not installed with the package: run this from a clone, installed with
pip install -e). Each suite is a module benchmarks/bench_NAME.py with main(argv) -> dict;
it runs in its own process (with a timeout) and prints its table. Suites whose
docstring says to run `mpiexec -n N python benchmarks/bench_NAME.py` run that way, and
are skipped with a message when mpiexec or mpi4py is missing. Where TensorFlow or
PyTorch imports, suites print their numbers beside gpustrat's (not with --quick).

A suite's output is relayed as it comes; after --heartbeat seconds of silence a line
says it still runs. Each target is printed with its verdict beside it (met, NOT met,
or not measured and why; suites make them with benchmarks/targets.py), and all verdicts
are listed again under "== targets ==" at the end. A --quick run (small sizes) judges no
target: each shows its figure and "not judged (quick)". --list says what each suite
measures.
"""

# Runs inside the suite's process: load the module from its file, call main(argv) and
# let the first rank write the returned dict as JSON.
_RUNNER = r"""
import importlib.util, json, sys
path, out, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
spec = importlib.util.spec_from_file_location("gpustrat_bench_suite", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
result = mod.main(argv)
rank = 0
if "mpi4py.MPI" in sys.modules:
    MPI = sys.modules["mpi4py.MPI"]
    if MPI.Is_initialized() and not MPI.Is_finalized():
        rank = MPI.COMM_WORLD.Get_rank()
if rank == 0:
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=repr)
"""


def benchmarks_dir() -> Path | None:
    """The checkout's benchmarks/ folder (GPUSTRAT_BENCHMARKS overrides), or None."""
    env = os.environ.get("GPUSTRAT_BENCHMARKS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    return here if here.is_dir() else None


def discover_suites(folder: Path) -> dict:
    """``{name: path}`` of ``bench_NAME.py`` files, in name order."""
    return {p.stem[len("bench_"):]: p for p in sorted(folder.glob("bench_*.py"))}


def mpi_ranks(path: Path) -> int:
    """Ranks a suite needs: its ``MPI_RANKS`` constant, else N where its docstring says
    to run ``mpiexec -n N python benchmarks/bench_NAME.py``, else 0 (the suite runs
    without mpiexec, or launches mpiexec itself). Read from the source, not imported."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MPI_RANKS" for t in node.targets):
            return int(ast.literal_eval(node.value))
    m = re.search(rf"mpiexec\s+-n\s+(\d+)\s+python3?\s+\S*{re.escape(path.name)}",
                  ast.get_docstring(tree) or "")
    return int(m.group(1)) if m else 0


def suite_summary(path: Path) -> str:
    """What a suite measures: the first sentence of its docstring (read, not imported)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")
    return first.split(". ")[0].rstrip(".:") or "(no docstring)"


def _child_env(repo: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    # Ranks share one stdout pipe: whole buffered lines keep them from interleaving.
    env.pop("PYTHONUNBUFFERED", None)
    # Peers' start-up chatter (TensorFlow's oneDNN and CPU-feature notices) hides the tables.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _relay(stream, state: dict) -> None:
    """Copy a suite's output lines to ours as they come, noting when the last one came."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        state["last"] = time.monotonic()


def run_suite(name: str, path: Path, quick: bool, timeout: float, ranks: int,
              heartbeat: float = 15.0) -> dict:
    """Run one suite in a subprocess (under mpiexec when ``ranks``); its result dict, or
    ``{"error": ...}`` / ``{"skipped": ...}``. The suite's output is relayed line by line;
    after ``heartbeat`` seconds without output a line says that it still runs."""
    import threading  # noqa: PLC0415
    cmd = [sys.executable, "-c", _RUNNER]
    if ranks:
        exe = _mpiexec()
        if exe == "not found":
            return {"skipped": f"suite {name} needs mpiexec -n {ranks}, and no mpiexec was "
                               "found beside Python or on PATH (pip install -e '.[mpi]')"}
        try:
            import mpi4py  # noqa: F401, PLC0415
        except ImportError:
            return {"skipped": f"suite {name} needs mpi4py (pip install -e '.[mpi]')"}
        from gpustrat.launch import mpiexec_command  # noqa: PLC0415
        cmd = mpiexec_command(ranks, exe) + cmd
    with tempfile.TemporaryDirectory(prefix="gpustrat-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd += [str(path), str(out)] + (["--quick"] if quick else [])
        sys.stdout.flush()
        env = _child_env(path.parent.parent)
        env.pop("GPUSTRAT_BENCH_QUICK", None)
        if quick:  # benchmarks/targets.py judges no target of a quick run
            env["GPUSTRAT_BENCH_QUICK"] = "1"
        proc = subprocess.Popen(cmd, env=env, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        start = time.monotonic()
        state = {"last": start}
        reader = threading.Thread(target=_relay, args=(proc.stdout, state), daemon=True)
        reader.start()
        rc = None
        while rc is None:
            try:
                rc = proc.wait(timeout=min(1.0, heartbeat))
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - start > timeout:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    reader.join(timeout=5)
                    return {"error": f"timed out after {timeout:g} s"}
                if now - state["last"] >= heartbeat:
                    print(f"  [{name}] still running: {now - start:.0f} s so far "
                          f"(timeout {timeout:g} s)", flush=True)
                    state["last"] = now
        reader.join(timeout=5)
        if rc != 0:
            return {"error": f"exited with status {rc} (its output is above)"}
        if not out.exists():
            return {"error": "finished without a result (main(argv) returned nothing?)"}
        return json.loads(out.read_text())


#: The reason of a verdict that a quick run does not judge (its sizes are too small).
QUICK = "quick"


def format_verdict(v: dict) -> str:
    """A suite's verdict on one target (``benchmarks/targets.py`` makes them):
    ``NAME: VALUE (goal OP GOAL): met | NOT met``, ``... not judged (quick)`` or
    ``... not measured (why)``."""
    unit = f" {v['unit']}" if v.get("unit") else ""
    goal = f"goal {v.get('op', '>=')} {_num(v['goal'])}{unit}"
    if v.get("met") is None and v.get("reason") == QUICK:
        value = f": {_num(v['value'])}{unit}" if v.get("value") is not None else ""
        return f"{v['name']}{value} ({goal}): not judged (quick)"
    if v.get("met") is None:
        return f"{v['name']} ({goal}): not measured ({v.get('reason', 'no value')})"
    return f"{v['name']}: {_num(v['value'])}{unit} ({goal}): {'met' if v['met'] else 'NOT met'}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def print_verdicts(report: dict) -> None:
    """Every suite's targets with their verdicts, and the count of each."""
    rows = [(name, v) for name, result in report["suites"].items()
            for v in (result.get("verdicts") or [])]
    if not rows:
        return
    print("== targets ==")
    for name, v in rows:
        print(f"{name:>10}  {format_verdict(v)}")
    print(_count_verdicts([v for _, v in rows]))


def _count_verdicts(verdicts: list) -> str:
    judged = [v for v in verdicts if v.get("reason") != QUICK]
    counts = [(sum(v.get("met") is want for v in judged), label)
              for want, label in ((True, "met"), (False, "not met"), (None, "not measured"))]
    counts.append((len(verdicts) - len(judged), "not judged (quick)"))
    return ", ".join(f"{n} target(s) {label}" if i == 0 else f"{n} {label}"
                     for i, (n, label) in enumerate(counts) if n or i == 0)


def _unwritable(path: str) -> str | None:
    """Why results cannot be written to ``path`` (its folder is made when missing), or
    None."""
    target = Path(path)
    if target.is_dir():
        return "is a folder"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"its folder cannot be made ({e.strerror})"
    if not os.access(target.parent, os.W_OK) or \
            (target.exists() and not os.access(target, os.W_OK)):
        return "not writable"
    return None


def cmd_bench(argv) -> int:
    folder = benchmarks_dir()
    p = argparse.ArgumentParser(prog="python -m gpustrat bench", description=BENCH_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="suites to run, e.g. run input fusion (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes: seconds per suite (default: off, full sizes)")
    p.add_argument("--json", metavar="FILE",
                   help="write every suite's result dict here (default: not written)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw throughput against batch size and replica count (runs the "
                        "sweep suite; needs matplotlib: pip install -e '.[plot]') "
                        "(default: no plot)")
    p.add_argument("--list", action="store_true",
                   help="list the suites and exit (default: off)")
    p.add_argument("--timeout", type=float,
                   help="seconds per suite before it is killed (default: 120 with --quick, "
                        "else 1200)")
    p.add_argument("--heartbeat", type=float, default=15.0, metavar="SECONDS",
                   help="say that a suite still runs after this many seconds without "
                        "output (default: 15)")
    args = p.parse_args(argv)
    if folder is None or not folder.is_dir():
        print("gpustrat bench: no benchmarks/ folder found next to the gpustrat package "
              f"({Path(__file__).resolve().parent.parent}); the bench command runs the "
              "suites of a source checkout: clone the repository and pip install -e it, or "
              "set GPUSTRAT_BENCHMARKS to the folder", file=sys.stderr)
        return 2
    suites = discover_suites(folder)
    if args.list:
        for name, path in suites.items():
            ranks = mpi_ranks(path)
            print(f"{name}: {suite_summary(path)} ({path.name}"
                  + (f", mpiexec -n {ranks})" if ranks else ")"))
        return 0
    names = list(dict.fromkeys(args.names or suites))
    unknown = [n for n in names if n not in suites]
    if unknown:
        print(f"gpustrat bench: no suite named {', '.join(unknown)}; the suites are: "
              f"{', '.join(suites)}", file=sys.stderr)
        return 2
    if args.plot:
        import importlib.util  # noqa: PLC0415
        if importlib.util.find_spec("matplotlib") is None:
            print("gpustrat bench: --plot needs matplotlib, which is not installed: "
                  "pip install -e '.[plot]'", file=sys.stderr)
            return 2
        if "sweep" not in suites:
            print(f"gpustrat bench: --plot draws the sweep suite, but {folder} has no "
                  "bench_sweep.py", file=sys.stderr)
            return 2
        if "sweep" not in names:
            names.append("sweep")
    for option, value in (("--timeout", args.timeout), ("--heartbeat", args.heartbeat)):
        if value is not None and not value > 0:  # NaN too
            print(f"gpustrat bench: {option} {value:g} must be a positive number of "
                  "seconds", file=sys.stderr)
            return 2
    for option, out in (("--json", args.json), ("--plot", args.plot)):
        problem = out and _unwritable(out)
        if problem:
            print(f"gpustrat bench: {option} {out}: {problem}; give a file in a folder "
                  "you can write (checked before any suite runs)", file=sys.stderr)
            return 2
    timeout = args.timeout or (120.0 if args.quick else 1200.0)
    from gpustrat import __version__  # noqa: PLC0415
    report = {"gpustrat": __version__, "python": platform.python_version(),
              "platform": platform.platform(), "cpu_count": os.cpu_count(),
              "quick": args.quick, "suites": {}}
    failed = []
    for name in names:
        ranks = mpi_ranks(suites[name])
        print(f"== {name} ({suites[name].name}"
              + (f", mpiexec -n {ranks}" if ranks else "") + ") ==", flush=True)
        t0 = time.perf_counter()
        result = run_suite(name, suites[name], args.quick, timeout, ranks, args.heartbeat)
        seconds = time.perf_counter() - t0
        if "skipped" in result:
            print(f"skipped: {result['skipped']}")
        elif "error" in result:
            print(f"FAILED: suite {name} {result['error']}")
            failed.append(name)
        if args.quick:  # also a suite's verdict made without benchmarks/targets.py
            for v in result.get("verdicts") or []:
                if v.get("met") is not None:
                    v.update(met=None, reason=QUICK)
        report["suites"][name] = result
        summary = _count_verdicts(result.get("verdicts") or []) or "no targets"
        print(f"-- {name}: {seconds:.1f} s, {summary}\n", flush=True)
    print_verdicts(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=repr)
        print(f"results written to {args.json}")
    if args.plot and "rows" in report["suites"].get("sweep", {}):
        _load_suite(suites["sweep"]).plot(report["suites"]["sweep"]["rows"], args.plot)
        print(f"plot written to {args.plot}")
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _load_suite(path: Path):
    import importlib.util  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location(f"gpustrat_bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
