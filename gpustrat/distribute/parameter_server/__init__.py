"""Parameter-server training over MPI ranks (``ParameterServerStrategy``,
``ClusterCoordinator``): see ``docs/parameter_server.md``.

Modules: :mod:`.resolver` (roles of the ranks), :mod:`.strategy`, :mod:`.coordinator`,
:mod:`.server` (a server rank's loop), :mod:`.worker` (a worker rank and its function
process), :mod:`.executor` (the function process), :mod:`.variables` (remote and
sharded variables), :mod:`.partitioners`, :mod:`.wire` and :mod:`.channel` (what
travels and how). Importing this package starts no MPI.
"""

from gpustrat.distribute.parameter_server import partitioners  # noqa: F401 - no MPI
