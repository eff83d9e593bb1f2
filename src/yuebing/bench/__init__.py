"""yuebing.bench: see docs/structure.md."""
