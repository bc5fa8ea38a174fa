"""Failure handling between workers: one rank's uncaught exception ends the whole job.

Without this, a rank that dies of an exception leaves the others waiting inside their
next collective (until the ``GPUSTRAT_TIMEOUT`` deadline at best). With
:func:`install_abort_on_error`, an exception that escapes on any rank, in the main
thread or any other thread (replica functions, input pipeline), prints
``[gpustrat] rank R of N: <traceback>`` once, on that rank, and calls ``MPI_Abort``,
after which the MPI launcher ends every rank with a non-zero status within seconds.

Multi-worker strategies call it when they are created; ``GPUSTRAT_ABORT_ON_ERROR=0``
opts out (then handle errors yourself, e.g. with ``python -m mpi4py train.py``).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

from gpustrat.collectives.base import WorkerGroup

ENV_ABORT = "GPUSTRAT_ABORT_ON_ERROR"

_lock = threading.Lock()
_installed: dict = {}  # "group", "sys", "threading": the group and the hooks replaced
_aborting = threading.Event()


def abort_on_error_enabled() -> bool:
    """False when ``GPUSTRAT_ABORT_ON_ERROR`` is 0/false/no/off."""
    return os.environ.get(ENV_ABORT, "1").strip().lower() not in ("0", "false", "no", "off")


def install_abort_on_error(group: WorkerGroup) -> bool:
    """Make an uncaught exception on this rank abort every rank of ``group``'s job.

    Sets ``sys.excepthook`` and ``threading.excepthook``. Does nothing (and returns
    False) for a single worker, when ``GPUSTRAT_ABORT_ON_ERROR=0``, or when hooks for
    another group are already installed (aborting one job ends it all). Returns True
    when the hooks are in place.
    """
    if group.size <= 1 or not abort_on_error_enabled():
        return False
    with _lock:
        if _installed:
            return _installed["group"] is group
        _installed.update(group=group, sys=sys.excepthook, threading=threading.excepthook)
        sys.excepthook = _sys_hook
        threading.excepthook = _thread_hook
    return True


def uninstall_abort_on_error() -> None:
    """Restore the hooks that :func:`install_abort_on_error` replaced."""
    with _lock:
        if _installed:
            sys.excepthook = _installed["sys"]
            threading.excepthook = _installed["threading"]
            _installed.clear()


def report_and_abort(group: WorkerGroup, exc_type, exc, tb, where: str = "") -> None:
    """Print the error with this rank once, then abort the job (never returns)."""
    if _aborting.is_set():  # a second failing thread: the first one is aborting
        return
    _aborting.set()
    try:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[gpustrat] rank {group.rank} of {group.size}: uncaught "
                         f"exception{where}; aborting every rank\n{text}")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        try:
            group.abort(1)
        finally:
            os._exit(1)  # abort returned or failed: never leave this rank alive


def _sys_hook(exc_type, exc, tb) -> None:
    group = _installed.get("group")
    if group is None:
        sys.__excepthook__(exc_type, exc, tb)
        return
    report_and_abort(group, exc_type, exc, tb)


def _thread_hook(args) -> None:
    group = _installed.get("group")
    if group is None or args.exc_type is SystemExit:
        threading.__excepthook__(args)
        return
    name = getattr(args.thread, "name", "?")
    report_and_abort(group, args.exc_type, args.exc_value, args.exc_traceback,
                     f" in thread {name!r}")
