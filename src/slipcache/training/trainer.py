"""Training and evaluation of DLRM: `slipcache train` and `slipcache eval`.

Read top to bottom: the config (`TrainConfig`, how a file and command-line flags combine into it), where
the data comes from (`prepare_data`), evaluation, then the training loop (`train`), which writes a run
directory:

    <out>/config.json      the resolved config
    <out>/metrics.jsonl    one JSON object per logging or evaluation event
    <out>/summary.json     final test metrics, throughput, memory
    <out>/report.md        plots of the above (see slipcache.training.report)
    <out>/checkpoints/     latest.pt plus the newest periodic checkpoints (atomic, checksummed writes)

Raw Criteo input is preprocessed once into the cache ($SLIPCACHE_CACHE_DIR, else ~/.cache/slipcache),
under `preprocessed/`; nothing is written outside `<out>` and the cache. `--out` must be new, empty, or
a run that stopped before its first checkpoint; `--resume` writes only into the run it names.

Determinism: everything random is seeded from `config.seed` (model init, shuffling, stochastic rounding
inside the embedding collection), and a checkpoint holds every piece of state the loop reads, so an
interrupted run resumed with `--resume` ends exactly where the uninterrupted run ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
import types
import typing
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from slipcache.data.synthetic import GENERATOR_VERSIONS
from slipcache.embedding.cache import LOOKAHEAD_POLICIES, POLICIES
from slipcache.embedding.collection import OPTIMIZERS
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS
from slipcache.errors import SlipcacheError
from slipcache.model import DLRM, EMBEDDING_KINDS, ModelConfig, build_embeddings
from slipcache.training import checkpoint as ckpt
from slipcache.training.metrics import evaluate_predictions
from slipcache.training.tensorboard import embedding_event_fields, open_writer

if typing.TYPE_CHECKING:
    from slipcache.distributed.training import DistributedRun
    from slipcache.staleness.skipping import StaleSkipper

VOCABS = ("hash", "frequency")

CHECKPOINT_FORMAT = ckpt.MAGIC


# ----------------------------------------------------------------------------------------------------
# Config


@dataclass
class TrainConfig:
    """Everything a run depends on. `None` fields are derived from the data in `resolve_schedule`."""

    # data and run directory
    data: str | None = None  # raw Criteo file/dir, or a preprocessed dataset dir; None = synthetic data
    out: str | None = None  # run directory; default runs/<timestamp>
    resume: str | None = None  # run directory or checkpoint file to continue from
    allow_changes: bool = False  # resume: accept settings that differ from the run's (they are recorded)
    vocab: str = "hash"  # raw data only: "hash" (fixed table size) or "frequency" (ids by count)
    max_rows: int = 1_000_000  # raw data, hash vocabulary: rows per table (DLRM's max-ind-range)
    min_count: int = 1  # raw data, frequency vocabulary: rarer values map to row 0 ("unknown")
    synthetic_samples: int = 4_000_000  # synthetic data: rows generated (80/10/10 train/val/test)
    synthetic_scale: float = 0.05  # synthetic data: table sizes relative to Criteo Kaggle
    synthetic_generator: str = "v3"  # synthetic data: "v3" (entities, time order) or "v2" (earlier figures)
    strict: bool = False  # raw data: a malformed line is an error instead of being skipped
    table_sizes: list[int] | None = None  # external formats: rows per table (one for all, or 26); ids modulo
    split_order: str | None = None  # external formats: "val-test" or "test-val" halves of the last day
    # embeddings (see slipcache.embedding.collection / docs/design.md)
    embeddings: str = "cached"  # "cached" (ours) or "torch" (fp32 nn.EmbeddingBag baseline)
    # precision, cache_size, cache_rows: one value, or (config files) a list with one value per table
    precision: str | list[str] = "int8"
    cache_size: float | list[float] = 0.05  # share of all rows the cache holds, in [0, 1] (1.0: every row)
    cache_rows: int | list[int] | None = None  # cache capacity as a row count instead (overrides cache_size)
    policy: str = "lru"
    lookahead: int = 4  # batches ahead the lookahead policies evict by (policy lookahead or lookahead-lfu)
    prefetch: bool = False  # read the next batch's rows into the cache while the current one computes
    rounding: str = "stochastic"
    optimizer: str = "sgd"  # embedding optimizer
    lr: float = 0.3  # embedding learning rate (SGD; tuned on synthetic data at batch 256)
    dense_lr: float | None = None  # MLP learning rate (plain SGD); None = lr
    # model
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    # schedule (all counts are samples)
    batch_size: int = 256
    epochs: int = 1
    samples: int | None = None  # training budget; overrides epochs when set
    log_every: int | None = None
    eval_every: int | None = None
    eval_samples: int | None = 100_000  # validation samples per periodic evaluation; None = all
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    seed: int = 0
    quick: bool = False  # small synthetic run for tests and first contact (see QUICK)
    progress: bool = True  # tqdm progress bar
    tensorboard: str | None = None  # also write metrics as TensorBoard events here; "" = <out>/tensorboard
    # Slipstream stale-input skipping (slipcache.staleness.skipping, docs/skipping.md)
    skip_stale: bool = False  # drop stale inputs while batches are assembled: no forward, no backward
    stale_target: float = 0.3  # D: share of hot inputs to skip, fitted anew each epoch
    stale_guard: bool = True  # back off D (or stop) when skipped inputs' loss drifts above trained ones'
    stale_guard_every: int = 100  # batches between guard checks (each evaluates 2048 inputs, forward only)
    stale_alpha: float = 1.0  # an input is stale when this share of its lookups hit stale rows
    stale_window: float = 0.02  # share of an epoch's batches between the two snapshots of the window
    stale_recheck: int | None = 0  # batches between rolling snapshots; 0 = window length, None = off
    stale_budget_mb: float = 256.0  # hot-row snapshot budget (one snapshot)
    stale_min_accesses: float = 0.0  # hot rows must expect this many accesses per window (0 = paper)
    stale_release_cache: bool = False  # stale rows give their cache slots to rows that still move
    stale_refit: bool = True  # refit T at every rolling re-check so D holds all epoch (paper: once per epoch)
    stale_rule: str = "convergence"  # "convergence" (change per update, measured rows only) or "paper"
    stale_min_updates: int = 4  # convergence rule: updates a row needs before it is judged
    stale_count_share: float = 0.25  # convergence rule: share of each trained batch counted (scaled up)
    stale_warmup: str = "val"  # "val" (validation loss flattened), "epoch" or "none"
    stale_warmup_epoch: int = 1  # 0-based epoch from which skipping may start at the latest (1 = the 2nd)
    stale_warmup_min: float = 0.1  # never skip in this first share of the run
    stale_warmup_tol: float = 0.005  # validation loss "flattened": improved less than this (relative) on its best
    stale_decision: str = "rolling"  # "rolling" re-checks, or "epoch": one decision per epoch (the authors')
    stale_keep: float = 0.05  # p: share of would-be-skipped inputs trained anyway (the guard's control)
    stale_reweight: bool = False  # weight the kept would-be-skipped inputs' loss by 1/p: unbiased gradient

    def embedding_options(self) -> dict[str, Any]:
        """The embedding collection's settings, shared by the one-process and the sharded model."""
        return {
            "precision": self.precision,
            "cache_size": self.cache_size,
            "cache_rows": self.cache_rows,
            "policy": self.policy,
            "rounding": self.rounding,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "seed": self.seed,
        }

    def model_config(self, table_sizes: list[int], num_dense: int) -> ModelConfig:
        return ModelConfig(
            table_sizes=list(table_sizes),
            num_dense=num_dense,
            embedding_dim=self.embedding_dim,
            bottom_mlp=list(self.bottom_mlp),
            top_mlp=list(self.top_mlp),
        )

    def validate(self) -> None:
        for precision in self.precision if isinstance(self.precision, list) else [self.precision]:
            if precision not in PRECISIONS:
                raise SlipcacheError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        choices = {
            "embeddings": EMBEDDING_KINDS,
            "policy": POLICIES,
            "rounding": ROUNDINGS,
            "optimizer": OPTIMIZERS,
            "vocab": VOCABS,
            "synthetic_generator": tuple(GENERATOR_VERSIONS),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise SlipcacheError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        positive = ["batch_size", "epochs", "embedding_dim", "samples", "log_every", "eval_every", "lookahead"]
        positive += ["checkpoint_every", "eval_samples", "synthetic_samples", "max_rows", "min_count"]
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SlipcacheError(f"{name} must be positive, got {value}")
        for name in _FIELDS:  # types first: a crafted checkpoint or API call may hold anything
            value = _coerce(name, getattr(self, name))
            if isinstance(value, float) and not math.isfinite(value):
                raise SlipcacheError(f"{name} must be a finite number, got {value}")
        for name in ("lr", "dense_lr", "synthetic_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # also rejects nan
                raise SlipcacheError(f"{name} must be positive, got {value}")
        if self.split_order not in (None, "val-test", "test-val"):
            raise SlipcacheError(f"split_order must be val-test or test-val, got {self.split_order!r}")
        if self.table_sizes is not None and (not self.table_sizes or min(self.table_sizes) < 1):
            raise SlipcacheError(f"table_sizes must be positive row counts, got {self.table_sizes}")
        for share in self.cache_size if isinstance(self.cache_size, list) else [self.cache_size]:
            if not 0.0 <= share <= 1.0:  # also rejects nan and inf
                hint = f" (for a number of rows use --cache-rows {share:g})" if share > 1 else ""
                raise SlipcacheError(f"cache_size is the share of rows cached, in [0, 1]; got {share}{hint}")
        for count in self.cache_rows if isinstance(self.cache_rows, list) else [self.cache_rows]:
            if count is not None and count < 0:
                raise SlipcacheError(f"cache_rows must be >= 0, got {count}")
        if not 0 <= self.seed < 2**32:
            raise SlipcacheError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.keep_checkpoints < 1:
            raise SlipcacheError(f"keep_checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.bottom_mlp[-1:] != [self.embedding_dim]:
            raise SlipcacheError(
                f"bottom_mlp must end in the embedding dim {self.embedding_dim}, got {self.bottom_mlp}"
            )
        if any(n < 1 for n in [*self.bottom_mlp, *self.top_mlp]):
            raise SlipcacheError(f"MLP layer sizes must be positive, got {self.bottom_mlp} and {self.top_mlp}")
        if self.top_mlp[-1:] != [1]:
            raise SlipcacheError(f"top_mlp must end in 1 (the logit), got {self.top_mlp}")
        if not 0.0 <= self.stale_target <= 1.0 or not 0.0 < self.stale_alpha <= 1.0:
            raise SlipcacheError("stale_target must be in [0, 1] and stale_alpha in (0, 1]")
        if not 0.0 < self.stale_window <= 1.0 or self.stale_guard_every < 1 or not self.stale_budget_mb > 0:
            raise SlipcacheError(
                "stale_window must be in (0, 1], stale_guard_every >= 1, stale_budget_mb > 0"
            )
        from slipcache.staleness.detector import RULES
        from slipcache.staleness.skipping import DECISIONS, WARMUPS

        for name, allowed in (("stale_rule", RULES), ("stale_warmup", WARMUPS), ("stale_decision", DECISIONS)):
            if getattr(self, name) not in allowed:
                raise SlipcacheError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.stale_min_updates < 1 or self.stale_warmup_epoch < 0 or not 0.0 <= self.stale_warmup_min < 1.0:
            raise SlipcacheError("stale_min_updates must be >= 1, stale_warmup_epoch >= 0, stale_warmup_min in [0, 1)")
        if not 0.0 < self.stale_count_share <= 1.0:
            raise SlipcacheError(f"stale_count_share must be in (0, 1], got {self.stale_count_share}")
        if not 0.0 <= self.stale_keep <= 1.0 or not 0.0 <= self.stale_warmup_tol < 1.0:
            raise SlipcacheError("stale_keep must be in [0, 1] and stale_warmup_tol in [0, 1)")
        if self.stale_reweight and self.stale_keep == 0.0:
            raise SlipcacheError("stale_reweight needs stale_keep > 0 (the kept share p is weighted 1/p)")
        if (self.stale_recheck is not None and self.stale_recheck < 0) or not self.stale_min_accesses >= 0:
            raise SlipcacheError(
                "stale_recheck must be >= 0 (0 = window length) or None, stale_min_accesses >= 0"
            )


# `--quick`: a scaled-down synthetic dataset, smaller MLPs and a 600k-sample budget; applied only to
# fields the user did not set. Tuned for test AUC > 0.70 (measured 0.714) in ~20 s on 2 idle CPU cores.
QUICK: dict[str, Any] = {
    "synthetic_samples": 800_000,
    "synthetic_scale": 0.02,
    "samples": 600_000,
    "lr": 0.5,
    "batch_size": 256,
    "eval_samples": 20_000,
    "bottom_mlp": [128, 64, 16],
    "top_mlp": [128, 64, 1],
}

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: Any) -> Any:
    """Check a config-file value against the field's type (ints are accepted where floats are)."""
    kind = _TYPES[name]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(kind):
            return None
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if isinstance(value, list):  # `str | list[str]`: one value or one per table
            listed = [a for a in options if typing.get_origin(a) is list]
            element = typing.get_args(listed[0])[0] if listed else None
            if element is not None and value and all(_matches(element, v) for v in value):
                return [float(v) if element is float else int(v) if element is int else v for v in value]
        kind = options[0]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(kind) is list:
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
    elif kind is bool and isinstance(value, bool):
        return value
    elif kind is int and is_number and float(value).is_integer():
        return int(value)  # also 1e6 written as a float
    elif kind is float and is_number:
        return float(value)
    elif kind is str and isinstance(value, str):
        return value
    raise SlipcacheError(f"{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def _matches(kind: type, value: Any) -> bool:
    """Whether a config-file list element fits `kind` (ints are accepted where floats are)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float:
        return number
    if kind is int:
        return number and float(value).is_integer()
    return isinstance(value, kind)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml/.json) config file into {field: value}."""
    path = Path(path)
    if not path.is_file():
        raise SlipcacheError(f"config file not found: {path}")
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(path.read_text())
        else:
            import yaml

            raw = yaml.safe_load(path.read_text()) or {}
    except Exception as exc:  # parse errors of either format
        raise SlipcacheError(f"cannot parse config file {path}: {exc}".splitlines()[0]) from exc
    if not isinstance(raw, dict):
        raise SlipcacheError(f"config file {path} must hold a mapping of keys to values")
    raw = raw.get("train", raw) if isinstance(raw.get("train"), dict) else raw
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            raise SlipcacheError(
                f"unknown key {key!r} in config file {path}; valid keys: {', '.join(sorted(_FIELDS))}"
            )
        values[name] = _coerce(name, value)
    return values


def make_config(
    file_values: dict[str, Any] | None = None, flag_values: dict[str, Any] | None = None
) -> TrainConfig:
    """Defaults, then the config file, then command-line flags; `--quick` fills only what neither set."""
    user = {**(file_values or {}), **(flag_values or {})}
    given = {**QUICK, **user} if user.get("quick") else dict(user)
    if "embedding_dim" in user and "bottom_mlp" not in user:
        # The bottom MLP's output meets the embeddings, so its last layer follows --dim.
        base = given.get("bottom_mlp", TrainConfig().bottom_mlp)
        given["bottom_mlp"] = [*base[:-1], user["embedding_dim"]]
    config = TrainConfig(**given)
    config.validate()
    return config


# ----------------------------------------------------------------------------------------------------
# Data


def _synthetic_dataset(config: TrainConfig) -> Path:
    from slipcache.data.synthetic import default_synthetic_path

    # Dataset seed 0 whatever the run seed: runs with different seeds then compare on the same data.
    return default_synthetic_path(
        None,
        config.synthetic_samples,
        config.synthetic_scale,
        0,
        generator=config.synthetic_generator,
        progress=config.progress,
    )


def _raw_inputs(path: Path) -> list[Path]:
    files = (
        sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        if path.is_dir()
        else [path]
    )
    if not files:
        raise SlipcacheError(f"no data files in {path}")
    return files


def preprocessed_root() -> Path:
    """Where raw input is preprocessed to: `preprocessed/` in the cache ($SLIPCACHE_CACHE_DIR, else
    ~/.cache/slipcache), shared by every run that reads the same files with the same options."""
    from slipcache.data.synthetic import default_cache_root

    return default_cache_root() / "preprocessed"


def prepare_data(config: TrainConfig, cache_root: Path | None = None) -> Path:
    """The preprocessed dataset dir for `config.data`, preprocessing raw files into `cache_root` once.

    The cache key covers the input files (path, size, mtime) and every preprocessing option, so a
    changed file or option produces a new dataset instead of silently reusing a stale one.
    """
    if config.data is None:
        return _synthetic_dataset(config)
    path = Path(config.data).expanduser().resolve()
    if not path.exists():
        raise SlipcacheError(f"data not found: {path}")
    from slipcache.data.formats import detect_format

    if (path / "meta.json").is_file() or detect_format(path) is not None:
        return path  # read in place (slipcache.data.formats)
    cache_root = cache_root if cache_root is not None else preprocessed_root()
    inputs = _raw_inputs(path)
    key_parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in inputs]
    key_parts += [config.vocab, str(config.max_rows), str(config.min_count), str(config.strict)]
    key = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()[:12]
    out_dir = cache_root / f"{path.stem}-{config.vocab}-{key}"
    if (out_dir / "meta.json").is_file():
        return out_dir
    from slipcache.data.dataset import remove_dead_staging
    from slipcache.data.preprocess import preprocess

    if cache_root.is_dir():  # what preprocessing runs killed before finishing left behind
        for other in cache_root.iterdir():
            if other.is_dir():
                remove_dead_staging(other)
    # Held-back splits: contiguous 80/10/10 in file order (Criteo is time-ordered), the preprocess default.
    # Hash seed 0 whatever the run seed, so runs with different seeds share one preprocessed dataset.
    preprocess(
        inputs,
        out_dir,
        vocab=config.vocab,
        min_count=config.min_count,
        max_rows=config.max_rows,
        strict=config.strict,
        progress=config.progress,
        seed=0,
    )
    return out_dir


def open_dataset(path: Path, config: TrainConfig | None = None) -> Any:
    from slipcache.data.formats import open_any

    try:
        if config is None:
            return open_any(path)
        return open_any(path, table_sizes=config.table_sizes, split_order=config.split_order)
    except SlipcacheError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise SlipcacheError(f"cannot open dataset {path}: {exc}") from exc


# ----------------------------------------------------------------------------------------------------
# Model, evaluation


def build_model(config: TrainConfig, table_sizes: list[int], num_dense: int) -> DLRM:
    embeddings = build_embeddings(
        list(table_sizes), config.embedding_dim, embeddings=config.embeddings, **config.embedding_options()
    )
    return DLRM(config.model_config(table_sizes, num_dense), embeddings)


def embedding_optimizer(config: TrainConfig, model: DLRM) -> torch.optim.Optimizer | None:
    """A torch optimizer for embeddings without a fused update (the baseline); sparse gradients."""
    if model.embeddings.fused_update:
        return None
    params = list(model.embeddings.parameters())
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=config.lr)
    raise SlipcacheError(f"optimizer {config.optimizer!r} needs the cached embeddings (--embeddings cached)")


@torch.no_grad()
def evaluate(
    model: DLRM, split: Any, *, max_samples: int | None = None, batch_size: int = 8192
) -> dict[str, float]:
    """AUC, log loss, accuracy and normalized entropy on the first `max_samples` of a split (in order)."""
    from slipcache.data.dataset import BatchIterator

    was_training = model.training
    model.eval()
    labels: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    seen = 0
    for batch in BatchIterator(split, batch_size, shuffle=False, seed=0, drop_last=False):
        take = (
            batch.labels.shape[0] if max_samples is None else min(batch.labels.shape[0], max_samples - seen)
        )
        logits = model(batch.dense[:take], batch.sparse[:take])
        labels.append(batch.labels[:take].numpy())
        probs.append(torch.sigmoid(logits).numpy())
        seen += take
        if max_samples is not None and seen >= max_samples:
            break
    model.train(was_training)
    if not labels:
        raise SlipcacheError("cannot evaluate on an empty split")
    result = evaluate_predictions(np.concatenate(labels), np.concatenate(probs))
    result["samples"] = seen
    return result


def check_table_sizes(expected: list[int], actual: list[int], what: str) -> None:
    """Embedding tables are sized by the vocabulary, so a mismatch means a different preprocessing."""
    if list(expected) != list(actual):
        if len(expected) != len(actual):
            detail = f"{len(actual)} tables vs {len(expected)}"
        else:
            t = next(i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b)
            detail = f"table {t} has {actual[t]} rows vs {expected[t]}"
        raise SlipcacheError(f"{what} does not match the checkpoint's vocabulary ({detail})")


# ----------------------------------------------------------------------------------------------------
# Run state: what a checkpoint must hold besides the model


@dataclass
class Progress:
    """Position in the schedule and the running sums of the current logging window."""

    step: int = 0
    samples: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_wall_s: float = (
        0.0  # wall time of the loop: data, skip filter and guard, steps (no eval, no checkpoints)
    )
    compute_s: float = 0.0  # forward, backward and optimizer steps only
    train_cpu_s: float = 0.0  # process CPU time of the same span as train_wall_s: robust to a shared machine
    skipped: int = 0  # inputs dropped as stale; they count against the sample budget like trained ones
    window_loss: float = 0.0  # sum of per-batch mean loss * batch size since the last log event
    window_samples: int = 0
    window_wall_s: float = 0.0
    window_lookups: int = 0
    window_hits: int = 0
    train_lookups: int = 0
    train_hits: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)


def resolve_schedule(config: TrainConfig, train_rows: int) -> TrainConfig:
    """Fill derived counts: the sample budget, and log/checkpoint intervals in whole batches."""
    batch = config.batch_size
    batches_per_epoch = train_rows // batch
    if batches_per_epoch == 0:
        raise SlipcacheError(f"the training split has {train_rows} rows, fewer than one batch of {batch}")
    samples = config.samples if config.samples is not None else config.epochs * batches_per_epoch * batch

    def every(value: int | None, parts: int) -> int:
        steps = max(1, round((value if value is not None else samples / parts) / batch))
        return steps * batch

    return dataclasses.replace(
        config,
        samples=samples,
        log_every=every(config.log_every, 100),
        # Evaluation follows the data consumed (trained + skipped), so runs with and without skipping
        # evaluate at the same positions; a given interval stays exact (see `_crossed`).
        eval_every=config.eval_every if config.eval_every is not None else every(None, 10),
        checkpoint_every=every(config.checkpoint_every, 4),
    )


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))


def _stats_totals(model: DLRM) -> tuple[int, int]:
    """Cumulative (lookups, hits); lookups count as 0 for a collection without a cache (hit_rate None)."""
    stats = model.embeddings.stats()
    if stats.get("hit_rate") is None and not stats.get("hits"):
        return 0, 0
    return int(stats.get("lookups") or 0), int(stats.get("hits") or 0)


# ----------------------------------------------------------------------------------------------------
# Run directory files


def _new_run_dir() -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / stamp
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{stamp}-{n}"
    return path


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    tmp.replace(path)


def _write_events(path: Path, events: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


# ----------------------------------------------------------------------------------------------------
# Training: the loop first, then its steps in the order they run.


@dataclass
class Run:
    """Everything the training loop reads and writes. `start_run` builds it; a checkpoint saves it."""

    config: TrainConfig  # resolved: sample budget and intervals filled in
    config_dict: dict[str, Any]  # what config.json and every checkpoint record
    run_dir: Path
    dataset: Any
    model: DLRM
    dense_opt: torch.optim.Optimizer
    emb_opt: torch.optim.Optimizer | None
    progress: Progress
    skipper: StaleSkipper | None
    budget: int  # samples to consume (trained + skipped), a whole number of batches
    max_epochs: int
    bar: Any  # tqdm progress bar
    data_quality: dict[str, Any] | None  # malformed lines skipped while preprocessing raw input
    base_lookups: int = 0  # the collection's cumulative counters when the open logging window began
    base_hits: int = 0
    tensorboard: Any = None  # TensorBoardWriter when config.tensorboard is set
    tick: float = 0.0  # when the running training-time interval began (paused for eval and checkpoints)
    tick_cpu: float = 0.0  # process CPU time at `tick`
    finished: bool = False  # set by the run's last batch
    logits: torch.Tensor | None = None  # the last step's (detached) logits, kept only for stale skipping
    dist: DistributedRun | None = None  # N processes (slipcache.distributed.training); None: this one alone

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the run directory's files (rank 0 of N, or the only process)."""
        return self.dist is None or self.dist.is_main

    @property
    def consumed(self) -> int:
        """Samples trained or skipped: the position in the data that the budget and eval schedule count."""
        return self.progress.samples + self.progress.skipped

    def more_epochs(self) -> bool:
        return not self.finished and self.consumed < self.budget and self.progress.epoch < self.max_epochs


def train(config: TrainConfig, dist: DistributedRun | None = None) -> dict[str, Any]:
    """Train DLRM as configured, writing the run directory; returns the summary dict.

    Hook points for features that join the loop: `epoch_batches` (per-epoch setup, the batch source),
    `train_step` (one optimization step), `record_step` (per-batch bookkeeping after the step), and
    `Run`/`checkpoint_state`/`restore` for state that must survive a resume. Training time
    (`progress.train_wall_s`) runs from `run.tick` to the end of `record_step`; evaluation and checkpoints
    fall outside it.
    """
    run = start_run(config, dist)
    try:
        while run.more_epochs():
            batches = epoch_batches(run)
            for batch in batches:
                loss = train_step(run, batch, batches)
                consumed_before = run.consumed
                last = record_step(run, batch, loss, batches)
                eval_due = _crossed(consumed_before, run.consumed, run.config.eval_every) or last
                if run.progress.samples % run.config.log_every == 0 or eval_due:
                    log_event(run, evaluate_now=eval_due)
                if run.progress.samples % run.config.checkpoint_every == 0 and not last:
                    save_checkpoint(run)
                if last:
                    # A skipping run's last epoch can end with trained + skipped just under the budget (the
                    # tail that fills no batch is dropped); it must not restart the epoch to look for more.
                    run.finished = True
                    break
                run.tick = time.perf_counter()  # the training clock restarts: eval and checkpoints excluded
                run.tick_cpu = time.process_time()
            else:  # the iterator ran out: next epoch (a sample filter may have made this one shorter)
                end_epoch(run)
    finally:
        run.bar.close()
    save_checkpoint(run)
    return finish_run(run)


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (before, after]: a schedule in samples that batches step over."""
    return after // every > before // every


def start_run(config: TrainConfig, dist: DistributedRun | None = None) -> Run:
    """A new run, or an interrupted one restored from its checkpoint (`config.resume`)."""
    config.validate()
    state: dict[str, Any] | None = None
    saved: dict[str, Any] = {}
    changes: dict[str, list[Any]] = {}
    if config.resume is not None:
        state, saved, config, changes = _load_resume(config, dist)
        run_dir = Path(config.out or "")
    else:
        run_dir = _prepare_out(Path(config.out) if config.out else _new_run_dir(), restart_ok=True)
    for directory in (run_dir, run_dir / "checkpoints"):  # left by a process killed while writing
        ckpt.remove_partial_writes(directory)
    if config.data is not None:  # absolute, so the run can be resumed and evaluated from anywhere
        config.data = str(Path(config.data).expanduser().resolve())

    dataset_dir = _dataset_dir(config, saved.get("dataset"))
    dataset = open_dataset(dataset_dir, config)
    config.split_order = config.split_order or dataset.meta.get("split_order")
    config = resolve_schedule(config, dataset.splits["train"])
    config.out = str(run_dir)
    config_dict = {**asdict(config), "dataset": str(dataset_dir)}
    history = list(saved.get("changed_on_resume", []))
    if changes:
        history.append({"samples": state["progress"]["samples"] if state else 0, "changes": changes})
    if history:
        config_dict["changed_on_resume"] = history
    quality = data_quality(dataset)
    if quality is not None and quality["malformed_lines"]:
        _warn(_malformed_message(quality, config.data))

    # Model and optimizers. Seeding first makes the MLP init (torch's global RNG) reproducible.
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    if dist is None:
        model = build_model(config, dataset.table_sizes, dataset.num_dense)
    else:
        model = dist.build_model(config, dataset.table_sizes, dataset.num_dense, run_dir)
    dense_opt = torch.optim.SGD(model.dense_parameters(), lr=config.dense_lr or config.lr)
    emb_opt = embedding_optimizer(config, model)
    batches_per_epoch = dataset.splits["train"] // config.batch_size
    skipper = None
    if config.skip_stale:
        from slipcache.staleness.skipping import StaleSkipper

        skipper = StaleSkipper(config, model, dataset.split("train"), batches_per_epoch)
    progress = Progress()
    if state is not None:
        check_table_sizes(state["table_sizes"], dataset.table_sizes, f"dataset {dataset_dir}")
        restore(state, model, dense_opt, emb_opt, progress, skipper)
    if dist is None or dist.is_main:
        write_json(run_dir / "config.json", config_dict)
        _write_events(run_dir / "metrics.jsonl", progress.events)  # a resumed run drops later events

    # The budget counts inputs trained or skipped, so a skipping run covers the same data; it ends after
    # as many epochs as the run without skipping, even though its epochs have fewer batches.
    total_steps = math.ceil(config.samples / config.batch_size)
    budget = total_steps * config.batch_size
    bar = tqdm(
        total=budget,
        initial=progress.samples,
        unit=" samples",
        unit_scale=True,
        disable=not config.progress,
        dynamic_ncols=True,
    )
    run = Run(
        data_quality=quality,
        config=config,
        config_dict=config_dict,
        run_dir=run_dir,
        dataset=dataset,
        model=model,
        dense_opt=dense_opt,
        emb_opt=emb_opt,
        progress=progress,
        skipper=skipper,
        budget=budget,
        max_epochs=math.ceil(total_steps / batches_per_epoch),
        bar=bar,
        tensorboard=open_writer(config.tensorboard, run_dir) if dist is None or dist.is_main else None,
        dist=dist,
    )
    # The collection's counters may or may not come back with its state; count relative to what it says now.
    run.base_lookups, run.base_hits = _stats_totals(model)
    run.base_lookups -= progress.window_lookups
    run.base_hits -= progress.window_hits
    return run


def epoch_batches(run: Run) -> Any:
    """The current epoch's training batches from where the run stands; starts the training clock."""
    from slipcache.data.dataset import BatchIterator

    run.tick = time.perf_counter()  # wall time includes reading and filtering batches, not eval or checkpoints
    run.tick_cpu = time.process_time()
    if run.skipper is not None:
        run.skipper.start_epoch(run.progress.epoch, run.progress.batch_in_epoch)  # profile, open the window
    return BatchIterator(
        run.dataset.split("train"),
        run.config.batch_size,
        shuffle=True,
        in_order=bool(run.dataset.meta.get("time_ordered")),  # time-ordered data: shuffle within windows
        seed=run.config.seed,
        epoch=run.progress.epoch,
        drop_last=True,
        sample_filter=run.skipper.sample_filter if run.skipper is not None else None,
        start_batch=run.progress.batch_in_epoch,
    )


def train_step(run: Run, batch: Any, batches: Any = None) -> float:
    """Forward, backward and optimizer steps on one batch; returns its mean loss.

    `batches` (the iterator `batch` came from) lets a lookahead policy or the prefetch see the batches
    that follow, after the skip filter: those that will be trained.
    """
    t0 = time.perf_counter()
    ahead = lookahead_batches(run.config)
    if ahead and batches is not None:
        run.model.embeddings.set_lookahead([b.sparse for b in batches.peek(ahead)], run.config.prefetch)
    logits = run.model(batch.dense, batch.sparse)
    weights = run.skipper.loss_weights(batch.labels.shape[0]) if run.skipper is not None else None
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels, weight=weights)
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        # Stop before backward: a fused embedding update would write the bad gradient into storage.
        raise _non_finite_loss(run, loss_value)
    run.dense_opt.zero_grad(set_to_none=True)
    if run.emb_opt is not None:
        run.emb_opt.zero_grad(set_to_none=True)
    loss.backward()  # with fused_update, this also updates the embedding rows
    run.dense_opt.step()
    if run.emb_opt is not None:
        run.emb_opt.step()
    run.progress.compute_s += time.perf_counter() - t0
    if run.skipper is not None:
        run.logits = logits.detach()  # the skipping guard follows the loss of its control inputs
    return loss_value


def lookahead_batches(config: TrainConfig) -> int:
    """Batches the embeddings are shown ahead: the lookahead policy's window, or 1 for the prefetch alone."""
    if config.embeddings != "cached":
        return 0
    return config.lookahead if config.policy in LOOKAHEAD_POLICIES else int(config.prefetch)


def _non_finite_loss(run: Run, loss_value: float) -> SlipcacheError:
    p = run.progress
    latest = run.run_dir / "checkpoints" / ckpt.LATEST
    where = f"last good checkpoint: {latest}" if latest.exists() else "no checkpoint was written yet"
    return SlipcacheError(
        f"training loss is {loss_value} at sample {p.samples} (epoch {p.epoch}, "
        f"batch {p.batch_in_epoch}); stopped. Check the input data or lower --lr; {where}"
    )


def record_step(run: Run, batch: Any, loss_value: float, batches: Any) -> bool:
    """Per-batch bookkeeping after a step (skipping, counters, clock); returns whether it was the last."""
    progress = run.progress
    last = False
    if run.skipper is not None:
        run.skipper.after_batch(batch, run.logits, loss_value)  # warm-up, counting, snapshots, fits, guard
        progress.skipped = run.skipper.detector.total.skipped
        # A skipping epoch has fewer batches: the run's last one is known when none follows.
        last = progress.epoch == run.max_epochs - 1 and not batches.peek(1)
    elapsed = time.perf_counter() - run.tick
    n = batch.labels.shape[0]
    progress.step += 1
    progress.samples += n
    progress.batch_in_epoch += 1
    progress.train_wall_s += elapsed
    progress.train_cpu_s += time.process_time() - run.tick_cpu
    progress.window_loss += loss_value * n
    progress.window_samples += n
    progress.window_wall_s += elapsed
    run.bar.update(n)
    return last or run.consumed >= run.budget


def log_event(run: Run, *, evaluate_now: bool) -> None:
    """Close the logging window into a `metrics.jsonl` event, with validation metrics when `evaluate_now`."""
    progress = run.progress
    _sync_window_counts(run)
    event = _close_window(progress)
    event.update(embedding_event_fields(run.model.embeddings, progress.samples, progress.skipped))
    if run.skipper is not None:
        event.update(run.skipper.event_fields(progress.compute_s / progress.samples))
    run.bar.set_postfix(_postfix(event), refresh=False)
    if evaluate_now:
        scores = evaluate(run.model, run.dataset.split("val"), max_samples=run.config.eval_samples)
        event.update({f"val_{k}": v for k, v in scores.items()})
        if run.skipper is not None:
            run.skipper.after_eval(scores)  # warm-up ends on a flat validation loss; the guard watches AUC
    progress.events.append(event)
    if run.writes_files:
        with open(run.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
    if run.tensorboard is not None:
        run.tensorboard.write_event(event)
    run.base_lookups, run.base_hits = _stats_totals(run.model)  # evaluation lookups do not count


def _sync_window_counts(run: Run) -> None:
    """Cache lookups and hits of the open logging window, from the collection's cumulative counters."""
    lookups, hits = _stats_totals(run.model)
    run.progress.window_lookups = lookups - run.base_lookups
    run.progress.window_hits = hits - run.base_hits


def _close_window(progress: Progress) -> dict[str, Any]:
    """One `metrics.jsonl` event for the batches since the previous one; resets the window."""
    lookups, hits = progress.window_lookups, progress.window_hits
    progress.train_lookups += lookups
    progress.train_hits += hits
    event: dict[str, Any] = {
        "event": "train",
        "samples": progress.samples,
        "epoch": progress.epoch,
        "train_loss": progress.window_loss / max(progress.window_samples, 1),
        "hit_rate": hits / lookups if lookups else None,
        "samples_per_s": progress.window_samples / progress.window_wall_s if progress.window_wall_s else None,
        "train_wall_s": progress.train_wall_s,
        # time-to-accuracy axis: cumulative training wall time, evaluation and checkpoints excluded
        "train_seconds": progress.train_wall_s,
        "train_cpu_s": progress.train_cpu_s,  # the same span in process CPU time (one torch thread: robust)
    }
    progress.window_loss = 0.0
    progress.window_samples = 0
    progress.window_wall_s = 0.0
    progress.window_lookups = progress.window_hits = 0
    return event


def _postfix(event: dict[str, Any]) -> dict[str, str]:
    postfix = {"loss": f"{event['train_loss']:.4f}"}
    if event["hit_rate"] is not None:
        postfix["hit"] = f"{100 * event['hit_rate']:.1f}%"
    return postfix


def save_checkpoint(run: Run) -> None:
    """`checkpoints/ckpt-<samples>.pt` and `latest.pt`; the open window's cache counts travel with it."""
    _sync_window_counts(run)
    state = checkpoint_state(run)
    directory = run.run_dir / "checkpoints"
    if run.dist is not None:
        run.dist.save_checkpoint(directory, state, run.progress.samples, keep=run.config.keep_checkpoints)
        return
    try:
        ckpt.save_run_checkpoint(directory, state, run.progress.samples, keep=run.config.keep_checkpoints)
    except OSError as exc:  # a full disk, a quota: the previous checkpoint is intact (atomic writes)
        complete = ckpt.complete_checkpoints(directory)
        then = (
            f"the last complete checkpoint is {complete[0]}; free space, then --resume {run.run_dir}"
            if complete
            else f"no checkpoint was written yet; free space, then --resume {run.run_dir} starts it again"
        )
        raise SlipcacheError(f"cannot write a checkpoint into {directory}: {exc.strerror or exc}; {then}") from exc


def end_epoch(run: Run) -> None:
    """The epoch's batches ran out: count the time spent filtering its tail and move to the next epoch."""
    progress = run.progress
    if progress.batch_in_epoch == 0:
        raise SlipcacheError(f"epoch {progress.epoch} produced no training batches")
    progress.train_wall_s += time.perf_counter() - run.tick
    progress.train_cpu_s += time.process_time() - run.tick_cpu
    progress.epoch += 1
    progress.batch_in_epoch = 0


def finish_run(run: Run) -> dict[str, Any]:
    """Test-set evaluation, summary.json and report.md."""
    progress, model = run.progress, run.model
    test = evaluate(model, run.dataset.split("test"))
    memory = model.embeddings.memory_report()
    skipper = run.skipper
    summary: dict[str, Any] = {
        "auc": test["auc"],
        "logloss": test["logloss"],
        "accuracy": test["accuracy"],
        "normalized_entropy": test["normalized_entropy"],
        "test_samples": test["samples"],
        "train_samples": progress.samples,
        "samples_per_s": progress.samples / progress.train_wall_s if progress.train_wall_s else None,
        "train_wall_s": progress.train_wall_s,  # wall clock of the loop: the figure speedups use
        "compute_s": progress.compute_s,
        "train_cpu_s": progress.train_cpu_s,
        "embedding_bytes": int(memory["total_bytes"]),
        "fp32_embedding_bytes": int(memory["fp32_bytes"]),
        "memory_ratio": float(memory["memory_ratio"]),
        "memory_components": memory["components"],
        "memory_per_rank": memory.get("per_rank"),  # N processes: each rank's own report
        "embedding_stats": {k: v for k, v in model.embeddings.stats().items() if k != "per_table"},
        "cache_hit_rate": progress.train_hits / progress.train_lookups if progress.train_lookups else None,
        "skipped_fraction": progress.skipped / (progress.samples + progress.skipped),
        "staleness": skipper.summary(progress.compute_s / progress.samples) if skipper is not None else None,
        "data_quality": run.data_quality,
        "run_dir": str(run.run_dir),
        "config": run.config_dict,
        "distributed": run.dist.summary(model) if run.dist is not None else None,
    }
    if not run.writes_files:
        return summary
    write_json(run.run_dir / "summary.json", summary)
    from slipcache.training.report import write_report

    write_report(run.run_dir, progress.events, summary)
    if run.tensorboard is not None:
        run.tensorboard.write_summary(summary)
        run.tensorboard.close()
    return summary


# ----------------------------------------------------------------------------------------------------
# Checkpoints and resuming


def checkpoint_state(run: Run) -> dict[str, Any]:
    """Every piece of state the loop reads, so a resumed run ends exactly where an uninterrupted one ends."""
    # The collection's own state_dict (cache contents, quantized storage, optimizer state, rounding RNG)
    # is saved through its method, not through the parent's, which would bypass an override.
    model = run.model
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    return {
        "format": CHECKPOINT_FORMAT,
        "version": ckpt.FORMAT_VERSION,
        "config": run.config_dict,
        "table_sizes": list(run.dataset.table_sizes),
        "dense": dense,
        "embeddings": model.embeddings.state_dict(),
        "dense_optimizer": run.dense_opt.state_dict(),
        "embedding_optimizer": run.emb_opt.state_dict() if run.emb_opt is not None else None,
        "progress": asdict(run.progress),
        "rng": _rng_state(),
        "skipping": run.skipper.state_dict() if run.skipper is not None else None,
    }


def restore(
    state: dict[str, Any],
    model: DLRM,
    dense_opt: torch.optim.Optimizer,
    emb_opt: torch.optim.Optimizer | None,
    progress: Progress,
    skipper: StaleSkipper | None,
) -> None:
    """Load what `checkpoint_state` saved into freshly built objects."""
    _load_model_state(state, model)
    dense_opt.load_state_dict(state["dense_optimizer"])
    if emb_opt is not None and state["embedding_optimizer"] is not None:
        emb_opt.load_state_dict(state["embedding_optimizer"])
    for name, value in state["progress"].items():
        setattr(progress, name, value)
    _set_rng_state(state["rng"])
    if skipper is not None:
        skipper.load_state_dict(state["skipping"])


def _check_checkpoint(state: dict[str, Any], path: Path) -> None:
    """The file verified (see `checkpoint.load_checkpoint`); is it a training checkpoint of this version?"""
    if state.get("format") != CHECKPOINT_FORMAT or state.get("version") != ckpt.FORMAT_VERSION:
        raise SlipcacheError(
            f"{path} is not a slipcache training checkpoint of format version {ckpt.FORMAT_VERSION} "
            f"(it holds format {state.get('format')!r}, version {state.get('version')!r})"
        )
    sizes = state.get("table_sizes")
    parts = ("dense", "embeddings", "dense_optimizer", "progress", "rng")
    if (
        not isinstance(sizes, list)
        or not all(isinstance(n, int) and n >= 1 for n in sizes)
        or not all(isinstance(state.get(k), dict) for k in parts)
    ):
        raise SlipcacheError(f"checkpoint {path} is incomplete or malformed (table sizes or state missing)")


def _load_model_state(state: dict[str, Any], model: DLRM) -> None:
    try:
        missing, unexpected = model.load_state_dict(state["dense"], strict=False)
        missing = [k for k in missing if not k.startswith("embeddings.")]
        if missing or unexpected:
            raise RuntimeError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.embeddings.load_state_dict(state["embeddings"])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise SlipcacheError(f"checkpoint does not fit the model: {str(exc).splitlines()[0]}") from exc




# Fields that say where and how a run reports, not what it computes: free to differ on resume.
_RUN_INDEPENDENT = {"progress", "resume", "out", "allow_changes", "tensorboard"}
# Fields the checkpoint's state depends on (data, shapes, storage, shuffling): never changed on resume.
_STATE_DEFINING = {
    "data", "vocab", "max_rows", "min_count", "synthetic_samples", "synthetic_scale", "synthetic_generator", "strict",
    "embeddings", "precision", "cache_size", "cache_rows", "policy", "rounding", "optimizer", "embedding_dim",
    "bottom_mlp", "top_mlp", "batch_size", "seed", "skip_stale", "table_sizes", "split_order",
    "lookahead", "prefetch",
}  # fmt: skip


def _warn(message: str) -> None:
    print(f"slipcache train: warning: {message}", file=sys.stderr)


def _is_run_dir(path: Path) -> bool:
    """Whether `path` is a directory `slipcache train` made (its config.json names a run's dataset)."""
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"dataset", "embeddings", "seed"} <= saved.keys()


def _has_checkpoint(run_dir: Path) -> bool:
    directory = run_dir / "checkpoints"
    return directory.is_dir() and any(p.suffix == ".pt" for p in directory.iterdir())


def _prepare_out(path: Path, *, restart_ok: bool) -> Path:
    """Create the run directory `path` (absolute): new, empty, or, with `restart_ok`, a run that stopped
    before its first checkpoint. Anything else holds someone's files or another run: refused."""
    path = path.expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise SlipcacheError(f"--out {path} is a file, not a directory")
    # Temp files of a write killed midway (before config.json existed) do not make a directory anyone's.
    entries = [p for p in path.iterdir() if not p.name.endswith(".tmp")] if path.is_dir() else []
    if entries:
        if not _is_run_dir(path):
            raise SlipcacheError(
                f"--out {path} is not empty and is not a slipcache run directory; choose a new or empty one"
            )
        if _has_checkpoint(path) or not restart_ok:
            raise SlipcacheError(f"run directory {path} already holds a run; use --resume {path} or another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SlipcacheError(f"cannot create run directory {path}: {exc.strerror or exc}") from exc
    return path


def _resume_location(resume: str) -> tuple[Path, Path | None]:
    """(checkpoint file, the run directory holding it or None for a loose file) named by `--resume`."""
    path = Path(resume).expanduser().resolve()
    if path.is_dir():
        if path.name == "checkpoints" and _is_run_dir(path.parent):
            return path / ckpt.LATEST, path.parent
        if _is_run_dir(path) or (path / "checkpoints").is_dir():
            return path / "checkpoints" / ckpt.LATEST, path
        raise SlipcacheError(f"--resume {path}: not a slipcache run directory or checkpoint file")
    if path.is_file():
        if path.parent.name == "checkpoints" and _is_run_dir(path.parent.parent):
            return path, path.parent.parent
        return path, None
    raise SlipcacheError(f"--resume {path}: no such run directory or checkpoint file")


def _load_resume(
    config: TrainConfig, dist: DistributedRun | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any], TrainConfig, dict[str, list[Any]]]:
    """(checkpoint state or None, the run's saved config, the config to continue with, changed settings).

    The resumed run writes into the directory `--resume` names, whatever the checkpoint says (a copied
    run directory stays a copy), or into a new or empty `--out`; never into another run. A run that
    stopped before its first checkpoint (a full disk) starts again from its config.json.
    """
    path, home = _resume_location(config.resume or "")
    if config.out is not None and (home is None or Path(config.out).expanduser().resolve() != home):
        run_dir = _prepare_out(Path(config.out), restart_ok=False)
    elif home is None:
        raise SlipcacheError(f"checkpoint {path} is not inside a run directory; give a new --out for the resumed run")
    else:
        run_dir = home
    if dist is None and home is not None:
        from slipcache.distributed.checkpoint import refuse_sharded

        refuse_sharded(home)  # written by N processes: say how to resume it
    if dist is not None:
        state = dist.load_checkpoint(home or path)  # every rank's file and the manifest
        saved, where = state["config"], f"checkpoint {path.parent}"
    elif home is not None and path.name == ckpt.LATEST and not _has_checkpoint(home):
        _warn(f"{home} has no checkpoint (it stopped before the first one); starting it again from the beginning")
        state, saved = None, json.loads((home / "config.json").read_text())
        where = f"{home / 'config.json'}"
    else:
        state = _load_checkpoint_or_name_others(path)
        saved, where = state["config"], f"checkpoint {path}"
    resumed = _config_from_saved(saved, where)
    changes = _resume_changes(config, resumed)
    if changes:
        listing = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())
        if not config.allow_changes:
            raise SlipcacheError(
                f"resuming would change the run's definition ({listing}); leave these flags out, "
                "or pass --allow-changes to continue with them"
            )
        fixed = sorted(changes.keys() & _STATE_DEFINING)
        if fixed:
            raise SlipcacheError(
                f"cannot change {', '.join(fixed)} when resuming, even with --allow-changes: "
                "the checkpoint's state depends on it"
            )
        for name, (_, new) in changes.items():
            setattr(resumed, name, new)
        if "epochs" in changes and "samples" not in changes:
            resumed.samples = None  # derive the budget from the new epoch count
    resumed.resume, resumed.progress, resumed.allow_changes = config.resume, config.progress, config.allow_changes
    resumed.out = str(run_dir)
    return state, saved, resumed, {k: list(v) for k, v in changes.items()}


def _resume_changes(config: TrainConfig, saved: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Settings given for the resume that differ from the run's (a value equal to the default counts as
    not given: the run's own value stands)."""
    defaults = TrainConfig()
    changes = {}
    for name in _FIELDS:
        value, old = getattr(config, name), getattr(saved, name)
        if name in _RUN_INDEPENDENT or value == getattr(defaults, name):
            continue
        if name == "data" and value is not None and old is not None:
            value = str(Path(value).expanduser().resolve())
        if value != old:
            changes[name] = (old, value)
    return changes


def _config_from_saved(saved: Any, where: str) -> TrainConfig:
    """A run's config from its checkpoint or config.json, checked like any other input."""
    if not isinstance(saved, dict):
        raise SlipcacheError(f"{where} holds no run config")
    try:
        config = TrainConfig(**{k: v for k, v in saved.items() if k in _FIELDS})
        config.validate()
    except (TypeError, SlipcacheError) as exc:
        raise SlipcacheError(f"{where} holds an invalid run config: {exc}") from exc
    return config


def _load_checkpoint_or_name_others(path: Path) -> dict[str, Any]:
    """A verified training checkpoint; when it is damaged or missing, the error names the complete older
    checkpoints beside it and how to resume from one."""
    try:
        state = ckpt.load_checkpoint(path)
    except ckpt.CorruptCheckpointError as exc:
        older = [p for p in ckpt.complete_checkpoints(path.parent) if p.name != path.name]
        if not older:
            raise
        names = ", ".join(p.name for p in older)
        raise SlipcacheError(
            f"{exc}; complete older checkpoints: {names}; to continue from the newest: --resume {older[0]}"
        ) from exc
    _check_checkpoint(state, path)
    return state


def _dataset_dir(config: TrainConfig, saved_dataset: str | None) -> Path:
    """The dataset a run reads: the one it started on while that is still there, else prepared anew."""
    if saved_dataset is not None and (Path(saved_dataset) / "meta.json").is_file():
        return Path(saved_dataset)
    return prepare_data(config)


def data_quality(dataset: Any) -> dict[str, Any] | None:
    """Lines read and skipped as malformed when the dataset was preprocessed from raw files (else None)."""
    source = dataset.meta.get("source") or {}
    if "bad_lines" not in source:
        return None
    return {
        "good_lines": int(source.get("good_lines", 0)),
        "malformed_lines": int(source["bad_lines"]),
        "examples": list(source.get("bad_examples", [])),
    }


def _malformed_message(quality: dict[str, Any], data: str | None) -> str:
    total = quality["good_lines"] + quality["malformed_lines"]
    lines = [
        f"{quality['malformed_lines']:,} of {total:,} lines of {data} are malformed and were skipped "
        "(--strict stops at the first); the first:"
    ]
    return "\n  ".join(lines + quality["examples"])


# ----------------------------------------------------------------------------------------------------
# Command line


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def summary_table(summary: dict[str, Any]) -> str:
    """The short table `slipcache train` ends with."""
    rate = summary["samples_per_s"]
    rows = [
        ("AUC (test)", f"{summary['auc']:.4f}"),
        ("log loss (test)", f"{summary['logloss']:.4f}"),
        ("normalized entropy", f"{summary['normalized_entropy']:.4f}"),
        (
            "embedding memory",
            f"{_fmt_bytes(summary['embedding_bytes'])} vs {_fmt_bytes(summary['fp32_embedding_bytes'])} fp32 "
            f"({summary['memory_ratio']:.2f}x smaller)",
        ),
        ("throughput", f"{rate:,.0f} samples/s" if rate else "n/a"),
        ("train time", f"{summary['train_wall_s']:.1f} s for {summary['train_samples']:,} samples"),
    ]
    if summary.get("cache_hit_rate") is not None:
        rows.insert(4, ("cache hit rate", f"{100 * summary['cache_hit_rate']:.1f}%"))
    if summary.get("staleness"):
        rows.append(("skipped as stale", f"{100 * summary['skipped_fraction']:.1f}% of inputs"))
    quality = summary.get("data_quality")
    if quality and quality["malformed_lines"]:
        rows.append(("malformed lines", f"{quality['malformed_lines']:,} skipped (see report.md)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag defaults to 'not given' so that a config file value is only overridden on purpose."""
    s = argparse.SUPPRESS
    add = parser.add_argument
    add("--config", metavar="FILE", default=s, help="TOML or YAML file of config keys; flags override it")
    add(
        "--data",
        default=s,
        help="raw Criteo file/dir (any of the 3 formats) or a preprocessed dataset dir; "
        "default: synthetic data",
    )
    add("--out", default=s, help="run directory (default runs/<timestamp>)")
    add(
        "--generator",
        dest="synthetic_generator",
        choices=tuple(GENERATOR_VERSIONS),
        default=s,
        help="synthetic data generator: v3 (default; entities, time order) or v2 (earlier figures)",
    )
    add(
        "--resume",
        metavar="RUN_OR_CHECKPOINT",
        default=s,
        help="continue an interrupted run, in its own directory (or a new empty --out)",
    )
    add(
        "--allow-changes",
        action="store_true",
        default=s,
        help="with --resume: continue with settings that differ from the run's (e.g. a larger --samples)",
    )
    add("--quick", action="store_true", default=s, help="small synthetic run, well under a minute")
    add(
        "--embeddings",
        choices=EMBEDDING_KINDS,
        default=s,
        help="cached = mixed-precision + fp32 cache (default); torch = fp32 nn.EmbeddingBag baseline",
    )
    add("--precision", choices=PRECISIONS, default=s, help="embedding storage precision (default int8)")
    add("--cache-size", type=float, default=s, help="share of rows cached, 0..1; 1 = every row (default 0.05)")
    add("--cache-rows", type=int, default=s, help="cache capacity as a number of rows (overrides --cache-size)")
    add("--policy", choices=POLICIES, default=s, help="cache replacement policy; none = no cache (default lru)")
    add("--lookahead", type=int, default=s, help="batches ahead the lookahead policies see (default 4)")
    add(
        "--prefetch",
        action="store_true",
        default=s,
        help="read the next batch's rows into the cache in the background while the current one computes",
    )
    add("--rounding", choices=ROUNDINGS, default=s, help="rounding into storage (default stochastic)")
    add("--optimizer", choices=OPTIMIZERS, default=s, help="embedding optimizer (default sgd)")
    add("--lr", type=float, default=s, help="embedding learning rate (default 0.3)")
    add("--dense-lr", type=float, default=s, help="MLP learning rate (default: --lr)")
    add("--batch-size", type=int, default=s, help="samples per batch (default 256)")
    add("--epochs", type=int, default=s, help="passes over the training split (default 1)")
    add("--samples", type=int, default=s, help="training budget in samples (overrides --epochs)")
    add(
        "--eval-every",
        metavar="SAMPLES",
        type=int,
        default=s,
        help="evaluate on the validation split after every SAMPLES samples consumed (trained or skipped; "
        "default: 10 per run)",
    )
    add(
        "--eval-samples",
        metavar="N",
        type=int,
        default=s,
        help="validation samples per evaluation, the first N of the split (default 100000)",
    )
    add("--checkpoint-every", type=int, default=s, help="samples between checkpoints (default: 4 per run)")
    add("--dim", dest="embedding_dim", type=int, default=s, help="embedding dimension (default 16)")
    add("--seed", type=int, default=s, help="random seed (default 0)")
    add("--vocab", choices=VOCABS, default=s, help="raw data vocabulary: hash (default) or frequency")
    add("--max-rows", type=int, default=s, help="raw data, hash vocabulary: rows per table (default 1000000)")
    add("--min-count", type=int, default=s, help="raw data, frequency vocabulary: minimum count (default 1)")
    add("--strict", action="store_true", default=s, help="raw data: stop at the first malformed line")
    add(
        "--table-sizes",
        type=_int_list,
        default=s,
        help="TorchRec/DLRM/MLPerf files: rows per table, one for all or 26 comma-separated; ids are "
        "taken modulo them (TorchRec's hashes). Default: the files' counts, else max id + 1",
    )
    add(
        "--split-order",
        choices=("val-test", "test-val"),
        default=s,
        help="which half of the last day is validation (default: the format's convention)",
    )
    add("--no-progress", "--quiet", dest="progress", action="store_false", default=s, help="no progress bar")
    add(
        "--tensorboard",
        nargs="?",
        const="",
        default=s,
        metavar="DIR",
        help="also write the metrics as TensorBoard events (default DIR: <out>/tensorboard)",
    )
    add(
        "--skip-stale",
        action="store_true",
        default=s,
        help="skip stale inputs (Slipstream; docs/skipping.md)",
    )
    add("--stale-target", type=float, default=s, help="D: share of hot inputs to skip (default 0.3)")
    add("--no-stale-guard", dest="stale_guard", action="store_false", default=s, help="no accuracy guard")
    add("--stale-guard-every", type=int, default=s, help="batches between guard checks (default 100)")
    add(
        "--stale-alpha",
        type=float,
        default=s,
        help="share of an input's lookups that must be hot, and stale to skip it (default 1: all; 0.9 = 24 of 26)",
    )
    add(
        "--stale-window",
        type=float,
        default=s,
        help="share of an epoch's batches in the snapshot window (0.02)",
    )
    add("--stale-recheck", type=int, default=s, help="batches between rolling snapshots (default 0 = window)")
    add("--stale-budget-mb", type=float, default=s, help="hot-row snapshot budget in MiB (default 256)")
    add(
        "--stale-min-accesses",
        type=float,
        default=s,
        help="hot rows must expect this many accesses per window (default 0 = budget only, as the paper)",
    )
    add("--stale-release-cache", action="store_true", default=s, help="stale rows give up their cache slots")
    add("--stale-rule", choices=("convergence", "paper"), default=s,
        help="convergence (default): change per update of rows updated >= k times; paper: L-inf change")
    add("--stale-min-updates", type=int, default=s, help="k: updates before a row is judged (default 4)")
    add("--stale-count-share", type=float, default=s,
        help="share of each trained batch whose row updates are counted, then scaled up (default 0.25)")
    add("--stale-warmup", choices=("val", "epoch", "none"), default=s,
        help="skip after validation loss flattened (val, default), from --stale-warmup-epoch, or at once")
    add("--stale-warmup-epoch", type=int, default=s, help="0-based epoch skipping starts by at the latest (1)")
    add("--stale-warmup-min", type=float, default=s, help="never skip in this first share of the run (0.1)")
    add("--stale-warmup-tol", type=float, default=s, help="relative val-loss gain that still counts (0.005)")
    add("--stale-decision", choices=("rolling", "epoch"), default=s,
        help="rolling re-checks (default) or one decision per epoch (the authors')")
    add("--stale-keep", "--stale-control", dest="stale_keep", type=float, default=s,
        help="p: share of would-be-skipped inputs trained anyway, the guard's control (0.05)")
    add("--stale-reweight", action="store_true", default=s,
        help="weight those inputs' loss by 1/p: the expected gradient is the one without skipping")
    add(
        "--no-stale-refit",
        dest="stale_refit",
        action="store_false",
        default=s,
        help="fit the threshold once per epoch (the paper) instead of at every re-check",
    )


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def run_train(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k in _FIELDS}
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    config = make_config(file_values, flags)
    from slipcache.distributed.launch import init_from_env

    context = init_from_env()  # None unless started by torchrun with more than one process
    if context is None:
        summary = train(config)
    else:
        from slipcache.distributed.training import train_on_ranks

        summary = train_on_ranks(config, context)
        if not context.is_main:
            return 0
    print(f"run: {summary['run_dir']}")
    print(summary_table(summary))
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    parser.add_argument("--data", default=None, help="dataset (default: the one the run trained on)")
    parser.add_argument("--split", default="test", choices=("train", "val", "test"), help="split to evaluate (default test)")
    parser.add_argument("--samples", type=int, default=None, help="evaluate only the first N samples")


def evaluate_checkpoint(
    checkpoint_path: str | Path, *, data: str | None = None, split: str = "test", samples: int | None = None
) -> dict[str, float]:
    """Metrics of a saved model on a dataset split."""
    if samples is not None and samples < 1:
        raise SlipcacheError(f"--samples must be at least 1, got {samples}")
    path = Path(checkpoint_path).expanduser().resolve()
    from slipcache.distributed import checkpoint as sharded_ckpt

    sharded = sharded_ckpt.latest_sharded(path) if path.is_dir() else None  # written by N processes
    if path.is_dir():
        path = path / "checkpoints" / ckpt.LATEST if (path / "checkpoints").is_dir() else path / ckpt.LATEST
    state = sharded_ckpt.load_rank_state(sharded, 0) if sharded else _load_checkpoint_or_name_others(path)
    config = _config_from_saved(state["config"], f"checkpoint {path}")
    config.progress = False
    if data is not None:
        config.data = str(Path(data).expanduser().resolve())
        dataset_dir = prepare_data(config)
    else:
        saved_dataset = state["config"].get("dataset")
        dataset_dir = _dataset_dir(config, saved_dataset if isinstance(saved_dataset, str) else None)
    dataset = open_dataset(dataset_dir, config)
    check_table_sizes(state["table_sizes"], dataset.table_sizes, f"dataset {dataset_dir}")
    if split not in dataset.splits or not dataset.splits[split]:
        raise SlipcacheError(f"dataset {dataset_dir} has no {split!r} split")
    model = build_model(config, dataset.table_sizes, dataset.num_dense)
    if sharded is not None:  # gather the ranks' shards into this process's tables
        sharded_ckpt.unshard_into(model.embeddings, sharded)
        state["embeddings"] = model.embeddings.state_dict()
    _load_model_state(state, model)
    return evaluate(model, dataset.split(split), max_samples=samples)


def run_eval(args: argparse.Namespace) -> int:
    scores = evaluate_checkpoint(args.checkpoint, data=args.data, split=args.split, samples=args.samples)
    print(f"{args.split}: {scores['samples']:,} samples")
    for name in ("auc", "logloss", "accuracy", "normalized_entropy"):
        print(f"  {name:<20} {scores[name]:.4f}")
    return 0


if __name__ == "__main__":  # python -m slipcache.training.trainer
    parser = argparse.ArgumentParser(prog="slipcache train")
    add_train_arguments(parser)
    sys.exit(run_train(parser.parse_args()))
