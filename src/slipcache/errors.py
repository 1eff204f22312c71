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


class RunInterrupted(SlipcacheError):
    """The run stopped on a signal after writing its checkpoint (not a failure: the message says how to go
    on); exits 128 + the signal's number, as a shell reports a process a signal stopped."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class SettingError(InvalidInputError):
    """A setting out of its range, raised by the config that owns it; `name` is its field, so a caller that
    spells the setting otherwise (the trainer's `--cache-size`) can name it in its own words."""

    def __init__(self, name: str, message: str, predicate: str | None = None) -> None:
        """`predicate`: what is wrong, worded to follow another name for the setting ("must be >= 0, got -1");
        by default the message after its leading `name`. `{field}` in it: another field, named as the caller
        names it."""
        super().__init__(message)
        self.name = name
        self.predicate = predicate
