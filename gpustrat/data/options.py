"""Dataset options, as ``tf.data.Options``.

Words:
    options: an :class:`Options` object attached to a dataset with
        ``dataset.with_options(opts)``; ``dataset.options()`` returns the options of the
        whole pipeline, merged.
    set field: a field a user assigned. Merging two options keeps, for each field, the
        value of the later options if it set that field, else the earlier one's. Unset
        fields read as their default. This is how ``tf.data`` merges options, so that
        ``ds.with_options(a).with_options(b)`` keeps a's fields that b leaves alone.
    auto-shard policy: how distributed input splits a dataset over workers
        (:class:`AutoShardPolicy`): by files, by data, or not at all.
"""

from __future__ import annotations

import enum
from typing import Any


class AutoShardPolicy(enum.IntEnum):
    """How a multi-worker strategy shards a dataset over workers (``tf.data`` values).

    AUTO: FILE when the pipeline reads files, else DATA.
    FILE: deal the input files over workers (file i to worker i mod W); each worker
        reads only its files. Fewer files than workers is an error.
    DATA: every worker reads everything and keeps its share of the elements.
    OFF: no sharding: every worker sees every element.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2

    # An IntEnum prints as its number from Python 3.11 on; print the name, which is
    # what a log line or an error message needs.
    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _OptionsBase:
    """Fields with defaults that remember which of them were set."""

    _defaults: dict[str, Any] = {}

    def __init__(self):
        object.__setattr__(self, "_set", {})

    def __getattr__(self, name):
        # Reached for every field: values live in _set, not in the instance dict.
        if name.startswith("__") or name == "_set":
            raise AttributeError(name)
        stored = self._set
        if name in stored:
            return stored[name]
        defaults = type(self)._defaults
        if name in defaults:
            value = defaults[name]
            return value() if callable(value) and isinstance(value, type) else value
        raise AttributeError(f"{type(self).__name__} has no option {name!r}; "
                             f"known options: {sorted(defaults)}")

    def __setattr__(self, name, value):
        if name not in type(self)._defaults:
            raise AttributeError(f"{type(self).__name__} has no option {name!r}; "
                                 f"known options: {sorted(type(self)._defaults)}")
        self._check(name, value)
        self._set[name] = value

    def _check(self, name, value):
        """Validate one field's value; subclasses override."""

    def _merge(self, later: "_OptionsBase") -> "_OptionsBase":
        out = type(self)()
        for name in type(self)._defaults:
            mine, theirs = self._set.get(name, _UNSET), later._set.get(name, _UNSET)
            if isinstance(mine, _OptionsBase) or isinstance(theirs, _OptionsBase):
                base = mine if mine is not _UNSET else type(theirs)()
                value = base._merge(theirs) if theirs is not _UNSET else base._merge(type(base)())
                out._set[name] = value
            elif theirs is not _UNSET:
                out._set[name] = theirs
            elif mine is not _UNSET:
                out._set[name] = mine
        return out

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in type(self)._defaults)

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in sorted(type(self)._defaults))
        return f"{type(self).__name__}({fields})"


_UNSET = object()


class DistributeOptions(_OptionsBase):
    """Options for distributing a dataset (``options.experimental_distribute``).

    Fields:
        auto_shard_policy: an :class:`AutoShardPolicy` (default AUTO).
        num_devices: the number of devices the dataset is split over, when known
            (default None); informational, as in ``tf.data``.
    """

    _defaults = {"auto_shard_policy": AutoShardPolicy.AUTO, "num_devices": None}

    def _check(self, name, value):
        if name == "auto_shard_policy":
            try:
                AutoShardPolicy(value)
            except ValueError:
                raise ValueError(f"auto_shard_policy must be an AutoShardPolicy "
                                 f"(AUTO, FILE, DATA, OFF), got {value!r}") from None
        if name == "num_devices" and value is not None and int(value) <= 0:
            raise ValueError(f"num_devices must be positive or None, got {value!r}")

    def __setattr__(self, name, value):
        if name == "auto_shard_policy" and not isinstance(value, AutoShardPolicy):
            self._check(name, value)
            value = AutoShardPolicy(value)
        super().__setattr__(name, value)


class ProcessingOptions(_OptionsBase):
    """Worker processes for a whole pipeline (``options.experimental_processing``).

    Fields:
        use_processes: True runs the calls of every ``map`` and ``interleave`` given
            ``num_parallel_calls`` in worker processes rather than threads, unless the
            call says ``use_processes=False`` (default None: threads).
        max_processes: the most processes ``num_parallel_calls=AUTOTUNE`` gives a
            stage on processes (default None: one per core this process may use).
    """

    _defaults = {"use_processes": None, "max_processes": None}

    def _check(self, name, value):
        if name == "use_processes" and value is not None and not isinstance(value, bool):
            raise TypeError(f"use_processes must be True, False or None, got "
                            f"{type(value).__name__} {value!r}")
        if name == "max_processes" and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"max_processes must be a positive int or None, got {value!r}")


class Options(_OptionsBase):
    """Options for a dataset, as ``tf.data.Options``.

    Fields:
        experimental_distribute: :class:`DistributeOptions`.
        experimental_processing: :class:`ProcessingOptions` (worker processes for
            ``map`` and ``interleave``; tf.data has no such options).
        deterministic: default for ``map``/``interleave`` calls whose ``deterministic``
            is None (default True: keep the order).
        experimental_deterministic: alias kept for code written for older ``tf.data``.
    """

    _defaults = {"experimental_distribute": DistributeOptions,
                 "experimental_processing": ProcessingOptions,
                 "deterministic": None}
    _sub = {"experimental_distribute": DistributeOptions,
            "experimental_processing": ProcessingOptions}

    def __getattr__(self, name):
        sub = type(self)._sub.get(name)
        if sub is not None and name not in self._set:
            # Hand out a stored object so that `opts.experimental_distribute.x = ...`
            # sticks, as in tf.data.
            value = sub()
            self._set[name] = value
            return value
        if name == "experimental_deterministic":
            return self.deterministic
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name == "experimental_deterministic":
            name = "deterministic"
        sub = type(self)._sub.get(name)
        if sub is not None and not isinstance(value, sub):
            raise TypeError(f"{name} must be a {sub.__name__}, got {type(value).__name__}")
        super().__setattr__(name, value)

    def merge(self, options: "Options") -> "Options":
        """A new Options: ``options``' set fields over this one's."""
        if not isinstance(options, Options):
            raise TypeError(f"can only merge Options, got {type(options).__name__}")
        return self._merge(options)
