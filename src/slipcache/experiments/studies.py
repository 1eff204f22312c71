"""`slipcache experiment`: the two papers' questions as grids of training runs, and a report answering them.

Mixed precision (Yang et al., arXiv 2010.11305) and Slipstream stale-input skipping (Maboud et al.,
arXiv 2404.04270) each become a grid of *setups* (one `TrainConfig` variant each), run over seeds as
*cells* (setup x seed) through `slipcache.training.trainer.train`. The output directory:

    DIR/cells/<cell-id>/   one training run directory (summary.json, metrics.jsonl, ...) plus cell.json,
                           written last: a cell with cell.json is done and never run again; one
                           without it (a crash) is deleted and rerun from scratch
    DIR/results.json       every cell (config, seed, summary, embedding traffic), mean/std per setup,
                           the machine description and memory probes
    DIR/report.md          tables, plots (*.png) and a generated answer per research question

The cell id holds a hash of the run's whole config, so changing a preset or an option makes new cells
instead of silently reusing results of a different run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from slipcache.data.synthetic import DEFAULT_GENERATOR, GENERATOR_VERSIONS
from slipcache.errors import SlipcacheError
from slipcache.training import trainer
from slipcache.training.trainer import write_json

EXPERIMENTS = ("mixed-precision", "slipstream")
ACCURACY = "accuracy"  # the settled accuracy claim (issue 9): a few setups, many paired seeds, whole epochs
NAMES = (*EXPERIMENTS, ACCURACY, "all")  # "all" runs EXPERIMENTS; the accuracy study is run on its own
RESULTS_FORMAT = "slipcache-experiments"
RESULTS_VERSION = 1
BASELINE = "fp32 no cache"  # the mixed-precision reference setup
CACHE_LINE = 64  # bytes; a random row access costs at least one line
# Headline numbers of the papers, compared against in the report.
PAPER = {
    "int8_5_memory_ratio": 3.0,
    "int4_1_memory_ratio": 7.0,
    "cache_speedup": 1.16,
    "skip_speedup_vs_xdl": 2.0,
    "skip_speedup_vs_fae": 1.2,
}


# ----------------------------------------------------------------------------------------------------
# Presets and grids


@dataclass(frozen=True)
class Preset:
    """Data and run sizes. Full: ~25 min (mixed precision) + ~15 min (slipstream) on 2 busy cores."""

    name: str
    scale: float  # synthetic table sizes relative to Criteo Kaggle
    dataset_samples: int  # mixed precision: synthetic rows (80 % train)
    train_samples: int  # mixed precision: samples per run
    stale_dataset_samples: int  # slipstream: synthetic rows (80 % train)
    stale_epochs: int  # slipstream: passes over the training split
    repeats: int  # slipstream: timed repeats of seed 0, interleaved across setups (A B A B ...)
    key_seeds: int  # seeds of the setups the answers rest on; sweep setups get one
    eval_samples: int  # validation samples per periodic evaluation
    probe_seconds: float
    probe_table_bytes: int
    full_grid: bool
    bottom_mlp: tuple[int, ...] = (128, 64, 16)
    top_mlp: tuple[int, ...] = (128, 64, 1)
    batch_size: int = 512  # not the trainer's 256: per-step overhead dominates on 2 cores
    lr: float = 0.3  # pinned, so a change of the trainer's default cannot silently change a grid
    # for the up-front estimate only: one thread on this machine, measured at scale 0.05
    rate_guess: float = 30_000.0
    overhead_guess_s: float = 6.0
    # accuracy study: passes over the mixed-precision dataset's training split (validation AUC flattened)
    accuracy_epochs: int = 3


PRESETS = {
    "full": Preset(
        "full", scale=0.05, dataset_samples=1_250_000, train_samples=400_000, stale_dataset_samples=2_000_000,
        stale_epochs=3, repeats=3, key_seeds=3, eval_samples=20_000, probe_seconds=1.0, probe_table_bytes=1 << 30,
        full_grid=True,
    ),
    "quick": Preset(
        "quick", scale=0.01, dataset_samples=150_000, train_samples=80_000, stale_dataset_samples=100_000,
        stale_epochs=3, repeats=1, key_seeds=1, eval_samples=10_000, probe_seconds=0.25, probe_table_bytes=128 << 20,
        full_grid=False, overhead_guess_s=3.0, accuracy_epochs=8,
    ),
}


@dataclass
class Setup:
    """One configuration of a grid; its cells are the same config over `seeds` seeds."""

    experiment: str
    name: str
    overrides: dict[str, Any]  # TrainConfig fields this setup sets
    seeds: int
    questions: list[str] = field(default_factory=list)
    group: str = ""  # slipstream: which storage (fp32 / int8 + cache) the setup belongs to


@dataclass
class Cell:
    """One training run: a setup at one seed, with the complete TrainConfig values it runs with."""

    setup: Setup
    seed: int
    values: dict[str, Any]
    repeat: int = 0  # > 0: a timing repeat of the same run (slipstream, seed 0)
    dataset: str = ""  # synthetic data: its cache directory's name (generator version + parameter digest)

    @property
    def id(self) -> str:
        """Readable name + seed (+ repeat) + a hash of the complete config, trainer defaults included, and
        of the synthetic dataset's identity: a recalibrated generator makes new cells, never reuses old ones.

        Fields at None (an option off, or a value derived from the data) are left out, so a new optional
        TrainConfig field does not orphan every finished cell of a grid that resumes across sessions.
        """
        full = {k: v for k, v in {**asdict(trainer.TrainConfig()), **self.values}.items() if v is not None}
        if self.dataset:
            full["dataset"] = self.dataset
        digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:8]
        slug = re.sub(r"[^a-z0-9.]+", "-", self.setup.name.lower()).strip("-")
        again = f"-r{self.repeat}" if self.repeat else ""
        return f"{self.setup.experiment}-{slug}-s{self.seed}{again}-{digest}"


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def mp_name(precision: str, cache: float, policy: str = "lru", rounding: str = "stochastic") -> str:
    """Readable setup name, e.g. 'int8 5% lru' or 'int4 no cache nearest'."""
    name = f"{precision} {'no cache' if cache == 0 else f'{_pct(cache)} {policy}'}"
    return name + (" nearest" if rounding == "nearest" else "")


def mixed_precision_grid(preset: Preset, seeds: int) -> list[Setup]:
    """RQ1 precision x cache, RQ2/RQ3 policy x cache size at int8, RQ4 rounding; RQ5 reads every run."""
    setups: dict[str, Setup] = {}

    def add(question: str, precision: str, cache: float, policy: str = "lru", rounding: str = "stochastic",
            n_seeds: int = 1) -> None:
        name = mp_name(precision, cache, policy, rounding)
        if name not in setups:
            overrides = {"precision": precision, "cache_size": cache, "policy": policy, "rounding": rounding}
            setups[name] = Setup("mixed-precision", name, overrides, n_seeds)
        setups[name].seeds = max(setups[name].seeds, n_seeds)
        if question not in setups[name].questions:
            setups[name].questions.append(question)

    if preset.full_grid:
        precisions, caches = ("fp32", "fp16", "int8", "int4"), (0.0, 0.01, 0.05, 0.10)
        sweep, policies, rounding_cases = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20), ("lru", "lfu"), (0.0, 0.05)
    else:
        precisions, caches = ("fp32", "fp16", "int8", "int4"), (0.0, 0.05)
        sweep, policies, rounding_cases = (0.01, 0.05, 0.20), ("lru", "lfu"), (0.0, 0.05)
    for precision in precisions:
        for cache in caches:
            # fp32 rows behind an exact fp32 cache: the baseline's math (up to float summation order).
            add("RQ1", precision, cache, n_seeds=1 if precision == "fp32" and cache else seeds)
    add("RQ1", "int4", 0.01, n_seeds=seeds)  # the paper's >7x headline setup, also in the quick grid
    for policy in policies:
        for cache in sweep if policy == "lru" or preset.full_grid else sweep[:2]:
            add("RQ3", "int8", cache, policy)
            add("RQ2", "int8", cache, policy)
    for precision in ("int8", "int4"):
        for cache in rounding_cases:
            add("RQ4", precision, cache, n_seeds=seeds)
            add("RQ4", precision, cache, rounding="nearest", n_seeds=seeds)
    return list(setups.values())


STALE_STORAGES = {
    "fp32": {"precision": "fp32", "cache_size": 0.0, "policy": "lru", "rounding": "stochastic"},
    "int8 + 5% cache": {"precision": "int8", "cache_size": 0.05, "policy": "lru", "rounding": "stochastic"},
}


def stale_name(group: str, target: float | None, rule: str = "convergence", warmup: str = "val",
               decision: str = "rolling") -> str:
    if target is None:
        return f"{group}, no skipping"
    if decision == "epoch":
        return f"{group}, authors' mode ({rule} rule, warm-up {warmup}, one decision per epoch), D={target:g}"
    return f"{group}, {rule} rule, warm-up {warmup}, D={target:g}"


# Warm-up settings of the grid: "val" is the new default; "off" is the earlier behaviour (window at 2 % of
# every epoch, no floor), which the paper rule's published grid used.
WARMUP_SETTINGS = {"val": {"stale_warmup": "val"}, "off": {"stale_warmup": "none", "stale_warmup_min": 0.0}}


def slipstream_grid(preset: Preset, seeds: int) -> list[Setup]:
    """Per storage: the run without skipping; D x staleness rule x warm-up; the authors' per-epoch mode.

    The quick grid spans D, the rule (paper vs convergence) and warm-up (validation loss vs off); the full
    grid keeps the settings that matter for the time-to-target question (see docs/skipping.md).
    """
    if preset.full_grid:
        variants = [(d, "convergence", "val") for d in (0.3, 0.5, 0.7)] + [(0.5, "paper", "val"), (0.3, "paper", "off")]
    else:
        # D sweep of the new default; rule and warm-up each compared at D = 0.5
        variants = [(0.3, "convergence", "val"), (0.5, "convergence", "val"), (0.5, "convergence", "off"),
                    (0.5, "paper", "val"), (0.5, "paper", "off")]
    setups = []
    for group, storage in STALE_STORAGES.items():
        base = {**storage, "skip_stale": False}
        setups.append(Setup("slipstream", stale_name(group, None), base, seeds, ["skip"], group))
        for target, rule, warmup in variants:
            overrides = {**storage, "skip_stale": True, "stale_target": target, "stale_rule": rule,
                         **WARMUP_SETTINGS[warmup]}
            setups.append(Setup("slipstream", stale_name(group, target, rule, warmup), overrides, seeds, ["skip"],
                                group))
        authors = {**storage, "skip_stale": True, "stale_target": 0.3, "stale_rule": "paper",
                   "stale_warmup": "epoch", "stale_decision": "epoch"}
        setups.append(Setup("slipstream", stale_name(group, 0.3, "paper", "epoch", "epoch"), authors, seeds,
                            ["skip"], group))
    return setups


# ----------------------------------------------------------------------------------------------------
# Running cells


@dataclass
class Plan:
    """Where cells read their data and how large their runs are (preset plus hidden test overrides)."""

    preset: Preset
    out: Path
    data: str | None  # preprocessed dataset dir; None = synthetic data
    seeds: int
    generator: str = DEFAULT_GENERATOR  # synthetic data: its generator (slipcache.data.synthetic)

    repeats: int = 1  # slipstream: timed runs of seed 0 per setup

    def cells(self, setups: list[Setup], dataset: str = "") -> list[Cell]:
        """Seed-major order, so an interrupted full run already has one seed of every setup.

        Slipstream's seed 0 runs `repeats` times, interleaved: every setup once, then every setup again
        (A B A B ...), so a change of the machine's speed hits all setups alike instead of one of them.
        """
        cells = []
        for seed in range(max(s.seeds for s in setups)):
            cells += [Cell(s, seed, self.run_values(s, seed), dataset=dataset) for s in setups if seed < s.seeds]
            if seed == 0:
                for repeat in range(1, self.repeats):
                    cells += [Cell(s, 0, self.run_values(s, 0), repeat, dataset) for s in setups
                              if s.experiment == "slipstream"]
        return cells

    def run_values(self, setup: Setup, seed: int) -> dict[str, Any]:
        p = self.preset
        stale = setup.experiment == "slipstream"
        values: dict[str, Any] = {
            "data": self.data,
            "batch_size": p.batch_size,
            "lr": p.lr,
            "bottom_mlp": list(p.bottom_mlp),
            "top_mlp": list(p.top_mlp),
            "eval_samples": p.eval_samples,
            "seed": seed,
            "progress": False,
        }
        if self.data is None:
            values["synthetic_samples"] = p.stale_dataset_samples if stale else p.dataset_samples
            values["synthetic_scale"] = p.scale
            values["synthetic_generator"] = self.generator
        if stale:
            values["epochs"] = p.stale_epochs  # same epochs with and without skipping
            # The AUC-over-time curve for time to target: 10 evaluations per epoch, each on the whole
            # validation split (>= 200 k samples at the full preset; 20 k swing by +-0.003).
            train_rows = 0.8 * p.stale_dataset_samples if self.data is None else None
            if train_rows:
                values["eval_every"] = max(int(train_rows // 10), 1)
            values["eval_samples"] = None
        elif setup.experiment == ACCURACY:
            values["epochs"] = p.accuracy_epochs  # whole passes, evaluated 10 times (trainer default)
        else:
            samples = p.train_samples
            values.update(samples=samples, log_every=max(samples // 50, 1), eval_every=max(samples // 5, 1))
        values["checkpoint_every"] = 1 << 40  # only the final checkpoint
        values.update(setup.overrides)
        return values

    def estimate_s(self, cell: Cell) -> float:
        """Guess of a cell's wall time, for the up-front total and the ETA before any cell finished."""
        p = self.preset
        v = cell.values
        if v.get("samples"):
            samples = v["samples"]
        else:
            samples = 0.8 * v.get("synthetic_samples", p.stale_dataset_samples) * v.get("epochs", 1)
            if v.get("skip_stale"):
                samples *= 1 - 0.5 * v.get("stale_target", 0.0)
        return samples / p.rate_guess + p.overhead_guess_s


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def embedding_traffic(summary: dict[str, Any]) -> dict[str, Any]:
    """Cumulative training counters of the embedding collection (rows/bytes in and out of the cache).

    Evaluation lookups are read-only and never counted, so these are the training run's alone.
    """
    stats = summary["embedding_stats"]
    keys = ("lookups", "hits", "misses", "evictions", "rows_in", "rows_out", "bytes_in", "bytes_out")
    return {k: stats.get(k) for k in keys}


def run_cell(cell: Cell, cells_dir: Path) -> tuple[dict[str, Any], bool]:
    """The cell's record, training it unless a finished record exists; returns (record, ran)."""
    cell_dir = cells_dir / cell.id
    record_path = cell_dir / "cell.json"
    record = _read_json(record_path)
    if isinstance(record, dict) and record.get("id") == cell.id and "summary" in record:
        return record, False
    if cell_dir.exists():  # an interrupted run: start it over rather than trust half a run directory
        shutil.rmtree(cell_dir)
    config = trainer.TrainConfig(**{**cell.values, "out": str(cell_dir)})
    start = time.perf_counter()
    summary = trainer.train(config)
    wall_s = time.perf_counter() - start
    traffic = embedding_traffic(summary)
    shutil.rmtree(cell_dir / "checkpoints", ignore_errors=True)  # large, and never resumed
    on_disk = _read_json(cell_dir / "summary.json")
    record = {
        "id": cell.id,
        "experiment": cell.setup.experiment,
        "setup": cell.setup.name,
        "seed": cell.seed,
        "repeat": cell.repeat,
        "curve": eval_curve(cell_dir / "metrics.jsonl"),
        "config": cell.values,
        "dataset": cell.dataset or None,
        "summary": on_disk if isinstance(on_disk, dict) else summary,
        "embedding_traffic": traffic,
        "cell_wall_s": wall_s,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(record_path, record)
    return record, True


def eval_curve(metrics: Path) -> list[list[float]]:
    """[training seconds, validation AUC] of each evaluation of a run, in order.

    Training seconds exclude evaluation: `train_seconds` where the trainer writes it, else `train_wall_s`.
    """
    curve = []
    text = metrics.read_text() if metrics.is_file() else ""
    for line in text.splitlines():
        event = json.loads(line) if line.strip() else {}
        if event.get("val_auc") is not None:
            seconds = event.get("train_seconds", event.get("train_wall_s"))
            if seconds is not None:
                curve.append([float(seconds), float(event["val_auc"])])
    return curve


def time_to_target(curve: list[list[float]] | list[tuple[float, float]], target: float) -> float | None:
    """Training seconds at which validation AUC first reaches `target`, linearly interpolated.

    Between the last evaluation below the target and the first at or above it; None if never reached.
    Reached at the first evaluation: its time (nothing earlier to interpolate from).
    """
    previous = None
    for seconds, auc in curve:
        if auc >= target:
            if previous is None:
                return float(seconds)
            t0, a0 = previous
            return float(t0 + (target - a0) / (auc - a0) * (seconds - t0))
        previous = (seconds, auc)
    return None


def auc_target(curve: list[list[float]] | list[tuple[float, float]], margin: float = 0.001) -> float | None:
    """The baseline's best validation AUC, taken as the mean of its last 3 evaluations, minus `margin`."""
    if not curve:
        return None
    last = [auc for _, auc in curve[-3:]]
    return statistics.fmean(last) - margin


def run_cells(plan: Plan, cells: list[Cell], label: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every unfinished cell in order with a progress line each (i/n, wall time, ETA)."""
    cells_dir = plan.out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not _is_done(cells_dir / c.id, c.id)]
    estimate = sum(plan.estimate_s(c) for c in todo)
    log(f"{label}: {len(cells)} runs, {len(cells) - len(todo)} already done; "
        f"estimated {_duration(estimate)} for the remaining {len(todo)}")
    records = []
    spent = guessed = 0.0
    remaining = estimate
    for i, cell in enumerate(cells, 1):
        record, ran = run_cell(cell, cells_dir)
        records.append(record)
        if not ran:
            continue
        guess = plan.estimate_s(cell)
        spent += record["cell_wall_s"]
        guessed += guess
        remaining -= guess
        summary = record["summary"]
        rate = summary.get("samples_per_s") or 0.0
        again = f", repeat {cell.repeat}" if cell.repeat else ""
        log(f"[{i}/{len(cells)}] {cell.setup.name}, seed {cell.seed}{again}: {record['cell_wall_s']:.1f} s, "
            f"AUC {summary['auc']:.4f}, {rate / 1e3:.1f}k samples/s; "
            f"ETA {_duration(remaining * spent / guessed)}")
    return records


def _is_done(cell_dir: Path, cell_id: str) -> bool:
    record = _read_json(cell_dir / "cell.json")
    return isinstance(record, dict) and record.get("id") == cell_id and "summary" in record


# ----------------------------------------------------------------------------------------------------
# Derived numbers and aggregation


def derived_metrics(record: dict[str, Any], probes: dict[str, Any] | None, num_tables: int) -> dict[str, Any]:
    """Per-sample traffic, the unified-memory comparison, step time and the memory-system bound.

    Bytes the embedding layer touches per sample: each of the `num_tables` lookups reads its row and the
    update writes it back (fp32 cache rows when there is a cache, stored rows when not), plus, with a
    cache, the rows moved between storage and cache. The no-cache unified-memory design moves every looked-up stored row
    from host memory and back. The bound divides the measured random-gather rate (rows of one cache
    line) by the cache lines a sample needs: what this memory system allows, ignoring the MLPs.
    """
    summary, config = record["summary"], record["config"]
    from slipcache.embedding.quant import RowStorage

    dim = summary["config"]["embedding_dim"]
    row_bytes = RowStorage(1, dim, config["precision"]).bytes_per_row
    fp32_row = 4 * dim
    cached = config["cache_size"] > 0 and config.get("policy") != "none"
    served = fp32_row if cached else row_bytes
    samples = max(summary["train_samples"], 1)
    out: dict[str, Any] = {
        "row_bytes": row_bytes,
        "unified_bytes_per_sample": 2 * num_tables * row_bytes,
        "step_ms": 1e3 * summary["train_wall_s"] / max(samples / config["batch_size"], 1),
    }
    traffic = record.get("embedding_traffic")
    moved_rows = moved_bytes = None
    if traffic:
        moved_rows = (traffic["rows_in"] + traffic["rows_out"]) / samples
        moved_bytes = (traffic["bytes_in"] + traffic["bytes_out"]) / samples
    out["rows_moved_per_sample"] = moved_rows
    out["bytes_moved_per_sample"] = moved_bytes
    moved_lines = (moved_rows or 0.0) * math.ceil(row_bytes / CACHE_LINE) if cached else 0.0
    out["touched_bytes_per_sample"] = 2 * num_tables * served + ((moved_bytes or 0.0) if cached else 0.0)
    lines = 2 * num_tables * math.ceil(served / CACHE_LINE) + moved_lines
    gather = (probes or {}).get("random_gather", {}).get("rows_per_s")
    out["bound_samples_per_s"] = gather / lines if gather and lines else None
    rate = summary.get("samples_per_s")
    out["bound_fraction"] = rate / out["bound_samples_per_s"] if rate and out["bound_samples_per_s"] else None
    return out


METRICS = (
    "auc", "logloss", "accuracy", "samples_per_s", "train_wall_s", "cache_hit_rate", "memory_ratio",
    "embedding_bytes", "skipped_fraction", "train_samples",
)  # fmt: skip
DERIVED = (
    "rows_moved_per_sample", "bytes_moved_per_sample", "unified_bytes_per_sample", "touched_bytes_per_sample",
    "step_ms", "bound_samples_per_s", "bound_fraction",
)  # fmt: skip


def _stat(values: Iterable[Any]) -> dict[str, Any] | None:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def aggregate(setups: list[Setup], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean/std per setup over seeds, plus deltas paired by seed against the setup's reference.

    References: the fp32 no-cache run for mixed precision; the same storage without skipping for
    slipstream (speedup = reference train time / train time, same seed).
    """
    by_setup: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_setup.setdefault(r["setup"], []).append(r)
    out = []
    for setup in setups:
        rows = by_setup.get(setup.name, [])
        ref_name = BASELINE if setup.experiment in ("mixed-precision", ACCURACY) else stale_name(setup.group, None)
        ref = {r["seed"]: r for r in by_setup.get(ref_name, [])}
        paired = _paired_with(ref)
        entry: dict[str, Any] = {
            "experiment": setup.experiment,
            "name": setup.name,
            "group": setup.group,
            "questions": setup.questions,
            "overrides": setup.overrides,
            "seeds": len(rows),
            "reference": ref_name,
            "metrics": {k: _stat(r["summary"].get(k) for r in rows) for k in METRICS},
        }
        entry["metrics"].update({k: _stat(r["derived"].get(k) for r in rows) for k in DERIVED})
        entry["metrics"]["auc_delta"] = _stat(paired("auc", r, lambda a, b: a - b) for r in rows)
        entry["metrics"]["logloss_delta"] = _stat(paired("logloss", r, lambda a, b: a - b) for r in rows)
        entry["metrics"]["speedup"] = _stat(paired("train_wall_s", r, lambda a, b: b / a) for r in rows)
        entry["per_seed"] = {
            str(r["seed"]): {
                **{k: r["summary"].get(k) for k in PER_SEED},
                "auc_delta": paired("auc", r, lambda a, b: a - b),
                "speedup": paired("train_wall_s", r, lambda a, b: b / a),
            }
            for r in rows
        }
        out.append(entry)
    return out


def _spread(values: list[float]) -> dict[str, Any] | None:
    """Median with min and max: the timing summary (robust to one disturbed repeat)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "mean": statistics.median(values), "std": None}


def add_timing(entries: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Time to target and its speedup for every slipstream setup, from seed 0's interleaved repeats.

    Target: the same storage's run without skipping, its best validation AUC (mean of its last 3
    evaluations) minus 0.001. Per repeat r: speedup = baseline's time to target in repeat r / this setup's in
    repeat r, so both come from the same pass over the setups. Also the overhead split, as a share of the
    training loop's wall time, and the guard's actions.
    """
    by_setup: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        if r["experiment"] == "slipstream" and r["seed"] == 0:
            by_setup.setdefault(r["setup"], {})[int(r.get("repeat", 0))] = r
    for entry in entries:
        if entry["experiment"] != "slipstream":
            continue
        runs = by_setup.get(entry["name"], {})
        base = by_setup.get(stale_name(entry["group"], None), {})
        target = auc_target(base[0].get("curve", [])) if 0 in base else None
        times, speedups, missed = [], [], 0
        for repeat, record in sorted(runs.items()):
            t = time_to_target(record.get("curve", []), target) if target is not None else None
            if t is None:
                missed += 1
                continue
            times.append(t)
            t_base = time_to_target(base[repeat].get("curve", []), target) if repeat in base else None
            if t_base:
                speedups.append(t_base / t)
        m = entry["metrics"]
        m["target_auc"] = target
        m["time_to_target"] = _spread(times)
        m["target_missed"] = missed
        m["speedup"] = _spread(speedups)
        parts: dict[str, list[float]] = {}
        actions = []
        for r in (r for r in records if r["setup"] == entry["name"] and not r.get("repeat")):
            block = r["summary"].get("staleness") or {}
            wall = r["summary"].get("train_wall_s") or 0.0
            for part, seconds in (block.get("skip_overhead_parts_s") or {}).items():
                parts.setdefault(part, []).append(seconds / wall if wall else 0.0)
            actions += [{**a, "seed": r["seed"]} for a in block.get("guard_actions") or []]
        m["overhead_parts"] = {part: statistics.fmean(v) for part, v in parts.items()}
        m["overhead_share"] = sum(m["overhead_parts"].values()) if parts else None
        m["guard_actions"] = len(actions)
        entry["guard_action_list"] = actions


PER_SEED = ("auc", "logloss", "cache_hit_rate", "memory_ratio", "embedding_bytes", "train_wall_s", "skipped_fraction")
MIN_EFFECT = 0.001  # AUC changes below this are not called a difference, whatever the seeds say


def on_seeds(entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries with their per-seed metrics averaged over the seeds all of them ran.

    Why: a sweep mixes setups run over three seeds with one-seed setups; comparing a three-seed mean with
    a seed-0 value measures the seeds, not the setups.
    """
    common = sorted(set.intersection(*(set(e["per_seed"]) for e in entries)), key=int) if entries else []
    view = []
    for e in entries:
        metrics = dict(e["metrics"])
        for key in (*PER_SEED, "auc_delta", "speedup"):
            metrics[key] = _stat(e["per_seed"][s].get(key) for s in common)
        view.append({**e, "metrics": metrics, "seeds": len(common)})
    return view, common


def paired_difference(a: dict[str, Any], b: dict[str, Any], key: str = "auc") -> dict[str, Any] | None:
    """a minus b on the seeds both ran, and whether it exceeds MIN_EFFECT and twice its standard error."""
    seeds = set(a["per_seed"]) & set(b["per_seed"])
    diffs = [a["per_seed"][s][key] - b["per_seed"][s][key] for s in seeds
             if a["per_seed"][s].get(key) is not None and b["per_seed"][s].get(key) is not None]
    stat = _stat(diffs)
    if stat:
        stat["measurable"] = _exceeds(stat["mean"], stat["std"], stat["n"])
    return stat


def _exceeds(mean: float, std: float, n: int) -> bool:
    return abs(mean) > max(MIN_EFFECT, 2 * std / math.sqrt(n) if n > 1 else 0.0)


def _paired_with(ref: dict[int, dict[str, Any]]) -> Callable[..., float | None]:
    """fn(value, reference value) of one summary key, against the same seed's reference (else its mean)."""
    means = {}

    def paired(key: str, record: dict[str, Any], fn: Callable[[float, float], float]) -> float | None:
        if record["seed"] in ref:
            base = ref[record["seed"]]["summary"].get(key)
        else:
            if key not in means:
                means[key] = (_stat(r["summary"].get(key) for r in ref.values()) or {}).get("mean")
            base = means[key]
        value = record["summary"].get(key)
        return fn(value, base) if value is not None and base else None

    return paired


# ----------------------------------------------------------------------------------------------------
# Plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> str:
    from matplotlib.legend import Legend

    fig.tight_layout()
    # every legend counts for the tight box, also one kept with add_artist (outside legends stay visible)
    legends = [a for ax in fig.axes for a in ax.get_children() if isinstance(a, Legend)]
    fig.savefig(path, bbox_inches="tight", bbox_extra_artists=legends)
    _plt().close(fig)
    return path.name


def _m(entry: dict[str, Any], key: str, part: str = "mean") -> float | None:
    stat = entry["metrics"].get(key)
    return stat[part] if stat else None


def _mib(n: float) -> float:
    return n / 2**20


PRECISION_COLORS = {"fp32": "tab:gray", "fp16": "tab:blue", "bf16": "tab:cyan", "int8": "tab:green",
                    "int4": "tab:red"}  # fmt: skip
CACHE_MARKERS = {0.0: "o", 0.005: "v", 0.01: "s", 0.02: "P", 0.05: "^", 0.10: "D", 0.20: "X"}


def pareto_front(points: list[tuple[float, float]], tie: float = 0.0) -> list[int]:
    """Indices of points no other point beats on both memory (lower) and accuracy (higher), by memory.

    A point must beat the accuracy of every smaller one by more than `tie` (equal results in float noise,
    such as fp32 rows with and without an exact fp32 cache, are not a trade-off).
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best + tie:
            front.append(i)
            best = points[i][1]
    return front


def plot_accuracy_memory(entries: list[dict[str, Any]], path: Path) -> str | None:
    """AUC change vs embedding memory for the setups run on every seed; the Pareto front highlighted.

    One-seed sweep setups are left out: next to multi-seed means they would compare seeds, not setups.
    """
    plt = _plt()
    from matplotlib.lines import Line2D

    most = max((e["seeds"] for e in entries), default=0)
    pts = [e for e in entries if e["seeds"] == most and _m(e, "embedding_bytes") and _m(e, "auc_delta") is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 5.5))
    xy = [(_mib(_m(e, "embedding_bytes")), 1e3 * _m(e, "auc_delta")) for e in pts]
    for e, (x, y) in zip(pts, xy, strict=True):
        o = e["overrides"]
        nearest = o["rounding"] == "nearest"
        color = PRECISION_COLORS.get(o["precision"], "k")
        sem = 1e3 * _m(e, "auc_delta", "std") / math.sqrt(most)
        ax.errorbar(x, y, yerr=sem or None, fmt=CACHE_MARKERS.get(o["cache_size"], "*"),
                    markersize=8, color=color, mfc="white" if nearest else color, alpha=0.9, capsize=3)
    front = pareto_front(xy, tie=0.01)  # 1e-5 AUC
    fx, fy = [xy[i][0] for i in front], [xy[i][1] for i in front]
    ax.step(fx, fy, where="post", color="black", linewidth=1.2, linestyle="--", zorder=0)
    ax.scatter(fx, fy, s=260, facecolors="none", edgecolors="gold", linewidths=2.2, zorder=5)
    for k, i in enumerate(front, 1):  # numbers at the points, names in a legend: labels never collide
        ax.annotate(str(k), xy[i], textcoords="offset points", xytext=(9, 7) if k % 2 else (-4, -20), fontsize=10,
                    fontweight="bold")
    ax.axhline(0, color="0.4", linewidth=0.8)
    ax.set_xlabel("embedding memory (MiB, storage + cache + bookkeeping)")
    ax.set_ylabel("test AUC change vs fp32 no cache (x 1e-3)")
    bars = f", bars: standard error over {most} seeds" if most > 1 else ""
    ax.set_title(f"Accuracy vs embedding memory (ringed: Pareto front{bars})")
    precisions = sorted({e["overrides"]["precision"] for e in pts}, key=list(PRECISION_COLORS).index)
    caches = sorted({e["overrides"]["cache_size"] for e in pts})
    handles = [Line2D([], [], color=PRECISION_COLORS[p], marker="o", linestyle="", label=p) for p in precisions]
    handles += [Line2D([], [], color="0.3", marker=CACHE_MARKERS.get(c, "*"), linestyle="",
                       label="no cache" if c == 0 else f"cache {_pct(c)}") for c in caches]
    handles.append(Line2D([], [], color="0.3", marker="o", mfc="white", linestyle="", label="nearest rounding"))
    first = ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="precision / cache")
    ax.add_artist(first)
    names = [Line2D([], [], linestyle="", label=f"{k}  {pts[i]['name']}") for k, i in enumerate(front, 1)]
    ax.legend(handles=names, loc="lower left", bbox_to_anchor=(1.01, 0.0), title="Pareto front",
              handlelength=0, handletextpad=0)
    return _save(fig, path)


def plot_cache_sweep(entries: list[dict[str, Any]], path: Path) -> str | None:
    """int8 with a cache: hit rate, AUC change and memory against cache size, one line per policy."""
    plt = _plt()
    sweep = [e for e in entries if e["overrides"]["precision"] == "int8" and e["overrides"]["cache_size"] > 0
             and e["overrides"]["rounding"] == "stochastic"]
    if not sweep:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.3))
    panels = [
        ("cache_hit_rate", 100, "hit rate (% of lookups)", "Cache hit rate"),
        ("auc_delta", 1e3, "AUC change vs fp32 (x 1e-3)", "Accuracy"),
        ("embedding_bytes", 1 / 2**20, "embedding memory (MiB)", "Memory"),
    ]
    for policy, color in (("lru", "tab:blue"), ("lfu", "tab:orange")):
        pts = sorted((e for e in sweep if e["overrides"]["policy"] == policy), key=lambda e: e["overrides"]["cache_size"])
        xs = [100 * e["overrides"]["cache_size"] for e in pts]
        for ax, (key, scale, ylabel, title) in zip(axes, panels, strict=True):
            ys = [(_m(e, key) or math.nan) * scale for e in pts]
            errs = [(_m(e, key, "std") or 0.0) * scale for e in pts]
            ax.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", color=color, label=policy.upper(),
                        capsize=3)
            ax.set_xscale("log")
            sizes = sorted({100 * e["overrides"]["cache_size"] for e in sweep})
            ax.set_xticks(sizes, [f"{x:g}%" for x in sizes])
            ax.minorticks_off()
            ax.set_xlabel("cache size (% of all rows, log scale)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}, int8 storage")
    axes[1].axhline(0, color="0.4", linewidth=0.8)
    n = sweep[0]["seeds"]
    axes[1].set_title(f"Accuracy, int8 storage ({n} common seed{'s' if n != 1 else ''})")
    for ax in axes:
        ax.legend()
    return _save(fig, path)


def plot_rounding(entries: list[dict[str, Any]], path: Path) -> str | None:
    """Left: AUC change vs fp32 per rounding; right: the seed-paired gain of stochastic over nearest."""
    plt = _plt()
    by_key = {(e["overrides"]["precision"], e["overrides"]["cache_size"], e["overrides"]["policy"],
               e["overrides"]["rounding"]): e for e in entries}
    cases = sorted({k[:3] for k in by_key if k[3] == "nearest" and (*k[:3], "stochastic") in by_key})
    if not cases:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{p}\n{'no cache' if c == 0 else f'{_pct(c)} {pol}'}" for p, c, pol in cases]
    width = 0.38
    for j, (rounding, color) in enumerate((("stochastic", "tab:green"), ("nearest", "tab:purple"))):
        group = [by_key[(*c, rounding)] for c in cases]
        ys = [1e3 * (_m(e, "auc_delta") or 0.0) for e in group]
        sems = [1e3 * (_m(e, "auc_delta", "std") or 0.0) / math.sqrt(max(e["seeds"], 1)) for e in group]
        left.bar([i + (j - 0.5) * width for i in range(len(cases))], ys, width, yerr=sems if any(sems) else None,
                 capsize=3, color=color, label=f"{rounding} rounding")
    left.set_xticks(range(len(cases)), labels)
    left.axhline(0, color="0.3", linewidth=0.8)
    left.set_ylabel("test AUC change vs fp32 no cache (x 1e-3)")
    left.set_title("Accuracy per rounding mode (bars: standard error)")
    left.legend()
    diffs = [paired_difference(by_key[(*c, "stochastic")], by_key[(*c, "nearest")]) for c in cases]
    ys = [1e3 * (d["mean"] if d else 0.0) for d in diffs]
    sems = [1e3 * d["std"] / math.sqrt(d["n"]) if d else 0.0 for d in diffs]
    colors = ["tab:green" if d and d["measurable"] else "0.6" for d in diffs]
    right.bar(range(len(cases)), ys, 0.6, yerr=sems if any(sems) else None, capsize=3, color=colors)
    right.set_xticks(range(len(cases)), labels)
    right.axhline(0, color="0.3", linewidth=0.8)
    right.set_ylabel("AUC, stochastic minus nearest (x 1e-3)")
    right.set_title("Gain of stochastic rounding, paired by seed\n(green: measurable, grey: within noise)")
    return _save(fig, path)


def plot_traffic(entries: list[dict[str, Any]], path: Path) -> str | None:
    """Bytes moved per sample (ours vs a no-cache unified-memory design) and time per step."""
    plt = _plt()
    pts = [e for e in entries if "RQ1" in e["questions"] and _m(e, "bytes_moved_per_sample") is not None]
    if not pts:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    xs = range(len(pts))
    width = 0.4
    left.bar([x - width / 2 for x in xs], [_m(e, "bytes_moved_per_sample") for e in pts], width,
             color="tab:green", label="ours: storage <-> cache (measured)")
    left.bar([x + width / 2 for x in xs], [_m(e, "unified_bytes_per_sample") for e in pts], width,
             color="0.6", label="no cache, unified memory: 26 rows each way")
    left.set_yscale("log")
    left.set_ylim(top=8 * max(_m(e, "unified_bytes_per_sample") for e in pts))  # room for the legend
    left.set_ylabel("bytes per training sample (log scale)")
    left.set_title("Embedding rows moved to and from storage")
    left.set_xticks(list(xs), [e["name"] for e in pts], rotation=40, ha="right")
    left.legend(loc="upper right")
    errs = [_m(e, "step_ms", "std") for e in pts]
    right.bar(list(xs), [_m(e, "step_ms") for e in pts], yerr=errs if any(errs) else None,
              color=[PRECISION_COLORS.get(e["overrides"]["precision"], "k") for e in pts], capsize=2)
    right.set_xticks(list(xs), [e["name"] for e in pts], rotation=55, ha="right")
    right.set_ylabel("time per training step (ms)")
    right.set_title("Time per training step")
    return _save(fig, path)


def _series(entry: dict[str, Any]) -> str:
    """A slipstream setup's name without its D: the line its D values are joined by."""
    return re.sub(r",? ?D=[0-9.]+$", "", entry["name"])


def plot_skip_speedup(entries: list[dict[str, Any]], path: Path) -> str | None:
    """Speedup to target (left, median with min-max, and the bound 1 / (1 - skipped)) and the test AUC
    change (right, paired seeds) against the share of inputs skipped; one line per storage, rule and warm-up.
    """
    plt = _plt()
    skips = [e for e in entries if e["overrides"].get("skip_stale") and _m(e, "skipped_fraction") is not None]
    if not skips:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab10")
    for k, series in enumerate(sorted({_series(e) for e in skips})):
        pts = sorted((e for e in skips if _series(e) == series), key=lambda e: _m(e, "skipped_fraction"))
        xs = [100 * _m(e, "skipped_fraction") for e in pts]
        style = {"color": colors(k % 10), "marker": "os^v"[k % 4], "capsize": 3, "label": series,
                 "linestyle": "-" if "int8" not in series else "--"}
        timed = [(x, e["metrics"]["speedup"]) for x, e in zip(xs, pts, strict=True) if e["metrics"].get("speedup")]
        if timed:
            left.errorbar([x for x, _ in timed], [t["median"] for _, t in timed],
                          yerr=[[t["median"] - t["min"] for _, t in timed], [t["max"] - t["median"] for _, t in timed]],
                          **style)
        right.errorbar(xs, [1e3 * (_m(e, "auc_delta") or 0.0) for e in pts],
                       yerr=[1e3 * (_m(e, "auc_delta", "std") or 0.0) for e in pts], **style)
    top = max(100 * _m(e, "skipped_fraction") for e in skips)
    grid = [top * i / 50 for i in range(51)]
    left.plot(grid, [1 / (1 - x / 100) for x in grid], ":", color="0.4", label="bound 1 / (1 - skipped)")
    left.axhline(1, color="0.3", linewidth=0.8)
    left.set_xlabel("inputs skipped (%)")
    left.set_ylabel("speedup to target AUC (median, min-max)")
    left.set_title("Time to the baseline's AUC - 0.001")
    right.axhline(0, color="0.3", linewidth=0.8)
    right.set_xlabel("inputs skipped (%)")
    right.set_ylabel("test AUC change vs no skipping (x 1e-3)")
    right.set_title("Accuracy cost at equal epochs")
    right.legend(fontsize=7)
    return _save(fig, path)


def plot_stale_rows(entries: list[dict[str, Any]], events: dict[str, list[dict[str, Any]]], path: Path) -> str | None:
    """Stale and hot rows (left) and the skipped fraction (right) over training, one row per storage."""
    plt = _plt()
    from slipcache.training.report import _samples_axis

    groups = [g for g in STALE_STORAGES if any(events.get(e["name"]) for e in entries if e["group"] == g)]
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4 * len(groups)), squeeze=False)
    colors = plt.get_cmap("viridis")
    for (left, right), group in zip(axes, groups, strict=True):
        pts = [e for e in entries if e["group"] == group and e["overrides"].get("skip_stale")
               and e["overrides"].get("stale_rule") == "convergence"]
        pts.sort(key=lambda e: e["overrides"]["stale_target"])
        hot_drawn = False
        for k, e in enumerate(pts):
            ev = events.get(e["name"], [])
            color = colors(0.15 + 0.7 * k / max(len(pts) - 1, 1))
            label = e["name"].removeprefix(f"{group}, ")
            xs = [x["samples"] for x in ev if x.get("stale_rows") is not None]
            left.plot(xs, [x["stale_rows"] for x in ev if x.get("stale_rows") is not None], color=color,
                      label=f"stale rows, {label}")
            hot = [(x["samples"], x["hot_rows"]) for x in ev if x.get("hot_rows") is not None]
            if hot and not hot_drawn:
                left.plot(*zip(*hot, strict=True), color="0.5", linestyle="--", label="hot rows")
                hot_drawn = True
            skip = [(x["samples"], 100 * x["skipped_fraction"]) for x in ev if x.get("skipped_fraction") is not None]
            if skip:
                right.plot(*zip(*skip, strict=True), color=color, label=label)
        left.set_title(f"Hot and stale embedding rows ({group}, convergence rule)")
        left.set_ylabel("rows")
        right.set_title(f"Inputs skipped ({group}, convergence rule)")
        right.set_ylabel("skipped (% of inputs)")
        for ax in (left, right):
            _samples_axis(ax)
            if ax.lines:
                ax.legend(fontsize=9)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------------
# Report text


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pm(entry: dict[str, Any], key: str, scale: float = 1.0, fmt: str = ".4f", sign: bool = False) -> str:
    stat = entry["metrics"].get(key)
    if not stat:
        return "n/a"
    mean = format(stat["mean"] * scale, ("+" if sign else "") + fmt)
    return f"{mean} ± {format(stat['std'] * scale, fmt)}" if stat["n"] > 1 else mean


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _pooled_delta_std(entries: list[dict[str, Any]]) -> float:
    """Typical seed-to-seed std of ΔAUC among setups run over several seeds (0 when there are none)."""
    stds = [_m(e, "auc_delta", "std") for e in entries if e["seeds"] > 1 and e["name"] != BASELINE]
    return math.sqrt(statistics.fmean(x * x for x in stds)) if stds else 0.0


def _loses(entry: dict[str, Any], pooled_std: float) -> bool:
    """A measurable AUC loss: beyond MIN_EFFECT and twice the standard error (a one-seed setup borrows
    the pooled std of the multi-seed ones)."""
    mean, n = _m(entry, "auc_delta"), entry["seeds"]
    std = _m(entry, "auc_delta", "std") if n > 1 else pooled_std
    return mean < 0 and _exceeds(mean, std, max(n, 1))


def _dim_estimate(table_sizes: list[int], precision: str, cache: float, dim: int) -> float | None:
    """Memory ratio of a setup at another embedding dim, computed without allocating the tables."""
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

    try:
        cfg = EmbeddingConfig(table_sizes=table_sizes, dim=dim, precision=precision, cache_size=cache)
        return float(CachedEmbeddingBagCollection.estimate_memory(cfg)["memory_ratio"])
    except Exception:  # an estimate for prose only; never fail the report on it
        return None


def mixed_precision_section(entries: list[dict[str, Any]], plots: dict[str, str | None],
                            table_sizes: list[int] | None) -> list[str]:
    by = {e["name"]: e for e in entries}
    base = by.get(BASELINE)
    lines = ["## Mixed-precision embeddings with an fp32 row cache", ""]
    if base:
        lines += [f"Reference: `{BASELINE}`, test AUC {_pm(base, 'auc')}, log loss {_pm(base, 'logloss')} "
                  f"over {base['seeds']} seed(s). Deltas are paired by seed (mean ± std over seeds). A change is "
                  f"called measurable when it exceeds {MIN_EFFECT} AUC and twice its standard error over seeds.", ""]

    # RQ1
    rq1 = [e for e in entries if "RQ1" in e["questions"]]
    lines += ["### RQ1: accuracy with most rows in low precision", ""]
    lines += _table(
        ["setup", "seeds", "test AUC", "ΔAUC vs fp32", "Δ log loss", "memory (MiB)", "memory saving", "hit rate"],
        [[e["name"], str(e["seeds"]), _pm(e, "auc"), _pm(e, "auc_delta", fmt=".4f", sign=True),
          _pm(e, "logloss_delta", fmt=".4f", sign=True), _f(_mib(_m(e, "embedding_bytes") or 0), ".1f"),
          _f(_m(e, "memory_ratio"), ".2f") + "x", _f(100 * (_m(e, "cache_hit_rate") or 0), ".1f") + "%"
          if _m(e, "cache_hit_rate") else "-"] for e in rq1],
    )
    if plots.get("accuracy_memory"):
        lines += ["", f"![accuracy vs memory]({plots['accuracy_memory']})"]
    lines += ["", answer_rq1(rq1), ""]

    # RQ2 and RQ3
    sweep, common = on_seeds([e for e in entries if {"RQ2", "RQ3"} & set(e["questions"])])
    sweep.sort(key=lambda e: (e["overrides"]["policy"], e["overrides"]["cache_size"]))
    lines += ["### RQ2 and RQ3: LRU vs LFU, and cache size (int8 storage)", "",
              f"Compared on the seed(s) every setup of the sweep ran: {', '.join(common) or 'none'}.", ""]
    lines += _table(
        ["policy", "cache", "seeds", "hit rate", "ΔAUC vs fp32", "memory (MiB)", "memory saving"],
        [[e["overrides"]["policy"].upper(), _pct(e["overrides"]["cache_size"]), str(e["seeds"]),
          _pm(e, "cache_hit_rate", 100, ".1f") + "%", _pm(e, "auc_delta", sign=True),
          _f(_mib(_m(e, "embedding_bytes") or 0), ".1f"), _f(_m(e, "memory_ratio"), ".2f") + "x"] for e in sweep],
    )
    if plots.get("cache_sweep"):
        lines += ["", f"![cache sweep]({plots['cache_sweep']})"]
    lines += ["", "**RQ2.** " + answer_rq2(sweep), "", "**RQ3.** " + answer_rq3(sweep), ""]

    # RQ4
    rq4 = [e for e in entries if "RQ4" in e["questions"]]
    lines += ["### RQ4: stochastic vs nearest rounding", ""]
    lines += _table(["setup", "seeds", "test AUC", "ΔAUC vs fp32", "Δ log loss"],
                    [[e["name"], str(e["seeds"]), _pm(e, "auc"), _pm(e, "auc_delta", sign=True),
                      _pm(e, "logloss_delta", sign=True)] for e in rq4])
    if plots.get("rounding"):
        lines += ["", f"![rounding]({plots['rounding']})"]
    lines += ["", answer_rq4(rq4), ""]

    # RQ5
    rq5 = [e for e in entries if "RQ1" in e["questions"]]
    lines += ["### RQ5: rows moved between storage and cache, and time per step", ""]
    lines += _table(
        ["setup", "rows moved / sample", "bytes moved / sample", "no-cache unified memory bytes / sample",
         "bytes touched / sample", "step (ms)", "measured samples/s", "memory bound samples/s", "of bound"],
        [[e["name"], _f(_m(e, "rows_moved_per_sample"), ".2f"), _f(_m(e, "bytes_moved_per_sample"), ".0f"),
          _f(_m(e, "unified_bytes_per_sample"), ".0f"), _f(_m(e, "touched_bytes_per_sample"), ".0f"),
          _pm(e, "step_ms", fmt=".2f"), _f(_m(e, "samples_per_s"), ",.0f"), _f(_m(e, "bound_samples_per_s"), ",.0f"),
          _f(100 * (_m(e, "bound_fraction") or math.nan), ".1f") + "%"] for e in rq5],
    )
    if plots.get("traffic"):
        lines += ["", f"![bytes moved]({plots['traffic']})"]
    lines += ["", answer_rq5(rq5), ""]
    lines += ["### Against the paper (Yang et al.)", "", paper_mixed_precision(by, table_sizes), ""]
    return lines


def answer_rq1(rq1: list[dict[str, Any]]) -> str:
    lowp = [e for e in rq1 if e["overrides"]["precision"] != "fp32" and _m(e, "auc_delta") is not None]
    if not lowp:
        return "**RQ1.** No low-precision runs finished."
    pooled = _pooled_delta_std(rq1)
    hurt = [e for e in lowp if _loses(e, pooled)]
    kept = [e for e in lowp if e not in hurt]
    text = f"**RQ1.** Of {len(lowp)} low-precision setups, {len(kept)} show no measurable AUC loss against fp32"
    if hurt:
        text += "; " + ", ".join(f"{e['name']} ({_pm(e, 'auc_delta', sign=True)})" for e in hurt)
        text += " loses accuracy" if len(hurt) == 1 else " lose accuracy"
    text += ". "
    best = max(kept, key=lambda e: _m(e, "memory_ratio") or 0, default=None)
    if best:
        text += (f"The largest memory saving without a measurable loss is {best['name']}: "
                 f"{_m(best, 'memory_ratio'):.2f}x less embedding memory at ΔAUC {_pm(best, 'auc_delta', sign=True)}. ")
    close = max((e for e in lowp if abs(_m(e, "auc_delta")) < MIN_EFFECT), key=lambda e: _m(e, "memory_ratio") or 0,
                default=None)
    if close and close is not best:
        text += (f"The largest saving whose mean change is also below {MIN_EFFECT} AUC is {close['name']} "
                 f"({_m(close, 'memory_ratio'):.2f}x, ΔAUC {_pm(close, 'auc_delta', sign=True)}). ")
    worst = min(lowp, key=lambda e: _m(e, "auc_delta"))
    if worst not in hurt and _m(worst, "auc_delta") < -MIN_EFFECT:
        text += (f"The largest mean loss, {worst['name']} ({_pm(worst, 'auc_delta', sign=True)}), is not separable "
                 f"from seed noise with {worst['seeds']} seed(s). ")
    for p in ("int8", "int4"):
        nocache = next((e for e in lowp if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] == 0), None)
        cached = sorted((e for e in lowp if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] > 0),
                        key=lambda e: abs(e["overrides"]["cache_size"] - 0.05))
        diff = paired_difference(cached[0], nocache) if nocache and cached else None
        if diff:
            verdict = ("a measurable gain" if diff["mean"] > 0 else "a measurable loss") if diff["measurable"] else "within noise"
            text += (f"For {p}, a {_pct(cached[0]['overrides']['cache_size'])} cache changes AUC by {diff['mean']:+.4f} "
                     f"against no cache (paired over {diff['n']} seed(s): {verdict}). ")
    return text.strip()


def _policy_pairs(sweep: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any], dict[str, Any]]]:
    lru = {e["overrides"]["cache_size"]: e for e in sweep if e["overrides"]["policy"] == "lru"}
    lfu = {e["overrides"]["cache_size"]: e for e in sweep if e["overrides"]["policy"] == "lfu"}
    return [(c, lru[c], lfu[c]) for c in sorted(set(lru) & set(lfu))]


def answer_rq2(sweep: list[dict[str, Any]]) -> str:
    pairs = [(c, a, b) for c, a, b in _policy_pairs(sweep) if _m(a, "cache_hit_rate") and _m(b, "cache_hit_rate")]
    if not pairs:
        return "No cache size was run with both policies."
    diffs = [100 * (_m(b, "cache_hit_rate") - _m(a, "cache_hit_rate")) for _, a, b in pairs]
    detail = ", ".join(f"{_pct(c)}: LRU {100 * _m(a, 'cache_hit_rate'):.1f}% vs LFU {100 * _m(b, 'cache_hit_rate'):.1f}%"
                       for c, a, b in pairs)
    mean = statistics.fmean(diffs)
    winner = "LFU" if mean > 0 else "LRU"
    auc = [(c, paired_difference(b, a)) for c, a, b in pairs]
    auc = [(c, d) for c, d in auc if d]
    measurable = [(c, d) for c, d in auc if d["measurable"]]
    if not auc:
        auc_word = "no accuracy to compare"
    elif not measurable:
        largest = max((d["mean"] for _, d in auc), key=abs)
        auc_word = f"no measurable accuracy difference (largest LFU minus LRU: {largest:+.4f} AUC)"
    else:
        auc_word = "an accuracy difference at " + ", ".join(f"{_pct(c)} ({d['mean']:+.4f} AUC, LFU minus LRU)"
                                                            for c, d in measurable)
    if auc and auc[0][1]["n"] == 1:
        auc_word += " (one seed: indicative only)"
    return (f"Hit rates ({detail}): {winner} is ahead by {abs(mean):.1f} points on average, with {auc_word}. "
            "With power-law ids both policies keep the head of the distribution; they differ on rows near "
            "the capacity boundary, which matters most for small caches.")


def answer_rq3(sweep: list[dict[str, Any]]) -> str:
    lru = sorted((e for e in sweep if e["overrides"]["policy"] == "lru"), key=lambda e: e["overrides"]["cache_size"])
    lru = [e for e in lru if _m(e, "cache_hit_rate") is not None]
    if len(lru) < 2:
        return "Fewer than two LRU cache sizes finished."
    lo, hi = lru[0], lru[-1]
    diffs = [paired_difference(e, lo) for e in lru[1:]]
    moved = [d for d in diffs if d and d["measurable"]]
    spread = max(abs(d["mean"]) for d in diffs if d) if any(diffs) else 0.0
    accuracy = (f"no cache size changes AUC measurably against the smallest (largest difference {spread:.4f})"
                if not moved else f"AUC moves by up to {spread:.4f} against the smallest cache")
    if any(d and d["n"] == 1 for d in diffs):
        accuracy += " (one seed: indicative only)"
    return (f"From {_pct(lo['overrides']['cache_size'])} to {_pct(hi['overrides']['cache_size'])} of rows (LRU), the "
            f"hit rate rises from {100 * _m(lo, 'cache_hit_rate'):.1f}% to {100 * _m(hi, 'cache_hit_rate'):.1f}% while "
            f"the memory saving falls from {_m(lo, 'memory_ratio'):.2f}x to {_m(hi, 'memory_ratio'):.2f}x (every "
            f"cached row costs an fp32 copy plus bookkeeping); {accuracy}. Past a few percent the cache buys "
            "traffic (RQ5), not accuracy.")


def answer_rq4(rq4: list[dict[str, Any]]) -> str:
    by = {(e["overrides"]["precision"], e["overrides"]["cache_size"], e["overrides"]["rounding"]): e for e in rq4}
    parts = []
    for (p, c, r), nearest in sorted(by.items()):
        stochastic = by.get((p, c, "stochastic"))
        diff = paired_difference(stochastic, nearest) if r == "nearest" and stochastic else None
        if diff:
            parts.append((p, c, diff))
    if not parts:
        return "**RQ4.** No rounding pair finished."
    words = [f"{p} {'no cache' if c == 0 else _pct(c) + ' cache'}: stochastic {d['mean']:+.4f} AUC over nearest"
             f"{' (measurable)' if d['measurable'] else ''}" for p, c, d in parts]
    helped = [x for x in parts if x[2]["measurable"] and x[2]["mean"] > 0]
    return (f"**RQ4.** {'; '.join(words)}. Stochastic rounding is measurably better in {len(helped)} of "
            f"{len(parts)} cases. Nearest rounding loses updates smaller than half a quantization step, so it "
            "matters where rows are trained in storage (no cache), and most in int4; a cache trains hot rows in "
            "fp32 and rounds only on eviction, which shrinks the difference.")


def answer_rq5(rq5: list[dict[str, Any]]) -> str:
    cached = [e for e in rq5 if e["overrides"]["cache_size"] > 0 and _m(e, "bytes_moved_per_sample") is not None]
    if not cached:
        return "**RQ5.** No cached run reported its traffic."
    ratios = [(e, _m(e, "unified_bytes_per_sample") / max(_m(e, "bytes_moved_per_sample"), 1e-9)) for e in cached]
    lo, hi = min(ratios, key=lambda x: x[1]), max(ratios, key=lambda x: x[1])
    rows = sorted(_m(e, "rows_moved_per_sample") for e in cached)
    span = f"{lo[1]:.1f}x" if hi[1] < 1.05 * lo[1] else f"{lo[1]:.1f}x ({lo[0]['name']}) to {hi[1]:.1f}x ({hi[0]['name']})"
    moved = f"{rows[0]:.2f}" if rows[-1] - rows[0] < 0.005 else f"{rows[0]:.2f}-{rows[-1]:.2f}"
    text = (f"**RQ5.** With a cache, a training sample moves {moved} rows between storage and "
            f"cache instead of the 52 (26 each way) of a no-cache unified-memory design: {span} fewer bytes. "
            "Without a cache our own design already moves fewer rows than 52, because a batch fetches each "
            "distinct row once. ")
    steps = []
    for p in ("fp16", "int8", "int4"):
        nc = next((e for e in rq5 if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] == 0), None)
        c5 = next((e for e in rq5 if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] == 0.05), None)
        if nc and c5 and _m(nc, "step_ms") and _m(c5, "step_ms"):
            steps.append(f"{p} {_m(nc, 'step_ms'):.1f} -> {_m(c5, 'step_ms'):.1f} ms")
    if steps:
        text += "Step time without -> with a 5% cache: " + ", ".join(steps) + ". "
    fractions = [_m(e, "bound_fraction") for e in rq5 if _m(e, "bound_fraction")]
    if fractions:
        text += (f"Measured throughput is {100 * min(fractions):.1f}-{100 * max(fractions):.1f}% of what the measured "
                 "random-gather rate would allow for the embedding traffic alone: the MLPs and per-step Python/"
                 "dispatch overhead, not memory, bound a step on this CPU.")
    return text.strip()


def paper_mixed_precision(by: dict[str, dict[str, Any]], table_sizes: list[int] | None) -> str:
    parts = []
    for key, name, claim in (("int8_5_memory_ratio", mp_name("int8", 0.05), "3x"),
                             ("int4_1_memory_ratio", mp_name("int4", 0.01), ">7x")):
        e = by.get(name)
        if not e or _m(e, "memory_ratio") is None:
            parts.append(f"{name}: not in this grid (paper: {claim}).")
            continue
        ratio = _m(e, "memory_ratio")
        verdict = "matches" if ratio >= PAPER[key] * 0.95 else "falls short of"
        text = f"{name}: {ratio:.2f}x less memory, which {verdict} the paper's {claim}"
        if table_sizes and verdict != "matches":
            o = e["overrides"]
            at64 = _dim_estimate(table_sizes, o["precision"], o["cache_size"], 64)
            if at64:
                text += (f"; at embedding dim 64 the same layout would give {at64:.2f}x (per-row quantization "
                         "parameters and fp32 cache rows weigh more at dim 16)")
        parts.append(text + ".")
    base, c5 = by.get(BASELINE), by.get(mp_name("int8", 0.05))
    if base and c5 and _m(base, "samples_per_s") and _m(c5, "samples_per_s"):
        speed = _m(c5, "samples_per_s") / _m(base, "samples_per_s")
        parts.append(
            f"Speed: int8 + 5% cache trains at {speed:.2f}x the fp32 baseline's throughput (paper: 1.16x). The "
            "paper's gain comes from fewer host-to-GPU transfers; here storage and cache share one CPU memory, so "
            "the saved traffic (RQ5) shows up as bytes, not as link time, and timings on this shared machine are "
            "noisy.")
    return " ".join(parts)


def _spread_text(stat: dict[str, Any] | None, fmt: str, unit: str = "") -> str:
    if not stat:
        return "n/a"
    return f"{format(stat['median'], fmt)}{unit} ({format(stat['min'], fmt)}-{format(stat['max'], fmt)})"


def _overhead_text(entry: dict[str, Any]) -> str:
    parts = entry["metrics"].get("overhead_parts") or {}
    if not parts:
        return "-"
    split = ", ".join(f"{k} {100 * v:.1f}" for k, v in parts.items() if v >= 0.0005)
    return f"{100 * entry['metrics']['overhead_share']:.1f}% ({split})"


def slipstream_section(entries: list[dict[str, Any]], plots: dict[str, str | None], repeats: int = 1,
                       threads: int = 1) -> list[str]:
    lines = ["## Slipstream: skipping stale inputs", ""]
    lines += [
        "Time to target: the training seconds (evaluation excluded) at which validation AUC first reaches the "
        "same storage's run without skipping, its best (mean of its last 3 evaluations) minus 0.001, "
        "interpolated linearly between evaluations (10 per epoch, each on the whole validation split). "
        f"Timing protocol: seed 0 of every setup ran {repeats} time(s), interleaved (every setup once, then "
        f"again: A B A B ...), {threads} torch thread(s) per run; medians with min-max over the repeats; "
        "speedup = baseline time / skipping time within the same repeat. Test AUC at equal epochs is paired "
        "by seed (mean +- std of the per-seed differences). Overhead: skipping's bookkeeping as a share of the "
        "training loop's wall time, split into its parts (%).", "",
    ]
    lines += _table(
        ["setup", "seeds", "skipped", "test AUC", "ΔAUC vs no skipping", "time to target (s)", "speedup",
         "overhead", "guard actions"],
        [[e["name"], str(e["seeds"]), _pm(e, "skipped_fraction", 100, ".1f") + "%", _pm(e, "auc"),
          _pm(e, "auc_delta", sign=True),
          _spread_text(e["metrics"].get("time_to_target"), ".1f")
          + (f", missed {e['metrics']['target_missed']}x" if e["metrics"].get("target_missed") else ""),
          _spread_text(e["metrics"].get("speedup"), ".2f", "x"), _overhead_text(e),
          str(e["metrics"].get("guard_actions", 0))] for e in entries],
    )
    acted = [(e["name"], a) for e in entries for a in e.get("guard_action_list", [])]
    if acted:
        lines += ["", "Guard actions (every one, from each run's summary.json):", ""]
        lines += [f"- {name}, seed {a.get('seed')}: epoch {a.get('epoch')}, batch {a.get('batch')}, "
                  f"{a.get('source', 'guard')}: {a.get('action')} (D now {_f(a.get('target'), '.3g')}, "
                  f"drift {_f(a.get('drift'), '+.4f')})" for name, a in acted]
    for key, alt in (("skip_speedup", "speedup vs skip ratio"), ("stale_rows", "stale and hot rows")):
        if plots.get(key):
            lines += ["", f"![{alt}]({plots[key]})"]
    lines += ["", answer_skip(entries), ""]
    return lines


def _skip_outcome(entry: dict[str, Any]) -> str:
    skipped = _m(entry, "skipped_fraction") or 0.0
    speed = entry["metrics"].get("speedup")
    return (f"{_series(entry).split(', ', 1)[-1]} at D={entry['overrides']['stale_target']:g} skipped "
            f"{100 * skipped:.0f}% of inputs for {_spread_text(speed, '.2f', 'x')} to target "
            f"(at most {1 / max(1 - skipped, 1e-9):.2f}x), ΔAUC {_m(entry, 'auc_delta') or 0:+.4f}")


def answer_skip(entries: list[dict[str, Any]]) -> str:
    skips = [e for e in entries if e["overrides"].get("skip_stale")]
    if not skips:
        return "**Skipping.** No skipping run finished."
    parts = []
    for group in STALE_STORAGES:
        runs = [e for e in skips if e["group"] == group]
        if runs:
            parts.append(f"{group}: " + "; ".join(_skip_outcome(e) for e in runs))
    text = "**Skipping.** " + ". ".join(parts) + ". "
    within = [e for e in skips if abs(_m(e, "auc_delta") or 0.0) <= MIN_EFFECT and e["metrics"].get("speedup")]
    goal = 1.25
    if within:
        best = max(within, key=lambda e: e["metrics"]["speedup"]["median"])
        reached = best["metrics"]["speedup"]["median"] >= goal
        text += (f"Best speedup to target at |ΔAUC| <= {MIN_EFFECT}: {best['metrics']['speedup']['median']:.2f}x "
                 f"({best['name']}); the goal of {goal}x is {'met' if reached else 'missed'}. ")
    else:
        text += f"No skipping setup stayed within {MIN_EFFECT} AUC with a measured time to target. "
    text += (f"Against the paper (Maboud et al.: {PAPER['skip_speedup_vs_xdl']:g}x vs XDL, "
             f"{PAPER['skip_speedup_vs_fae']:g}x vs FAE): their baselines are distributed trainers whose steps "
             "are dominated by embedding communication; here the reference is the same single-node trainer "
             "without skipping, so the gain is bounded by 1/(1 - skipped share) minus the bookkeeping overhead.")
    return text


# ----------------------------------------------------------------------------------------------------
# The accuracy study: paired seeds and 95 % confidence intervals (issue 9)

ACCURACY_SEEDS = 5
ACCURACY_TOLERANCE = 0.001  # the claim: INT8 + 5 % cache within this AUC of fp32, its interval inside ± this
ACCURACY_CONFIDENCE = 0.95
ACCURACY_SETUPS = (("fp32", 0.0, "lru"), ("fp16", 0.0, "lru"), ("int8", 0.05, "lru"), ("int8", 0.05, "lfu"),
                   ("int4", 0.01, "lru"), ("int8", 0.0, "lru"))  # fmt: skip


def accuracy_grid(preset: Preset, seeds: int) -> list[Setup]:
    """fp32 and the paper's configurations, all on the same seeds: a seed fixes the data order and the
    initial fp32 rows (low precision stores their rounding), so per-seed differences measure storage alone."""
    del preset  # the same grid at every scale; the preset sets only sizes and run length
    return [Setup(ACCURACY, mp_name(p, c, pol), {"precision": p, "cache_size": c, "policy": pol,
                                                 "rounding": "stochastic"}, seeds, [ACCURACY])
            for p, c, pol in ACCURACY_SETUPS]


def t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer `df`: the finite series of Abramowitz & Stegun 26.7.3-4.

    Why not scipy: the package does not depend on it, and seeds (hence df) are whole numbers.
    """
    if df < 1:
        raise SlipcacheError(f"degrees of freedom must be at least 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= cos2 * (k - 1) / k
            total += term
        return sin * total
    total = 0.0  # 2/pi * (theta + sin * (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... up to cos^(df-2)))
    if df > 1:
        term = total = math.cos(theta)
        for k in range(3, df - 1, 2):
            term *= cos2 * (k - 1) / k
            total += term
    return 2 / math.pi * (theta + sin * total)


def t_critical(df: int, confidence: float = ACCURACY_CONFIDENCE) -> float:
    """The t with P(|T| < t) = confidence (2.776 for df 4 at 95 %), by bisection on the series."""
    low, high = 0.0, 1.0
    while t_two_sided_mass(high, df) < confidence:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if t_two_sided_mass(mid, df) < confidence else (low, mid)
    return (low + high) / 2


def paired_interval(diffs: list[float], confidence: float = ACCURACY_CONFIDENCE) -> dict[str, Any] | None:
    """Mean of per-seed differences and its paired t-interval (None bounds with a single seed)."""
    if not diffs:
        return None
    n, mean = len(diffs), statistics.fmean(diffs)
    if n == 1:
        return {"mean": mean, "n": 1, "std": None, "half_width": None, "low": None, "high": None}
    std = statistics.stdev(diffs)
    half = t_critical(n - 1, confidence) * std / math.sqrt(n)
    return {"mean": mean, "n": n, "std": std, "half_width": half, "low": mean - half, "high": mean + half}


def accuracy_intervals(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setup: ΔAUC and Δ log loss against fp32 on the seeds both ran, with their 95 % intervals."""
    base = next((e for e in entries if e["name"] == BASELINE), None)
    rows = []
    for e in entries:
        if base is None or e is base:
            continue
        seeds = sorted(set(e["per_seed"]) & set(base["per_seed"]), key=int)
        row: dict[str, Any] = {"setup": e["name"], "seeds": [int(s) for s in seeds]}
        for key in ("auc", "logloss"):
            pairs = [(e["per_seed"][s].get(key), base["per_seed"][s].get(key)) for s in seeds]
            row[f"{key}_delta"] = paired_interval([a - b for a, b in pairs if a is not None and b is not None])
        row["verdict"] = tolerance_verdict(row["auc_delta"])
        rows.append(row)
    return rows


def tolerance_verdict(interval: dict[str, Any] | None, tolerance: float = ACCURACY_TOLERANCE) -> str:
    """Whether ΔAUC is within `tolerance` with its whole interval inside ± tolerance (the paper's claim)."""
    if not interval or interval["low"] is None:
        return "too few seeds for an interval"
    low, high = interval["low"], interval["high"]
    if -tolerance < low and high < tolerance:
        return f"met: interval inside ±{tolerance:g}"
    if high < -tolerance or low > tolerance:
        side = "loss" if high < 0 else "gain"
        return f"missed: a {side} beyond {tolerance:g} (whole interval)"
    beyond = max(-tolerance - low, high - tolerance)
    return f"not shown: interval reaches {beyond:.2g} beyond ±{tolerance:g}"


def validation_curves(out: Path, results: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, list]:
    """Per setup: (samples, validation AUC averaged over the seeds evaluated there), from metrics.jsonl."""
    curves: dict[str, list] = {}
    for e in entries:
        points: dict[int, list[float]] = {}
        for cell in (c for c in results["cells"] if c["setup"] == e["name"]):
            path = out / "cells" / cell["id"] / "metrics.jsonl"
            for line in path.read_text().splitlines() if path.is_file() else []:
                event = json.loads(line)
                if event.get("val_auc") is not None:
                    points.setdefault(event["samples"], []).append(event["val_auc"])
        curves[e["name"]] = [(s, statistics.fmean(v)) for s, v in sorted(points.items())]
    return curves


def validation_slopes(curve: list[tuple[int, float]], epochs: int) -> tuple[float, float] | None:
    """Validation AUC gained per epoch at the end (from the last evaluation at least an epoch before the
    final one) and at the start (first two evaluations): how flat the curve has become."""
    if len(curve) < 3 or epochs < 2:
        return None
    per_epoch = curve[-1][0] / epochs
    earlier = [(s, auc) for s, auc in curve if s <= curve[-1][0] - per_epoch]
    if not earlier:
        return None
    (s0, a0), (s1, a1) = earlier[-1], curve[-1]
    (f0, b0), (f1, b1) = curve[0], curve[1]
    return (a1 - a0) * per_epoch / (s1 - s0), (b1 - b0) * per_epoch / (f1 - f0)


def plot_accuracy_intervals(rows: list[dict[str, Any]], entries: list[dict[str, Any]],
                            curves: dict[str, list], path: Path) -> str | None:
    """ΔAUC and Δ log loss vs fp32 with 95 % intervals and per-seed points, then the validation curves."""
    plt = _plt()
    rows = [r for r in rows if r["auc_delta"]]
    if not rows:
        return None
    by = {e["name"]: e for e in entries}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [3, 3, 4]})
    xs = range(len(rows))
    for ax, key, label in ((axes[0], "auc", "test AUC"), (axes[1], "logloss", "test log loss")):
        if key == "auc":
            ax.axhspan(-1e3 * ACCURACY_TOLERANCE, 1e3 * ACCURACY_TOLERANCE, color="tab:green", alpha=0.12,
                       label=f"target: interval inside ±{ACCURACY_TOLERANCE:g}")
        ax.axhline(0, color="0.3", linewidth=0.8)
        for x, r in zip(xs, rows, strict=True):
            stat = r[f"{key}_delta"]
            color = PRECISION_COLORS.get(by[r["setup"]]["overrides"]["precision"], "k")
            per_seed = [by[r["setup"]]["per_seed"][str(s)] for s in r["seeds"]]
            base = by[BASELINE]["per_seed"]
            dots = [1e3 * (p[key] - base[str(s)][key]) for p, s in zip(per_seed, r["seeds"], strict=True)]
            ax.scatter([x + 0.18] * len(dots), dots, s=12, color=color, alpha=0.5)
            ax.errorbar(x, 1e3 * stat["mean"], yerr=1e3 * stat["half_width"] if stat["half_width"] else None,
                        fmt="o", color=color, capsize=5, markersize=7)
        ax.set_xticks(list(xs), [r["setup"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(f"{label} minus fp32, same seed (x 1e-3)")
        n = min(r[f"{key}_delta"]["n"] for r in rows)
        ax.set_title(f"Δ {label}: mean, 95% interval, seeds (n={n})")
        if key == "auc":
            ax.legend(loc="best", fontsize=8)
    right = axes[2]
    for e in entries:
        curve = curves.get(e["name"])
        if curve:
            o = e["overrides"]
            right.plot(*zip(*curve, strict=True), marker=CACHE_MARKERS.get(o["cache_size"], "*"), markersize=4,
                       color=PRECISION_COLORS.get(o["precision"]), linewidth=2.5 if e["name"] == BASELINE else 1.2,
                       linestyle="--" if o["policy"] == "lfu" and o["cache_size"] else "-", label=e["name"],
                       zorder=3 if e["name"] == BASELINE else 2)
    right.set_xlabel("training samples")
    right.set_ylabel("validation AUC (mean over seeds)")
    right.set_title("Validation AUC during training")
    if right.lines:
        right.legend(fontsize=8)
    return _save(fig, path)


def _interval_text(stat: dict[str, Any] | None) -> str:
    if not stat:
        return "n/a"

    def signed(x: float) -> str:
        return f"{round(x, 4) + 0.0:+.4f}"  # + 0.0: no "-0.0000"

    if stat["low"] is None:
        return signed(stat["mean"])
    return f"{signed(stat['mean'])} [{signed(stat['low'])}, {signed(stat['high'])}]"


def accuracy_section(out: Path, results: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    from slipcache.training.report import STYLE

    rows = accuracy_intervals(entries)
    curves = validation_curves(out, results, entries)
    with _plt().rc_context(STYLE):
        plot = plot_accuracy_intervals(rows, entries, curves, out / "accuracy_intervals.png")
    by = {e["name"]: e for e in entries}
    base = by.get(BASELINE)
    cells = [c for c in results["cells"] if c["experiment"] == ACCURACY]
    config = cells[0]["summary"].get("config", {}) if cells else {}
    epochs = config.get("epochs") or results["preset"].get("accuracy_epochs") or 0
    data = (f"`{results['data']}`" if results.get("data") else
            f"synthetic data, generator {config.get('synthetic_generator', 'v2')}, "
            f"{config.get('synthetic_samples', 0):,} rows at scale {config.get('synthetic_scale', 0):g}"
            + (f" (`{cells[0]['dataset']}` in the cache)" if cells[0].get("dataset") else ""))
    lines = ["## Accuracy against fp32, paired over seeds", "",
             f"Data: {data}; {epochs} epoch(s) of the training split, batch {config.get('batch_size')}, "
             f"lr {config.get('lr')}; test AUC and log loss on the test split. A seed gives every setup the same "
             "data order and the same initial fp32 rows (low precision stores their rounding), so the per-seed "
             "difference to fp32 measures storage and cache alone. Intervals: 95% paired t-interval over seeds, "
             "mean ± t(0.975, n-1) · sd / √n of the per-seed differences.", ""]
    if base:
        slopes = validation_slopes(curves.get(BASELINE, []), epochs)
        lines += [f"Reference `{BASELINE}`: test AUC {_pm(base, 'auc')}, log loss {_pm(base, 'logloss')} "
                  f"(mean ± sd over {base['seeds']} seed(s))."
                  + (f" Its validation AUC (mean over seeds) moved by {slopes[0]:+.4f} per epoch at the end of "
                     f"training, against {slopes[1]:+.4f} per epoch at the start." if slopes else ""), ""]
    lines += _table(
        ["setup", "n", "test AUC", "ΔAUC [95% CI]", "Δ log loss [95% CI]", "memory saving", "hit rate",
         f"within ±{ACCURACY_TOLERANCE:g}?"],
        [[r["setup"], str(r["auc_delta"]["n"] if r["auc_delta"] else 0), _pm(by[r["setup"]], "auc"),
          _interval_text(r["auc_delta"]), _interval_text(r["logloss_delta"]),
          _f(_m(by[r["setup"]], "memory_ratio"), ".2f") + "x",
          _f(100 * _m(by[r["setup"]], "cache_hit_rate"), ".1f") + "%" if _m(by[r["setup"]], "cache_hit_rate") else "-",
          r["verdict"]] for r in rows],
    )
    if plot:
        lines += ["", f"![accuracy with intervals]({plot})"]
    lines += ["", answer_accuracy(rows), ""]
    return lines


def answer_accuracy(rows: list[dict[str, Any]]) -> str:
    """The claim (INT8 + 5 % cache) against the target, then INT4 + 1 % as measured."""
    by = {r["setup"]: r for r in rows}
    parts = []
    for name in (mp_name("int8", 0.05, "lru"), mp_name("int8", 0.05, "lfu"), mp_name("int4", 0.01, "lru")):
        r = by.get(name)
        if r and r["auc_delta"]:
            parts.append(f"{name}: ΔAUC {_interval_text(r['auc_delta'])} over {r['auc_delta']['n']} seed(s), "
                         f"{r['verdict']}")
    if not parts:
        return "**Accuracy.** No low-precision setup finished."
    return (f"**Accuracy.** Target: INT8 + 5% cache within {ACCURACY_TOLERANCE:g} AUC of fp32 with its 95% "
            "interval inside that band. " + "; ".join(parts) + ".")


# ----------------------------------------------------------------------------------------------------
# The command


def machine_section(machine: dict[str, Any], probes: dict[str, Any], threads: int) -> list[str]:
    gather, copy = probes.get("random_gather", {}), probes.get("sequential_copy", {})
    return [
        "## Machine", "",
        f"{machine.get('cpu_model')}, {machine.get('usable_cores')} usable cores, "
        f"{(machine.get('memory_total_bytes') or 0) / 2**30:.0f} GiB; torch {machine.get('torch')} with "
        f"{threads} thread(s) per run (two threads on two shared cores ran ~40x slower than one here: OpenMP "
        "workers spin while other jobs hold the cores).", "",
        *_table(["probe", "result"], [
            ["sequential copy", f"{_f(copy.get('copy_gb_s'), '.2f')} GB/s copied "
                                f"({_f(copy.get('traffic_gb_s'), '.2f')} GB/s read + written)"],
            ["random 64-byte row gather", f"{_f((gather.get('rows_per_s') or 0) / 1e6, '.1f')} M rows/s "
                                          f"= {_f(gather.get('gb_s'), '.2f')} GB/s from a "
                                          f"{(gather.get('table_bytes') or 0) / 2**20:.0f} MiB table"],
        ]),
        "",
        "The memory bound in RQ5 divides the gather rate by the cache lines a training sample touches in the "
        "embedding layer (26 lookups read and write a row; cache misses add the rows moved in and out).", "",
    ]


def write_report(out: Path, results: dict[str, Any]) -> Path:
    """report.md and its PNGs from results.json's content (so a report can be rebuilt from it)."""
    from slipcache.training.report import STYLE

    plt = _plt()
    entries = results["setups"]
    mp = [e for e in entries if e["experiment"] == "mixed-precision"]
    accuracy = [e for e in entries if e["experiment"] == ACCURACY]
    stale = [e for e in entries if e["experiment"] == "slipstream"]
    events = {}
    for e in stale:  # seed-0 event series of each setup
        cell = next((c for c in results["cells"] if c["setup"] == e["name"] and c["seed"] == 0), None)
        if cell:
            path = out / "cells" / cell["id"] / "metrics.jsonl"
            text = path.read_text() if path.is_file() else ""
            events[e["name"]] = [json.loads(line) for line in text.splitlines() if line.strip()]
    with plt.rc_context(STYLE):
        plots = {
            "accuracy_memory": plot_accuracy_memory(mp, out / "accuracy_vs_memory.png"),
            "cache_sweep": plot_cache_sweep(on_seeds([e for e in mp if {"RQ2", "RQ3"} & set(e["questions"])])[0],
                                            out / "cache_sweep.png"),
            "rounding": plot_rounding(mp, out / "rounding.png"),
            "traffic": plot_traffic(mp, out / "bytes_moved.png"),
            "skip_speedup": plot_skip_speedup(stale, out / "skip_speedup.png"),
            "stale_rows": plot_stale_rows(stale, events, out / "stale_rows.png"),
        }
    preset = results["preset"]
    lines = [
        "# slipcache experiments", "",
        f"`slipcache experiment {results['name']}` ({preset['name']} preset), "
        f"written {results['written']}. Synthetic Criteo-Kaggle-shaped data at scale {preset['scale']:g} unless "
        f"`--data` was given ({results.get('data') or 'synthetic'}); every number below is generated from "
        "`results.json`.", "",
    ]
    lines += machine_section(results["machine"], results["probes"], results["threads"])
    if mp:
        lines += mixed_precision_section(mp, plots, results.get("table_sizes"))
    if stale:
        lines += slipstream_section(stale, plots, results.get("repeats", 1), results["threads"])
    if accuracy:
        lines += accuracy_section(out, results, accuracy)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    hidden = argparse.SUPPRESS
    parser.add_argument("name", choices=NAMES, help="which experiment grid to run")
    parser.add_argument("--out", required=True, help="output directory (reused: finished runs are kept)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny data and a reduced grid (a few minutes); exercises every question and plot")
    parser.add_argument("--data", default=None, help="a preprocessed dataset dir (or raw Criteo files, "
                        "preprocessed once into OUT/data); default: synthetic data. Slipstream runs whole "
                        "epochs of its training split")
    parser.add_argument("--generator", choices=tuple(GENERATOR_VERSIONS), default=DEFAULT_GENERATOR,
                        help="synthetic data generator (default v3; v2 reproduces figures measured before v3)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds of the key setups (default 3, quick 1; accuracy: 5); sweep setups run one seed")
    parser.add_argument("--repeats", type=int, default=None,
                        help="slipstream: timed runs of seed 0 per setup, interleaved A B A B (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1: on a shared machine more threads oversubscribe)")
    parser.add_argument("--accuracy-epochs", type=int, default=None,
                        help="accuracy: passes over the training split (default 3, quick 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per batch (default 512)")
    # Hidden size overrides, for tests and for fitting a time budget.
    for flag, kind in (("--scale", float), ("--dataset-samples", int), ("--train-samples", int),
                       ("--stale-dataset-samples", int), ("--stale-epochs", int), ("--eval-samples", int),
                       ("--probe-seconds", float), ("--probe-table-bytes", int)):
        parser.add_argument(flag, type=kind, default=None, help=hidden)


def _resolve_preset(args: argparse.Namespace) -> Preset:
    preset = PRESETS["quick" if args.quick else "full"]
    changes = {name: getattr(args, name) for name in ("scale", "dataset_samples", "train_samples",
                                                       "stale_dataset_samples", "stale_epochs", "eval_samples",
                                                       "probe_seconds", "probe_table_bytes", "accuracy_epochs",
                                                       "batch_size")
               if getattr(args, name, None) is not None}
    for name, value in changes.items():
        if not value > 0:
            raise SlipcacheError(f"--{name.replace('_', '-')} must be positive, got {value}")
    return Preset(**{**asdict(preset), **changes})


def _prepare_data(data: str | None, out: Path) -> tuple[str | None, list[int] | None]:
    """The preprocessed dataset every cell reads (raw files are preprocessed once), and its table sizes."""
    if data is None:
        return None, None
    config = trainer.TrainConfig(data=data, progress=True)
    path = trainer.prepare_data(config, out / "data")
    return str(path), trainer.open_dataset(path).table_sizes


def run_experiment(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> int:
    log = log or (lambda line: print(line, flush=True))
    if args.threads < 1:
        raise SlipcacheError(f"--threads must be at least 1, got {args.threads}")
    preset = _resolve_preset(args)
    seeds = args.seeds if args.seeds is not None else ACCURACY_SEEDS if args.name == ACCURACY else preset.key_seeds
    if seeds < 1:
        raise SlipcacheError(f"--seeds must be at least 1, got {seeds}")
    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SlipcacheError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, preset, seeds, names, out, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace, preset: Preset, seeds: int, names: list[str], out: Path,
         log: Callable[[str], None]) -> int:
    from slipcache.experiments.machine import describe_machine, probe_memory

    start = time.perf_counter()
    data, table_sizes = _prepare_data(args.data, out)
    repeats = args.repeats if getattr(args, "repeats", None) is not None else preset.repeats
    if repeats < 1:
        raise SlipcacheError(f"--repeats must be at least 1, got {repeats}")
    generator = getattr(args, "generator", DEFAULT_GENERATOR)
    plan = Plan(preset, out, data, seeds, generator=generator, repeats=repeats)
    setups: list[Setup] = []
    records: list[dict[str, Any]] = []
    log(f"probing memory ({2 * preset.probe_seconds:g} s) ...")
    probes = probe_memory(table_bytes=preset.probe_table_bytes, copy_bytes=min(preset.probe_table_bytes, 256 << 20),
                          seconds=preset.probe_seconds)
    for name in names:
        grids = {"mixed-precision": mixed_precision_grid, "slipstream": slipstream_grid, ACCURACY: accuracy_grid}
        grid = grids[name](preset, seeds)
        if data is None:  # generate the synthetic data up front, so the first cell's time is its own
            from slipcache.data.synthetic import default_synthetic_path, synthetic_table_sizes

            n = preset.stale_dataset_samples if name == "slipstream" else preset.dataset_samples
            dataset = default_synthetic_path(None, n, preset.scale, 0, generator=generator, progress=True).name
            table_sizes = synthetic_table_sizes(preset.scale)
        setups += grid
        records += run_cells(plan, plan.cells(grid, dataset if data is None else ""), name, log)
    num_tables = len(table_sizes) if table_sizes else 26
    for record in records:
        record["derived"] = derived_metrics(record, probes, num_tables)
    results = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "name": args.name,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "preset": asdict(preset),
        "seeds": seeds,
        "repeats": repeats,
        "threads": args.threads,
        "data": data,
        "generator": None if data is not None else generator,
        "table_sizes": table_sizes,
        "machine": describe_machine(),
        "probes": probes,
        "paper": PAPER,
        "cells": records,
        "setups": aggregate(setups, [r for r in records if not r.get("repeat")]),
    }
    add_timing(results["setups"], records)
    if ACCURACY in names:
        results["accuracy"] = accuracy_intervals([e for e in results["setups"] if e["experiment"] == ACCURACY])
    write_json(out / "results.json", results)
    report = write_report(out, results)
    log(f"wrote {out / 'results.json'} and {report} in {_duration(time.perf_counter() - start)}")
    return 0
