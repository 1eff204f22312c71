"""What every plot of the package shares: pyplot on a file-only backend, one style, the samples axis."""

from __future__ import annotations

from typing import Any

STYLE = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 110,
}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: plots are files, never a window, and matplotlib (slow to
    import) loads only when something is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def samples_axis(ax: Any) -> None:
    """Sample counts in thousands or millions instead of matplotlib's 1e6 offset label."""
    from matplotlib.ticker import FuncFormatter

    def fmt(x: float, _pos: int) -> str:
        if abs(x) >= 1e6:
            return f"{x / 1e6:g}M"
        if abs(x) >= 1e3:
            return f"{x / 1e3:g}k"
        return f"{x:g}"

    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.set_xlabel("training samples seen")
