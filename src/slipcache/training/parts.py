"""The parts of a `TrainConfig`, one dataclass each: every setting of `slipcache train` is one field of one
part, described there once (`settings.flag`: help, choices, range, default) and checked by its part at
construction. A setting that configures a library part (`sets=`: `EmbeddingConfig`, `ModelConfig`,
`StalenessConfig`) takes its default and its range from that part's field.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipcache.data.formats import SPLIT_ORDERS
from slipcache.data.synthetic import DEFAULT_GENERATOR, GENERATOR_VERSIONS
from slipcache.embedding.cache import POLICIES
from slipcache.embedding.config import OPTIMIZERS, EmbeddingConfig
from slipcache.embedding.hostmem import HUGE_PAGE_MODES
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS
from slipcache.errors import SlipcacheError
from slipcache.model import AUTOCAST_DTYPES, EMBEDDING_KINDS, INTERACTIONS, ModelConfig
from slipcache.options import HUGE_PAGES_HELP, SEED_RANGE, THREADS_DEFAULT, THREADS_HELP
from slipcache.staleness.config import (
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
from slipcache.training.settings import check_library, check_settings
from slipcache.training.settings import flag as _flag  # the one way a setting is described

VOCABS = ("frequency", "hash")
WIRE_PRECISIONS = ("fp32", "fp16", "bf16")
TIME_ORDERS = ("first", "every")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")  # the MLPs' (`backend.dense_optimizer`)
LR_SCHEDULES = ("constant", "mlperf")  # `training/schedule.py`
# What a run of any length gets when the intervals are not given (`trainer.resolve_schedule`).
LOGS_PER_RUN, EVALS_PER_RUN, CHECKPOINTS_PER_RUN = 100, 10, 4
# The mlperf schedule's warm-up and decay start when not given, as shares of the run's steps (`schedule.py`).
WARMUP_SHARE, DECAY_START_SHARE = 0.04, 0.75


@dataclass
class RunSettings:
    """Where the run lives and how this invocation continues it."""

    out: str | None = _flag(None, "run directory", resume="free", default_text="runs/<timestamp>")
    resume: str | None = _flag(None, "continue an interrupted run, in its own directory (or a new empty --out)",
                               resume="free", metavar="RUN_OR_CHECKPOINT")
    allow_changes: bool = _flag(False, "with --resume: continue with settings that differ from the run's "
                                "(e.g. a larger --samples); they are recorded", resume="free")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.out == "" or self.resume == "":
            raise SlipcacheError("--out and --resume need a directory name, got an empty one")


@dataclass
class DataSettings:
    """What the run trains on: a dataset, raw files read in place, or synthetic data."""

    data: str | None = _flag(None, "raw Criteo file/dir (any of the 3 formats) or a preprocessed dataset dir",
                             resume="fixed", default_text="synthetic data")
    vocab: str = _flag("frequency", "raw data vocabulary, as `slipcache preprocess`: frequency (a row per value seen "
                       "in train, tables sized to the data) or hash (--max-rows hashed rows per table)",
                       resume="fixed", choices=VOCABS)
    max_rows: int = _flag(1_000_000, "raw data, --vocab hash: rows per table (DLRM's max-ind-range)",
                          resume="fixed", within="(0, 2**31]")
    min_count: int = _flag(1, "raw data, frequency vocabulary: rarer values map to row 0 (unknown)",
                           resume="fixed", within="(0, inf)")
    synthetic_samples: int = _flag(4_000_000, resume="fixed", within="(0, inf)",
                                   doc="synthetic data: rows generated (80/10/10 train/val/test)")
    synthetic_scale: float = _flag(0.05, resume="fixed", within="(0, inf)",
                                   doc="synthetic data: table sizes relative to Criteo Kaggle (data.kaggle)")
    synthetic_generator: str = _flag(DEFAULT_GENERATOR, "synthetic data generator: v5 (the default: v4 with the "
                                     "label signal of real rows in the big tables; docs/data.md), v4 (v3 with real "
                                     "signal, dense shapes and links) or v3 (entities, time order)",
                                     resume="fixed", flag=("--generator",),
                                     choices=tuple(GENERATOR_VERSIONS))
    strict: bool = _flag(False, "raw data: stop at the first malformed line instead of skipping it",
                         resume="fixed")
    table_sizes: list[int] | None = _flag(
        None, "TorchRec/DLRM/MLPerf files: rows per table, one for all, 26 comma-separated or a preset (mlperf, "
        "kaggle); ids are taken modulo them (TorchRec's hashes). A slipcache dataset must match its own sizes",
        resume="fixed", type="table_sizes", default_text="the files' counts, else max id + 1")
    split_order: str | None = _flag(None, "which half of the last day is validation", resume="fixed",
                                    choices=SPLIT_ORDERS, default_text="the format's convention")
    time_order: str = _flag("first", "time-ordered data: first: the first epoch through time, later ones shuffled "
                            "across days (validation AUC does not saw at epoch boundaries); every: every epoch "
                            "through time", resume="fixed", choices=TIME_ORDERS)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.table_sizes is not None and (not self.table_sizes or min(self.table_sizes) < 1):
            raise SlipcacheError(f"--table-sizes must be positive row counts, got {self.table_sizes}")


@dataclass
class EmbeddingSettings:
    """The tables: kind, storage precision, cache, their optimizer; checked by `EmbeddingConfig` itself."""

    embeddings: str = _flag("cached", "cached = mixed-precision + fp32 cache; torch = fp32 nn.EmbeddingBag "
                            "baseline", resume="fixed", choices=EMBEDDING_KINDS)
    # precision, cache_size, cache_rows: one value, or (config files) a list with one value per table
    precision: str | list[str] = _flag(help="embedding storage precision", resume="fixed",
                                       sets="embedding.precision", choices=PRECISIONS)
    cache_size: float | list[float] = _flag(help="share of rows cached, 0..1; 1 = every row", resume="fixed",
                                            sets="embedding.cache_size")
    cache_rows: int | list[int] | None = _flag(help="cache capacity as a number of rows (overrides --cache-size)",
                                               resume="fixed", sets="embedding.cache_rows")
    policy: str = _flag(help="cache replacement policy; none = no cache", resume="fixed",
                        sets="embedding.policy", choices=POLICIES)
    lookahead: int = _flag(4, "batches ahead the lookahead policies (lookahead, lookahead-lfu) see, and that rows "
                           "on disk (--storage-path) are read ahead", resume="fixed", within="(0, inf)")
    prefetch: bool = _flag(False, "read the next batch's rows into the cache in the background while the "
                           "current one computes", resume="fixed")
    rounding: str = _flag(help="rounding into storage", resume="fixed",
                          sets="embedding.rounding", choices=ROUNDINGS)
    optimizer: str = _flag(help="embedding optimizer", resume="fixed",
                           sets="embedding.optimizer", choices=OPTIMIZERS)
    # The trainer's own learning rate (tuned on synthetic data at batch 256), not the collection's 0.1.
    lr: float = _flag(0.3, "embedding learning rate", resume="changeable", sets="embedding.lr")
    wire_precision: str = _flag("fp32", "torchrun runs: the pooled rows and their gradients between ranks, in "
                                "TorchRec's codecs; fp16 (gradients in bf16) and bf16 send half the bytes",
                                resume="changeable", choices=WIRE_PRECISIONS)
    storage_path: str | None = _flag(None, "keep the row storage in memory-mapped files in DIR (unnamed: gone with "
                                     "the process) so that tables larger than memory train, the OS paging rows in; "
                                     "the memory check then counts the cache and optimizer state only; docs/scale.md "
                                     "says when it pays", resume="free",
                                     sets="embedding.storage_path", metavar="DIR", default_text="in memory")

    def __post_init__(self) -> None:
        check_settings(self)
        lists = [v for v in (self.precision, self.cache_size, self.cache_rows) if isinstance(v, list)]
        tables = [1] * (len(lists[0]) if lists else 1)  # per-table values are matched to the tables later
        check_library(self, "embedding", lambda options: EmbeddingConfig(tables, **options))


@dataclass
class ModelSettings:
    """The MLPs, their optimizer and the seed; the shapes are checked by `ModelConfig` itself."""

    dense_lr: float | None = _flag(None, "MLP learning rate", resume="changeable", within="[0, float32]",
                                   default_text="--lr")
    dense_optimizer: str = _flag("sgd", "MLP optimizer", resume="fixed", choices=DENSE_OPTIMIZERS)
    embedding_dim: int = _flag(help="embedding dimension", resume="fixed",
                               sets=("embedding.dim", "model.embedding_dim"), flag=("--dim",))
    bottom_mlp: list[int] = _flag(help="bottom MLP widths, comma-separated; the last is the embedding dim "
                                  "(--dim alone sets it)", resume="fixed", sets="model.bottom_mlp",
                                  type="int_list", metavar="N,N,...")
    top_mlp: list[int] = _flag(help="top MLP widths, comma-separated; the last is 1, the logit", resume="fixed",
                               sets="model.top_mlp", type="int_list", metavar="N,N,...")
    interaction: str = _flag(help="how the bottom MLP's output meets the embeddings: dot (pairwise dot products, "
                             "DLRM) or cat (side by side)", resume="fixed",
                             sets="model.interaction", choices=INTERACTIONS)
    autocast: str | None = _flag(help="compute the MLPs and the interaction in this dtype (torch.autocast; the "
                                 "tables keep their precision)", resume="changeable",
                                 sets="model.autocast", choices=tuple(AUTOCAST_DTYPES), default_text="fp32")
    seed: int = _flag(0, "random seed (model init, shuffling, stochastic rounding)", resume="fixed",
                      within=SEED_RANGE,
                      sets=("embedding.seed", "staleness.seed"))

    def __post_init__(self) -> None:
        check_settings(self)
        check_library(self, "embedding", lambda options: EmbeddingConfig([1], **options))  # the dim, the seed
        check_library(self, "model", lambda options: ModelConfig([1], **options))


@dataclass
class ScheduleSettings:
    """Batch, budget, learning-rate schedule, evaluation, checkpoints and reports, all counted in samples."""

    batch_size: int = _flag(256, "samples per batch", resume="fixed", within="(0, 2**31]")
    epochs: int = _flag(1, "passes over the training split", resume="changeable", within="(0, inf)")
    samples: int | None = _flag(None, "training budget in samples (overrides --epochs)", resume="changeable",
                                within="(0, inf)", default_text="--epochs passes over the split")
    log_every: int | None = _flag(None, resume="changeable", within="(0, inf)",
                                  doc=f"samples between metrics.jsonl events; None: {LOGS_PER_RUN} per run")
    eval_every: int | None = _flag(None, "evaluate on the validation split after every SAMPLES samples consumed "
                                   "(trained or skipped)", resume="changeable", within="(0, inf)", metavar="SAMPLES",
                                   default_text=f"{EVALS_PER_RUN} per run")
    eval_samples: int | None = _flag(100_000, "validation samples per evaluation, the first N of the split "
                                     "(a config file's null: all)", resume="changeable", within="(0, inf)",
                                     metavar="N")
    checkpoint_every: int | None = _flag(None, "samples between checkpoints", resume="changeable", within="(0, inf)",
                                         default_text=f"{CHECKPOINTS_PER_RUN} per run")
    checkpoint_minutes: float = _flag(10.0, "also a checkpoint after every N minutes of training: the most work a "
                                      "kill loses (0: none)", resume="free", within="[0, inf)", metavar="N")
    checkpoint_on_interrupt: bool = _flag(True, "no checkpoint on Ctrl-C or SIGTERM (by default the run writes one "
                                          "at the step under way and stops, naming the --resume command)",
                                          resume="free", flag=("--no-checkpoint-on-interrupt",))
    lr_schedule: str = _flag("constant", "learning rate of the MLPs and the tables over the run: constant, or mlperf "
                             "(the MLPerf DLRM reference's linear warm-up, then quadratic decay)",
                             resume="changeable", choices=LR_SCHEDULES)
    lr_warmup_steps: int | None = _flag(None, "mlperf schedule: steps of linear warm-up from 0",
                                        resume="changeable", within="[0, inf)", metavar="STEPS",
                                        default_text=f"{WARMUP_SHARE * 100:g} percent of the run's steps")
    lr_decay_start: int | None = _flag(None, "mlperf schedule: the step the decay starts at", resume="changeable",
                                       within="[0, inf)", metavar="STEP",
                                       default_text=f"{DECAY_START_SHARE * 100:g} percent of the run's steps")
    lr_decay_steps: int | None = _flag(None, "mlperf schedule: steps of the decay (its last rate then holds)",
                                       resume="changeable",
                                       within="[0, inf)", metavar="STEPS", default_text="the rest of the run")
    keep_checkpoints: int = _flag(2, "periodic checkpoints kept on disk, newest first (the MLPerf tables take "
                                  "15 GB each)", resume="changeable", within="[1, inf)")
    # quick only fills other settings (MLP widths: the checkpoint's shape), so a resume never takes it
    quick: bool = _flag(False, "small synthetic run, well under a minute", resume="fixed")
    progress: bool = _flag(True, resume="free",
                           doc="tqdm progress bar (--no-progress / --quiet, as on every long command)")
    tensorboard: str | None = _flag(None, "also write the metrics as TensorBoard events into DIR", resume="free",
                                    metavar="DIR", nargs="?", const="",
                                    default_text="none; DIR alone: <out>/tensorboard")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class ProcessSettings:
    """How this process computes; a resume keeps the run's unless given."""

    threads: int | None = _flag(None, f"{THREADS_HELP}; a resume keeps the run's unless given", resume="free",
                                within="(0, inf)", default_text=THREADS_DEFAULT, type="positive_int")
    huge_pages: str = _flag(help=HUGE_PAGES_HELP, resume="free", choices=HUGE_PAGE_MODES, sets="embedding.huge_pages")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class SkippingSettings:
    """Stale-input skipping (slipcache.staleness, docs/skipping.md); the detector's settings are
    `StalenessConfig`'s, checked by it."""

    skip_rule: str | None = _flag(None, SKIP_RULE_HELP, resume="fixed", choices=SKIP_RULES,
                                  default_text="none: train on every input")
    stale_preset: str | None = _flag(None, "a set of --stale-* settings (flags you give still win): " + preset_help(),
                                     resume="fixed", choices=tuple(STALE_PRESETS))
    input_order: str = _flag("data", "data: the data's own order; cold_first: FAE's order, each epoch's cold inputs "
                             "first, then its hot ones (every lookup a hot row), each part in the data's order",
                             resume="fixed", choices=ORDERS)
    stale_hot_share: float | None = _flag(help="hot set size as a share of all rows, replacing --stale-budget-mb "
                                          "(paper: 0.1242, 256 MB at dim 16 over Criteo Kaggle's 33.8 M rows)",
                                          resume="fixed", sets="staleness.hot_share",
                                          default_text="the budget")
    stale_threshold_sample: float = _flag(help="share of inputs sampled to fit T, of the hot inputs under "
                                          "--input-order cold_first; at least 4,096", resume="changeable",
                                          sets="staleness.threshold_sample_fraction")
    stale_window_start: float | None = _flag(None, "open each epoch's window after this share of its batches "
                                             "(counted as --stale-window-count says)", resume="changeable",
                                             within="[0, 1]", default_text="the warm-up rule")
    stale_window_start_max: int | None = _flag(None, "open it at most this many batches after the count's start",
                                               resume="changeable", within="[0, inf)", default_text="no cap")
    stale_window_count: str = _flag("epoch", "what --stale-window-start and --stale-window are shares of: epoch: "
                                    "the epoch's batches from its start; hot: its hot batches, after the cold pass "
                                    "(needs --input-order cold_first)", resume="fixed",
                                    choices=WINDOW_COUNTS)
    stale_hot_set: str = _flag(help="budget: most accessed rows that fit --stale-budget-mb; frequency: FAE's "
                               "threshold", resume="fixed", sets="staleness.hot_set",
                               choices=HOT_SETS)
    stale_hot_rate: float = _flag(help="frequency hot set: share of profiled inputs a hot row is looked up by",
                                  resume="fixed", sets="staleness.hot_min_rate")
    prune_share: float = _flag(0.5, "loss rule: r, share of below-mean-loss inputs pruned; kept ones weigh 1/(1-r)",
                               resume="fixed", within="(0, 1)")
    prune_final: float = _flag(0.125, "loss rule: last share of the run on all data", resume="fixed", within="[0, 1)")
    stale_target: float = _flag(help="D: share of hot inputs to skip, fitted anew each epoch", resume="changeable",
                                sets="staleness.target_drop")
    stale_guard: bool = _flag(True, "no accuracy guard (by default D is backed off, or skipping stopped, when "
                              "skipped inputs' loss drifts above trained ones')", resume="changeable",
                              flag=("--no-stale-guard",))
    stale_guard_every: int = _flag(100, "batches between guard checks", resume="changeable", within="[1, inf)")
    stale_alpha: float = _flag(help="share of an input's lookups that must be hot, and stale to skip it (1: all; "
                               "0.9 = 24 of 26)", resume="changeable", sets="staleness.alpha")
    stale_window: float = _flag(help="share of an epoch's batches in the snapshot window", resume="changeable",
                                sets="staleness.window_fraction")
    stale_recheck: int | None = _flag(help="batches between rolling snapshots (0 = the window length; None in "
                                      "config files: off)", resume="changeable",
                                      sets="staleness.recheck_interval")
    stale_budget_mb: float = _flag(help="hot-row snapshot budget in MiB", resume="changeable",
                                   sets="staleness.memory_budget_bytes", scale=2**20)
    stale_rule: str = _flag(help="convergence: change per update of rows updated >= k times; paper: L-inf change "
                            "between snapshots", resume="fixed", sets="staleness.rule",
                            choices=RULES)
    stale_min_updates: int = _flag(help="k: updates before a row is judged (convergence rule)", resume="changeable",
                                   sets="staleness.min_updates")
    stale_count_share: float = _flag(help="share of each trained batch whose row updates are counted, then scaled "
                                     "up (convergence rule)", resume="changeable",
                                     sets="staleness.count_share")
    stale_warmup: str = _flag("val", "skip after the validation loss flattened (val), from "
                              "--stale-warmup-epoch (epoch), or at once (none)", resume="changeable", choices=WARMUPS)
    stale_warmup_epoch: int = _flag(1, "0-based epoch from which skipping starts at the latest (1 = the 2nd)",
                                    resume="changeable", within="[0, inf)")
    stale_warmup_min: float = _flag(0.1, "never skip in this first share of the run", resume="changeable",
                                    within="[0, 1)")
    stale_warmup_tol: float = _flag(0.005, "relative validation-loss gain on its best that still counts",
                                    resume="changeable", within="[0, 1)")
    stale_decision: str = _flag("rolling", "rolling re-checks, or one decision per epoch (epoch: the authors')",
                                resume="changeable", choices=DECISIONS)
    stale_keep: float = _flag(0.05, "p: share of would-be-skipped inputs trained anyway, the guard's control",
                              resume="changeable", within="[0, 1]")

    def __post_init__(self) -> None:
        check_settings(self)
        check_library(self, "staleness", lambda options: StalenessConfig(**options))
        counted_hot = self.stale_window_count == "hot" and self.stale_window_start is not None
        if counted_hot and self.input_order != "cold_first":
            raise SlipcacheError("a window counted in hot batches (stale_window_count hot) needs "
                                 "input_order cold_first")
