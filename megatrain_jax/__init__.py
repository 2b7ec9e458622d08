"""megatrain_jax: train models larger than GPU memory on one GPU, with all state in host RAM."""

from megatrain_jax.engine import StreamedEngine

__all__ = ["StreamedEngine"]
