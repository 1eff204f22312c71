"""Flags mean one thing: `slipcache train`'s come from TrainConfig's fields; shared flags are one flag."""

from __future__ import annotations

import dataclasses

import pytest

from slipcache.cli import build_parser, main
from slipcache.training.config import CONFIG_FIELDS, TrainConfig, make_config
from slipcache.training.flags import default_text, range_text
from slipcache.training.settings import _interval


def _train_action(dest: str):  # noqa: ANN202 - an argparse Action
    parser = build_parser("train")
    sub = next(a for a in parser._actions if a.dest == "command").choices["train"]
    return next(a for a in sub._actions if a.dest == dest)


def test_every_flag_shows_the_fields_default_and_offers_its_choices() -> None:
    flagged = [f for f in CONFIG_FIELDS.values() if "help" in f.metadata]
    assert len(flagged) > 40
    for f in flagged:
        action = _train_action(f.name)
        text = default_text(f)
        shown = getattr(action, "full_help", action.help)  # `--help` shows the common flags, `--help-all` all
        assert text is None or f"(default {text}" in shown, f.name
        if "within" in f.metadata:
            assert f"range {range_text(f.metadata['within'])})" in shown, f.name
        if "choices" in f.metadata:
            assert tuple(action.choices) == tuple(f.metadata["choices"]), f.name
            if isinstance(f.default, str) and f.name != "precision":
                assert f.default in f.metadata["choices"], f.name


def test_a_changed_default_changes_the_help(monkeypatch: pytest.MonkeyPatch) -> None:
    field = CONFIG_FIELDS["batch_size"]
    monkeypatch.setattr(field, "default", 512)
    assert "(default 512; range > 0)" in _train_action("batch_size").help


def test_the_help_says_a_range_as_the_user_reads_it() -> None:
    assert range_text(_interval("(0, 1]")) == "(0, 1]" and range_text(_interval("[1, inf)")) == ">= 1"
    assert range_text(_interval("(0, 2**31]")) == "> 0"  # a bound of the representation is not the meaning
    assert range_text(_interval("[0, float32]")) == ">= 0"


def test_flags_parse_into_the_config() -> None:
    args = build_parser("train").parse_args(
        ["train", "--dim", "8", "--precision", "int4", "--no-stale-guard", "--stale-keep", "0.1",
         "--table-sizes", "3,4", "--tensorboard", "--threads", "1", "--generator", "v3"]
    )  # fmt: skip
    given = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS}
    assert given == {"embedding_dim": 8, "precision": "int4", "stale_guard": False, "stale_keep": 0.1,
                     "table_sizes": [3, 4], "tensorboard": "", "threads": 1, "synthetic_generator": "v3"}  # fmt: skip
    with pytest.raises(SystemExit):
        build_parser("train").parse_args(["train", "--policy", "fifo"])


def test_threads_is_one_flag_on_every_command_that_computes() -> None:
    required = {"train": [], "eval": ["--checkpoint", "r"], "export": ["--checkpoint", "r", "--out", "o"],
                "plan": ["--budget-gb", "1"], "bench": ["cache", "--out", "o"]}  # fmt: skip
    for command, argv in required.items():
        assert build_parser(command).parse_args([command, *argv, "--threads", "2"]).threads == 2, command
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([command, *argv, "--threads", "0"])


def test_eval_samples_is_the_trains_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser("eval")
    assert parser.parse_args(["eval", "--checkpoint", "r", "--eval-samples", "5"]).samples == 5
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", "r", "--samples", "7"])  # `--samples` is what train trains, not eval's
    assert "did you mean --eval-samples?" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", "nowhere", "--eval-samples", "5"]) == 2  # one line, not a traceback


def test_every_setting_says_its_group_and_what_a_resume_may_do() -> None:
    from slipcache.training.config import PART_OF
    from slipcache.training.settings import GROUPS, RESUME

    for name, f in CONFIG_FIELDS.items():
        assert f.metadata.get("resume") in RESUME and PART_OF[name] in GROUPS, name


def test_the_parts_configs_are_built_from_the_settings() -> None:
    from slipcache.training.settings import PART_CONFIGS

    config = TrainConfig.from_flat({"stale_budget_mb": 64.0, "stale_target": 0.2, "embedding_dim": 8,
                                    "bottom_mlp": [32, 8], "seed": 7, "precision": "fp16"})  # fmt: skip
    staleness = config.staleness_config(rule="random")
    assert staleness.memory_budget_bytes == 64 * 2**20 and staleness.target_drop == 0.2 and staleness.seed == 7
    assert staleness.rule == "random"
    assert config.embedding_options()["dim"] == 8 and config.embedding_options()["precision"] == "fp16"
    assert config.model_config([5], 13).bottom_mlp == [32, 8]
    # a setting that takes its part's default has that default, in the setting's unit
    defaults = TrainConfig()
    for part, kind in PART_CONFIGS.items():
        own = {f.name: f for f in dataclasses.fields(kind)}
        for key, value in defaults.library_options(part).items():
            f = own[key]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if key not in ("lr",):  # the trainer's own learning rate, on purpose
                assert value == default, (part, key)


@pytest.mark.parametrize("old", ["--skip-stale", "--stale-control"])
def test_the_old_skipping_spellings_are_gone(old: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--skip-rule stale` turns skipping on and `--stale-keep` sets p: one spelling each."""
    argv = ["train", old] if old == "--skip-stale" else ["train", old, "0.1"]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and f"unrecognized arguments: {old}" in capsys.readouterr().err
    assert make_config({}, {"skip_rule": "stale"}).skipping.skip_rule == "stale"


def test_threads_are_applied_once_by_whoever_owns_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """`train` applies the run's own threads (a resumed run's, unless given); other commands get the CLI's."""
    import contextlib

    from slipcache import cli, train_command
    from slipcache.training import cli as training_cli

    applied: list[int | None] = []
    monkeypatch.setattr(cli, "torch_threads", lambda n: applied.append(n) or contextlib.nullcontext())
    monkeypatch.setattr(train_command, "run_train", lambda args: 0)
    assert main(["train", "--threads", "2", "--quick"]) == 0
    monkeypatch.setattr(training_cli, "run_eval", lambda args: 0)
    assert main(["eval", "--checkpoint", "run", "--threads", "2"]) == 0
    assert applied == [None, 2]
