"""yuebing.trace: see docs/structure.md."""
