"""The errors a user sees as one line (`error: ...`, see cli.py), in a module that imports nothing,
so that the CLI's error handling does not import the training stack. Each is raised by the module
named in its docstring, which imports it from here (and so still exports it)."""


class ConfigError(ValueError):
    """A config file or override that cannot be used (config.py). Exit 2."""


class DataError(ValueError):
    """Bad input to the data pipeline (missing file, malformed record, bad setting). Exit 2."""


class HFError(ValueError):
    """A Hugging Face model directory, or an export request, that cannot be used (hf/). Exit 2."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model. Exit 2."""


class LockedError(ValueError):
    """The run directory is in use by another training process (runlock.py). Exit 2."""


class SaveError(RuntimeError):
    """A checkpoint that could not be written (an I/O failure, or a state that is not finite).
    The checkpoints already committed are untouched. Exit 1."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps); its checkpoints are
    intact and hold no non-finite state (train.py). Exit 1."""
