"""Presets, setups and cells of the experiment grids, and running the cells (resumable, one directory each).

The cell id holds a hash of the run's whole config, so changing a preset or an option makes new cells
instead of silently reusing results of a different run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slipcache.data.synthetic import DEFAULT_GENERATOR
from slipcache.training import trainer
from slipcache.training.rundir import write_json

EXPERIMENTS = ("mixed-precision", "slipstream")
ACCURACY = "accuracy"  # the settled accuracy claim: a few setups, many paired seeds, whole epochs
NAMES = (*EXPERIMENTS, ACCURACY, "all")  # "all" runs EXPERIMENTS; the accuracy study is run on its own
# Headline numbers of the papers, compared against in the report.
PAPER = {
    "int8_5_memory_ratio": 3.0,
    "int4_1_memory_ratio": 7.0,
    "cache_speedup": 1.16,
    "skip_speedup_vs_xdl": 2.0,
    "skip_speedup_vs_fae": 1.2,
}


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
    overrides: dict[str, Any]  # TrainConfig keys this setup sets
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
        TrainConfig setting does not orphan every finished cell of a grid that resumes across sessions.
        """
        full = {k: v for k, v in {**trainer.TrainConfig().flat(), **self.values}.items() if v is not None}
        if self.dataset:
            full["dataset"] = self.dataset
        digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:8]
        slug = re.sub(r"[^a-z0-9.]+", "-", self.setup.name.lower()).strip("-")
        again = f"-r{self.repeat}" if self.repeat else ""
        return f"{self.setup.experiment}-{slug}-s{self.seed}{again}-{digest}"


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
            if v.get("skip_rule"):
                samples *= 1 - 0.5 * v.get("stale_target", 0.0)
        return samples / p.rate_guess + p.overhead_guess_s


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt_duration(seconds: float) -> str:
    """m:ss or h:mm:ss, for progress lines and estimates."""
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
    config = trainer.TrainConfig.from_flat({**cell.values, "out": str(cell_dir)})
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
        "cpu_curve": eval_curve(cell_dir / "metrics.jsonl", clock="train_cpu_s"),
        "config": cell.values,
        "dataset": cell.dataset or None,
        "summary": on_disk if isinstance(on_disk, dict) else summary,
        "embedding_traffic": traffic,
        "cell_wall_s": wall_s,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_json(record_path, record)
    return record, True


def eval_curve(metrics: Path, clock: str = "train_seconds") -> list[list[float]]:
    """[training seconds, validation AUC] of each evaluation of a run, in order.

    Training seconds exclude evaluation: `train_seconds` where the trainer writes it, else `train_wall_s`;
    `clock="train_cpu_s"`: the same span in process CPU time (empty for runs that did not record it).
    """
    curve = []
    text = metrics.read_text() if metrics.is_file() else ""
    for line in text.splitlines():
        event = json.loads(line) if line.strip() else {}
        if event.get("val_auc") is not None:
            seconds = event.get(clock, event.get("train_wall_s") if clock == "train_seconds" else None)
            if seconds is not None:
                curve.append([float(seconds), float(event["val_auc"])])
    return curve


def run_cells(plan: Plan, cells: list[Cell], label: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every unfinished cell in order with a progress line each (i/n, wall time, ETA)."""
    cells_dir = plan.out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not _is_done(cells_dir / c.id, c.id)]
    estimate = sum(plan.estimate_s(c) for c in todo)
    log(f"{label}: {len(cells)} runs, {len(cells) - len(todo)} already done; "
        f"estimated {fmt_duration(estimate)} for the remaining {len(todo)}")
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
            f"ETA {fmt_duration(remaining * spent / guessed)}")
    return records


def _is_done(cell_dir: Path, cell_id: str) -> bool:
    record = _read_json(cell_dir / "cell.json")
    return isinstance(record, dict) and record.get("id") == cell_id and "summary" in record


def prepare_experiment_data(data: str | None, out: Path) -> tuple[str | None, list[int] | None]:
    """The preprocessed dataset every cell reads (raw files are preprocessed once), and its table sizes."""
    if data is None:
        return None, None
    config = trainer.TrainConfig.from_flat({"data": data, "progress": True})
    path = trainer.prepare_data(config, out / "data")
    return str(path), trainer.open_dataset(path).table_sizes
