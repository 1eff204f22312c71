"""Studies that outlive a session: each arm x seed is one run directory, trained in a process of its own,
and every finished run is appended to committed JSON (`docs/studies/<study>.json`).

    python -m benchmarks.studies accuracy_at_scale --resume      # or another name in STUDIES

Two processes of one study may run side by side (one core each): each run is claimed with a lock in the
run root before it starts, so the second process takes the next unclaimed run.

Why this shape: at the papers' sizes one study takes many CPU hours, longer than a working session on
this kind of machine. So a run that finishes is recorded at once; a run cut off mid-way resumes from its
last checkpoint (the trainer's `--resume`); `--resume` skips every finished run. All runs of one study
run on the commit recorded when it started: when the checkout has moved on, the study's own commit is
unpacked into the run root and the study continues from there, so every paired seed runs the same code.
A new commit starts a new comparison only with `--restart`, which keeps the old file's runs out of it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slipcache.cache_dir import default_cache_root
from slipcache.errors import SlipcacheError
from slipcache.training.rundir import write_json

REPO = Path(__file__).resolve().parent.parent
STUDIES_DIR = REPO / "docs" / "studies"
PINNED_ENV = "SLIPCACHE_STUDY_PINNED"  # set in a study re-run from its own commit's source
FORMAT = "slipcache-study"


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict[str, Any]  # TrainConfig keys this arm sets on top of the study's
    seeds: int
    # A study on the same data and settings whose runs of this arm are this study's too (copied, not
    # trained again: a seed fixes the data order and the initial rows, so the pairs stay paired).
    borrowed_from: str | None = None


@dataclass(frozen=True)
class Study:
    """A grid of arms over paired seeds (a seed fixes the data order and the initial rows)."""

    name: str
    description: str
    data: dict[str, Any]  # synthetic dataset: generator, samples, scale (80/10/10 train/val/test)
    common: dict[str, Any]  # TrainConfig keys every run shares
    arms: tuple[Arm, ...]
    comparisons: tuple[tuple[str, str], ...]  # (arm, vs): paired differences reported
    metrics: tuple[str, ...] = ("test_auc", "test_logloss")
    time_to_target: bool = False  # CPU time until validation AUC reaches the baseline's final - 0.001
    extra: dict[str, Any] = field(default_factory=dict)

    def run_values(self, arm: Arm, seed: int) -> dict[str, Any]:
        return {
            "synthetic_generator": self.data["generator"],
            "synthetic_samples": self.data["samples"],
            "synthetic_scale": self.data["scale"],
            **self.common,
            **arm.overrides,
            "seed": seed,
            "progress": False,
            "threads": 1,
        }

    def runs(self) -> list[tuple[Arm, int]]:
        """Seed-major: a session cut short leaves whole seeds of every arm, so the pairs it has are usable."""
        return [
            (arm, seed)
            for seed in range(max(a.seeds for a in self.arms))
            for arm in self.arms
            if seed < arm.seeds
        ]


# The paper's DLRM on Criteo Kaggle (dim 16, bottom 512-256-64-16, top 512-256-1), one epoch in time order.
KAGGLE_DLRM = {
    "embedding_dim": 16,
    "bottom_mlp": [512, 256, 64, 16],
    "top_mlp": [512, 256, 1],
    "batch_size": 512,
    "lr": 0.3,
    "epochs": 1,
}

# Criteo Kaggle's length (45,840,617 rows) at its full cardinalities, 80/10/10 in time order: 36.7 M training
# rows, then 4.58 M of validation and 4.58 M of test. 16 evaluations on 500 k validation rows draw the curve.
KAGGLE_LOG = {"generator": "v5", "samples": 45_840_617, "scale": 1.0}
KAGGLE_LOG_RUN = {
    "eval_every": 2_292_031,
    "eval_samples": 500_000,
    "checkpoint_every": 9_168_124,
    "keep_checkpoints": 1,
}

# Which schedule converges in one epoch of the Kaggle-sized log? fp32, one seed per candidate; the chosen one
# (validation AUC gain <= 0.002 over the last quarter, test AUC within 0.01 of the k = 10 coverage ceiling)
# is the low-precision study's schedule. Row-wise Adagrad for the tables is TorchRec's and MLPerf's choice.
ROWWISE = {"optimizer": "rowwise_adagrad", "dense_lr": 0.3}
SCHEDULE_PILOT = Study(
    name="schedule_pilot",
    description="which schedule converges in one epoch of a Kaggle-sized log (36.7 M training rows, full "
    "Kaggle cardinalities, dim 16, fp32)",
    data=KAGGLE_LOG,
    common={**KAGGLE_DLRM, **KAGGLE_LOG_RUN, "precision": "fp32", "policy": "none"},
    arms=(
        Arm("rowwise-adagrad-0.1", {**ROWWISE, "lr": 0.1}, 1),
        Arm("rowwise-adagrad-0.02", {**ROWWISE, "lr": 0.02}, 1),
        Arm("sgd-0.3", {}, 1),
        Arm("rowwise-adagrad-0.1-mlperf", {**ROWWISE, "lr": 0.1, "lr_schedule": "mlperf"}, 1),
    ),
    comparisons=(),
)

ACCURACY_AT_SCALE = Study(
    name="accuracy_at_scale",
    description="low precision at the paper's scale: full Kaggle cardinalities (33,762,577 rows), dim 16, "
    "one epoch over 10 M time-ordered rows, tested on 1.25 M",
    data={"generator": "v5", "samples": 12_500_000, "scale": 1.0},
    common={
        **KAGGLE_DLRM,
        "eval_every": 2_500_000,
        "eval_samples": 250_000,
        "checkpoint_every": 2_500_000,
        "keep_checkpoints": 1,
    },
    arms=(
        Arm("fp32", {"precision": "fp32", "policy": "none"}, 5),
        Arm("int8-lru5", {"precision": "int8", "cache_size": 0.05, "policy": "lru"}, 5),
        Arm("int4-lru1", {"precision": "int4", "cache_size": 0.01, "policy": "lru"}, 5),
        Arm("fp16", {"precision": "fp16", "policy": "none"}, 3),
        Arm("int8", {"precision": "int8", "policy": "none"}, 3),
    ),
    comparisons=(("fp16", "fp32"), ("int8", "fp32"), ("int8-lru5", "fp32"), ("int4-lru1", "fp32")),
)

# Slipstream's decisive test: at the authors' schedule (cold inputs first, batch 1024, lr 0.01, one epoch), do
# stale inputs beat the same share skipped at random, and does freezing the stalest hot rows cost less than
# freezing a random half? Hot rows by frequency (looked up by >= 1e-4 of the profiled inputs): at 1.6 M
# rows no window inside one epoch gives the rarest row of a hot input 4 updates (it occurs once or twice in
# the whole split), so the rule is applied to the 5th percentile of the hot inputs' rows, which gets about
# 12 in a window of 25 % of the hot batches opened after 25 % of them.
STALE_WINDOW = {
    "stale_hot_set": "frequency",
    "stale_hot_rate": 1e-4,
    "stale_window_count": "hot",
    "stale_window_start": 0.25,
    "stale_window": 0.25,
    "stale_target": 0.5,
}
SLIPSTREAM_PAPER = Study(
    name="slipstream_paper",
    description="Slipstream on its authors' schedule: cold inputs first, then hot; window after 25 % of the hot "
    "batches for 25 % of them; D = 0.5; against random skipping and freezing",
    data={"generator": "v5", "samples": 2_000_000, "scale": 0.05},
    common={
        **KAGGLE_DLRM,
        "stale_preset": "paper",
        "input_order": "cold_first",
        "batch_size": 1024,
        "lr": 0.01,
        "precision": "fp32",
        "policy": "none",
        "eval_every": 80_000,
        "eval_samples": None,
        "checkpoint_every": 1 << 40,
        **STALE_WINDOW,
    },
    arms=(
        Arm("baseline", {}, 5),
        Arm("stale", {"skip_rule": "stale"}, 5),
        Arm("random", {"skip_rule": "random"}, 5),
        Arm("freeze-stalest", {"freeze_rows": "stalest"}, 5),
        Arm("freeze-random", {"freeze_rows": "random"}, 5),
    ),
    comparisons=(
        ("stale", "random"),
        ("stale", "baseline"),
        ("random", "baseline"),
        ("freeze-stalest", "baseline"),
        ("freeze-random", "baseline"),
        ("freeze-stalest", "freeze-random"),
    ),
    time_to_target=True,
)

# The schedule the pilot chose (docs/studies/schedule_pilot.json): the low-precision study trains with it.
CONVERGED = {**ROWWISE, "lr": 0.1}
CONVERGED_NAME = "rowwise-adagrad-0.1"

# Both papers' low-precision claims on the Kaggle-sized log at the converged schedule, with the controls that
# train every lookup in storage precision, and a positive control (INT4, round to nearest, no cache) that
# must show a loss for a "no loss" verdict to mean anything. Seed-major: seeds 0-2 of every arm come first.
ACCURACY_CONVERGED = Study(
    name="accuracy_converged",
    description="low precision on a Kaggle-sized log (36.7 M training rows, full Kaggle cardinalities, dim 16), "
    f"one epoch at the schedule the pilot chose ({CONVERGED_NAME}), tested on 4.58 M rows",
    data=KAGGLE_LOG,
    common={**KAGGLE_DLRM, **KAGGLE_LOG_RUN, **CONVERGED},
    arms=(
        Arm("fp32", {"precision": "fp32", "policy": "none"}, 5),
        Arm("int4-nearest", {"precision": "int4", "policy": "none", "rounding": "nearest"}, 3),
        Arm("int8-lru5", {"precision": "int8", "cache_size": 0.05, "policy": "lru"}, 5),
        Arm("int4-lru1", {"precision": "int4", "cache_size": 0.01, "policy": "lru"}, 5),
        Arm("int8", {"precision": "int8", "policy": "none"}, 3),
        Arm("int4", {"precision": "int4", "policy": "none"}, 3),
    ),
    comparisons=(
        ("int8-lru5", "fp32"), ("int4-lru1", "fp32"), ("int8", "fp32"), ("int4", "fp32"), ("int4-nearest", "fp32"),
        ("int4-nearest", "int4"),
    ),  # fmt: skip
    extra={"pilot": CONVERGED_NAME},
)

# Slipstream exactly as its authors ran it: the `paper` preset unmodified (budget hot set of 4.19 M rows at
# dim 16, all cold inputs first, window from hot batch 1,000 for 3 % of the hot batches, D = 0.3, an input
# skipped only when all 26 lookups are stale, batch 1024, one epoch, SGD at lr 0.01), on 10 M time-ordered
# rows at full Kaggle cardinalities; once at their learning rate and once at the converged schedule.
FULL_TABLES_10M = {"generator": "v5", "samples": 12_500_000, "scale": 1.0}
PAPER_SETTINGS = {
    # the preset's share of all rows (StalenessConfig.hot_rows rounds it): what 256 MB holds at dim 16
    "stale_hot_rows": round(0.1242 * 33_762_577),
    "window_start_batch": 1000,
    "window_share": 0.03,
    "stale_target": 0.3,
    "batch_size": 1024,
    "epochs": 1,
}


def slipstream_exact(name: str, schedule: dict[str, Any], description: str) -> Study:
    return Study(
        name=name,
        description="Slipstream with its authors' settings unmodified (the paper preset) on 10 M time-ordered "
        f"rows at full Kaggle cardinalities, {description}; against random skipping of the same share",
        data=FULL_TABLES_10M,
        common={
            **KAGGLE_DLRM,
            "stale_preset": "paper",
            "input_order": "cold_first",
            "precision": "fp32",
            "policy": "none",
            "eval_every": 500_000,
            "eval_samples": 250_000,
            "checkpoint_every": 2_500_000,
            "keep_checkpoints": 1,
            **schedule,
            "batch_size": 1024,
        },
        arms=(
            Arm("baseline", {}, 5),
            Arm("stale", {"skip_rule": "stale"}, 5),
            Arm("random", {"skip_rule": "random"}, 5),
            Arm("freeze-stalest", {"freeze_rows": "stalest"}, 3),
            Arm("freeze-random", {"freeze_rows": "random"}, 3),
        ),
        comparisons=(
            ("stale", "random"), ("stale", "baseline"), ("random", "baseline"),
            ("freeze-stalest", "baseline"), ("freeze-random", "baseline"), ("freeze-stalest", "freeze-random"),
        ),  # fmt: skip
        time_to_target=True,
        extra={"settings": {**PAPER_SETTINGS, "lr": schedule["lr"]}},
    )


SLIPSTREAM_LR001 = slipstream_exact("slipstream_exact_lr0.01", {"lr": 0.01}, "SGD at lr 0.01 (theirs)")
SLIPSTREAM_CONVERGED = slipstream_exact(
    "slipstream_exact_converged", CONVERGED, f"at the converged schedule ({CONVERGED_NAME})"
)

# Stale skipping lost to random skipping of the same share at the converged schedule, and the inputs it
# skipped were a group of their own (a label rate apart from the rest). The correction: train a random half
# of the would-be-skipped inputs anyway and count their loss twice, so the epoch's expected gradient is the
# one without skipping (an importance sample); against random skipping of that smaller share. The baseline,
# stale and random runs are the converged study's, copied by seed.
UNBIASED_KEEP = 0.5
# Random skips this share D of the hot inputs; at the converged schedule D = 0.3 skipped 16.7 % of all inputs
# (hot inputs: 55.7 %), and stale skipped 15.5 %, so half of stale's share is D = 0.139 of the hot inputs.
MATCHED_RANDOM_D = 0.14
SLIPSTREAM_UNBIASED = Study(
    name="slipstream_unbiased_converged",
    description="unbiased stale skipping (a random half of the would-be-skipped inputs trained anyway, their "
    "loss weighted 2) at the converged schedule, against random skipping of the same share; the paper "
    "preset otherwise, on the converged Slipstream study's data and seeds",
    data=SLIPSTREAM_CONVERGED.data,
    common=SLIPSTREAM_CONVERGED.common,
    arms=(
        *(Arm(a.name, a.overrides, 5, borrowed_from=SLIPSTREAM_CONVERGED.name)
          for a in SLIPSTREAM_CONVERGED.arms if a.name in ("baseline", "stale", "random")),
        # `stale_reweight` is a flag of the study's pinned commit only: the correction lost and left the product.
        Arm("stale-unbiased", {"skip_rule": "stale", "stale_keep": UNBIASED_KEEP, "stale_reweight": True}, 5),
        Arm("random-matched", {"skip_rule": "random", "stale_target": MATCHED_RANDOM_D}, 5),
    ),
    comparisons=(
        ("stale-unbiased", "random-matched"), ("stale-unbiased", "baseline"), ("random-matched", "baseline"),
        ("stale-unbiased", "stale"),
    ),  # fmt: skip
    time_to_target=True,
    extra={"settings": {**PAPER_SETTINGS, "lr": CONVERGED["lr"], "stale_keep": UNBIASED_KEEP,
                        "stale_reweight": True}},
)

STUDIES = {
    s.name: s
    for s in (SCHEDULE_PILOT, ACCURACY_CONVERGED, SLIPSTREAM_LR001, SLIPSTREAM_CONVERGED, SLIPSTREAM_UNBIASED,
              ACCURACY_AT_SCALE, SLIPSTREAM_PAPER)
}


# ------------------------------------------------------------------------------------------ statistics
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def t_interval(diffs: list[float]) -> tuple[float, list[float] | None]:
    """Mean and two-sided 95 % t interval of paired differences (None below two pairs)."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, None
    half = T95.get(len(diffs) - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, [mean - half, mean + half]


def comparisons(study: Study, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mean(arm - vs) over the seeds both arms finished, with its 95 % CI, per metric."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    out = []
    metrics = (*study.metrics, *(("cpu_s_to_target_ratio",) if study.time_to_target else ()))
    for arm, vs in study.comparisons:
        seeds = sorted({s for a, s in by if a == arm} & {s for a, s in by if a == vs})
        for metric in metrics:
            diffs = [
                by[arm, s][metric] - by[vs, s][metric]
                for s in seeds
                if by[arm, s].get(metric) is not None and by[vs, s].get(metric) is not None
            ]
            if not diffs:
                continue
            mean, ci = t_interval(diffs)
            out.append(
                {"arm": arm, "vs": vs, "metric": metric, "n": len(diffs), "mean_diff": mean, "ci95": ci}
            )
    return out


def time_to_target(curve: list[list[float]], target: float) -> float | None:
    """CPU seconds of training until the first evaluation at or above `target` (None: never reached)."""
    return next((cpu for cpu, _, auc in curve if auc >= target), None)


def add_time_to_target(runs: list[dict[str, Any]], baseline: str = "baseline") -> None:
    """Per run: CPU time to the paired baseline's final validation AUC - 0.001, and baseline's / this run's."""
    base = {r["seed"]: r for r in runs if r["arm"] == baseline}
    for run in runs:
        ref = base.get(run["seed"])
        if ref is None or not ref.get("curve") or not run.get("curve"):
            continue
        target = ref["curve"][-1][2] - 0.001
        mine, theirs = time_to_target(run["curve"], target), time_to_target(ref["curve"], target)
        run["cpu_s_to_target"] = mine
        run["cpu_s_to_target_ratio"] = theirs / mine if mine and theirs else None


# --------------------------------------------------------------------------------------------- records
def git_commit(root: Path = REPO) -> tuple[str, bool]:
    """(HEAD's commit, whether src/ or benchmarks/ differ from it)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], check=True, capture_output=True, text=True
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--", "src", "benchmarks").strip())
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SlipcacheError(f"the studies run from a git checkout of slipcache ({exc})") from exc
    return commit, dirty


def run_record(study: Study, arm: Arm, seed: int, run_dir: Path, child: dict[str, Any]) -> dict[str, Any]:
    """One finished run as the study file keeps it."""
    summary = json.loads((run_dir / "summary.json").read_text())
    stats = summary.get("embedding_stats") or {}
    precision = study.run_values(arm, seed).get("precision", "int8")
    hit = summary.get("cache_hit_rate")
    staleness = summary.get("staleness") or {}
    return {
        "arm": arm.name,
        "seed": seed,
        "commit": child["commit"],
        "run_dir": run_dir.name,
        "test_auc": summary["auc"],
        "test_logloss": summary["logloss"],
        "hit_rate": hit,
        # Lookups whose row is read from and written back to low-precision storage (not the fp32 cache).
        "storage_update_share": None if precision == "fp32" else 1.0 - (hit or 0.0),
        "embedding_bytes": summary["embedding_bytes"],
        "memory_ratio": summary["memory_ratio"],
        "samples_per_s": summary["samples_per_s"],
        "train_samples": summary["train_samples"],
        "cpu_s": summary["train_cpu_s"],
        "run_cpu_s": child["cpu_s"],
        "peak_rss_bytes": child["peak_rss_bytes"],
        "skipped_fraction": summary.get("skipped_fraction"),
        "staleness": staleness or None,
        # Slipstream: how many rows were hot and stayed live, and whether the skipped inputs were a skewed group
        "hot_rows": staleness.get("hot_rows"),
        "nonstale_rows": staleness.get("nonstale_hot_rows"),
        "skipped_label_rate": staleness.get("skipped_label_rate"),
        "kept_label_rate": staleness.get("kept_label_rate"),
        "calibration": staleness.get("calibration"),
        "overflow_rows": stats.get("overflow_rows"),
        "curve": (curve := eval_curve(run_dir / "metrics.jsonl")),
        "val_auc_gain_last_quarter": gain_last_quarter(curve),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def eval_curve(metrics: Path) -> list[list[float]]:
    """[training CPU seconds, samples, validation AUC] at each evaluation."""
    curve = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        event = json.loads(line) if line.strip() else {}
        if event.get("val_auc") is not None and event.get("train_cpu_s") is not None:
            curve.append([float(event["train_cpu_s"]), int(event.get("samples", 0)), float(event["val_auc"])])
    return curve


def gain_last_quarter(curve: list[list[float]]) -> float | None:
    """Validation AUC at the end minus at 3/4 of the run's samples (linear between evaluations): how much the
    model still learned in its last quarter. None without evaluations on both sides of the 3/4 mark."""
    if len(curve) < 2:
        return None
    mark = 0.75 * curve[-1][1]
    for (_, s0, a0), (_, s1, a1) in zip(curve, curve[1:], strict=False):
        if s0 <= mark <= s1:
            at_mark = a0 if s1 == s0 else a0 + (a1 - a0) * (mark - s0) / (s1 - s0)
            return curve[-1][2] - at_mark
    return None


def pilot_block(arm: str) -> dict[str, Any]:
    """What the schedule pilot found for the schedule a study trains with (docs/studies/schedule_pilot.json)."""
    pilot = json.loads((STUDIES_DIR / f"{SCHEDULE_PILOT.name}.json").read_text())
    run = next(r for r in pilot["runs"] if r["arm"] == arm)
    return {"schedule": arm, "overrides": pilot["arms"][arm]["overrides"],
            "val_auc_gain_last_quarter": run["val_auc_gain_last_quarter"], "test_auc": run["test_auc"]}


def empty_file(study: Study, commit: str) -> dict[str, Any]:
    from slipcache.bench.machine import describe_machine
    from slipcache.data.synthetic import synthetic_table_sizes
    from slipcache.data.synthetic.generate import split_bounds

    bounds = split_bounds(study.data["samples"], 0.1, 0.1, "slipcache")
    rows = {name: end - start for name, (start, end) in bounds.items()}
    return {
        "format": FORMAT,
        "study": study.name,
        "description": study.description,
        "command": f"python -m benchmarks.studies {study.name} --resume",
        "commit": commit,
        "machine": describe_machine(),
        "date": datetime.now(UTC).date().isoformat(),
        "data": {
            "generator": study.data["generator"],
            "table_rows": sum(synthetic_table_sizes(study.data["scale"])),
            "scale": study.data["scale"],
            "train_rows": rows["train"],
            "val_rows": rows["val"],
            "test_rows": rows["test"],
            "epochs": study.common.get("epochs", 1),
        },
        "settings": {**study.common, **study.extra.get("settings", {})},
        **({"pilot": pilot_block(study.extra["pilot"])} if "pilot" in study.extra else {}),
        "arms": {
            a.name: {"overrides": a.overrides, "seeds": a.seeds}
            | ({"borrowed_from": a.borrowed_from} if a.borrowed_from else {})
            for a in study.arms
        },
        "runs": [],
        "comparisons": [],
    }


def update_file(path: Path, study: Study, record: dict[str, Any]) -> dict[str, Any]:
    """Add (or replace) one run, recompute the comparisons, write atomically."""
    results = json.loads(path.read_text())
    results["runs"] = [r for r in results["runs"] if (r["arm"], r["seed"]) != (record["arm"], record["seed"])]
    results["runs"].append(record)
    results["runs"].sort(key=lambda r: (r["seed"], [a.name for a in study.arms].index(r["arm"])))
    if study.time_to_target:
        add_time_to_target(results["runs"])
    results["comparisons"] = comparisons(study, results["runs"])
    results["updated"] = datetime.now(UTC).isoformat(timespec="seconds")
    write_json(path, results)
    return results


def borrowed_record(study: Study, arm: Arm, seed: int, out_file: Path) -> dict[str, Any] | None:
    """This arm x seed as the study it is borrowed from recorded it, or None while that study has not.

    Refused in one line when the two studies do not share their data and settings: a copied run would not
    be paired with this study's own."""
    assert arm.borrowed_from is not None
    other_file = out_file.parent / f"{arm.borrowed_from}.json"
    if not other_file.is_file():
        return None
    other = json.loads(other_file.read_text())
    other_study = STUDIES[arm.borrowed_from]
    mine = study.run_values(arm, seed)
    theirs = other_study.run_values(next(a for a in other_study.arms if a.name == arm.name), seed)
    if mine != theirs:
        differ = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
        raise SlipcacheError(
            f"{study.name}: {arm.name} is borrowed from {arm.borrowed_from}, whose runs differ in "
            f"{', '.join(differ)}: train it here instead (drop borrowed_from)"
        )
    record = next((r for r in other["runs"] if (r["arm"], r["seed"]) == (arm.name, seed)), None)
    return None if record is None else {**record, "borrowed_from": arm.borrowed_from}


# ---------------------------------------------------------------------------------------------- running
class RunFailed(SlipcacheError):
    """A run the trainer stopped with its own error (a diverged loss): its record says why."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def run_one(
    study: Study, arm: Arm, seed: int, run_dir: Path, source: Path, commit: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """Train one arm x seed in a child process (its own peak memory and CPU time) on the study's commit,
    unpacked at `source`, so later edits of the checkout never reach a run; resume it if cut off."""
    from benchmarks.freezing import SETTINGS as FREEZING_SETTINGS

    values = study.run_values(arm, seed)
    research = {key: values.pop(key) for key in FREEZING_SETTINGS if key in values}  # a research arm's own
    resuming = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    if not resuming and run_dir.exists():
        shutil.rmtree(run_dir)  # started but never checkpointed: start over
    spec = {"values": values, "research": research, "out": str(run_dir), "resume": resuming}
    code = (
        "import json, resource, sys, time\n"
        "from slipcache.training.config import make_config\n"
        "from slipcache.training.trainer import TrainConfig, train\n"
        "spec = json.loads(sys.argv[1])\n"
        "extra = []\n"
        "if spec['research']:  # freezing rows: research beside the product, passed again on a resume\n"
        "    from benchmarks.freezing import freezing_arm\n"
        "    extra = [freezing_arm(**spec['research'])]\n"
        "cpu = time.process_time()\n"
        "if spec['resume']:\n"
        "    config = TrainConfig.from_flat({'resume': spec['out'], 'progress': False, 'threads': 1})\n"
        "else:\n"
        "    config = make_config({}, {**spec['values'], 'out': spec['out']})  # as flags: presets apply\n"
        "train(config, extra_callbacks=extra)\n"
        "print(json.dumps({'cpu_s': time.process_time() - cpu,"
        " 'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))\n"
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(source / "src"), str(source)]),
    }
    log(f"{study.name}: {arm.name} seed {seed} {'resumes' if resuming else 'starts'} in {run_dir}")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        if done.returncode < 0 or "SlipcacheError" not in tail[0]:  # killed, or a crash: nothing to record
            raise SlipcacheError(
                f"{arm.name} seed {seed} failed (exit {done.returncode}): {tail[0]}; its run "
                f"directory {run_dir} is kept for a look, and --resume continues it"
            )
        raise RunFailed(
            f"{study.name}: {arm.name} seed {seed} stopped: {tail[0]} (recorded as failed; its run directory "
            f"{run_dir} is kept)",
            {"arm": arm.name, "seed": seed, "commit": commit, "run_dir": run_dir.name, "test_auc": None,
             "test_logloss": None, "failed": tail[0].removeprefix("slipcache.errors.SlipcacheError: "),
             "curve": eval_curve(run_dir / "metrics.jsonl"),
             "finished": datetime.now(UTC).isoformat(timespec="seconds")},
        )
    child = json.loads(done.stdout.strip().splitlines()[-1])
    child["commit"] = commit
    record = run_record(study, arm, seed, run_dir, child)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 0.6-2.2 GB each at full size
    (run_dir / "finished.json").write_text(json.dumps(record, indent=2) + "\n")
    log(
        f"{study.name}: {arm.name} seed {seed} done in {time.perf_counter() - start:.0f} s: test AUC "
        f"{record['test_auc']:.4f}, {record['samples_per_s']:.0f} samples/s, "
        f"peak {child['peak_rss_bytes'] / 2**30:.1f} GiB"
    )
    return record


def pinned_source(commit: str, root: Path) -> Path:
    """The study's commit unpacked under the run root (once), to continue the study on its own code."""
    source = root / f"source-{commit[:12]}"
    if not (source / "src" / "slipcache").is_dir():
        tmp = root / f".source-{commit[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.replace(source)
    return source


def run_study(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    study = STUDIES[args.name]
    out_file = Path(args.json) if args.json else STUDIES_DIR / f"{study.name}.json"
    root = Path(args.out) if args.out else default_cache_root() / "studies" / study.name
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise SlipcacheError(f"--out {root} must be a directory (not a link)")
    root.mkdir(parents=True, exist_ok=True)
    # Re-run from the study's unpacked commit (no git there): that commit is the one to record.
    commit, dirty = (os.environ[PINNED_ENV], False) if os.environ.get(PINNED_ENV) else git_commit()
    if out_file.is_file():
        if not args.resume and not args.restart:
            raise SlipcacheError(
                f"{out_file} holds this study's runs: add --resume to continue it (or --restart "
                "to begin a new comparison on this commit)"
            )
        if not args.restart and "ceiling" not in json.loads(out_file.read_text()):
            add_ceiling(out_file, study, root, log)  # on this checkout's code: the study's own commit may predate it
        pinned = json.loads(out_file.read_text()).get("commit")
        if args.restart:
            out_file.unlink()
        elif pinned != commit and os.environ.get(PINNED_ENV) != pinned:
            source = pinned_source(pinned, root)
            log(
                f"{study.name}: the study runs on its commit {pinned[:12]} (this checkout is at {commit[:12]}); "
                f"continuing from {source}"
            )
            argv = [
                sys.executable,
                "-m",
                "benchmarks.studies",
                study.name,
                "--resume",
                "--json",
                str(out_file.resolve()),
                "--out",
                str(root.resolve()),
            ] + (["--max-runs", str(args.max_runs)] if args.max_runs else [])
            env = {
                **os.environ,
                PINNED_ENV: pinned,
                "PYTHONPATH": os.pathsep.join([str(source / "src"), str(source)]),
            }
            return subprocess.run(argv, cwd=source, env=env).returncode
        else:
            commit = pinned
    if not out_file.is_file():
        if dirty:
            raise SlipcacheError(
                "src/ or benchmarks/ has uncommitted changes: commit them first, so every run "
                "records the code it ran"
            )
        out_file.parent.mkdir(parents=True, exist_ok=True)
        write_json(out_file, empty_file(study, commit))
        add_ceiling(out_file, study, root, log)
    results = json.loads(out_file.read_text())
    done = {(r["arm"], r["seed"]) for r in results["runs"]}
    todo = [(arm, seed) for arm, seed in study.runs() if (arm.name, seed) not in done]
    log(f"{study.name}: {len(done)} runs finished, {len(todo)} to go; runs in {root}, results in {out_file}")
    if todo:
        prepare_data(study, log)
        source = pinned_source(commit, root)
    ran = 0
    for arm, seed in todo:
        if args.max_runs and ran >= args.max_runs:
            break
        with claimed(root / f".{arm.name}-s{seed}.claim") as mine:
            finished = {(r["arm"], r["seed"]) for r in json.loads(out_file.read_text())["runs"]}
            if not mine or (arm.name, seed) in finished:
                continue  # another process of this study runs it, or has finished it meanwhile
            try:
                if arm.borrowed_from:
                    record = borrowed_record(study, arm, seed, out_file)
                    if record is None:
                        log(f"{study.name}: {arm.name} seed {seed} waits for {arm.borrowed_from} to finish it "
                            "(a later --resume takes it)")
                        continue
                    log(f"{study.name}: {arm.name} seed {seed} taken from {arm.borrowed_from}")
                else:
                    record = run_one(study, arm, seed, root / f"{arm.name}-s{seed}", source, commit, log)
            except RunFailed as failure:  # a diverged run is a result too: recorded, and the study goes on
                log(str(failure))
                record = failure.record
            with claimed(root / ".results.lock", wait=True):
                results = update_file(out_file, study, record)
            ran += 1
        for c in results["comparisons"]:
            if c["arm"] == arm.name and c["metric"] == "test_auc":
                ci = "" if c["ci95"] is None else f" [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]"
                log(f"  {c['arm']} - {c['vs']}: AUC {c['mean_diff']:+.4f}{ci} over {c['n']} seeds")
    return 0


@contextlib.contextmanager
def claimed(path: Path, *, wait: bool = False) -> Iterator[bool]:
    """An exclusive lock on `path` while the block runs: True when this process holds it, False when another
    does (with `wait`, block until it is free). Released with the process, however it ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def add_ceiling(out_file: Path, study: Study, root: Path, log: Callable[[str], None]) -> None:
    """Record the best AUC a model can reach on the study's test split (`stats --ceiling`), once per file;
    taken from another study file on the same data where one has it."""
    from slipcache.data.synthetic import default_synthetic_path
    from slipcache.data.synthetic.regenerate import dataset_ceiling

    ceiling = None
    for other in sorted(STUDIES_DIR.glob("*.json")):
        known = json.loads(other.read_text())
        if known.get("ceiling") and known.get("data_spec") == study.data:
            ceiling = known["ceiling"]
            break
    if ceiling is None:
        log(f"{study.name}: computing the ceiling of its data (the teacher's AUC and the coverage ceilings)")
        path = default_synthetic_path(None, study.data["samples"], study.data["scale"], 0,
                                      generator=study.data["generator"])
        ceiling = dataset_ceiling(path, progress=False)
    with claimed(root / ".results.lock", wait=True):
        results = json.loads(out_file.read_text())
        results.update(ceiling=ceiling, data_spec=study.data)
        write_json(out_file, results)
    log(f"{study.name}: ceiling: teacher {ceiling['teacher_auc']:.4f}, coverage "
        + ", ".join(f"k = {k} {v:.4f}" for k, v in ceiling["coverage_auc"].items()))


def prepare_data(study: Study, log: Callable[[str], None]) -> None:
    """Generate the synthetic dataset before the first run, so no run's time includes it."""
    from slipcache.data.synthetic import default_synthetic_path

    log(
        f"{study.name}: data: generator {study.data['generator']}, {study.data['samples']:,} rows, scale "
        f"{study.data['scale']:g} (generated once into the cache)"
    )
    default_synthetic_path(
        None, study.data["samples"], study.data["scale"], 0, generator=study.data["generator"]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the study: finished runs are skipped, a run cut off resumes from its checkpoint",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="begin a new comparison on this commit (the study file's earlier runs are dropped)",
    )
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    parser.add_argument("--json", default=None, help="the study file (default docs/studies/<study>.json)")
