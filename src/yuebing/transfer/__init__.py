"""yuebing.transfer: see docs/structure.md."""
