"""Random programs over variables, optimizers, metrics and loss helpers, run with real
TensorFlow (``MirroredStrategy`` on logical CPUs) or with gpustrat, and compared.

Not a test and not imported by the tests (pytest collects ``test_*.py`` only); the
regression tests hard-code what this script found. A program is a seeded list of
operations (``tf_programs.make_program``; ``tf_program_runner`` runs it): variables made with every synchronization,
aggregation and dtype; ``assign``/``assign_add``/``assign_sub`` in replica context (each
replica with its own value) and in cross-replica context; reads in both contexts;
``merge_call``; ``strategy.extended.update``/``reduce_to``/``batch_reduce_to``;
``strategy.reduce``/``gather`` of values and variables; variables made inside ``run``;
reads and updates outside any scope; metrics' ``update_state`` (rows, column weights,
in both contexts)/``result``/``reset_state``; SGD (momentum, Nesterov, a schedule), Adam
(AMSGrad) and AdamW steps with per-replica gradients; ``compute_average_loss`` with and
without ``global_batch_size`` and sample weights, over pieces of unequal size (partial
batches, empty pieces). Each operation's outcome is recorded as values, dtypes and
shapes (per replica where the result is per replica), or the type of the exception
raised (messages are not compared: gpustrat words its own; TensorFlow's
InvalidArgumentError counts as ValueError).

With a venv that has ``tensorflow-cpu==2.21.*`` (Keras 3)::

    /path/to/tf-venv/bin/python tests/variables/record_tf_programs.py tf \\
        --seeds 0:200 --replicas 1,2,3,4 > /tmp/tf_programs.json
    python tests/variables/record_tf_programs.py gs --seeds 0:200 --replicas 1,2,3,4 \\
        --compare /tmp/tf_programs.json

and across MPI workers (``--local`` replicas on each of the ``-n`` ranks; rank 0 prints
the differences), against a one-process recording of the same total replicas, by
TensorFlow or by gpustrat::

    python tests/variables/record_tf_programs.py gs --seeds 0:200 --replicas 4 \\
        > /tmp/gs4.json
    mpiexec -n 2 python tests/variables/record_tf_programs.py gs-mpi --local 2 \\
        --seeds 0:200 --compare /tmp/gs4.json

Not reported (see :func:`expected_difference`): the differences docs/variables.md
documents (a mirrored variable with aggregation NONE updated in replica context is a
ValueError here; ``compute_average_loss`` without ``global_batch_size`` divides by the
true number of examples; NumPy floats into an integer variable are a TypeError in every
context, NumPy integers into a float variable convert in every context), TensorFlow's
own quirks (it keeps the integer dtype of a MEAN that reduces nothing, refuses to batch
int32 tensors with others, divides a Python list before converting it, writes a
sync-on-read variable with aggregation NONE before raising), and a replica's own
``result()`` of a metric updated in cross-replica context after replica-context updates
(the totals are compared).
Where the libraries differ on purpose the program resets the variable right after
(``resync``), so that both go on from the same state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from tf_program_runner import Runner, record
from tf_programs import make_program, np_dtype, rows

# --- comparing ------------------------------------------------------------------------------

#: Keras computes Adam's bias correction ``sqrt(1 - beta_2 ** t)`` in float32, also for
#: float64 variables (it casts the betas from float32): relative errors of 1e-5 to 1e-4
#: in a step, which a few steps with a learning rate of 0.5 carry to 1e-4. The values a
#: program writes are multiples of 1/4, so any real difference is far larger.
TOLERANCE = {"float16": (2e-3, 2e-3), "float32": (1e-4, 1e-4), "float64": (1e-4, 1e-4)}


def same_leaf(a: dict, b: dict) -> bool:
    if a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
        return False
    x, y = np.asarray(a["v"]), np.asarray(b["v"])
    rtol, atol = TOLERANCE.get(a["dtype"], (0, 0))
    return np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True) if x.size else True


#: TensorFlow's op errors and the Python exception gpustrat raises for the same misuse.
SAME_ERRORS = {"InvalidArgumentError": "ValueError"}


def same(a, b) -> bool:
    if isinstance(a, dict) and "dtype" in a and isinstance(b, dict) and "dtype" in b:
        return same_leaf(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        if "err" in a and "err" in b:
            return SAME_ERRORS.get(a["err"], a["err"]) == b["err"]
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) == 1 and len(b) > 1 and all(isinstance(x, dict) and "dtype" in x
                                              for x in a + b):
            # TensorFlow's run hands back one value when every replica returned the
            # very same object (a merge_call's result); gpustrat one per replica.
            return all(same_leaf(a[0], x) for x in b)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def expected_difference(op: dict, want: dict, got: dict, n: int, seed: int,
                        tf_side: bool) -> bool:
    """Whether ``got`` differs from ``want`` only as documented, or by a quirk of
    TensorFlow's (``tf_side``: ``want`` is TensorFlow's)."""
    if op["kind"] == "metric_result" and op["split"]:
        return "per" in got and "per" in want
    if not tf_side:
        return False
    if op["kind"] == "replica_update" and op["sync"] in ("AUTO", "ON_WRITE") and \
            op["agg"] == "NONE" and "err" not in want:
        return got.get("err") == "ValueError"
    if op["kind"] in ("replica_update", "cross_update") and op["value"] == "other_dtype":
        # NumPy floats into an integer variable: TensorFlow truncates them (or, in
        # replica context of an aggregated mirrored variable, raises ValueError), here
        # a TypeError. NumPy integers into a float variable: TensorFlow raises
        # ValueError in replica context of an aggregated mirrored variable, here they
        # convert, as TensorFlow converts them everywhere else.
        if "int" in op["dtype"]:
            return got.get("err") == "TypeError"
        return "err" not in got and want.get("err") == "ValueError"
    if op["kind"] in ("reduce", "reduce_to", "batch_reduce_to", "reduce_var") and \
            n == 1 and op["op"] == "MEAN" and "int" in op["dtype"]:
        # One replica: TensorFlow reduces nothing and keeps the integer dtype; a MEAN
        # of integers is float64 here, as TensorFlow's is on two replicas or more.
        return True
    if op["kind"] == "reduce_var" and op["op"] == "MEAN" and "int" in op["dtype"] and \
            op["sync"] in ("AUTO", "ON_WRITE"):
        # TensorFlow hands back a mirrored value's MEAN as it is (integers stay
        # integers); a MEAN of integers is float64 here, as TensorFlow's of per-replica
        # integers on two replicas or more.
        return True
    if op["kind"] == "reduce_var" and op["how"] == "gather" and n == 1 and \
            got.get("err") == "ValueError":
        # One replica: TensorFlow gathers nothing and hands back even a scalar; here a
        # scalar cannot be gathered along axis 0, on any number of replicas.
        return True
    if op["kind"] == "cross_update" and op["value"] == "py" and op["sync"] == "ON_READ" \
            and op["agg"] == "SUM" and want.get("err") == "TypeError":
        # TensorFlow divides the value by the number of replicas before converting it:
        # a Python list is a TypeError there.
        return "err" not in got
    if op["kind"] == "batch_reduce_to" and op["dtype"] == "int32" and \
            len(op["shapes"]) > 1 and want.get("err") == "ValueError":
        # TensorFlow keeps int32 tensors in host memory and refuses to batch them
        # with others ("all on the host or all on the compute devices").
        return True
    if op["kind"] == "loss" and op["gbs"] is None and op["where"] == "replica" and \
            "per" in got:
        # The true global count: sum(loss * weight) / (rows of every replica).
        counts = [rows((seed, "loss", op["step"]), r, op["rows"]) for r in range(n)]
        total = sum(counts)
        fake = Runner.__new__(Runner)
        fake.seed = seed
        for r, g in enumerate(got["per"]):
            loss, w = fake.loss_args(op, r)
            if w is not None:
                if w.ndim == loss.ndim + 1:   # (n, 1) weights of (n,) losses
                    w = w[..., 0]
                loss = loss * w.reshape(w.shape + (1,) * (loss.ndim - w.ndim))
            s = loss.sum()
            wish = {"v": (s / total if total else 0.0), "dtype": op["dtype"], "shape": []}
            if not same_leaf(dict(wish, v=float(np.asarray(wish["v"], op["dtype"]))), g):
                return False
        return True
    return False


def split_metric_results(program: list) -> set:
    """The replica-context ``result()`` calls of metrics updated in cross-replica context
    after a replica-context update, since their last reset: Keras then spreads the new
    total evenly over the replicas, gpustrat spreads the value and keeps what each
    replica had (the totals agree; before the replicas' states differ both give each
    replica the same)."""
    dirty, own, out = set(), set(), set()
    for i, op in enumerate(program):
        if op["kind"] == "metric_update" and op["where"] == "cross":
            if op["metric"] in own:
                dirty.add(op["metric"])
        elif op["kind"] == "metric_update":
            own.add(op["metric"])
        elif op["kind"] == "metric_reset":
            dirty.discard(op["metric"])
            own.discard(op["metric"])
        elif op["kind"] == "metric_result" and op["where"] == "replica" and \
                op["metric"] in dirty:
            out.add(i)
    return out


def compare(want: dict, got: dict, tf_side: bool) -> list:
    """The differences between two recordings of the same programs."""
    bad = []
    for key, records in got.items():
        if key not in want:
            continue
        seed, n = map(int, key.split("/"))
        program = make_program(seed)
        specs = {op["var"]: op for op in program
                 if op["kind"] in ("create", "create_in_run")}
        split = split_metric_results(program)
        for w, g in zip(want[key], records):
            op = dict(program[g["i"]])
            if "var" in op and op["kind"] not in ("create", "create_in_run"):
                op.update(sync=specs[op["var"]]["sync"], agg=specs[op["var"]]["agg"],
                          dtype=op.get("dtype", np_dtype(specs[op["var"]]["dtype"])))
            op["split"] = g["i"] in split
            if same(w, g) or expected_difference(op, w, g, n, seed, tf_side):
                continue
            bad.append({"case": key, "op": program[g["i"]], "want": w, "got": g})
    return bad


# --- across MPI workers ----------------------------------------------------------------------

def gather_ranks(local_records: dict) -> dict | None:
    """Rank 0: the records with every rank's per-replica lists joined in rank order (and
    a check that every rank saw the same single values and errors); None elsewhere."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    everything = comm.gather(local_records, root=0)
    if comm.rank != 0:
        return None
    joined = {}
    for key in everything[0]:
        joined[key] = [join([ranks[key][i] for ranks in everything])
                       for i in range(len(everything[0][key]))]
    return joined


def join(items: list):
    """One record from every rank's: per-replica lists concatenated in rank order,
    anything else kept when every rank has the same (else marked as differing)."""
    first = items[0]
    if isinstance(first, dict) and "per" in first and all(isinstance(i, dict) and "per" in i
                                                          for i in items):
        return {**first, "per": [x for i in items for x in i["per"]]}
    if isinstance(first, dict) and "dtype" in first:
        return first if all(same(first, i) for i in items) else {"ranks differ": items}
    if isinstance(first, dict) and all(isinstance(i, dict) and i.keys() == first.keys()
                                       for i in items):
        return {k: (join([i[k] for i in items]) if k in ("ret", "comps", "vars", "list")
                    else join_same([i[k] for i in items])) for k in first}
    if isinstance(first, list) and all(isinstance(i, list) for i in items):
        # Lists of per-replica leaves ("ret", "comps") join; nested lists join per item.
        if first and isinstance(first[0], dict) and "dtype" in first[0]:
            return [x for i in items for x in i]
        if all(len(i) == len(first) for i in items):
            return [join([i[k] for i in items]) for k in range(len(first))]
    return join_same(items)


def join_same(items: list):
    first = items[0]
    return first if all(same(first, i) for i in items) else {"ranks differ": items}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", choices=("tf", "gs", "gs-mpi"))
    p.add_argument("--seeds", default="0:50", help="A:B, the seeds A .. B-1")
    p.add_argument("--replicas", default="1,2,3,4", help="numbers of replicas in sync")
    p.add_argument("--local", type=int, default=1, help="gs-mpi: replicas per rank")
    p.add_argument("--compare", help="a recording to compare with")
    p.add_argument("--out", help="write the recording here (default: stdout)")
    args = p.parse_args(argv)
    a, b = map(int, args.seeds.split(":"))
    seeds = range(a, b)
    if args.which == "tf" and "," not in args.replicas:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
        tf.get_logger().setLevel("ERROR")
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] *
            max(4, *(int(n) for n in args.replicas.split(","))))
    if args.which == "gs-mpi":
        from mpi4py import MPI
        size = MPI.COMM_WORLD.size
        got = gather_ranks(record("gs-mpi", seeds, [size * args.local], args.local))
        if got is None:
            return 0
    elif args.which == "tf" and "," in args.replicas:
        # One process per replica count: TensorFlow's collectives keep group keys per
        # process, and strategies of two sizes in one process clash.
        import subprocess
        got = {}
        for n in args.replicas.split(","):
            text = subprocess.run([sys.executable, __file__, "tf", "--seeds", args.seeds,
                                   "--replicas", n], check=True, capture_output=True,
                                  text=True).stdout
            got.update({k: v for k, v in json.loads(text).items() if k != "_library"})
    else:
        got = record(args.which, seeds, [int(n) for n in args.replicas.split(",")])
    if args.compare:
        want = json.loads(Path(args.compare).read_text())
        tf_side = want.get("_library") == "tf"
        bad = compare(want, got, tf_side)
        for d in bad:
            print(json.dumps(d))
        print(f"{len(bad)} differences in {len(got)} programs", file=sys.stderr)
        if args.out:
            Path(args.out).write_text(json.dumps({"_library": args.which, **got}))
        return 1 if bad else 0
    text = json.dumps({"_library": args.which, **got})
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
