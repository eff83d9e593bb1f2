"""yuebing.prefill: see docs/structure.md."""
