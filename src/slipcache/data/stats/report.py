"""`compute_stats`'s result as text (`format_stats`) and as a PNG (`plot_stats`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.plotting import STYLE, pyplot


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_stats(stats: dict[str, Any]) -> str:
    """A readable report of `compute_stats`'s result."""
    src = stats["source"]
    lines = [f"source: {src.get('path', src['kind'])} ({src['kind']})"]
    if "bad_lines" in src:
        formats = ", ".join(sorted(set(src["formats"].values())))
        lines.append(
            f"  lines: {src['good_lines']} good, {src['bad_lines']} malformed (skipped); format {formats}"
        )
        lines.extend(f"    {example}" for example in src["bad_examples"])
    if src.get("splits"):
        lines.append("  splits: " + ", ".join(f"{k} {v}" for k, v in src["splits"].items()))
    lines.append(f"  missing categorical: {src['missing']}")
    rows = f"rows: {stats['rows']:,}"
    if stats["positive_rate"] is not None:
        rows += f", positive rate {stats['positive_rate']:.4f}"
    lines += [rows, ""]
    fractions = list(stats["tables"][0]["top_share"])
    header = f"{'table':>5} {'distinct':>10} {'missing':>7} " + " ".join(f"{'top' + f:>7}" for f in fractions)
    header += f" {'recur':>6} {'single':>6} {'zipf s':>6}"
    lines.append(header)
    big = set(stats["big_tables"])
    for table in stats["tables"]:
        mark = "*" if table["name"] in big else " "
        line = f"{mark}{table['name']:>4} {table['distinct']:>10,.0f} {_num(table['missing_rate']):>7} "
        line += " ".join(f"{_num(table['top_share'][f]):>7}" for f in fractions)
        line += f" {_num(table['recur_share']):>6} {_num(table['singleton_share']):>6}"
        line += f" {_num(table['power_law_exponent'], 2):>6}"
        lines.append(line)
    lines.append(
        "  top x%: share of lookups on the top x% of values; recur: share of rows whose value occurs >= 2 times;"
    )
    lines.append(
        "  single: share of values seen once; zipf s: count ~ rank^-s over recurring values; * big table"
    )
    co = stats["co_recurrence"]
    corr = stats["recurrence_correlation"]
    lines += [
        "",
        f"big tables {', '.join(stats['big_tables'])}: all recur in {_num(co['all_recur'])} of rows; "
        f"if independent {_num(co['independent'])}" + (f" (x{co['ratio']:.1f})" if co["ratio"] else ""),
        f"correlation of recurrence between big tables: mean {_num(corr['big_tables_mean'])}, "
        f"min {_num(corr['big_tables_min'])}",
        "hot inputs (all lookups among the top rows by count; dim 16 fp32):",
    ]
    for entry in stats["hot_inputs"] + stats["hot_inputs_by_fraction"]:
        budget = (
            f"{entry['budget_mb']:>6g} MB"
            if "budget_mb" in entry
            else f"{entry['budget_fraction'] * 100:>5g}% of values"
        )
        lines.append(
            f"  {budget} = {entry['hot_rows']:>10,} rows: hot inputs {entry['hot_input_share']:.3f}, "
            f"hot lookups {entry['hot_lookup_share']:.3f} (count threshold {entry['count_threshold']})"
        )
    time = stats["over_time"]
    chunks = time["chunks"]
    lines.append(
        f"over time ({len(chunks)} chunks of {stats['settings']['chunk_rows']:,} rows, in read order):"
    )
    if len(chunks) < 2:
        lines.append("  one chunk only: no over-time figures (use a smaller --chunk-rows)")
    else:
        lines.append(
            f"  new-id rate after the first chunk: mean {_num(time['new_id_rate_mean'])}, last "
            f"{_num(time['new_id_rate_last'])} (big tables {_num(time['new_id_rate_big_tables_mean'])})"
        )
        lines.append(
            f"  top-{stats['settings']['top_k']} overlap of consecutive chunks, big tables: "
            f"mean {_num(time['top_overlap_big_tables_mean'])}"
        )
    exact = stats["exact"]
    approximate = [k for k, v in exact.items() if v is False]
    if approximate:
        lines.append(
            f"approximate: {', '.join(approximate)} (per-row figures on {stats['settings']['rows_sampled']:,} "
            f"sampled rows, standard error <= {exact['sample_standard_error']:.4f})"
        )
    else:
        lines.append("all figures exact")
    if stats.get("ceiling"):
        ceiling = stats["ceiling"]
        coverage = ", ".join(f"k = {k}: {v:.4f}" for k, v in ceiling["coverage_auc"].items())
        lines.append(
            f"ceiling on the test split ({ceiling['test_rows']:,} rows): teacher AUC {ceiling['teacher_auc']:.4f}; "
            f"without the values seen < k times in training: {coverage}"
        )
    return "\n".join(lines)


def plot_stats(stats: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """A PNG of the rank-frequency curves, per-table shares, recurrence correlation, hot inputs and time."""
    plt = pyplot()
    out = Path(path)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
        ax = axes[0, 0]
        big = set(stats["big_tables"])
        for table in stats["tables"]:
            curve = np.array(table["rank_frequency"], dtype=float)
            if len(curve):
                ax.loglog(curve[:, 0], curve[:, 1], lw=2 if table["name"] in big else 0.7,
                          label=table["name"] if table["name"] in big else None)  # fmt: skip
        ax.set(xlabel="rank", ylabel="count", title="value counts by rank (bold: big tables)")
        ax.legend()

        ax = axes[0, 1]
        x = np.arange(len(stats["tables"]))
        ax.bar(x - 0.2, [t["recur_share"] for t in stats["tables"]], 0.4, label="rows whose value recurs")
        ax.bar(
            x + 0.2, [t["top_share"]["1%"] for t in stats["tables"]], 0.4, label="lookups on top 1% of values"
        )
        ax.set_xticks(x, [t["name"] for t in stats["tables"]], rotation=90)
        ax.set(ylim=(0, 1.05), title="per table")
        ax.legend()

        ax = axes[0, 2]
        matrix = np.array(
            [[np.nan if v is None else v for v in row] for row in stats["recurrence_correlation"]["matrix"]]
        )
        image = ax.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu_r")
        names = stats["recurrence_correlation"]["tables"]
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title("correlation of recurrence")
        ax.grid(False)
        fig.colorbar(image, ax=ax, shrink=0.8)

        ax = axes[1, 0]
        co = stats["co_recurrence"]
        ax.bar(
            ["all big tables recur", "if independent"],
            [co["all_recur"], co["independent"]],
            color=["C0", "C7"],
        )
        ax.set(ylim=(0, 1), title=f"co-recurrence of {', '.join(stats['big_tables'])}")

        ax = axes[1, 1]
        hot = sorted(stats["hot_inputs"] + stats["hot_inputs_by_fraction"], key=lambda h: h["hot_rows"])
        hot_rows = [max(h["hot_rows"], 1) for h in hot]
        ax.semilogx(hot_rows, [h["hot_input_share"] for h in hot], "o-", label="hot inputs")
        ax.semilogx(hot_rows, [h["hot_lookup_share"] for h in hot], "s--", label="hot lookups")
        for h, x in zip(hot, hot_rows, strict=True):
            tag = f"{h['budget_mb']:g} MB" if "budget_mb" in h else f"{h['budget_fraction']:.0%}"
            ax.annotate(
                tag, (x, h["hot_input_share"]), textcoords="offset points", xytext=(4, -12), fontsize=8
            )
        ax.set(
            xlabel="hot rows (budget in MB at dim 16 fp32, or % of values)",
            ylim=(0, 1.05),
            title="hot inputs",
        )
        ax.legend()

        ax = axes[1, 2]
        chunks = stats["over_time"]["chunks"][1:]
        if chunks:
            starts = [c["start"] for c in chunks]
            ax.plot(starts, [c["new_id_rate"] for c in chunks], "o-", label="new-id rate (all tables)")
            ax.plot(
                starts,
                [c["top_overlap_big_tables"] for c in chunks],
                "s-",
                label="top-row overlap (big tables)",
            )
            ax.legend()
        else:
            ax.text(0.5, 0.5, "one chunk only", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="first row of chunk", ylim=(0, 1.05), title="over time")
        fig.suptitle(f"{stats['source'].get('path', stats['source']['kind'])}: {stats['rows']:,} rows")
        fig.tight_layout()
        fig.savefig(out)
        plt.close(fig)
    return out
