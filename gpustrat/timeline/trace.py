"""The timeline's files: each rank's events streamed to ``PATH.rank<N>.json``, and the
merged Chrome trace at ``PATH``.

A rank's file is a Chrome trace of its own (the JSON array format, whose closing
bracket trace viewers do not require): one event per line, so that a file cut off
by a crash still reads up to its last whole line. Its first metadata event,
``gpustrat_origin``, gives the wall-clock time (ns since the epoch) of its zero;
``gpustrat_end`` closes a file whose recording ended (normally or by an exception).
Merging shifts every rank's times onto the earliest rank's zero.
"""

from __future__ import annotations

import collections
import glob
import json
import math
import os
import re
import socket
import threading
import time

FLUSH_S = 0.2  # how often the writer thread writes the queued events


def rank_path(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.json"


def _launch() -> tuple[int, int]:
    from gpustrat.launch import detect_launch  # noqa: PLC0415
    launch = detect_launch()
    return (0, 1) if launch is None else (launch.rank, launch.size)


class Writer:
    """This rank's events: a queue filled by the hooks, written by a daemon thread."""

    def __init__(self, path: str):
        self.path = path
        self.rank, self.size = _launch()
        self.file_path = rank_path(path, self.rank)
        self.events: collections.deque = collections.deque()
        self.pending_device: collections.deque = collections.deque()
        self.device_end: dict = {}
        self.named: set = set()
        self.nvtx = False
        self._steps = 0
        self._collectives = 0
        self.base = time.perf_counter_ns()
        self.origin = time.time_ns()
        self._file = open(self.file_path, "w", encoding="utf-8")  # noqa: SIM115
        pid = self.rank
        head = [{"name": "gpustrat_origin", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"epoch_ns": self.origin, "rank": self.rank, "size": self.size,
                          "host": socket.gethostname(), "os_pid": os.getpid()}},
                {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"sort_index": self.rank}},
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": "replica 0 (caller)"}}]
        self.named.add(0)
        self._file.write("[\n" + "".join(json.dumps(e) + ",\n" for e in head))
        self._file.flush()
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpustrat-timeline",
                                        daemon=True)
        self._thread.start()

    def next_step(self) -> int:
        self._steps += 1
        return self._steps

    def next_collective(self) -> int:
        self._collectives += 1
        return self._collectives

    def thread_name(self, tid: int, name: str) -> None:
        self.named.add(tid)
        if 0 < tid < 100:
            name = f"replica {tid}"
        self.events.append(("thread_name", None, tid, 0, 0, {"name": name}))

    def _format(self, event) -> str:
        name, cat, tid, t0, t1, args = event
        if cat is None:  # metadata
            return json.dumps({"name": name, "ph": "M", "pid": self.rank, "tid": tid,
                               "args": args})
        if tid not in self.named and tid < 100:
            self.named.add(tid)
            self._file.write(json.dumps({"name": "thread_name", "ph": "M",
                                         "pid": self.rank, "tid": tid,
                                         "args": {"name": f"replica {tid}"}}) + ",\n")
        # By hand: json.dumps of a dict per event costs several times more.
        return (f'{{"name":{_js(name)},"cat":"{cat}","ph":"X","pid":{self.rank},'
                f'"tid":{tid},"ts":{(t0 - self.base) / 1000:.3f},'
                f'"dur":{(t1 - t0) / 1000:.3f}'
                + (f',"args":{_args_json(args)}}}' if type(args) is dict else
                   f',"args":{_collective_json(args, t1 - t0)}}}' if args else "}"))

    def flush(self) -> None:
        with self._write_lock:
            if self._file is None:
                return
            q, lines = self.events, []
            while q:
                lines.append(self._format(q.popleft()) + ",\n")
            if lines:
                self._file.write("".join(lines))
                self._file.flush()

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
        with self._write_lock:
            end = {"name": "gpustrat_end", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"steps": self._steps, "collectives": self._collectives}}
            self._file.write(json.dumps(end) + "\n]\n")
            self._file.close()
            self._file = None


_strings: dict = {}


def _js(text: str) -> str:
    """``text`` as a JSON string (remembered: a trace repeats a few names)."""
    out = _strings.get(text)
    if out is None:
        out = json.dumps(text)
        if len(_strings) < 4096:
            _strings[text] = out
    return out


def _collective_json(args: tuple, dur: int) -> str:
    """A collective's arguments, recorded as ``(kind, dtype, bytes, replicas, workers,
    seq, ns waiting for peers)``."""
    kind, dtype, nbytes, replicas, workers, seq, wait = args
    return (f'{{"kind":{_js(kind)},"dtype":"{dtype}","bytes":{nbytes},'
            f'"replicas":{replicas},"workers":{workers},"seq":{seq},'
            f'"wait_us":{wait / 1000:.3f},"move_us":{(dur - wait) / 1000:.3f}}}')


def _args_json(args: dict) -> str:
    parts = []
    for k, v in args.items():
        t = type(v)
        if t is str:
            v = _js(v)
        elif t is int:
            v = str(v)
        elif t is float and math.isfinite(v):
            v = repr(v)
        else:
            v = json.dumps(v if not (t is float) else None)
        parts.append(f"{_js(k)}:{v}")
    return "{" + ",".join(parts) + "}"


# --- reading and merging ----------------------------------------------------------------

def read_rank_file(path: str) -> tuple[list, bool]:
    """A rank's events, and whether its file is complete (``gpustrat_end`` present); a
    line cut off by a crash is skipped."""
    events, complete = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip().rstrip(",")
            if not line or line in ("[", "]"):
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("name") == "gpustrat_end":
                complete = True
            events.append(e)
    return events, complete


def rank_files(path: str) -> dict:
    """``{rank: file}`` of the per-rank files of ``path``."""
    found = {}
    for f in glob.glob(glob.escape(path) + ".rank*.json"):
        m = re.fullmatch(re.escape(path) + r"\.rank(\d+)\.json", f)
        if m:
            found[int(m.group(1))] = f
    return dict(sorted(found.items()))


def _complete(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 400))
            return b"gpustrat_end" in f.read()
    except OSError:
        return False


def merge(path: str, size: int | None = None, wait: float = 0.0) -> dict:
    """Merge the per-rank files of ``path`` into the Chrome trace ``path``.

    Args:
        size: the number of ranks expected (default: the files found).
        wait: seconds to wait for ranks whose file is missing or still being written.
    Returns:
        The trace written (``traceEvents`` and ``otherData``: ranks found, complete and
        missing).
    Raises:
        FileNotFoundError: no per-rank file of ``path`` exists.
    """
    deadline = time.monotonic() + wait
    while True:
        files = rank_files(path)
        expected = range(size) if size else files
        if all(r in files and _complete(files[r]) for r in expected) or \
                time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not files:
        raise FileNotFoundError(f"no per-rank timeline files {path}.rank<N>.json found: "
                                "was the job run with GPUSTRAT_TIMELINE set to this path, "
                                "or gs.timeline.record(path)?")
    per_rank, complete = {}, []
    origins = {}
    for r, f in files.items():
        events, done = read_rank_file(f)
        per_rank[r] = events
        if done:
            complete.append(r)
        origin = next((e["args"]["epoch_ns"] for e in events
                       if e.get("name") == "gpustrat_origin"), None)
        origins[r] = origin
    base = min((o for o in origins.values() if o is not None), default=0)
    out = []
    for r, events in per_rank.items():
        shift = ((origins[r] or base) - base) / 1000
        for e in events:
            if e.get("name") in ("gpustrat_origin", "gpustrat_end"):
                continue
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
            out.append(e)
    meta = [e for e in out if e.get("ph") == "M"]
    spans = sorted((e for e in out if e.get("ph") != "M"),
                   key=lambda e: (e["pid"], e["tid"], e["ts"], -e.get("dur", 0)))
    missing = sorted(set(range(size or 0)) - set(files))
    trace = {"traceEvents": meta + spans, "displayTimeUnit": "ms",
             "otherData": {"generator": "gpustrat timeline", "ranks": sorted(files),
                           "complete": complete, "missing": missing,
                           "origin_epoch_ns": base}}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
    return trace


def load(path: str) -> list:
    """The events of a trace: a merged trace (an object with ``traceEvents``), a
    per-rank file, or the per-rank files of ``path`` when ``path`` itself is absent."""
    if not os.path.exists(path):
        files = rank_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: no such trace, and no per-rank files "
                                    f"{path}.rank<N>.json")
        return [e for f in files.values() for e in read_rank_file(f)[0]]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return read_rank_file(path)[0]
    return data["traceEvents"] if isinstance(data, dict) else data
