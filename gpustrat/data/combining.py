"""``Dataset.zip`` and ``concatenate``: transformations of several input datasets."""

from __future__ import annotations

from typing import Any

from gpustrat import nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset
from gpustrat.data.iterator_state import FunctionIterator
from gpustrat.data.spec import merge_specs
from gpustrat.data.unary import _close


def _check_zip_structure(structure: Any) -> None:
    """Datasets in tuples, dicts and namedtuples. A list is refused, as tf.data does: it
    would make elements whose lists are structures, where a list is otherwise one array."""
    stack = [structure]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            raise TypeError(f"zip takes a (nested) structure of Datasets in tuples and dicts, "
                            f"found a list of {len(x)}: use a tuple instead")
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, tuple):
            stack.extend(x)
        elif not isinstance(x, Dataset):
            raise TypeError(f"zip takes a (nested) structure of Datasets, found "
                            f"{type(x).__name__} {x!r:.60}")


class ZipDataset(Dataset):
    """``Dataset.zip(structure of datasets)``: stops at the shortest input."""

    def __init__(self, structure: Any):
        _check_zip_structure(structure)
        flat = nest.flatten(structure)
        if not flat:
            raise ValueError(f"zip: {structure!r} holds no dataset; zip needs at least one")
        self._structure = structure
        self._datasets = tuple(flat)

    def _inputs(self):
        return self._datasets

    def _with_inputs(self, inputs):
        return ZipDataset(nest.pack_sequence_as(self._structure, list(inputs)))

    def _iter(self, ctx):
        its = [d._iter(ctx) for d in self._datasets]
        try:
            if nest.is_nested(self._structure):
                structure = self._structure
                _, pack = st.make_plan(structure)
                for row in zip(*its):
                    yield pack(row)
            else:
                yield from its[0]
        finally:
            for it in its:
                _close(it)

    def _state_iter(self, ctx):
        nested = nest.is_nested(self._structure)
        _, pack = st.make_plan(self._structure)

        def step_fn(it):
            row = [next(i) for i in it._inputs]
            return pack(row) if nested else row[0]
        return FunctionIterator([d._state_iter(ctx) for d in self._datasets], step_fn)

    def _cardinality(self):
        ns = [d._cardinality() for d in self._datasets]
        if UNKNOWN_CARDINALITY in ns:
            return UNKNOWN_CARDINALITY
        finite = [n for n in ns if n >= 0]
        return min(finite) if finite else INFINITE_CARDINALITY

    def _compute_spec(self):
        return nest.map_structure(lambda d: d.element_spec, self._structure)


class ConcatenateDataset(Dataset):
    """``a.concatenate(b)``."""

    def __init__(self, first: Dataset, second: Dataset):
        if not isinstance(second, Dataset):
            raise TypeError(f"concatenate needs a Dataset, got {type(second).__name__}")
        self._first, self._second = first, second

    def _inputs(self):
        return (self._first, self._second)

    def _with_inputs(self, inputs):
        return ConcatenateDataset(*inputs)

    def _iter(self, ctx):
        # tf.data refuses incompatible inputs when the dataset is built; here the specs
        # may need user code to run (a peek), so the check waits for the first element.
        try:
            self.element_spec
        except ValueError:
            pass  # an input too empty to have a spec conflicts with nothing
        for d in (self._first, self._second):
            it = d._iter(ctx)
            try:
                yield from it
            finally:
                _close(it)

    def _state_iter(self, ctx):
        try:
            self.element_spec
        except ValueError:
            pass

        def step_fn(it):
            while it.fields["which"] < 2:
                try:
                    return next(it._inputs[it.fields["which"]])
                except StopIteration:
                    it.fields["which"] += 1
            raise StopIteration
        return FunctionIterator((self._first._state_iter(ctx), self._second._state_iter(ctx)),
                                step_fn, which=0)

    def _cardinality(self):
        a, b = self._first._cardinality(), self._second._cardinality()
        if INFINITE_CARDINALITY in (a, b):
            return INFINITE_CARDINALITY
        if UNKNOWN_CARDINALITY in (a, b):
            return UNKNOWN_CARDINALITY
        return a + b

    def _compute_spec(self):
        a, b = self._first.element_spec, self._second.element_spec
        try:
            return merge_specs(a, b)
        except TypeError as e:
            raise TypeError(f"concatenate: the datasets' element specs are incompatible: "
                            f"{a} vs {b} ({e})") from None
