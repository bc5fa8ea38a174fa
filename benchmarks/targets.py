"""Speed targets: one way for every suite to state a target, print its verdict beside
it and return it, so that ``python -m gpustrat bench`` lists every verdict at the end.

A verdict is a dict ``{"name", "value", "goal", "op", "unit", "met"}``; ``met`` is True,
False, or None for a target that could not be measured here (no GPU) or not judged: a
quick run (``--quick``, small sizes) judges no target, its figures are shown beside
the goal with "not judged (quick)". Suites return their verdicts under the key
``"verdicts"`` of their result dict.
"""

from __future__ import annotations

import os
import sys

from gpustrat.cli import QUICK, format_verdict


def quick() -> bool:
    """Whether this is a quick run: the bench runner's ``--quick`` (it sets
    ``GPUSTRAT_BENCH_QUICK=1``) or a suite run by hand with ``--quick``."""
    return os.environ.get("GPUSTRAT_BENCH_QUICK") == "1" or "--quick" in sys.argv[1:]


def check(name: str, value: float, goal: float, unit: str = "",
          higher_is_better: bool = True, echo: bool = True) -> dict:
    """The verdict of ``value`` against ``goal``; printed as one line unless not ``echo``
    (ranks other than 0 of an MPI suite)."""
    met = bool(value >= goal) if higher_is_better else bool(value <= goal)
    op = ">=" if higher_is_better else "<="
    verdict = {"name": name, "value": float(value), "goal": float(goal), "op": op,
               "unit": unit, "met": met}
    if quick():
        verdict.update(met=None, reason=QUICK)
    if echo:
        print(f"target {format_verdict(verdict)}", flush=True)
    return verdict


def not_measured(name: str, goal: float, reason: str, unit: str = "",
                 higher_is_better: bool = True, echo: bool = True) -> dict:
    """A target that this run could not measure, and why."""
    verdict = {"name": name, "value": None, "goal": float(goal),
               "op": ">=" if higher_is_better else "<=", "unit": unit, "met": None,
               "reason": QUICK if quick() and "quick" in reason else reason}
    if echo:
        print(f"target {format_verdict(verdict)}", flush=True)
    return verdict


def progress(message: str, echo: bool = True) -> None:
    """A progress line while a suite measures (the bench runner relays it at once)."""
    if echo:
        print(f"  ... {message}", flush=True)
