"""Progress off a terminal: one plain line every 30 s, no redraws; a short job prints nothing."""

from __future__ import annotations

import io

import pytest

from slipcache import progress
from slipcache.progress import LineProgress, progress_bar


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_one_plain_line_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    log = io.StringIO()
    bar = progress_bar(total=600_000, desc="train", unit=" samples", unit_scale=True, file=log)
    assert isinstance(bar, LineProgress)
    for step in range(1, 2344):  # 256 samples a step, 16 steps a second: 146 s
        clock.now += 0.0625
        bar.update(256)
        if step == 100:
            bar.set_postfix({"loss": "0.5123"}, refresh=False)
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 5  # at 30, 60, 90 and 120 s, then the end
    assert lines[0] == "train: 122,880/600,000 samples (20%), 4,096 samples/s, loss=0.5123, ETA 0:01:56"
    assert lines[-1].startswith("train: 599,808/600,000 samples (100%)")


def test_a_short_job_prints_nothing_and_a_terminal_gets_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    with progress_bar(total=10, desc="synth", unit="rows", file=log) as bar:
        bar.update(10)
    assert log.getvalue() == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert not isinstance(progress_bar(total=10, file=Terminal()), LineProgress)
