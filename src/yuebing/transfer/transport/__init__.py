"""Transports of the transfer engine: `base` (the ABCs), `local` (same process), `shm` (same
host, direct copies into the peer's mapped segment), `tcp_client` / `tcp_server` (TCP lanes)."""
