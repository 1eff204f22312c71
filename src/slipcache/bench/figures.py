"""What the small benches (`bench disk`, `bench quantize`) share: a figure measured over rounds, printed as
its median and range (one number hides how much a loaded machine moved it), and the optional JSON file."""

from __future__ import annotations

import json
import statistics
from typing import Any


def median_range(values: list[float], unit: str, spec: str = ".0f", width: int = 0) -> str:
    """`median unit (min-max)`, e.g. ` 1,234 reads/s (1,100-1,300)`; the median padded to `width`."""
    median, low, high = statistics.median(values), min(values), max(values)
    pad = str(width) if width else ""
    return f"{median:{pad}{spec}} {unit} ({low:{spec}}-{high:{spec}})"


def write_result(path: str | None, result: dict[str, Any]) -> None:
    """The bench's figures as JSON at `path` (`--json`); nothing when it is not given."""
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
