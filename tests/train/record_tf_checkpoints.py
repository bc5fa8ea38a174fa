"""Deferred restores and ``CheckpointManager`` schedules, run with real TensorFlow or
with gpustrat, printed as JSON.

Not a test and not imported by the tests (pytest collects ``test_*.py`` only);
``tf_recorded_checkpoints.py`` hard-codes what TensorFlow 2.21 printed. With a venv that
has ``tensorflow-cpu==2.21.*``::

    /path/to/tf-venv/bin/python tests/train/record_tf_checkpoints.py tf > /tmp/tf.json
    python tests/train/record_tf_checkpoints.py gs > /tmp/gs.json   # then compare

The manager's clock is replaced by a fake one (``time.time`` of the module that reads
it), so ``keep_checkpoint_every_n_hours`` is recorded at chosen times.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

LIB = "tf" if sys.argv[1:2] == ["tf"] else "gs"
if LIB == "tf":
    import tensorflow as tf
    from tensorflow.python.checkpoint import checkpoint_management as clock_module
    Var, Ckpt, Manager, Base = tf.Variable, tf.train.Checkpoint, tf.train.CheckpointManager, \
        tf.Module
else:
    import gpustrat as gs
    from gpustrat.train import manager as clock_module
    Var, Ckpt, Manager, Base = gs.Variable, gs.train.Checkpoint, gs.train.CheckpointManager, \
        object


class Lazy(Base):
    """A model whose variables are made by ``build`` (a layer built on first call)."""

    def __init__(self):
        super().__init__()
        self.layers = []

    def build(self):
        self.w = Var(np.zeros(2, np.float32))
        self.layers.append(Var(np.zeros(1, np.float32)))


def outcome(fn):
    try:
        fn()
        return "ok"
    except AssertionError:
        return "AssertionError"


def deferred(directory: str) -> dict:
    m = Lazy()
    m.build()
    m.w.assign(np.float32([3, 4]))
    m.layers[0].assign(np.float32([5]))
    path = Ckpt(model=m).save(os.path.join(directory, "c"))
    out = {}
    m2 = Lazy()
    status = Ckpt(model=m2).restore(path)
    out["before_build/existing_matched"] = outcome(status.assert_existing_objects_matched)
    out["before_build/consumed"] = outcome(status.assert_consumed)
    m2.build()
    out["after_build/consumed"] = outcome(status.assert_consumed)
    out["after_build/values"] = [m2.w.numpy().tolist(), m2.layers[0].numpy().tolist()]
    # Part of the model first, the rest later.
    m3 = Lazy()
    m3.w = Var(np.zeros(2, np.float32))
    status = Ckpt(model=m3).restore(path)
    out["partial/w"] = m3.w.numpy().tolist()
    out["partial/existing_matched"] = outcome(status.assert_existing_objects_matched)
    out["partial/consumed"] = outcome(status.assert_consumed)
    m3.layers.append(Var(np.zeros(1, np.float32)))
    out["partial/consumed_after"] = outcome(status.assert_consumed)
    out["partial/layer"] = m3.layers[0].numpy().tolist()
    return out


class Clock:
    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def names(paths) -> list:
    return [os.path.basename(p) for p in paths]


def on_disk(directory: str) -> list:
    return sorted({f.split(".")[0] for f in os.listdir(directory) if f.startswith("ckpt-")})


def manager_hours(directory: str) -> dict:
    clock = Clock(1_000_000.0)
    real = clock_module.time
    clock_module.time = clock
    try:
        v = Var(np.zeros(1, np.float32))
        mgr = Manager(Ckpt(v=v), directory, max_to_keep=2, keep_checkpoint_every_n_hours=1)
        out = {"saves": []}
        for minutes in (0, 20, 40, 70, 90, 130, 150, 200):
            clock.now = 1_000_000.0 + 60 * minutes
            path = mgr.save()
            out["saves"].append([minutes, os.path.basename(path), names(mgr.checkpoints),
                                 on_disk(directory)])
        clock.now += 60
        again = Manager(Ckpt(v=v), directory, max_to_keep=2)
        out["again/checkpoints"] = names(again.checkpoints)
        out["again/latest"] = os.path.basename(again.latest_checkpoint)
        again.save()
        out["again/after_save"] = [names(again.checkpoints), on_disk(directory)]
        return out
    finally:
        clock_module.time = real


def manager_interval(directory: str) -> dict:
    step = Var(0, dtype=np.int64)
    ckpt = Ckpt(step=step)
    mgr = Manager(ckpt, directory, max_to_keep=None, step_counter=step,
                  checkpoint_interval=3)
    out = {"interval": mgr.checkpoint_interval, "saves": []}
    for s in range(10):
        step.assign(s)
        path = mgr.save()
        out["saves"].append([s, None if path is None else os.path.basename(path)])
    out["same_step_unchecked"] = mgr.save(check_interval=False)
    step.assign(10)
    out["unchecked"] = os.path.basename(mgr.save(check_interval=False))
    out["number"] = os.path.basename(mgr.save(checkpoint_number=100)) \
        if step.assign(20) is not None else None
    out["checkpoints"] = names(mgr.checkpoints)
    out["save_counter"] = int(ckpt.save_counter)
    # restore_or_initialize, and where its interval counts from.
    calls = []
    step2 = Var(0, dtype=np.int64)
    other = Manager(Ckpt(step=step2), directory, max_to_keep=None, step_counter=step2,
                    checkpoint_interval=3, init_fn=lambda: calls.append(1))
    out["restore_or_initialize"] = os.path.basename(other.restore_or_initialize())
    out["restored_step"] = int(step2.numpy())
    step2.assign(22)
    out["after_restore_22"] = other.save()
    step2.assign(23)
    out["after_restore_23"] = os.path.basename(other.save())
    empty = Manager(Ckpt(step=Var(0, dtype=np.int64)), os.path.join(directory, "none"),
                    max_to_keep=1, init_fn=lambda: calls.append(2))
    out["empty/restore_or_initialize"] = empty.restore_or_initialize()
    out["init_fn_calls"] = calls
    return out


def main() -> None:
    out = {}
    for name, fn in (("deferred", deferred), ("hours", manager_hours),
                     ("interval", manager_interval)):
        with tempfile.TemporaryDirectory() as d:
            out[name] = fn(d)
    print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
