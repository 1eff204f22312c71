"""TrainConfig is made of parts, each checking its own settings once, at construction, with one error naming
the flag; a setting's range, default and help are written once (in its part, or in the library config it
sets); config files may nest keys by part, and flat keys, config.json and checkpoints still read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from slipcache.embedding.config import EmbeddingConfig
from slipcache.errors import SettingError, SlipcacheError
from slipcache.model import ModelConfig
from slipcache.staleness.config import STALE_PRESETS, StalenessConfig
from slipcache.training.config import (
    CONFIG_FIELDS,
    PART_OF,
    PARTS,
    QUICK,
    RESEARCH_SETTINGS,
    TrainConfig,
    config_from_saved,
    load_config_file,
    make_config,
)
from slipcache.training.parts import EmbeddingSettings, ModelSettings, ScheduleSettings, SkippingSettings
from slipcache.training.settings import GROUPS, PART_CONFIGS

NESTED_TOML = """
[run]
allow_changes = true

[data]
vocab = "hash"
max_rows = 5000

[embeddings]
embeddings = "cached"
precision = "int4"
cache_size = 0.2

[model]
embedding_dim = 8
bottom_mlp = [32, 8]

[schedule]
batch_size = 128
lr_schedule = "mlperf"

[process]
threads = 1

[skipping]
skip_rule = "stale"
stale_target = 0.2
"""


def _flat_of(nested: str) -> dict[str, Any]:
    """The same settings as `nested`, as top-level keys."""
    import tomllib

    return {key: value for part in tomllib.loads(nested).values() for key, value in part.items()}


def test_the_parts_are_the_help_groups_and_every_key_is_in_one_part() -> None:
    assert tuple(PARTS) == tuple(GROUPS)
    assert [f.name for f in dataclasses.fields(TrainConfig) if f.name != "given"] == list(PARTS)
    assert sum(len(dataclasses.fields(kind)) for kind in PARTS.values()) == len(CONFIG_FIELDS) == len(PART_OF)


def test_a_config_file_nested_by_part_reads_as_its_flat_keys(tmp_path: Path) -> None:
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text(NESTED_TOML)
    flat.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in _flat_of(NESTED_TOML).items()))
    assert load_config_file(nested) == load_config_file(flat) == _flat_of(NESTED_TOML)
    config = make_config(load_config_file(nested), {"lr": 0.2})
    assert config.embeddings.precision == "int4" and config.model.bottom_mlp == [32, 8]
    assert config.schedule.batch_size == 128 and config.skipping.stale_target == 0.2 and config.embeddings.lr == 0.2
    assert config.staleness_config().target_drop == 0.2


def test_yaml_nests_by_part_and_mixes_with_flat_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("embeddings:\n  precision: fp16\n  policy: lfu\nbatch_size: 64\nembedding_dim: 8\n"
                    "bottom_mlp: [16, 8]\n")
    config = make_config(load_config_file(path), {})
    assert (config.embeddings.precision, config.embeddings.policy, config.schedule.batch_size) == ("fp16", "lfu", 64)


@pytest.mark.parametrize(("text", "says"), [
    ("[model]\nprecision = \"int4\"\n", r"key 'precision' in config file .* belongs to \[embeddings\], not \[model\]"),
    ("lr = 0.1\n[embeddings]\nlr = 0.2\n", "key 'lr' is set twice"),
    ("[embeddings]\nlearning_rate = 0.2\n", "unknown key \\[embeddings\\] 'learning_rate'.*did you mean"),
])
def test_a_nested_key_in_the_wrong_part_or_twice_is_one_line(text: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(SlipcacheError, match=says):
        load_config_file(path)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("out", "", "--out and --resume need a directory name"),  # run
    ("max_rows", 0, "--max-rows must be positive, got 0"),  # data
    ("table_sizes", [0], "--table-sizes must be positive row counts"),
    ("cache_size", 2.0, "--cache-size is the share of rows cached in [0, 1]; got 2.0 (for a number of rows use "
                        "--cache-rows 2)"),  # EmbeddingConfig's range, the hint in the flags' words
    ("precision", ["int4", "int3"], "--precision must be one of .*, got 'int3'"),
    ("lookahead", 0, "--lookahead must be positive, got 0"),
    ("seed", -1, "--seed must be in [0, 2**32), got -1"),  # model
    ("top_mlp", [8, 2], "--top-mlp: the top MLP must end in 1 output"),  # ModelConfig's
    ("dense_lr", 1e39, "--dense-lr must fit a float32"),
    ("batch_size", 2**31 + 1, "--batch-size must be at most 2**31"),  # schedule
    ("keep_checkpoints", 0, "--keep-checkpoints must be at least 1, got 0"),
    ("lr_warmup_steps", -1, "--lr-warmup-steps must be 0 or more, got -1"),
    ("threads", 0, "--threads must be positive, got 0"),  # process
    ("stale_target", 1.5, "--stale-target must be in [0, 1], got 1.5"),  # skipping, StalenessConfig's
    ("stale_window", 0.0, "--stale-window must be in (0, 1], got 0.0"),
    ("stale_keep", 1.5, "--stale-keep must be in [0, 1], got 1.5"),
    ("prune_share", 1.0, "--prune-share must be in (0, 1), got 1.0"),
    ("stale_budget_mb", -1.0, "--stale-budget-mb: memory_budget_bytes must be >= 0, got -1048576"),  # its unit
])
def test_an_out_of_range_value_is_one_error_naming_the_flag(key: str, value: Any, says: str) -> None:
    import re

    for build in (lambda: make_config({key: value}), lambda: TrainConfig.from_flat({key: value}),
                  lambda: PARTS[PART_OF[key]](**{key: value})):
        with pytest.raises(SlipcacheError, match=re.escape(says) if ".*" not in says else says) as raised:
            build()
        assert type(raised.value) is SlipcacheError and "\n" not in str(raised.value)


def test_a_crafted_saved_config_is_checked_by_its_parts() -> None:
    saved = {**TrainConfig().flat(), "stale_alpha": 0.0, "dataset": "elsewhere", "run_id": "x"}
    with pytest.raises(SlipcacheError, match=r"config.json holds an invalid run config: --stale-alpha is a fraction"):
        config_from_saved(saved, "config.json")


@pytest.mark.parametrize(("key", "value"), [("stale_release_cache", True), ("stale_min_accesses", 0.5),
                                            ("stale_refit", False)])
def test_a_saved_run_of_a_removed_variant_is_refused_and_its_off_value_reads(key: str, value: object) -> None:
    flat = TrainConfig().flat()
    with pytest.raises(SlipcacheError, match=rf"config.json: this run used {key} {value}, a setting") as raised:
        config_from_saved({**flat, key: value}, "config.json")
    assert "\n" not in str(raised.value)
    assert config_from_saved({**flat, key: RESEARCH_SETTINGS[key]}, "config.json") == TrainConfig()
    with pytest.raises(SlipcacheError, match=key.replace("_", "[-_]")):  # not a setting of today's trainer
        TrainConfig.from_flat({**flat, key: value})


def test_a_setting_of_a_library_config_has_that_configs_range_and_no_other() -> None:
    """The single source: a setting that sets a library field (`sets=`) carries no range of its own, and
    what the library config rejects, the setting rejects, named as the flag."""
    library = {"embedding": lambda **o: EmbeddingConfig([1], **o), "model": lambda **o: ModelConfig([1], **o),
               "staleness": StalenessConfig}
    bad = {"cache_size": -0.5, "cache_rows": -1, "lr": -1.0, "embedding_dim": 0, "stale_target": 2.0,
           "stale_alpha": 1.5, "stale_window": 2.0, "stale_hot_share": 0.0, "stale_hot_rate": 0.0,
           "stale_threshold_sample": 0.0, "stale_recheck": -1, "stale_min_updates": 0, "stale_count_share": 0.0,
           "bottom_mlp": [8, 3], "top_mlp": [4], "stale_budget_mb": -1.0}
    for key, f in CONFIG_FIELDS.items():
        if f.metadata["sets"] and key != "seed":  # the libraries take any seed; the trainer's shuffling, 32 bits
            assert "within" not in f.metadata, key  # its range is the library's, written there
    for key, value in bad.items():
        target = CONFIG_FIELDS[key].metadata["sets"][0]
        part, field = target.split(".")
        assert part in PART_CONFIGS
        with pytest.raises(SettingError) as rejected:
            library[part](**{field: value})
        assert rejected.value.name == field, key
        with pytest.raises(SlipcacheError, match=f"--{key.replace('_', '-')}|--dim") as named:
            TrainConfig.from_flat({key: value})
        assert str(named.value).split()[0].rstrip(":") in ("--dim", f"--{key.replace('_', '-')}"), key
    assert TrainConfig.from_flat({"stale_budget_mb": 0.0}).staleness_config().memory_budget_bytes == 0  # as the part


def test_a_flag_is_its_parts_field() -> None:
    """The flag's help, choices and default come from the part's field: change the field, the flag changes."""
    from slipcache.cli import build_parser

    def action(dest: str):  # noqa: ANN202 - an argparse Action
        parser = build_parser("train")
        sub = next(a for a in parser._actions if a.dest == "command").choices["train"]
        return next(a for a in sub._actions if a.dest == dest)

    field = next(f for f in dataclasses.fields(ScheduleSettings) if f.name == "epochs")
    assert field is CONFIG_FIELDS["epochs"] and action("epochs").full_help.startswith(field.metadata["help"])
    precision = next(f for f in dataclasses.fields(EmbeddingSettings) if f.name == "precision")
    assert tuple(action("precision").choices) == precision.metadata["choices"]
    stale = next(f for f in dataclasses.fields(StalenessConfig) if f.name == "target_drop")
    assert SkippingSettings().stale_target == stale.default  # the default too: the library's, written there
    assert ModelSettings().bottom_mlp == ModelConfig([1]).bottom_mlp


def test_presets_are_partial_configurations_over_the_same_keys() -> None:
    for name, values in {"quick": QUICK, **STALE_PRESETS}.items():
        assert set(values) <= set(CONFIG_FIELDS), name
        TrainConfig.from_flat(dict(values))  # each one a valid partial configuration
    paper = make_config({}, {"stale_preset": "paper", "quick": True, "batch_size": 512})
    assert paper.skipping.input_order == "cold_first" and paper.schedule.batch_size == 512  # the user wins
    assert paper.data.synthetic_samples == QUICK["synthetic_samples"]  # what the preset leaves: --quick's


def test_the_flat_form_is_what_runs_record_and_read_back() -> None:
    config = make_config({}, {"quick": True, "precision": "fp16", "skip_rule": "random"})
    flat = config.flat()
    assert list(flat) == list(CONFIG_FIELDS) and flat["precision"] == "fp16" and flat["skip_rule"] == "random"
    assert json.loads(json.dumps(flat)) == flat  # config.json
    again = config_from_saved({**flat, "dataset": "d", "run_id": "r"}, "config.json")
    assert again == config and again.given is None
    assert config.replaced(lr=0.1).embeddings.lr == 0.1 and config.embeddings.lr == QUICK["lr"]
    with pytest.raises(SlipcacheError, match="--lr must fit a float32"):
        config.replaced(lr=1e39)
