"""`slipcache bench cache`: hit rate against cache size for LRU, LFU, lookahead and the offline optimum.

Hit rates are counted by the embedding collection itself (the real set-associative cache, fp32 rows of
dim 1 so that only the bookkeeping costs time), one training step per batch of the trace, after a warm-up
that fills the cache. OPT is Belady's rule with the whole trace known (`lookahead.belady_hits`), fully
associative, with the same constraints as the cache. Everything here is deterministic: no timing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipcache.bench.report import progress
from slipcache.bench.workload import make_workload
from slipcache.data.kaggle import kaggle_table_sizes
from slipcache.embedding.cache import LOOKAHEAD_POLICIES
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.lookahead import belady_hits
from slipcache.errors import SlipcacheError
from slipcache.options import float_in, positive_int, seed_arg

DEFAULT_SIZES = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20)
DEFAULT_POLICIES = (
    "lru", "lfu", "lookahead:1", "lookahead:4", "lookahead:16", "lookahead-lfu:1", "lookahead-lfu:4",
    "lookahead-lfu:16", "opt",
)  # fmt: skip
GAP_SIZES = (0.005, 0.01)  # the target: lookahead closes >= half the LRU -> OPT miss gap at these sizes


@dataclass
class Trace:
    """Id batches [N, B, T] in training order, the first `warmup` of which only fill the cache."""

    batches: torch.Tensor
    table_sizes: list[int]
    warmup: int
    source: str

    @property
    def rows(self) -> torch.Tensor:
        """Global rows [N, B * T] (table offset + id), as the cache sees them."""
        offsets = torch.tensor([0, *np.cumsum(self.table_sizes)[:-1].tolist()], dtype=torch.int64)
        return (self.batches + offsets).reshape(self.batches.shape[0], -1)


def zipf_trace(scale: float, batch_size: int, batches: int, warmup: int, exponent: float, seed: int) -> Trace:
    sizes = kaggle_table_sizes(scale)
    work = make_workload(sizes, batch_size, warmup_steps=0, timed_steps=batches, exponent=exponent, seed=seed)
    source = (
        f"Zipf({exponent}) ids, independent per table and sample, over the Kaggle tables x{scale:g} "
        f"({sum(sizes):,} rows), batch {batch_size} (the `bench embedding` workload)"
    )
    return Trace(work.batches, sizes, warmup, source)


def dataset_trace(path: str, batch_size: int, batches: int, warmup: int, seed: int) -> Trace:
    """The first `batches` training batches of a binary dataset, in the trainer's (shuffled) order."""
    from slipcache.training.datasets import open_dataset, training_batches

    dataset = open_dataset(Path(path))
    iterator = training_batches(dataset, batch_size, seed=seed, epoch=0)
    taken = [batch.sparse for _, batch in zip(range(batches), iterator, strict=False)]
    if len(taken) < batches:
        raise SlipcacheError(f"{path}: only {len(taken)} training batches of {batch_size}, asked for {batches}")
    meta = getattr(dataset, "meta", {}) or {}
    source = (
        f"dataset {path} (vocabulary {meta.get('vocabulary', '?')}, generator "
        f"{(meta.get('generator') or {}).get('version', '-')}), {sum(dataset.table_sizes):,} rows, "
        f"train split in the training order (seed {seed}, training_batches), batch {batch_size}"
    )
    return Trace(torch.stack(taken), list(dataset.table_sizes), warmup, source)


def parse_policy(name: str) -> tuple[str, int]:
    """'lru' -> ('lru', 0), 'lookahead:4' -> ('lookahead', 4), 'opt' -> ('opt', 0)."""
    policy, _, k = name.partition(":")
    lookahead = policy in LOOKAHEAD_POLICIES
    if policy not in ("lru", "lfu", *LOOKAHEAD_POLICIES, "opt") or lookahead != bool(k):
        raise SlipcacheError(f"unknown policy {name!r}: use lru, lfu, lookahead:K, lookahead-lfu:K or opt")
    try:
        window = int(k) if k else 0
    except ValueError:
        raise SlipcacheError(f"lookahead window must be an integer, got {name!r}") from None
    if lookahead and window < 1:
        raise SlipcacheError(f"lookahead window must be at least 1, got {name!r}")
    return policy, window


def hit_rate(trace: Trace, policy: str, window: int, capacity: int, ways: int = 16) -> dict[str, Any]:
    """Hit rates over the batches after the warm-up, as the collection counts them (Belady's for opt).

    `hit_rate` is per lookup (what `stats()` reports); `row_hit_rate` counts each distinct row of a batch
    once: 1 - rows fetched from storage / rows needed, the count Belady's rule minimizes.
    """
    rows = trace.rows
    measured = rows[trace.warmup :]
    distinct = sum(int(torch.unique(batch).numel()) for batch in measured)
    if policy == "opt":
        lookup_hits, row_hits = belady_hits(rows, capacity, sum(trace.table_sizes))
        hits, fetched = int(lookup_hits[trace.warmup :].sum()), distinct - int(row_hits[trace.warmup :].sum())
        return {
            "hits": hits,
            "lookups": measured.numel(),
            "hit_rate": hits / measured.numel(),
            "rows_fetched": fetched,
            "row_hit_rate": 1 - fetched / distinct,
            "evictions": None,
            "overflow_rows": None,
        }
    coll = CachedEmbeddingBagCollection(
        EmbeddingConfig(trace.table_sizes, dim=1, precision="fp32", cache_rows=capacity, policy=policy, ways=ways)
    )
    batches = list(trace.batches)
    grad = torch.ones(trace.batches.shape[1], len(trace.table_sizes), 1)
    for i, ids in enumerate(batches):
        if i == trace.warmup:
            coll.reset_stats()
        if window:
            coll.set_lookahead(batches[i + 1 : i + 1 + window])
        coll(ids).backward(grad)
    stats = coll.stats()
    return {
        "hits": stats["hits"],
        "lookups": stats["lookups"],
        "hit_rate": stats["hit_rate"],
        "rows_fetched": stats["rows_in"],  # each missing row once per step, admitted or served from storage
        "row_hit_rate": 1 - stats["rows_in"] / distinct,
        "evictions": stats["evictions"],
        "overflow_rows": stats["overflow_rows"],
    }


def gap_closed(rates: dict[str, float | None], policy: str) -> float | None:
    """Share of the LRU -> OPT miss gap that `policy` closes (1 = as good as OPT)."""
    lru, opt, other = rates.get("lru"), rates.get("opt"), rates.get(policy)
    if lru is None or opt is None or other is None or opt <= lru:
        return None
    return (other - lru) / (opt - lru)


def run_cache_bench(args: argparse.Namespace) -> int:
    sizes = [float(s) for s in (args.sizes or DEFAULT_SIZES)]
    if any(not 0 < s < 1 for s in sizes):
        raise SlipcacheError(f"--sizes are fractions of all rows in (0, 1), got {sizes}")
    policies = [p.strip() for p in (args.policies or ",".join(DEFAULT_POLICIES)).split(",") if p.strip()]
    parsed = {p: parse_policy(p) for p in policies}
    if args.batches <= args.warmup or args.warmup < 0 or args.batch_size < 1:
        raise SlipcacheError("need --batches > --warmup >= 0 and --batch-size >= 1")
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    if args.data:
        trace = dataset_trace(args.data, args.batch_size, args.batches, args.warmup, args.seed)
    else:
        trace = zipf_trace(args.scale, args.batch_size, args.batches, args.warmup, args.zipf, args.seed)
    num_rows = sum(trace.table_sizes)
    rows = trace.rows
    distinct = int(torch.unique(rows).numel())
    progress(f"trace: {trace.source}; {rows.shape[0]} batches, {distinct:,} distinct rows")

    results: list[dict[str, Any]] = []
    for size in sizes:
        capacity = max(1, round(size * num_rows))
        row_rates: dict[str, float | None] = {}
        lookup_rates: dict[str, float | None] = {}
        for name in policies:
            policy, window = parsed[name]
            t0 = time.perf_counter()
            r = hit_rate(trace, policy, window, capacity, args.ways)
            row_rates[name], lookup_rates[name] = r["row_hit_rate"], r["hit_rate"]
            results.append({"cache_size": size, "cache_rows": capacity, "policy": name, **r})
            progress(
                f"  {size:6.1%} {name:13s} row hit rate {r['row_hit_rate']:.4f}, per lookup {r['hit_rate']:.4f} "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        for entry in results:
            if entry["cache_size"] == size:
                entry["gap_closed"] = gap_closed(row_rates, entry["policy"])
                entry["lookup_gap_closed"] = gap_closed(lookup_rates, entry["policy"])
    targets = _targets(results, policies)
    result = {
        "command": _command(args),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "trace": {
            "source": trace.source,
            "batches": rows.shape[0],
            "warmup_batches": trace.warmup,
            "batch_size": int(trace.batches.shape[1]),
            "tables": len(trace.table_sizes),
            "rows": num_rows,
            "distinct_rows": distinct,
            "lookups_measured": int(rows[trace.warmup :].numel()),
        },
        "ways": args.ways,
        "results": results,
        "targets": targets,
        "seconds": time.perf_counter() - start,
    }
    with open(os.path.join(args.out, "cache.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(args.out, "cache.md"), "w", encoding="utf-8") as fh:
        fh.write(_markdown(result, policies))
    _plot(results, policies, os.path.join(args.out, "cache.png"), trace.source)
    print("row hit rate (each distinct row of a batch once; in brackets the share of the LRU -> OPT gap closed)")
    print(format_cache_table(results, policies))
    print("\nhit rate per lookup")
    print(format_cache_table(results, policies, per_lookup=True))
    for t in targets:
        print(f"{t['result']:4s}  {t['target']}: {'-' if t['value'] is None else format(t['value'], '.2f')}")
    print(f"\nwrote {os.path.join(args.out, 'cache.json')}, cache.md and cache.png")
    return 0


def _targets(results: list[dict[str, Any]], policies: list[str]) -> list[dict[str, Any]]:
    out = []
    for size in GAP_SIZES:
        closed = [
            e["gap_closed"]
            for e in results
            if e["cache_size"] == size and e["policy"].startswith("lookahead") and e.get("gap_closed") is not None
        ]
        best = max(closed) if closed else None
        result = "N/A" if best is None else ("PASS" if best >= 0.5 else "MISS")
        out.append({
            "target": f"lookahead closes >= 50% of the LRU -> OPT row miss gap at {size:.1%}",
            "value": best,
            "result": result,
        })
    return out


def format_cache_table(
    results: list[dict[str, Any]], policies: list[str], markdown: bool = False, per_lookup: bool = False
) -> str:
    """Row hit rate (or per lookup) by cache size and policy; lookahead cells add the share of the LRU -> OPT
    gap they close."""
    rate_key, gap_key = ("hit_rate", "lookup_gap_closed") if per_lookup else ("row_hit_rate", "gap_closed")
    sizes = sorted({e["cache_size"] for e in results})
    by = {(e["cache_size"], e["policy"]): e for e in results}
    header = ["cache", *policies]
    lines = []
    for size in sizes:
        cells = [f"{size:.1%}"]
        for p in policies:
            e = by.get((size, p))
            if e is None:
                cells.append("-")
                continue
            cell = f"{e[rate_key]:.4f}"
            if p.startswith("lookahead") and e.get(gap_key) is not None:
                cell += f" ({e[gap_key]:.0%})"
            cells.append(cell)
        lines.append(cells)
    if markdown:
        return "\n".join(
            ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(c) + " |" for c in lines]
        )
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) for cells in [header, *lines])


def _markdown(result: dict[str, Any], policies: list[str]) -> str:
    t = result["trace"]
    return "\n".join([
        "# slipcache bench cache",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- trace: {t['source']}; {t['batches']} batches ({t['warmup_batches']} warm-up, not counted), "
        f"{t['distinct_rows']:,} distinct rows, {t['lookups_measured']:,} lookups counted",
        f"- cache: {result['ways']}-way set associative (LRU, LFU, lookahead); OPT: Belady with the whole trace "
        "known, fully associative, rows of the batch in flight kept",
        "",
        "Row hit rate (each distinct row of a batch counted once: 1 - rows fetched / rows needed, what Belady's "
        "rule minimizes); in brackets, the share of the LRU -> OPT miss gap the lookahead policy closes:",
        "",
        format_cache_table(result["results"], policies, markdown=True),
        "",
        "Hit rate per lookup (what `stats()` reports; OPT does not weigh rows by their lookups, so it is not an "
        "upper bound here):",
        "",
        format_cache_table(result["results"], policies, markdown=True, per_lookup=True),
        "",
        *[f"- {x['result']}: {x['target']}: {'-' if x['value'] is None else format(x['value'], '.2f')}"
          for x in result["targets"]],
        "",
    ])


def _plot(results: list[dict[str, Any]], policies: list[str], path: str, title: str) -> None:
    from slipcache.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        pts = sorted((e["cache_size"], e["row_hit_rate"]) for e in results if e["policy"] == p)
        style = "k--" if p == "opt" else "-o"
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], style, label=p, markersize=4)
    ax.set_xscale("log")
    ax.set_xlabel("cache size (% of rows)")
    ax.set_ylabel("row hit rate (1 - rows fetched / rows needed)")
    ax.set_title(title[:90] + ("..." if len(title) > 90 else ""), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for cache.json, cache.md and cache.png")
    parser.add_argument("--data", default=None, help="a binary dataset directory (default: a Zipf trace)")
    parser.add_argument("--sizes", nargs="+", default=None, help="cache sizes as fractions of all rows")
    parser.add_argument("--policies", default=None, help=f"comma-separated (default {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--batches", type=int, default=2000, help="batches in the trace, warm-up included")
    parser.add_argument("--warmup", type=int, default=500, help="batches that fill the cache before counting")
    parser.add_argument("--batch-size", type=int, default=256, help="default: the trainer's")
    parser.add_argument(
        "--scale", type=float, default=0.05, help="Zipf trace: Kaggle table sizes times this (default: the trainer's)"
    )
    parser.add_argument("--zipf", type=float_in(0, 100), default=1.05, help="Zipf trace: the power-law exponent")
    parser.add_argument("--ways", type=positive_int, default=16, help="cache associativity")
    parser.add_argument("--seed", type=seed_arg, default=0)


def _command(args: argparse.Namespace) -> str:
    parts = ["slipcache", "bench", "cache"]
    if args.data:
        parts += ["--data", args.data]
    else:
        parts += ["--scale", str(args.scale), "--zipf", str(args.zipf)]
    if args.sizes:
        parts += ["--sizes", *map(str, args.sizes)]
    if args.policies:
        parts += ["--policies", args.policies]
    parts += ["--batches", str(args.batches), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    parts += ["--ways", str(args.ways), "--seed", str(args.seed), "--out", str(args.out)]
    return shlex.join(parts)
