"""The functions of ``tf.data.experimental``: transformations for ``Dataset.apply`` and
helpers that take a dataset, each doing what the :class:`Dataset` method of the same
meaning does.

Words:
    transformation: a function ``dataset -> dataset``, used as ``ds.apply(t)``; the
        functions here return one, as ``tf.data.experimental``'s do.
    method transformation: a transformation that calls one Dataset method with the
        arguments it was given (``scan(s, f)`` is ``lambda ds: ds.scan(s, f)``).
        :data:`METHOD_TRANSFORMATIONS` names them; :func:`available` keeps those whose
        method the Dataset class has, so that ``gs.data.experimental`` offers a name
        exactly when the pipeline can honour it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

# tf.data.experimental name -> the Dataset method it applies.
METHOD_TRANSFORMATIONS = {
    "unbatch": "unbatch",
    "enumerate_dataset": "enumerate",
    "scan": "scan",
    "unique": "unique",
    "ignore_errors": "ignore_errors",
    "group_by_window": "group_by_window",
    "bucket_by_sequence_length": "bucket_by_sequence_length",
    "take_while": "take_while",
    "assert_cardinality": "assert_cardinality",
    "dense_to_ragged_batch": "ragged_batch",
    "rejection_resample": "rejection_resample",
}

# tf.data.experimental name -> the Dataset static method (a source of several datasets)
# it calls, with tf.data.experimental's own defaults where they differ from the method's.
STATIC_FUNCTIONS = {
    "sample_from_datasets": ("sample_from_datasets", {"stop_on_empty_dataset": False}),
    "choose_from_datasets": ("choose_from_datasets", {"stop_on_empty_dataset": False}),
}


def _dataset_class():
    from gpustrat.data.dataset import Dataset  # noqa: PLC0415 - keeps this module light
    return Dataset


def method_transformation(name: str) -> Callable[..., Callable]:
    """The transformation factory ``name`` of :data:`METHOD_TRANSFORMATIONS`."""
    method = METHOD_TRANSFORMATIONS[name]

    def factory(*args, **kwargs) -> Callable:
        def transformation(dataset):
            return getattr(dataset, method)(*args, **kwargs)
        return transformation

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (f"A transformation for ``Dataset.apply``: "
                       f"``lambda ds: ds.{method}(*args, **kwargs)``.")
    return factory


def static_function(name: str) -> Callable:
    """The function ``name`` of :data:`STATIC_FUNCTIONS`."""
    method, defaults = STATIC_FUNCTIONS[name]

    def function(*args, **kwargs):
        return getattr(_dataset_class(), method)(*args, **{**defaults, **kwargs})

    function.__name__ = function.__qualname__ = name
    function.__doc__ = (f"``Dataset.{method}`` with "
                        + ", ".join(f"{k}={v!r}" for k, v in defaults.items())
                        + " by default, as in ``tf.data.experimental``.")
    return function


def available() -> dict[str, Callable]:
    """``{name: function}`` for every method transformation and static function whose
    Dataset method exists."""
    cls = _dataset_class()
    out = {n: method_transformation(n) for n, m in METHOD_TRANSFORMATIONS.items()
           if hasattr(cls, m)}
    out.update({n: static_function(n) for n, (m, _) in STATIC_FUNCTIONS.items()
                if hasattr(cls, m)})
    return out


def cardinality(dataset) -> int:
    """``dataset.cardinality()``: a count, INFINITE_CARDINALITY (-1) or
    UNKNOWN_CARDINALITY (-2)."""
    return dataset.cardinality()


def get_single_element(dataset) -> Any:
    """``dataset.get_single_element()``."""
    return dataset.get_single_element()


def get_structure(dataset_or_iterator) -> Any:
    """The element spec of a dataset or iterator."""
    return dataset_or_iterator.element_spec


def shuffle_and_repeat(buffer_size: int, count: int | None = None, seed: int | None = None
                       ) -> Callable:
    """``lambda ds: ds.shuffle(buffer_size, seed).repeat(count)``."""
    return lambda dataset: dataset.shuffle(buffer_size, seed).repeat(count)


def map_and_batch(map_func: Callable, batch_size: int, num_parallel_batches: int | None = None,
                  drop_remainder: bool = False, num_parallel_calls: int | None = None
                  ) -> Callable:
    """``lambda ds: ds.map(map_func, parallel).batch(batch_size, drop_remainder)``; the
    parallelism is ``num_parallel_calls``, else ``num_parallel_batches * batch_size``."""
    if num_parallel_calls is None and num_parallel_batches is not None:
        num_parallel_calls = num_parallel_batches * batch_size
    return lambda dataset: dataset.map(map_func, num_parallel_calls).batch(
        batch_size, drop_remainder)


def parallel_interleave(map_func: Callable, cycle_length: int, block_length: int = 1,
                        sloppy: bool | None = False, buffer_output_elements: int | None = None,
                        prefetch_input_elements: int | None = None) -> Callable:
    """``ds.interleave`` with ``cycle_length`` inputs read in parallel; ``sloppy`` lets
    elements come in the order they are ready. The buffer sizes are accepted and left to
    the interleave's own buffering."""
    del buffer_output_elements, prefetch_input_elements
    return lambda dataset: dataset.interleave(
        map_func, cycle_length=cycle_length, block_length=block_length,
        num_parallel_calls=cycle_length, deterministic=not sloppy)
