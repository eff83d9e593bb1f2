"""yuebing.sim: see docs/structure.md."""
