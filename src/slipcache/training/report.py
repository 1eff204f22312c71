"""The run report: `report.md` with PNG plots, written at the end of `slipcache train`.

Input is what the run already wrote: the events of `metrics.jsonl` (one dict per logging/evaluation
point, all with `samples`) and the summary dict. Plots appear only for series the run recorded, so a
baseline run (no cache) gets no hit-rate plot and a run without stale-input skipping no staleness plot.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from slipcache.plotting import STYLE, pyplot, samples_axis
from slipcache.safe_files import write_atomic
from slipcache.training.settings import change_lines

plt = pyplot()


def _series(events: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(e["samples"], e[key]) for e in events if e.get(key) is not None]
    points = [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    return [x for x, _ in points], [float(y) for _, y in points]


def _save(fig: Figure, path: Path) -> str:
    """The figure into `path`, replaced atomically (a link there is replaced, its target never written)."""
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    write_atomic(path, image.getvalue())
    return path.name


def plot_training(events: list[dict[str, Any]], path: Path) -> str | None:
    """Train loss (left) and validation AUC (right) against samples."""
    loss_x, loss_y = _series(events, "train_loss")
    auc_x, auc_y = _series(events, "val_auc")
    if not loss_x and not auc_x:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(loss_x, loss_y, color="tab:blue", alpha=0.3, linewidth=1.0, label="per logging window")
    if len(loss_y) >= 10:  # a moving average shows the trend through the per-window noise
        k = max(3, len(loss_y) // 15)
        smooth = np.convolve(loss_y, np.ones(k) / k, mode="valid")
        left.plot(loss_x[k - 1 :], smooth, color="tab:blue", linewidth=2.0, label=f"mean of {k} windows")
        left.legend()
    left.set_title("Training loss")
    left.set_ylabel("binary cross-entropy (nats)")
    samples_axis(left)
    right.plot(auc_x, auc_y, color="tab:green", marker="o", markersize=4, linewidth=1.5)
    right.set_title("Validation AUC")
    right.set_ylabel("ROC AUC")
    samples_axis(right)
    return _save(fig, path)


def plot_hit_rate(events: list[dict[str, Any]], path: Path) -> str | None:
    """Cache hit rate per logging window; none for collections without a cache."""
    x, y = _series(events, "hit_rate")
    if not x:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    percent = [100 * v for v in y]
    ax.plot(x, percent, color="tab:purple", linewidth=1.5)
    ax.set_title("Embedding cache hit rate during training")
    ax.set_ylabel("hit rate (% of lookups)")
    ax.set_ylim(max(0.0, 10 * math.floor(min(percent) / 10) - 5), 100)
    samples_axis(ax)
    return _save(fig, path)


def _mib(n: float) -> float:
    return n / 2**20


def plot_memory(summary: dict[str, Any], path: Path) -> str | None:
    """Stacked bar of the embedding memory components next to the same tables in fp32."""
    components = summary.get("memory_components") or {}
    fp32 = summary.get("fp32_embedding_bytes")
    if not components or not fp32:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = 0.0
    colors = plt.get_cmap("tab10").colors
    for i, (name, size) in enumerate(components.items()):
        if size <= 0:
            continue
        label = f"{name.replace('_', ' ')}: {_mib(size):.2f} MiB"
        ax.bar(0, _mib(size), bottom=bottom, color=colors[i % 10], width=0.55, label=label)
        bottom += _mib(size)
    ax.bar(1, _mib(fp32), color="0.6", width=0.55, label=f"fp32 tables: {_mib(fp32):.2f} MiB")
    # memory_ratio is fp32 bytes / our bytes (docs/design.md): how many times smaller.
    ratio = summary.get("memory_ratio") or _mib(fp32) / max(bottom, 1e-12)
    ax.text(0, bottom, f"{bottom:.2f} MiB\n({ratio:.2f}x smaller)", ha="center", va="bottom")
    ax.text(1, _mib(fp32), f"{_mib(fp32):.2f} MiB", ha="center", va="bottom")
    config = summary.get("config", {})
    label = "this run (fp32)" if config.get("embeddings") == "torch" else f"{config.get('precision', '')} + cache"
    ax.set_xticks([0, 1], [label, "fp32 tables"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(0, max(bottom, _mib(fp32)) * 1.2)
    ax.set_ylabel("embedding memory (MiB)")
    ax.set_title("Embedding memory by component")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    ax.grid(axis="x", visible=False)
    return _save(fig, path)


def plot_staleness(events: list[dict[str, Any]], path: Path) -> str | None:
    """Skipped input fraction (left) and stale/hot row counts (right), when the run skipped stale inputs."""
    skip_x, skip_y = _series(events, "skipped_fraction")
    stale_x, stale_y = _series(events, "stale_rows")
    hot_x, hot_y = _series(events, "hot_rows")
    if not skip_x and not stale_x:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(skip_x, [100 * v for v in skip_y], color="tab:orange", linewidth=1.5)
    left.set_title("Inputs skipped as stale")
    left.set_ylabel("skipped (% of inputs)")
    samples_axis(left)
    right.plot(stale_x, stale_y, color="tab:red", linewidth=1.5, label="stale rows")
    if hot_x:
        right.plot(hot_x, hot_y, color="0.5", linestyle="--", linewidth=1.2, label="hot rows")
    right.set_title("Stale embedding rows")
    right.set_ylabel("rows")
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    right.legend()
    samples_axis(right)
    return _save(fig, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "n/a" if value is None else str(value)


def write_report(run_dir: str | Path, events: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
    """Write `report.md` and its PNGs into `run_dir`; returns the report path."""
    run_dir = Path(run_dir)
    config = summary.get("config", {})
    skipping = bool(summary.get("staleness") or config.get("skip_rule"))  # every event has a skipped share
    with plt.rc_context(STYLE):
        plots = {
            "Training": plot_training(events, run_dir / "training.png"),
            "Cache hit rate": plot_hit_rate(events, run_dir / "hit_rate.png"),
            "Memory": plot_memory(summary, run_dir / "memory.png"),
            "Stale-input skipping": plot_staleness(events, run_dir / "staleness.png") if skipping else None,
        }
    lines = ["# slipcache training run", ""]
    setup = f"`{config.get('embeddings', '?')}` embeddings"
    if config.get("embeddings") != "torch":
        setup += (
            f", {config.get('precision')} storage, cache {config.get('cache_size')} ({config.get('policy')}), "
            f"{config.get('rounding')} rounding"
        )
    lines += [f"{setup}; optimizer {config.get('optimizer')}, lr {config.get('lr')}, "
              f"batch {config.get('batch_size')}, seed {config.get('seed')}.", ""]
    lines += ["| metric | value |", "|---|---|"]
    rows = [
        ("test AUC", summary.get("auc")),
        ("test log loss", summary.get("logloss")),
        ("test accuracy", summary.get("accuracy")),
        ("test normalized entropy", summary.get("normalized_entropy")),
        ("training samples", summary.get("train_samples")),
        ("throughput (samples/s)", summary.get("samples_per_s")),
        ("training time (s)", summary.get("train_wall_s")),
        ("cache hit rate", summary.get("cache_hit_rate")),
        ("embedding bytes", summary.get("embedding_bytes")),
        ("fp32 embedding bytes", summary.get("fp32_embedding_bytes")),
        ("memory ratio (fp32 bytes / ours)", summary.get("memory_ratio")),
        ("skipped fraction", summary.get("skipped_fraction")),
    ]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in rows]
    lines.append("")
    quality = summary.get("data_quality")
    if quality and quality["malformed_lines"]:
        total = quality["good_lines"] + quality["malformed_lines"]
        lines += ["## Malformed input lines", "",
                  f"{quality['malformed_lines']:,} of {total:,} lines were malformed and skipped. The first:", ""]
        lines += [f"- `{example}`" for example in quality["examples"]] + [""]
    history = config.get("changed_on_resume") or []
    if history:  # --allow-changes: the settings above are the final ones; these are what they were before
        lines += ["## Settings changed on resume", "",
                  "The run was resumed with other settings (`--allow-changes`); the config below shows the final "
                  "ones. Each change took effect from the sample given:", ""]
        lines += [f"- {line}" for entry in history for line in change_lines(entry)]
        if any("data_fingerprint" in entry.get("changes", {}) for entry in history):
            lines.append("- the dataset changed (its content differs from the data trained before), at sample "
                         + ", ".join(f"{int(e.get('samples') or 0):,}" for e in history
                                     if "data_fingerprint" in e.get("changes", {})))
        lines.append("")
    for title, name in plots.items():
        if name and (run_dir / name).is_file():  # a link only to a plot on disk
            lines += [f"## {title}", "", f"![{title}]({name})", ""]
    lines += ["## Config", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    path = run_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path
