"""The config's own errors and warnings."""

from zeroshard.errors import ZeroshardError


class ConfigError(ZeroshardError, ValueError):
    """A config that cannot be used; the message names the cause and the fix."""


class ConfigWarning(UserWarning):
    """A DeepSpeed key that zeroshard ignores because the config says `"strict": false`."""


class AutoError(ZeroshardError):
    """An "auto" value zeroshard cannot work out; the argument says what to put instead (auto.py turns it
    into a line of the ConfigError)."""
