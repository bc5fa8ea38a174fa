"""Checks of Chrome trace JSON shared by the timeline tests."""

from __future__ import annotations

import json
import struct

EPS = 0.002  # µs: starts and durations are rounded to 1 ns


def load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_trace(trace: dict) -> list:
    """Assert ``trace`` is a valid Chrome trace (the JSON object format) whose spans
    nest on every track; return its spans."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    spans = []
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            spans.append(e)
        else:
            assert isinstance(e["args"], dict), e
    check_nesting(spans)
    return spans


def check_nesting(spans: list) -> None:
    """Every span on a track either contains the next one or ends before it starts."""
    tracks: dict = {}
    for e in spans:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, events in tracks.items():
        stack: list = []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + EPS:
                stack.pop()
            if stack:
                top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"] + EPS, \
                    f"track {track}: {e} overlaps {top} without nesting in it"
            stack.append(e)


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head[:8]
    return struct.unpack(">II", head[16:24])
