"""Bad input that used to end in a traceback: one line (exit code 2) naming what is wrong."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from slipcache.cli import main
from tests.data.test_formats import write_dlrm, write_torchrec
from tests.helpers import make_dataset


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))


def one_line(argv: list[str], capsys: pytest.CaptureFixture, expected: str) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's usage errors exit; ours return
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert expected in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "--seed", "-1", "--budget-gb", "1"], "a seed must be in [0, 2**32), got -1"),
        (["stats", "data", "--seed", "-1"], "a seed must be in [0, 2**32), got -1"),
        (["synth", "--out", "x", "--seed", "-1"], "a seed must be in [0, 2**32), got -1"),
        (["synth", "--out", "x", "--scale", "1e6"], "argument --scale: must be in (0, 8], got 1e6"),
        (["stats", "data", "--plot", "x.txt"], "argument --plot: expected a .png"),
        (["bench", "cache", "--out", "x", "--ways", "0"], "argument --ways: must be at least 1, got 0"),
        (["bench", "cache", "--out", "x", "--zipf", "nan"], "argument --zipf: must be in (0, 100], got nan"),
        (["train", "--lr", "1e308"], "lr must fit a float32"),
    ],
)
def test_flags_out_of_range(argv: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    one_line(argv, capsys, expected)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE must be a non-negative integer, got 'abc'"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
          "SLIPCACHE_DIST_BACKEND": "nccl"}, "SLIPCACHE_DIST_BACKEND=nccl needs a CUDA GPU"),
    ],
)
def test_launch_variables(env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    if "nccl" in env.values() and torch.cuda.is_available():
        pytest.skip("a GPU is present: nccl is valid here")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    one_line(["train", "--quick", "--out", str(tmp_path / "run")], capsys, expected)
    assert not (tmp_path / "run").exists()


def _train(data: Path, tmp_path: Path, *flags: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--no-progress", "--embeddings", "torch",
            "--samples", "256", "--batch-size", "64", "--eval-samples", "64", *flags]


def test_damaged_compressed_npz(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_dlrm(tmp_path / "d", compressed=True)
    f = tmp_path / "d" / "kaggleAdDisplayChallenge_processed.npz"
    data = bytearray(f.read_bytes())
    data[2000:2100] = bytes(b ^ 0xFF for b in data[2000:2100])
    f.write_bytes(bytes(data))
    for argv in (_train(tmp_path / "d", tmp_path), ["stats", str(tmp_path / "d")]):
        one_line(argv, capsys, "damaged compressed .npz")


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        (lambda a: a.astype(np.float32) + 0.5, "ids must be integers, found 19.5"),
        (lambda a: np.where(a == a.max(), 2**31 + 5, a).astype(np.int64), "id 2147483653 is beyond 2147483647"),
    ],
    ids=["fractional", "beyond int32"],
)
def test_torchrec_ids_that_cannot_size_a_table(tmp_path: Path, capsys: pytest.CaptureFixture, ids, expected) -> None:  # noqa: ANN001
    write_torchrec(tmp_path / "t", days=2, n=200)
    for day in range(2):
        path = tmp_path / "t" / f"day_{day}_sparse.npy"
        np.save(path, ids(np.load(path)))
    one_line(_train(tmp_path / "t", tmp_path), capsys, expected)


@pytest.mark.slow
def test_unsigned_and_integral_float_ids_train(tmp_path: Path) -> None:
    for kind, dtype in (("u", np.uint64), ("f", np.float64)):
        write_torchrec(tmp_path / kind, days=2, n=200)
        for day in range(2):
            path = tmp_path / kind / f"day_{day}_sparse.npy"
            np.save(path, np.load(path).astype(dtype))
        assert main(_train(tmp_path / kind, tmp_path / kind)) == 0
        assert main(_train(tmp_path / kind, tmp_path / f"{kind}-hashed", "--table-sizes", "7")) == 0


def test_symlink_loop_and_pipe_as_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "b", tmp_path / "a")
    one_line(_train(tmp_path / "a", tmp_path), capsys, "symlink loop")
    os.mkfifo(tmp_path / "fifo")
    one_line(_train(tmp_path / "fifo", tmp_path), capsys, "is a pipe")


@pytest.mark.slow
def test_subdirectories_of_raw_data_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = tmp_path / "raw"
    (raw / "day_2").mkdir(parents=True)
    line = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a0b0c0d"] * 26) + "\n"
    (raw / "day_0.tsv").write_text(line * 700)
    main(_train(raw, tmp_path))
    assert "subdirectories are not read (day_2)" in capsys.readouterr().err


def test_hash_rows_beyond_int32_and_an_empty_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = tmp_path / "raw.tsv"
    raw.write_text(("1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a0b0c0d"] * 26) + "\n") * 10)
    one_line(["preprocess", str(raw), "--out", str(tmp_path / "o"), "--vocab", "hash", "--max-rows", "3000000000"],
             capsys, "--max-rows must be in [2, 2**31], got 3000000000")
    one_line(["train", "--out", ""], capsys, "need a directory name, got an empty one")
    assert not (tmp_path / "runs").exists()


def test_failed_preprocessing_leaves_no_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = tmp_path / "raw.tsv"
    raw.write_text("1\tnot a line\n")
    one_line(["preprocess", str(raw), "--out", str(tmp_path / "o"), "--strict"], capsys, "raw.tsv:1")
    assert not (tmp_path / "o").exists()


def test_bom_and_unknown_formats_are_named_without_echoing_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + header.encode() + b"\n")
    one_line(["train", "--data", str(tmp_path / "bom.csv"), "--out", str(tmp_path / "r")], capsys, "byte-order mark")
    (tmp_path / "secret.txt").write_text("password=hunter2\n")
    train = ["train", "--data", str(tmp_path / "secret.txt"), "--out", str(tmp_path / "r")]
    one_line(train, capsys, "unrecognized format")
    assert "hunter2" not in capsys.readouterr().err


def test_settings_that_are_ignored_are_said(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from slipcache.training.config import make_config

    make_config({}, {"policy": "none", "cache_size": 0.5, "prefetch": True, "table_sizes": [10]})
    err = capsys.readouterr().err
    assert "--cache-size/--cache-rows are ignored" in err and "--prefetch reads rows" in err
    assert "synthetic data ignores it" in err
    make_config({}, {"policy": "lru", "cache_size": 0.5})
    assert capsys.readouterr().err == ""


def test_nan_dense_values_in_the_test_split_stop_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    data = make_dataset(tmp_path / "d", n=640)
    assert main(_train(data, tmp_path)) == 0
    dense = np.load(data / "test.dense.npy")
    dense[3, 0] = np.nan
    np.save(data / "test.dense.npy", dense)
    one_line(["eval", "--checkpoint", str(tmp_path / "run"), "--allow-changes"], capsys,
             "1 of 160 predictions are not finite")


def test_eval_of_a_damaged_checkpoint_names_the_older_one_for_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "d", n=640)
    assert main(_train(data, tmp_path, "--checkpoint-every", "128")) == 0
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    raw = bytearray(latest.read_bytes())
    latest.unlink()
    raw[-10] ^= 0xFF
    latest.write_bytes(bytes(raw))
    one_line(["eval", "--checkpoint", str(tmp_path / "run")], capsys, "to use the newest: --checkpoint ")


def test_plan_toml_parses_with_a_newline_in_the_data_path(tmp_path: Path) -> None:
    import tomllib

    data = make_dataset(tmp_path / "odd\nname", n=400)
    out = tmp_path / "plan.toml"
    assert main(["plan", "--data", str(data), "--budget-gb", "0.001", "--out", str(out), "--no-progress"]) == 0
    parsed = tomllib.loads(out.read_text())
    assert parsed.get("train", parsed)["data"] == str(data)


@pytest.mark.parametrize(
    ("craft", "expected"),
    [
        (lambda rows: rows.__setitem__(0, 10**8), "cache state holds row 100000000 outside [0, 192)"),
        (lambda rows: rows.__setitem__(slice(0, 2), int(rows.max())), "cache state holds a row in two slots"),
    ],
    ids=["row out of range", "row twice"],
)
def test_crafted_cache_state_with_a_valid_checksum(
    tmp_path: Path, capsys: pytest.CaptureFixture, craft, expected
) -> None:  # noqa: ANN001
    from slipcache.training import checkpoint

    data = make_dataset(tmp_path / "d", n=640)
    assert main(_train(data, tmp_path, "--embeddings", "cached", "--cache-size", "1")) == 0
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    state = checkpoint.load_checkpoint(latest)
    craft(state["embeddings"]["cache.slot_rows"])
    latest.unlink()
    checkpoint.save_checkpoint(latest, state)  # a valid checksum over inconsistent content
    one_line(["eval", "--checkpoint", str(latest)], capsys, expected)


@pytest.mark.slow
def test_plan_out_replaces_only_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = make_dataset(tmp_path / "d", n=400)
    notes = tmp_path / "notes.toml"
    notes.write_text("mine = 1\n")
    argv = ["plan", "--data", str(data), "--budget-gb", "0.001", "--no-progress", "--out"]
    one_line([*argv, str(notes)], capsys, "exists and is not a plan written by slipcache plan")
    assert notes.read_text() == "mine = 1\n"
    assert main([*argv, str(tmp_path / "plan.toml")]) == 0
    assert main([*argv, str(tmp_path / "plan.toml")]) == 0  # its own plan: replaced
