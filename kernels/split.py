"""Split a device-resident global batch into per-replica pieces, into one buffer.

The splitting rule of distributed input: a batch of ``n`` rows on ``N``
replicas is cut in order into pieces of ``chunk = ceil(n / N)`` rows; the last
non-empty piece may be shorter, and replicas past the end of the data get zero rows
(same trailing shape and dtype). :func:`split_sizes` is that rule, written once.

Words:
- *row*: ``batch[k]``, of any dtype and trailing shape. The kernel moves rows as
  unsigned *words* (8, 4, 2 or 1 bytes, the widest dividing the row size and the
  batch's address), so one compiled kernel per word size serves every dtype.
- *gather*: with ``index``, output row ``g`` is ``batch[index[g]]`` and
  ``n = len(index)``: a shuffle (or any row selection) done on the device, fused with
  the split.
- *fixed-shape mode*: with ``pad_to=P`` every piece has exactly ``P`` rows, the rows
  past its valid count zero-filled, and the valid-row counts are returned: kernels and
  CUDA graphs downstream then never see a new shape, even on the last partial batch.

Algorithm: the output is one contiguous buffer of shape ``(N, P, words)`` (``P`` is
``pad_to`` or ``chunk``). A gather is one launch of ``_gather_split_rows``, whose
grid has one layer per piece; in a layer, threads along
x take consecutive words of a row (coalesced reads and writes) and threads along y
take rows, four per pass (loads before stores). Row ``r`` of piece ``p`` is row ``index[g]`` of the batch, ``g = p * chunk + r``,
copied when ``r < chunk`` and ``g < n`` and zero-filled otherwise. Each piece is then a view of the buffer (``out[p, :count]``, contiguous),
so moving it to its replica's device is a single copy.

Without ``index`` each piece's rows are one range of the batch, so the split is
device-to-device copies and memsets (adjacent ranges merged: one copy and at most one
memset without padding), which move the bytes at 93-95% of one copy; no kernel does
better. A contiguous batch with neither option needs nothing at all (its pieces are
views along axis 0, see :func:`scatter`). A gather kernel beats CuPy's ``batch[index]``
(1.6-1.8x on an H100 and an H200) and then costs one launch.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import numpy as np

from gpustrat import devices as _devices

from . import _launch

# numba.cuda, bound on first launch: Numba is optional, and split_sizes must import
# without it. The kernels below name it as a module global because the CUDA simulator
# swaps the module in a kernel's globals for its fake one.
cuda = None


def split_sizes(n: int, num_replicas: int) -> list[int]:
    """Rows of each replica's piece when ``n`` rows are split over ``num_replicas``.

    Pieces of ``ceil(n / num_replicas)`` rows, in order; replicas past the end of the
    data get 0. Examples: ``split_sizes(6, 4) == [2, 2, 2, 0]``,
    ``split_sizes(4, 5) == [1, 1, 1, 1, 0]``, ``split_sizes(7, 3) == [3, 3, 1]``.
    """
    n, num_replicas = int(n), int(num_replicas)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if n < 0:
        raise ValueError(f"a batch cannot have a negative number of rows ({n})")
    chunk = -(-n // num_replicas)
    return [max(0, min(chunk, n - i * chunk)) for i in range(num_replicas)]


class Split(NamedTuple):
    """The pieces of one batch, in replica order, and their valid-row counts."""

    pieces: list
    counts: list


# --- kernels ---------------------------------------------------------------------------

def _gather_split_rows(src, index, out, rows, chunk, n, zero):
    """out[p * rows + r, :] = src[index[p * chunk + r], :] where that row exists (``r <
    chunk`` and inside the index), else ``zero`` (0 as a word); ``p`` is the piece,
    ``rows`` its rows in ``out``."""
    pieces = out.shape[0] // rows
    words = out.shape[1]
    w0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    wstep = cuda.gridDim.x * cuda.blockDim.x
    r0 = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    rstep = cuda.gridDim.y * cuda.blockDim.y
    p = cuda.blockIdx.z
    while p < pieces:
        first = p * chunk
        valid = min(chunk, n - first)
        out0 = p * rows
        r = r0
        while r < rows:
            s0 = index[first + r] if r < valid else -1
            s1 = index[first + r + rstep] if r + rstep < valid else -1
            s2 = index[first + r + 2 * rstep] if r + 2 * rstep < valid else -1
            s3 = index[first + r + 3 * rstep] if r + 3 * rstep < valid else -1
            w = w0
            while w < words:
                v0 = src[s0, w] if s0 >= 0 else zero
                v1 = src[s1, w] if s1 >= 0 else zero
                v2 = src[s2, w] if s2 >= 0 else zero
                v3 = src[s3, w] if s3 >= 0 else zero
                out[out0 + r, w] = v0
                if r + rstep < rows:
                    out[out0 + r + rstep, w] = v1
                if r + 2 * rstep < rows:
                    out[out0 + r + 2 * rstep, w] = v2
                if r + 3 * rstep < rows:
                    out[out0 + r + 3 * rstep, w] = v3
                w += wstep
            r += 4 * rstep
        p += cuda.gridDim.z


#: Output rows each thread moves per pass of the kernels.
ROWS_PER_PASS = 4
_WORDS = ("uint8", "uint16", "uint32", "uint64")
_INDEX = ("int32", "int64")
_kernels = _launch.LazyKernels(globals())



def signature(word, index) -> tuple:
    """The arguments of ``_gather_split_rows`` for rows of ``word`` words and an
    ``index`` dtype (:class:`_launch.Arg`)."""
    w, i64 = np.dtype(word), np.dtype(np.int64)
    rows = _launch.Arg(w, 2)
    return (rows, _launch.Arg(np.dtype(index), 1), rows, _launch.Arg(i64), _launch.Arg(i64),
            _launch.Arg(i64), _launch.Arg(w))


def specialisations() -> list:
    """Every kernel specialisation the launcher uses (:class:`_launch.Kernel`)."""
    return [_kernels.specialise("_gather_split_rows", *signature(w, i))
            for w in _WORDS for i in _INDEX]


def ptx_signatures():
    """``(python_function, signature)`` for every specialisation the launcher uses,
    so that tests can compile each to PTX."""
    _kernels.bind()
    return [(_kernels.python_function(k.name), k.numba_signature())
            for k in specialisations()]


# --- launcher and reference ------------------------------------------------------------

def _plan(batch, num_replicas, index, pad_to):
    """Shared argument checks; returns ``(n, sizes, chunk, rows_out)``."""
    if batch.ndim < 1:
        raise ValueError(f"a batch to split needs a leading batch axis, got a scalar "
                         f"(shape {tuple(batch.shape)})")
    if index is not None:
        kind = np.dtype(index.dtype)
        if index.ndim != 1 or kind.kind not in "iu":
            raise TypeError(f"index must be a 1-D integer array, got shape "
                            f"{tuple(index.shape)} dtype {kind}")
        if kind == np.uint64:  # no signed type holds every uint64 and the kernel's -1
            raise TypeError("index must be a signed or 32-bit-at-most unsigned integer "
                            "array (int32 or int64 are best), got uint64: cast it with "
                            "index.astype('int64')")
        n = int(index.shape[0])
    else:
        n = int(batch.shape[0])
    sizes = split_sizes(n, num_replicas)
    chunk = sizes[0]
    if pad_to is None:
        rows_out = chunk
    else:
        rows_out = int(pad_to)
        if rows_out < chunk:
            raise ValueError(
                f"pad_to={rows_out} rows per replica is too small: {n} rows on "
                f"{num_replicas} replicas need {chunk} rows per piece; use pad_to >= "
                f"{chunk} (the per-replica batch size) or no padding")
    return n, sizes, chunk, rows_out


def _check_index_range(index, src_rows: int) -> None:
    if index.shape[0] == 0:
        return
    if hasattr(index, "copy_to_host"):
        host = index.copy_to_host()
        lo, hi = int(host.min()), int(host.max())
    else:
        lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= src_rows:
        raise IndexError(f"index holds rows {lo} .. {hi} but the batch has {src_rows} "
                         f"rows (valid: 0 .. {src_rows - 1})")


def _prepare(batch, index, check_index: bool, stream):
    """The batch (and index) made C-contiguous and the index range checked, on the launch stream
    ``stream`` (inside the launch's device context): the kernel then runs after the
    copy, and the copy's memory goes back to that stream's pool, reused only after it.
    (The launch stream was ordered after the current stream, where the batch and
    index were written, by ``_launch.launch_stream``.)"""
    cp = _launch._cupy_of(batch)
    with (_launch.cupy_stream(cp, stream) if cp is not None
          else contextlib.nullcontext()):
        if not _launch.is_c_contiguous(batch):
            batch = cp.ascontiguousarray(batch)
        if index is not None and not _launch.is_c_contiguous(index):
            index = cp.ascontiguousarray(index)
        if index is not None and check_index:
            _check_index_range(index, int(batch.shape[0]))
    return batch, index


def launch_config(pieces: int, rows: int, words: int, threads: int | None = None):
    """``(grid, block)`` of a split into ``pieces`` pieces of ``rows`` rows of ``words``
    words: blocks shaped by :func:`_launch.launch_config_2d` over a piece's rows
    (``ROWS_PER_PASS`` rows per thread) and words, one grid layer per piece (up to the
    65,535 layers a grid has, then a loop)."""
    (gx, gy), block = _launch.launch_config_2d(-(-max(int(rows), 1) // ROWS_PER_PASS),
                                               words, threads or _launch.env_threads())
    return (gx, gy, min(max(int(pieces), 1), _launch.MAX_GRID_Y)), block


def piece_ranges(sizes, chunk: int, rows_out: int, row: int):
    """``(copies, zeros)`` of a split without a gather into a ``(pieces, rows_out)``
    buffer of ``row``-byte rows: ``[dst, src, bytes]`` ranges copied from the batch and
    ``[dst, bytes]`` ranges zero-filled, adjacent ranges merged (without padding: one
    copy and at most one memset)."""
    copies, zeros = [], []
    for p, count in enumerate(sizes):
        dst = p * rows_out * row
        if count:
            if copies and copies[-1][0] + copies[-1][2] == dst \
                    and copies[-1][1] + copies[-1][2] == p * chunk * row:
                copies[-1][2] += count * row
            else:
                copies.append([dst, p * chunk * row, count * row])
        if rows_out > count:
            start, size = dst + count * row, (rows_out - count) * row
            if zeros and zeros[-1][0] + zeros[-1][1] == start:
                zeros[-1][1] += size
            else:
                zeros.append([start, size])
    return copies, zeros


def _copy_pieces(cp, batch, out, sizes, chunk) -> None:
    """The split of a contiguous CuPy ``batch`` without a gather: each piece's rows are
    one range of the batch, so the pieces are device-to-device copies and the rows past
    each piece's data zero-filled with memsets, on CuPy's current stream (the launch
    stream)."""
    row = int(out.shape[2]) * out.dtype.itemsize
    copies, zeros = piece_ranges(sizes, chunk, int(out.shape[1]), row)
    stream = cp.cuda.get_current_stream()
    for dst, src, size in copies:
        (out.data + dst).copy_from_device_async(batch.data + src, size, stream)
    for dst, size in zeros:
        (out.data + dst).memset_async(0, size, stream)


def _copy_pieces_host(batch, out, sizes, chunk) -> None:
    """:func:`_copy_pieces` on host memory (the simulator's NumPy batches)."""
    row = int(out.shape[2]) * out.dtype.itemsize
    copies, zeros = piece_ranges(sizes, chunk, int(out.shape[1]), row)
    src, dst = batch.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    for d, s, size in copies:
        dst[d:d + size] = src[s:s + size]
    for d, size in zeros:
        dst[d:d + size] = 0


#: Plans of recent gathers (see ``kernels/_launch.py``): a training loop gathers from
#: the same batch buffer with the same index layout every step.
_plans = _launch.Plans()


class _Plan(NamedTuple):
    """A gather of one layout (batch, index, pieces) on one device and stream."""

    device: int
    function: object        # CuPy's RawKernel
    grid: tuple
    block: tuple
    args: tuple             # CuPy's argument objects; the output's address at ``slot``
    slot: int
    out_shape: tuple        # (pieces, rows per piece, words)
    word: np.dtype
    dtype: np.dtype         # the batch's
    full_shape: tuple       # (pieces, rows per piece, *trailing)
    sizes: list
    padded: bool
    rows: int               # the batch's


def _gather(cp, batch, index, out, rows_out, chunk, n, threads, key, how) -> None:
    """``_gather_split_rows`` into ``out`` (``(pieces, rows_out, words)``) on CuPy's
    current device and stream; its plan is kept under ``key`` (None: not kept) with
    ``how`` (``(dtype, full_shape, sizes, padded)``, what :func:`_pieces` needs)."""
    word, words = out.dtype, int(out.shape[2])
    pieces, rows = int(out.shape[0]), int(batch.shape[0])
    device = out.data.device_id
    kernel = _kernels.specialise("_gather_split_rows", *signature(word, index.dtype))
    grid, block = launch_config(pieces, rows_out, words, threads)
    values = [(int(batch.data.ptr), (rows, words)), (int(index.data.ptr), (n,)),
              (0, (pieces * rows_out, words)), rows_out, chunk, n, 0]
    plan = _Plan(device, kernel.function(cp, device), grid, block + (1,) * (3 - len(block)),
                 _launch.cupy_args(cp, _launch.flatten(kernel.signature, values)),
                 _launch.data_slot(kernel.signature, 2), tuple(out.shape), word, *how, rows)
    if key is not None:
        _plans.put(key, plan)
    _launch_gather(cp, plan, out)


def _launch_gather(cp, plan: _Plan, out) -> None:
    args = plan.args
    plan.function(plan.grid, plan.block, args[:plan.slot] + (_launch.word(cp, out.data.ptr),)
                  + args[plan.slot + 1:])


def _gather_planned(cp, plan: _Plan, index, stream, check_index: bool) -> Split:
    """A gather whose layout was launched before: no checks but the index range."""
    with _launch.on_device(cp, plan.device), _launch.launch_stream(cp, stream):
        if check_index:
            _check_index_range(index, plan.rows)
        if plan.dtype.isbuiltin:
            # The buffer as the pieces' dtype and shape at once (the kernel only takes
            # its address): no views of a word buffer to make.
            full = cp.empty(plan.full_shape, plan.dtype)
            _launch_gather(cp, plan, full)
            return _cut(full, plan.full_shape[1], plan.sizes, plan.padded)
        out = cp.empty(plan.out_shape, plan.word)
        _launch_gather(cp, plan, out)
    return _pieces(out, plan.dtype, plan.full_shape, plan.sizes, plan.padded)


def _pieces(out, dtype, full_shape, sizes, padded: bool) -> Split:
    # One view of the whole buffer, then a piece per replica: indexing a device array
    # costs microseconds of Python per call.
    return _cut(out.view(np.uint8).view(dtype).reshape(full_shape), full_shape[1], sizes,
                padded)


def _cut(full, rows_out: int, sizes, padded: bool) -> Split:
    """The pieces of ``full`` (``(pieces, rows_out, *trailing)``)."""
    return Split([full[p] if padded or count == rows_out else full[p][:count]
                  for p, count in enumerate(sizes)], list(sizes))


def split(batch, num_replicas: int, index=None, pad_to: int | None = None,
          stream=None, threads: int | None = None, check_index: bool = True) -> Split:
    """Cut ``batch`` (on a GPU) into ``num_replicas`` pieces by the splitting rule, into
    one fresh buffer: one kernel launch for a gather, device copies and memsets
    otherwise.

    Args:
        batch: a device array (CuPy, any ``__cuda_array_interface__``; NumPy under the
            simulator), any dtype, shape ``(rows, *trailing)``.
        num_replicas: number of pieces.
        index: optional 1-D int32/int64 device array; row ``g`` of the split is
            ``batch[index[g]]`` and ``n = len(index)``.
        pad_to: fixed-shape mode: every piece gets exactly ``pad_to`` rows, rows past
            its count are zeros. Must be at least ``ceil(n / num_replicas)``.
        stream: a CuPy or Numba stream (or ``cudaStream_t``); None is the current
            CuPy stream. The launch is asynchronous on it.
        threads: threads per block (default 256, or ``GPUSTRAT_KERNEL_THREADS``).
        check_index: check that ``index`` lies in ``0 .. rows - 1`` first (reads
            two numbers back from the device, so it synchronises the stream).

    Returns:
        ``Split(pieces, counts)``: ``pieces[i]`` has shape ``(rows_i, *trailing)``
        (``rows_i = counts[i]``, or ``pad_to`` in fixed-shape mode), all views of one
        new contiguous buffer on ``batch``'s device; ``counts`` are host ints.
    Raises:
        TypeError: host data on a real GPU, or an index that is not integer.
        ValueError: ``pad_to`` too small, or arrays on different devices.
        IndexError: ``index`` outside the batch (when ``check_index``).
    """
    key = None
    if index is not None and _launch._is_cupy(batch) and _launch._is_cupy(index) \
            and not _launch.simulating():
        # A layout gathered before (a training loop's): its plan, and no other check.
        cp = _devices.cupy()
        device = batch.data.device_id
        key = (device, _launch.launch_handle(cp, stream, device), batch.data.ptr,
               batch.shape, batch.strides, _launch.dtype_key(batch.dtype), index.data.ptr,
               index.shape, index.strides, _launch.dtype_key(index.dtype), num_replicas,
               pad_to, threads)
        plan = _plans.get(key)
        if plan is not None:
            return _gather_planned(cp, plan, index, stream, check_index)
    _launch.check_kernel_input(batch, "batch")
    if index is not None:
        _launch.check_kernel_input(index, "index")
    n, sizes, chunk, rows_out = _plan(batch, num_replicas, index, pad_to)
    trailing = tuple(int(s) for s in batch.shape[1:])
    dtype = np.dtype(batch.dtype)
    row_elems = math.prod(trailing)
    row_bytes = row_elems * dtype.itemsize
    if _launch.simulating():
        out = _split_simulated(batch, index, check_index, sizes, chunk, n, rows_out,
                               num_replicas, row_elems, row_bytes, threads)
    else:
        cp = _devices.cupy()
        batch = _launch.as_cupy(batch)
        index = None if index is None else _launch.as_cupy(index)
        device = batch.data.device_id
        if index is not None and index.data.device_id != device:
            raise ValueError(f"one launch reads and writes one device, but the batch is on "
                             f"gpu:{device} and the index on gpu:{index.data.device_id}: "
                             "copy them to one device first")
        with _launch.on_device(cp, device), _launch.launch_stream(cp, stream):
            given_batch, given_index = batch, index
            batch, index = _prepare(batch, index, check_index, None)
            if batch is not given_batch or index is not given_index:
                key = None          # copies made for this call: no plan to keep
            word = _launch.word_dtype(row_bytes, int(batch.data.ptr))
            words = row_bytes // word.itemsize
            out = cp.empty((num_replicas, rows_out, words), word)
            if num_replicas * rows_out * words == 0:
                pass                                # an empty buffer: nothing to write
            elif index is None:
                _copy_pieces(cp, batch, out, sizes, chunk)
            else:
                # Through bytes: a dtype whose size is not a power of two (a 3-byte
                # void or record) does not view as a word directly.
                src = batch.reshape(int(batch.shape[0]), row_elems).view(np.uint8).view(word)
                _gather(cp, src, index, out, rows_out, chunk, n, threads, key,
                        (dtype, (num_replicas, rows_out) + trailing, sizes,
                         pad_to is not None))
    return _pieces(out, dtype, (num_replicas, rows_out) + trailing, sizes,
                   pad_to is not None)


def _split_simulated(batch, index, check_index, sizes, chunk, n, rows_out, num_replicas,
                     row_elems, row_bytes, threads):
    """The split under Numba's simulator, of NumPy arrays: the gather kernel through
    Numba's dispatcher, and the copies of a plain split with NumPy."""
    batch = np.ascontiguousarray(batch)
    index = None if index is None else np.ascontiguousarray(index)
    if index is not None and check_index:
        _check_index_range(index, int(batch.shape[0]))
    word = _launch.word_dtype(row_bytes, _launch.data_ptr(batch))
    words = row_bytes // word.itemsize
    out = np.empty((num_replicas, rows_out, words), word)
    if num_replicas * rows_out * words == 0:
        return out
    src = batch.reshape(int(batch.shape[0]), row_elems).view(np.uint8).view(word)
    if index is None:
        _copy_pieces_host(src, out, sizes, chunk)
    else:
        grid, block = launch_config(num_replicas, rows_out, words, threads)
        _kernels["_gather_split_rows"][grid, block](
            src, index, out.reshape(num_replicas * rows_out, words), rows_out, chunk, n,
            word.type(0))
    return out


def split_reference(batch, num_replicas: int, index=None, pad_to: int | None = None,
                    stream=None, threads: int | None = None,
                    check_index: bool = True) -> Split:
    """NumPy reference of :func:`split` (``stream`` and ``threads`` are ignored)."""
    batch = np.asarray(batch)
    if index is not None:
        index = np.asarray(index)
    n, sizes, chunk, rows_out = _plan(batch, num_replicas, index, pad_to)
    if index is not None:
        if check_index:
            _check_index_range(index, batch.shape[0])
        rows = batch[index]
    else:
        rows = batch
    pieces = []
    for p, count in enumerate(sizes):
        piece = rows[p * chunk:p * chunk + count]
        if pad_to is not None:
            padded = np.zeros((rows_out,) + batch.shape[1:], batch.dtype)
            padded[:count] = piece
            piece = padded
        pieces.append(np.ascontiguousarray(piece).copy())
    return Split(pieces, list(sizes))


def scatter(batch, devices, index=None, pad_to: int | None = None, streams=None,
            check_index: bool = True) -> Split:
    """Split ``batch`` and place piece ``i`` on ``devices[i]``.

    A C-contiguous GPU batch with neither ``index`` nor ``pad_to`` is cut into views,
    and each piece moves with one device-to-device (peer) copy; a piece for the batch's
    own device stays a view. Otherwise a batch on a GPU is split by the kernel on its
    own device, on that device's current CuPy stream (where the batch was produced),
    then each piece is copied to its replica's device, on ``streams[i]`` when given
    (else that device's current stream); every copy waits for the split first
    (``devices.to_device`` orders it after the source device's current stream). Host
    batches are split with the NumPy reference.

    With ``streams``, the batch's own device ``k`` uses its piece on ``streams[k]``:
    the split and the copies' reads then run on ``streams[k]`` (after the batch's
    producer, on the current stream), so that the buffer the pieces come from belongs
    to that stream's pool arena, and its piece of a contiguous cut is a copy made
    there instead of a view of the batch; the current stream waits for those reads (an
    event). Every piece is then reused by CuPy's pool only after the work queued on its
    stream, and the batch only after the reads of it.
    """
    from gpustrat.devices import (current_stream, device_of,  # noqa: PLC0415
                                  parse_device, wait_for_current)
    devices = [parse_device(d) for d in devices]
    if streams is not None and len(streams) != len(devices):
        raise ValueError(f"scatter got {len(streams)} streams for {len(devices)} devices: "
                         "pass one stream per device, or None")
    home = device_of(batch)
    own = _own_stream(batch, home, devices, streams)
    if own is None:
        return _scatter(batch, devices, index, pad_to, streams, check_index, False)
    cp = _launch._cupy_of(batch)
    wait_for_current(home, own)               # after the batch's producer
    with current_stream(home, own):
        res = _scatter(batch, devices, index, pad_to, streams, check_index, True)
    with home.activate():                     # the batch is reused after its reads
        cp.cuda.get_current_stream().wait_event(own.record())
    return res


def _own_stream(batch, home, devices, streams):
    """``streams[k]`` for the batch's own device ``devices[k]`` when it is another
    stream than that device's current one; else None."""
    if streams is None or home is None or home not in devices:
        return None
    own = streams[devices.index(home)]
    if own is None:
        return None
    cp = _launch._cupy_of(batch)
    with home.activate():
        return None if cp.cuda.get_current_stream().ptr == own.ptr else own


def _scatter(batch, devices, index, pad_to, streams, check_index, copy_own) -> Split:
    # copy_own: the batch's device's own stream is current, and its piece of a
    # contiguous cut is copied there (not left a view of the caller's batch).
    from gpustrat.devices import device_of, is_gpu_array, to_device  # noqa: PLC0415
    contiguous_cut = (is_gpu_array(batch) and index is None and pad_to is None
                      and batch.flags.c_contiguous)
    if contiguous_cut:
        # A contiguous cut needs no kernel: the pieces are views, each moved with one
        # copy (device to device, or peer) ordered after the batch's producer.
        sizes = split_sizes(int(batch.shape[0]), len(devices))
        starts = np.cumsum([0] + sizes[:-1])
        with device_of(batch).activate():
            res = Split([batch[int(a):int(a) + c] for a, c in zip(starts, sizes)], sizes)
    elif is_gpu_array(batch):
        # The split and the copies' wait are both on this device's current stream.
        with device_of(batch).activate():
            res = split(batch, len(devices), index, pad_to, check_index=check_index)
    elif hasattr(batch, "__cuda_array_interface__") and not isinstance(batch, np.ndarray):
        res = split(batch, len(devices), index, pad_to, check_index=check_index)
    else:
        res = split_reference(batch, len(devices), index, pad_to, check_index=check_index)
    home = device_of(batch)
    placed = [_own_copy(p) if copy_own and contiguous_cut and d == home else
              to_device(p, d, None if streams is None else streams[i])
              for i, (p, d) in enumerate(zip(res.pieces, devices))]
    return Split(placed, res.counts)


def _own_copy(piece):
    """A contiguous CuPy ``piece`` copied, device to device, on its device's current
    stream, into memory of that stream's pool arena."""
    from gpustrat.devices import device_of  # noqa: PLC0415
    cp = _launch._cupy_of(piece)
    with device_of(piece).activate():
        stream = cp.cuda.get_current_stream()
        out = cp.empty(piece.shape, piece.dtype)
        if piece.nbytes:
            out.data.copy_from_device_async(piece.data, piece.nbytes, stream)
    return out
