"""Failure handling between workers: one rank's uncaught exception ends the whole job.

Without this, a rank that dies of an exception leaves the others waiting inside their
next collective (until the ``GPUSTRAT_TIMEOUT`` deadline at best). With
:func:`install_abort_on_error`, an exception that escapes on any rank, in the main
thread or any other thread (replica functions, input pipeline), prints
``[gpustrat] rank R of N: <traceback>`` once, on that rank, and calls ``MPI_Abort``,
after which the MPI launcher ends every rank with a non-zero status within seconds.

Multi-worker strategies call it when they are created and
:func:`uninstall_abort_on_error` when they are closed: the hooks are in place while at
least one strategy is open, abort through the newest open one's communicator, and are
handed back to the hooks they replaced (the application's own) when the last one closes.
``GPUSTRAT_ABORT_ON_ERROR=0`` opts out (then handle errors yourself, e.g. with
``python -m mpi4py train.py``).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

from gpustrat.collectives.base import WorkerGroup

ENV_ABORT = "GPUSTRAT_ABORT_ON_ERROR"

_lock = threading.RLock()
_groups: list = []  # the open groups that an error aborts, newest last
_replaced: dict = {}  # "sys", "threading": the hooks in place before ours
_aborting = threading.Event()


def abort_on_error_enabled() -> bool:
    """False when ``GPUSTRAT_ABORT_ON_ERROR`` is 0/false/no/off."""
    return os.environ.get(ENV_ABORT, "1").strip().lower() not in ("0", "false", "no", "off")


def install_abort_on_error(group: WorkerGroup) -> bool:
    """Make an uncaught exception on this rank abort every rank of ``group``'s job, until
    :func:`uninstall_abort_on_error` is called for ``group``.

    Sets ``sys.excepthook`` and ``threading.excepthook`` (once, for every group: an
    error aborts through the newest group still installed). Does nothing (and returns
    False) for a single worker or when ``GPUSTRAT_ABORT_ON_ERROR=0``. Returns True when
    the hooks are in place for ``group``.
    """
    if group.size <= 1 or not abort_on_error_enabled():
        return False
    with _lock:
        if not any(g is group for g in _groups):
            _groups.append(group)
        if not _replaced:
            _replaced.update(sys=sys.excepthook, threading=threading.excepthook)
            sys.excepthook = _sys_hook
            threading.excepthook = _thread_hook
    return True


def uninstall_abort_on_error(group: WorkerGroup | None = None) -> None:
    """Stop aborting through ``group`` (every group when None); once no group is left,
    give back the hooks that :func:`install_abort_on_error` replaced. A hook the
    application set since then is left in place (ours is no longer in it)."""
    with _lock:
        if group is None:
            _groups.clear()
        else:
            _groups[:] = [g for g in _groups if g is not group]
        if _groups or not _replaced:
            return
        if sys.excepthook is _sys_hook:
            sys.excepthook = _replaced["sys"]
        if threading.excepthook is _thread_hook:
            threading.excepthook = _replaced["threading"]
        _replaced.clear()


def _newest():
    with _lock:
        return (_groups[-1] if _groups else None,
                _replaced.get("sys", sys.__excepthook__),
                _replaced.get("threading", threading.__excepthook__))


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


def _tell(hook, default, *args) -> None:
    """Pass the error to the application's own hook (one it set before the strategy was
    made) before aborting; Python's default one is not run (the report says it all)."""
    if hook is default or _aborting.is_set():
        return
    try:
        hook(*args)
    except BaseException:  # noqa: BLE001 - the abort must come whatever the hook does
        pass


def _sys_hook(exc_type, exc, tb) -> None:
    group, before, _ = _newest()
    if group is None:  # every group was closed while a hook still pointed here
        before(exc_type, exc, tb)
        return
    _tell(before, sys.__excepthook__, exc_type, exc, tb)
    report_and_abort(group, exc_type, exc, tb)


def _thread_hook(args) -> None:
    group, _, before = _newest()
    if group is None or args.exc_type is SystemExit:
        before(args)
        return
    _tell(before, threading.__excepthook__, args)
    name = getattr(args.thread, "name", "?")
    report_and_abort(group, args.exc_type, args.exc_value, args.exc_traceback,
                     f" in thread {name!r}")
