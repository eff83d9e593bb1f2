"""yuebing.conductor.policy: see docs/structure.md."""
