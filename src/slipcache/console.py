"""What the `slipcache` command shows of the library's log records: each one as the one line it says.

Library modules log (`logging.getLogger(__name__)`) and never print; a program that imports slipcache
decides where the records go. The command installs `console_messages()` for its duration: information
on stdout, beside the command's own output, and warnings and errors on stderr, with no level or logger
name added, so what a user reads is the message itself.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

PACKAGE_LOGGER = "slipcache"


class ConsoleHandler(logging.Handler):
    """Information to stdout, warnings and errors to stderr; the streams are looked up at each record, so a
    command that redirects them (a rank's log) or a test that captures them sees its own."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging's own contract: a failing handler reports, never raises
            self.handleError(record)


@contextlib.contextmanager
def console_messages(level: int = logging.INFO) -> Iterator[ConsoleHandler]:
    """Print slipcache's records of `level` and above while the block runs, then leave logging as it was.

    Nested (a command run from within another, or under a test that shows the messages), the outer handler
    stays the only one: each line is printed once."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    present = next((h for h in logger.handlers if isinstance(h, ConsoleHandler)), None)
    if present is not None:
        yield present
        return
    handler = ConsoleHandler(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
