"""Progress of a long job: tqdm's bar on a terminal, a plain line every 30 s anywhere else.

Why: tqdm redraws its bar with carriage returns many times a second; in a log file, a pipe or CI output each
redraw is kept (a default training run left a thousand of them). Off a terminal the same call prints
`desc: done/total unit (share), rate, postfix, ETA` at most every `LOG_EVERY_S` seconds, and a closing line
only when it printed any (a job of a few seconds stays silent).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol, TextIO

from tqdm import tqdm

LOG_EVERY_S = 30.0


class ProgressBar(Protocol):
    """What a progress bar offers its callers, whichever `progress_bar` made (tqdm's or `LineProgress`)."""

    def update(self, n: float = 1) -> Any: ...
    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...


def progress_bar(
    total: float | None = None,
    *,
    desc: str = "",
    unit: str = "it",
    initial: float = 0,
    disable: bool = False,
    file: TextIO | None = None,
    **bar_options: Any,
) -> ProgressBar:
    """A tqdm bar on a terminal, else a `LineProgress`; both take `update`, `set_postfix`, `close` and `with`."""
    stream = file if file is not None else sys.stderr
    if disable or _is_terminal(stream):
        return tqdm(total=total, desc=desc or None, unit=unit, initial=initial, disable=disable, file=stream,
                    **bar_options)
    return LineProgress(total, desc=desc, unit=unit.strip(), initial=initial, file=stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False


class LineProgress:
    """Plain progress lines, at most one every `every_s` seconds (see the module docstring)."""

    def __init__(self, total: float | None, *, desc: str, unit: str, initial: float = 0, file: TextIO,
                 every_s: float = LOG_EVERY_S) -> None:
        self.total, self.desc, self.unit, self.file, self.every_s = total, desc, unit, file, every_s
        self.n = self.start_n = self.last_n = initial
        self.start = self.last = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self.printed = 0

    def update(self, n: float = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every_s:
            self._print()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def close(self) -> None:
        if self.printed and self.n != self.last_n:
            self._print()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _print(self) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.n:,.0f}/{self.total:,.0f} {self.unit} ({100 * self.n / self.total:.0f}%)"
                 if self.total else f"{self.n:,.0f} {self.unit}"]
        parts.append(f"{rate:,.0f} {self.unit}/s")
        parts += [f"{key}={value}" for key, value in self.postfix.items()]
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {_clock((self.total - self.n) / rate)}")
        else:
            parts.append(f"{_clock(elapsed)} elapsed")
        prefix = f"{self.desc}: " if self.desc else ""
        print(prefix + ", ".join(parts), file=self.file, flush=True)
        self.last, self.last_n, self.printed = now, self.n, self.printed + 1


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
