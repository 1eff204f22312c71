"""`TrainConfig`: everything a run depends on, checked once, and how a config file and command-line
flags combine into it (defaults, then the file, then flags; `--quick` fills only what neither set).

Each setting is described once, by `_flag` in its field's metadata (`training/settings.py` says how).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipcache.data.synthetic import DEFAULT_GENERATOR, GENERATOR_VERSIONS
from slipcache.embedding.cache import POLICIES
from slipcache.embedding.config import FLOAT32_MAX, OPTIMIZERS
from slipcache.embedding.hostmem import HUGE_PAGE_MODES
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS
from slipcache.errors import SlipcacheError
from slipcache.model import AUTOCAST_DTYPES, EMBEDDING_KINDS, INTERACTIONS, ModelConfig
from slipcache.staleness.config import (
    FREEZE_MODES,
    HOT_SETS,
    ORDERS,
    RULES,
    SKIP_RULE_HELP,
    SKIP_RULES,
    STALE_PRESETS,
    WINDOW_COUNTS,
    StalenessConfig,
    preset_help,
)
from slipcache.staleness.skipping import DECISIONS, WARMUPS
from slipcache.training.settings import _digits, coerce, part_options, read_settings_file, setting_name
from slipcache.training.settings import flag as _flag  # the one way a setting is described

logger = logging.getLogger(__name__)

VOCABS = ("frequency", "hash")
SPLIT_ORDERS = ("val-test", "test-val")
WIRE_PRECISIONS = ("fp32", "fp16", "bf16")
TIME_ORDERS = ("first", "every")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")  # the MLPs' (`backend.dense_optimizer`)
LR_SCHEDULES = ("constant", "mlperf")  # `training/schedule.py`

@dataclass
class TrainConfig:
    """Everything a run depends on. `None` fields are derived from the data in `resolve_schedule`.

    A field with a `help` is a `slipcache train` flag; the others are set by config files (or --quick).
    """

    # run directory
    out: str | None = _flag(None, "run directory", resume="free", group="run", default_text="runs/<timestamp>")
    resume: str | None = _flag(None, "continue an interrupted run, in its own directory (or a new empty --out)",
                               resume="free", group="run", metavar="RUN_OR_CHECKPOINT")
    allow_changes: bool = _flag(False, "with --resume: continue with settings that differ from the run's "
                                "(e.g. a larger --samples); they are recorded", resume="free", group="run")
    # data
    data: str | None = _flag(None, "raw Criteo file/dir (any of the 3 formats) or a preprocessed dataset dir",
                             resume="fixed", group="data", default_text="synthetic data")
    vocab: str = _flag("frequency", "raw data vocabulary, as `slipcache preprocess`: frequency (a row per value seen "
                       "in train, tables sized to the data) or hash (--max-rows hashed rows per table)",
                       resume="fixed", group="data", choices=VOCABS)
    max_rows: int = _flag(1_000_000, "raw data, --vocab hash: rows per table (DLRM's max-ind-range)",
                          resume="fixed", group="data")
    min_count: int = _flag(1, "raw data, frequency vocabulary: rarer values map to row 0 (unknown)",
                           resume="fixed", group="data")
    synthetic_samples: int = _flag(4_000_000, resume="fixed", group="data",
                                   doc="synthetic data: rows generated (80/10/10 train/val/test)")
    synthetic_scale: float = _flag(0.05, resume="fixed", group="data",
                                   doc="synthetic data: table sizes relative to Criteo Kaggle (data.kaggle)")
    synthetic_generator: str = _flag(DEFAULT_GENERATOR, "synthetic data generator: v5 (the default: v4 with the "
                                     "label signal of real rows in the big tables; docs/data.md), v4 (v3 with real "
                                     "signal, dense shapes and links), v3 (entities, time order) or v2 (earlier "
                                     "figures)",
                                     resume="fixed", group="data", flag=("--generator",),
                                     choices=tuple(GENERATOR_VERSIONS))
    strict: bool = _flag(False, "raw data: stop at the first malformed line instead of skipping it",
                         resume="fixed", group="data")
    table_sizes: list[int] | None = _flag(
        None, "TorchRec/DLRM/MLPerf files: rows per table, one for all, 26 comma-separated or a preset (mlperf, "
        "kaggle); ids are taken modulo them (TorchRec's hashes). A slipcache dataset must match its own sizes",
        resume="fixed", group="data", type="table_sizes", default_text="the files' counts, else max id + 1")
    split_order: str | None = _flag(None, "which half of the last day is validation", resume="fixed", group="data",
                                    choices=SPLIT_ORDERS, default_text="the format's convention")
    time_order: str = _flag("first", "time-ordered data: first: the first epoch through time, later ones shuffled "
                            "across days (validation AUC does not saw at epoch boundaries); every: every epoch "
                            "through time", resume="fixed", group="data", choices=TIME_ORDERS)
    # embeddings (see slipcache.embedding.collection / docs/design.md); defaults are EmbeddingConfig's
    embeddings: str = _flag("cached", "cached = mixed-precision + fp32 cache; torch = fp32 nn.EmbeddingBag "
                            "baseline", resume="fixed", group="embeddings", choices=EMBEDDING_KINDS)
    # precision, cache_size, cache_rows: one value, or (config files) a list with one value per table
    precision: str | list[str] = _flag(help="embedding storage precision", resume="fixed", group="embeddings",
                                       sets="embedding.precision", choices=PRECISIONS)
    cache_size: float | list[float] = _flag(help="share of rows cached, 0..1; 1 = every row", resume="fixed",
                                            group="embeddings", sets="embedding.cache_size")
    cache_rows: int | list[int] | None = _flag(help="cache capacity as a number of rows (overrides --cache-size)",
                                               resume="fixed", group="embeddings", sets="embedding.cache_rows")
    policy: str = _flag(help="cache replacement policy; none = no cache", resume="fixed", group="embeddings",
                        sets="embedding.policy", choices=POLICIES)
    lookahead: int = _flag(4, "batches ahead the lookahead policies (lookahead, lookahead-lfu) see, and that rows "
                           "on disk (--storage-path) are read ahead", resume="fixed", group="embeddings")
    prefetch: bool = _flag(False, "read the next batch's rows into the cache in the background while the "
                           "current one computes", resume="fixed", group="embeddings")
    rounding: str = _flag(help="rounding into storage", resume="fixed", group="embeddings",
                          sets="embedding.rounding", choices=ROUNDINGS)
    optimizer: str = _flag(help="embedding optimizer", resume="fixed", group="embeddings",
                           sets="embedding.optimizer", choices=OPTIMIZERS)
    # The trainer's own learning rate (tuned on synthetic data at batch 256), not the collection's 0.1.
    lr: float = _flag(0.3, "embedding learning rate", resume="changeable", group="embeddings", sets="embedding.lr")
    dense_lr: float | None = _flag(None, "MLP learning rate", resume="changeable", group="model",
                                   default_text="--lr")
    dense_optimizer: str = _flag("sgd", "MLP optimizer", resume="fixed", group="model", choices=DENSE_OPTIMIZERS)
    wire_precision: str = _flag("fp32", "torchrun runs: rows and gradients between ranks as fp32 or fp16/bf16 "
                                "(half the bytes)", resume="changeable", group="embeddings", choices=WIRE_PRECISIONS)
    storage_path: str | None = _flag(None, "keep the row storage in memory-mapped files in DIR (unnamed: gone with "
                                     "the process) so that tables larger than memory train, the OS paging rows in; "
                                     "the memory check then counts the cache and optimizer state only; docs/scale.md "
                                     "says when it pays", resume="free", group="embeddings",
                                     sets="embedding.storage_path", metavar="DIR", default_text="in memory")
    # this process
    threads: int | None = _flag(None, "torch threads of this process (the `slipcache` command makes their waits "
                                "sleep, so the default holds on a busy machine: docs/threads.md; a resume keeps the "
                                "run's unless given)", resume="free", group="process",
                                default_text="torch's choice, one per core", type="positive_int")
    huge_pages: str = _flag(help="back the tables' storage, cache and optimizer state with transparent huge "
                            "pages: on, off, or auto (tensors of 64 MiB and more); where the kernel has none, "
                            "off (docs/scale.md)", resume="free", group="process", choices=HUGE_PAGE_MODES,
                            sets="embedding.huge_pages")
    # model
    embedding_dim: int = _flag(help="embedding dimension", resume="fixed", group="model",
                               sets=("embedding.dim", "model.embedding_dim"), flag=("--dim",))
    bottom_mlp: list[int] = _flag(help="bottom MLP widths, comma-separated; the last is the embedding dim "
                                  "(--dim alone sets it)", resume="fixed", group="model", sets="model.bottom_mlp",
                                  type="int_list", metavar="N,N,...")
    top_mlp: list[int] = _flag(help="top MLP widths, comma-separated; the last is 1, the logit", resume="fixed",
                               group="model", sets="model.top_mlp", type="int_list", metavar="N,N,...")
    interaction: str = _flag(help="how the bottom MLP's output meets the embeddings: dot (pairwise dot products, "
                             "DLRM) or cat (side by side)", resume="fixed", group="model",
                             sets="model.interaction", choices=INTERACTIONS)
    autocast: str | None = _flag(help="compute the MLPs and the interaction in this dtype (torch.autocast; the "
                                 "tables keep their precision)", resume="changeable", group="model",
                                 sets="model.autocast", choices=tuple(AUTOCAST_DTYPES), default_text="fp32")
    seed: int = _flag(0, "random seed (model init, shuffling, stochastic rounding)", resume="fixed", group="model",
                      sets=("embedding.seed", "staleness.seed"))
    # schedule (all counts are samples)
    batch_size: int = _flag(256, "samples per batch", resume="fixed", group="schedule")
    epochs: int = _flag(1, "passes over the training split", resume="changeable", group="schedule")
    samples: int | None = _flag(None, "training budget in samples (overrides --epochs)", resume="changeable",
                                group="schedule", default_text="--epochs passes over the split")
    log_every: int | None = _flag(None, resume="changeable", group="schedule",
                                  doc="samples between metrics.jsonl events; None: 100 per run")
    eval_every: int | None = _flag(None, "evaluate on the validation split after every SAMPLES samples consumed "
                                   "(trained or skipped)", resume="changeable", group="schedule", metavar="SAMPLES",
                                   default_text="10 per run")
    eval_samples: int | None = _flag(100_000, "validation samples per evaluation, the first N of the split "
                                     "(a config file's null: all)", resume="changeable", group="schedule",
                                     metavar="N")
    checkpoint_every: int | None = _flag(None, "samples between checkpoints", resume="changeable", group="schedule",
                                         default_text="4 per run")
    checkpoint_minutes: float = _flag(10.0, "also a checkpoint after every N minutes of training: the most work a "
                                      "kill loses (0: none)", resume="free", group="schedule", metavar="N")
    checkpoint_on_interrupt: bool = _flag(True, "no checkpoint on Ctrl-C or SIGTERM (by default the run writes one "
                                          "at the step under way and stops, naming the --resume command)",
                                          resume="free", group="schedule", flag=("--no-checkpoint-on-interrupt",))
    lr_schedule: str = _flag("constant", "learning rate of the MLPs and the tables over the run: constant, or mlperf "
                             "(the MLPerf DLRM reference's linear warm-up, then quadratic decay)",
                             resume="changeable", group="schedule", choices=LR_SCHEDULES)
    lr_warmup_steps: int | None = _flag(None, "mlperf schedule: steps of linear warm-up from 0",
                                        resume="changeable", group="schedule", metavar="STEPS",
                                        default_text="4 percent of the run's steps")
    lr_decay_start: int | None = _flag(None, "mlperf schedule: the step the decay starts at", resume="changeable",
                                       group="schedule", metavar="STEP", default_text="75 percent of the run's steps")
    lr_decay_steps: int | None = _flag(None, "mlperf schedule: steps of the decay (its last rate then holds)",
                                       resume="changeable",
                                       group="schedule", metavar="STEPS", default_text="the rest of the run")
    keep_checkpoints: int = _flag(2, "periodic checkpoints kept on disk, newest first (the MLPerf tables take "
                                  "15 GB each)", resume="changeable", group="schedule")
    # quick only fills other settings (MLP widths: the checkpoint's shape), so a resume never takes it
    quick: bool = _flag(False, "small synthetic run, well under a minute", resume="fixed", group="schedule")
    progress: bool = _flag(True, resume="free", group="schedule",
                           doc="tqdm progress bar (--no-progress / --quiet, as on every long command)")
    tensorboard: str | None = _flag(None, "also write the metrics as TensorBoard events into DIR", resume="free",
                                    group="schedule", metavar="DIR", nargs="?", const="",
                                    default_text="none; DIR alone: <out>/tensorboard")
    # Slipstream stale-input skipping (slipcache.staleness.skipping, docs/skipping.md); the detector's
    # settings take StalenessConfig's defaults
    skip_rule: str | None = _flag(None, SKIP_RULE_HELP, resume="fixed", group="skipping", choices=SKIP_RULES,
                                  default_text="none: train on every input")
    stale_preset: str | None = _flag(None, "a set of --stale-* settings (flags you give still win): " + preset_help(),
                                     resume="fixed", group="skipping", choices=tuple(STALE_PRESETS))
    input_order: str = _flag("data", "data: the data's own order; cold_first: FAE's order, each epoch's cold inputs "
                             "first, then its hot ones (every lookup a hot row), each part in the data's order",
                             resume="fixed", group="skipping", choices=ORDERS)
    stale_hot_share: float | None = _flag(help="hot set size as a share of all rows, replacing --stale-budget-mb "
                                          "(paper: 0.1242, 256 MB at dim 16 over Criteo Kaggle's 33.8 M rows)",
                                          resume="fixed", group="skipping", sets="staleness.hot_share",
                                          default_text="the budget")
    stale_threshold_sample: float = _flag(help="share of inputs sampled to fit T, of the hot inputs under "
                                          "--input-order cold_first; at least 4,096", resume="changeable",
                                          group="skipping", sets="staleness.threshold_sample_fraction")
    stale_window_start: float | None = _flag(None, "open each epoch's window after this share of its batches "
                                             "(counted as --stale-window-count says)", resume="changeable",
                                             group="skipping", default_text="the warm-up rule")
    stale_window_start_max: int | None = _flag(None, "open it at most this many batches after the count's start",
                                               resume="changeable", group="skipping", default_text="no cap")
    stale_window_count: str = _flag("epoch", "what --stale-window-start and --stale-window are shares of: epoch: "
                                    "the epoch's batches from its start; hot: its hot batches, after the cold pass "
                                    "(needs --input-order cold_first)", resume="fixed", group="skipping",
                                    choices=WINDOW_COUNTS)
    freeze_rows: str | None = _flag(None, "instead of skipping, stop updating --freeze-share of the hot rows from the "
                                    "window's end to the epoch's (stalest: least L-inf change over the window; "
                                    "random: the control); every input is still trained", resume="fixed",
                                    group="skipping", choices=FREEZE_MODES, default_text="off")
    freeze_share: float = _flag(0.5, "share of the hot rows frozen", resume="fixed", group="skipping")
    stale_hot_set: str = _flag(help="budget: most accessed rows that fit --stale-budget-mb; frequency: FAE's "
                               "threshold", resume="fixed", group="skipping", sets="staleness.hot_set",
                               choices=HOT_SETS)
    stale_hot_rate: float = _flag(help="frequency hot set: share of profiled inputs a hot row is looked up by",
                                  resume="fixed", group="skipping", sets="staleness.hot_min_rate")
    prune_share: float = _flag(0.5, "loss rule: r, share of below-mean-loss inputs pruned; kept ones weigh 1/(1-r)",
                               resume="fixed", group="skipping")
    prune_final: float = _flag(0.125, "loss rule: last share of the run on all data", resume="fixed",
                               group="skipping")
    stale_target: float = _flag(help="D: share of hot inputs to skip, fitted anew each epoch", resume="changeable",
                                group="skipping", sets="staleness.target_drop")
    stale_guard: bool = _flag(True, "no accuracy guard (by default D is backed off, or skipping stopped, when "
                              "skipped inputs' loss drifts above trained ones')", resume="changeable",
                              group="skipping", flag=("--no-stale-guard",))
    stale_guard_every: int = _flag(100, "batches between guard checks", resume="changeable", group="skipping")
    stale_alpha: float = _flag(help="share of an input's lookups that must be hot, and stale to skip it (1: all; "
                               "0.9 = 24 of 26)", resume="changeable", group="skipping", sets="staleness.alpha")
    stale_window: float = _flag(help="share of an epoch's batches in the snapshot window", resume="changeable",
                                group="skipping", sets="staleness.window_fraction")
    stale_recheck: int | None = _flag(help="batches between rolling snapshots (0 = the window length; None in "
                                      "config files: off)", resume="changeable", group="skipping",
                                      sets="staleness.recheck_interval")
    stale_budget_mb: float = _flag(help="hot-row snapshot budget in MiB", resume="changeable", group="skipping",
                                   sets="staleness.memory_budget_bytes", scale=2**20)
    stale_min_accesses: float = _flag(0.0, "hot rows must expect this many accesses per window (0 = budget "
                                      "only, as the paper)", resume="changeable", group="skipping")
    stale_release_cache: bool = _flag(False, "stale rows give their cache slots to rows that still move",
                                      resume="changeable", group="skipping")
    stale_refit: bool = _flag(True, "fit the threshold once per epoch (the paper) instead of at every re-check",
                              resume="changeable", group="skipping", flag=("--no-stale-refit",))
    stale_rule: str = _flag(help="convergence: change per update of rows updated >= k times; paper: L-inf change "
                            "between snapshots", resume="fixed", group="skipping", sets="staleness.rule",
                            choices=RULES)
    stale_min_updates: int = _flag(help="k: updates before a row is judged (convergence rule)", resume="changeable",
                                   group="skipping", sets="staleness.min_updates")
    stale_count_share: float = _flag(help="share of each trained batch whose row updates are counted, then scaled "
                                     "up (convergence rule)", resume="changeable", group="skipping",
                                     sets="staleness.count_share")
    stale_warmup: str = _flag("val", "skip after the validation loss flattened (val), from "
                              "--stale-warmup-epoch (epoch), or at once (none)", resume="changeable",
                              group="skipping", choices=WARMUPS)
    stale_warmup_epoch: int = _flag(1, "0-based epoch from which skipping starts at the latest (1 = the 2nd)",
                                    resume="changeable", group="skipping")
    stale_warmup_min: float = _flag(0.1, "never skip in this first share of the run", resume="changeable",
                                    group="skipping")
    stale_warmup_tol: float = _flag(0.005, "relative validation-loss gain on its best that still counts",
                                    resume="changeable", group="skipping")
    stale_decision: str = _flag("rolling", "rolling re-checks, or one decision per epoch (epoch: the authors')",
                                resume="changeable", group="skipping", choices=DECISIONS)
    stale_keep: float = _flag(0.05, "p: share of would-be-skipped inputs trained anyway, the guard's control",
                              resume="changeable", group="skipping")
    stale_reweight: bool = _flag(False, "weight those inputs' loss by 1/p: the expected gradient is the one "
                                 "without skipping", resume="changeable", group="skipping")
    stale_weight_max: float | None = _flag(None, "clip that weight at this value (less variance, some bias "
                                           "back)", resume="changeable", group="skipping", default_text="none, 1/p")

    def embedding_options(self) -> dict[str, Any]:
        """The embedding collection's settings (`EmbeddingConfig` fields, dim included), shared by the
        one-process and the sharded model."""
        return part_options(self, CONFIG_FIELDS, "embedding")

    def model_config(self, table_sizes: list[int], num_dense: int) -> ModelConfig:
        return ModelConfig(list(table_sizes), num_dense, **part_options(self, CONFIG_FIELDS, "model"))

    def staleness_config(self, **overrides: Any) -> StalenessConfig:
        """The detector's settings; `overrides`: those another setting decides (e.g. the rule for random)."""
        return StalenessConfig(**{**part_options(self, CONFIG_FIELDS, "staleness"), **overrides})

    def validate(self) -> None:
        for name in CONFIG_FIELDS:  # types first: a crafted checkpoint, a config file or an API call may hold
            value = _coerce(name, getattr(self, name))  # anything ("256", 1e100); what trains is the typed value
            if isinstance(value, float) and not math.isfinite(value):
                raise SlipcacheError(f"{_named(name)} must be a finite number, got {value}")
            for number in value if isinstance(value, list) else [value]:  # exact: ints of any size
                if isinstance(number, int) and not isinstance(number, bool) and abs(number) >= 2**63:
                    raise SlipcacheError(f"{_named(name)} must fit a 64-bit integer, got {_digits(number)}")
            setattr(self, name, value)
        for precision in self.precision if isinstance(self.precision, list) else [self.precision]:
            if precision not in PRECISIONS:
                raise SlipcacheError(f"{_named('precision')} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        for name, f in CONFIG_FIELDS.items():  # the choices the flags offer (precision: per table, above)
            allowed = f.metadata.get("choices")
            if allowed is not None and name != "precision" and getattr(self, name) not in (*allowed, None):
                raise SlipcacheError(
                    f"{_named(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        positive = ["batch_size", "epochs", "embedding_dim", "samples", "log_every", "eval_every", "lookahead"]
        positive += ["checkpoint_every", "eval_samples", "synthetic_samples", "max_rows", "min_count", "threads"]
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SlipcacheError(f"{_named(name)} must be positive, got {value}")
        value = self.synthetic_scale
        if value is not None and not value > 0:  # also rejects nan
            raise SlipcacheError(f"{_named('synthetic_scale')} must be positive, got {value}")
        for name in ("lr", "dense_lr"):  # 0 is a rate: those parameters stay as they are
            value = getattr(self, name)
            if value is not None and not value >= 0:  # also rejects nan
                raise SlipcacheError(f"{_named(name)} must be >= 0, got {value}")
        if self.batch_size > 2**31:  # rows of a batch are indexed with int32 offsets
            raise SlipcacheError(f"{_named('batch_size')} must be at most 2**31, got {self.batch_size}")
        if self.max_rows > 2**31:  # rows are int32 ids
            raise SlipcacheError(f"{_named('max_rows')} must be at most 2**31, got {self.max_rows}")
        if self.out == "" or self.resume == "":
            raise SlipcacheError("--out and --resume need a directory name, got an empty one")
        for name in ("lr", "dense_lr"):  # the update multiplies float32 parameters by it
            value = getattr(self, name)
            if value is not None and value > FLOAT32_MAX:
                raise SlipcacheError(f"{_named(name)} must fit a float32 (at most {FLOAT32_MAX:.3g}), got {value}")
        if self.table_sizes is not None and (not self.table_sizes or min(self.table_sizes) < 1):
            raise SlipcacheError(f"{_named('table_sizes')} must be positive row counts, got {self.table_sizes}")
        for share in self.cache_size if isinstance(self.cache_size, list) else [self.cache_size]:
            if not 0.0 <= share <= 1.0:  # also rejects nan and inf
                hint = f" (for a number of rows use --cache-rows {share:g})" if share > 1 else ""
                raise SlipcacheError(f"{_named('cache_size')} is the share of rows cached in [0, 1]; got {share}{hint}")
        for count in self.cache_rows if isinstance(self.cache_rows, list) else [self.cache_rows]:
            if count is not None and count < 0:
                raise SlipcacheError(f"{_named('cache_rows')} must be >= 0, got {count}")
        if not 0 <= self.seed < 2**32:
            raise SlipcacheError(f"{_named('seed')} must be in [0, 2**32), got {self.seed}")
        for name in ("lr_warmup_steps", "lr_decay_start", "lr_decay_steps", "checkpoint_minutes"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # also rejects nan
                raise SlipcacheError(f"{_named(name)} must be 0 or more, got {value}")
        if self.keep_checkpoints < 1:
            raise SlipcacheError(f"{_named('keep_checkpoints')} must be at least 1, got {self.keep_checkpoints}")
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
        self._validate_schedule()
        if not 0.0 < self.stale_hot_rate <= 1.0:
            raise SlipcacheError(f"stale_hot_rate must be in (0, 1], got {self.stale_hot_rate}")
        if not 0.0 < self.prune_share < 1.0 or not 0.0 <= self.prune_final < 1.0:
            raise SlipcacheError("prune_share must be in (0, 1) and prune_final in [0, 1)")
        if self.stale_min_updates < 1 or self.stale_warmup_epoch < 0 or not 0.0 <= self.stale_warmup_min < 1.0:
            raise SlipcacheError("stale_min_updates must be >= 1, stale_warmup_epoch >= 0, stale_warmup_min in [0, 1)")
        if not 0.0 < self.stale_count_share <= 1.0:
            raise SlipcacheError(f"stale_count_share must be in (0, 1], got {self.stale_count_share}")
        if not 0.0 <= self.stale_keep <= 1.0 or not 0.0 <= self.stale_warmup_tol < 1.0:
            raise SlipcacheError("stale_keep must be in [0, 1] and stale_warmup_tol in [0, 1)")
        if self.stale_reweight and self.stale_keep == 0.0:
            raise SlipcacheError("stale_reweight needs stale_keep > 0 (the kept share p is weighted 1/p)")
        if self.stale_weight_max is not None and not self.stale_weight_max >= 1.0:
            raise SlipcacheError(f"stale_weight_max must be >= 1, got {self.stale_weight_max}")
        if (self.stale_recheck is not None and self.stale_recheck < 0) or not self.stale_min_accesses >= 0:
            raise SlipcacheError(
                "stale_recheck must be >= 0 (0 = window length) or None, stale_min_accesses >= 0"
            )

    def _validate_schedule(self) -> None:
        """The window's position, the order and freezing (`slipcache.staleness.schedule`, `freezing`)."""
        if self.stale_hot_share is not None and not 0.0 < self.stale_hot_share <= 1.0:
            raise SlipcacheError(f"stale_hot_share must be in (0, 1], got {self.stale_hot_share}")
        if not 0.0 < self.stale_threshold_sample <= 1.0 or not 0.0 < self.freeze_share <= 1.0:
            raise SlipcacheError("stale_threshold_sample and freeze_share must be in (0, 1]")
        if self.stale_window_start is not None and not 0.0 <= self.stale_window_start <= 1.0:
            raise SlipcacheError(f"stale_window_start must be in [0, 1], got {self.stale_window_start}")
        if self.stale_window_start_max is not None and self.stale_window_start_max < 0:
            raise SlipcacheError(f"stale_window_start_max must be >= 0, got {self.stale_window_start_max}")
        counted_hot = self.stale_window_count == "hot" and self.stale_window_start is not None
        if counted_hot and self.input_order != "cold_first":
            raise SlipcacheError("a window counted in hot batches (stale_window_count hot) needs "
                                 "input_order cold_first")
        if self.freeze_rows is not None and self.skip_rule is not None:
            raise SlipcacheError("freeze_rows and skip_rule are separate arms: set one of them")
        if self.freeze_rows is not None and self.stale_window_start is None:
            raise SlipcacheError("freeze_rows needs stale_window_start: where the window that picks the rows opens")


# `--quick`: a scaled-down synthetic dataset, smaller MLPs and a 600k-sample budget; applied only to
# fields the user did not set. Tuned for a test AUC above 0.70 well under a minute on 2 CPU cores (the
# README gives the measured wall time and AUC).
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

CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _named(name: str) -> str:
    """How an error names a setting of `TrainConfig` (`settings.setting_name`)."""
    return setting_name(name, CONFIG_FIELDS[name])


_TYPES = typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: Any) -> Any:
    return coerce(name, _TYPES[name], value)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml/.json) config file into {field: value}."""
    return read_settings_file(path, CONFIG_FIELDS, _coerce)


def make_config(
    file_values: dict[str, Any] | None = None, flag_values: dict[str, Any] | None = None
) -> TrainConfig:
    """Defaults, then `--quick`, then a `--stale-preset`, then the config file, then command-line flags."""
    user = {**(file_values or {}), **(flag_values or {})}
    preset = user.get("stale_preset")
    if preset is not None and preset not in STALE_PRESETS:
        raise SlipcacheError(f"stale_preset must be one of {', '.join(STALE_PRESETS)}, got {preset!r}")
    # each fills only what the later ones leave: the preset wins over --quick, the user over both
    given = {**(QUICK if user.get("quick") else {}), **(STALE_PRESETS[preset] if preset else {}), **user}
    if "embedding_dim" in user and "bottom_mlp" not in user:
        # The bottom MLP's output meets the embeddings, so its last layer follows --dim.
        base = given.get("bottom_mlp", TrainConfig().bottom_mlp)
        given["bottom_mlp"] = [*base[:-1], user["embedding_dim"]]
    config = TrainConfig(**given)
    config.validate()
    # What was set on purpose (flags, the file, --quick), whatever the value: a resume compares these
    # with the run's settings, so `--lr 0.3` given on resume counts even though 0.3 is the default.
    config.given_fields = frozenset(given)  # type: ignore[attr-defined]
    for message in ignored_settings(config, set(user)):
        logger.warning(f"slipcache train: warning: {message}")
    return config


def ignored_settings(config: TrainConfig, given: set[str]) -> list[str]:
    """Settings the user gave that this combination does not use: said once instead of silently dropped."""
    notes = []
    if "table_sizes" in given and config.data is None:
        notes.append("--table-sizes applies to TorchRec/DLRM/MLPerf files; synthetic data ignores it")
    cached = config.embeddings == "cached" and config.policy != "none"
    if not cached and given & {"cache_size", "cache_rows"}:
        notes.append("no cache (--policy none or --embeddings torch): --cache-size/--cache-rows are ignored")
    if config.prefetch and not cached:
        notes.append("--prefetch reads rows into the cache, and there is none: ignored")
    return notes


def cache_rows_note(config: TrainConfig, table_sizes: list[int]) -> str | None:
    """What a `cache_rows` beyond the tables' rows does, said instead of a silent cap: every row cached,
    which holds more memory than plain fp32 tables would."""
    if config.cache_rows is None or config.embeddings != "cached" or config.policy == "none":
        return None
    counts = config.cache_rows if isinstance(config.cache_rows, list) else [config.cache_rows]
    limits = list(table_sizes) if isinstance(config.cache_rows, list) else [sum(table_sizes)]
    over = [(count, rows) for count, rows in zip(counts, limits, strict=False) if count > rows]
    if not over:
        return None
    count, rows = over[0]
    return (f"--cache-rows {_digits(count)} is more than the {rows:,} rows there are: the cache holds every row "
            f"({rows:,}), which takes more memory than fp32 tables without a cache (--embeddings torch)")


def config_from_saved(saved: Any, where: str) -> TrainConfig:
    """A run's config from its checkpoint or config.json, checked like any other input."""
    if not isinstance(saved, dict):
        raise SlipcacheError(f"{where} holds no run config")
    try:
        # huge_pages was None ("the environment's choice") in runs saved before it was a plain setting
        given = {k: v for k, v in saved.items() if k in CONFIG_FIELDS and not (k == "huge_pages" and v is None)}
        config = TrainConfig(**given)
        config.validate()
    except (TypeError, SlipcacheError) as exc:
        raise SlipcacheError(f"{where} holds an invalid run config: {exc}") from exc
    return config
