"""yuebing.store: see docs/structure.md."""
