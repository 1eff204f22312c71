"""`slipcache experiment accuracy`: the paired t-interval on known values, and the study end to end."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks import accuracy, runner
from slipcache.data.synthetic import DEFAULT_GENERATOR
from slipcache.errors import SlipcacheError
from tests.benchmarks.study_runs import RAN, FakeConfig, fake_trainer, run_study, write_fake_run

PROBE = ["--probe-seconds", "0.05", "--probe-table-bytes", "8000000"]


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (9, 2.262157), (10, 2.228139), (30, 2.042272)],
)
def test_t_critical_matches_the_tables(df: int, expected: float) -> None:
    assert accuracy.t_critical(df) == pytest.approx(expected, abs=2e-6)


def test_t_mass_has_the_closed_forms_of_one_and_two_degrees_of_freedom() -> None:
    for t in (0.0, 0.3, 1.0, 4.0):
        assert accuracy.t_two_sided_mass(t, 1) == pytest.approx(2 / math.pi * math.atan(t))  # Cauchy
        assert accuracy.t_two_sided_mass(t, 2) == pytest.approx(t / math.sqrt(2 + t * t))
    assert accuracy.t_critical(10_000) == pytest.approx(1.959964, abs=1e-3)  # the normal limit
    with pytest.raises(SlipcacheError):
        accuracy.t_two_sided_mass(1.0, 0)


def test_paired_interval_on_known_values() -> None:
    got = accuracy.paired_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4) * sd / sqrt(n)
    assert got is not None and got["n"] == 5 and got["mean"] == pytest.approx(3.0)
    assert got["half_width"] == pytest.approx(half, rel=1e-6)
    assert (got["low"], got["high"]) == pytest.approx((3 - half, 3 + half), rel=1e-6)
    one = accuracy.paired_interval([0.5])
    assert one is not None and one["mean"] == 0.5 and one["low"] is None and one["half_width"] is None
    assert accuracy.paired_interval([]) is None


def test_tolerance_verdict() -> None:
    def verdict(*diffs: float) -> str:
        return accuracy.tolerance_verdict(accuracy.paired_interval(list(diffs)))

    assert verdict(0.0001, -0.0001, 0.0002, 0.0).startswith("met")
    assert verdict(-0.003, -0.0031, -0.0029).startswith("missed: a loss")
    assert verdict(0.003, 0.0031, 0.0029).startswith("missed: a gain")
    wide = verdict(0.002, -0.002, 0.0)  # mean 0, half width 4.3 * 0.002 / sqrt(3) = 0.00497
    assert wide.startswith("not shown") and "0.004 beyond" in wide
    assert accuracy.tolerance_verdict(accuracy.paired_interval([0.0])) == "too few seeds for an interval"


# ----------------------------------------------------------------------------------------------------
# The study with a fake trainer: constructed AUCs, so every interval in results.json and the report is known.

SEED_AUC = [0.70, 0.74, 0.71, 0.76, 0.73]  # seed-to-seed spread far above the effects: pairing must remove it
EFFECT = {"fp32": 0.0, "fp16": 0.0001, "int8": -0.0002, "int4": -0.004}
NOISE = [0.0001, -0.0001, 0.0002, 0.0, -0.0002]  # per seed, added to every non-fp32 setup


def _auc(config: FakeConfig) -> float:
    noise = NOISE[config.seed] if config.precision != "fp32" else 0.0
    return SEED_AUC[config.seed] + EFFECT[config.precision] + noise


def _fake_train(config: FakeConfig) -> dict[str, Any]:
    auc = _auc(config)
    events = [{"event": "train", "samples": 100 * k, "val_auc": auc - 0.01 / k} for k in range(1, 5)]
    return write_fake_run(config, events, {
        "auc": auc, "logloss": 0.5 - auc / 10, "accuracy": 0.7, "train_samples": 400, "samples_per_s": 1000.0,
        "train_wall_s": 1.0, "embedding_bytes": 100, "memory_ratio": 2.0,
        "cache_hit_rate": 0.9 if config.cache_size else None, "skipped_fraction": 0.0,
        "embedding_stats": {k: 1 for k in ("lookups", "hits", "misses", "evictions", "rows_in", "rows_out",
                                           "bytes_in", "bytes_out")},
    })  # fmt: skip


@pytest.mark.slow
def test_accuracy_study_with_a_fake_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "trainer", fake_trainer(_fake_train))
    out = tmp_path / "out"
    lines = run_study("accuracy", "--out", str(out), "--data", str(tmp_path), "--accuracy-epochs", "4", *PROBE)
    results = json.loads((out / "results.json").read_text())
    assert sum(bool(RAN.match(line)) for line in lines) == 6 * accuracy.ACCURACY_SEEDS == len(results["cells"])
    assert {c["config"]["epochs"] for c in results["cells"]} == {4}
    for setup in accuracy.accuracy_grid(runner.PRESETS["full"], 5):  # every setup on every seed: paired
        assert sorted(c["seed"] for c in results["cells"] if c["setup"] == setup.name) == [0, 1, 2, 3, 4]

    rows = {r["setup"]: r for r in results["accuracy"]}
    assert set(rows) == {"fp16 no cache", "int8 5% lru", "int8 5% lfu", "int4 1% lru", "int8 no cache"}
    diffs = [EFFECT["int8"] + n for n in NOISE]  # what pairing leaves: the effect plus the per-seed noise
    half = 2.776445 * statistics.stdev(diffs) / math.sqrt(5)
    got = rows["int8 5% lru"]["auc_delta"]
    assert got["n"] == 5 and got["mean"] == pytest.approx(-0.0002)
    assert got["half_width"] == pytest.approx(half, rel=1e-5)  # unpaired, the seeds' 0.02 spread would swamp it
    assert rows["int8 5% lru"]["logloss_delta"]["mean"] == pytest.approx(0.00002)
    assert rows["int8 5% lru"]["verdict"].startswith("met")
    assert rows["int4 1% lru"]["verdict"].startswith("missed: a loss")

    report = (out / "report.md").read_text()
    assert (out / "accuracy_intervals.png").is_file() and "](accuracy_intervals.png)" in report
    # -0.0002 ± 0.000196: the upper bound -0.0000037 is printed without a minus sign
    assert "| int8 5% lru | 5 | " in report and "| -0.0002 [-0.0004, +0.0000] |" in report
    # 100 samples an epoch; val AUC - 0.01 / epoch: +0.01 * (1/3 - 1/4) per epoch at the end, +0.005 at the start
    assert "moved by +0.0008 per epoch at the end of training, against +0.0050 per epoch at the start" in report
    assert "**Accuracy.**" in report and "Mixed-precision embeddings" not in report

    again = run_study("accuracy", "--out", str(out), "--data", str(tmp_path), "--accuracy-epochs", "4", *PROBE)
    assert not any(RAN.match(line) for line in again)  # every cell kept: the study resumes cell by cell


@pytest.mark.slow  # 12 tiny training runs: ~20 s on 2 idle cores
def test_accuracy_study_with_the_real_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two seeds of the whole grid at a tiny size: real runs, paired by seed, a report with intervals."""
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    run_study("accuracy", "--out", str(out), "--quick", "--scale", "0.001", "--dataset-samples", "4000",
         "--eval-samples", "500", "--accuracy-epochs", "1", "--seeds", "2", *PROBE)  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    cells = results["cells"]
    assert len(cells) == 12 and {c["summary"]["config"]["synthetic_generator"] for c in cells} == {DEFAULT_GENERATOR}
    by = {(c["setup"], c["seed"]): c["summary"] for c in cells}
    for row in results["accuracy"]:
        diffs = [by[(row["setup"], s)]["auc"] - by[("fp32 no cache", s)]["auc"] for s in (0, 1)]
        assert row["auc_delta"]["mean"] == pytest.approx(statistics.fmean(diffs))
    assert "| int4 1% lru | 2 |" in (out / "report.md").read_text()


def test_a_recalibrated_synthetic_dataset_makes_new_cells(tmp_path: Path) -> None:
    plan = runner.Plan(runner.PRESETS["quick"], tmp_path, None, 2)
    grid = accuracy.accuracy_grid(plan.preset, 2)
    old, new = plan.cells(grid, "n150000-scale0.01-seed0-v3-aaaa"), plan.cells(grid, "n150000-scale0.01-seed0-v3-bbbb")
    assert [c.id for c in old] == [c.id for c in plan.cells(grid, "n150000-scale0.01-seed0-v3-aaaa")]
    assert not {c.id for c in old} & {c.id for c in new}


def test_a_new_optional_trainer_field_keeps_finished_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = runner.Plan(runner.PRESETS["quick"], tmp_path, None, 2)
    grid = accuracy.accuracy_grid(plan.preset, 2)
    before = [c.id for c in plan.cells(grid, "v3-aaaa")]
    base = runner.trainer.TrainConfig

    class Off(base):  # type: ignore[misc,valid-type]
        def flat(self) -> dict[str, Any]:
            return {**super().flat(), "new_option": None}

    class Changed(base):  # type: ignore[misc,valid-type]
        def flat(self) -> dict[str, Any]:
            return {**super().flat(), "new_option": "on"}

    monkeypatch.setattr(runner.trainer, "TrainConfig", Off)
    assert [c.id for c in plan.cells(grid, "v3-aaaa")] == before  # an option added, off by default
    monkeypatch.setattr(runner.trainer, "TrainConfig", Changed)
    assert not set(before) & {c.id for c in plan.cells(grid, "v3-aaaa")}  # a default that is on: new cells
