"""The user-facing error classes of dhp and the exit code of each (a leaf module: no torch, no Ray).

Every mistake a user can make ends in one of these, raised with a message that
names the key or file and the fix; ``dhp`` prints it as one ``dhp: ...`` line and
exits with the class's code (``dhp --help`` lists them). Anything else is a bug
(exit code 1); ``--debug`` or ``DHP_DEBUG=1`` shows the traceback of either.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BUG = 1  # an unexpected error: a bug in dhp (or in a plugin)
EXIT_CONFIG = 2  # a config key or value, a command-line argument, a layout that cannot run
EXIT_DATA = 3  # a data file, an image, a sample
EXIT_MODEL = 4  # a model directory, a tokenizer, a checkpoint
EXIT_WORKER = 5  # a Ray worker failed or died
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

EXIT_CODES = {
    EXIT_BUG: "unexpected error (a bug: rerun with --debug and report the traceback)",
    EXIT_CONFIG: "config error (a key, a value, an argument, a layout)",
    EXIT_DATA: "data error (a data file, an image, a sample)",
    EXIT_MODEL: "model or checkpoint error (model.hf_path, data.tokenizer, a checkpoint)",
    EXIT_WORKER: "a worker failed (module, rank, method, step and the worker's error are printed)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class DhpError(Exception):
    """A mistake the user can fix; the message names the key or file and says how."""

    exit_code = EXIT_BUG
    label = "error"  # printed as ``dhp: <label>: <message>``


class UsageError(DhpError, ValueError):
    """A command-line argument that cannot be used as given."""

    exit_code = EXIT_CONFIG
    label = "error"


class ConfigError(DhpError, ValueError):
    """A configuration problem; the message names the key and how to fix it."""

    exit_code = EXIT_CONFIG
    label = "config error"


class DataError(DhpError, ValueError):
    """A problem with the training data; the message names the file, the sample and the fix.

    ``issues`` holds the per-sample problems (``DataIssue``) when there are any; the message's first line
    summarises them and names the fix."""

    exit_code = EXIT_DATA
    label = "data error"

    def __init__(self, message: str, issues: list | None = None) -> None:
        super().__init__(message)
        self.issues = list(issues or [])


class ModelError(DhpError, ValueError):
    """A model directory, tokenizer or checkpoint that cannot be used; the message names the key and the fix."""

    exit_code = EXIT_MODEL
    label = "model error"


class CheckpointError(ModelError):
    """A checkpoint that cannot be used: a training checkpoint to resume from (missing, incomplete, from another
    config), or Hugging Face weights that do not fit the module (the message names the tensor and the file)."""

    label = "checkpoint error"


class Interrupted(DhpError):
    """Ctrl-C or SIGTERM stopped a run after a step (a checkpoint was written if asked); exit 128 + signal."""

    label = "stopped"

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


__all__ = [
    "Interrupted",
    "EXIT_BUG",
    "EXIT_CODES",
    "EXIT_CONFIG",
    "EXIT_DATA",
    "EXIT_INTERRUPTED",
    "EXIT_MODEL",
    "EXIT_OK",
    "EXIT_WORKER",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DhpError",
    "ModelError",
    "UsageError",
]
