"""``Dataset.sample_from_datasets`` and ``Dataset.choose_from_datasets``.

Words:
    inputs: the datasets elements are drawn from; their element specs must be
        compatible (the result's spec is the most specific spec covering all of them).
    pick: the index of the input the next element comes from: drawn at random with
        probabilities proportional to ``weights`` (sample), or read from
        ``choice_dataset`` (choose).
    exhausted input: one that has ended. With ``stop_on_empty_dataset`` the result
        ends at the first pick of an exhausted input; otherwise such picks are skipped
        (sampling draws among the inputs left, with their weights renormalised), and
        the result ends when every input has ended or the picks run out.
    seed: sampling draws from NumPy's generator seeded with ``(seed, epoch)``, where
        ``epoch`` counts this node's iterations when ``rerandomize_each_iteration`` is
        true or no seed was given, and is 0 otherwise (every epoch the same order, as
        ``tf.data``). A fixed seed gives the same order in every process; ``seed=None``
        draws one when the dataset is built.

Cardinality follows ``tf.data``: infinite when an input is infinite, else unknown.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from typing import Sequence

import numpy as np

from gpustrat.data.dataset import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset
from gpustrat.data.iterator_state import FunctionIterator, StateIterator, resume_epochs
from gpustrat.data.spec import TensorSpec, merge_specs
from gpustrat.data.unary import _close

_INT64 = np.dtype(np.int64)
_DRAWS = 1024  # uniform numbers drawn per NumPy call


def _check_datasets(datasets, what: str) -> list[Dataset]:
    if isinstance(datasets, Dataset) or not isinstance(datasets, (list, tuple)):
        raise TypeError(f"{what}: datasets must be a list of Datasets, got "
                        f"{type(datasets).__name__}")
    if not datasets:
        raise ValueError(f"{what}: datasets must not be empty")
    for i, d in enumerate(datasets):
        if not isinstance(d, Dataset):
            raise TypeError(f"{what}: datasets[{i}] is a {type(d).__name__}, not a Dataset")
    return list(datasets)


class _DirectedDataset(Dataset):
    """Elements of ``self._datasets`` in the order of the picks (``_picks``)."""

    _what = "choose_from_datasets"

    def __init__(self, datasets: list[Dataset], stop_on_empty_dataset: bool):
        self._datasets = datasets
        self._stop = bool(stop_on_empty_dataset)

    def _cardinality(self):
        if any(d._cardinality() == INFINITE_CARDINALITY for d in self._datasets):
            return INFINITE_CARDINALITY
        return UNKNOWN_CARDINALITY  # as tf.data, even when every count is known

    def _compute_spec(self):
        spec = self._datasets[0].element_spec
        for i, d in enumerate(self._datasets[1:], 1):
            try:
                spec = merge_specs(spec, d.element_spec)
            except TypeError:
                raise TypeError(f"{self._what}: the datasets' element specs are "
                                f"incompatible: datasets[0] has {self._datasets[0].element_spec}"
                                f", datasets[{i}] has {d.element_spec}") from None
        return spec

    def _picks(self, ctx, active: list[bool]):
        """Generator of input indices; ``active`` says which inputs have not ended."""
        raise NotImplementedError

    def _iter(self, ctx):
        try:
            self.element_spec  # incompatible inputs are an error before any element
        except ValueError:
            pass  # an input too empty to have a spec conflicts with nothing
        n = len(self._datasets)
        its: list = [None] * n
        active = [True] * n
        left = n
        picks = self._picks(ctx, active)
        try:
            for i in picks:
                if not active[i]:
                    continue
                if its[i] is None:
                    its[i] = self._datasets[i]._iter(ctx)
                try:
                    element = next(its[i])
                except StopIteration:
                    if self._stop:
                        return
                    active[i] = False
                    _close(its[i])
                    left -= 1
                    if not left:
                        return
                    continue
                yield element
        finally:
            _close(picks)
            for it in its:
                if it is not None:
                    _close(it)


    def _pick_iter(self, ctx, active: list[bool]) -> StateIterator:
        """A state iterator of the picks (as :meth:`_picks`)."""
        raise NotImplementedError

    def _state_iter(self, ctx):
        return _DirectedIterator(self, ctx)


class _DirectedIterator(StateIterator):
    """``sample_from_datasets`` / ``choose_from_datasets``: the state is the picks'
    (the sampler's generator state, or the choice dataset's position), which inputs
    have ended, and each input's position (None for an input not read yet)."""

    def __init__(self, node: _DirectedDataset, ctx):
        try:
            node.element_spec  # incompatible inputs are an error before any element
        except ValueError:
            pass  # an input too empty to have a spec conflicts with nothing
        self._node, self._ctx = node, ctx
        n = len(node._datasets)
        self._its: list = [None] * n
        self._active = [True] * n
        self._done = False
        self._picks = node._pick_iter(ctx, self._active)

    @property
    def _inputs(self):
        return [self._picks] + [it for it in self._its if it is not None]

    def __next__(self):
        node, its, active = self._node, self._its, self._active
        while not self._done:
            try:
                i = next(self._picks)
            except StopIteration:
                self._done = True
                break
            if not active[i]:
                continue
            if its[i] is None:
                its[i] = node._datasets[i]._state_iter(self._ctx)
            try:
                return next(its[i])
            except StopIteration:
                if node._stop:
                    self._done = True
                    break
                active[i] = False
                its[i].close()
                its[i] = None
                if not any(active):
                    self._done = True
        raise StopIteration

    def save(self):
        return {"picks": self._picks.save(), "active": list(self._active),
                "done": self._done,
                "inputs": [None if it is None else it.save() for it in self._its]}

    def restore(self, state):
        self._picks.restore(state["picks"])
        self._active[:] = [bool(a) for a in state["active"]]
        self._done = bool(state["done"])
        for i, saved in enumerate(state["inputs"]):
            if saved is not None:
                self._its[i] = self._node._datasets[i]._state_iter(self._ctx)
                self._its[i].restore(saved)


class ChooseDataset(_DirectedDataset):
    """``Dataset.choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset)``."""

    def __init__(self, datasets, choice_dataset: Dataset, stop_on_empty_dataset: bool = True):
        datasets = _check_datasets(datasets, "choose_from_datasets")
        if not isinstance(choice_dataset, Dataset):
            raise TypeError(f"choose_from_datasets: choice_dataset must be a Dataset of "
                            f"int64 scalars, got {type(choice_dataset).__name__}")
        spec = choice_dataset.element_spec
        if spec != TensorSpec((), _INT64):
            raise TypeError(f"choose_from_datasets: the elements of choice_dataset must be "
                            f"int64 scalars, but its element_spec is {spec} (convert them "
                            "with map(lambda i: np.int64(i)))")
        super().__init__(datasets, stop_on_empty_dataset)
        self._choice = choice_dataset

    def _inputs(self):
        return (self._choice, *self._datasets)

    def _selector_inputs(self):
        return (self._choice,)

    def _with_inputs(self, inputs):
        return ChooseDataset(list(inputs[1:]), inputs[0], self._stop)

    def _picks(self, ctx, active):
        n = len(self._datasets)
        it = self._choice._iter(ctx)
        try:
            for choice in it:
                i = int(choice)
                if not 0 <= i < n:
                    raise ValueError(f"choose_from_datasets: choice {i} is out of range "
                                     f"for {n} datasets; choices must be in [0, {n})")
                yield i
        finally:
            _close(it)


    def _pick_iter(self, ctx, active):
        n = len(self._datasets)

        def step_fn(it):
            i = int(next(it._inputs[0]))
            if not 0 <= i < n:
                raise ValueError(f"choose_from_datasets: choice {i} is out of range "
                                 f"for {n} datasets; choices must be in [0, {n})")
            return i
        return FunctionIterator((self._choice._state_iter(ctx),), step_fn)


class SampleDataset(_DirectedDataset):
    """``Dataset.sample_from_datasets`` with fixed weights or a dataset of weights."""

    _what = "sample_from_datasets"

    def __init__(self, datasets: list[Dataset], weights: Sequence[float] | Dataset,
                 seed: int | None, stop_on_empty_dataset: bool,
                 rerandomize_each_iteration: bool):
        super().__init__(datasets, stop_on_empty_dataset)
        self._weights = weights
        self._seeded = seed is not None
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        # As tf.data: without a seed every epoch draws anew; with one, only on request.
        self._rerandomize = bool(rerandomize_each_iteration) or seed is None
        self._epochs = itertools.count()

    def _inputs(self):
        extra = (self._weights,) if isinstance(self._weights, Dataset) else ()
        return (*extra, *self._datasets)

    def _selector_inputs(self):
        return (self._weights,) if isinstance(self._weights, Dataset) else ()

    def _with_inputs(self, inputs):
        if isinstance(self._weights, Dataset):
            weights, datasets = inputs[0], list(inputs[1:])
        else:
            weights, datasets = self._weights, list(inputs)
        new = SampleDataset(datasets, weights, self._seed, self._stop, self._rerandomize)
        new._seeded, new._rerandomize = self._seeded, self._rerandomize
        new._agreed = getattr(self, "_agreed", False)
        return new

    def _with_seed(self, seed: int) -> "SampleDataset":
        """The same sampling with another seed (one every worker agreed on)."""
        new = self._with_inputs(self._inputs())
        new._seed, new._seeded, new._agreed = int(seed), True, True
        return new

    def _picks(self, ctx, active):
        epoch = next(self._epochs) if self._rerandomize and not ctx.peek else 0
        rng = np.random.default_rng([self._seed, epoch])
        draws, k = rng.random(_DRAWS).tolist(), 0
        fixed = not isinstance(self._weights, Dataset)
        weights_it = iter(()) if fixed else self._weights._iter(ctx)
        n = len(self._datasets)
        try:
            while True:
                if fixed:
                    w = self._weights
                else:
                    row = next(weights_it, None)
                    if row is None:
                        return
                    w = _check_weights(np.asarray(row).tolist(), n, "a weights element")
                if k == _DRAWS:
                    draws, k = rng.random(_DRAWS).tolist(), 0
                i = self._draw(w, active, draws[k])
                if i is None:
                    return  # only inputs of weight 0 are left
                k += 1
                yield i
        finally:
            _close(weights_it)


    def _pick_iter(self, ctx, active):
        return _SamplePicks(self, ctx, active)

    def _draw(self, weights: list, active: list, u: float) -> int | None:
        """The input a uniform draw ``u`` picks (None: only inputs of weight 0 left)."""
        # Exhausted inputs drop out and the others' weights are renormalised: the same
        # distribution as drawing again after a pick of an ended input.
        live = [x if a else 0.0 for x, a in zip(weights, active)] if not self._stop \
            else weights
        cum = list(itertools.accumulate(live))
        total = cum[-1]
        if total <= 0:
            return None
        return min(bisect.bisect_right(cum, u * total), len(weights) - 1)


class _SamplePicks(StateIterator):
    """The picks of ``sample_from_datasets``, as ``SampleDataset._picks`` draws them;
    the state is the epoch and seed, the generator's state before the current block of
    draws and the draws used from it, and the weights dataset's position."""

    def __init__(self, node: SampleDataset, ctx, active: list):
        self._node, self._active = node, active
        self._epoch = next(node._epochs) if node._rerandomize else 0
        self._seed = node._seed
        self._rng = np.random.default_rng([self._seed, self._epoch])
        self._refill()
        fixed = not isinstance(node._weights, Dataset)
        self._inputs = () if fixed else (node._weights._state_iter(ctx),)

    def _refill(self) -> None:
        self._block_start = self._rng.bit_generator.state
        self._draws, self._k = self._rng.random(_DRAWS).tolist(), 0

    def __next__(self):
        node = self._node
        if self._inputs:
            w = _check_weights(np.asarray(next(self._inputs[0])).tolist(),
                               len(node._datasets), "a weights element")
        else:
            w = node._weights
        if self._k == _DRAWS:
            self._refill()
        i = node._draw(w, self._active, self._draws[self._k])
        if i is None:
            raise StopIteration  # only inputs of weight 0 are left
        self._k += 1
        return i

    def save(self):
        return {"epoch": self._epoch, "seed": self._seed, "rng": self._block_start,
                "k": self._k, "weights": self._inputs[0].save() if self._inputs else None}

    def restore(self, state):
        self._epoch, self._seed = int(state["epoch"]), int(state["seed"])
        if self._node._rerandomize:
            resume_epochs(self._node, self._epoch, self._seed)
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self._refill()
        self._k = int(state["k"])
        if self._inputs:
            self._inputs[0].restore(state["weights"])


def _check_weights(weights, n: int, what: str = "weights") -> list[float]:
    if len(weights) != n:
        raise ValueError(f"sample_from_datasets: {what} has {len(weights)} entries for "
                         f"{n} datasets; give one weight per dataset")
    out = []
    for w in weights:
        if isinstance(w, (bool, str, bytes)) or np.ndim(w) != 0:
            raise TypeError(f"sample_from_datasets: weights must be numbers, got {w!r} in "
                            f"{weights!r}")
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"sample_from_datasets: weights must be finite and "
                             f"non-negative, got {w!r} in {list(weights)!r}")
        out.append(w)
    return out


def sample_from_datasets(datasets, weights=None, seed: int | None = None,
                         stop_on_empty_dataset: bool = False,
                         rerandomize_each_iteration: bool | None = None) -> Dataset:
    """Elements drawn at random from ``datasets``, input ``i`` with probability
    proportional to ``weights[i]`` (uniform without weights).

    ``weights`` may also be a Dataset of weight vectors, one read per element drawn.
    As ``tf.data``: datasets of weight 0 are left out when the dataset is built (one
    left: that dataset itself; none: an empty dataset).

    Raises:
        ValueError: no datasets, a weight count that differs from the dataset count,
            or a negative or non-finite weight.
        TypeError: something that is not a Dataset, or incompatible element specs.
    """
    datasets = _check_datasets(datasets, "sample_from_datasets")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or seed < 0):
        raise ValueError(f"sample_from_datasets: seed must be a non-negative int or None, "
                         f"got {seed!r}")
    if not isinstance(weights, Dataset):
        if weights is None:
            weights = [1.0] * len(datasets)
        else:
            weights = _check_weights(list(np.asarray(weights).tolist())
                                     if isinstance(weights, np.ndarray) else list(weights),
                                     len(datasets))
        kept = [(d, w) for d, w in zip(datasets, weights) if w > 0]
        if not kept:
            return datasets[0].take(0)
        datasets, weights = [d for d, _ in kept], [w for _, w in kept]
        if len(datasets) == 1:
            return datasets[0]
    return SampleDataset(datasets, weights, None if seed is None else int(seed),
                         stop_on_empty_dataset, bool(rerandomize_each_iteration))


def choose_from_datasets(datasets, choice_dataset: Dataset,
                         stop_on_empty_dataset: bool = True) -> Dataset:
    """Element ``j`` comes from ``datasets[choice_dataset[j]]`` (int64 scalars).

    Raises:
        TypeError: ``choice_dataset`` is not a Dataset of int64 scalars.
        ValueError: (when iterating) a choice outside ``[0, len(datasets))``.
    """
    return ChooseDataset(datasets, choice_dataset, stop_on_empty_dataset)

