"""The local supervisor behind ``yuebing serve`` and etcd discovery of multi-host roles.

- `supervisor.Supervisor`: starts role processes in stages (one log file each), waits for their
  readiness (`readiness`), watches and restarts them, stops them on SIGINT/SIGTERM.
- `process`: one child process (own process group, dies with the supervisor).
- `discovery.Discovery`: publish / list roles under ``/yuebing/<cluster>/`` in etcd.
- `serve`: the one-host plan of ``yuebing serve`` (store, instances, conductor).
"""

from yuebing.cluster.config import SupervisorConfig
from yuebing.cluster.process import RoleSpec
from yuebing.cluster.supervisor import Interrupted, RoleFailed, Supervisor

__all__ = ["Interrupted", "RoleFailed", "RoleSpec", "Supervisor", "SupervisorConfig"]
