"""Restoring a checkpoint into an object graph: now, and later for objects made later.

Words:
    target: an entry of the restoring ``Checkpoint``'s graph whose key the checkpoint
        holds: it gets the saved value.
    pending: what a restore found no object for: the saved values of the checkpoint's
        keys that the graph did not hold, kept by the ``Checkpoint`` (with only their
        arrays) so that objects attached or made later get them, as TensorFlow's
        deferred restore gives a variable its value when a lazily built layer makes it.
    walk: looking at the graph again for pending keys. ``CheckpointLoadStatus``'s
        methods walk, and so do the ``Checkpoint``'s next ``save``, ``write``,
        ``restore`` and ``read`` (and ``CheckpointManager.save``), before they read or
        write anything; every target found is restored then, all or nothing, exactly
        as at the restore. Under several workers a walk with pending keys is a
        collective (one allgather of the keys each worker found, then the restore's
        own), so every worker makes these calls in the same order.

A pending key's object may have been used between the restore and the walk that finds
it (a layer made and trained by a step): restoring it then would throw the step's work
away, or keep a mix. So a target is refused (a ValueError naming its key, on every
worker, before anything is written) when its variables, or those of its optimizer or
metric, were written after the restore, or when a variable made after the restore no
longer holds its initial value.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from gpustrat.distribute import variables as vmod
from gpustrat.distribute.variables import Variable
from gpustrat.train import format as fmt
from gpustrat.train import graph, saving


def workers_of(entries: list):
    """The worker group the objects live in: their strategy's (a variable's, or that of
    the variables of a metric or an optimizer), else the current one's."""
    from gpustrat.distribute import context  # noqa: PLC0415
    for e in entries:
        for holder in (e.obj, *variables_of(e.obj)):
            strategy = getattr(holder, "distribute_strategy", None)
            if strategy is not None and hasattr(strategy, "workers"):
                return strategy.workers
    return context.get_strategy().workers


def variables_of(obj) -> list:
    """The variables a metric or an optimizer keeps (none for other objects)."""
    found = getattr(obj, "variables", None)
    return list(found) if isinstance(found, (list, tuple)) else []


# --- what a restore read ------------------------------------------------------------

class Saved:
    """A checkpoint as a restore read it: its index, its shared arrays, and this
    worker's per-worker trees (``local``, ``local_arrays``) or, where it was saved by
    another number of workers, every saved worker's (``every``: ``[(arrays, trees)]``)."""

    def __init__(self, path: str, index: dict, shared_arrays: dict, local: dict,
                 local_arrays: dict, every: list | None):
        self.path, self.index, self.shared_arrays = path, index, shared_arrays
        self.local, self.local_arrays, self.every = local, local_arrays, every

    @property
    def keys(self) -> set:
        return set(self.index["objects"]) | set(self.index["per_worker_objects"])

    def only(self, keys: set) -> "Saved":
        """The part of this checkpoint that ``keys`` need (the other arrays let go)."""
        index = dict(self.index)
        index["objects"] = {k: v for k, v in self.index["objects"].items() if k in keys}
        index["per_worker_objects"] = [k for k in self.index["per_worker_objects"]
                                       if k in keys]
        shared = _arrays_of([v["tree"] for v in index["objects"].values()],
                            self.shared_arrays)
        local = {k: v for k, v in (self.local or {}).items() if k in keys}
        local_arrays = _arrays_of([v["tree"] for v in local.values()], self.local_arrays)
        every = None
        if self.every is not None:
            every = []
            for arrays, trees in self.every:
                mine = {k: v for k, v in trees.items() if k in keys}
                every.append((_arrays_of([v["tree"] for v in mine.values()], arrays), mine))
        return Saved(self.path, index, shared, local, local_arrays, every)


def _arrays_of(trees: list, arrays) -> dict:
    """The arrays that encoded ``trees`` name."""
    out = {}

    def visit(t):
        if isinstance(t, list):
            for x in t:
                visit(x)
        elif isinstance(t, dict):
            for name in ("__array__", "__scalar__"):
                if name in t:
                    out[t[name]] = arrays[t[name]]
            for value in t.values():
                if isinstance(value, (list, dict)):
                    visit(value)
    for tree in trees:
        visit(tree)
    return out


def read(path: str, entries: list, workers) -> Saved:
    """Read the checkpoint at ``path`` for ``entries`` (this worker's part of it).

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: not a gpustrat checkpoint, a damaged one, or per-worker state that
            an entry cannot take from another number of workers.
    """
    index = _read_index(path)
    shared_arrays = fmt.read_arrays(fmt.data_file(path), index["array_offsets"],
                                    index.get("array_crc32"))
    saved_w, size = index["num_workers"], workers.size
    local, local_arrays, every = {}, {}, None
    if index["per_worker_objects"]:
        if saved_w == size:
            local_arrays, local = fmt.read_npz(fmt.worker_file(path, workers.rank, saved_w))
        else:
            # Another worker count: an object may take every saved worker's state (a
            # distributed iterator whose position is global), else it is an error.
            _check_topology([e for e in entries if e.kind == "per_worker"
                             and e.key in index["per_worker_objects"]], path, saved_w, size)
            every = [fmt.read_npz(fmt.worker_file(path, r, saved_w))
                     for r in range(saved_w)]
    return Saved(path, index, shared_arrays, local, local_arrays, every)


def _check_topology(targets: list, path: str, saved_w: int, size: int) -> None:
    fixed = [e.key for e in targets if e.kind == "per_worker"
             and not hasattr(e.obj, "_restore_checkpoint_state_from")]
    if fixed:
        raise ValueError(
            f"checkpoint {path!r} holds per-worker state of {fixed} saved by {saved_w} "
            f"workers; it cannot be restored by {size} workers: restart with {saved_w} "
            "workers, or restore without them")


def _read_index(path: str) -> dict:
    if not os.path.exists(fmt.index_file(path)):
        raise FileNotFoundError(f"no checkpoint at {path!r}: {fmt.index_file(path)!r} does "
                                "not exist (give the path that save() returned)")
    index = fmt.read_json(fmt.index_file(path))
    if index.get("format") != fmt.FORMAT or index.get("version") != fmt.VERSION:
        raise ValueError(f"{fmt.index_file(path)!r} is not a gpustrat checkpoint of "
                         f"version {fmt.VERSION} (format {index.get('format')!r}, version "
                         f"{index.get('version')!r})")
    return index


# --- restoring targets, all or nothing ----------------------------------------------

def restore(entries: list, targets: list, saved: Saved, workers, pending=None) -> None:
    """Restore ``targets`` (entries of the graph ``entries``) from ``saved``.

    Everything is checked before anything is written: every target's kind, class,
    shapes and dtypes (and an optimizer's or metric's own checks), and for a walk
    (``pending`` given) that no target was written since the restore; then every
    worker's per-worker state is restored, and only when all of it succeeded on every
    worker are the shared objects written. A walk first agrees on the targets' keys.
    """
    path = saved.path
    mismatch, writes = None, []
    try:
        if pending is not None:
            if saved.every is not None:
                _check_topology(targets, path, saved.index["num_workers"], workers.size)
            pending.check_unused(targets)
        writes = _prepare_shared(entries, _decode_shared(targets, saved.index,
                                                         saved.shared_arrays))
    except Exception as e:  # noqa: BLE001 - raised on every worker below
        mismatch = e
    found = _agree_on_checks(workers, mismatch, path,
                             None if pending is None else [e.key for e in targets])
    if pending is not None and not found:
        return
    error = None
    try:
        for e in targets:
            if e.kind != "per_worker":
                continue
            if saved.every is None:
                e.obj._restore_checkpoint_state(fmt.decode(saved.local[e.key]["tree"],
                                                           saved.local_arrays))
            else:
                e.obj._restore_checkpoint_state_from(
                    [fmt.decode(trees[e.key]["tree"], arrays)
                     for arrays, trees in saved.every])
    except Exception as e:  # noqa: BLE001
        error = saving.describe(e)
    saving.agree(workers, error, f"restoring the per-worker state of {path!r} (the "
                 "variables, optimizers, metrics and numbers were not restored)")
    # The shared objects' writes may be collectives (the same on every worker).
    for write in writes:
        write()


def _saved_category(key: str, index: dict) -> str:
    if key in index["per_worker_objects"]:
        return "per_worker"
    kind = index["objects"][key]["kind"]
    return kind if kind in ("variable", "number") else "shared"


_WORDS = {"variable": "a variable", "number": "a number",
          "shared": "an object's shared state (an optimizer or metric)",
          "per_worker": "an iterator's per-worker position"}


def _decode_shared(targets: list, index: dict, arrays: dict) -> dict:
    """The saved value of every target, checked against it (kind, variable shape)
    before anything is restored: a mismatch restores nothing. The same checks on every
    worker, so the error is raised on every one."""
    out = {}
    for e in targets:
        saved = _saved_category(e.key, index)
        here = e.kind
        if saved != here:
            what = type(e.obj).__name__
            raise ValueError(
                f"checkpoint key {e.key!r} holds {_WORDS[saved]}, but this Checkpoint has "
                f"{_WORDS[here]} there ({what}): restore into the structure that was "
                "saved")
        if here == "per_worker":
            continue
        if here == "shared":
            _check_class(e.key, e.obj, index["objects"][e.key]["kind"])
        value = fmt.decode(index["objects"][e.key]["tree"], arrays)
        if here == "variable":
            _check_shape(e.key, e.obj, value)
        out[e.key] = value
    return out


def _prepare_shared(entries: list, shared: dict) -> list:
    """One function per shared target that writes its saved value, made once every
    target was checked (an optimizer or a metric checks its own state first, against
    the variables of the whole graph ``entries``): a mismatch raises, naming the key,
    before anything is written."""
    writes = []
    keys = graph.VariableKeys(entries)
    for e in entries:
        if e.key not in shared:
            continue
        value = shared[e.key]
        if e.kind == "variable":
            _check_dtype(e.key, e.obj, value)
            _check_writable(e.key, e.obj)
            writes.append(lambda var=e.obj, value=value: var.assign(value))
        elif e.kind == "number":
            number = value.item() if isinstance(value, np.generic) else value
            writes.append(lambda e=e, number=number: e.owner._objects.__setitem__(e.name,
                                                                                  number))
        else:
            prepare = getattr(e.obj, "_prepare_checkpoint_restore", None)
            if prepare is None:
                writes.append(lambda obj=e.obj, value=value:
                              obj._restore_checkpoint_state(value))
                continue
            try:
                writes.append(prepare(value, keys) if getattr(
                    type(e.obj), "_checkpoint_by_variable_keys", False) else prepare(value))
            except (ValueError, TypeError) as err:
                raise type(err)(f"checkpoint key {e.key!r}: {err}") from None
    return writes


def _agree_on_checks(workers, mismatch: Exception | None, path: str,
                     keys: list | None = None) -> bool:
    """Raise ``mismatch`` (as it is) on the worker that had it, and a ValueError naming
    it on the others (one collective under several workers), before any restore. With
    ``keys`` (a walk's targets), every worker must have found the same ones; returns
    whether there are any."""
    mine = (None if mismatch is None else saving.describe(mismatch), keys)
    every = workers.allgather(mine) if workers.size > 1 else [mine]
    if mismatch is not None:
        raise mismatch
    bad = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
    if bad:
        raise ValueError(f"restoring checkpoint {path!r}: nothing was restored, because "
                         + "; ".join(f"worker {r}: {e}" for r, e in bad))
    if len({tuple(k or ()) for _, k in every}) > 1:
        raise ValueError(
            f"restoring checkpoint {path!r} into objects attached after the restore: "
            "the workers' Checkpoints hold different objects at its keys ("
            + "; ".join(f"worker {r}: {k}" for r, (_, k) in enumerate(every))
            + "); nothing was restored: every worker must build the same objects, in "
            "the same order, before the same call")
    return bool(keys)


def _check_class(key: str, obj, saved: str) -> None:
    """``obj`` takes state saved from an object of class ``saved``: that class or a
    subclass of it (a class named ``saved`` among its bases)."""
    if saved in {c.__name__ for c in type(obj).__mro__}:
        return
    raise ValueError(
        f"checkpoint key {key!r} holds state saved from class {saved}, but this "
        f"Checkpoint has class {type(obj).__name__} there, whose state differs (an "
        f"optimizer's slots, a metric's totals); nothing was restored: restore into an "
        f"object of class {saved} (or a subclass), or leave the key out of the "
        "Checkpoint to start that object afresh")


def _check_shape(key: str, var: Variable, value: np.ndarray) -> None:
    if tuple(value.shape) != tuple(var.shape):
        raise ValueError(f"Checkpoint: variable {key!r} has shape {tuple(var.shape)}, the "
                         f"checkpoint holds shape {tuple(value.shape)}; nothing was "
                         "restored: restore into a variable of the saved shape")


def _check_dtype(key: str, var: Variable, value: np.ndarray) -> None:
    """A saved value is never cast, as in TensorFlow (float32 into float16 would turn
    70000 into inf; float into int would truncate)."""
    if np.dtype(value.dtype) != np.dtype(var.dtype):
        raise ValueError(f"Checkpoint: variable {key!r} has dtype {var.dtype}, the "
                         f"checkpoint holds dtype {value.dtype}; nothing was restored "
                         "(a restore never casts): restore into a variable of the saved "
                         f"dtype, e.g. gs.Variable(..., dtype={str(value.dtype)!r}), and "
                         "cast afterwards if another one is meant")


def _check_writable(key: str, var: Variable) -> None:
    """A sync-on-read variable with aggregation NONE cannot be assigned outside run."""
    from gpustrat.distribute.distributed_variables import SyncOnReadVariable  # noqa
    from gpustrat.distribute.variables import VariableAggregation  # noqa: PLC0415
    if isinstance(var, SyncOnReadVariable) and \
            var.aggregation is VariableAggregation.NONE:
        raise ValueError(f"Checkpoint: variable {key!r} is sync-on-read with aggregation "
                         "NONE, which cannot be assigned one value for all replicas; "
                         "nothing was restored: make it with aggregation SUM, MEAN or "
                         "ONLY_FIRST_REPLICA, or leave it out of the Checkpoint")


# --- pending keys and the load status -------------------------------------------------

class Pending:
    """The keys a restore found no object for, their saved values, and what a walk
    needs to restore them later (see the module docstring)."""

    def __init__(self, saved: Saved, entries: list, targets: list):
        matched = {e.key for e in targets}
        self.keys = saved.keys - matched
        # Objects whose state refers to variables by key (an optimizer's slots): a walk
        # that finds new variables gives them their state again, so that the slots of
        # variables made after the restore reach them, unless they were written since.
        self.again = {e.key: e.obj for e in targets if e.kind == "shared" and
                      getattr(type(e.obj), "_checkpoint_by_variable_keys", False)}
        self.saved = saved.only(self.keys | set(self.again))
        self.var_keys = {e.key for e in entries if e.kind == "variable"}
        self.since = vmod.write_stamp()
        self.restored_at: dict = {}
        self.closed = False
        vmod.watch_creations(1)
        self._finalizer = weakref.finalize(self, vmod.watch_creations, -1)

    def close(self) -> None:
        """Stop waiting: no later walk restores anything (the keys still pending stay
        to be reported as not restored)."""
        self.closed = True
        self.again = {}
        self.saved = None
        self._finalizer()

    def _threshold(self, obj) -> int:
        return self.restored_at.get(id(obj), self.since)

    def _written(self, e) -> bool:
        """Whether the entry's variables were written after the restore gave them (or
        after the restore, for an object it did not give anything)."""
        held = [e.obj] if e.kind == "variable" else variables_of(e.obj)
        limit = self._threshold(e.obj)
        return any(vmod.written_at(v) > limit for v in held)

    def check_unused(self, targets: list) -> None:
        """Raise unless every pending target still holds what it held at the restore
        (see the module docstring): its saved value would otherwise overwrite work."""
        for e in targets:
            if e.key not in self.keys:
                continue
            held = [e.obj] if e.kind == "variable" else variables_of(e.obj)
            if self._written(e) or any(vmod.changed_since_creation(v) for v in held):
                what = "variable" if e.kind == "variable" else type(e.obj).__name__
                raise ValueError(
                    f"checkpoint key {e.key!r}: this {what} was attached after the "
                    f"restore of {self.saved.path!r} and written before its saved value "
                    "could be restored (a training step updated it); nothing was "
                    "restored: once the model is built, call status.run_restore_ops() "
                    "(or assert_consumed()) on the status restore() returned, before "
                    "training")

    def walk(self, checkpoint) -> list:
        """Restore the pending keys ``checkpoint``'s graph holds now (a collective
        under several workers while keys are pending); return the graph's entries."""
        entries = checkpoint._graph(restoring=True)
        if self.closed:
            return entries
        workers = workers_of(entries)
        var_keys = {e.key for e in entries if e.kind == "variable"}
        grew = bool(var_keys - self.var_keys)
        targets = [e for e in entries if e.key in self.keys or
                   (grew and self.again.get(e.key) is e.obj and not self._written(e))]
        if workers.size == 1 and not targets:
            return entries
        restore(entries, targets, self.saved, workers, pending=self)
        stamp = vmod.write_stamp()
        for e in targets:
            if e.kind == "shared" and getattr(type(e.obj), "_checkpoint_by_variable_keys",
                                              False):
                self.again[e.key] = e.obj
                self.restored_at[id(e.obj)] = stamp
        self.keys -= {e.key for e in targets}
        self.var_keys = var_keys
        if not self.keys:
            self.close()
        return entries


class CheckpointLoadStatus:
    """What a restore matched: the checkpoint's keys against the Checkpoint's graph.

    Each method first walks the graph (see :mod:`gpustrat.train.restoring`): objects
    attached or made since the restore get their saved values, all or nothing, then
    the method checks. A collective under several workers while keys are pending.
    """

    def __init__(self, checkpoint, pending: Pending | None, saved_keys: set,
                 matched: set):
        self._checkpoint, self._pending = checkpoint, pending
        self._saved_keys, self._matched = set(saved_keys), set(matched)

    def _walk(self) -> tuple[list, list]:
        """The graph's keys the checkpoint lacks, and the checkpoint's keys not restored
        (after restoring what the graph holds now)."""
        ckpt, pending = self._checkpoint, self._pending
        if pending is not None and ckpt.__dict__.get("_pending") is pending:
            entries = pending.walk(ckpt)
        else:
            entries = ckpt._graph(restoring=True)
        keys = [e.key for e in entries]
        unused = pending.keys if pending is not None else set()
        self._matched |= self._saved_keys - unused
        return [k for k in keys if k not in self._saved_keys], sorted(unused)

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Raise unless every object was restored and every saved object was used."""
        missing, unused = self._walk()
        if missing or unused:
            raise AssertionError(
                f"checkpoint restore was partial: objects of this Checkpoint not in the "
                f"checkpoint {missing}, saved objects not restored {unused}")
        return self

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Raise unless every object of this Checkpoint was in the checkpoint (saved
        objects this Checkpoint lacks are allowed: restoring a part of a checkpoint)."""
        missing, _ = self._walk()
        if missing:
            raise AssertionError(f"objects of this Checkpoint not in the checkpoint: "
                                 f"{missing}")
        return self

    def assert_nontrivial_match(self) -> "CheckpointLoadStatus":
        """Raise unless at least one object of the checkpoint was restored."""
        self._walk()
        if not self._matched:
            raise AssertionError(
                f"nothing of the checkpoint was restored: none of its keys "
                f"{sorted(self._saved_keys)} is an object of this Checkpoint")
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Accept a partial restore: restore what the graph holds now, check nothing."""
        self._walk()
        return self

    def run_restore_ops(self, session=None) -> None:
        """Restore the saved values of the objects attached or made since the restore
        (``session`` is TensorFlow 1's and must be None)."""
        if session is not None:
            raise ValueError("run_restore_ops: session must be None (a TensorFlow 1 "
                             "argument; gpustrat restores at the call)")
        self._walk()


class InitializationOnlyStatus:
    """The status of ``restore(None)`` (no checkpoint yet, as
    ``latest_checkpoint`` of a fresh directory gives): nothing was restored, so the
    assertions raise, as TensorFlow's; ``expect_partial``, ``run_restore_ops`` and
    ``initialize_or_restore`` do nothing."""

    _WHY = "no checkpoint was given (save_path=None): nothing was restored"

    def assert_consumed(self):
        raise AssertionError(self._WHY)

    def assert_existing_objects_matched(self):
        raise AssertionError(self._WHY)

    def assert_nontrivial_match(self):
        raise AssertionError(self._WHY)

    def expect_partial(self) -> "InitializationOnlyStatus":
        return self

    def run_restore_ops(self, session=None) -> None:
        return None

    def initialize_or_restore(self, session=None) -> None:
        return None
