"""The DMP step benchmark's arithmetic and arguments (its timing runs are `python -m benchmarks.dmp_step`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import dmp_step


def test_the_ratios_are_per_round_against_torchrecs_step_of_the_same_round(tmp_path: Path) -> None:
    timings = [
        {"round": r, "arm": arm, "ms_per_step": ms}
        for r, base in enumerate((10.0, 20.0, 40.0))  # the machine slows down round by round
        for arm, ms in zip(dmp_step.ARMS, (base, 1.5 * base, 1.2 * base), strict=True)
    ]
    dmp_step._write(tmp_path / "out.json", timings, 2, 3, 4, "python -m benchmarks.dmp_step")
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["median_ms_per_step"]["torchrec-fp32"] == 20.0
    assert result["ratio_to_torchrec"] == pytest.approx({"torchrec-fp32": 1.0, "ours-fp32-all-cached": 1.5,
                                                         "ours-int8-lru5": 1.2})
    assert result["ratio_range"]["ours-int8-lru5"] == pytest.approx([1.2, 1.2])
    assert result["setup"]["rows"] == 521_000 and result["setup"]["processes"] == 2


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--processes", "1"], ["--processes", "3"]])
def test_bad_arguments_stop_with_a_usage_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        dmp_step.main(argv)
    assert stopped.value.code == 2 and "--processes at least 2" in capsys.readouterr().err
