"""The timeline's files: each rank's events streamed to ``PATH.rank<N>.events``, and
the merged Chrome trace at ``PATH``.

A rank's file is a stream of chunks, each a 4-byte little-endian length and a
``marshal`` dump of a list of event tuples ``(name, category, track, start ns, end
ns, args)`` (a category of None marks metadata; ``args`` is None, a dict, ``((key,
value), ...)``, a run's step number (category ``step``), a wait's collective kind (a
string), or for a collective ``(kind, dtype, bytes, replicas, workers, seq, ns
waiting for peers)``). Writing a chunk costs tens of
nanoseconds per event (formatting JSON costs microseconds, on the training threads'
CPU), and a file cut off by a crash still reads up to its last whole chunk. Its first
chunk is its header (``gpustrat_origin``: rank, ranks, host, and the wall-clock time
of its zero in ns since the epoch); ``gpustrat_end`` closes a file whose recording
ended (normally or by an exception). Merging turns every rank's events into Chrome
trace events (the JSON object format: ``traceEvents``, times in microseconds),
shifted onto the earliest rank's zero.

The files are read with ``marshal``: read only timeline files your own jobs wrote.
"""

from __future__ import annotations

import collections
import json
import marshal
import os
import re
import struct
import threading
import time

FLUSH_S = 0.2  # how often the writer thread writes the queued events
MISSING_GRACE_S = 1.0  # how long a merge waits for a rank that has no file at all
MAGIC = b"gpustrat-timeline 1\n"
_LEN = struct.Struct("<I")


def rank_path(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.events"


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
        self.named: set = {0}
        self.nvtx = False
        #: ``strategy.run`` calls recorded so far (each one's ``step``).
        self.steps = 0
        #: Collectives recorded so far (each one's ``seq``).
        self.collectives = 0
        self.base = time.perf_counter_ns()
        import socket  # noqa: PLC0415 - only once recording starts
        origin = time.time_ns()
        self._file = open(self.file_path, "wb")  # noqa: SIM115
        self._file.write(MAGIC)
        self._write([("gpustrat_origin", None, 0, 0, 0,
                      {"epoch_ns": origin, "base_ns": self.base, "rank": self.rank,
                       "size": self.size, "host": socket.gethostname(),
                       "os_pid": os.getpid()}),
                     ("thread_name", None, 0, 0, 0, {"name": "replica 0 (caller)"})])
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpustrat-timeline",
                                        daemon=True)
        self._thread.start()

    def thread_name(self, tid: int, name: str) -> None:
        self.named.add(tid)
        self.events.append(("thread_name", None, tid, 0, 0, {"name": name}))

    def _write(self, events: list) -> None:
        data = marshal.dumps(events)
        self._file.write(_LEN.pack(len(data)) + data)
        self._file.flush()

    def flush(self) -> None:
        with self._write_lock:
            if self._file is None:
                return
            q, batch = self.events, []
            while q:
                batch.append(q.popleft())
            if batch:
                self._write(batch)

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
        with self._write_lock:
            self._write([("gpustrat_end", None, 0, 0, 0,
                          {"steps": self.steps, "collectives": self.collectives})])
            self._file.close()
            self._file = None


# --- reading --------------------------------------------------------------------------------

def read_rank_file(path: str) -> tuple[dict, list, bool]:
    """A rank file's header, its events (tuples) and whether it is complete
    (``gpustrat_end`` present); a chunk cut off by a crash is left out.

    Raises:
        ValueError: the file is not a timeline rank file.
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a gpustrat timeline rank file (it does not start "
                         f"with {MAGIC!r})")
    at, events = len(MAGIC), []
    while at + 4 <= len(data):
        (n,) = _LEN.unpack_from(data, at)
        if at + 4 + n > len(data):
            break
        try:
            events.extend(marshal.loads(data[at + 4:at + 4 + n]))
        except (ValueError, EOFError, TypeError):
            break
        at += 4 + n
    header = next((e[5] for e in events if e[0] == "gpustrat_origin" and e[1] is None), {})
    complete = any(e[0] == "gpustrat_end" and e[1] is None for e in events)
    return header, events, complete


def rank_files(path: str) -> dict:
    """``{rank: file}`` of the per-rank files of ``path``."""
    import glob  # noqa: PLC0415
    found = {}
    for f in glob.glob(glob.escape(path) + ".rank*.events"):
        m = re.fullmatch(re.escape(path) + r"\.rank(\d+)\.events", f)
        if m:
            found[int(m.group(1))] = f
    return dict(sorted(found.items()))


def _chrome(rank: int, event: tuple, base: int, shift_us: float) -> dict:
    """One event tuple as a Chrome trace event of track ``(rank, tid)``."""
    name, cat, tid, t0, t1, args = event
    if cat is None:
        return {"name": name, "ph": "M", "pid": rank, "tid": tid, "args": args}
    e = {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
         "ts": round((t0 - base) / 1000 + shift_us, 3), "dur": round((t1 - t0) / 1000, 3)}
    if cat == "collective":  # (kind, dtype, bytes, replicas, workers, seq, wait ns)
        kind, dtype, nbytes, replicas, workers, seq, wait = args
        args = {"kind": kind, "dtype": dtype, "bytes": nbytes, "replicas": replicas,
                "workers": workers, "seq": seq, "wait_us": round(wait / 1000, 3),
                "move_us": round((t1 - t0 - wait) / 1000, 3)}
    elif cat == "step":  # a run's step
        args = {"step": args, "replica": tid}
    elif type(args) is str:  # a wait's collective kind
        args = {"kind": args}
    elif type(args) is tuple:  # ((key, value), ...)
        args = dict(args)
    if args:
        e["args"] = args
    return e


def _complete(path: str) -> bool:
    try:
        return read_rank_file(path)[2]
    except (OSError, ValueError):
        return False


def chrome_events(files: dict) -> tuple[list, list, int]:
    """The Chrome trace events of rank files ``{rank: file}`` (metadata first, then
    the spans by track and start), the ranks whose file is complete, and the wall-clock
    zero (ns since the epoch) of the times."""
    read = {r: read_rank_file(f) for r, f in files.items()}
    origin = min((h.get("epoch_ns", 0) for h, _, _ in read.values()), default=0)
    meta, spans, complete = [], [], []
    for r, (header, events, done) in read.items():
        if done:
            complete.append(r)
        meta += [{"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                  "args": {"name": f"rank {r}"}},
                 {"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
                  "args": {"sort_index": r}}]
        base = header.get("base_ns", 0)
        shift = (header.get("epoch_ns", origin) - origin) / 1000
        named = set()
        for ev in events:
            if ev[1] is None:
                if ev[0] == "thread_name":
                    named.add(ev[2])
                    meta.append(_chrome(r, ev, base, shift))
                continue
            if ev[2] not in named and ev[2] < 100:
                named.add(ev[2])
                meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": ev[2],
                             "args": {"name": f"replica {ev[2]}"}})
            spans.append(_chrome(r, ev, base, shift))
    spans.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    return meta + spans, complete, origin


def merge(path: str, size: int | None = None, wait: float = 0.0) -> dict:
    """Merge the per-rank files of ``path`` into the Chrome trace ``path``.

    Args:
        size: the number of ranks expected (default: the files found).
        wait: seconds to wait for ranks whose file is still being written. A rank with
            no file yet is waited for only ``MISSING_GRACE_S`` (every rank opens its
            file when it starts recording, long before the end; a rank that never
            records, such as a parameter server, has none).
    Returns:
        The trace written (``traceEvents`` and ``otherData``: ranks found, complete and
        missing).
    Raises:
        FileNotFoundError: no per-rank file of ``path`` exists.
    """
    start = time.monotonic()
    while True:
        files = rank_files(path)
        waited = time.monotonic() - start
        missing = [r for r in (range(size) if size else ()) if r not in files]
        if (all(_complete(f) for f in files.values()) and
                (not missing or waited >= min(wait, MISSING_GRACE_S))) or waited >= wait:
            break
        time.sleep(0.05)
    if not files:
        raise FileNotFoundError(f"no per-rank timeline files {path}.rank<N>.events found: "
                                "was the job run with GPUSTRAT_TIMELINE set to this path, "
                                "or gs.timeline.record(path)?")
    events, complete, origin = chrome_events(files)
    missing = sorted(set(range(size or 0)) - set(files))
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"generator": "gpustrat timeline", "ranks": sorted(files),
                           "complete": complete, "missing": missing,
                           "origin_epoch_ns": origin}}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
    return trace


def load(path: str) -> list:
    """The Chrome trace events of ``path``: a merged trace, one rank file, or (when
    ``path`` itself is absent) the rank files of ``path``, merged in memory.

    Raises:
        FileNotFoundError: neither exists. ValueError: not a trace.
    """
    if not os.path.exists(path):
        files = rank_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: no such trace, and no per-rank files "
                                    f"{path}.rank<N>.events")
        return chrome_events(files)[0]
    with open(path, "rb") as f:
        start = f.read(len(MAGIC))
    if start == MAGIC:
        m = re.search(r"\.rank(\d+)\.events$", path)
        return chrome_events({int(m.group(1)) if m else 0: path})[0]
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is neither a Chrome trace (JSON) nor a gpustrat "
                             f"timeline rank file: {e}") from None
    return data["traceEvents"] if isinstance(data, dict) else data
