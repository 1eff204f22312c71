"""`slipcache bench train`: the whole DLRM trainer against the same model built from TorchRec + FBGEMM.

Three runs on the same data, model shape, batch size and sample budget: our trainer with fp32
`nn.EmbeddingBag` tables, our trainer with INT8 tables behind a 5 % LRU cache, and TorchRec's `DLRM` over a
`FusedEmbeddingBagCollection` (FBGEMM table-batched embeddings on the host, SGD fused into backward) trained
by a plain loop over the same batches. Runs are interleaved over rounds (median samples/s with min-max);
test AUC is deterministic per implementation. TorchRec is optional: without it its row says why.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipcache.bench.machine import describe_machine
from slipcache.bench.report import progress
from slipcache.errors import SlipcacheError
from slipcache.options import positive_int, seed_arg

IMPLS = ("torch-fp32", "slipcache-int8-lru5", "torchrec-fbgemm")
_OURS: dict[str, dict[str, Any]] = {
    "torch-fp32": {"embeddings": "torch", "precision": "fp32"},
    "slipcache-int8-lru5": {"embeddings": "cached", "precision": "int8", "cache_size": 0.05, "policy": "lru"},
}


def torchrec_available() -> str | None:
    """None when TorchRec's fused embedding bags import; else the reason they do not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchrec.models.dlrm import DLRM  # noqa: F401
            from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as exc:  # ImportError, or a native library that does not load
        return f"{type(exc).__name__}: {exc}"
    return None


class _TorchRecDLRM(nn.Module):
    """TorchRec's DLRM behind our model's call: (dense [B, 13], sparse ids [B, T]) -> logits [B]."""

    def __init__(self, table_sizes: list[int], config: Any) -> None:
        super().__init__()
        from torchrec import EmbeddingBagConfig
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        tables = [
            EmbeddingBagConfig(name=f"t{t}", embedding_dim=config.model.embedding_dim, num_embeddings=n,
                               feature_names=[f"f{t}"])
            for t, n in enumerate(table_sizes)
        ]  # fmt: skip
        self.keys = [f"f{t}" for t in range(len(table_sizes))]
        self.embeddings = FusedEmbeddingBagCollection(
            tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": config.embeddings.lr}
        )
        self.dlrm = DLRM(
            embedding_bag_collection=self.embeddings,
            dense_in_features=13,
            dense_arch_layer_sizes=list(config.model.bottom_mlp),
            over_arch_layer_sizes=list(config.model.top_mlp),
        )

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        from slipcache.interop.torchrec import sparse_to_kjt

        return self.dlrm(dense, sparse_to_kjt(sparse, self.keys)).squeeze(-1)

    def dense_parameters(self) -> list[nn.Parameter]:
        fused = {id(p) for p in self.embeddings.parameters()}
        return [p for p in self.parameters() if id(p) not in fused]


def _run_torchrec(config: Any, out: Path) -> dict[str, Any]:
    """The plain loop: the trainer's batches (same order), BCE loss, SGD on the MLPs, fused SGD on tables."""
    from slipcache.training import trainer
    from slipcache.training.datasets import training_batches

    dataset = trainer.open_dataset(trainer.prepare_data(config, out / "data-cache"))
    config = trainer.resolve_schedule(config, dataset.splits["train"])
    torch.manual_seed(config.model.seed)
    model = _TorchRecDLRM(dataset.table_sizes, config)
    dense_opt = torch.optim.SGD(model.dense_parameters(), lr=config.mlp_lr())
    samples, wall, epoch = 0, 0.0, 0
    while samples < config.schedule.samples:
        start = time.perf_counter()
        for batch in training_batches(dataset, config.schedule.batch_size, seed=config.model.seed, epoch=epoch):
            loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # the table update runs inside backward (fused)
            dense_opt.step()
            samples += batch.labels.shape[0]
            if samples >= config.schedule.samples:
                break
        wall += time.perf_counter() - start
        epoch += 1
    test = trainer.evaluate(model, dataset.split("test"))
    table_bytes = sum(p.numel() * p.element_size() for p in model.embeddings.parameters())
    return {"auc": test["auc"], "logloss": test["logloss"], "samples_per_s": samples / wall,
            "train_wall_s": wall, "train_samples": samples, "embedding_bytes": table_bytes}  # fmt: skip


def _run_ours(impl: str, base: dict[str, Any], out: Path) -> dict[str, Any]:
    from slipcache.training import trainer
    from slipcache.training.config import make_config

    config = make_config({}, {**base, **_OURS[impl], "out": str(out), "progress": False})
    summary = trainer.train(config)
    keys = ("auc", "logloss", "samples_per_s", "train_wall_s", "train_samples", "embedding_bytes")
    return {k: summary[k] for k in keys}


def run_train_bench(args: argparse.Namespace) -> int:
    from slipcache.training.config import make_config

    impls = [i.strip() for i in (args.impls or ",".join(IMPLS)).split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise SlipcacheError(f"--impls: unknown {', '.join(unknown)} (known: {', '.join(IMPLS)})")
    if args.rounds < 1:
        raise SlipcacheError(f"--rounds must be >= 1, got {args.rounds}")
    base: dict[str, Any] = {"quick": args.quick, "seed": args.seed, "huge_pages": args.huge_pages}
    for key in ("data", "samples", "batch_size"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    if args.dim is not None:  # the trainer's bottom MLP then ends in this dim too (make_config)
        base["embedding_dim"] = args.dim
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = torchrec_available() if "torchrec-fbgemm" in impls else None
    if missing is not None:
        progress(f"torchrec-fbgemm skipped: torchrec not usable ({missing})")
    results: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    for r in range(args.rounds):
        for impl in impls:
            if impl == "torchrec-fbgemm" and missing is not None:
                continue
            progress(f"[round {r + 1}/{args.rounds}] {impl} ...")
            run_dir = out / f"{impl}-round{r}"
            if impl == "torchrec-fbgemm":
                config = make_config({}, {**base, "out": str(run_dir), "progress": False})
                outcome = _run_torchrec(config, out)
            else:
                outcome = _run_ours(impl, base, run_dir)
            outcome["load_avg_1m"] = os.getloadavg()[0]
            results[impl].append(outcome)
            progress(f"    {outcome['samples_per_s']:,.0f} samples/s, test AUC {outcome['auc']:.4f}")
    rows = []
    for impl in impls:
        runs = results[impl]
        if not runs:
            rows.append({"impl": impl, "status": f"skipped: {missing}"})
            continue
        speeds = [x["samples_per_s"] for x in runs]
        rows.append({
            "impl": impl,
            "status": "ok",
            "samples_per_s": float(np.median(speeds)),
            "samples_per_s_min": min(speeds),
            "samples_per_s_max": max(speeds),
            "auc": float(np.median([x["auc"] for x in runs])),
            "auc_rounds": [x["auc"] for x in runs],
            "train_samples": runs[0]["train_samples"],
            "embedding_bytes": runs[0].get("embedding_bytes"),
            "rounds": runs,
        })
    _attach_peer_ratios(rows)
    threads = torch.get_num_threads()
    loads = [x["load_avg_1m"] for runs in results.values() for x in runs]
    warnings_out = []
    if loads and max(loads) > threads + 0.5:
        warnings_out.append(
            f"the machine was busy (load average up to {max(loads):.1f} with {threads} thread(s) of ours): "
            "samples/s are understated and noisy; rerun when idle"
        )
    result = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["slipcache", "bench", "train", *sys.argv[3:]]) if len(sys.argv) > 2 else "",
        "machine": {**describe_machine(), "torch_threads": threads},
        "settings": base,
        "rows": rows,
        "warnings": warnings_out,
    }
    (out / "train_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    table = format_train_table(rows)
    (out / "train_bench.md").write_text(format_train_report(result, table))
    print(table)
    for w in warnings_out:
        print(f"\nwarning: {w}")
    return 0


def format_train_report(result: dict[str, Any], table: str) -> str:
    """train_bench.md: what ran where, then the table; a figure without its command and machine is noise."""
    machine = result["machine"]
    lines = [
        "# slipcache bench train",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- machine: {machine.get('cpu_model')}, {machine.get('usable_cores')} usable cores, torch threads "
        f"{machine.get('torch_threads')}, compiled-loop threads {machine.get('loop_threads', 1)}; "
        f"torch {machine.get('torch')}, fbgemm_gpu {machine.get('fbgemm_gpu')}",
        f"- settings: {json.dumps(result['settings'], sort_keys=True)}",
        "",
        table,
        "",
        *(f"warning: {w}" for w in result["warnings"]),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def _attach_peer_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's samples/s and embedding memory against TorchRec + FBGEMM's (the goal's two ratios)."""
    peer = next((r for r in rows if r["impl"] == "torchrec-fbgemm" and r["status"] == "ok"), None)
    for r in rows:
        r["speed_vs_torchrec"] = r["memory_ratio_vs_torchrec"] = None
        if peer is None or r["status"] != "ok":
            continue
        r["speed_vs_torchrec"] = r["samples_per_s"] / peer["samples_per_s"]
        if r.get("embedding_bytes") and peer.get("embedding_bytes"):
            r["memory_ratio_vs_torchrec"] = peer["embedding_bytes"] / r["embedding_bytes"]


def format_train_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| impl | samples/s (median) | min-max | x TorchRec | test AUC | embedding GB | TorchRec GB / ours | status |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | - | - | - | - | - | - | {r['status']} |")
            continue
        gb = "-" if not r.get("embedding_bytes") else f"{r['embedding_bytes'] / 1e9:.3f}"
        lines.append(
            f"| {r['impl']} | {r['samples_per_s']:,.0f} | {r['samples_per_s_min']:,.0f}-{r['samples_per_s_max']:,.0f} "
            f"| {ratio(r.get('speed_vs_torchrec'))} | {r['auc']:.4f} | {gb} "
            f"| {ratio(r.get('memory_ratio_vs_torchrec'))} | ok |"
        )
    return "\n".join(lines)


def add_train_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for the runs, train_bench.json and .md")
    parser.add_argument("--quick", action="store_true", help="the trainer's --quick data and model (minutes)")
    parser.add_argument("--data", default=None, help="dataset (default: the trainer's synthetic data)")
    parser.add_argument("--samples", type=int, default=None, help="training samples per run")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument(
        "--dim", type=positive_int, default=None,
        help="embedding dim of every implementation (default: the trainer's; 128 makes the tables outweigh the MLPs)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--seed", type=seed_arg, default=0)
