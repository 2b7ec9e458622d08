"""Train a model on the streamed engine.

    python scripts/train.py --config configs/tiny.yaml [key=value ...]

Overrides are dotted config keys: `train.steps=20 run_dir=/tmp/run data.seq_len=256`.
"""

import argparse

from megatrain_jax.cli import run_cli, script_exit
from megatrain_jax.config import load_config
from megatrain_jax.train import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config file (defaults apply without one)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    return run_cli(lambda: train(load_config(args.config, args.overrides)))


if __name__ == "__main__":
    script_exit(main)
