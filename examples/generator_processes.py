"""Parallel Python processing behind ``from_generator``: an index generator plus a
per-index Python function, mapped on worker processes.

A generator that reads records and also decodes them runs one record at a time. The
usual cure, from tf.data, keeps only the indexing in the generator and moves the
processing into ``map(..., num_parallel_calls=AUTOTUNE)``. With TensorFlow the function
is wrapped in ``tf.py_function`` and holds the GIL, so the calls do not overlap. Here
the same pipeline, with ``use_processes=True``, runs the calls in one worker process
per core; the generator stays in this process and the decoded arrays come back
through shared memory.

    python examples/generator_processes.py                    # 800 records, both ways
    python examples/generator_processes.py --records 2000 --batch 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import gpustrat as gs

SIDE, CHANNELS, CLASSES = 64, 3, 10
#: A gamma correction applied while decoding (a lookup per pixel).
_GAMMA = bytes(int(255 * (v / 255) ** 0.8) for v in range(256))


def make_training_set(n: int, seed: int = 0) -> list[bytes]:
    """Records as a decoder would see them: a class byte, then pixel bytes written as
    run-length pairs (count, value)."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        label = int(rng.integers(CLASSES))
        pixels = SIDE * SIDE * CHANNELS
        runs = bytearray([label])
        while pixels:
            count = min(pixels, int(rng.integers(1, 8)))
            runs += bytes([count, int(rng.integers(256))])
            pixels -= count
        records.append(bytes(runs))
    return records


def your_processing_function(record: bytes):
    """Decode one record in pure Python (the kind of work that holds the GIL)."""
    label = record[0]
    out = bytearray()
    for k in range(1, len(record), 2):
        value = _GAMMA[record[k + 1]]
        for _ in range(record[k]):
            out.append(value)
    x = np.frombuffer(bytes(out), np.uint8).reshape(SIDE, SIDE, CHANNELS)
    y = np.zeros(CLASSES, np.float32)
    y[label] = 1.0
    return x, y


def pipeline(training_set: list[bytes], batch: int, use_processes: bool):
    def func(i):
        return your_processing_function(training_set[int(i)])

    z = list(range(len(training_set)))              # the index generator
    dataset = gs.data.Dataset.from_generator(
        lambda: z, output_signature=gs.data.TensorSpec((), np.int64))
    dataset = dataset.map(func, num_parallel_calls=gs.data.AUTOTUNE,
                          use_processes=use_processes)
    return dataset.batch(batch)


def main(records: int = 800, batch: int = 8, compare: bool = True):
    """Run the pipeline on processes (and, with ``compare``, on threads); return the
    batches of the process run and the seconds each run took."""
    training_set = make_training_set(records)
    times = {}
    results = {}
    for mode in (["threads", "processes"] if compare else ["processes"]):
        t0 = time.perf_counter()
        results[mode] = [(x, y) for x, y in pipeline(training_set, batch,
                                                     mode == "processes")]
        times[mode] = time.perf_counter() - t0
        x, y = results[mode][0]
        print(f"{mode:9s}: {len(results[mode])} batches, x {x.shape} {x.dtype}, "
              f"y {y.shape} {y.dtype}, {records / times[mode]:.0f} records/s")
    if compare:
        same = all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                   for a, b in zip(results["threads"], results["processes"]))
        print(f"same batches: {same}; processes/threads speed: "
              f"{times['threads'] / times['processes']:.2f}x on "
              f"{gs.data.processes.process_count()} cores")
    return results["processes"], times


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=800)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-compare", action="store_true",
                        help="run on processes only")
    args = parser.parse_args()
    main(args.records, args.batch, not args.no_compare)
