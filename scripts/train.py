"""Train a model on the streamed engine.

    python scripts/train.py --config configs/tiny.yaml [key=value ...]

Overrides are dotted config keys: `train.steps=20 run_dir=/tmp/run data.seq_len=256`.
The same as `megatrain train ...` (megatrain_jax.commands.train).
"""

from megatrain_jax.cli import script_exit
from megatrain_jax.commands import train as main

if __name__ == "__main__":
    script_exit(main)
