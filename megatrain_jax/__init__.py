"""megatrain_jax: train models larger than GPU memory on one GPU, with all state in host RAM."""

__all__ = ["StreamedEngine"]


def __getattr__(name):
    """`megatrain_jax.StreamedEngine`, imported on first use: importing a light module of the
    package (errors, cli) does not import JAX."""
    if name == "StreamedEngine":
        from megatrain_jax.engine import StreamedEngine
        return StreamedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
