"""`python -m benchmarks.beyond_ram`: the same tables trained in RAM and from `--storage-path`, interleaved.

Why: storage on disk is only worth having if it trains at a useful share of the in-RAM speed. One run of
each says little on a shared machine, so the two arms alternate (A B, B A, A B, ...) with the same seed,
data and settings, and each round's ratio is reported with the load average around it.

Beyond RAM is emulated: the disk arm runs in a cgroup (v1 `memory.limit_in_bytes`, or v2 `memory.max`)
whose limit also bounds the page cache the run may hold, so only part of the quantized rows stays cached,
as on a machine whose tables are larger than its memory. Every figure comes from each run's summary.json
(`/proc/self/io` for disk bytes, `ru_maxrss` and anonymous peak memory).

    python -m benchmarks.beyond_ram --data DIR --work DIR --memory-limit-gb 2.6 --rounds 3 \
        --json docs/scale/beyond_ram.json
    python -m benchmarks.beyond_ram --data MLPERF --work DIR --memory-limit-gb 14 --rounds 3 --dim 128 \
        --disk-dim 256 --samples 2048 --json docs/scale/startup.json   # start-up: dim 256 on disk, 128 in RAM
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_NAME = "slipcache-beyond-ram"
KEPT = (
    "samples_per_s", "train_samples", "train_wall_s", "train_cpu_s", "startup_s", "startup_disk_read_bytes",
    "train_disk_read_bytes", "train_disk_write_bytes", "peak_rss_bytes", "peak_rss_anon_bytes", "auc",
    "cache_hit_rate", "embedding_bytes", "memory_ratio",
)  # fmt: skip


def make_cgroup(limit_bytes: int) -> Path:
    """A memory cgroup with this limit (page cache included); returns the file a pid is written to."""
    if (CGROUP_V1 / "memory.limit_in_bytes").is_file():
        group = CGROUP_V1 / CGROUP_NAME
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        return group / "cgroup.procs"
    if (CGROUP_V2 / "cgroup.controllers").is_file():
        group = CGROUP_V2 / CGROUP_NAME
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(limit_bytes))
        return group / "cgroup.procs"
    raise SystemExit("beyond_ram: no memory cgroup here (neither v1 nor v2 is mounted under /sys/fs/cgroup)")


def drop_page_cache() -> bool:
    """Start each run from a cold page cache where allowed (root); False where not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def train_command(args: argparse.Namespace, run_dir: Path, storage: Path | None) -> list[str]:
    dim = args.disk_dim if storage and args.disk_dim else args.dim
    command = [
        sys.executable, "-m", "slipcache.cli", "train", "--data", str(args.data), "--dim", str(dim),
        "--precision", args.precision, "--cache-size", str(args.cache_size), "--threads", "1",
        "--samples", str(args.samples), "--eval-every", str(1 << 40), "--checkpoint-every", str(1 << 40),
        "--eval-samples", str(args.eval_samples), "--seed", "0", "--out", str(run_dir),
    ]  # fmt: skip
    return command + (["--storage-path", str(storage)] if storage else [])


def run_arm(args: argparse.Namespace, arm: str, round_: int, procs: Path | None) -> dict[str, Any]:
    run_dir = args.work / f"{arm}-r{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    storage = args.work / "rows" if arm == "disk" else None
    if storage:
        storage.mkdir(parents=True, exist_ok=True)
    cold = drop_page_cache()
    load_before = os.getloadavg()[0]

    def enter_cgroup() -> None:  # runs in the child before exec: its memory and page cache are charged there
        if procs is not None:
            procs.write_text(str(os.getpid()))

    start = time.perf_counter()
    done = subprocess.run(
        train_command(args, run_dir, storage), env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=enter_cgroup if arm == "disk" else None, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"beyond_ram: {arm} round {round_} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    record = {
        "arm": arm,
        "round": round_,
        "command": " ".join(train_command(args, Path("RUN"), Path("ROWS") if storage else None)[2:]),
        "cold_page_cache": cold,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "command_wall_s": round(wall, 1),
        **{key: summary.get(key) for key in KEPT},
    }
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    print(
        f"round {round_} {arm}: {record['samples_per_s']:.0f} samples/s, start-up {record['startup_s']:.0f} s, "
        f"{(record['train_disk_read_bytes'] or 0) / 1e6:.0f} MB read in training, load "
        f"{record['load_before']}-{record['load_after']}",
        flush=True,
    )
    return record


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["arm"]] = run
    ratios = [r["disk"]["samples_per_s"] / r["ram"]["samples_per_s"] for r in by_round.values() if len(r) == 2]
    startup = [r["disk"]["startup_s"] / r["ram"]["startup_s"] for r in by_round.values() if len(r) == 2]

    def median(arm: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["arm"] == arm and r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "rounds": len(ratios),
        "disk_vs_ram_throughput": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        if ratios
        else None,
        "disk_vs_ram_startup": {"median": statistics.median(startup), "min": min(startup), "max": max(startup)}
        if startup
        else None,
        "median": {
            arm: {key: median(arm, key) for key in KEPT if key not in ("embedding_bytes", "memory_ratio")}
            for arm in ("ram", "disk")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.beyond_ram", description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a slipcache dataset (e.g. `slipcache synth "
                        "--table-sizes kaggle`)")
    parser.add_argument("--work", type=Path, required=True, help="run directories and the disk arm's storage")
    parser.add_argument("--json", type=Path, required=True, help="where the results go")
    parser.add_argument("--memory-limit-gb", type=float, default=2.6,
                        help="the disk arm's cgroup limit, page cache included (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default="ram,disk", help="the arms to run, alternating: ram,disk (default), or "
                        "disk alone for tables that do not fit in RAM")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--disk-dim", type=int, help="the disk arm's dim where it differs (tables too large for RAM "
                        "at that dim: their start-up is measured against the in-RAM start-up at --dim)")
    parser.add_argument("--precision", default="int4")
    parser.add_argument("--cache-size", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=51_200, help="training samples per run")
    parser.add_argument("--eval-samples", type=int, default=10_000, help="validation samples per evaluation")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    procs = make_cgroup(int(args.memory_limit_gb * 1e9))
    from slipcache.bench.machine import describe_machine

    result: dict[str, Any] = {
        "command": "python -m benchmarks.beyond_ram " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe_machine(),
        "memory_limit_bytes": int(args.memory_limit_gb * 1e9),
        "runs": [],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    arms = [arm for arm in ("ram", "disk") if arm in args.arms.split(",")]
    for round_ in range(args.rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:
            result["runs"].append(run_arm(args, arm, round_, procs))
            result.update(date=datetime.now(UTC).isoformat(timespec="seconds"), summary=summarize(result["runs"]))
            args.json.write_text(json.dumps(result, indent=2) + "\n")  # each finished run recorded at once
    print(json.dumps(result["summary"]["disk_vs_ram_throughput"] or result["summary"]["median"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
