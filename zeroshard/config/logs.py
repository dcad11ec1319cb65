"""Make zeroshard's INFO lines visible when the application configured no logging (as transformers does).

`show_info()` (called by `zeroshard.initialize`) gives the
"zeroshard" logger a stderr handler and the level INFO, unless the
application already decided: a level set on the "zeroshard" logger, or a
handler on the root logger (`logging.basicConfig`, pytest's capture), is
left alone. The handler also stays silent whenever the root logger has a
handler by the time a line is written, so nothing is printed twice.

Quiet switch: the environment variable ZEROSHARD_LOG_LEVEL (debug, info,
warning, error, in any case; default info), or
`logging.getLogger("zeroshard").setLevel(logging.WARNING)` before `initialize`. In config/, not a leaf, so that a bad
value is a `ConfigError` (leaves import nothing of zeroshard, errors.py included).
"""

from __future__ import annotations

import logging
import os
import sys

from zeroshard.config.errors import ConfigError

ENV = "ZEROSHARD_LOG_LEVEL"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _FallbackHandler(logging.StreamHandler):
    """stderr, only while the root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_info() -> None:
    """Give the "zeroshard" logger a stderr handler at INFO (or ZEROSHARD_LOG_LEVEL), once, unless the
    application configured logging itself."""
    logger = logging.getLogger("zeroshard")
    if any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        return
    given = os.environ.get(ENV, "info")
    name = given.strip().lower()
    if name not in _LEVELS:
        raise ConfigError(f"the environment variable {ENV}={given!r} is not a log level: set it to one of "
                          f"{', '.join(_LEVELS)} (any case), or unset it for info")
    if logger.level != logging.NOTSET or logging.getLogger().handlers:
        return  # the application decided
    logger.setLevel(_LEVELS[name])
    handler = _FallbackHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
