"""Studies that outlive a session: one run directory per arm x seed, finished runs skipped on --resume,
each finished run appended to the study file with paired comparisons and their t intervals."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest

from benchmarks import long_studies
from benchmarks.long_studies import Arm, Study
from slipcache.errors import SlipcacheError

TINY = Study(
    name="tiny",
    description="two arms, two seeds, a few thousand rows",
    data={"generator": "v5", "samples": 6000, "scale": 0.001},
    common={"batch_size": 256, "epochs": 1, "eval_every": 2400, "eval_samples": None,
            "bottom_mlp": [16, 8], "top_mlp": [16, 1], "embedding_dim": 8},
    arms=(Arm("fp32", {"precision": "fp32", "policy": "none"}, 2),
          Arm("int8", {"precision": "int8", "policy": "none"}, 2)),
    comparisons=(("int8", "fp32"),),
)


def test_t_interval_is_the_two_sided_95_percent_interval() -> None:
    mean, ci = long_studies.t_interval([0.001, 0.003, 0.002])
    half = 4.303 * 0.001 / math.sqrt(3)  # t(2) * sd / sqrt(n)
    assert mean == pytest.approx(0.002) and ci == pytest.approx([0.002 - half, 0.002 + half])
    assert long_studies.t_interval([0.5]) == (0.5, None)


def test_comparisons_pair_by_seed_and_skip_unpaired_runs() -> None:
    runs = [{"arm": a, "seed": s, "test_auc": auc, "test_logloss": 0.5}
            for a, s, auc in (("fp32", 0, 0.70), ("int8", 0, 0.69), ("fp32", 1, 0.80), ("int8", 1, 0.78),
                              ("int8", 2, 0.10))]
    auc = next(c for c in long_studies.comparisons(TINY, runs) if c["metric"] == "test_auc")
    assert auc["n"] == 2 and auc["mean_diff"] == pytest.approx(-0.015)  # seed 2 has no fp32 partner


def test_time_to_target_reads_the_baselines_final_auc() -> None:
    runs = [{"arm": "baseline", "seed": 0, "curve": [[10.0, 1, 0.70], [20.0, 2, 0.75]]},
            {"arm": "stale", "seed": 0, "curve": [[5.0, 1, 0.749], [8.0, 2, 0.76]]}]
    long_studies.add_time_to_target(runs)
    assert runs[1]["cpu_s_to_target"] == 5.0 and runs[1]["cpu_s_to_target_ratio"] == pytest.approx(4.0)
    assert runs[0]["cpu_s_to_target_ratio"] == 1.0


@pytest.mark.slow
def test_study_runs_each_arm_and_seed_once_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(long_studies.STUDIES, "tiny", TINY)
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(long_studies, "git_commit", lambda: ("c0ffee" * 6 + "abcd", False))
    monkeypatch.setattr(long_studies, "pinned_source", lambda commit, root: long_studies.REPO)
    out, root = tmp_path / "tiny.json", tmp_path / "runs"
    args = argparse.Namespace(name="tiny", json=str(out), out=str(root), resume=False, restart=False, max_runs=3)
    lines: list[str] = []
    assert long_studies.run_study(args, lines.append) == 0
    results = json.loads(out.read_text())
    assert [(r["arm"], r["seed"]) for r in results["runs"]] == [("fp32", 0), ("int8", 0), ("fp32", 1)]
    assert results["data"]["train_rows"] == 4800 and results["data"]["test_rows"] == 600
    for run in results["runs"]:
        assert 0.0 < run["test_auc"] < 1.0 and run["commit"].startswith("c0ffee") and run["peak_rss_bytes"] > 0
        assert len(run["curve"]) >= 2 and not (root / run["run_dir"] / "checkpoints").exists()
    assert results["runs"][1]["storage_update_share"] == 1.0 and results["runs"][0]["storage_update_share"] is None
    with pytest.raises(SlipcacheError, match="--resume"):
        long_studies.run_study(args, lines.append)
    # A run cut off before its first checkpoint starts over; the finished ones are not run again.
    (root / "int8-s1").mkdir()
    args.resume, args.max_runs = True, None
    lines.clear()
    assert long_studies.run_study(args, lines.append) == 0
    assert lines[0].startswith("tiny: 3 runs finished, 1 to go")
    results = json.loads(out.read_text())
    assert len(results["runs"]) == 4
    [auc] = [c for c in results["comparisons"] if c["metric"] == "test_auc"]
    diffs = [next(r["test_auc"] for r in results["runs"] if (r["arm"], r["seed"]) == ("int8", s))
             - next(r["test_auc"] for r in results["runs"] if (r["arm"], r["seed"]) == ("fp32", s)) for s in (0, 1)]
    assert auc["n"] == 2 and auc["mean_diff"] == pytest.approx(sum(diffs) / 2) and auc["ci95"][0] <= auc["mean_diff"]
    shutil.rmtree(root)


def test_a_moved_checkout_continues_on_the_studys_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When HEAD is not the study's commit, the study re-runs itself from that commit's unpacked source."""
    out = tmp_path / "tiny.json"
    out.write_text(json.dumps({"commit": "a" * 40, "runs": [], "ceiling": None}))
    monkeypatch.setitem(long_studies.STUDIES, "tiny", TINY)
    monkeypatch.delenv(long_studies.PINNED_ENV, raising=False)
    monkeypatch.setattr(long_studies, "git_commit", lambda: ("b" * 40, False))
    monkeypatch.setattr(long_studies, "pinned_source", lambda commit, root: tmp_path / f"source-{commit[:12]}")
    calls = []
    monkeypatch.setattr(long_studies.subprocess, "run",
                        lambda argv, cwd, env: calls.append((argv, cwd, env)) or argparse.Namespace(returncode=0))
    args = argparse.Namespace(name="tiny", json=str(out), out=str(tmp_path / "runs"), resume=True, restart=False,
                              max_runs=None)
    assert long_studies.run_study(args, lambda line: None) == 0
    [(argv, cwd, env)] = calls
    assert cwd == tmp_path / "source-aaaaaaaaaaaa" and env[long_studies.PINNED_ENV] == "a" * 40
    assert argv[2:5] == ["benchmarks.studies", "tiny", "--resume"] and str(out.resolve()) in argv
    assert env["PYTHONPATH"].startswith(str(tmp_path / "source-aaaaaaaaaaaa" / "src"))


def test_a_claimed_run_is_skipped_by_a_second_process(tmp_path: Path) -> None:
    """Two processes of one study split its runs: a run's claim is held while it trains."""
    path = tmp_path / ".fp32-s0.claim"
    with long_studies.claimed(path) as first, long_studies.claimed(path) as second:
        assert first and not second
    with long_studies.claimed(tmp_path / ".fp32-s0.claim") as again:
        assert again  # released when the first block ended


def test_gain_over_the_last_quarter_interpolates_between_evaluations() -> None:
    curve = [[1.0, 0, 0.60], [2.0, 500, 0.70], [3.0, 1000, 0.74]]
    assert long_studies.gain_last_quarter(curve) == pytest.approx(0.74 - 0.72)  # 0.72 at sample 750
    assert long_studies.gain_last_quarter(curve[:1]) is None


def test_a_run_the_trainer_stops_is_recorded_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A diverged run is a result (the study goes on); a crash or a kill is not, and stops the study."""
    stderr = "Traceback ...\nslipcache.errors.SlipcacheError: training loss is nan at sample 1452032"
    monkeypatch.setattr(long_studies.subprocess, "run",
                        lambda *a, **k: argparse.Namespace(returncode=1, stderr=stderr, stdout=""))
    arm = TINY.arms[1]
    with pytest.raises(long_studies.RunFailed) as failed:
        long_studies.run_one(TINY, arm, 0, tmp_path / "int8-s0", tmp_path, "c" * 40, lambda line: None)
    record = failed.value.record
    assert (record["arm"], record["seed"], record["test_auc"]) == ("int8", 0, None)
    assert record["failed"].startswith("training loss is nan")
    monkeypatch.setattr(long_studies.subprocess, "run",
                        lambda *a, **k: argparse.Namespace(returncode=-9, stderr="", stdout=""))
    with pytest.raises(SlipcacheError, match="--resume continues it") as crashed:
        long_studies.run_one(TINY, arm, 0, tmp_path / "int8-s0", tmp_path, "c" * 40, lambda line: None)
    assert not isinstance(crashed.value, long_studies.RunFailed)


def test_a_diverged_run_the_pinned_orchestrator_stopped_on_is_recorded_once(tmp_path: Path) -> None:
    from benchmarks import long_studies
    from benchmarks.record_divergence import record_divergence

    study = long_studies.STUDIES["accuracy_converged"]
    out_file = tmp_path / "study.json"
    out_file.write_text(json.dumps({"commit": "f" * 40, "runs": [], "comparisons": []}))
    (tmp_path / "int4-nearest-s1").mkdir()
    (tmp_path / "int4-nearest-s1" / "metrics.jsonl").write_text(
        json.dumps({"event": "eval", "samples": 512, "train_cpu_s": 3.0, "val_auc": 0.61}) + "\n")
    log = tmp_path / "study.log"
    log.write_text(
        "accuracy_converged: int4-nearest seed 1 starts in ...\n"
        "benchmarks.studies: error: int4-nearest seed 1 failed (exit 1): slipcache.errors.SlipcacheError: "
        "training loss is nan at sample 1038848 (epoch 0, batch 2029); stopped. Check the input data\n")
    record = record_divergence(study.name, log, tmp_path, out_file)
    assert record["failed"] == "training loss is nan at sample 1038848 (epoch 0, batch 2029): the run diverged"
    assert record["curve"] == [[3.0, 512, 0.61]] and record["test_auc"] is None
    assert [r["arm"] for r in json.loads(out_file.read_text())["runs"]] == ["int4-nearest"]
    with pytest.raises(SlipcacheError, match="recorded .* already"):
        record_divergence(study.name, log, tmp_path, out_file)
    log.write_text("benchmarks.studies: error: int8 seed 1 failed (exit -9): killed\n")
    with pytest.raises(SlipcacheError, match="not a diverged run"):
        record_divergence(study.name, log, tmp_path, out_file)


def test_a_borrowed_arm_is_copied_by_seed_and_waits_for_runs_not_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study on another's data and settings copies that study's runs of an arm instead of training them."""
    fp32 = TINY.arms[0]
    borrow = Study(name="borrow", description="int4 against tiny's fp32", data=TINY.data, common=TINY.common,
                   arms=(Arm("fp32", fp32.overrides, 2, borrowed_from="tiny"),
                         Arm("int4", {"precision": "int4", "policy": "none"}, 2)),
                   comparisons=(("int4", "fp32"),))
    monkeypatch.setitem(long_studies.STUDIES, "tiny", TINY)
    monkeypatch.setitem(long_studies.STUDIES, "borrow", borrow)
    commit = "c0ffee" * 6 + "abcd"
    monkeypatch.setattr(long_studies, "git_commit", lambda: (commit, False))
    monkeypatch.setattr(long_studies, "pinned_source", lambda commit, root: long_studies.REPO)
    monkeypatch.setattr(long_studies, "prepare_data", lambda study, log: None)
    trained: list[tuple[str, int]] = []

    def fake_run(study: Study, arm: Arm, seed: int, *rest: object) -> dict[str, object]:
        trained.append((arm.name, seed))
        return {"arm": arm.name, "seed": seed, "test_auc": 0.70 + seed / 100, "test_logloss": 0.5}

    monkeypatch.setattr(long_studies, "run_one", fake_run)
    tiny_run = {"arm": "fp32", "seed": 0, "test_auc": 0.72, "test_logloss": 0.49, "run_dir": "fp32-s0"}
    (tmp_path / "tiny.json").write_text(json.dumps({"commit": "a" * 40, "runs": [tiny_run]}))
    out = tmp_path / "borrow.json"
    out.write_text(json.dumps({"commit": commit, "runs": [], "ceiling": None}))
    args = argparse.Namespace(name="borrow", json=str(out), out=str(tmp_path / "runs"), resume=True,
                              restart=False, max_runs=None)
    lines: list[str] = []
    assert long_studies.run_study(args, lines.append) == 0
    assert trained == [("int4", 0), ("int4", 1)]  # fp32 is never trained here
    runs = {(r["arm"], r["seed"]): r for r in json.loads(out.read_text())["runs"]}
    assert runs["fp32", 0] == {**tiny_run, "borrowed_from": "tiny"} and ("fp32", 1) not in runs
    assert "borrow: fp32 seed 1 waits for tiny to finish it (a later --resume takes it)" in lines
    [auc] = [c for c in json.loads(out.read_text())["comparisons"] if c["metric"] == "test_auc"]
    assert auc["n"] == 1 and auc["mean_diff"] == pytest.approx(0.70 - 0.72)
    # A study whose settings differ from the one it borrows from would pair runs that are not pairs.
    other = Study(name="borrow", description="", data=TINY.data, common={**TINY.common, "batch_size": 128},
                  arms=borrow.arms, comparisons=borrow.comparisons)
    monkeypatch.setitem(long_studies.STUDIES, "borrow", other)
    with pytest.raises(SlipcacheError, match="whose runs differ in batch_size: train it here instead"):
        long_studies.run_study(args, lines.append)
