"""`python -m benchmarks.beyond_ram`: the two arms' commands differ only in the storage, and each round's
ratio pairs the runs of that round."""

import argparse
from pathlib import Path

from benchmarks import beyond_ram


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(data=tmp_path / "data", dim=128, disk_dim=None, precision="int4", cache_size=0.01,
                              samples=512, eval_samples=100)


def test_the_arms_differ_only_in_where_the_rows_live(tmp_path: Path) -> None:
    ram = beyond_ram.train_command(_args(tmp_path), tmp_path / "run", None)
    disk = beyond_ram.train_command(_args(tmp_path), tmp_path / "run", tmp_path / "rows")
    assert disk == ram + ["--storage-path", str(tmp_path / "rows")]
    assert ram[ram.index("--seed") + 1] == "0" and ram[ram.index("--threads") + 1] == "1"


def test_a_disk_dim_changes_the_disk_arms_dim_alone(tmp_path: Path) -> None:
    args = _args(tmp_path)
    args.disk_dim = 256
    ram = beyond_ram.train_command(args, tmp_path / "run", None)
    disk = beyond_ram.train_command(args, tmp_path / "run", tmp_path / "rows")
    assert ram[ram.index("--dim") + 1] == "128" and disk[disk.index("--dim") + 1] == "256"
    assert [a for a in disk if a not in ("256", "--storage-path", str(tmp_path / "rows"))] == [
        a for a in ram if a != "128"
    ]


def test_each_round_is_paired_with_itself() -> None:
    def run(arm: str, round_: int, rate: float, startup: float) -> dict:
        return {"arm": arm, "round": round_, "samples_per_s": rate, "startup_s": startup}

    runs = [run("ram", 0, 100.0, 10.0), run("disk", 0, 50.0, 20.0), run("disk", 1, 90.0, 10.0),
            run("ram", 1, 100.0, 10.0), run("ram", 2, 200.0, 10.0)]  # round 2 unfinished: left out
    summary = beyond_ram.summarize(runs)
    assert summary["rounds"] == 2
    assert summary["disk_vs_ram_throughput"] == {"median": 0.7, "min": 0.5, "max": 0.9}
    assert summary["disk_vs_ram_startup"]["max"] == 2.0
    assert summary["median"]["ram"]["samples_per_s"] == 100.0
