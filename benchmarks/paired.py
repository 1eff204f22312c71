"""Statistics over seeds: per-setup mean and std, and differences paired by seed.

Why paired: a seed fixes the data order and the initial rows, so a per-seed difference measures the
setup alone, not the seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any


def mean_std(values: Iterable[Any]) -> dict[str, Any] | None:
    """{mean, std, n} of the finite numbers among `values` (a run that did not measure a key is left out)."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


PER_SEED = ("auc", "logloss", "cache_hit_rate", "memory_ratio", "embedding_bytes", "train_wall_s", "skipped_fraction")
MIN_EFFECT = 0.001  # AUC changes below this are not called a difference, whatever the seeds say


def on_seeds(entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries with their per-seed metrics averaged over the seeds all of them ran.

    Why: a sweep mixes setups run over three seeds with one-seed setups; comparing a three-seed mean with
    a seed-0 value measures the seeds, not the setups.
    """
    common = sorted(set.intersection(*(set(e["per_seed"]) for e in entries)), key=int) if entries else []
    view = []
    for e in entries:
        metrics = dict(e["metrics"])
        for key in (*PER_SEED, "auc_delta", "speedup"):
            metrics[key] = mean_std(e["per_seed"][s].get(key) for s in common)
        view.append({**e, "metrics": metrics, "seeds": len(common)})
    return view, common


def paired_difference(a: dict[str, Any], b: dict[str, Any], key: str = "auc") -> dict[str, Any] | None:
    """a minus b on the seeds both ran, and whether it exceeds MIN_EFFECT and twice its standard error."""
    seeds = set(a["per_seed"]) & set(b["per_seed"])
    diffs = [a["per_seed"][s][key] - b["per_seed"][s][key] for s in seeds
             if a["per_seed"][s].get(key) is not None and b["per_seed"][s].get(key) is not None]
    stat = mean_std(diffs)
    if stat:
        stat["measurable"] = exceeds_noise(stat["mean"], stat["std"], stat["n"])
    return stat


def exceeds_noise(mean: float, std: float, n: int) -> bool:
    """Whether a mean difference is beyond MIN_EFFECT and twice its standard error."""
    return abs(mean) > max(MIN_EFFECT, 2 * std / math.sqrt(n) if n > 1 else 0.0)
