"""The mixed-precision study (Yang et al., arXiv 2010.11305): its grid (RQ1-RQ5), derived traffic
numbers, plots and report section.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.paired import MIN_EFFECT, exceeds_noise, on_seeds, paired_difference
from benchmarks.render import (
    CACHE_MARKERS,
    PRECISION_COLORS,
    fmt_mean_std,
    fmt_percent,
    fmt_value,
    markdown_table,
    metric,
    mib,
    save_figure,
)
from benchmarks.runner import PAPER, Preset, Setup
from slipcache.plotting import pyplot

BASELINE = "fp32 no cache"  # the mixed-precision reference setup
CACHE_LINE = 64  # bytes; a random row access costs at least one line


def mp_name(precision: str, cache: float, policy: str = "lru", rounding: str = "stochastic") -> str:
    """Readable setup name, e.g. 'int8 5% lru' or 'int4 no cache nearest'."""
    name = f"{precision} {'no cache' if cache == 0 else f'{fmt_percent(cache)} {policy}'}"
    return name + (" nearest" if rounding == "nearest" else "")


def mixed_precision_grid(preset: Preset, seeds: int) -> list[Setup]:
    """RQ1 precision x cache, RQ2/RQ3 policy x cache size at int8, RQ4 rounding; RQ5 reads every run."""
    setups: dict[str, Setup] = {}

    def add(question: str, precision: str, cache: float, policy: str = "lru", rounding: str = "stochastic",
            n_seeds: int = 1) -> None:
        name = mp_name(precision, cache, policy, rounding)
        if name not in setups:
            overrides = {"precision": precision, "cache_size": cache, "policy": policy, "rounding": rounding}
            setups[name] = Setup("mixed-precision", name, overrides, n_seeds)
        setups[name].seeds = max(setups[name].seeds, n_seeds)
        if question not in setups[name].questions:
            setups[name].questions.append(question)

    if preset.full_grid:
        precisions, caches = ("fp32", "fp16", "int8", "int4"), (0.0, 0.01, 0.05, 0.10)
        sweep, policies, rounding_cases = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20), ("lru", "lfu"), (0.0, 0.05)
    else:
        precisions, caches = ("fp32", "fp16", "int8", "int4"), (0.0, 0.05)
        sweep, policies, rounding_cases = (0.01, 0.05, 0.20), ("lru", "lfu"), (0.0, 0.05)
    for precision in precisions:
        for cache in caches:
            # fp32 rows behind an exact fp32 cache: the baseline's math (up to float summation order).
            add("RQ1", precision, cache, n_seeds=1 if precision == "fp32" and cache else seeds)
    add("RQ1", "int4", 0.01, n_seeds=seeds)  # the paper's >7x headline setup, also in the quick grid
    for policy in policies:
        for cache in sweep if policy == "lru" or preset.full_grid else sweep[:2]:
            add("RQ3", "int8", cache, policy)
            add("RQ2", "int8", cache, policy)
    for precision in ("int8", "int4"):
        for cache in rounding_cases:
            add("RQ4", precision, cache, n_seeds=seeds)
            add("RQ4", precision, cache, rounding="nearest", n_seeds=seeds)
    return list(setups.values())


def derived_metrics(record: dict[str, Any], probes: dict[str, Any] | None, num_tables: int) -> dict[str, Any]:
    """Per-sample traffic, the unified-memory comparison, step time and the memory-system bound.

    Bytes the embedding layer touches per sample: each of the `num_tables` lookups reads its row and the
    update writes it back (fp32 cache rows when there is a cache, stored rows when not), plus, with a
    cache, the rows moved between storage and cache. The no-cache unified-memory design moves every looked-up stored row
    from host memory and back. The bound divides the measured random-gather rate (rows of one cache
    line) by the cache lines a sample needs: what this memory system allows, ignoring the MLPs.
    """
    summary, config = record["summary"], record["config"]
    from slipcache.embedding.quant import RowStorage

    dim = summary["config"]["embedding_dim"]
    row_bytes = RowStorage(1, dim, config["precision"]).bytes_per_row
    fp32_row = 4 * dim
    cached = config["cache_size"] > 0 and config.get("policy") != "none"
    served = fp32_row if cached else row_bytes
    samples = max(summary["train_samples"], 1)
    out: dict[str, Any] = {
        "row_bytes": row_bytes,
        "unified_bytes_per_sample": 2 * num_tables * row_bytes,
        "step_ms": 1e3 * summary["train_wall_s"] / max(samples / config["batch_size"], 1),
    }
    traffic = record.get("embedding_traffic")
    moved_rows = moved_bytes = None
    if traffic:
        moved_rows = (traffic["rows_in"] + traffic["rows_out"]) / samples
        moved_bytes = (traffic["bytes_in"] + traffic["bytes_out"]) / samples
    out["rows_moved_per_sample"] = moved_rows
    out["bytes_moved_per_sample"] = moved_bytes
    moved_lines = (moved_rows or 0.0) * math.ceil(row_bytes / CACHE_LINE) if cached else 0.0
    out["touched_bytes_per_sample"] = 2 * num_tables * served + ((moved_bytes or 0.0) if cached else 0.0)
    lines = 2 * num_tables * math.ceil(served / CACHE_LINE) + moved_lines
    gather = (probes or {}).get("random_gather", {}).get("rows_per_s")
    out["bound_samples_per_s"] = gather / lines if gather and lines else None
    rate = summary.get("samples_per_s")
    out["bound_fraction"] = rate / out["bound_samples_per_s"] if rate and out["bound_samples_per_s"] else None
    return out


def pareto_front(points: list[tuple[float, float]], tie: float = 0.0) -> list[int]:
    """Indices of points no other point beats on both memory (lower) and accuracy (higher), by memory.

    A point must beat the accuracy of every smaller one by more than `tie` (equal results in float noise,
    such as fp32 rows with and without an exact fp32 cache, are not a trade-off).
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best + tie:
            front.append(i)
            best = points[i][1]
    return front


def plot_accuracy_memory(entries: list[dict[str, Any]], path: Path) -> str | None:
    """AUC change vs embedding memory for the setups run on every seed; the Pareto front highlighted.

    One-seed sweep setups are left out: next to multi-seed means they would compare seeds, not setups.
    """
    plt = pyplot()
    from matplotlib.lines import Line2D

    most = max((e["seeds"] for e in entries), default=0)
    pts = [e for e in entries
           if e["seeds"] == most and metric(e, "embedding_bytes") and metric(e, "auc_delta") is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 5.5))
    xy = [(mib(metric(e, "embedding_bytes")), 1e3 * metric(e, "auc_delta")) for e in pts]
    for e, (x, y) in zip(pts, xy, strict=True):
        o = e["overrides"]
        nearest = o["rounding"] == "nearest"
        color = PRECISION_COLORS.get(o["precision"], "k")
        sem = 1e3 * metric(e, "auc_delta", "std") / math.sqrt(most)
        ax.errorbar(x, y, yerr=sem or None, fmt=CACHE_MARKERS.get(o["cache_size"], "*"),
                    markersize=8, color=color, mfc="white" if nearest else color, alpha=0.9, capsize=3)
    front = pareto_front(xy, tie=0.01)  # 1e-5 AUC
    fx, fy = [xy[i][0] for i in front], [xy[i][1] for i in front]
    ax.step(fx, fy, where="post", color="black", linewidth=1.2, linestyle="--", zorder=0)
    ax.scatter(fx, fy, s=260, facecolors="none", edgecolors="gold", linewidths=2.2, zorder=5)
    for k, i in enumerate(front, 1):  # numbers at the points, names in a legend: labels never collide
        ax.annotate(str(k), xy[i], textcoords="offset points", xytext=(9, 7) if k % 2 else (-4, -20), fontsize=10,
                    fontweight="bold")
    ax.axhline(0, color="0.4", linewidth=0.8)
    ax.set_xlabel("embedding memory (MiB, storage + cache + bookkeeping)")
    ax.set_ylabel("test AUC change vs fp32 no cache (x 1e-3)")
    bars = f", bars: standard error over {most} seeds" if most > 1 else ""
    ax.set_title(f"Accuracy vs embedding memory (ringed: Pareto front{bars})")
    precisions = sorted({e["overrides"]["precision"] for e in pts}, key=list(PRECISION_COLORS).index)
    caches = sorted({e["overrides"]["cache_size"] for e in pts})
    handles = [Line2D([], [], color=PRECISION_COLORS[p], marker="o", linestyle="", label=p) for p in precisions]
    handles += [Line2D([], [], color="0.3", marker=CACHE_MARKERS.get(c, "*"), linestyle="",
                       label="no cache" if c == 0 else f"cache {fmt_percent(c)}") for c in caches]
    handles.append(Line2D([], [], color="0.3", marker="o", mfc="white", linestyle="", label="nearest rounding"))
    first = ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="precision / cache")
    ax.add_artist(first)
    names = [Line2D([], [], linestyle="", label=f"{k}  {pts[i]['name']}") for k, i in enumerate(front, 1)]
    ax.legend(handles=names, loc="lower left", bbox_to_anchor=(1.01, 0.0), title="Pareto front",
              handlelength=0, handletextpad=0)
    return save_figure(fig, path)


def plot_cache_sweep(entries: list[dict[str, Any]], path: Path) -> str | None:
    """int8 with a cache: hit rate, AUC change and memory against cache size, one line per policy."""
    plt = pyplot()
    sweep = [e for e in entries if e["overrides"]["precision"] == "int8" and e["overrides"]["cache_size"] > 0
             and e["overrides"]["rounding"] == "stochastic"]
    if not sweep:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.3))
    panels = [
        ("cache_hit_rate", 100, "hit rate (% of lookups)", "Cache hit rate"),
        ("auc_delta", 1e3, "AUC change vs fp32 (x 1e-3)", "Accuracy"),
        ("embedding_bytes", 1 / 2**20, "embedding memory (MiB)", "Memory"),
    ]
    for policy, color in (("lru", "tab:blue"), ("lfu", "tab:orange")):
        pts = sorted((e for e in sweep if e["overrides"]["policy"] == policy),
                     key=lambda e: e["overrides"]["cache_size"])
        xs = [100 * e["overrides"]["cache_size"] for e in pts]
        for ax, (key, scale, ylabel, title) in zip(axes, panels, strict=True):
            ys = [(metric(e, key) or math.nan) * scale for e in pts]
            errs = [(metric(e, key, "std") or 0.0) * scale for e in pts]
            ax.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", color=color, label=policy.upper(),
                        capsize=3)
            ax.set_xscale("log")
            sizes = sorted({100 * e["overrides"]["cache_size"] for e in sweep})
            ax.set_xticks(sizes, [f"{x:g}%" for x in sizes])
            ax.minorticks_off()
            ax.set_xlabel("cache size (% of all rows, log scale)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}, int8 storage")
    axes[1].axhline(0, color="0.4", linewidth=0.8)
    n = sweep[0]["seeds"]
    axes[1].set_title(f"Accuracy, int8 storage ({n} common seed{'s' if n != 1 else ''})")
    for ax in axes:
        ax.legend()
    return save_figure(fig, path)


def plot_rounding(entries: list[dict[str, Any]], path: Path) -> str | None:
    """Left: AUC change vs fp32 per rounding; right: the seed-paired gain of stochastic over nearest."""
    plt = pyplot()
    by_key = {(e["overrides"]["precision"], e["overrides"]["cache_size"], e["overrides"]["policy"],
               e["overrides"]["rounding"]): e for e in entries}
    cases = sorted({k[:3] for k in by_key if k[3] == "nearest" and (*k[:3], "stochastic") in by_key})
    if not cases:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{p}\n{'no cache' if c == 0 else f'{fmt_percent(c)} {pol}'}" for p, c, pol in cases]
    width = 0.38
    for j, (rounding, color) in enumerate((("stochastic", "tab:green"), ("nearest", "tab:purple"))):
        group = [by_key[(*c, rounding)] for c in cases]
        ys = [1e3 * (metric(e, "auc_delta") or 0.0) for e in group]
        sems = [1e3 * (metric(e, "auc_delta", "std") or 0.0) / math.sqrt(max(e["seeds"], 1)) for e in group]
        left.bar([i + (j - 0.5) * width for i in range(len(cases))], ys, width, yerr=sems if any(sems) else None,
                 capsize=3, color=color, label=f"{rounding} rounding")
    left.set_xticks(range(len(cases)), labels)
    left.axhline(0, color="0.3", linewidth=0.8)
    left.set_ylabel("test AUC change vs fp32 no cache (x 1e-3)")
    left.set_title("Accuracy per rounding mode (bars: standard error)")
    left.legend()
    diffs = [paired_difference(by_key[(*c, "stochastic")], by_key[(*c, "nearest")]) for c in cases]
    ys = [1e3 * (d["mean"] if d else 0.0) for d in diffs]
    sems = [1e3 * d["std"] / math.sqrt(d["n"]) if d else 0.0 for d in diffs]
    colors = ["tab:green" if d and d["measurable"] else "0.6" for d in diffs]
    right.bar(range(len(cases)), ys, 0.6, yerr=sems if any(sems) else None, capsize=3, color=colors)
    right.set_xticks(range(len(cases)), labels)
    right.axhline(0, color="0.3", linewidth=0.8)
    right.set_ylabel("AUC, stochastic minus nearest (x 1e-3)")
    right.set_title("Gain of stochastic rounding, paired by seed\n(green: measurable, grey: within noise)")
    return save_figure(fig, path)


def plot_traffic(entries: list[dict[str, Any]], path: Path) -> str | None:
    """Bytes moved per sample (ours vs a no-cache unified-memory design) and time per step."""
    plt = pyplot()
    pts = [e for e in entries if "RQ1" in e["questions"] and metric(e, "bytes_moved_per_sample") is not None]
    if not pts:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    xs = range(len(pts))
    width = 0.4
    left.bar([x - width / 2 for x in xs], [metric(e, "bytes_moved_per_sample") for e in pts], width,
             color="tab:green", label="ours: storage <-> cache (measured)")
    left.bar([x + width / 2 for x in xs], [metric(e, "unified_bytes_per_sample") for e in pts], width,
             color="0.6", label="no cache, unified memory: 26 rows each way")
    left.set_yscale("log")
    left.set_ylim(top=8 * max(metric(e, "unified_bytes_per_sample") for e in pts))  # room for the legend
    left.set_ylabel("bytes per training sample (log scale)")
    left.set_title("Embedding rows moved to and from storage")
    left.set_xticks(list(xs), [e["name"] for e in pts], rotation=40, ha="right")
    left.legend(loc="upper right")
    errs = [metric(e, "step_ms", "std") for e in pts]
    right.bar(list(xs), [metric(e, "step_ms") for e in pts], yerr=errs if any(errs) else None,
              color=[PRECISION_COLORS.get(e["overrides"]["precision"], "k") for e in pts], capsize=2)
    right.set_xticks(list(xs), [e["name"] for e in pts], rotation=55, ha="right")
    right.set_ylabel("time per training step (ms)")
    right.set_title("Time per training step")
    return save_figure(fig, path)


def _pooled_delta_std(entries: list[dict[str, Any]]) -> float:
    """Typical seed-to-seed std of ΔAUC among setups run over several seeds (0 when there are none)."""
    stds = [metric(e, "auc_delta", "std") for e in entries if e["seeds"] > 1 and e["name"] != BASELINE]
    return math.sqrt(statistics.fmean(x * x for x in stds)) if stds else 0.0


def _loses(entry: dict[str, Any], pooled_std: float) -> bool:
    """A measurable AUC loss: beyond MIN_EFFECT and twice the standard error (a one-seed setup borrows
    the pooled std of the multi-seed ones)."""
    mean, n = metric(entry, "auc_delta"), entry["seeds"]
    std = metric(entry, "auc_delta", "std") if n > 1 else pooled_std
    return mean < 0 and exceeds_noise(mean, std, max(n, 1))


def _dim_estimate(table_sizes: list[int], precision: str, cache: float, dim: int) -> float | None:
    """Memory ratio of a setup at another embedding dim, computed without allocating the tables."""
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

    try:
        cfg = EmbeddingConfig(table_sizes=table_sizes, dim=dim, precision=precision, cache_size=cache)
        return float(CachedEmbeddingBagCollection.estimate_memory(cfg)["memory_ratio"])
    except Exception:  # an estimate for prose only; never fail the report on it
        return None


def mixed_precision_section(entries: list[dict[str, Any]], plots: dict[str, str | None],
                            table_sizes: list[int] | None) -> list[str]:
    by = {e["name"]: e for e in entries}
    base = by.get(BASELINE)
    lines = ["## Mixed-precision embeddings with an fp32 row cache", ""]
    if base:
        lines += [f"Reference: `{BASELINE}`, test AUC {fmt_mean_std(base, 'auc')}, "
                  f"log loss {fmt_mean_std(base, 'logloss')} "
                  f"over {base['seeds']} seed(s). Deltas are paired by seed (mean ± std over seeds). A change is "
                  f"called measurable when it exceeds {MIN_EFFECT} AUC and twice its standard error over seeds.", ""]

    # RQ1
    rq1 = [e for e in entries if "RQ1" in e["questions"]]
    lines += ["### RQ1: accuracy with most rows in low precision", ""]
    lines += markdown_table(
        ["setup", "seeds", "test AUC", "ΔAUC vs fp32", "Δ log loss", "memory (MiB)", "memory saving", "hit rate"],
        [[e["name"], str(e["seeds"]), fmt_mean_std(e, "auc"), fmt_mean_std(e, "auc_delta", fmt=".4f", sign=True),
          fmt_mean_std(e, "logloss_delta", fmt=".4f", sign=True),
          fmt_value(mib(metric(e, "embedding_bytes") or 0), ".1f"), fmt_value(metric(e, "memory_ratio"), ".2f") + "x",
          fmt_value(100 * (metric(e, "cache_hit_rate") or 0), ".1f") + "%" if metric(e, "cache_hit_rate") else "-"]
         for e in rq1],
    )
    if plots.get("accuracy_memory"):
        lines += ["", f"![accuracy vs memory]({plots['accuracy_memory']})"]
    lines += ["", answer_rq1(rq1), ""]

    # RQ2 and RQ3
    sweep, common = on_seeds([e for e in entries if {"RQ2", "RQ3"} & set(e["questions"])])
    sweep.sort(key=lambda e: (e["overrides"]["policy"], e["overrides"]["cache_size"]))
    lines += ["### RQ2 and RQ3: LRU vs LFU, and cache size (int8 storage)", "",
              f"Compared on the seed(s) every setup of the sweep ran: {', '.join(common) or 'none'}.", ""]
    lines += markdown_table(
        ["policy", "cache", "seeds", "hit rate", "ΔAUC vs fp32", "memory (MiB)", "memory saving"],
        [[e["overrides"]["policy"].upper(), fmt_percent(e["overrides"]["cache_size"]), str(e["seeds"]),
          fmt_mean_std(e, "cache_hit_rate", 100, ".1f") + "%", fmt_mean_std(e, "auc_delta", sign=True),
          fmt_value(mib(metric(e, "embedding_bytes") or 0), ".1f"), fmt_value(metric(e, "memory_ratio"), ".2f") + "x"]
         for e in sweep],
    )
    if plots.get("cache_sweep"):
        lines += ["", f"![cache sweep]({plots['cache_sweep']})"]
    lines += ["", "**RQ2.** " + answer_rq2(sweep), "", "**RQ3.** " + answer_rq3(sweep), ""]

    # RQ4
    rq4 = [e for e in entries if "RQ4" in e["questions"]]
    lines += ["### RQ4: stochastic vs nearest rounding", ""]
    lines += markdown_table(["setup", "seeds", "test AUC", "ΔAUC vs fp32", "Δ log loss"],
                    [[e["name"], str(e["seeds"]), fmt_mean_std(e, "auc"), fmt_mean_std(e, "auc_delta", sign=True),
                      fmt_mean_std(e, "logloss_delta", sign=True)] for e in rq4])
    if plots.get("rounding"):
        lines += ["", f"![rounding]({plots['rounding']})"]
    lines += ["", answer_rq4(rq4), ""]

    # RQ5
    rq5 = [e for e in entries if "RQ1" in e["questions"]]
    lines += ["### RQ5: rows moved between storage and cache, and time per step", ""]
    lines += markdown_table(
        ["setup", "rows moved / sample", "bytes moved / sample", "no-cache unified memory bytes / sample",
         "bytes touched / sample", "step (ms)", "measured samples/s", "memory bound samples/s", "of bound"],
        [[e["name"], fmt_value(metric(e, "rows_moved_per_sample"), ".2f"),
          fmt_value(metric(e, "bytes_moved_per_sample"), ".0f"),
          fmt_value(metric(e, "unified_bytes_per_sample"), ".0f"),
          fmt_value(metric(e, "touched_bytes_per_sample"), ".0f"),
          fmt_mean_std(e, "step_ms", fmt=".2f"), fmt_value(metric(e, "samples_per_s"), ",.0f"),
          fmt_value(metric(e, "bound_samples_per_s"), ",.0f"),
          fmt_value(100 * (metric(e, "bound_fraction") or math.nan), ".1f") + "%"] for e in rq5],
    )
    if plots.get("traffic"):
        lines += ["", f"![bytes moved]({plots['traffic']})"]
    lines += ["", answer_rq5(rq5), ""]
    lines += ["### Against the paper (Yang et al.)", "", paper_mixed_precision(by, table_sizes), ""]
    return lines


def answer_rq1(rq1: list[dict[str, Any]]) -> str:
    lowp = [e for e in rq1 if e["overrides"]["precision"] != "fp32" and metric(e, "auc_delta") is not None]
    if not lowp:
        return "**RQ1.** No low-precision runs finished."
    pooled = _pooled_delta_std(rq1)
    hurt = [e for e in lowp if _loses(e, pooled)]
    kept = [e for e in lowp if e not in hurt]
    text = f"**RQ1.** Of {len(lowp)} low-precision setups, {len(kept)} show no measurable AUC loss against fp32"
    if hurt:
        text += "; " + ", ".join(f"{e['name']} ({fmt_mean_std(e, 'auc_delta', sign=True)})" for e in hurt)
        text += " loses accuracy" if len(hurt) == 1 else " lose accuracy"
    text += ". "
    best = max(kept, key=lambda e: metric(e, "memory_ratio") or 0, default=None)
    if best:
        text += (f"The largest memory saving without a measurable loss is {best['name']}: "
                 f"{metric(best, 'memory_ratio'):.2f}x less embedding memory at "
                 f"ΔAUC {fmt_mean_std(best, 'auc_delta', sign=True)}. ")
    close = max((e for e in lowp if abs(metric(e, "auc_delta")) < MIN_EFFECT),
                key=lambda e: metric(e, "memory_ratio") or 0, default=None)
    if close and close is not best:
        text += (f"The largest saving whose mean change is also below {MIN_EFFECT} AUC is {close['name']} "
                 f"({metric(close, 'memory_ratio'):.2f}x, ΔAUC {fmt_mean_std(close, 'auc_delta', sign=True)}). ")
    worst = min(lowp, key=lambda e: metric(e, "auc_delta"))
    if worst not in hurt and metric(worst, "auc_delta") < -MIN_EFFECT:
        text += (f"The largest mean loss, {worst['name']} ({fmt_mean_std(worst, 'auc_delta', sign=True)}), "
                 "is not separable "
                 f"from seed noise with {worst['seeds']} seed(s). ")
    for p in ("int8", "int4"):
        nocache = next(
            (e for e in lowp if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] == 0), None
        )
        cached = sorted((e for e in lowp if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] > 0),
                        key=lambda e: abs(e["overrides"]["cache_size"] - 0.05))
        diff = paired_difference(cached[0], nocache) if nocache and cached else None
        if diff:
            verdict = "within noise"
            if diff["measurable"]:
                verdict = "a measurable gain" if diff["mean"] > 0 else "a measurable loss"
            text += (f"For {p}, a {fmt_percent(cached[0]['overrides']['cache_size'])} cache changes AUC by "
                     f"{diff['mean']:+.4f} "
                     f"against no cache (paired over {diff['n']} seed(s): {verdict}). ")
    return text.strip()


def _policy_pairs(sweep: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any], dict[str, Any]]]:
    lru = {e["overrides"]["cache_size"]: e for e in sweep if e["overrides"]["policy"] == "lru"}
    lfu = {e["overrides"]["cache_size"]: e for e in sweep if e["overrides"]["policy"] == "lfu"}
    return [(c, lru[c], lfu[c]) for c in sorted(set(lru) & set(lfu))]


def answer_rq2(sweep: list[dict[str, Any]]) -> str:
    pairs = [(c, a, b) for c, a, b in _policy_pairs(sweep)
             if metric(a, "cache_hit_rate") and metric(b, "cache_hit_rate")]
    if not pairs:
        return "No cache size was run with both policies."
    diffs = [100 * (metric(b, "cache_hit_rate") - metric(a, "cache_hit_rate")) for _, a, b in pairs]
    detail = ", ".join(
        f"{fmt_percent(c)}: LRU {100 * metric(a, 'cache_hit_rate'):.1f}% "
        f"vs LFU {100 * metric(b, 'cache_hit_rate'):.1f}%"
        for c, a, b in pairs
    )
    mean = statistics.fmean(diffs)
    winner = "LFU" if mean > 0 else "LRU"
    auc = [(c, paired_difference(b, a)) for c, a, b in pairs]
    auc = [(c, d) for c, d in auc if d]
    measurable = [(c, d) for c, d in auc if d["measurable"]]
    if not auc:
        auc_word = "no accuracy to compare"
    elif not measurable:
        largest = max((d["mean"] for _, d in auc), key=abs)
        auc_word = f"no measurable accuracy difference (largest LFU minus LRU: {largest:+.4f} AUC)"
    else:
        auc_word = "an accuracy difference at " + ", ".join(f"{fmt_percent(c)} ({d['mean']:+.4f} AUC, LFU minus LRU)"
                                                            for c, d in measurable)
    if auc and auc[0][1]["n"] == 1:
        auc_word += " (one seed: indicative only)"
    return (f"Hit rates ({detail}): {winner} is ahead by {abs(mean):.1f} points on average, with {auc_word}. "
            "With power-law ids both policies keep the head of the distribution; they differ on rows near "
            "the capacity boundary, which matters most for small caches.")


def answer_rq3(sweep: list[dict[str, Any]]) -> str:
    lru = sorted((e for e in sweep if e["overrides"]["policy"] == "lru"), key=lambda e: e["overrides"]["cache_size"])
    lru = [e for e in lru if metric(e, "cache_hit_rate") is not None]
    if len(lru) < 2:
        return "Fewer than two LRU cache sizes finished."
    lo, hi = lru[0], lru[-1]
    diffs = [paired_difference(e, lo) for e in lru[1:]]
    moved = [d for d in diffs if d and d["measurable"]]
    spread = max(abs(d["mean"]) for d in diffs if d) if any(diffs) else 0.0
    accuracy = (f"no cache size changes AUC measurably against the smallest (largest difference {spread:.4f})"
                if not moved else f"AUC moves by up to {spread:.4f} against the smallest cache")
    if any(d and d["n"] == 1 for d in diffs):
        accuracy += " (one seed: indicative only)"
    return (f"From {fmt_percent(lo['overrides']['cache_size'])} to {fmt_percent(hi['overrides']['cache_size'])} "
            "of rows (LRU), the "
            f"hit rate rises from {100 * metric(lo, 'cache_hit_rate'):.1f}% to "
            f"{100 * metric(hi, 'cache_hit_rate'):.1f}% while "
            f"the memory saving falls from {metric(lo, 'memory_ratio'):.2f}x to "
            f"{metric(hi, 'memory_ratio'):.2f}x (every "
            f"cached row costs an fp32 copy plus bookkeeping); {accuracy}. Past a few percent the cache buys "
            "traffic (RQ5), not accuracy.")


def answer_rq4(rq4: list[dict[str, Any]]) -> str:
    by = {(e["overrides"]["precision"], e["overrides"]["cache_size"], e["overrides"]["rounding"]): e for e in rq4}
    parts = []
    for (p, c, r), nearest in sorted(by.items()):
        stochastic = by.get((p, c, "stochastic"))
        diff = paired_difference(stochastic, nearest) if r == "nearest" and stochastic else None
        if diff:
            parts.append((p, c, diff))
    if not parts:
        return "**RQ4.** No rounding pair finished."
    words = [f"{p} {'no cache' if c == 0 else fmt_percent(c) + ' cache'}: stochastic {d['mean']:+.4f} AUC over nearest"
             f"{' (measurable)' if d['measurable'] else ''}" for p, c, d in parts]
    helped = [x for x in parts if x[2]["measurable"] and x[2]["mean"] > 0]
    return (f"**RQ4.** {'; '.join(words)}. Stochastic rounding is measurably better in {len(helped)} of "
            f"{len(parts)} cases. Nearest rounding loses updates smaller than half a quantization step, so it "
            "matters where rows are trained in storage (no cache), and most in int4; a cache trains hot rows in "
            "fp32 and rounds only on eviction, which shrinks the difference.")


def answer_rq5(rq5: list[dict[str, Any]]) -> str:
    cached = [e for e in rq5 if e["overrides"]["cache_size"] > 0 and metric(e, "bytes_moved_per_sample") is not None]
    if not cached:
        return "**RQ5.** No cached run reported its traffic."
    ratios = [(e, metric(e, "unified_bytes_per_sample") / max(metric(e, "bytes_moved_per_sample"), 1e-9))
              for e in cached]
    lo, hi = min(ratios, key=lambda x: x[1]), max(ratios, key=lambda x: x[1])
    rows = sorted(metric(e, "rows_moved_per_sample") for e in cached)
    span = (f"{lo[1]:.1f}x" if hi[1] < 1.05 * lo[1]
            else f"{lo[1]:.1f}x ({lo[0]['name']}) to {hi[1]:.1f}x ({hi[0]['name']})")
    moved = f"{rows[0]:.2f}" if rows[-1] - rows[0] < 0.005 else f"{rows[0]:.2f}-{rows[-1]:.2f}"
    text = (f"**RQ5.** With a cache, a training sample moves {moved} rows between storage and "
            f"cache instead of the 52 (26 each way) of a no-cache unified-memory design: {span} fewer bytes. "
            "Without a cache our own design already moves fewer rows than 52, because a batch fetches each "
            "distinct row once. ")
    steps = []
    for p in ("fp16", "int8", "int4"):
        nc = next((e for e in rq5 if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] == 0), None)
        c5 = next((e for e in rq5 if e["overrides"]["precision"] == p and e["overrides"]["cache_size"] == 0.05), None)
        if nc and c5 and metric(nc, "step_ms") and metric(c5, "step_ms"):
            steps.append(f"{p} {metric(nc, 'step_ms'):.1f} -> {metric(c5, 'step_ms'):.1f} ms")
    if steps:
        text += "Step time without -> with a 5% cache: " + ", ".join(steps) + ". "
    fractions = [metric(e, "bound_fraction") for e in rq5 if metric(e, "bound_fraction")]
    if fractions:
        text += (f"Measured throughput is {100 * min(fractions):.1f}-{100 * max(fractions):.1f}% of what the measured "
                 "random-gather rate would allow for the embedding traffic alone: the MLPs and per-step Python/"
                 "dispatch overhead, not memory, bound a step on this CPU.")
    return text.strip()


def paper_mixed_precision(by: dict[str, dict[str, Any]], table_sizes: list[int] | None) -> str:
    parts = []
    for key, name, claim in (("int8_5_memory_ratio", mp_name("int8", 0.05), "3x"),
                             ("int4_1_memory_ratio", mp_name("int4", 0.01), ">7x")):
        e = by.get(name)
        if not e or metric(e, "memory_ratio") is None:
            parts.append(f"{name}: not in this grid (paper: {claim}).")
            continue
        ratio = metric(e, "memory_ratio")
        verdict = "matches" if ratio >= PAPER[key] * 0.95 else "falls short of"
        text = f"{name}: {ratio:.2f}x less memory, which {verdict} the paper's {claim}"
        if table_sizes and verdict != "matches":
            o = e["overrides"]
            at64 = _dim_estimate(table_sizes, o["precision"], o["cache_size"], 64)
            if at64:
                text += (f"; at embedding dim 64 the same layout would give {at64:.2f}x (per-row quantization "
                         "parameters and fp32 cache rows weigh more at dim 16)")
        parts.append(text + ".")
    base, c5 = by.get(BASELINE), by.get(mp_name("int8", 0.05))
    if base and c5 and metric(base, "samples_per_s") and metric(c5, "samples_per_s"):
        speed = metric(c5, "samples_per_s") / metric(base, "samples_per_s")
        parts.append(
            f"Speed: int8 + 5% cache trains at {speed:.2f}x the fp32 baseline's throughput (paper: 1.16x). The "
            "paper's gain comes from fewer host-to-GPU transfers; here storage and cache share one CPU memory, so "
            "the saved traffic (RQ5) shows up as bytes, not as link time, and timings on this shared machine are "
            "noisy.")
    return " ".join(parts)
