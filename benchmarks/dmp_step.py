"""A training step under TorchRec's DistributedModelParallel: TorchRec's own fused fp32 tables against ours
(fp32 with every row cached; INT8 behind a 5 % cache), the same DLRM, plan and batches on N gloo processes.

    python -m benchmarks.dmp_step [--rounds 5] [--steps 30] [--tables review|kaggle] [--out docs/bench/dmp_step.json]

Each rank builds the three models once, then times `--steps` steps of each in turn, round after round
(interleaved, so a machine that slows down slows every arm alike). A step is forward, backward and the
optimizers (the tables' SGD fused into backward in both collections; Adam over the dense layers); the
ranks meet at a barrier before and after each timed stretch, and the figure is rank 0's wall time per step.
The batches are drawn once, before any timing: Zipf-skewed ids (exponent 1.05, so a small cache both hits
and misses), dimension 32, a global batch of 2048, over the review's 8 tables of 521 k rows in all (every
arm starts from TorchRec's rows) or over Criteo Kaggle's 26 tables of 33.8 M rows (`--tables kaggle`: the
tables are built on meta and each rank's shards draw their own rows, so that a rank holds only its shards;
the fp32 arm with every row cached is left out, its 8.6 GB beside TorchRec's 4.3 GB being more than the
point needs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from slipcache.data.kaggle import KAGGLE_CARDINALITIES

REVIEW_ROWS = (200_000, 150_000, 100_000, 40_000, 20_000, 8_000, 2_000, 1_000)  # 521 k rows
TABLES = {"review": REVIEW_ROWS, "kaggle": tuple(KAGGLE_CARDINALITIES)}
DIM, DENSE, GLOBAL_BATCH, LR = 32, 13, 2048, 0.05
ARMS = ("torchrec-fp32", "ours-fp32-all-cached", "ours-int8-lru5")
META_ARMS = ("torchrec-fp32", "ours-int8-lru5")  # the arms of tables built on meta
WARMUP_STEPS = 5
BATCHES = 16  # distinct batches, cycled


def _batches(rank: int, world_size: int, table_rows: tuple[int, ...],
             seed: int = 0) -> list[tuple[torch.Tensor, Any, torch.Tensor]]:
    """This rank's slice of BATCHES global batches: (dense, KeyedJaggedTensor, labels)."""
    from slipcache.interop.keyed import sparse_to_kjt

    draw = torch.Generator().manual_seed(seed)
    share = GLOBAL_BATCH // world_size
    mine = slice(rank * share, (rank + 1) * share)
    out = []
    for _ in range(BATCHES):
        columns = []
        for rows in table_rows:
            popularity = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
            columns.append(torch.multinomial(popularity, GLOBAL_BATCH, replacement=True, generator=draw))
        ids = torch.stack(columns, 1)
        dense = torch.rand(GLOBAL_BATCH, DENSE, generator=draw)
        labels = (torch.rand(GLOBAL_BATCH, generator=draw) < 0.25).float()
        out.append((dense[mine], sparse_to_kjt(ids[mine], [f"f{t}" for t in range(len(table_rows))]), labels[mine]))
    return out


def _plan(world_size: int, table_rows: tuple[int, ...]) -> dict[str, Any]:
    """Table-wise, the tables dealt to the ranks largest first onto the emptiest (rows balanced)."""
    from torchrec.distributed.sharding_plan import table_wise

    load = [0] * world_size
    plan = {}
    for t, rows in sorted(enumerate(table_rows), key=lambda item: -item[1]):
        rank = load.index(min(load))
        load[rank] += rows
        plan[f"t{t}"] = table_wise(rank=rank, compute_kernel="fused")
    return plan


def _models(world_size: int, table_rows: tuple[int, ...], meta: bool,
            huge_pages: str = "off") -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection, KeyedCachedEmbeddingBagCollectionSharder
    from slipcache.interop.torchrec_weights import from_torchrec

    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{t}"])
        for t, rows in enumerate(table_rows)
    ]

    def dlrm(tables: torch.nn.Module) -> torch.nn.Module:
        return DLRM(embedding_bag_collection=tables, dense_in_features=DENSE,
                    dense_arch_layer_sizes=[64, DIM], over_arch_layer_sizes=[64, 1])

    theirs_tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta" if meta else "cpu"))
    if meta:
        ours = KeyedCachedEmbeddingBagCollection(configs, device="meta", precision="int8", cache_size=0.05,
                                                 policy="lru", lr=LR, huge_pages=huge_pages)
        tables = {"torchrec-fp32": (theirs_tables, EmbeddingBagCollectionSharder()),
                  "ours-int8-lru5": (ours, KeyedCachedEmbeddingBagCollectionSharder())}
    else:
        tables = {
            "torchrec-fp32": (theirs_tables, EmbeddingBagCollectionSharder()),
            "ours-fp32-all-cached": (from_torchrec(theirs_tables, precision="fp32", cache_size=1.0, lr=LR),
                                     KeyedCachedEmbeddingBagCollectionSharder()),
            "ours-int8-lru5": (from_torchrec(theirs_tables, precision="int8", cache_size=0.05, policy="lru",
                                             lr=LR), KeyedCachedEmbeddingBagCollectionSharder()),
        }
    apply_optimizer_in_backward(torch.optim.SGD, theirs_tables.parameters(), {"lr": LR})
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for arm, (collection, sharder) in tables.items():
        torch.manual_seed(1)  # the same dense layers in every arm
        model = dlrm(collection)
        plan = construct_module_sharding_plan(collection, _plan(world_size, table_rows), sharder=sharder,
                                              device_type="cpu")
        sharded = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder],
                                           plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}))
        dense = dict(in_backward_optimizer_filter(sharded.named_parameters()))
        models[arm] = (sharded, torch.optim.Adam(dense.values(), lr=1e-3))
    return models


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, start: int, count: int) -> None:
    for i in range(start, start + count):
        dense, kjt, labels = batches[i % len(batches)]
        logits = model(dense, kjt).squeeze(1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def _rank(rank: int, world_size: int, port: int, rounds: int, steps: int, tables: str, huge_pages: str,
          out: str, command: str) -> None:
    import torch.distributed as dist

    import slipcache.distributed.launch  # noqa: F401  (before the group: see its import of torch.distributed.nn)

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        table_rows = TABLES[tables]
        batches = _batches(rank, world_size, table_rows)
        models = _models(world_size, table_rows, meta=tables == "kaggle", huge_pages=huge_pages)
        for model, optimizer in models.values():
            _steps(model, optimizer, batches, 0, WARMUP_STEPS)
        done = WARMUP_STEPS
        timings: list[dict[str, Any]] = []
        for round_ in range(rounds):
            for arm, (model, optimizer) in models.items():
                dist.barrier()
                start = time.perf_counter()
                _steps(model, optimizer, batches, done, steps)
                dist.barrier()
                ms = 1e3 * (time.perf_counter() - start) / steps
                timings.append({"round": round_, "arm": arm, "ms_per_step": ms})
                if rank == 0:
                    print(f"round {round_} {arm}: {ms:.1f} ms per step", flush=True)
            done += steps
        peak = _peak_rss_gb()
        peaks: list[Any] = [None] * world_size
        dist.all_gather_object(peaks, peak)
        if rank == 0:
            _write(Path(out), timings, world_size, rounds, steps, command, table_rows, peaks)
    finally:
        dist.destroy_process_group()


def _peak_rss_gb() -> float:
    from slipcache.memory import GB, peak_rss_bytes

    return round(peak_rss_bytes() / GB, 2)


def _write(out: Path, timings: list[dict[str, Any]], world_size: int, rounds: int, steps: int, command: str,
           table_rows: tuple[int, ...] = REVIEW_ROWS, peak_rss_gb: list[float] | None = None) -> None:
    from slipcache.bench.machine import describe_machine

    arms = [arm for arm in ARMS if any(t["arm"] == arm for t in timings)]
    median = {arm: statistics.median(t["ms_per_step"] for t in timings if t["arm"] == arm) for arm in arms}
    per_round = {
        arm: [a["ms_per_step"] / b["ms_per_step"] for a, b in zip(
            (t for t in timings if t["arm"] == arm), (t for t in timings if t["arm"] == "torchrec-fp32"), strict=True)]
        for arm in arms
    }
    result: dict[str, Any] = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": describe_machine(),
        "data": f"Zipf(1.05) ids drawn once: {BATCHES} global batches cycled",
        "setup": {
            "processes": world_size, "backend": "gloo", "threads_per_process": 1, "tables": len(table_rows),
            "rows": sum(table_rows), "dim": DIM, "global_batch": GLOBAL_BATCH, "plan": "table-wise, rows balanced",
            "steps_per_round": steps, "rounds": rounds, "table_optimizer": f"SGD lr {LR} (fused)",
            "dense_optimizer": "Adam",
        },
        "timings": timings,
        "median_ms_per_step": median,
        "ratio_to_torchrec": {arm: statistics.median(r) for arm, r in per_round.items()},
        "ratio_range": {arm: [min(r), max(r)] for arm, r in per_round.items()},
        **({"peak_rss_gb_per_rank": peak_rss_gb} if peak_rss_gb is not None else {}),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for arm in arms:
        print(f"{arm}: median {median[arm]:.1f} ms per step, {result['ratio_to_torchrec'][arm]:.2f}x TorchRec's")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dmp_step", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each arm per round")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tables", choices=tuple(TABLES), default="review",
                        help="review: 8 tables of 521 k rows; kaggle: Criteo Kaggle's 26 tables of 33.8 M rows")
    parser.add_argument("--huge-pages", choices=("off", "auto"), default="off",
                        help="auto: huge pages for both sides' tables (ours by their option, TorchRec's by starting "
                        "the ranks with THP_MEM_ALLOC_ENABLE=1); --tables kaggle only")
    parser.add_argument("--out", default="docs/bench/dmp_step.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.processes < 2 or GLOBAL_BATCH % args.processes:
        parser.error(f"--rounds and --steps must be at least 1, --processes at least 2 and divide {GLOBAL_BATCH}")
    if args.huge_pages != "off" and args.tables != "kaggle":
        parser.error("--huge-pages needs --tables kaggle")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = "python -m benchmarks.dmp_step " + " ".join(argv if argv is not None else sys.argv[1:])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.huge_pages == "auto":  # read by torch's allocator when a process starts: the spawned ranks
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    mp.start_processes(_rank, args=(args.processes, port, args.rounds, args.steps, args.tables, args.huge_pages,
                                    args.out, command.strip()),
                       nprocs=args.processes, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
