"""Rewriting a pipeline for the auto-shard policies: file-level sharding (FILE, and AUTO
on pipelines that read files), and the same order of elements on every worker (DATA).

Words:
    file source: a node of the pipeline with a static list of files (``list_files``,
        ``TextLineDataset``/``TFRecordDataset`` over a list of names, ``NpyDataset`` and
        its fused batches). A dataset of file names given to ``TextLineDataset`` is not
        one itself: its own source is (typically ``list_files``), so
        ``list_files(...).interleave(TextLineDataset, ...)`` shards at the file list, as
        TensorFlow does.
    file sharding: rebuilding the pipeline with every file source reading only its files
        ``i`` with ``i % num_shards == index``, in their order; every transformation
        above is rebuilt over the new sources (``Dataset._with_inputs``), options
        included. ``list_files`` is sharded on its sorted list, before its per-epoch
        shuffle, so the workers' file sets are disjoint whatever the seed.
    unseeded shuffle: a ``shuffle`` or ``list_files`` (shuffling) node built without a
        seed, which draws a random one of its own.
    same order everywhere: under DATA every worker must read the same elements in the
        same order (each keeps its own pieces of the same global batches), so
        :func:`same_order_everywhere` gives every unseeded shuffle worker 0's seed for
        it (one ``allgather`` when the dataset is distributed) and makes a parallel
        ``map`` with ``deterministic=False`` keep its input order. Shuffles built while
        the pipeline runs, in the datasets an ``interleave``/``flat_map`` function
        returns, are seeded from the interleave's own agreed seed, its epoch and the
        element's index (:func:`seeded_like_every_worker`): the same on every worker,
        with no collective.
"""

from __future__ import annotations

import logging

import numpy as np

from gpustrat.data.dataset import Dataset
from gpustrat.data.iterator_state import walk

log = logging.getLogger("gpustrat")


def file_sources(dataset: Dataset) -> list[Dataset]:
    """The file sources of the pipeline (each once), output end first."""
    return [n for n in walk(dataset) if n._files is not None]


def reads_files(dataset: Dataset) -> bool:
    """Whether the pipeline has a file source, so that FILE sharding applies to it."""
    return any(n._files is not None for n in walk(dataset))


def unshardable_sources(dataset: Dataset) -> list[Dataset]:
    """The sources that FILE sharding would leave whole on every worker: sources that
    read no files in a pipeline that does (``Dataset.zip((lines, Dataset.range(n)))``,
    ``sample_from_datasets([lines, Dataset.from_tensor_slices(x)])``), whose data every
    worker would then read in full. A node's selector inputs (the choices of
    ``choose_from_datasets``, the weights of ``sample_from_datasets``) are not data and
    are not counted. TensorFlow calls these unshardable sources: FILE fails on them and
    AUTO falls back to DATA."""
    out, seen, stack = [], set(), [dataset]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        inputs = node._inputs()
        if not inputs and node._files is None:
            out.append(node)
        selectors = getattr(node, "_selector_inputs", tuple)()
        stack.extend(i for i in inputs if not any(i is s for s in selectors))
    return out


def shard_files(dataset: Dataset, num_shards: int, index: int) -> Dataset:
    """The same pipeline with each file source reading only files ``index::num_shards``.

    Raises:
        ValueError: ``num_shards`` <= 0, ``index`` out of ``[0, num_shards)``, the
            pipeline reads no files, or a file source has fewer files than
            ``num_shards`` (some worker would get none); the message names the counts.
    """
    if isinstance(num_shards, bool) or int(num_shards) <= 0:
        raise ValueError(f"shard_files: num_shards must be positive, got {num_shards}")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard_files: index {index} is out of range for {num_shards} "
                         f"shards; it must be in [0, {num_shards})")
    if not reads_files(dataset):
        raise ValueError("shard_files: the dataset reads no files, so it cannot be sharded "
                         "by file: use AutoShardPolicy.DATA or OFF")

    def with_my_files(_, node: Dataset) -> Dataset | None:
        if node._files is None:
            return None
        files = node._files
        if len(files) < num_shards:
            raise ValueError(
                f"dataset reads {len(files)} file(s) but is sharded over {num_shards} "
                f"workers, so some workers would get no file: use more files, or "
                f"AutoShardPolicy.DATA or OFF (files: {files})")
        return node._with_files(files[index::num_shards])

    return _rebuild(dataset, with_my_files)


def _rebuild(dataset: Dataset, replace, same_specs: bool = False) -> Dataset:
    """The pipeline with every node rebuilt over its rebuilt inputs
    (``Dataset._with_inputs``, options included), then replaced by
    ``replace(node, rebuilt)`` where that is not None; untouched parts are shared.
    ``same_specs``: the rewrite changes no element spec, so the specs already worked
    out (which may have run user code) carry over to the rebuilt nodes."""
    memo: dict[int, Dataset] = {}

    def rebuild(node: Dataset) -> Dataset:
        done = memo.get(id(node))
        if done is not None:
            return done
        inputs = node._inputs()
        new_inputs = tuple(rebuild(i) for i in inputs)
        new = node if all(a is b for a, b in zip(inputs, new_inputs)) else \
            node._with_inputs(new_inputs)
        replaced = replace(node, new)
        if replaced is not None:
            new = replaced
        known = node.__dict__.get("_spec_cache")
        if same_specs and new is not node and known is not None:
            new.__dict__["_spec_cache"] = known
        memo[id(node)] = new
        return new

    return rebuild(dataset)


def unseeded_shuffles(dataset: Dataset) -> list[Dataset]:
    """The pipeline's nodes that need a seed agreed by every worker, in a fixed walk
    order: shuffles built without a seed, and every ``interleave``/``flat_map`` (the
    datasets its function returns may shuffle without one)."""
    return [n for n in walk(dataset) if hasattr(n, "_with_seed") and not n._seeded]


def _in_agreed_order(dataset: Dataset, seeds: list[int]) -> tuple[Dataset, int]:
    """The pipeline with node ``j`` of :func:`unseeded_shuffles` given ``seeds[j]`` and
    every parallel ``map`` with ``deterministic=False`` keeping its order; also the
    number of such maps. No collective: the shuffle seeds are already agreed."""
    agreed = {id(n): int(seed) for n, seed in zip(unseeded_shuffles(dataset), seeds)}
    unordered = []

    def replace(old: Dataset, new: Dataset) -> Dataset | None:
        if id(old) in agreed:
            return new._with_seed(agreed[id(old)])
        in_order = new._in_order() if hasattr(new, "_in_order") else None
        if in_order is not None:
            unordered.append(old)
        return in_order

    return _rebuild(dataset, replace, same_specs=True), len(unordered)


def seeded_like_every_worker(dataset: Dataset, key: tuple) -> Dataset:
    """``dataset`` (one that an ``interleave``/``flat_map`` function returned while the
    pipeline runs) with the shuffle seeds of its unseeded shuffles drawn from ``key`` (the
    interleave's agreed seed, its epoch and the element's index), so that every worker
    derives the same ones without a collective; parallel maps keep their order."""
    count = len(unseeded_shuffles(dataset))
    if count == 0 and not any(n._in_order() is not None for n in walk(dataset)
                              if hasattr(n, "_in_order")):
        return dataset
    seeds = np.random.default_rng(list(key)).integers(0, 2 ** 63, size=count).tolist()
    return _in_agreed_order(dataset, seeds)[0]


def same_order_everywhere(dataset: Dataset, workers) -> Dataset:
    """The pipeline rewritten so that every worker reads the same elements in the same
    order, as DATA needs: every unseeded shuffle gets worker 0's seed for it (one
    ``allgather``, which every worker must call), each ``interleave``/``flat_map`` gets
    an agreed seed from which the shuffles of the datasets its function returns are
    seeded (:func:`seeded_like_every_worker`), and a parallel ``map`` with
    ``deterministic=False`` keeps its input order (logged once).

    Raises:
        ValueError: on every worker, when the workers' pipelines have different numbers
            of such nodes (the pipelines differ between workers).
    """
    nodes = unseeded_shuffles(dataset)
    shared = workers.allgather([n._seed for n in nodes])
    counts = [len(seeds) for seeds in shared]
    if len(set(counts)) > 1:
        named = ", ".join(f"worker {w}: {c}" for w, c in enumerate(counts))
        raise ValueError(
            f"under AutoShardPolicy.DATA every worker must build the same pipeline, but the "
            f"workers' pipelines have different numbers of unseeded shuffles ({named}), "
            "counting each interleave/flat_map as one: build the same pipeline on every "
            "worker, or give each shuffle a seed")
    out, unordered = _in_agreed_order(dataset, shared[0])
    if unordered and workers.rank == 0:
        log.info("under AutoShardPolicy.DATA every worker must read the same order: "
                 "%d parallel map(s) with deterministic=False keep their input order",
                 unordered)
    return out
