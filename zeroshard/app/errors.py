"""The programs' error: flags (or a checkpoint's batch) they cannot run with, reported in one line."""

from zeroshard.errors import ZeroshardError


class UsageError(ZeroshardError, ValueError):
    """Flags that cannot work together, or a checkpoint's global batch that these flags cannot make on this many
    ranks: not a bug, so it is reported in one line without a traceback; the message names the flag to change."""
