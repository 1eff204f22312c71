"""Errors that the command line reports as one line, without a traceback."""


class SlipcacheError(Exception):
    """A problem the user can fix (bad input, missing file, mismatched config); the CLI exits with
    `exit_code`."""

    exit_code = 2


class InvalidInputError(SlipcacheError, ValueError):
    """Bad ids, offsets, dtypes or data lines; a ValueError so library callers can catch it as one."""


class RunLockedError(SlipcacheError):
    """Another live process holds the run directory (`run.lock`): exit code 3, so a scheduler can tell
    "already running" from a bad command (2)."""

    exit_code = 3
