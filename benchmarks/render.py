"""Formatting and plotting helpers shared by the studies' report sections."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from slipcache.plotting import pyplot


def fmt_percent(fraction: float) -> str:
    """0.05 -> '5%' (setup names and labels; no trailing zeros)."""
    return f"{100 * fraction:g}%"


def save_figure(fig: Any, path: Path) -> str:
    """Save and close `fig`; returns the file name, which the report links relative to itself."""
    from matplotlib.legend import Legend

    fig.tight_layout()
    # every legend counts for the tight box, also one kept with add_artist (outside legends stay visible)
    legends = [a for ax in fig.axes for a in ax.get_children() if isinstance(a, Legend)]
    fig.savefig(path, bbox_inches="tight", bbox_extra_artists=legends)
    pyplot().close(fig)
    return path.name


def metric(entry: dict[str, Any], key: str, part: str = "mean") -> float | None:
    """One statistic of an aggregated setup entry; None when no seed measured it."""
    stat = entry["metrics"].get(key)
    return stat[part] if stat else None


def mib(n: float) -> float:
    """Bytes in MiB, the unit of the report's memory columns and axes."""
    return n / 2**20


PRECISION_COLORS = {"fp32": "tab:gray", "fp16": "tab:blue", "bf16": "tab:cyan", "int8": "tab:green",
                    "int4": "tab:red"}  # fmt: skip
CACHE_MARKERS = {0.0: "o", 0.005: "v", 0.01: "s", 0.02: "P", 0.05: "^", 0.10: "D", 0.20: "X"}


def fmt_value(x: float | None, fmt: str = ".4f") -> str:
    """A number for a table cell: 'n/a' for missing or non-finite values instead of crashing the report."""
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def fmt_mean_std(entry: dict[str, Any], key: str, scale: float = 1.0, fmt: str = ".4f", sign: bool = False) -> str:
    """'mean ± std' over seeds; the mean alone for one seed, where a std would claim a spread never seen."""
    stat = entry["metrics"].get(key)
    if not stat:
        return "n/a"
    mean = format(stat["mean"] * scale, ("+" if sign else "") + fmt)
    return f"{mean} ± {format(stat['std'] * scale, fmt)}" if stat["n"] > 1 else mean


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table as lines of the report."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
