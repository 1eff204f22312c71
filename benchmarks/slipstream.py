"""The Slipstream study (Maboud et al., arXiv 2404.04270): stale-input skipping against the same storage
without skipping, judged by time to a validation-AUC target from interleaved, timed repeats.

Layout, top to bottom: the grid (STALE_STORAGES x the settings dicts WARMUP_SETTINGS / KEEP_SETTINGS, named
by `stale_name`, built by `slipstream_grid`); time to target and timing over the repeats (`add_timing`);
plots; the report section (`slipstream_section`, `answer_skip`). A new control or setting is one entry in a
settings dict plus its variant in `slipstream_grid`; its name pairs it with the storage's run without skipping.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from benchmarks.paired import MIN_EFFECT
from benchmarks.render import fmt_mean_std, fmt_value, markdown_table, metric, save_figure
from benchmarks.runner import PAPER, Preset, Setup
from slipcache.plotting import pyplot, samples_axis

STALE_STORAGES = {
    "fp32": {"precision": "fp32", "cache_size": 0.0, "policy": "lru", "rounding": "stochastic"},
    "int8 + 5% cache": {"precision": "int8", "cache_size": 0.05, "policy": "lru", "rounding": "stochastic"},
}


def stale_name(group: str, target: float | None, rule: str = "convergence", warmup: str = "val",
               decision: str = "rolling", keep: str | None = None) -> str:
    """Readable setup name, e.g. 'fp32, convergence rule, warm-up val, D=0.5' (with `keep`, a KEEP_SETTINGS
    key, before D); also the key that pairs a setup with its storage's run without skipping (target None)."""
    if target is None:
        return f"{group}, no skipping"
    if decision == "epoch":
        return f"{group}, authors' mode ({rule} rule, warm-up {warmup}, one decision per epoch), D={target:g}"
    kept = f", {keep}" if keep else ""
    return f"{group}, {rule} rule, warm-up {warmup}{kept}, D={target:g}"


# Warm-up settings of the grid: "val" is the new default; "off" is the earlier behaviour (window at 2 % of
# every epoch, no floor), which the paper rule's published grid used.
WARMUP_SETTINGS = {"val": {"stale_warmup": "val"}, "off": {"stale_warmup": "none", "stale_warmup_min": 0.0}}
# Kept share p of the would-be-skipped inputs: a larger control group than the default 5 %.
KEEP_SETTINGS = {"keep 0.25": {"stale_keep": 0.25}}


def is_skipping(overrides: dict[str, Any]) -> bool:
    """Whether a recorded run skipped stale inputs (`skip_rule`; records written before it say `skip_stale`)."""
    return overrides.get("skip_rule") == "stale" or bool(overrides.get("skip_stale"))


def slipstream_grid(preset: Preset, seeds: int) -> list[Setup]:
    """Per storage: the run without skipping; D x staleness rule x warm-up; the authors' per-epoch mode.

    The quick grid spans D, the rule (paper vs convergence) and warm-up (validation loss vs off); the full
    grid keeps the settings that matter for the time-to-target question (see docs/skipping.md).
    """
    if preset.full_grid:
        variants = [(d, "convergence", "val", None) for d in (0.3, 0.5, 0.7)] + [
            (0.5, "convergence", "val", keep) for keep in KEEP_SETTINGS] + [
            (0.5, "paper", "val", None), (0.3, "paper", "off", None)]
    else:
        # D sweep of the new default; rule, warm-up and a larger control group each compared at D = 0.5
        variants = [(0.3, "convergence", "val", None), (0.5, "convergence", "val", None),
                    (0.5, "convergence", "val", "keep 0.25"), (0.5, "convergence", "off", None),
                    (0.5, "paper", "val", None), (0.5, "paper", "off", None)]
    setups = []
    for group, storage in STALE_STORAGES.items():
        base = dict(storage)
        setups.append(Setup("slipstream", stale_name(group, None), base, seeds, ["skip"], group))
        for target, rule, warmup, keep in variants:
            overrides = {**storage, "skip_rule": "stale", "stale_target": target, "stale_rule": rule,
                         **WARMUP_SETTINGS[warmup]}
            if keep:
                overrides.update(KEEP_SETTINGS[keep])
            setups.append(Setup("slipstream", stale_name(group, target, rule, warmup, keep=keep), overrides, seeds,
                                ["skip"], group))
        authors = {**storage, "skip_rule": "stale", "stale_target": 0.3, "stale_rule": "paper",
                   "stale_warmup": "epoch", "stale_decision": "epoch"}
        setups.append(Setup("slipstream", stale_name(group, 0.3, "paper", "epoch", "epoch"), authors, seeds,
                            ["skip"], group))
    return setups


def time_to_target(curve: list[list[float]] | list[tuple[float, float]], target: float) -> float | None:
    """Training seconds at which validation AUC first reaches `target`, linearly interpolated.

    Between the last evaluation below the target and the first at or above it; None if never reached.
    Reached at the first evaluation: its time (nothing earlier to interpolate from).
    """
    previous = None
    for seconds, auc in curve:
        if auc >= target:
            if previous is None:
                return float(seconds)
            t0, a0 = previous
            return float(t0 + (target - a0) / (auc - a0) * (seconds - t0))
        previous = (seconds, auc)
    return None


def auc_target(curve: list[list[float]] | list[tuple[float, float]], margin: float = 0.001) -> float | None:
    """The baseline's best validation AUC, taken as the mean of its last 3 evaluations, minus `margin`."""
    if not curve:
        return None
    last = [auc for _, auc in curve[-3:]]
    return statistics.fmean(last) - margin


def _spread(values: list[float]) -> dict[str, Any] | None:
    """Median with min and max: the timing summary (robust to one disturbed repeat)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "mean": statistics.median(values), "std": None}


def add_timing(entries: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Time to target and its speedup for every slipstream setup, from seed 0's interleaved repeats.

    Target: the same storage's run without skipping, its best validation AUC (mean of its last 3
    evaluations) minus 0.001. Per repeat r: speedup = baseline's time to target in repeat r / this setup's in
    repeat r, so both come from the same pass over the setups. Also the overhead split, as a share of the
    training loop's wall time, and the guard's actions.
    """
    by_setup: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        if r["experiment"] == "slipstream" and r["seed"] == 0:
            by_setup.setdefault(r["setup"], {})[int(r.get("repeat", 0))] = r
    for entry in entries:
        if entry["experiment"] != "slipstream":
            continue
        runs = by_setup.get(entry["name"], {})
        base = by_setup.get(stale_name(entry["group"], None), {})
        target = auc_target(base[0].get("curve", [])) if 0 in base else None
        m = entry["metrics"]
        m["target_auc"] = target
        # wall clock (the loop's), and process CPU time: one torch thread per run, so CPU time is what the
        # run itself spent, robust to other jobs on a shared machine
        for clock, prefix in (("curve", ""), ("cpu_curve", "cpu_")):
            times, speedups, missed = [], [], 0
            for repeat, record in sorted(runs.items()):
                t = time_to_target(record.get(clock) or [], target) if target is not None else None
                if t is None:
                    missed += 1
                    continue
                times.append(t)
                t_base = time_to_target(base[repeat].get(clock) or [], target) if repeat in base else None
                if t_base:
                    speedups.append(t_base / t)
            m[f"{prefix}time_to_target"] = _spread(times)
            m[f"{prefix}target_missed"] = missed
            m[f"{prefix}speedup"] = _spread(speedups)
        parts: dict[str, list[float]] = {}
        actions = []
        for r in (r for r in records if r["setup"] == entry["name"] and not r.get("repeat")):
            block = r["summary"].get("staleness") or {}
            wall = r["summary"].get("train_wall_s") or 0.0
            for part, seconds in (block.get("skip_overhead_parts_s") or {}).items():
                parts.setdefault(part, []).append(seconds / wall if wall else 0.0)
            actions += [{**a, "seed": r["seed"]} for a in block.get("guard_actions") or []]
        m["overhead_parts"] = {part: statistics.fmean(v) for part, v in parts.items()}
        m["overhead_share"] = sum(m["overhead_parts"].values()) if parts else None
        m["guard_actions"] = len(actions)
        entry["guard_action_list"] = actions


def _series(entry: dict[str, Any]) -> str:
    """A slipstream setup's name without its D: the line its D values are joined by."""
    return re.sub(r",? ?D=[0-9.]+$", "", entry["name"])


def plot_skip_speedup(entries: list[dict[str, Any]], path: Path) -> str | None:
    """Speedup to target (left, median with min-max, and the bound 1 / (1 - skipped)) and the test AUC
    change (right, paired seeds) against the share of inputs skipped; one line per storage, rule and warm-up.
    """
    plt = pyplot()
    skips = [e for e in entries if is_skipping(e["overrides"]) and metric(e, "skipped_fraction") is not None]
    if not skips:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab10")
    for k, series in enumerate(sorted({_series(e) for e in skips})):
        pts = sorted((e for e in skips if _series(e) == series), key=lambda e: metric(e, "skipped_fraction"))
        xs = [100 * metric(e, "skipped_fraction") for e in pts]
        style = {"color": colors(k % 10), "marker": "os^v"[k % 4], "capsize": 3, "label": series,
                 "linestyle": "-" if "int8" not in series else "--"}
        timed = [(x, e["metrics"]["speedup"]) for x, e in zip(xs, pts, strict=True) if e["metrics"].get("speedup")]
        if timed:
            left.errorbar([x for x, _ in timed], [t["median"] for _, t in timed],
                          yerr=[[t["median"] - t["min"] for _, t in timed], [t["max"] - t["median"] for _, t in timed]],
                          **style)
        right.errorbar(xs, [1e3 * (metric(e, "auc_delta") or 0.0) for e in pts],
                       yerr=[1e3 * (metric(e, "auc_delta", "std") or 0.0) for e in pts], **style)
    top = max(100 * metric(e, "skipped_fraction") for e in skips)
    grid = [top * i / 50 for i in range(51)]
    left.plot(grid, [1 / (1 - x / 100) for x in grid], ":", color="0.4", label="bound 1 / (1 - skipped)")
    left.axhline(1, color="0.3", linewidth=0.8)
    left.set_xlabel("inputs skipped (%)")
    left.set_ylabel("speedup to target AUC (median, min-max)")
    left.set_title("Time to the baseline's AUC - 0.001")
    right.axhline(0, color="0.3", linewidth=0.8)
    right.set_xlabel("inputs skipped (%)")
    right.set_ylabel("test AUC change vs no skipping (x 1e-3)")
    right.set_title("Accuracy cost at equal epochs")
    right.legend(fontsize=7)
    return save_figure(fig, path)


def plot_stale_rows(entries: list[dict[str, Any]], events: dict[str, list[dict[str, Any]]], path: Path) -> str | None:
    """Stale and hot rows (left) and the skipped fraction (right) over training, one row per storage."""
    plt = pyplot()
    groups = [g for g in STALE_STORAGES if any(events.get(e["name"]) for e in entries if e["group"] == g)]
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4 * len(groups)), squeeze=False)
    colors = plt.get_cmap("viridis")
    for (left, right), group in zip(axes, groups, strict=True):
        pts = [e for e in entries if e["group"] == group and is_skipping(e["overrides"])
               and e["overrides"].get("stale_rule") == "convergence"]
        pts.sort(key=lambda e: e["overrides"]["stale_target"])
        hot_drawn = False
        for k, e in enumerate(pts):
            ev = events.get(e["name"], [])
            color = colors(0.15 + 0.7 * k / max(len(pts) - 1, 1))
            label = e["name"].removeprefix(f"{group}, ")
            xs = [x["samples"] for x in ev if x.get("stale_rows") is not None]
            left.plot(xs, [x["stale_rows"] for x in ev if x.get("stale_rows") is not None], color=color,
                      label=f"stale rows, {label}")
            hot = [(x["samples"], x["hot_rows"]) for x in ev if x.get("hot_rows") is not None]
            if hot and not hot_drawn:
                left.plot(*zip(*hot, strict=True), color="0.5", linestyle="--", label="hot rows")
                hot_drawn = True
            skip = [(x["samples"], 100 * x["skipped_fraction"]) for x in ev if x.get("skipped_fraction") is not None]
            if skip:
                right.plot(*zip(*skip, strict=True), color=color, label=label)
        left.set_title(f"Hot and stale embedding rows ({group}, convergence rule)")
        left.set_ylabel("rows")
        right.set_title(f"Inputs skipped ({group}, convergence rule)")
        right.set_ylabel("skipped (% of inputs)")
        for ax in (left, right):
            samples_axis(ax)
            if ax.lines:
                ax.legend(fontsize=9)
    return save_figure(fig, path)


def _spread_text(stat: dict[str, Any] | None, fmt: str, unit: str = "") -> str:
    if not stat:
        return "n/a"
    return f"{format(stat['median'], fmt)}{unit} ({format(stat['min'], fmt)}-{format(stat['max'], fmt)})"


def _overhead_text(entry: dict[str, Any]) -> str:
    parts = entry["metrics"].get("overhead_parts") or {}
    if not parts:
        return "-"
    split = ", ".join(f"{k} {100 * v:.1f}" for k, v in parts.items() if v >= 0.0005)
    return f"{100 * entry['metrics']['overhead_share']:.1f}% ({split})"


def slipstream_section(entries: list[dict[str, Any]], plots: dict[str, str | None], repeats: int = 1,
                       threads: int = 1) -> list[str]:
    lines = ["## Slipstream: skipping stale inputs", ""]
    lines += [
        "Time to target: the training seconds (evaluation excluded) at which validation AUC first reaches the "
        "same storage's run without skipping, its best (mean of its last 3 evaluations) minus 0.001, "
        "interpolated linearly between evaluations (10 per epoch, each on the whole validation split). "
        f"Timing protocol: seed 0 of every setup ran {repeats} time(s), interleaved (every setup once, then "
        f"again: A B A B ...), {threads} torch thread(s) per run; medians with min-max over the repeats; "
        "speedup = baseline time / skipping time within the same repeat, by the loop's wall clock and by its "
        "process CPU time (robust to other jobs on the machine with one thread per run). Test AUC at equal "
        "epochs is paired by seed (mean +- std of the per-seed differences). Overhead: skipping's bookkeeping "
        "as a share of the training loop's wall time, split into its parts (%).", "",
    ]
    lines += markdown_table(
        ["setup", "seeds", "skipped", "test AUC", "ΔAUC vs no skipping", "time to target (s)", "speedup",
         "speedup (CPU time)", "overhead", "guard actions"],
        [[e["name"], str(e["seeds"]), fmt_mean_std(e, "skipped_fraction", 100, ".1f") + "%", fmt_mean_std(e, "auc"),
          fmt_mean_std(e, "auc_delta", sign=True),
          _spread_text(e["metrics"].get("time_to_target"), ".1f")
          + (f", missed {e['metrics']['target_missed']}x" if e["metrics"].get("target_missed") else ""),
          _spread_text(e["metrics"].get("speedup"), ".2f", "x"),
          _spread_text(e["metrics"].get("cpu_speedup"), ".2f", "x"),
          _overhead_text(e),
          str(e["metrics"].get("guard_actions", 0))] for e in entries],
    )
    acted = [(e["name"], a) for e in entries for a in e.get("guard_action_list", [])]
    if acted:
        lines += ["", "Guard actions (every one, from each run's summary.json):", ""]
        lines += [f"- {name}, seed {a.get('seed')}: epoch {a.get('epoch')}, batch {a.get('batch')}, "
                  f"{a.get('source', 'guard')}: {a.get('action')} (D now {fmt_value(a.get('target'), '.3g')}, "
                  f"drift {fmt_value(a.get('drift'), '+.4f')})" for name, a in acted]
    for key, alt in (("skip_speedup", "speedup vs skip ratio"), ("stale_rows", "stale and hot rows")):
        if plots.get(key):
            lines += ["", f"![{alt}]({plots[key]})"]
    lines += ["", answer_skip(entries), ""]
    return lines


def _skip_outcome(entry: dict[str, Any]) -> str:
    skipped = metric(entry, "skipped_fraction") or 0.0
    speed = entry["metrics"].get("speedup")
    return (f"{_series(entry).split(', ', 1)[-1]} at D={entry['overrides']['stale_target']:g} skipped "
            f"{100 * skipped:.0f}% of inputs for {_spread_text(speed, '.2f', 'x')} to target "
            f"(at most {1 / max(1 - skipped, 1e-9):.2f}x), ΔAUC {metric(entry, 'auc_delta') or 0:+.4f}")


def answer_skip(entries: list[dict[str, Any]]) -> str:
    skips = [e for e in entries if is_skipping(e["overrides"])]
    if not skips:
        return "**Skipping.** No skipping run finished."
    parts = []
    for group in STALE_STORAGES:
        runs = [e for e in skips if e["group"] == group]
        if runs:
            parts.append(f"{group}: " + "; ".join(_skip_outcome(e) for e in runs))
    text = "**Skipping.** " + ". ".join(parts) + ". "
    within = [e for e in skips if abs(metric(e, "auc_delta") or 0.0) <= MIN_EFFECT and e["metrics"].get("speedup")]
    goal = 1.25
    if within:
        best = max(within, key=lambda e: e["metrics"]["speedup"]["median"])
        reached = best["metrics"]["speedup"]["median"] >= goal
        text += (f"Best speedup to target at |ΔAUC| <= {MIN_EFFECT}: {best['metrics']['speedup']['median']:.2f}x "
                 f"({best['name']}); the goal of {goal}x is {'met' if reached else 'missed'}. ")
    else:
        text += f"No skipping setup stayed within {MIN_EFFECT} AUC with a measured time to target. "
    text += (f"Against the paper (Maboud et al.: {PAPER['skip_speedup_vs_xdl']:g}x vs XDL, "
             f"{PAPER['skip_speedup_vs_fae']:g}x vs FAE): their baselines are distributed trainers whose steps "
             "are dominated by embedding communication; here the reference is the same single-node trainer "
             "without skipping, so the gain is bounded by 1/(1 - skipped share) minus the bookkeeping overhead.")
    return text
