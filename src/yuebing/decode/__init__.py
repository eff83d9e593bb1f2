"""yuebing.decode: see docs/structure.md."""
