"""The library logs; the command prints its records as one-line messages (`slipcache.console`)."""

from __future__ import annotations

import logging

import pytest

from slipcache.console import ConsoleHandler, console_messages


def _handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger("slipcache").handlers if isinstance(h, ConsoleHandler)]


def test_information_goes_to_stdout_and_warnings_to_stderr_as_the_bare_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = logging.getLogger("slipcache.training.somewhere")
    with console_messages():
        log.info("run: /tmp/x")
        log.warning("slipcache train: warning: careful")
        log.debug("not shown")
    captured = capsys.readouterr()
    assert captured.out == "run: /tmp/x\n"
    assert captured.err == "slipcache train: warning: careful\n"


def test_nested_commands_print_each_line_once(capsys: pytest.CaptureFixture[str]) -> None:
    with console_messages(), console_messages():
        assert len(_handlers()) == 1
        logging.getLogger("slipcache.x").info("once")
    assert capsys.readouterr().out == "once\n"


def test_the_handler_is_removed_and_the_level_restored_after_the_command() -> None:
    logger = logging.getLogger("slipcache")
    saved = _handlers()
    for handler in saved:  # the suite's own (conftest): out of the way for this check
        logger.removeHandler(handler)
    before = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with console_messages():
            assert len(_handlers()) == 1 and logger.level == logging.INFO
        assert _handlers() == [] and logger.level == logging.WARNING
    finally:
        logger.setLevel(before)
        for handler in saved:
            logger.addHandler(handler)


def test_a_library_caller_without_the_command_gets_no_information_lines(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("slipcache")
    saved = _handlers()
    for handler in saved:
        logger.removeHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="slipcache"):
            logging.getLogger("slipcache.training.callbacks").info("run: /tmp/x")
        assert capsys.readouterr().out == ""  # not printed: the program decides where records go
        assert [r.getMessage() for r in caplog.records] == ["run: /tmp/x"]
    finally:
        for handler in saved:
            logger.addHandler(handler)
