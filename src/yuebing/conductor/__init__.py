"""yuebing.conductor: see docs/structure.md."""
