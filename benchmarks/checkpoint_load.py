"""`python -m benchmarks.checkpoint_load`: a checkpoint's tables read into rows on disk, through the map or
with pwrite, alternating.

Why: resuming a run whose rows live on disk (`--storage-path`) reads the checkpoint's codes into fresh
storage files. Through the map every page first written is a fault of its own; `materialize` writes them
with pwrite instead. Each arm runs in its own process, in the memory cgroup of `benchmarks.beyond_ram` (so
the page cache is bounded as beyond RAM), from a dropped page cache, one thread:

    python -m benchmarks.checkpoint_load --run RUN --rows DIR --rounds 2 --json docs/scale/resume_load.json

RUN is a run directory of the MLPerf tables (or any) trained with `--storage-path`, its dim and precision
given again here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.beyond_ram import drop_page_cache, make_cgroup

ARMS = ("map", "pwrite")


def load_once(run: Path, rows: Path, arm: str, dim: int, precision: str, cache_size: float, tables: str) -> dict:
    """Build the collection with its rows in `rows` (none drawn) and read the checkpoint's tables into it."""
    import torch

    from slipcache.data.presets import parse_table_sizes
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
    from slipcache.training import checkpoint as ckpt

    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF)
    config = EmbeddingConfig(parse_table_sizes(tables), dim=dim, precision=precision, cache_size=cache_size,
                             storage_path=str(rows))
    collection = CachedEmbeddingBagCollection(config, draw_rows=False)
    start = time.perf_counter()
    state = ckpt.load_checkpoint(run / "checkpoints" / ckpt.LATEST, lazy=True)
    files = collection.storage_files() if arm == "pwrite" else []
    ckpt.materialize(state, {"embeddings": collection.state_dict()}, files)
    collection.load_state_dict(state["embeddings"])
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "arm": arm, "load_s": round(time.perf_counter() - start, 1),
        "user_s": round(after.ru_utime - before.ru_utime, 1), "system_s": round(after.ru_stime - before.ru_stime, 1),
        "major_faults": after.ru_majflt - before.ru_majflt,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_load", description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a run directory with a checkpoint")
    parser.add_argument("--rows", type=Path, required=True, help="where the fresh storage files go")
    parser.add_argument("--json", type=Path, help="where the results go")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--memory-limit-gb", type=float, default=14.0, help="the cgroup limit, page cache included")
    parser.add_argument("--tables", default="mlperf", help="the run's table sizes (a preset or a list)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--precision", default="int4")
    parser.add_argument("--cache-size", type=float, default=0.01)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one load, in this process
    args = parser.parse_args(argv)
    if args.arm:
        print(json.dumps(load_once(args.run, args.rows, args.arm, args.dim, args.precision, args.cache_size,
                                   args.tables)))
        return 0
    procs = make_cgroup(int(args.memory_limit_gb * 1e9))
    from slipcache.bench.machine import describe_machine

    result: dict[str, Any] = {
        "command": "python -m benchmarks.checkpoint_load " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe_machine(), "memory_limit_bytes": int(args.memory_limit_gb * 1e9), "runs": [],
    }  # fmt: skip
    for round_ in range(args.rounds):
        for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:
            shutil.rmtree(args.rows, ignore_errors=True)
            args.rows.mkdir(parents=True)
            drop_page_cache()
            load_before = os.getloadavg()[0]
            child = [sys.executable, "-m", "benchmarks.checkpoint_load", *(argv if argv is not None else sys.argv[1:]),
                     "--arm", arm]
            done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  preexec_fn=lambda: procs.write_text(str(os.getpid())))
            if done.returncode != 0:
                raise SystemExit(f"checkpoint_load: {arm} failed: {done.stderr.strip()[-400:]}")
            record = {**json.loads(done.stdout.strip().splitlines()[-1]), "round": round_,
                      "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
            result["runs"].append(record)
            print(json.dumps(record), flush=True)
            result["date"] = datetime.now(UTC).isoformat(timespec="minutes")
            if args.json:
                args.json.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(args.rows, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
