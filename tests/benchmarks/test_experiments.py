"""Studies at a tiny size: the files they write, resumability, and the grids they build."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import mixed_precision, runner, slipstream, studies
from slipcache.errors import SlipcacheError
from tests.benchmarks.study_runs import RAN, FakeConfig, fake_trainer, run_study, study_args, write_fake_run

# Far below --quick: ~35k embedding rows, 8 steps per run; still every setup of the quick grid.
TINY = [
    "--quick", "--scale", "0.001", "--dataset-samples", "12000", "--train-samples", "4096",
    "--stale-dataset-samples", "6000", "--eval-samples", "1000", "--probe-seconds", "0.05",
    "--probe-table-bytes", "8000000",
]  # fmt: skip
MP_PLOTS = ("accuracy_vs_memory.png", "cache_sweep.png", "rounding.png", "bytes_moved.png")
STALE_PLOTS = ("skip_speedup.png", "stale_rows.png")
def _ran(lines: list[str]) -> int:
    return sum(bool(RAN.match(line)) for line in lines)


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        out = tmp_path_factory.mktemp("exp") / "out"
        lines = run_study("mixed-precision", "--out", str(out), *TINY)
        yield out, lines


@pytest.mark.slow
def test_results_schema(mp_run: tuple[Path, list[str]]) -> None:
    out, lines = mp_run
    results = json.loads((out / "results.json").read_text())
    assert results["format"] == "slipcache-experiments" and results["version"] == 1
    assert results["machine"]["cpu_model"] and results["probes"]["random_gather"]["rows_per_s"] > 0
    grid = mixed_precision.mixed_precision_grid(runner.PRESETS["quick"], 1)
    assert _ran(lines) == len(results["cells"]) == sum(s.seeds for s in grid)
    for cell in results["cells"]:
        assert {
            "id",
            "experiment",
            "setup",
            "seed",
            "config",
            "summary",
            "embedding_traffic",
            "derived",
        } <= set(cell)
        assert cell["config"]["seed"] == cell["seed"]
        traffic = cell["embedding_traffic"]
        assert traffic["lookups"] == 26 * cell["summary"]["train_samples"]  # training lookups only
        assert cell["derived"]["bytes_moved_per_sample"] > 0 and cell["derived"]["step_ms"] > 0
    setups = {s["name"]: s for s in results["setups"]}
    assert {q for s in setups.values() for q in s["questions"]} == {"RQ1", "RQ2", "RQ3", "RQ4"}
    base = setups[mixed_precision.BASELINE]["metrics"]
    assert base["auc_delta"]["mean"] == 0.0 and base["auc"]["n"] == 1
    for s in setups.values():
        for key in ("auc", "logloss", "samples_per_s", "memory_ratio", "auc_delta", "bytes_moved_per_sample"):
            assert set(s["metrics"][key]) == {"mean", "std", "n"}, (s["name"], key)
    # fp32 rows behind an exact fp32 cache compute what the baseline computes, up to float summation order
    assert setups["fp32 5% lru"]["metrics"]["auc"]["mean"] == pytest.approx(base["auc"]["mean"], abs=2e-3)
    assert setups["int4 no cache"]["metrics"]["memory_ratio"]["mean"] > 3


@pytest.mark.slow
def test_cell_result_equals_its_summary(mp_run: tuple[Path, list[str]]) -> None:
    out, _ = mp_run
    results = json.loads((out / "results.json").read_text())
    for cell in results["cells"]:
        cell_dir = out / "cells" / cell["id"]
        assert cell["summary"] == json.loads((cell_dir / "summary.json").read_text())
        assert not (cell_dir / "checkpoints").exists()


@pytest.mark.slow
def test_report_has_every_plot_and_answer(mp_run: tuple[Path, list[str]]) -> None:
    out, _ = mp_run
    report = (out / "report.md").read_text()
    for name in MP_PLOTS:
        assert (out / name).stat().st_size > 10_000, name
        assert f"]({name})" in report
    for question in ("**RQ1.**", "**RQ2.**", "**RQ3.**", "**RQ4.**", "**RQ5.**", "Against the paper"):
        assert question in report
    assert "n/a" not in report.split("### RQ5")[1].split("###")[0]  # traffic was found for every run


@pytest.mark.slow
def test_second_invocation_runs_nothing_and_a_crashed_cell_reruns(mp_run: tuple[Path, list[str]]) -> None:
    out, _ = mp_run
    first = json.loads((out / "results.json").read_text())
    lines = run_study("mixed-precision", "--out", str(out), *TINY)
    assert _ran(lines) == 0 and any("already done" in line for line in lines)
    again = json.loads((out / "results.json").read_text())
    assert [c["summary"] for c in again["cells"]] == [c["summary"] for c in first["cells"]]

    crashed = out / "cells" / first["cells"][3]["id"]
    (crashed / "cell.json").unlink()  # as if the run died before its record was written
    (crashed / "checkpoints").mkdir()
    lines = run_study("mixed-precision", "--out", str(out), *TINY)
    assert _ran(lines) == 1 and (crashed / "cell.json").is_file()


@pytest.mark.slow
def test_slipstream_runs_with_the_real_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole slipstream grid end to end at a tiny scale: every setup, the report and its plots."""
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    lines = run_study("slipstream", "--out", str(out), *TINY, "--stale-epochs", "2")
    grid = slipstream.slipstream_grid(runner.PRESETS["quick"], 1)
    assert _ran(lines) == sum(s.seeds for s in grid)
    results = json.loads((out / "results.json").read_text())
    skipped = [c["summary"]["skipped_fraction"] for c in results["cells"] if c["config"].get("skip_rule") == "stale"]
    assert skipped and all(0.0 <= f < 1.0 for f in skipped)
    assert all(len(c["curve"]) >= 3 for c in results["cells"])  # 10 evaluations per epoch feed time to target
    report = (out / "report.md").read_text()
    assert "time to target" in report
    for plot in STALE_PLOTS:
        assert (out / plot).is_file() and plot in report


def _fake_train(config: FakeConfig) -> dict[str, Any]:
    """A run whose time falls with the skip target, with staleness events in metrics.jsonl.

    Validation AUC climbs the same way per evaluation in every run; a skipping run gets there in (1 - skipped)
    of the time, so its speedup to target is 1 / (1 - skipped) exactly.
    """
    skipped = 0.8 * config.stale_target if config.skip_rule == "stale" else 0.0
    events = [
        {
            "event": "train",
            "samples": s,
            "skipped_fraction": skipped,
            "stale_rows": s // 10 if skipped else 0,
            "hot_rows": 1000,
            "threshold": 0.01,
            "val_auc": 0.75 - 0.05 / i,
            "train_seconds": i * (1 - skipped),
            "train_cpu_s": 0.5 * i * (1 - skipped),
        }
        for i, s in enumerate(range(512, 8192, 512), 1)
    ]
    return write_fake_run(config, events, {
        "auc": 0.75 - 0.01 * skipped + 0.001 * config.seed, "logloss": 0.5, "accuracy": 0.7,
        "train_samples": int(8192 * (1 - skipped)), "samples_per_s": 1000.0, "train_wall_s": 10.0 * (1 - skipped),
        "embedding_bytes": 100, "memory_ratio": 2.0, "cache_hit_rate": 0.9, "skipped_fraction": skipped,
        "staleness": {"skip_overhead_parts_s": {"filter": 0.1, "guard": 0.05}, "guard_actions": [{"action": "lower"}]}
        if skipped else None,
        "embedding_stats": {"lookups": 26, "hits": 20, "misses": 6, "evictions": 1, "rows_in": 6, "rows_out": 1,
                            "bytes_in": 114, "bytes_out": 19},
    })  # fmt: skip


@pytest.mark.slow
def test_slipstream_report_with_a_fake_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "trainer", fake_trainer(_fake_train))
    out = tmp_path / "out"
    lines = run_study("slipstream", "--out", str(out), "--data", str(tmp_path), "--seeds", "2", "--repeats", "3", *TINY)
    results = json.loads((out / "results.json").read_text())
    setups = {s["name"]: s for s in results["setups"]}
    assert len(setups) == 16 and _ran(lines) == (2 + 2) * 16  # seeds 0 and 1, and seed 0 twice more
    ran = [line for line in lines if RAN.match(line)]
    # interleaved: every setup's first run, then every setup's repeat 1, then repeat 2 (A B A B), then seed 1
    assert all("repeat" not in line for line in ran[:16]) and all("repeat 1" in line for line in ran[16:32])
    assert all("repeat 2" in line for line in ran[32:48]) and all("seed 1" in line for line in ran[48:])
    m = setups["fp32, convergence rule, warm-up val, D=0.5"]["metrics"]
    assert m["speedup"]["median"] == pytest.approx(1 / 0.6) and m["speedup"]["n"] == 3
    assert m["cpu_speedup"]["median"] == pytest.approx(1 / 0.6) and m["cpu_time_to_target"]["median"] < (
        m["time_to_target"]["median"])  # the CPU clock's own curve, not the wall clock's
    assert setups["fp32, convergence rule, warm-up val, keep 0.25, D=0.5"]["overrides"]["stale_keep"] == 0.25
    assert m["auc_delta"]["n"] == 2  # accuracy pairs by seed; repeats do not count twice
    assert m["overhead_share"] == pytest.approx(0.15 / (10.0 * 0.6)) and m["guard_actions"] == 2
    assert setups["fp32, no skipping"]["metrics"]["speedup"]["median"] == 1.0
    report = (out / "report.md").read_text()
    for name in STALE_PLOTS:
        assert (out / name).is_file() and f"]({name})" in report
    assert "**Skipping.**" in report and "Mixed-precision" not in report
    assert "interleaved" in report and "1.67x (1.67-1.67)" in report
    assert "fp32, convergence rule, warm-up val, D=0.5, seed 1: epoch None, batch None, guard: lower" in report


def test_slipstream_runs_only_the_named_setups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--setup picks setups by name (a timing rerun of a baseline and one setting); a wrong name is one line."""
    monkeypatch.setattr(runner, "trainer", fake_trainer(_fake_train))
    pick = ["fp32, no skipping", "fp32, convergence rule, warm-up val, D=0.5"]
    lines = run_study("slipstream", "--out", str(tmp_path / "out"), "--data", str(tmp_path), "--seeds", "1",
                 "--repeats", "3", "--setup", pick[0], "--setup", pick[1], *TINY)
    assert _ran(lines) == 2 * 3
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["name"] for s in results["setups"]] == pick
    assert results["setups"][1]["metrics"]["speedup"]["n"] == 3
    with pytest.raises(SlipcacheError, match="no setup named 'fp32, D=9'"):
        run_study("slipstream", "--out", str(tmp_path / "bad"), "--data", str(tmp_path), "--setup", "fp32, D=9", *TINY)


def test_time_to_target_on_a_constructed_curve() -> None:
    """Target = mean of the last 3 evaluations - 0.001; the crossing is interpolated between evaluations."""
    baseline = [(10.0, 0.70), (20.0, 0.74), (30.0, 0.751), (40.0, 0.752), (50.0, 0.753)]
    target = slipstream.auc_target(baseline)
    assert target == pytest.approx(0.751)
    assert slipstream.time_to_target(baseline, target) == pytest.approx(30.0)
    faster = [(5.0, 0.70), (10.0, 0.76)]  # crosses 0.751 at 5 + 5 * 0.051 / 0.06
    assert slipstream.time_to_target(faster, target) == pytest.approx(5.0 + 5.0 * 0.051 / 0.06)
    assert slipstream.time_to_target([(3.0, 0.9)], target) == 3.0  # reached at the first evaluation
    assert slipstream.time_to_target([(1.0, 0.70), (2.0, 0.75), (3.0, 0.72)], target) is None
    assert slipstream.auc_target([]) is None


def test_grids_cover_the_questions() -> None:
    full = mixed_precision.mixed_precision_grid(runner.PRESETS["full"], 3)
    names = {s.name for s in full}
    assert len(names) == len(full)
    rq1 = [s for s in full if "RQ1" in s.questions]
    assert len(rq1) == 16 and mixed_precision.BASELINE in names
    assert {s.overrides["cache_size"] for s in full if "RQ3" in s.questions} == {
        0.005,
        0.01,
        0.02,
        0.05,
        0.1,
        0.2,
    }
    assert {s.overrides["policy"] for s in full if "RQ2" in s.questions} == {"lru", "lfu"}
    assert {s.overrides["rounding"] for s in full if "RQ4" in s.questions} == {"stochastic", "nearest"}
    assert next(s for s in full if s.name == "int8 5% lru").seeds == 3
    stale = slipstream.slipstream_grid(runner.PRESETS["full"], 2)
    assert len(stale) == 16 and {s.group for s in stale} == set(slipstream.STALE_STORAGES)
    assert {s.overrides.get("stale_rule") for s in stale} == {None, "paper", "convergence"}
    plan = runner.Plan(runner.PRESETS["full"], Path("x"), None, 3)
    ids = [c.id for c in plan.cells(full + stale)]
    assert len(ids) == len(set(ids)) and ids == [c.id for c in plan.cells(full + stale)]


def test_pareto_front() -> None:
    points = [(10.0, 0.0), (5.0, -0.001), (5.0, -0.003), (2.0, -0.002), (3.0, -0.004), (1.0, -0.01)]
    assert mixed_precision.pareto_front(points) == [5, 3, 1, 0]


@pytest.mark.slow
def test_all_quick_preset_as_ci_runs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slipcache experiment all --quick`, the preset itself (about 1.5 minutes on two idle cores)."""
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    run_study("all", "--quick", "--out", str(out))
    results = json.loads((out / "results.json").read_text())
    assert {c["experiment"] for c in results["cells"]} == {"mixed-precision", "slipstream"}
    report = (out / "report.md").read_text()
    for plot in MP_PLOTS + STALE_PLOTS:
        assert (out / plot).is_file() and plot in report


def test_out_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(SlipcacheError, match="exists and is not a directory"):
        studies.run_experiment(study_args("mixed-precision", "--out", str(tmp_path / "notes")))


def test_generator_choice_reaches_every_cell() -> None:
    """`experiment --generator v3` trains every cell on v3 data; its cells never pass for v5 ones."""
    grid = mixed_precision.mixed_precision_grid(runner.PRESETS["quick"], 1)
    plans = [runner.Plan(runner.PRESETS["quick"], Path("x"), None, 1, g) for g in ("v5", "v3")]
    v5, v3 = (plan.cells(grid) for plan in plans)
    assert {c.values["synthetic_generator"] for c in v5} == {"v5"}
    assert {c.values["synthetic_generator"] for c in v3} == {"v3"}
    assert not {c.id for c in v5} & {c.id for c in v3}


def test_bad_repeats_is_refused_before_any_data_is_prepared(tmp_path: Path) -> None:
    # Checked with the other flags: not after minutes of preprocessing `--data`.
    with pytest.raises(SlipcacheError, match="--repeats must be at least 1"):
        studies.run_experiment(study_args("slipstream", "--out", str(tmp_path / "out"),
                                          "--data", str(tmp_path / "none"), "--repeats", "0", *TINY))


def test_experiment_command_says_where_the_studies_are_when_they_are_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipcache import cli
    from slipcache.bench import experiment

    monkeypatch.setattr(experiment, "CHECKOUT", tmp_path)  # no benchmarks/ beside the package: a wheel
    assert cli.main(["experiment", "mixed-precision", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m benchmarks.studies" in err[0]
    assert not (tmp_path / "out").exists()


def test_experiment_command_runs_the_studies_apart_in_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`slipcache experiment` runs `python -m benchmarks.studies` in a child process: this process's import
    path is left alone, and a relative --out means the working directory's."""
    from slipcache import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("mine")
    path = list(sys.path)
    assert cli.main(["experiment", "mixed-precision", "--out", "notes"]) == 2
    assert sys.path == path
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists and is not a directory" in err[0] and "notes" in err[0]
    assert (tmp_path / "notes").read_text() == "mine"


def test_experiment_help_names_the_command_the_user_typed(capfd: pytest.CaptureFixture[str]) -> None:
    from slipcache import cli

    assert cli.main(["experiment", "--help"]) == 0  # printed by the child process the command runs
    out = capfd.readouterr().out
    assert out.startswith("usage: slipcache experiment ") and "benchmarks.studies" not in out
    assert cli.main(["experiment", "accuracy", "--out", "x", "--seeds", "many"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slipcache experiment: error: argument --seeds")


def test_quick_help_states_what_each_study_takes() -> None:
    """The --quick help gives each study's time from the estimate the study prints as it starts (the
    accuracy grid's 30 runs of 8 epochs took about 16 min: not "a few minutes")."""
    estimates = studies.quick_estimates()
    text = studies.quick_help()
    stated = {name: int(minutes) for minutes, name in re.findall(r"(\d+) min for ([a-z-]+)", text)}
    assert set(stated) == {"mixed-precision", "slipstream", "all", "accuracy"}
    for name, (_, seconds) in estimates.items():
        assert abs(stated[name] - seconds / 60) <= 0.5 or stated[name] == 1, name
    assert stated["all"] == stated["mixed-precision"] + stated["slipstream"]
    assert estimates["accuracy"][0] == 30 and 12 <= stated["accuracy"] <= 25 and "few minutes" not in text


def test_studies_module_entry_point_reports_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert studies.main(["mixed-precision", "--out", str(tmp_path / "out"), "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "benchmarks.studies: error: --threads must be at least 1, got 0"


def test_the_old_experiments_package_is_gone() -> None:
    """The benchmarks live in `slipcache.bench`, the studies in the checkout's `benchmarks/`: no alias left."""
    import importlib

    for old in ("slipcache.experiments", "slipcache.experiments.bench_cache", "slipcache.experiments.runner"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
