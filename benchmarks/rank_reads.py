"""What each rank of N reads per epoch: the whole global batch (then its slice) or only its slice.

    python benchmarks/rank_reads.py --data DIR [--world 2] [--batch-size 256] [--rounds 3] [--mode whole part]

Starts `--world` gloo processes on 127.0.0.1; each iterates one training epoch of `--data` as
`slipcache train` does (`training_batches`, epoch 0, seed 0) and keeps its slice. Modes: `whole` reads every
global batch whole (what every rank did before `part` existed; it runs on older code too, so
`PYTHONPATH=<old checkout>/src` measures the old reader) and `part` reads only the rank's slice plus the
batch's labels. Modes alternate round by round (A B A B ...), the ranks start each together (a barrier).
Per rank and mode it prints the bytes of rows read from the split (labels 4, dense 52, sparse 104 bytes a
row in slipcache's format), the pages first touched (minor + major faults), and the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _epoch(dataset: Any, batch_size: int, mode: str, rank: int, world: int) -> dict[str, float]:
    from slipcache.data.batches import slice_bounds
    from slipcache.training.datasets import training_batches

    part = {"part": (rank, world)} if mode == "part" else {}
    faults = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    bytes_read = kept = 0
    for batch in training_batches(dataset, batch_size, seed=0, epoch=0, **part):
        if mode == "whole":  # the old path: read the global batch, keep the slice
            lo, hi = slice_bounds(len(batch), world, rank)
            dense, sparse = batch.dense[lo:hi], batch.sparse[lo:hi]
            rows_read = len(batch)
        else:
            dense, sparse = batch.dense, batch.sparse
            rows_read = len(dense)
        bytes_read += len(batch) * 4 + rows_read * (dense.shape[1] + sparse.shape[1]) * 4
        kept += len(dense)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    pages = (after.ru_minflt - faults.ru_minflt) + (after.ru_majflt - faults.ru_majflt)
    return {"bytes": bytes_read, "rows_kept": kept, "pages": pages, "seconds": seconds}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    from slipcache.data.formats import open_any

    results = []
    for round_ in range(args.rounds):
        for mode in args.mode:
            dataset = open_any(args.data)  # fresh maps: pages are counted as first touched by this epoch
            dist.barrier()
            result = _epoch(dataset, args.batch_size, mode, rank, world)
            results.append({"round": round_, "mode": mode, "rank": rank, **result})
            del dataset
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", nargs="+", default=["whole", "part"], choices=["whole", "part"])
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    out = f"/tmp/rank-reads-{os.getpid()}"
    mp.start_processes(_rank, args=(args.world, _free_port(), args, out), nprocs=args.world, start_method="spawn")
    rows = []
    for rank in range(args.world):
        with open(f"{out}.{rank}") as f:
            rows += json.load(f)
        os.remove(f"{out}.{rank}")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.world} ranks, batch {args.batch_size}, {args.rounds} rounds")
    print("| mode | rank | MB read | pages touched | rows kept | s, median (min-max) |")
    print("|---|---|---|---|---|---|")
    for mode in args.mode:
        for rank in range(args.world):
            mine = [r for r in rows if r["mode"] == mode and r["rank"] == rank]
            secs = [r["seconds"] for r in mine]
            print(
                f"| {mode} | {rank} | {mine[0]['bytes'] / 1e6:.1f} | {mine[0]['pages']:,} | {mine[0]['rows_kept']:,} | "
                f"{statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f}) |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
