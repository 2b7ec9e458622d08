"""`python -m megatrain_jax train|plan|export|generate|plot ...`: the `megatrain` console script."""

from megatrain_jax.commands import main

if __name__ == "__main__":
    main(prog="python -m megatrain_jax")
