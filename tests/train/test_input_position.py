"""Property tests of the topology-independent input position: steps taken on one
topology (W workers x R replicas, dealt as under DATA or streamed as under OFF), replayed
to a position, and continued on another, deliver each remaining row once, and are the
uninterrupted run's steps of the new topology from the step that holds the position,
with the rows before it taken out of that step's pieces."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpustrat.distribute.input_position import Layout, clipped_steps, replay
from gpustrat.distribute.splitting import Splitter, deal_steps


def stream(sizes):
    """Batches whose rows are their global row numbers (batch index * 1000 + row)."""
    return [np.arange(b * 1000, b * 1000 + n) for b, n in enumerate(sizes)]


def run(batches, layout):
    """The uninterrupted steps of ``layout``'s worker, by the distribution code itself
    (independent of input_position)."""
    splitter = Splitter(layout.num_pieces)
    stream_mode = not layout.dealt
    return [[p.tolist() for p in step] for step in deal_steps(
        iter(batches), splitter, layout.worker, layout.num_workers, layout.local,
        stream_mode)]


def continued(batches, saved, steps, new, origin=(0, 0)):
    """Replay ``steps`` of ``saved`` from ``origin``, then continue on ``new``."""
    source = iter(batches)
    position, current = replay(source, saved, origin, steps, Splitter(saved.num_pieces))
    splitter = Splitter(new.num_pieces)
    head = [] if current is None else clipped_steps(current, position[1], new, splitter)
    rest = [[p.tolist() for p in step] for step in head] + run(list(source), new)
    return position, rest


def flat(steps):
    return [v for step in steps for piece in step for v in piece]


def layouts(dealt):
    return st.tuples(st.integers(1, 4), st.integers(1, 3)).map(
        lambda t: (t[0], t[1], dealt or t[0] == 1))


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 13), min_size=1, max_size=6),
       old=layouts(False), new=layouts(False), data=st.data())
def test_off_every_worker_continues_its_stream_exactly(sizes, old, new, data):
    """OFF (and one worker): each worker reads every row once, before and after."""
    batches = stream(sizes)
    a = Layout(*old, worker=data.draw(st.integers(0, old[0] - 1)))
    b = Layout(*new, worker=data.draw(st.integers(0, new[0] - 1)))
    taken = run(batches, a)
    k = data.draw(st.integers(0, len(taken)))
    position, rest = continued(batches, a, k, b)
    every = [v for batch in batches for v in batch.tolist()]
    assert flat(taken[:k]) + flat(rest) == every          # once each, in stream order
    full = run(batches, b)
    if rest:
        # After the first step, exactly the uninterrupted run's last steps; the first is
        # the uninterrupted step holding the position, rows before it taken out.
        assert rest[1:] == full[len(full) - len(rest) + 1:]
        first = full[len(full) - len(rest)]
        assert all(p[len(p) - len(q):] == q for p, q in zip(first, rest[0]))
        if position[1] == 0:
            assert rest == full[len(full) - len(rest):]


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 13), min_size=1, max_size=6),
       old=layouts(False), new=layouts(True), data=st.data())
def test_a_streamed_position_continues_dealt_over_every_worker_once(sizes, old, new, data):
    """OFF saved mid-batch, restored under DATA (dealt over several workers): the
    workers' pieces together hold every remaining row once."""
    batches = stream(sizes)
    a = Layout(*old, worker=0)
    taken = run(batches, a)
    k = data.draw(st.integers(0, len(taken)))
    rests = [continued(batches, a, k, Layout(*new, worker=w))[1] for w in range(new[0])]
    assert len({len(r) for r in rests}) == 1            # every worker the same steps
    remaining = sorted(v for r in rests for v in flat(r))
    every = [v for batch in batches for v in batch.tolist()]
    assert remaining == every[len(flat(taken[:k])):]


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 13), min_size=1, max_size=6),
       layouts3=st.lists(layouts(False), min_size=3, max_size=3), data=st.data())
def test_a_restored_position_saved_again_moves_on(sizes, layouts3, data):
    """Saved on A, restored on B (origin mid-batch), saved again after some B steps and
    restored on C: still every row once."""
    batches = stream(sizes)
    a, b, c = (Layout(*t) for t in layouts3)
    taken_a = run(batches, a)
    k = data.draw(st.integers(0, len(taken_a)))
    origin, rest_b = continued(batches, a, k, b)
    j = data.draw(st.integers(0, len(rest_b)))
    _, rest_c = continued(batches, b, j, c, origin=origin)
    every = [v for batch in batches for v in batch.tolist()]
    assert flat(taken_a[:k]) + flat(rest_b[:j]) + flat(rest_c) == every


def test_same_replica_count_change_on_aligned_pieces_is_the_uninterrupted_run():
    # 2x2 -> 2x1 with 12-row batches: 6 rows a step either way.
    batches = stream([12, 12, 12])
    a, b = Layout(2, 2, False), Layout(2, 1, False)
    position, rest = continued(batches, a, 3, b)
    assert position == (1, 6)
    assert rest == run(batches, b)[3:]
    # 2x1 -> 3x1: the step holding row 6 of batch 1 (rows 4..7) keeps rows 6 and 7.
    position, rest = continued(batches, Layout(2, 1, False), 3, Layout(3, 1, False))
    assert position == (1, 6) and rest[0] == [[1006, 1007]]
    assert rest[1:] == run(batches, Layout(3, 1, False))[5:]
