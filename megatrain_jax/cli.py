"""What every entry script shares: bad input becomes one line on stderr and exit code 2."""

import sys

from megatrain_jax.checkpoint import CheckpointError
from megatrain_jax.config import ConfigError
from megatrain_jax.data import DataError
from megatrain_jax.hf import HFError

USER_ERRORS = (ConfigError, DataError, HFError, CheckpointError)


def run_cli(fn) -> int:
    """Runs fn(); a user error (config, data, checkpoint) prints `error: ...` and returns 2."""
    try:
        fn()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
