"""yuebing.engine: see docs/structure.md."""
