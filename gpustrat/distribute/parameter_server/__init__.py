"""Parameter-server training over MPI ranks (``ParameterServerStrategy``,
``ClusterCoordinator``): see ``docs/parameter_server.md``.

Modules: :mod:`.resolver` (roles of the ranks), :mod:`.strategy`, :mod:`.coordinator`
and :mod:`.values` (what it hands back: remote and per-worker values), :mod:`.server`
(a server rank's loop), :mod:`.worker` (a worker rank and its function process),
:mod:`.executor` (the function process), :mod:`.variables` (remote and sharded
variables), :mod:`.optimizers` (optimizer steps, slots and their checkpoint state on
the servers), :mod:`.partitioners`, :mod:`.wire` and :mod:`.channel` (what travels and
how), :mod:`.doorbell` (how waiting ranks sleep). Importing this package starts no MPI.
"""

from gpustrat.distribute.parameter_server import partitioners  # noqa: F401 - no MPI
