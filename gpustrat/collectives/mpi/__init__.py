"""MPI between workers: the only module that imports mpi4py.

Words:
- *worker*: one MPI rank. A job launched as ``mpiexec -n 4 python train.py`` has four.
- *channel*: one duplicated MPI communicator plus the rule for waiting on it. Each
  :class:`MpiWorkerGroup` and each :class:`MpiCommunicator` owns its own duplicate, so
  several strategies coexist, and control collectives (input pipeline threads) never
  interleave with data collectives (replica threads) on one communicator.
- *deadline*: every blocking wait is a non-blocking MPI call (``Iallreduce``,
  ``Ibcast``, ...) polled with ``Test`` until it completes or ``GPUSTRAT_TIMEOUT``
  seconds (default 300) pass; then :class:`~gpustrat.errors.CollectiveTimeout` is
  raised. Polling is a tight ``Test`` spin first (small collectives finish in a few
  microseconds, as fast as the blocking call), then ``Test`` between yields of the core,
  then sleeps backing off to 1 ms, so a rank waiting minutes for a slow peer does not
  burn a core. The one exception: the data transfer of a reduce or gather of 64 KiB or
  more, which starts only after every rank's header has arrived (so no rank can be
  absent from it), is the blocking MPI call, as fast as a bare one.
- *header*: every collective between workers starts with one Allgather of a fixed
  64-byte record per rank: the kind of collective, a checksum of the layout (and of an
  agreement folded into it, :meth:`MpiCommunicator.agreeing`), the input step (steps
  taken from distributed iterators; data collectives only), a size that may differ
  between ranks, and (up to 32 bytes) the payload itself. Every rank sees
  every header, so a disagreement raises :class:`~gpustrat.errors.CollectiveMismatch`
  (or :class:`~gpustrat.errors.LayoutMismatch`) on every rank, naming each rank's call,
  before any data moves; a small reduce, gather or broadcast is that one collective.
- *debug mode* (``GPUSTRAT_DEBUG_COLLECTIVES=1``): the header also carries a checksum of
  the line of user code that made the call, so the same collective reached from two
  different lines (a skipped call followed by an alike one) is a mismatch too.

Modules: :mod:`.waits` (mpi4py on first use, the deadline for every wait, the dtype
and op table), :mod:`.header` (the channel and the header agreement), :mod:`.exits`
(ranks that exit early), :mod:`.stall` (where every rank is when a wait lasts
``GPUSTRAT_STALL_WARNING`` seconds), :mod:`.group` (:class:`MpiWorkerGroup`) and
:mod:`.communicator` (:class:`MpiCommunicator`, the data plane).

Arrays travel through mpi4py's buffer interface (upper-case calls), never pickled.
``from mpi4py import MPI`` initialises MPI, so it happens in :func:`mpi` the first time a
group is made, never when gpustrat is imported.
"""

from gpustrat.collectives.mpi.communicator import MpiCommunicator
from gpustrat.collectives.mpi.group import MpiWorkerGroup
from gpustrat.collectives.mpi.header import kind_code
from gpustrat.collectives.mpi.waits import (DEFAULT_TIMEOUT, ENV_DEBUG, ENV_INPUT_STEPS,
                                            ENV_TIMEOUT, debug_from_env,
                                            input_steps_from_env, mpi, mpi_world,
                                            reduce_args, timeout_from_env, wait)
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout, LayoutMismatch

__all__ = ["DEFAULT_TIMEOUT", "ENV_DEBUG", "ENV_INPUT_STEPS", "ENV_TIMEOUT",
           "CollectiveMismatch", "CollectiveTimeout", "LayoutMismatch", "MpiCommunicator",
           "MpiWorkerGroup", "debug_from_env", "input_steps_from_env", "kind_code", "mpi",
           "mpi_world", "reduce_args", "timeout_from_env", "wait"]
