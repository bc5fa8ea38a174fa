"""mpi4py on first use, the deadline for every wait, and the dtype and op table."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import numpy as np

from gpustrat.errors import CollectiveTimeout
from gpustrat.reduce_util import ReduceOp

ENV_TIMEOUT = "GPUSTRAT_TIMEOUT"
ENV_DEBUG = "GPUSTRAT_DEBUG_COLLECTIVES"
ENV_INPUT_STEPS = "GPUSTRAT_CHECK_INPUT_STEPS"
DEFAULT_TIMEOUT = 300.0

# Polling: back-to-back Tests for _SPIN_S (the clock read every _SPIN tests), then Test
# after each yield of the core for _YIELD_S (MPI progresses only inside MPI calls, so a
# large transfer must keep being tested), then sleeps doubling from 10 us up to 1 ms.
_SPIN = 100
_SPIN_S = 300e-6
_YIELD_S = 0.05
_MAX_SLEEP_S = 1e-3
# How long a wait goes on after another rank of the group has exited (see _ExitWatch).
_EXIT_GRACE_S = 1.0

_MPI = None


def mpi():
    """The ``mpi4py.MPI`` module, imported (and MPI initialised) on first use."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI
        _MPI = MPI
    return _MPI


def mpi_world():
    """``MPI.COMM_WORLD``, initialising MPI if needed."""
    return mpi().COMM_WORLD


def timeout_from_env() -> float:
    """``GPUSTRAT_TIMEOUT`` in seconds (default 300; ``inf`` waits forever)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        t = float("nan")
    if not t > 0:  # also rejects nan
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a positive number of seconds: "
                         f"unset it for the default {DEFAULT_TIMEOUT:g} s, or set 'inf' "
                         "to wait forever")
    return t


def debug_from_env() -> bool:
    """Whether ``GPUSTRAT_DEBUG_COLLECTIVES`` turns the agreement checks on."""
    return os.environ.get(ENV_DEBUG, "").strip().lower() in ("1", "true", "yes", "on")


def input_steps_from_env() -> bool:
    """Whether data collectives compare input steps (``GPUSTRAT_CHECK_INPUT_STEPS``,
    on unless set to 0)."""
    return os.environ.get(ENV_INPUT_STEPS, "").strip().lower() not in ("0", "false", "no",
                                                                        "off")


# --- dtype and op table -------------------------------------------------------------

# numpy dtype -> name of the MPI datatype used to reduce it.
_REDUCE_TYPES = {
    np.dtype(np.float32): "FLOAT", np.dtype(np.float64): "DOUBLE",
    np.dtype(np.longdouble): "LONG_DOUBLE",
    np.dtype(np.int8): "INT8_T", np.dtype(np.int16): "INT16_T",
    np.dtype(np.int32): "INT32_T", np.dtype(np.int64): "INT64_T",
    np.dtype(np.uint8): "UINT8_T", np.dtype(np.uint16): "UINT16_T",
    np.dtype(np.uint32): "UINT32_T", np.dtype(np.uint64): "UINT64_T",
    np.dtype(np.complex64): "C_FLOAT_COMPLEX", np.dtype(np.complex128): "C_DOUBLE_COMPLEX",
    np.dtype(np.bool_): "C_BOOL",
}
# float16 has no portable MPI datatype (Open MPI has none; MPICH's MPIX_C_FLOAT16 is an
# extension), so it is reduced in float32 and rounded back once, which is also more
# accurate than summing in float16.
_UPCAST = {np.dtype(np.float16): np.dtype(np.float32)}
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.MEAN: "SUM", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN"}
# The host path combines booleans with np.add/maximum/minimum: or, or, and.
_BOOL_OPS = {ReduceOp.SUM: "LOR", ReduceOp.MEAN: "LOR", ReduceOp.MAX: "LOR",
             ReduceOp.MIN: "LAND"}

# What the replicas' host arrays combine with, per op (booleans: or, or, and).
_NP_OPS = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MAX: np.maximum,
           ReduceOp.MIN: np.minimum}
_BOOL_NP_OPS = {ReduceOp.SUM: np.logical_or, ReduceOp.MEAN: np.logical_or,
                ReduceOp.MAX: np.logical_or, ReduceOp.MIN: np.logical_and}

_reduce_args_cache: dict = {}
_MEAN = ReduceOp.MEAN  # a module global is faster to reach than an enum member


def reduce_args(dtype: np.dtype, op: ReduceOp):
    """``(MPI datatype, MPI op, dtype to reduce in or None)`` for reducing ``dtype``."""
    key = (dtype, op)
    hit = _reduce_args_cache.get(key)
    if hit is not None:
        return hit
    MPI = mpi()
    up = _UPCAST.get(dtype)
    name = _REDUCE_TYPES.get(up or dtype)
    if name is None:
        raise TypeError(
            f"cannot reduce arrays of dtype {dtype} between workers: supported are "
            f"{sorted({str(d) for d in _REDUCE_TYPES} | {str(d) for d in _UPCAST})}; "
            "cast to one of them first")
    if dtype.kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
        raise TypeError(f"{op.name} of complex values ({dtype}) is not defined between "
                        "workers: reduce the real and imaginary parts, or the absolute value")
    mop = (_BOOL_OPS if dtype.kind == "b" else _OPS)[op]
    hit = (getattr(MPI, name), getattr(MPI, mop), up)
    _reduce_args_cache[key] = hit
    return hit


# --- waiting with a deadline --------------------------------------------------------

def wait(request, what: "str | Callable[[], str] | tuple", rank: int, timeout: float,
         exits: "_ExitWatch | None" = None) -> None:
    """Wait for ``request``, raising CollectiveTimeout after ``timeout`` seconds, or
    ``_EXIT_GRACE_S`` after ``exits`` reports that another rank of the group has exited.

    ``what`` names the operation: a string, a callable returning it, or ``(kind,
    shape, dtype)`` (either is only turned into text to build the error).
    """
    test = request.Test
    for _ in range(_SPIN):
        if test():
            return
    # Keep spinning up to _SPIN_S: a peer a few tens of microseconds behind (Python
    # work between its collectives) is met without giving the core away, which on a
    # loaded node can cost a whole time slice.
    start = time.monotonic()
    spin_until = start + _SPIN_S
    while True:
        for _ in range(_SPIN):
            if test():
                return
        if time.monotonic() >= spin_until:
            break
    start = time.monotonic()
    deadline = start + timeout
    yield_until = start + _YIELD_S
    delay = 1e-5
    gone = None
    # The stall inspector (stall.py) of the group, when it has one: after its delay,
    # this rank asks every rank where it is and prints the answers.
    inspector = getattr(exits, "inspector", None)
    warn_at = start + inspector.delay if inspector is not None else float("inf")
    survey = None
    while True:
        now = time.monotonic()
        if now >= warn_at:
            if survey is None:
                survey = inspector.stalled(start, now)
                if survey is None:
                    warn_at = float("inf")
            elif survey.poll():
                sys.stderr.write(survey.warning(now - start))
                sys.stderr.flush()
                survey, warn_at = None, float("inf")
        if exits is not None and gone is None:
            gone = exits.poll()
            if gone is not None:
                # A peer that left may still have completed its side: give MPI a moment.
                deadline = min(deadline, now + _EXIT_GRACE_S)
        if now >= deadline and gone is not None:
            name = _name(what)
            raise CollectiveTimeout(
                f"{name} cannot complete on rank {rank}: {exits.reason()} while this "
                "rank waits for it. Every rank must run the same steps and collectives: "
                "do not leave the training loop or the script early on some ranks only, "
                "and raise an exception instead of sys.exit on errors (it ends every "
                "rank)")
        if now >= deadline:
            name = _name(what)
            raise CollectiveTimeout(
                f"{name} did not complete within {timeout:g} s on rank {rank}: another "
                "rank probably died, is stuck, or skipped this collective (every rank "
                "must make the same collective calls in the same order). Check the other "
                f"ranks' output; raise {ENV_TIMEOUT} (seconds) if the work between "
                f"collectives legitimately takes longer; {ENV_DEBUG}=1 names ranks "
                "that call different collectives" + _where_every_rank_is(exits))
        if now < yield_until:
            # sched_yield, not sleep(0): a zero sleep still costs the kernel's timer
            # slack (about 50 us), which a peer spinning on us would wait out.
            for _ in range(_SPIN):
                os.sched_yield()
                if test():
                    return
        else:
            time.sleep(delay)
            delay = min(2 * delay, _MAX_SLEEP_S)
            if test():
                return


def _where_every_rank_is(exits) -> str:
    from gpustrat.collectives.mpi.stall import report_at_deadline  # noqa: PLC0415
    return report_at_deadline(exits)


def _name(what) -> str:
    return _describe(*what) if type(what) is tuple else what() if callable(what) else what


def _describe(op: str, shape, dtype) -> str:
    if shape is None:
        return op
    return f"{op} on shape {shape if isinstance(shape, str) else _shown(shape)} {dtype}"



def _shown(shape) -> str:
    dims = [str(n) for n in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
