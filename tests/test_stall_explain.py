"""The stall inspector's words, without MPI: a rank's place read from a stack, and what
a survey's pattern of places means (the MPI runs are in tests/mpi/test_stall_inspector.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from gpustrat.collectives.mpi import stall


def waiting(call, site, collective="all_reduce(SUM) on shape (2,) float32"):
    return {"state": "waiting", "call": call, "site": site, "collective": collective,
            "since": 12.0}


def test_the_warning_delay_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(stall.ENV_STALL_WARNING, raising=False)
    assert stall.stall_warning_from_env() == stall.DEFAULT_STALL_WARNING == 10
    for raw, want in (("2.5", 2.5), ("off", None), ("0", None), (" OFF ", None)):
        monkeypatch.setenv(stall.ENV_STALL_WARNING, raw)
        assert stall.stall_warning_from_env() == want
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(stall.ENV_STALL_WARNING, bad)
        with pytest.raises(ValueError, match=r"GPUSTRAT_STALL_WARNING=.* is not a positive "
                                             r"number of seconds.*'off'"):
            stall.stall_warning_from_env()


def test_a_collective_some_ranks_skipped_is_named_with_its_fix():
    mine = waiting("Mean.result()", "train.py:42")
    other = waiting("next(DistributedIterator)", "train.py:35",
                    "allgather: the input pipeline's end-of-data agreement")
    text = stall.explain(0, mine, {0: [mine], 1: [other], 2: [other]}, 3)
    assert "  rank 0: waiting in Mean.result() at train.py:42 [all_reduce(SUM) on shape " \
           "(2,) float32] for 12 s" in text
    assert "  rank 2: waiting in next(DistributedIterator) at train.py:35" in text
    assert "A collective reached by some workers only: rank 0 waits in Mean.result() at " \
           "train.py:42, while rank 1 in next(DistributedIterator) at train.py:35; rank 2 " \
           "in next(DistributedIterator) at train.py:35" in text
    assert "`if task_id == 0: print(value)`" in text


def test_busy_ranks_silent_ranks_and_a_stuck_mpi_are_told_apart():
    mine = waiting("MultiWorkerMirroredStrategy.reduce()", "train.py:9")
    outside = {"state": "outside", "site": None, "call": None,
               "where": "train.py:5 (in evaluate)"}
    same = {"state": "working", "call": "MultiWorkerMirroredStrategy.reduce()",
            "site": "train.py:9"}
    text = stall.explain(0, mine, {0: [mine], 1: [outside], 3: [same]}, 4)
    assert "  rank 1: outside any gpustrat call, at train.py:5 (in evaluate)" in text
    assert "  rank 2: no answer within 2 s" in text
    assert "rank 1 is in no collective: either still working" in text
    assert "rank 3 is still working in the same call" in text
    assert "some workers only" not in text
    everyone = stall.explain(0, mine, {0: [mine], 1: [mine]}, 2)
    assert "Every rank waits in the same collective: MPI itself is not making progress" \
        in everyone


def test_a_place_is_read_from_a_threads_stack():
    # This test's own frame is "user code" outside gpustrat: outside any gpustrat call.
    place = stall.place_of(sys._getframe())
    assert place["state"] == "outside" and place["call"] is None
    assert place["where"].startswith("test_stall_explain.py:")
    assert place["where"].endswith("(in test_a_place_is_read_from_a_threads_stack)")
    # Inside a gpustrat call (here a map function that a dataset iterator runs): the
    # user's call and its line, working (no wait for other ranks).
    from gpustrat.data import Dataset  # noqa: PLC0415
    seen = []

    def look(x):
        seen.append(stall.place_of(sys._getframe()))
        return x
    it = iter(Dataset.range(1).map(look))
    line = sys._getframe().f_lineno + 1
    next(it)
    assert seen[0]["state"] == "working", seen
    assert seen[0]["call"] == "next(DatasetIterator)", seen
    assert seen[0]["site"] == f"test_stall_explain.py:{line}", seen
    # No thread waits: the main thread's place alone, read from another thread (as the
    # inspector's thread does), while the main thread joins it.
    got = []
    def read():
        time.sleep(0.3)  # the main thread is in join() by then
        got.extend(stall.this_rank())
    reader = threading.Thread(target=read)
    line = sys._getframe().f_lineno + 2
    reader.start()
    reader.join()
    assert [(p["state"], p["where"]) for p in got] == [
        ("outside", f"test_stall_explain.py:{line} (in test_a_place_is_read_from_a_threads_stack)")]
