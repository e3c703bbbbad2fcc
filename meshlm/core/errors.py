"""User-facing errors: a bad configuration or argument, a missing checkpoint, a failed write, a run that cannot go on.

Kept free of heavy imports so the CLI can catch them without loading torch.
"""


class ConfigError(ValueError):
    """A user-facing configuration error: the message names the key and the fix."""


class CheckpointError(FileNotFoundError):
    """No usable checkpoint (or metrics) at a path the user gave."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, another rank failed); nothing was published."""


class TrainingError(RuntimeError):
    """The run cannot go on for a reason the user can fix (e.g. non-finite losses step after step)."""
