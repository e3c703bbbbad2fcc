"""User-facing errors that are not configuration errors (those are `meshlm.config.ConfigError`).

Kept free of heavy imports so the CLI can catch them without loading torch.
"""


class CheckpointError(FileNotFoundError):
    """No usable checkpoint (or metrics) at a path the user gave."""
