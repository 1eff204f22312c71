"""Errors that the command line reports as one line, without a traceback."""


class SlipcacheError(Exception):
    """A problem the user can fix (bad input, missing file, mismatched config)."""


class InvalidInputError(SlipcacheError, ValueError):
    """Bad ids, offsets, dtypes or data lines; a ValueError so library callers can catch it as one."""
