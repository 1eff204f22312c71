"""`TrainConfig`: everything a run depends on, as parts (`training/parts.py`), each checked once when it is
built; and how a config file and command-line flags combine into it (defaults, then `--quick`, then a
`--stale-preset`, then the file, then flags).

A setting has one key, its field's name (`lr`, `stale_target`), unique over the parts: flags, flat config
files, config.json and checkpoints use it; a config file may also nest the keys by part (`[embeddings]`).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipcache.errors import SlipcacheError
from slipcache.model import ModelConfig
from slipcache.staleness.config import STALE_PRESETS, StalenessConfig
from slipcache.training.parts import (
    DataSettings,
    EmbeddingSettings,
    ModelSettings,
    ProcessSettings,
    RunSettings,
    ScheduleSettings,
    SkippingSettings,
)
from slipcache.training.settings import (
    GROUPS,
    _digits,
    coerce,
    part_options,
    read_settings_file,
)

logger = logging.getLogger(__name__)

# The part each attribute of a TrainConfig is, in GROUPS' order.
PARTS: dict[str, type] = {
    "run": RunSettings,
    "data": DataSettings,
    "embeddings": EmbeddingSettings,
    "model": ModelSettings,
    "schedule": ScheduleSettings,
    "process": ProcessSettings,
    "skipping": SkippingSettings,
}
assert tuple(PARTS) == tuple(GROUPS)
# Every setting by its key: its field in its part, and which part that is.
CONFIG_FIELDS: dict[str, dataclasses.Field] = {f.name: f for kind in PARTS.values() for f in dataclasses.fields(kind)}
PART_OF: dict[str, str] = {f.name: part for part, kind in PARTS.items() for f in dataclasses.fields(kind)}
assert len(CONFIG_FIELDS) == sum(len(dataclasses.fields(kind)) for kind in PARTS.values()), "keys must be unique"


@dataclass
class TrainConfig:
    """Everything a run depends on, by part. `None` settings are derived from the data in `resolve_schedule`.

    `given`: the keys set on purpose (flags, the file, --quick; `make_config` records them), whatever the
    value: a resume compares these with the run's settings; None: not recorded (built directly).
    """

    run: RunSettings = field(default_factory=RunSettings)
    data: DataSettings = field(default_factory=DataSettings)
    embeddings: EmbeddingSettings = field(default_factory=EmbeddingSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    process: ProcessSettings = field(default_factory=ProcessSettings)
    skipping: SkippingSettings = field(default_factory=SkippingSettings)
    given: frozenset[str] | None = field(default=None, compare=False)

    @classmethod
    def from_flat(cls, values: dict[str, Any], given: frozenset[str] | None = None) -> TrainConfig:
        """A config from {key: value} (a flat config file, config.json, a checkpoint); each part checks its own."""
        unknown = sorted(set(values) - set(CONFIG_FIELDS))
        if unknown:
            raise SlipcacheError(f"unknown settings: {', '.join(unknown)}")
        values = bottom_follows_dim(values, values)
        by_part: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
        for key, value in values.items():
            by_part[PART_OF[key]][key] = value
        return cls(**{part: PARTS[part](**options) for part, options in by_part.items()}, given=given)

    def flat(self) -> dict[str, Any]:
        """{key: value} of every setting: what config.json and checkpoints record."""
        return {key: getattr(getattr(self, part), key) for key, part in PART_OF.items()}

    def get(self, key: str) -> Any:
        return getattr(getattr(self, PART_OF[key]), key)

    def replaced(self, **values: Any) -> TrainConfig:
        """A copy with these settings (by key) changed, checked like any other."""
        return TrainConfig.from_flat({**self.flat(), **values}, given=self.given)

    def mlp_lr(self) -> float:
        """The MLPs' learning rate: `--dense-lr`, else the tables' `--lr`."""
        return self.embeddings.lr if self.model.dense_lr is None else self.model.dense_lr

    def embedding_options(self) -> dict[str, Any]:
        """The embedding collection's settings (`EmbeddingConfig` fields, dim included), shared by the
        one-process and the sharded model."""
        return self.library_options("embedding")

    def model_config(self, table_sizes: list[int], num_dense: int) -> ModelConfig:
        return ModelConfig(list(table_sizes), num_dense, **self.library_options("model"))

    def staleness_config(self, **overrides: Any) -> StalenessConfig:
        """The detector's settings; `overrides`: those another setting decides (e.g. the rule for random)."""
        return StalenessConfig(**{**self.library_options("staleness"), **overrides})

    def library_options(self, library: str) -> dict[str, Any]:
        """The settings that set fields of the library config `library` (`settings.PART_CONFIGS`), by its field."""
        options: dict[str, Any] = {}
        for part in PARTS:
            own = getattr(self, part)
            options.update(part_options(own, {f.name: f for f in dataclasses.fields(own)}, library))
        return options


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

SETTING_TYPES = {key: hint for kind in PARTS.values() for key, hint in typing.get_type_hints(kind).items()}


def _coerce(name: str, value: Any) -> Any:
    return coerce(name, SETTING_TYPES[name], value)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml/.json) config file into {key: value}: flat keys, or keys
    nested by part (`[embeddings]` / `embeddings:`)."""
    return read_settings_file(path, CONFIG_FIELDS, _coerce, sections=PART_OF)


def make_config(
    file_values: dict[str, Any] | None = None, flag_values: dict[str, Any] | None = None
) -> TrainConfig:
    """Defaults, then `--quick`, then a `--stale-preset`, then the config file, then command-line flags."""
    user = {**(file_values or {}), **(flag_values or {})}
    preset = user.get("stale_preset")
    if preset is not None:
        SkippingSettings(stale_preset=preset)  # its part checks it (one of STALE_PRESETS) before it is applied
    # each fills only what the later ones leave: the preset wins over --quick, the user over both
    given = bottom_follows_dim(
        {**(QUICK if user.get("quick") else {}), **(STALE_PRESETS[preset] if preset else {}), **user}, user
    )
    config = TrainConfig.from_flat(given, given=frozenset(given))
    for message in ignored_settings(config, set(user)):
        logger.warning(f"slipcache train: warning: {message}")
    return config


def bottom_follows_dim(values: dict[str, Any], chosen: Collection[str]) -> dict[str, Any]:
    """`values` with the bottom MLP's last layer set to the embedding dim where `chosen` (what was set on
    purpose) names the dim and not the bottom MLP: its output meets the embeddings. The widths before it are
    those of `values` (e.g. --quick's), else the default."""
    if "embedding_dim" not in chosen or "bottom_mlp" in chosen:
        return values
    base = values.get("bottom_mlp", ModelSettings().bottom_mlp)
    return {**values, "bottom_mlp": [*base[:-1], values["embedding_dim"]]}


def ignored_settings(config: TrainConfig, given: set[str]) -> list[str]:
    """Settings the user gave that this combination does not use: said once instead of silently dropped."""
    notes = []
    if "table_sizes" in given and config.data.data is None:
        notes.append("--table-sizes applies to TorchRec/DLRM/MLPerf files; synthetic data ignores it")
    cached = config.embeddings.embeddings == "cached" and config.embeddings.policy != "none"
    if not cached and given & {"cache_size", "cache_rows"}:
        notes.append("no cache (--policy none or --embeddings torch): --cache-size/--cache-rows are ignored")
    if config.embeddings.prefetch and not cached:
        notes.append("--prefetch reads rows into the cache, and there is none: ignored")
    return notes


def cache_rows_note(config: TrainConfig, table_sizes: list[int]) -> str | None:
    """What a `cache_rows` beyond the tables' rows does, said instead of a silent cap: every row cached,
    which holds more memory than plain fp32 tables would."""
    tables = config.embeddings
    if tables.cache_rows is None or tables.embeddings != "cached" or tables.policy == "none":
        return None
    counts = tables.cache_rows if isinstance(tables.cache_rows, list) else [tables.cache_rows]
    limits = list(table_sizes) if isinstance(tables.cache_rows, list) else [sum(table_sizes)]
    over = [(count, rows) for count, rows in zip(counts, limits, strict=False) if count > rows]
    if not over:
        return None
    count, rows = over[0]
    return (f"--cache-rows {_digits(count)} is more than the {rows:,} rows there are: the cache holds every row "
            f"({rows:,}), which takes more memory than fp32 tables without a cache (--embeddings torch)")


# Settings slipcache train no longer has (a study's arm, now research code, or a variant no study measured),
# with the value that meant "off".
RESEARCH_SETTINGS: dict[str, Any] = {
    "freeze_rows": None, "stale_reweight": False, "stale_weight_max": None,
    "stale_min_accesses": 0.0, "stale_release_cache": False, "stale_refit": True,
}  # fmt: skip


def config_from_saved(saved: Any, where: str) -> TrainConfig:
    """A run's config from its checkpoint or config.json, checked like any other input."""
    if not isinstance(saved, dict):
        raise SlipcacheError(f"{where} holds no run config")
    for key, off in RESEARCH_SETTINGS.items():  # runs saved while a study's arm was a setting of its own
        if saved.get(key, off) != off:
            raise SlipcacheError(
                f"{where}: this run used {key} {saved[key]}, a setting slipcache train no longer has (a study's "
                "arm, or a variant no study measured): continue it with the version or the study that started it "
                "(python -m benchmarks.studies NAME --resume)"
            )
    # huge_pages was None ("the environment's choice") in runs saved before it was a plain setting
    given = {k: v for k, v in saved.items() if k in CONFIG_FIELDS and not (k == "huge_pages" and v is None)}
    try:
        return TrainConfig.from_flat(given)
    except SlipcacheError as exc:
        raise SlipcacheError(f"{where} holds an invalid run config: {exc}") from exc
