"""File-level sharding of a pipeline, for the FILE (and AUTO) auto-shard policies.

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
"""

from __future__ import annotations

from gpustrat.data.dataset import Dataset


def _walk(dataset: Dataset):
    seen: set[int] = set()
    stack = [dataset]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(node._inputs())


def file_sources(dataset: Dataset) -> list[Dataset]:
    """The file sources of the pipeline (each once), output end first."""
    return [n for n in _walk(dataset) if n._files is not None]


def reads_files(dataset: Dataset) -> bool:
    """Whether the pipeline has a file source, so that FILE sharding applies to it."""
    return any(n._files is not None for n in _walk(dataset))


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
    memo: dict[int, Dataset] = {}

    def rebuild(node: Dataset) -> Dataset:
        done = memo.get(id(node))
        if done is not None:
            return done
        if node._files is not None:
            files = node._files
            if len(files) < num_shards:
                raise ValueError(
                    f"dataset reads {len(files)} file(s) but is sharded over {num_shards} "
                    f"workers, so some workers would get no file: use more files, or "
                    f"AutoShardPolicy.DATA or OFF (files: {files})")
            new = node._with_files(files[index::num_shards])
        else:
            inputs = node._inputs()
            new_inputs = tuple(rebuild(i) for i in inputs)
            if all(a is b for a, b in zip(inputs, new_inputs)):
                new = node
            else:
                new = node._with_inputs(new_inputs)
        memo[id(node)] = new
        return new

    return rebuild(dataset)
