"""Speed targets: one way for every suite to state a target, print its verdict beside
it and return it, so that ``python -m gpustrat bench`` lists every verdict at the end.

A verdict is a dict ``{"name", "value", "goal", "op", "unit", "met"}``; ``met`` is True,
False, or None for a target that could not be measured here (no GPU, ``--quick``).
Suites return their verdicts under the key ``"verdicts"`` of their result dict.
"""

from __future__ import annotations

from gpustrat.cli import format_verdict


def check(name: str, value: float, goal: float, unit: str = "",
          higher_is_better: bool = True, echo: bool = True) -> dict:
    """The verdict of ``value`` against ``goal``; printed as one line unless not ``echo``
    (ranks other than 0 of an MPI suite)."""
    met = bool(value >= goal) if higher_is_better else bool(value <= goal)
    op = ">=" if higher_is_better else "<="
    verdict = {"name": name, "value": float(value), "goal": float(goal), "op": op,
               "unit": unit, "met": met}
    if echo:
        print(f"target {format_verdict(verdict)}", flush=True)
    return verdict


def not_measured(name: str, goal: float, reason: str, unit: str = "",
                 higher_is_better: bool = True, echo: bool = True) -> dict:
    """A target that this run could not measure, and why."""
    verdict = {"name": name, "value": None, "goal": float(goal),
               "op": ">=" if higher_is_better else "<=", "unit": unit, "met": None,
               "reason": reason}
    if echo:
        print(f"target {format_verdict(verdict)}", flush=True)
    return verdict


def progress(message: str, echo: bool = True) -> None:
    """A progress line while a suite measures (the bench runner relays it at once)."""
    if echo:
        print(f"  ... {message}", flush=True)
