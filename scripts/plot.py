"""Plot runs: train and eval loss and tokens/s against the step, runs overlaid.

    python scripts/plot.py RUN_DIR [RUN_DIR ...] [--out PNG]

The same as `megatrain plot ...` (megatrain_jax.commands.plot). Needs matplotlib
(pip install 'megatrain-jax[plot]').
"""

from megatrain_jax.cli import script_exit
from megatrain_jax.commands import plot as main

if __name__ == "__main__":
    script_exit(main)
