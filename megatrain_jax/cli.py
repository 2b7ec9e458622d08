"""What every entry script shares: an error is one line on stderr, `error: ...`, and an exit code.

    2   bad input, refused before anything is written: config, data, HF directory, a checkpoint
        that cannot be resumed, a run directory in use by another run
    1   a fault during the run: a checkpoint could not be written (disk full, directory made
        read-only, a state that is not finite), another file write failed, or too many
        consecutive steps had a non-finite gradient; the checkpoints committed before it are
        intact

Orbax reports a failed background write from its own threads (log records with tracebacks, then
errors of abandoned coroutines at exit). While a script runs, those records are held back: replayed
if the run succeeds, dropped after an error (whose one line already names the cause).
"""

import logging
import os
import sys

from megatrain_jax.errors import (CheckpointError, ConfigError, DataError, HFError, LockedError,
                                  SaveError, TrainingError)

USER_ERRORS = (ConfigError, DataError, HFError, CheckpointError, LockedError)  # exit code 2
RUN_FAULTS = (SaveError, OSError, TrainingError)  # exit code 1 (e.g. a disk filled up), + TierError
TIER_MODULE = "megatrain_jax.engine.tier"  # TierError's: engine/ imports nothing outside itself
NOISY_LOGGERS = ("absl", "asyncio")  # Orbax's background threads log through these

_as_script = False


class _HeldRecords(logging.Filter):
    """Holds the WARNING+ records of NOISY_LOGGERS, and unraisable exceptions, instead of printing
    them."""

    def __init__(self):
        super().__init__()
        self.records, self.unraisable = [], []

    def filter(self, record):
        if record.levelno < logging.WARNING:
            return True
        self.records.append(record)
        return False

    def install(self):
        for name in NOISY_LOGGERS:
            logging.getLogger(name).addFilter(self)
        self._hook, sys.unraisablehook = sys.unraisablehook, self.unraisable.append

    def remove(self, replay: bool):
        for name in NOISY_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        sys.unraisablehook = self._hook
        if replay:
            for record in self.records:
                logging.getLogger(record.name).handle(record)
            for unraisable in self.unraisable:
                sys.unraisablehook(unraisable)


def _run_faults() -> tuple:
    """RUN_FAULTS and, once the disk tier is imported (it cannot raise before), its TierError:
    read from sys.modules, so that importing the CLI does not import the engine and JAX."""
    tier = sys.modules.get(TIER_MODULE)
    return RUN_FAULTS + ((tier.TierError,) if tier is not None else ())


def run_cli(fn) -> int:
    """Runs fn(); a user error prints `error: ...` and returns 2, a failed save returns 1."""
    held = _HeldRecords()
    held.install()
    try:
        fn()
    except USER_ERRORS as e:
        code, message = 2, str(e)
    except _run_faults() as e:
        code, message = 1, str(e)
    except BaseException:  # a bug or KeyboardInterrupt: everything, with its traceback
        held.remove(replay=True)
        raise
    else:
        held.remove(replay=True)
        return 0
    if not _as_script:  # a script exits right after this; keep the noise held until then
        held.remove(replay=False)
    print(f"error: {message}", file=sys.stderr)
    return code


def script_exit(main):
    """`sys.exit(main())` for an entry script. After an error it exits at once (os._exit): a
    failed Orbax save leaves non-daemon threads waiting for signals that never come, which would
    keep a normal interpreter exit waiting for minutes and print tracebacks."""
    global _as_script
    _as_script = True
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
