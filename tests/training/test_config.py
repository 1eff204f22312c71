"""Settings are numbers, exactly: config files (TOML, JSON, a FIFO) and flags are read to the integer, a
huge value is one line naming its key, and settings that change nothing are said."""

import os
from pathlib import Path

import pytest

from slipcache.errors import SlipcacheError
from slipcache.training import trainer
from slipcache.training.config import load_config_file, make_config
from tests.helpers import cli_fails_in_one_line

pytestmark = pytest.mark.usefixtures("private_cache_dir")


HUGE = "1" + "0" * 400  # TOML integers have no size limit


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"batch_size = {HUGE}", "--batch-size must fit a 64-bit integer, got 100000000000... (401 digits)"),
        (f"samples = {HUGE}", "--samples must fit a 64-bit integer, got 100000000000... (401 digits)"),
        (f"cache_rows = {HUGE}", "--cache-rows must fit a 64-bit integer, got 100000000000... (401 digits)"),
        (f"table_sizes = [{HUGE}]", "--table-sizes must fit a 64-bit integer, got 100000000000... (401 digits)"),
        (f"lr = {HUGE}", "lr: 100000000000... (401 digits) is beyond the range of a floating-point number"),
        (f"cache_size = [0.5, {HUGE}]", "cache_size: 100000000000... (401 digits) is beyond the range"),
    ],
)
def test_a_huge_integer_in_a_config_file_is_one_line_naming_the_key(
    line: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(line + "\n")
    cli_fails_in_one_line(["train", "--config", str(config), "--out", str(tmp_path / "run")], capsys, expected)
    assert not (tmp_path / "run").exists()


def test_integers_are_converted_exactly(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"samples = {2**63 - 1}\nbatch_size = 1e3\n")
    values = load_config_file(config)
    assert values["samples"] == 2**63 - 1 and isinstance(values["samples"], int)
    assert values["batch_size"] == 1000 and isinstance(values["batch_size"], int)
    assert make_config(values, {}).schedule.samples == 2**63 - 1


def test_a_budget_of_2_63_minus_1_samples_is_exact() -> None:
    assert trainer.budget_steps(2**63 - 1, 256) * 256 == 2**63  # the last batch rounded up, exactly
    assert trainer.budget_steps(2**63 - 1, 1) == 2**63 - 1  # a float gave 9223372036854775808
    config = make_config({}, {"samples": 2**63 - 1, "batch_size": 1, "progress": False})
    resolved = trainer.resolve_schedule(config, 1000)
    assert resolved.schedule.samples == 2**63 - 1
    assert resolved.schedule.checkpoint_every == (2**63 - 1) // 4 + 1  # nearest whole batch of 1, exactly


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1e18", None), ("9223372036854775807", None), ("1.5", "expected an integer, got '1.5'"),
     ("1e400000", "expected an integer, got '1e400000'"), ("1e19", "--samples must fit a 64-bit integer")],
)
def test_samples_flag_in_scientific_notation(value: str, expected: str | None, tmp_path: Path,
                                             capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache.training.flags import add_config_flags

    if expected is None:  # parsed exactly (not trained here: the budget is huge)
        import argparse

        parser = argparse.ArgumentParser()
        add_config_flags(parser)
        assert parser.parse_args(["--samples", value]).samples == (10**18 if value == "1e18" else 2**63 - 1)
        return
    cli_fails_in_one_line(["train", "--samples", value, "--out", str(tmp_path / "run")], capsys, expected)


@pytest.mark.parametrize(("value", "expected"), [(1e100, "--batch-size must fit a 64-bit integer"),
                                                 ("256", "batch_size: expected int, got '256'")])
def test_a_config_file_value_of_the_wrong_type_is_one_line(value: object, expected: str) -> None:
    with pytest.raises(SlipcacheError, match=expected):
        make_config({"batch_size": value})
    batch_size = make_config({"batch_size": 256.0}).schedule.batch_size
    assert batch_size == 256 and isinstance(batch_size, int)


def test_a_fifo_as_config_is_read(tmp_path: Path) -> None:
    import threading

    fifo = tmp_path / "settings.toml"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w") as fh:
            fh.write("batch_size = 128\n")

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        assert load_config_file(fifo) == {"batch_size": 128}
    finally:
        writer.join(timeout=60)


def test_a_json_config_reads_1e_minus_3_as_a_number(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text('{"lr": 1e-3, "batch_size": 64}')
    assert load_config_file(config) == {"lr": 0.001, "batch_size": 64}
    (tmp_path / "c.yaml").write_text("lr: 1e-3\n")  # YAML 1.1 reads this as a string: still refused there
    with pytest.raises(SlipcacheError, match="lr: expected float, got '1e-3'"):
        load_config_file(tmp_path / "c.yaml")


def test_a_config_path_that_is_a_directory_or_device_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="is a directory"):
        load_config_file(tmp_path)
    with pytest.raises(SlipcacheError, match="is a device or socket"):
        load_config_file("/dev/zero")


def test_cache_rows_beyond_the_tables_is_said(tmp_path: Path) -> None:
    from slipcache.training.config import cache_rows_note

    config = make_config({"cache_rows": 10**18}, {"progress": False})
    note = cache_rows_note(config, [1000, 10])
    assert note is not None and "more than the 1,010 rows there are" in note and "more memory than fp32" in note
    assert cache_rows_note(make_config({"cache_rows": 500}, {}), [1000, 10]) is None


def test_settings_that_are_ignored_are_said(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from slipcache.training.config import make_config

    make_config({}, {"policy": "none", "cache_size": 0.5, "prefetch": True, "table_sizes": [10]})
    err = capsys.readouterr().err
    assert "--cache-size/--cache-rows are ignored" in err and "--prefetch reads rows" in err
    assert "synthetic data ignores it" in err
    make_config({}, {"policy": "lru", "cache_size": 0.5})
    assert capsys.readouterr().err == ""



def test_a_library_config_of_another_dim_gets_a_bottom_mlp_that_meets_it() -> None:
    """`--dim` alone sets the bottom MLP's last width; a config built in code follows the same rule, and a
    bottom MLP given on purpose is still checked against the dim."""
    from slipcache.training.config import TrainConfig

    assert TrainConfig.from_flat({"embedding_dim": 32}).model.bottom_mlp[-1] == 32
    with pytest.raises(SlipcacheError, match="must end in the embedding dim 32"):
        TrainConfig.from_flat({"embedding_dim": 32, "bottom_mlp": [64, 16]})
