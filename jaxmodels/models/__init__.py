"""Model families. `registry` maps HF architecture names to model classes."""
