"""Where a job's time went, from its timeline: ``python -m gpustrat timeline ...``.

    python -m gpustrat timeline summary FILE [--json] [--plot OUT.png] [--steps N]
    python -m gpustrat timeline merge PATH [--ranks N]

Figures per rank, read on its first track (replica 0, the thread that calls
``strategy.run``):
- *step time*: the time from one ``run`` to the next (the loop's period: input,
  step and whatever the loop does between steps), median and 95th percentile;
- *input wait share*: the share of the rank's recorded time spent in ``get_next``;
- *collective wait share*: the share spent waiting in collectives, for the other
  workers (the header exchange) or for the worker's other replicas. (Waiting for the
  other workers' agreement on the end of the data, inside ``get_next``, is input
  wait.)

*Last to arrive*: a collective between workers ends for all at about the same moment,
when the last worker arrives, so the worker that waited least for its peers came last
(whatever the ranks' clocks say). Collectives are matched across ranks by their
position in each rank's sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from gpustrat.timeline import trace as _trace

#: The plot: this many pixels wide, and ``PLOT_TOP + PLOT_ROW`` per track high.
PLOT_WIDTH = 1200
PLOT_TOP = 120
PLOT_ROW = 40


def _p95(values: list) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(0.95 * (len(s) - 1)))))]


def _spans(events: list) -> list:
    return [e for e in events if e.get("ph") == "X"]


def summarize(events: list) -> dict:
    """The summary of a trace's events (see the module docstring); JSON-ready."""
    spans = _spans(events)
    ranks = sorted({e["pid"] for e in spans})
    out: dict = {"ranks": {}, "last_to_arrive": {}, "waited_for_s": {}, "collectives": {},
                 "straggler": None}
    colls: dict = {}
    for r in ranks:
        mine = [e for e in spans if e["pid"] == r]
        first = min(e["ts"] for e in mine)
        wall = (max(e["ts"] + e["dur"] for e in mine) - first) / 1e6
        main = [e for e in mine if e["tid"] == 0]
        runs = sorted(e["ts"] for e in main if e["name"] == "run")
        periods = [(b - a) / 1e6 for a, b in zip(runs, runs[1:])]
        if not periods:
            periods = [e["dur"] / 1e6 for e in main if e["name"] == "run"]
        inputs = sum(e["dur"] for e in main if e["name"] == "get_next") / 1e6
        # In collectives: their waits for peers, and the waits for the local replicas
        # (an agreement inside get_next waits for peers too: that is input wait).
        waits = (sum(e["args"]["wait_us"] for e in main if e.get("cat") == "collective")
                 + sum(e["dur"] for e in main if e["name"] == "wait for replicas")) / 1e6
        out["ranks"][str(r)] = {
            "steps": len(runs), "wall_s": wall,
            "step_time_median_s": statistics.median(periods) if periods else None,
            "step_time_p95_s": _p95(periods) if periods else None,
            "input_wait_s": inputs, "input_wait_share": inputs / wall if wall else 0.0,
            "collective_wait_s": waits,
            "collective_wait_share": waits / wall if wall else 0.0}
        colls[r] = sorted((e for e in mine if e.get("cat") == "collective"),
                          key=lambda e: e["args"]["seq"])
        out["last_to_arrive"][str(r)] = 0
        out["waited_for_s"][str(r)] = 0.0
    # Bytes per second per kind (on every rank together).
    kinds: dict = {}
    for r in ranks:
        for e in colls[r]:
            a = e["args"]
            k = kinds.setdefault(a["kind"], {"count": 0, "bytes": 0, "time_s": 0.0,
                                             "move_s": 0.0, "wait_s": 0.0})
            k["count"] += 1
            k["bytes"] += a["bytes"]
            k["time_s"] += e["dur"] / 1e6
            k["move_s"] += a["move_us"] / 1e6
            k["wait_s"] += a["wait_us"] / 1e6
    for k in kinds.values():
        k["bytes_per_s"] = k["bytes"] / k["time_s"] if k["time_s"] else None
        k["moving_bytes_per_s"] = k["bytes"] / k["move_s"] if k["move_s"] else None
    out["collectives"] = kinds
    # Who came last to each collective between workers.
    between = {r: [e for e in colls[r] if e["args"].get("workers", 1) > 1] for r in ranks}
    matched = 0
    if len(ranks) > 1:
        for group in zip(*(between[r] for r in ranks)):
            if len({e["args"]["kind"] for e in group}) != 1:
                break  # the sequences no longer line up (recording started apart)
            matched += 1
            waits = [e["args"]["wait_us"] for e in group]
            last = min(range(len(group)), key=waits.__getitem__)
            out["last_to_arrive"][str(ranks[last])] += 1
            out["waited_for_s"][str(ranks[last])] += (sum(waits) - waits[last]) / 1e6
    out["matched_collectives"] = matched
    if matched:
        worst = max(ranks, key=lambda r: out["waited_for_s"][str(r)])
        out["straggler"] = {"rank": worst,
                            "last_to_arrive": out["last_to_arrive"][str(worst)],
                            "of": matched,
                            "others_waited_s": out["waited_for_s"][str(worst)]}
    return out


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


def _rate(b) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B/s"


def format_summary(s: dict) -> str:
    lines = ["per rank (its first track: replica 0, the caller of strategy.run):",
             f"  {'rank':>4}  {'steps':>5}  {'step median':>12}  {'step p95':>12}  "
             f"{'input wait':>10}  {'collective wait':>15}"]
    for r, v in s["ranks"].items():
        lines.append(f"  {r:>4}  {v['steps']:>5}  {_ms(v['step_time_median_s']):>12}  "
                     f"{_ms(v['step_time_p95_s']):>12}  {v['input_wait_share']:>10.1%}  "
                     f"{v['collective_wait_share']:>15.1%}")
    if s["matched_collectives"]:
        lines.append(f"last to arrive at the {s['matched_collectives']} collectives between "
                     "workers (and how long the others waited for it):")
        for r in s["ranks"]:
            lines.append(f"  rank {r}: last at {s['last_to_arrive'][r]}, others waited "
                         f"{s['waited_for_s'][r] * 1e3:.3f} ms in all")
        st = s["straggler"]
        lines.append(f"straggler: rank {st['rank']} (last at {st['last_to_arrive']} of "
                     f"{st['of']} collectives; the others waited "
                     f"{st['others_waited_s'] * 1e3:.3f} ms for it)")
    if s["collectives"]:
        lines.append("collectives by kind (every rank):")
        for kind, k in sorted(s["collectives"].items()):
            lines.append(f"  {kind}: {k['count']} calls, {k['bytes']} bytes, "
                         f"{_rate(k['bytes_per_s'])} overall, "
                         f"{_rate(k['moving_bytes_per_s'])} while moving data, "
                         f"{k['wait_s'] * 1e3:.3f} ms waiting for peers")
    return "\n".join(lines)


# --- the picture --------------------------------------------------------------------------

_COLOURS = {"run": "#9ecae1", "get_next": "#fd8d3c", "place": "#fdae6b",
            "apply_gradients": "#9e9ac8",
            "wait for peers": "#de2d26", "wait for replicas": "#fc9272"}


def _colour(e) -> str:
    if e["name"] in _COLOURS:
        return _COLOURS[e["name"]]
    if e.get("cat") == "collective":
        return "#31a354"
    if e.get("cat") == "device":
        return "#74c476"
    return "#bdbdbd"


def plot_window(spans: list, steps: int) -> tuple[float, float, int]:
    """``(start, end, steps shown)`` of a plot of the last ``steps`` steps of every rank:
    from the earliest start of any rank's ``steps``-th last ``run`` (its replica 0's)
    to the end of the last span. With no ``run``, every span."""
    starts: dict = {}
    for e in spans:
        if e["name"] == "run" and e["tid"] == 0:
            starts.setdefault(e["pid"], []).append(e["ts"])
    if starts:
        lo = min(sorted(ts)[-steps] if len(ts) >= steps else min(ts)
                 for ts in starts.values())
        shown = min(steps, max(len(ts) for ts in starts.values()))
    else:
        lo, shown = (min(e["ts"] for e in spans) if spans else 0), 0
    hi = max((e["ts"] + e["dur"] for e in spans), default=lo + 1)
    return lo, hi, shown


def plot(events: list, out: str, steps: int = 10) -> tuple[int, int]:
    """A Gantt chart of the last ``steps`` steps, one row per track (rank, replica),
    written to ``out`` as a PNG of ``PLOT_WIDTH`` by ``PLOT_TOP + PLOT_ROW * rows``
    pixels; returns that size.

    Raises:
        RuntimeError: matplotlib is missing (``pip install -e '.[plot]'``).
    """
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install -e '.[plot]'") from e
    spans = _spans(events)
    lo, hi, shown_steps = plot_window(spans, steps)
    shown = [e for e in spans if e["ts"] + e["dur"] >= lo and e["tid"] < 100]
    rows = sorted({(e["pid"], e["tid"]) for e in shown}) or [(0, 0)]
    height = PLOT_TOP + PLOT_ROW * len(rows)
    fig = plt.figure(figsize=(PLOT_WIDTH / 100, height / 100), dpi=100)
    ax = fig.add_axes((0.13, 50 / height, 0.85, 1 - 90 / height))
    where = {row: i for i, row in enumerate(rows)}
    stacks: dict = {}
    for e in sorted(shown, key=lambda e: (e["ts"], -e["dur"])):
        row = (e["pid"], e["tid"])
        y = where[row]
        stack = stacks.setdefault(row, [])   # the spans this one nests in
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        h = 0.8 * 0.75 ** len(stack)
        stack.append(e["ts"] + e["dur"])
        ax.broken_barh([((max(e["ts"], lo) - lo) / 1e3, max(e["dur"], 0.5) / 1e3)],
                       (y - h / 2, h), facecolors=_colour(e), edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p} replica {t}" for p, t in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel(f"ms (the last {shown_steps} steps)" if shown_steps else "ms")
    legend = [Patch(color=c, label=n) for n, c in _COLOURS.items()] + \
        [Patch(color="#31a354", label="collective"), Patch(color="#bdbdbd", label="other")]
    fig.legend(handles=legend, loc="upper center", ncol=len(legend), fontsize=7,
               frameon=False, bbox_to_anchor=(0.5, 1 - 2 / height))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return PLOT_WIDTH, height


# --- the command ----------------------------------------------------------------------------

def main(argv=None, prog: str = "python -m gpustrat timeline") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Summarize or merge a gpustrat timeline (GPUSTRAT_TIMELINE=PATH or "
        "gs.timeline.record(PATH)); see docs/timeline.md."))
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="step times, waits, stragglers, bytes/s")
    s.add_argument("file", help="a merged trace, a per-rank file, or the PATH whose "
                   "PATH.rank<N>.events files to read")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="OUT.png", help="draw a Gantt chart of the last steps")
    s.add_argument("--steps", type=int, default=10, help="steps in the plot (default 10)")
    m = sub.add_parser("merge", help="merge PATH.rank<N>.events into PATH (after a job died)")
    m.add_argument("path")
    m.add_argument("--ranks", type=int, default=None,
                   help="ranks expected (default: the files found); missing ones are listed")
    args = parser.parse_args(argv)
    if args.command == "merge":
        try:
            trace = _trace.merge(args.path, size=args.ranks)
        except FileNotFoundError as e:
            print(f"gpustrat timeline merge: {e}", file=sys.stderr)
            return 1
        other = trace["otherData"]
        print(f"wrote {args.path}: ranks {other['ranks']} ({len(trace['traceEvents'])} "
              f"events); complete: {other['complete']}"
              + (f"; missing: {other['missing']}" if other["missing"] else ""))
        return 0
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    try:
        events = _trace.load(args.file)
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"gpustrat timeline summary: {e}", file=sys.stderr)
        return 1
    if not _spans(events):
        print(f"gpustrat timeline summary: {args.file} holds no events", file=sys.stderr)
        return 1
    result = summarize(events)
    if args.plot:
        try:
            w, h = plot(events, args.plot, args.steps)
        except RuntimeError as e:
            print(f"gpustrat timeline summary: {e}", file=sys.stderr)
            return 1
        result["plot"] = {"path": args.plot, "width": w, "height": h}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_summary(result))
        if args.plot:
            print(f"plot: {args.plot} ({result['plot']['width']}x{result['plot']['height']})")
    return 0
