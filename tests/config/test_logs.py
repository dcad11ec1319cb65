"""zeroshard.config.logs: zeroshard's INFO lines are visible without logging set-up; ZEROSHARD_LOG_LEVEL=warning
(or a level the application sets) turns them off; an application that configured logging decides.

Each test runs with the root logger's handlers taken away (pytest's capture is one), as in a script that
configured nothing, and puts everything back. The 2-rank test in test_hf_configs.py sees the start-up
block through the same path, once, on rank 0 only.
"""

from __future__ import annotations

import contextlib
import logging

import pytest

from zeroshard.config.logs import show_info
from zeroshard.errors import ZeroshardError


@contextlib.contextmanager
def unconfigured():
    # In the test body: pytest adds its capture handler to the root logger for each phase.
    root, logger = logging.getLogger(), logging.getLogger("zeroshard")
    saved = root.handlers[:], logger.handlers[:], logger.level
    root.handlers.clear()
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    try:
        yield logger
    finally:
        root.handlers[:], logger.handlers[:] = saved[0], saved[1]
        logger.setLevel(saved[2])


def test_info_is_visible_without_logging_setup(capsys, monkeypatch):
    monkeypatch.delenv("ZEROSHARD_LOG_LEVEL", raising=False)
    with unconfigured():
        show_info()
        show_info()  # once: a second initialize adds no second handler
        logging.getLogger("zeroshard.config").info("zeroshard config:\n  resolved: ...")
    assert capsys.readouterr().err == "zeroshard config:\n  resolved: ...\n"


def test_quiet_switch(capsys, monkeypatch):
    monkeypatch.setenv("ZEROSHARD_LOG_LEVEL", "warning")
    with unconfigured():
        show_info()
        logging.getLogger("zeroshard.config").info("hidden")
        logging.getLogger("zeroshard.config").warning("shown")
    assert capsys.readouterr().err == "shown\n"


def test_a_level_set_by_the_application_is_kept(capsys, monkeypatch):
    monkeypatch.delenv("ZEROSHARD_LOG_LEVEL", raising=False)
    with unconfigured() as logger:
        logger.setLevel(logging.WARNING)
        show_info()
        logging.getLogger("zeroshard.engine").info("hidden")
        assert capsys.readouterr().err == "" and logger.level == logging.WARNING


def test_an_application_that_configured_logging_decides():
    with unconfigured() as logger:
        logging.getLogger().addHandler(logging.NullHandler())  # as logging.basicConfig(...) would
        show_info()
        assert logger.level == logging.NOTSET and not logger.handlers


def test_a_level_name_in_any_case_and_a_bad_one_names_the_variable_and_the_values(capsys, monkeypatch):
    monkeypatch.setenv("ZEROSHARD_LOG_LEVEL", " Warning ")
    with unconfigured():
        show_info()
        logging.getLogger("zeroshard.config").info("hidden")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ZEROSHARD_LOG_LEVEL", "verbose")
    with unconfigured(), pytest.raises(ZeroshardError) as info:
        show_info()
    assert isinstance(info.value, ValueError)
    assert str(info.value) == ("the environment variable ZEROSHARD_LOG_LEVEL='verbose' is not a log level: set it "
                               "to one of debug, info, warning, error (any case), or unset it for info")
