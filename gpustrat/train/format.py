"""The checkpoint file format: state trees as JSON plus ``.npz`` arrays, written atomically.

Words:
    state tree: what an object's ``_checkpoint_state()`` returns: nested dicts, lists,
        tuples, None, bools, ints, floats, strings, bytes, NumPy arrays and scalars, and
        ``gs.Variable`` objects (their values are read when the checkpoint is written,
        without a copy where possible; restoring gives arrays back).
    encoded tree: the JSON form of a state tree. Arrays are replaced by
        ``{"__array__": key}`` (``{"__scalar__": key}`` for a NumPy scalar) naming an
        entry of the accompanying ``.npz`` file; tuples become ``{"__tuple__": [...]}``,
        dicts ``{"__dict__": [[key, value], ...]}`` (keys may be ints or tuples),
        bytes ``{"__bytes__": base64}``. Lists, strings, numbers, bools and None are
        themselves.

A checkpoint at path ``P`` is the files ``P.index`` (JSON: format, topology, the shared
objects' encoded trees, and each of their arrays' byte offset in ``P.data``),
``P.data`` (those arrays, one ``.npy`` record after the other: ``numpy.load`` at the
offset reads one) and one ``P.worker-K-of-W.npz``
per worker (its arrays plus, under the key ``__tree__``, its encoded trees as UTF-8
JSON). ``P.index`` is renamed into place last: a path is a checkpoint exactly when its
index exists.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import zlib
from typing import Any, Callable

import numpy as np

FORMAT = "gpustrat-checkpoint"
VERSION = 1
TREE_KEY = "__tree__"


def encode(tree: Any, arrays: dict, prefix: str, leaf: Callable[[Any], bool] | None = None
           ) -> Any:
    """The JSON form of ``tree``; its arrays go into ``arrays`` under keys from ``prefix``.

    ``leaf(value)`` True marks a value of another type as an array to be (a variable,
    read when the arrays are written): it goes into ``arrays`` as it is.
    """
    if tree is None or isinstance(tree, (bool, str)):
        return tree
    if isinstance(tree, (int, float)) and not isinstance(tree, np.generic):
        return tree
    if isinstance(tree, np.ndarray) or isinstance(tree, np.generic):
        arr = np.asarray(tree)
        if arr.dtype.hasobject:
            raise TypeError(f"checkpoint: {prefix!r} is an array of Python objects "
                            f"(dtype {arr.dtype}), which .npz cannot store without pickle; "
                            "use numeric, bool, bytes or unicode arrays")
        key = f"{prefix}#{len(arrays)}"
        arrays[key] = arr
        return {"__scalar__" if isinstance(tree, np.generic) else "__array__": key}
    if leaf is not None and leaf(tree):
        key = f"{prefix}#{len(arrays)}"
        arrays[key] = tree
        return {"__array__": key}
    if isinstance(tree, bytes):
        return {"__bytes__": base64.b64encode(tree).decode("ascii")}
    if isinstance(tree, tuple):
        return {"__tuple__": [encode(x, arrays, prefix, leaf) for x in tree]}
    if isinstance(tree, list):
        return [encode(x, arrays, prefix, leaf) for x in tree]
    if isinstance(tree, dict):
        return {"__dict__": [[encode(k, arrays, prefix, leaf),
                              encode(v, arrays, prefix, leaf)] for k, v in tree.items()]}
    raise TypeError(f"checkpoint: cannot save a {type(tree).__name__} ({tree!r:.80}) "
                    f"under {prefix!r}: state holds numbers, strings, bytes, NumPy arrays "
                    "and lists, tuples and dicts of them")


def decode(tree: Any, arrays) -> Any:
    """The state tree of an encoded tree whose arrays are in ``arrays`` (a mapping)."""
    if isinstance(tree, list):
        return [decode(x, arrays) for x in tree]
    if isinstance(tree, dict):
        if "__array__" in tree:
            return np.array(arrays[tree["__array__"]])
        if "__scalar__" in tree:
            return np.asarray(arrays[tree["__scalar__"]])[()]
        if "__tuple__" in tree:
            return tuple(decode(x, arrays) for x in tree["__tuple__"])
        if "__bytes__" in tree:
            return base64.b64decode(tree["__bytes__"])
        return {_hashable(decode(k, arrays)): decode(v, arrays) for k, v in tree["__dict__"]}
    return tree


def _hashable(key):
    return key.item() if isinstance(key, np.generic) else key


# --- files ----------------------------------------------------------------------------

#: The file of a checkpoint directory that names its latest checkpoint (TensorFlow's
#: name), read by ``latest_checkpoint``.
STATE_FILE = "checkpoint"


def write_state(directory: str, state: dict) -> None:
    """Replace ``directory``'s state file with ``state`` (atomically, durably)."""
    path = os.path.join(directory, STATE_FILE)
    tmp = temp_name(path, secrets.token_hex(6))
    write_json(tmp, state)
    replace(tmp, path)
    fsync_dir(directory)


def temp_name(final: str, token: str) -> str:
    """The temporary name a file is written under before it is renamed to ``final``."""
    return f"{final}.tmp-{token}"


def fsync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (where the file system allows it)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_npz(path: str, arrays: dict, tree: Any = None) -> None:
    """Write ``arrays`` (and ``tree`` as JSON under :data:`TREE_KEY`) to ``path``,
    uncompressed, and flush it to disk."""
    out = dict(arrays)
    if tree is not None:
        out[TREE_KEY] = np.frombuffer(json.dumps(tree).encode("utf-8"), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **out)
        f.flush()
        os.fsync(f.fileno())


def write_arrays(path: str, arrays: dict) -> tuple[dict, dict]:
    """Write ``arrays`` one after the other as ``.npy`` records (``numpy.save`` each) to
    ``path``, flush it to disk, and return ``({key: byte offset of its record},
    {key: CRC-32 of its bytes})``."""
    offsets, crcs = {}, {}
    with open(path, "wb") as f:
        for key, a in arrays.items():
            offsets[key] = f.tell()
            crcs[key] = _crc(a)
            np.save(f, a, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return offsets, crcs


def read_arrays(path: str, offsets: dict, crcs: dict | None = None) -> dict:
    """The arrays of a file :func:`write_arrays` wrote (``numpy.load`` at each offset),
    each checked against its CRC-32 in ``crcs`` where given.

    Raises:
        ValueError: an array's bytes are not those written (the file was damaged).
    """
    out = {}
    with open(path, "rb") as f:
        for key, offset in offsets.items():
            f.seek(offset)
            out[key] = a = np.load(f, allow_pickle=False)
            if crcs is not None and _crc(a) != crcs.get(key):
                raise ValueError(
                    f"{path!r} is damaged: the bytes of {key!r} do not match the "
                    f"checksum written with them (CRC-32 {_crc(a):#010x}, saved "
                    f"{crcs.get(key, 0):#010x}); restore an earlier checkpoint")
    return out


def _crc(a: np.ndarray) -> int:
    """CRC-32 of an array's bytes in C order (zlib's, in C)."""
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) if a.size else 0


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_npz(path: str) -> tuple[dict, Any]:
    """``(arrays, tree)`` of a file written by :func:`write_npz` (tree None if absent)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    raw = arrays.pop(TREE_KEY, None)
    tree = None if raw is None else json.loads(raw.tobytes().decode("utf-8"))
    return arrays, tree


def replace(src: str, dst: str) -> None:
    """Rename ``src`` over ``dst`` atomically."""
    os.replace(src, dst)


def worker_file(prefix: str, rank: int, size: int) -> str:
    return f"{prefix}.worker-{rank}-of-{size}.npz"


def data_file(prefix: str) -> str:
    return f"{prefix}.data"


def index_file(prefix: str) -> str:
    return f"{prefix}.index"
