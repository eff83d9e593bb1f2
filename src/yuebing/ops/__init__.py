"""What every service process shares for being operated: the admin HTTP server (health and
Prometheus metrics, `ops.admin`) and the cluster-token authentication of its ZeroMQ sockets
(`ops.zap`). Imports `core` only; the store, instance, Conductor and cluster roles import it."""
