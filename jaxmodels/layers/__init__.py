"""Layers shared by both model families (Flax NNX)."""
