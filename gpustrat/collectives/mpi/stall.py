"""The stall inspector: where every rank is when a collective waits too long.

Words:
- *stall*: a wait between workers that has lasted ``GPUSTRAT_STALL_WARNING`` seconds
  (default 10; ``0`` or ``off`` turns the inspector off).
- *place*: what a rank is doing, read from its threads' stacks: waiting in a
  collective (the collective, the gpustrat call the user made and the user's line that
  made it: ``Mean.result() at train.py:42``), working inside a gpustrat call that is
  not waiting for other ranks (``Checkpoint.save() at train.py:47``, writing files), or
  outside any gpustrat call (``train.py:50``, the user's own code).
- *survey*: a waiting rank asks every other rank for its place and prints every rank's
  place, and what the pattern means (the common case: a collective some workers
  called and others did not, as ``if task_id == 0: print(metric.result())``).

Every rank of a group runs one daemon thread that answers questions on its own
duplicated communicator. It looks for a question every ``_POLL_S`` (one MPI ``Test``)
and reads the stacks only when asked, so a step that waits less than the delay costs
nothing more: no call site is recorded anywhere in the steady state. A rank busy in
its own code answers too, as long as that code lets other Python threads run (pure
Python, sleeps, I/O and most NumPy calls do). The thread needs MPI's
``THREAD_MULTIPLE`` (mpi4py's default); without it there is no inspector.

At the deadline (``GPUSTRAT_TIMEOUT``) the :class:`~gpustrat.errors.CollectiveTimeout`
carries the same survey.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from gpustrat.collectives.mpi import waits as _waits
from gpustrat.collectives.mpi.header import _PKG, _PUBLIC, _STDLIB
from gpustrat.collectives.mpi.waits import ENV_TIMEOUT, _name, mpi, timeout_from_env

ENV_STALL_WARNING = "GPUSTRAT_STALL_WARNING"
DEFAULT_STALL_WARNING = 10.0
_POLL_S = 0.25  # how often each rank's thread looks for a question
_ANSWER_S = 2.0  # how long a survey waits for the answers before printing what it has
_ASK = 1  # tag of a question; its answer comes back on the tag the question names
_FIRST_ANSWER_TAG = 16

_inspectors: dict = {}  # id -> every running Inspector, stopped at interpreter exit
_hooks_installed = False
# Sends whose receiver may never take them (a survey that gave up): their buffers must
# outlive this process's use of them.
_orphans: list = []


def stall_warning_from_env() -> float | None:
    """``GPUSTRAT_STALL_WARNING`` in seconds (default 10), or None when it is ``0`` or
    ``off`` (no inspector)."""
    raw = os.environ.get(ENV_STALL_WARNING, "").strip().lower()
    if not raw:
        return DEFAULT_STALL_WARNING
    if raw in ("0", "off", "false", "no"):
        return None
    try:
        t = float(raw)
    except ValueError:
        t = float("nan")
    if not t > 0:
        raise ValueError(f"{ENV_STALL_WARNING}={raw!r} is not a positive number of seconds: "
                         f"unset it for the default {DEFAULT_STALL_WARNING:g} s, or set "
                         "'off' to turn the stall inspector off")
    return t


# --- a rank's place -----------------------------------------------------------------

def _is_user(filename: str) -> bool:
    return not filename.startswith(_PKG) and (not filename.startswith(_STDLIB)
                                              or "site-packages" in filename)


def _call_name(frame) -> str:
    """How the user wrote the gpustrat call of ``frame``: ``Mean.result()``,
    ``next(DistributedIterator)``."""
    code = frame.f_code
    name = code.co_name
    owner = frame.f_locals.get("self")
    cls = type(owner).__name__ if owner is not None else None
    if cls is None:
        qual = getattr(code, "co_qualname", name)
        cls = qual.rsplit(".", 1)[0] if "." in qual else None
    if name == "__next__":
        return f"next({cls})"
    if name == "__iter__":
        return f"iter({cls})"
    if name == "__init__":
        return f"{cls}()"
    return f"{cls}.{name}()" if cls else f"{name}()"


def _site(frame) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def place_of(frame) -> dict:
    """The place of a thread whose innermost frame is ``frame``: ``state`` ("waiting",
    "working" or "outside"), ``call`` and ``site`` (the gpustrat call and the user's
    line that made it), ``collective`` and ``since`` (seconds) when waiting, ``where``
    (the innermost user line) when outside."""
    stack = []
    f = frame
    while f is not None:
        stack.append(f)
        f = f.f_back
    stack.reverse()  # outermost first
    site = call = public = None
    innermost_user = None
    for f in stack:
        code = f.f_code
        if _is_user(code.co_filename):
            innermost_user = f
            if call is None:
                site = f
        elif code.co_filename.startswith(_PKG):
            if call is None and site is not None:
                call = f  # the first gpustrat frame inside user code: the user's call
            if call is not None:
                public = _PUBLIC.get(getattr(code, "co_qualname", code.co_name), public)
    wait = next((f for f in reversed(stack) if f.f_code is _waits.wait.__code__), None)
    out = {"site": None if site is None else _site(site),
           "call": None if call is None else _call_name(call)}
    if wait is not None:
        loc = wait.f_locals
        try:
            what = _name(loc.get("what"))
        except Exception:  # noqa: BLE001 - a description must never fail the survey
            what = "a collective"
        out.update(state="waiting", collective=what if public is None or public in what
                   else f"{what}: {public}",
                   since=max(0.0, time.monotonic() - loc.get("start", time.monotonic())))
    elif call is not None:
        out["state"] = "working"
    else:
        out.update(state="outside", where=None if innermost_user is None
                   else f"{_site(innermost_user)} (in {innermost_user.f_code.co_name})")
    return out


def this_rank(skip: int | None = None) -> list:
    """The places of this process's threads worth naming: every thread waiting in a
    collective, else the main thread's place. ``skip``: a thread id left out."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    places = []
    for tid, frame in frames.items():
        if tid == skip or tid in _thread_ids:
            continue
        try:
            p = place_of(frame)
        except Exception as e:  # noqa: BLE001 - a survey names what it can
            p = {"state": "outside", "site": None, "call": None,
                 "where": f"(its stack could not be read: {type(e).__name__})"}
        if p["state"] == "waiting":
            places.append(p)
    if not places and main in frames and main != skip:
        places.append(place_of(frames[main]))
    return places or [{"state": "outside", "site": None, "call": None, "where": None}]


_thread_ids: set = set()  # the inspectors' own threads, never described


def describe(place: dict) -> str:
    """One place in words."""
    at = f" at {place['site']}" if place.get("site") else ""
    call = place.get("call") or "gpustrat"
    if place["state"] == "waiting":
        return (f"waiting in {call}{at} [{place['collective']}] for "
                f"{place['since']:.0f} s")
    if place["state"] == "working":
        return f"working in {call}{at} (not waiting for other ranks)"
    where = place.get("where")
    return "outside any gpustrat call" + (f", at {where}" if where else "")


def _key(place: dict) -> tuple:
    return (place["state"], place.get("call"), place.get("site"), place.get("collective"))


def explain(rank: int, mine: dict, answers: dict, size: int) -> str:
    """The survey in words: every rank's place, then what the pattern means.
    ``answers[r]`` is rank r's list of places (absent: no answer)."""
    lines = []
    for r in range(size):
        if r not in answers:
            lines.append(f"  rank {r}: no answer within {_ANSWER_S:g} s (busy in code that "
                         "holds the Python GIL, or gone)")
            continue
        for p in answers[r]:
            lines.append(f"  rank {r}: {describe(p)}")
    here = _key(mine)
    there = [r for r in range(size) if r in answers
             and all(_key(p) != here for p in answers[r])]
    absent = [r for r in range(size) if r not in answers]
    elsewhere = [r for r in there if any(p["state"] == "waiting" for p in answers[r])]
    busy = [r for r in there if r not in elsewhere]
    with_me = [r for r in range(size) if r not in there and r not in absent]
    what = _at(mine)
    advice = []
    if elsewhere:
        others = "; ".join(f"rank {r} in {_at(_waiting(answers[r]))}" for r in elsewhere)
        advice.append(
            f"A collective reached by some workers only: {_ranks(with_me)} "
            f"{_verb(with_me, 'waits', 'wait')} in {what}, while {others}: each waits for "
            "the other, forever. Every collective (metric.result(), strategy.reduce, "
            "strategy.gather, a checkpoint save, ...) must be called on every worker: "
            "call it on every worker and print on one, e.g. `value = metric.result()` "
            "on every worker, then `if task_id == 0: print(value)`")
    same = [r for r in busy if any(_at(p) == what for p in answers[r])]
    if same:
        advice.append(
            f"{_ranks(same)} {_verb(same, 'is', 'are')} still working in the same call "
            f"({what}) and not yet at the collective the others wait in: slow work on "
            f"some ranks only (raise {ENV_TIMEOUT} if it legitimately takes longer than "
            f"{timeout_s()})")
    busy = [r for r in busy if r not in same]
    if busy:
        advice.append(
            f"{_ranks(busy)} {_verb(busy, 'is', 'are')} in no collective: either still "
            f"working (raise {ENV_TIMEOUT} if that work legitimately takes longer than "
            f"{timeout_s()}) or past a call of {what} that {_verb(busy, 'it', 'they')} "
            "skipped (call it on every worker)")
    if not there and not absent:
        advice.append("Every rank waits in the same collective: MPI itself is not making "
                      "progress (a network problem, or a rank stopped by a debugger?)")
    return "\n".join(lines + ["  " + a for a in advice])


def timeout_s() -> str:
    try:
        return f"{timeout_from_env():g} s"
    except ValueError:
        return "its deadline"


def _at(place: dict) -> str:
    return (place.get("call") or "a collective") + (f" at {place['site']}"
                                                    if place.get("site") else "")


def _waiting(places: list) -> dict:
    return next(p for p in places if p["state"] == "waiting")


def _ranks(ranks: list) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _verb(ranks: list, one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


# --- the inspector of one worker group ----------------------------------------------

class Inspector:
    """Answers the other ranks' questions (a thread) and surveys every rank for a
    waiting thread of this rank.

    Args:
        comm: the group's communicator; the inspector works on its own duplicate
            (collective over the group, bounded by ``timeout``).
        delay: seconds a wait lasts before it surveys (``GPUSTRAT_STALL_WARNING``).
    """

    def __init__(self, comm, delay: float, timeout: float, exits=None):
        dup, req = comm.Idup()
        _waits.wait(req, "creating the stall inspector (MPI Idup)", comm.Get_rank(),
                    timeout, exits)
        self.comm = dup
        self.rank = dup.Get_rank()
        self.size = dup.Get_size()
        self.delay = delay
        self._next_tag = _FIRST_ANSWER_TAG
        self._tag_lock = threading.Lock()
        self._warned_at = -float("inf")
        self._stop = threading.Event()
        self._question = np.zeros(1, np.int64)
        self._status = mpi().Status()
        self._req = dup.Irecv([self._question, mpi().INT64_T], source=mpi().ANY_SOURCE,
                              tag=_ASK)
        self._sends: list = []
        self._thread = threading.Thread(target=self._serve, name="gpustrat-stall-inspector",
                                        daemon=True)
        self._thread.start()
        _inspectors[id(self)] = self
        _install_exit_hooks()

    # --- answering ------------------------------------------------------------------
    def _serve(self) -> None:
        _thread_ids.add(threading.get_ident())
        while not self._stop.is_set():
            if self._req.Test(self._status):
                source, tag = self._status.Get_source(), int(self._question[0])
                try:
                    places = this_rank()
                except Exception as e:  # noqa: BLE001 - an answer must still go back
                    places = [{"state": "outside", "site": None, "call": None,
                               "where": f"(its stacks could not be read: {e!r})"}]
                self._sends.append(self.comm.isend(places, dest=source, tag=tag))
                self._req = self.comm.Irecv([self._question, mpi().INT64_T],
                                            source=mpi().ANY_SOURCE, tag=_ASK)
            else:
                self._sends = [s for s in self._sends if not s.Test()]
                self._stop.wait(_POLL_S)

    # --- asking ---------------------------------------------------------------------
    def stalled(self, start: float, now: float) -> "Survey | None":
        """A survey for a wait that began at ``start``; None when another wait of this
        rank already warned within the last delay (one warning per stall)."""
        if now - self._warned_at < self.delay or id(self) not in _inspectors:
            return None
        self._warned_at = now
        try:
            return self.survey()
        except Exception:  # noqa: BLE001 - the wait itself goes on, unwarned
            return None

    def survey(self) -> "Survey":
        with self._tag_lock:
            tag = self._next_tag
            self._next_tag = _FIRST_ANSWER_TAG + (tag + 1 - _FIRST_ANSWER_TAG) % 4096
        return Survey(self, tag)

    def close(self) -> None:
        """Stop the thread and free the communicator (no communication)."""
        if _inspectors.pop(id(self), None) is None:
            return
        self._stop.set()
        self._thread.join()
        if _waits._MPI is None or _waits._MPI.Is_finalized():
            return
        self._req.Cancel()
        self._req.Wait()
        _orphans.extend(s for s in self._sends if not s.Test())
        self.comm.Free()


class Survey:
    """One question to every other rank, and their answers as they come."""

    def __init__(self, inspector: Inspector, tag: int):
        self.inspector = inspector
        self.tag = tag
        comm = inspector.comm
        me = inspector.rank
        self._note = np.array([tag], np.int64)
        MPI = mpi()
        sends = [comm.Isend([self._note, MPI.INT64_T], dest=r, tag=_ASK)
                 for r in range(inspector.size) if r != me]
        _orphans.append((self._note, sends))  # the receiver's thread may have stopped
        self.answers = {}
        self.asked = time.monotonic()
        self._status = MPI.Status()

    def poll(self) -> bool:
        """Take the answers that arrived; whether the survey is over (every rank
        answered, or ``_ANSWER_S`` passed)."""
        comm = self.inspector.comm
        MPI = mpi()
        try:
            while comm.iprobe(source=MPI.ANY_SOURCE, tag=self.tag, status=self._status):
                source = self._status.Get_source()
                self.answers[source] = comm.recv(source=source, tag=self.tag)
        except Exception:  # noqa: BLE001 - the survey ends with the answers it has
            return True
        return (len(self.answers) >= self.inspector.size - 1
                or time.monotonic() - self.asked >= _ANSWER_S)

    def finish(self) -> None:
        """Poll until the survey is over."""
        while not self.poll():
            time.sleep(0.005)

    def text(self) -> str:
        """Every rank's place and what it means (this rank's place read now)."""
        insp = self.inspector
        me = threading.get_ident()
        mine = place_of(sys._getframe(1))
        answers = dict(self.answers)
        # This thread's place, and any other thread of this rank waiting elsewhere.
        answers[insp.rank] = [mine] + [p for p in this_rank(skip=me)
                                       if p["state"] == "waiting" and _key(p) != _key(mine)]
        return explain(insp.rank, mine, answers, insp.size)

    def warning(self, waited: float) -> str:
        """The text a stalled wait prints (never raises: the wait goes on)."""
        try:
            return self._warning(waited)
        except Exception as e:  # noqa: BLE001
            return (f"[gpustrat] rank {self.inspector.rank} has waited {waited:.0f} s in a "
                    f"collective (the stall inspector could not describe it: {e!r})\n")

    def _warning(self, waited: float) -> str:
        mine = place_of(sys._getframe(2))
        at = f" at {mine['site']}" if mine.get("site") else ""
        return (f"[gpustrat] rank {self.inspector.rank} has waited {waited:.0f} s in "
                f"{mine.get('call') or 'a collective'}{at} [{mine.get('collective')}]. "
                f"Where every rank is ({ENV_STALL_WARNING}={self.inspector.delay:g} s sets "
                "when this is printed; off turns it off):\n" + self.text() + "\n")


def report_at_deadline(exits) -> str:
    """The survey a CollectiveTimeout carries, or "" when there is no inspector."""
    insp = getattr(exits, "inspector", None)
    if insp is None or insp.comm is None or id(insp) not in _inspectors:
        return ""
    try:
        survey = insp.survey()
        survey.finish()
        return "\nWhere every rank is:\n" + survey.text()
    except Exception as e:  # noqa: BLE001 - the timeout itself must still be raised
        return f"\n(the stall inspector could not ask the other ranks: {e})"


def _install_exit_hooks() -> None:
    """Stop every inspector at interpreter exit, and at MPI_Finalize if it comes first."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    import atexit  # noqa: PLC0415
    atexit.register(_stop_all)
    MPI = mpi()
    keyval = MPI.Comm.Create_keyval(delete_fn=lambda *_: _stop_all())
    MPI.COMM_SELF.Set_attr(keyval, True)


def _stop_all() -> None:
    for insp in list(_inspectors.values()):
        insp.close()


def start(comm, timeout: float, exits=None) -> "Inspector | None":
    """The inspector of a group on ``comm`` (collective), or None when it is turned off,
    the group has one rank, or MPI runs without ``THREAD_MULTIPLE``."""
    delay = stall_warning_from_env()
    MPI = mpi()
    if delay is None or comm.Get_size() < 2 or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return None
    return Inspector(comm, delay, timeout, exits)
