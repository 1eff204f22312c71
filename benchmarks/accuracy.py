"""The accuracy study: a few setups, many paired seeds, whole epochs, 95 % t-intervals."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.mixed_precision import BASELINE, mp_name
from benchmarks.render import (
    CACHE_MARKERS,
    PRECISION_COLORS,
    fmt_mean_std,
    fmt_value,
    markdown_table,
    metric,
    save_figure,
)
from benchmarks.runner import ACCURACY, Preset, Setup
from slipcache.errors import SlipcacheError
from slipcache.plotting import STYLE, pyplot

ACCURACY_SEEDS = 5
ACCURACY_TOLERANCE = 0.001  # the claim: INT8 + 5 % cache within this AUC of fp32, its interval inside ± this
ACCURACY_CONFIDENCE = 0.95
ACCURACY_SETUPS = (("fp32", 0.0, "lru"), ("fp16", 0.0, "lru"), ("int8", 0.05, "lru"), ("int8", 0.05, "lfu"),
                   ("int4", 0.01, "lru"), ("int8", 0.0, "lru"))  # fmt: skip


def accuracy_grid(preset: Preset, seeds: int) -> list[Setup]:
    """fp32 and the paper's configurations, all on the same seeds: a seed fixes the data order and the
    initial fp32 rows (low precision stores their rounding), so per-seed differences measure storage alone."""
    del preset  # the same grid at every scale; the preset sets only sizes and run length
    return [Setup(ACCURACY, mp_name(p, c, pol), {"precision": p, "cache_size": c, "policy": pol,
                                                 "rounding": "stochastic"}, seeds, [ACCURACY])
            for p, c, pol in ACCURACY_SETUPS]


def t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer `df`: the finite series of Abramowitz & Stegun 26.7.3-4.

    Why not scipy: the package does not depend on it, and seeds (hence df) are whole numbers.
    """
    if df < 1:
        raise SlipcacheError(f"degrees of freedom must be at least 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= cos2 * (k - 1) / k
            total += term
        return sin * total
    total = 0.0  # 2/pi * (theta + sin * (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... up to cos^(df-2)))
    if df > 1:
        term = total = math.cos(theta)
        for k in range(3, df - 1, 2):
            term *= cos2 * (k - 1) / k
            total += term
    return 2 / math.pi * (theta + sin * total)


def t_critical(df: int, confidence: float = ACCURACY_CONFIDENCE) -> float:
    """The t with P(|T| < t) = confidence (2.776 for df 4 at 95 %), by bisection on the series."""
    low, high = 0.0, 1.0
    while t_two_sided_mass(high, df) < confidence:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if t_two_sided_mass(mid, df) < confidence else (low, mid)
    return (low + high) / 2


def paired_interval(diffs: list[float], confidence: float = ACCURACY_CONFIDENCE) -> dict[str, Any] | None:
    """Mean of per-seed differences and its paired t-interval (None bounds with a single seed)."""
    if not diffs:
        return None
    n, mean = len(diffs), statistics.fmean(diffs)
    if n == 1:
        return {"mean": mean, "n": 1, "std": None, "half_width": None, "low": None, "high": None}
    std = statistics.stdev(diffs)
    half = t_critical(n - 1, confidence) * std / math.sqrt(n)
    return {"mean": mean, "n": n, "std": std, "half_width": half, "low": mean - half, "high": mean + half}


def accuracy_intervals(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setup: ΔAUC and Δ log loss against fp32 on the seeds both ran, with their 95 % intervals."""
    base = next((e for e in entries if e["name"] == BASELINE), None)
    rows = []
    for e in entries:
        if base is None or e is base:
            continue
        seeds = sorted(set(e["per_seed"]) & set(base["per_seed"]), key=int)
        row: dict[str, Any] = {"setup": e["name"], "seeds": [int(s) for s in seeds]}
        for key in ("auc", "logloss"):
            pairs = [(e["per_seed"][s].get(key), base["per_seed"][s].get(key)) for s in seeds]
            row[f"{key}_delta"] = paired_interval([a - b for a, b in pairs if a is not None and b is not None])
        row["verdict"] = tolerance_verdict(row["auc_delta"])
        rows.append(row)
    return rows


def tolerance_verdict(interval: dict[str, Any] | None, tolerance: float = ACCURACY_TOLERANCE) -> str:
    """Whether ΔAUC is within `tolerance` with its whole interval inside ± tolerance (the paper's claim)."""
    if not interval or interval["low"] is None:
        return "too few seeds for an interval"
    low, high = interval["low"], interval["high"]
    if -tolerance < low and high < tolerance:
        return f"met: interval inside ±{tolerance:g}"
    if high < -tolerance or low > tolerance:
        side = "loss" if high < 0 else "gain"
        return f"missed: a {side} beyond {tolerance:g} (whole interval)"
    beyond = max(-tolerance - low, high - tolerance)
    return f"not shown: interval reaches {beyond:.2g} beyond ±{tolerance:g}"


def validation_curves(out: Path, results: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, list]:
    """Per setup: (samples, validation AUC averaged over the seeds evaluated there), from metrics.jsonl."""
    curves: dict[str, list] = {}
    for e in entries:
        points: dict[int, list[float]] = {}
        for cell in (c for c in results["cells"] if c["setup"] == e["name"]):
            path = out / "cells" / cell["id"] / "metrics.jsonl"
            for line in path.read_text().splitlines() if path.is_file() else []:
                event = json.loads(line)
                if event.get("val_auc") is not None:
                    points.setdefault(event["samples"], []).append(event["val_auc"])
        curves[e["name"]] = [(s, statistics.fmean(v)) for s, v in sorted(points.items())]
    return curves


def validation_slopes(curve: list[tuple[int, float]], epochs: int) -> tuple[float, float] | None:
    """Validation AUC gained per epoch at the end (from the last evaluation at least an epoch before the
    final one) and at the start (first two evaluations): how flat the curve has become."""
    if len(curve) < 3 or epochs < 2:
        return None
    per_epoch = curve[-1][0] / epochs
    earlier = [(s, auc) for s, auc in curve if s <= curve[-1][0] - per_epoch]
    if not earlier:
        return None
    (s0, a0), (s1, a1) = earlier[-1], curve[-1]
    (f0, b0), (f1, b1) = curve[0], curve[1]
    return (a1 - a0) * per_epoch / (s1 - s0), (b1 - b0) * per_epoch / (f1 - f0)


def plot_accuracy_intervals(rows: list[dict[str, Any]], entries: list[dict[str, Any]],
                            curves: dict[str, list], path: Path) -> str | None:
    """ΔAUC and Δ log loss vs fp32 with 95 % intervals and per-seed points, then the validation curves."""
    plt = pyplot()
    rows = [r for r in rows if r["auc_delta"]]
    if not rows:
        return None
    by = {e["name"]: e for e in entries}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [3, 3, 4]})
    xs = range(len(rows))
    for ax, key, label in ((axes[0], "auc", "test AUC"), (axes[1], "logloss", "test log loss")):
        if key == "auc":
            ax.axhspan(-1e3 * ACCURACY_TOLERANCE, 1e3 * ACCURACY_TOLERANCE, color="tab:green", alpha=0.12,
                       label=f"target: interval inside ±{ACCURACY_TOLERANCE:g}")
        ax.axhline(0, color="0.3", linewidth=0.8)
        for x, r in zip(xs, rows, strict=True):
            stat = r[f"{key}_delta"]
            color = PRECISION_COLORS.get(by[r["setup"]]["overrides"]["precision"], "k")
            per_seed = [by[r["setup"]]["per_seed"][str(s)] for s in r["seeds"]]
            base = by[BASELINE]["per_seed"]
            dots = [1e3 * (p[key] - base[str(s)][key]) for p, s in zip(per_seed, r["seeds"], strict=True)]
            ax.scatter([x + 0.18] * len(dots), dots, s=12, color=color, alpha=0.5)
            ax.errorbar(x, 1e3 * stat["mean"], yerr=1e3 * stat["half_width"] if stat["half_width"] else None,
                        fmt="o", color=color, capsize=5, markersize=7)
        ax.set_xticks(list(xs), [r["setup"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(f"{label} minus fp32, same seed (x 1e-3)")
        n = min(r[f"{key}_delta"]["n"] for r in rows)
        ax.set_title(f"Δ {label}: mean, 95% interval, seeds (n={n})")
        if key == "auc":
            ax.legend(loc="best", fontsize=8)
    right = axes[2]
    for e in entries:
        curve = curves.get(e["name"])
        if curve:
            o = e["overrides"]
            right.plot(*zip(*curve, strict=True), marker=CACHE_MARKERS.get(o["cache_size"], "*"), markersize=4,
                       color=PRECISION_COLORS.get(o["precision"]), linewidth=2.5 if e["name"] == BASELINE else 1.2,
                       linestyle="--" if o["policy"] == "lfu" and o["cache_size"] else "-", label=e["name"],
                       zorder=3 if e["name"] == BASELINE else 2)
    right.set_xlabel("training samples")
    right.set_ylabel("validation AUC (mean over seeds)")
    right.set_title("Validation AUC during training")
    if right.lines:
        right.legend(fontsize=8)
    return save_figure(fig, path)


def _interval_text(stat: dict[str, Any] | None) -> str:
    if not stat:
        return "n/a"

    def signed(x: float) -> str:
        return f"{round(x, 4) + 0.0:+.4f}"  # + 0.0: no "-0.0000"

    if stat["low"] is None:
        return signed(stat["mean"])
    return f"{signed(stat['mean'])} [{signed(stat['low'])}, {signed(stat['high'])}]"


def accuracy_section(out: Path, results: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    rows = accuracy_intervals(entries)
    curves = validation_curves(out, results, entries)
    with pyplot().rc_context(STYLE):
        plot = plot_accuracy_intervals(rows, entries, curves, out / "accuracy_intervals.png")
    by = {e["name"]: e for e in entries}
    base = by.get(BASELINE)
    cells = [c for c in results["cells"] if c["experiment"] == ACCURACY]
    config = cells[0]["summary"].get("config", {}) if cells else {}
    epochs = config.get("epochs") or results["preset"].get("accuracy_epochs") or 0
    data = (f"`{results['data']}`" if results.get("data") else
            f"synthetic data, generator {config.get('synthetic_generator', 'v2')}, "
            f"{config.get('synthetic_samples', 0):,} rows at scale {config.get('synthetic_scale', 0):g}"
            + (f" (`{cells[0]['dataset']}` in the cache)" if cells[0].get("dataset") else ""))
    lines = ["## Accuracy against fp32, paired over seeds", "",
             f"Data: {data}; {epochs} epoch(s) of the training split, batch {config.get('batch_size')}, "
             f"lr {config.get('lr')}; test AUC and log loss on the test split. A seed gives every setup the same "
             "data order and the same initial fp32 rows (low precision stores their rounding), so the per-seed "
             "difference to fp32 measures storage and cache alone. Intervals: 95% paired t-interval over seeds, "
             "mean ± t(0.975, n-1) · sd / √n of the per-seed differences.", ""]
    if base:
        slopes = validation_slopes(curves.get(BASELINE, []), epochs)
        lines += [f"Reference `{BASELINE}`: test AUC {fmt_mean_std(base, 'auc')}, "
                  f"log loss {fmt_mean_std(base, 'logloss')} "
                  f"(mean ± sd over {base['seeds']} seed(s))."
                  + (f" Its validation AUC (mean over seeds) moved by {slopes[0]:+.4f} per epoch at the end of "
                     f"training, against {slopes[1]:+.4f} per epoch at the start." if slopes else ""), ""]
    lines += markdown_table(
        ["setup", "n", "test AUC", "ΔAUC [95% CI]", "Δ log loss [95% CI]", "memory saving", "hit rate",
         f"within ±{ACCURACY_TOLERANCE:g}?"],
        [[r["setup"], str(r["auc_delta"]["n"] if r["auc_delta"] else 0), fmt_mean_std(by[r["setup"]], "auc"),
          _interval_text(r["auc_delta"]), _interval_text(r["logloss_delta"]),
          fmt_value(metric(by[r["setup"]], "memory_ratio"), ".2f") + "x",
          fmt_value(100 * metric(by[r["setup"]], "cache_hit_rate"), ".1f") + "%"
          if metric(by[r["setup"]], "cache_hit_rate") else "-",
          r["verdict"]] for r in rows],
    )
    if plot:
        lines += ["", f"![accuracy with intervals]({plot})"]
    lines += ["", answer_accuracy(rows), ""]
    return lines


def answer_accuracy(rows: list[dict[str, Any]]) -> str:
    """The claim (INT8 + 5 % cache) against the target, then INT4 + 1 % as measured."""
    by = {r["setup"]: r for r in rows}
    parts = []
    for name in (mp_name("int8", 0.05, "lru"), mp_name("int8", 0.05, "lfu"), mp_name("int4", 0.01, "lru")):
        r = by.get(name)
        if r and r["auc_delta"]:
            parts.append(f"{name}: ΔAUC {_interval_text(r['auc_delta'])} over {r['auc_delta']['n']} seed(s), "
                         f"{r['verdict']}")
    if not parts:
        return "**Accuracy.** No low-precision setup finished."
    return (f"**Accuracy.** Target: INT8 + 5% cache within {ACCURACY_TOLERANCE:g} AUC of fp32 with its 95% "
            "interval inside that band. " + "; ".join(parts) + ".")
