"""The bound each configuration of `slipcache bench embedding` is measured against: a per-access cost model.

An embedding step on a CPU is random memory accesses. The model lists those of one lookup for each kind of
configuration and prices each by the random-gather probe at its working-set size and row size (seconds per
access = 1 / rows per second of `probe_random_gather`), so the machine's caches, DRAM latency and TLB
reach enter through measurement, not assumptions. The ids are skewed: the share `hot` of accesses that go to
the rows that fit in half the last-level cache (L3; the other half for everything else) is priced at a
working set of that size, the rest at the structure's full size; `hot` is read from the workload's own
lookups (rows ranked by use). Cached rows are the hottest, so a cached structure gets the hot share of the
hits, and storage (read for misses, written for evictions) gets none. The bound is the samples/s at which
these accesses alone would take the whole step; a configuration's `fraction_of_bound` says how much of the
step is anything else (Python, autograd, arithmetic, accesses the model leaves out). Per lookup, with u the
share of lookups that are a step's first of their row (repeats of a row within a step find it in the CPU's
caches):

- a table without a cache (torch, FBGEMM): the forward gathers the row, the backward updates each row once:
  (1 + u) x row(table bytes, row bytes);
- ours without a cache: each distinct row is read from storage and written back: 2u x storage access;
- ours with a cache: the probe reads the set's tags and touches the slot's bookkeeping (last use, and the
  use count for LFU), the forward gathers the cached fp32 row, the backward updates it (once per distinct
  row); a missed row is read from storage (rows in), an evicted one read from the cache and written to
  storage (rows out): tags + bookkeeping + (1 + u) x cached row + rows_in x storage access
  + rows_out x (cached row + storage access), rows_in and rows_out per lookup as the run counted them.

Every configuration also streams what the layer hands on and gets back: the forward writes each bag's pooled
fp32 row (dim x 4 bytes) and the backward reads the gradient of it, whatever the tables' precision. At one id
per bag (the bench's workload) that is 2 x dim x 4 bytes per lookup, 512 at dim 64: more than an int8 row's
accesses. The model prices it as one sequential copy of dim x 4 bytes per bag (the copy probe: a byte read
and a byte written), the "output and gradient" term; the least those bytes can cost (a store that
allocates its line costs more), so the bound stays a bound.

A storage access of an int8/int4 row is three: its payload, its fp16 bias and its scale code live in three
arrays.

Beside the time, the model counts the 64-byte lines each lookup touches (`lines_per_lookup`, by the same
terms: a row of b bytes is ceil(b / 64) lines, as the tables are 64-byte aligned and their rows a multiple
or divisor of 64 bytes at the usual dims; a row read and written again counts once). With a cache: the probe
reads one line of tags per set of 16 int32 ways (ways x tag bytes / 64), a hit writes its last use (one line,
and one more for LFU's use count, a second array); that is the least this layout allows, as a set's tags and
its 16 last uses are 64 bytes each.

Working sets above `max_probe_bytes` are probed at that size (what it leaves out is the page walks of larger
sets, so the bound is optimistic there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipcache.bench.machine import probe_random_gather

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}
_PARAM_BYTES = {"int8": (2, 1), "int4": (2, 1)}  # fp16 bias, uint8 scale code


def last_level_cache_bytes() -> int:
    """The largest CPU cache (L3 on most machines) from sysfs; 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else 32 << 20


class Popularity:
    """Share of a workload's lookups that go to its k most used rows (the rows ranked by use)."""

    def __init__(self, batches: torch.Tensor, table_sizes: list[int]) -> None:
        offsets = torch.tensor([0, *torch.tensor(table_sizes).cumsum(0).tolist()[:-1]])
        _, counts = torch.unique((batches + offsets).reshape(-1), return_counts=True)
        cumulative = torch.sort(counts, descending=True).values.cumsum(0).double()
        self.shares = cumulative / max(1.0, float(cumulative[-1])) if cumulative.numel() else cumulative

    def top(self, rows: float) -> float:
        """Share of lookups to the `rows` most used rows."""
        k = int(rows)
        if k <= 0 or not self.shares.numel():
            return 0.0
        return float(self.shares[min(k, self.shares.numel()) - 1])


def unique_share(batches: torch.Tensor, table_sizes: list[int]) -> float:
    """Share of a step's lookups that are the first of their row in that step (u), over `batches` [S, B, T]."""
    offsets = torch.tensor([0, *torch.tensor(table_sizes).cumsum(0).tolist()[:-1]])
    shares = [torch.unique(b + offsets).numel() / b.numel() for b in batches]
    return sum(shares) / len(shares) if shares else 1.0


class AccessCosts:
    """Seconds per random access, probed once per (working-set size, row size) and reused."""

    def __init__(
        self,
        seconds: float,
        max_probe_bytes: int,
        probe: Callable[..., dict[str, float]] = probe_random_gather,
        cache_bytes: int | None = None,
        copy_bytes_per_s: float | None = None,
    ):
        """`copy_bytes_per_s`: the sequential copy probe's bytes copied per second, which prices the output
        and its gradient (None: that term is left out)."""
        self.seconds, self.max_probe_bytes, self.probe = seconds, max_probe_bytes, probe
        self.copy_bytes_per_s = copy_bytes_per_s
        self.cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
        self.measured: dict[tuple[int, int], float] = {}

    def skewed(self, working_set: float, row_bytes: float, hot: float) -> float:
        """Cost of an access that goes to the hottest rows (those in half the L3) with probability `hot`."""
        near = min(working_set, self.cache_bytes / 2)
        return hot * self(near, row_bytes) + (1 - hot) * self(working_set, row_bytes)

    def __call__(self, working_set: float, row_bytes: float) -> float:
        row = max(4, 4 * math.ceil(row_bytes / 4))  # the probe gathers fp32 rows
        size = min(self.max_probe_bytes, max(row, 1 << round(math.log2(max(working_set, row)))))
        key = (size, row)
        if key not in self.measured:
            result = self.probe(table_bytes=size, row_bytes=row, batch_rows=1 << 18, seconds=self.seconds)
            self.measured[key] = 1.0 / result["rows_per_s"]
        return self.measured[key]

    def describe(self) -> list[dict[str, float]]:
        return [
            {"working_set_bytes": size, "row_bytes": row, "ns_per_access": seconds * 1e9}
            for (size, row), seconds in sorted(self.measured.items())
        ]


def lookup_terms(
    row: dict[str, Any], rows: int, u: float, costs: AccessCosts, popularity: Popularity, bags_per_lookup: float = 1.0
) -> dict[str, float] | None:
    """Seconds per lookup of each access the model counts for this measured configuration (None: no model)."""
    terms = _row_terms(row, rows, u, costs, popularity)
    if terms is not None and costs.copy_bytes_per_s:
        terms["output and gradient"] = bags_per_lookup * row["dim"] * 4 / costs.copy_bytes_per_s
    return terms


def _row_terms(
    row: dict[str, Any], rows: int, u: float, costs: AccessCosts, popularity: Popularity
) -> dict[str, float] | None:
    """`lookup_terms` of the rows' random accesses."""
    dim, precision = row["dim"], row["precision"]
    near = costs.cache_bytes / 2

    def hot(row_bytes: float) -> float:  # share of lookups to the rows that fit in half the L3
        return popularity.top(near / max(row_bytes, 64))

    if row["impl"] in ("torch", "fbgemm"):
        width = dim * _ELEMENT_BYTES[precision]
        return {"table row": (1 + u) * costs.skewed(rows * width, width, hot(width))}
    if row["impl"] != "slipcache" or precision not in _ELEMENT_BYTES:
        return None
    payload = math.ceil(dim * _ELEMENT_BYTES[precision])
    storage = costs(rows * payload, payload)  # misses and evictions: cold rows
    for param in _PARAM_BYTES.get(precision, ()):
        storage += costs(rows * param, param)
    lookups = row.get("lookups") or 0
    rows_in = (row.get("rows_in") or 0) / lookups if lookups else u
    rows_out = (row.get("rows_out") or 0) / lookups if lookups else u
    if not row["cache_fraction"]:
        return {"storage read": rows_in * storage, "storage write": rows_out * storage}
    slots = max(1, round(row["cache_fraction"] * rows))
    hits = row.get("hit_rate") or 0.0
    cached_hot = min(hot(dim * 4), hits) / hits if hits else 0.0
    cached = costs.skewed(slots * dim * 4, dim * 4, cached_hot)
    line = hot(64)  # tags (one 64-byte set) and bookkeeping lines of the hottest rows
    bookkeeping = costs.skewed(slots * 4, 4, line) * (2 if row.get("policy") == "lfu" else 1)
    return {
        "tags": costs.skewed(slots * 4, 64, line),
        "bookkeeping": bookkeeping,
        "cached row": (1 + u) * cached,
        "miss fill": rows_in * storage,
        "write-back": rows_out * (costs(slots * dim * 4, dim * 4) + storage),
    }


def _lines(row_bytes: float) -> int:
    """64-byte lines of one row (aligned)."""
    return max(1, math.ceil(row_bytes / 64))


def lookup_lines(
    row: dict[str, Any], u: float, ways: int = 16, bags_per_lookup: float | None = 1.0
) -> dict[str, float] | None:
    """Lines touched per lookup by each term of `lookup_terms` (None: no model); `bags_per_lookup` None leaves
    the output and its gradient out (as `lookup_terms` does without a copy price)."""
    lines = _row_lines(row, u, ways)
    if lines is not None and bags_per_lookup is not None:
        lines["output and gradient"] = bags_per_lookup * 2 * _lines(row["dim"] * 4)
    return lines


def _row_lines(row: dict[str, Any], u: float, ways: int) -> dict[str, float] | None:
    """`lookup_lines` of the rows' random accesses."""
    dim, precision = row["dim"], row["precision"]
    if row["impl"] in ("torch", "fbgemm"):
        return {"table row": (1 + u) * _lines(dim * _ELEMENT_BYTES[precision])}
    if row["impl"] != "slipcache" or precision not in _ELEMENT_BYTES:
        return None
    storage = _lines(math.ceil(dim * _ELEMENT_BYTES[precision])) + len(_PARAM_BYTES.get(precision, ()))
    lookups = row.get("lookups") or 0
    rows_in = (row.get("rows_in") or 0) / lookups if lookups else u
    rows_out = (row.get("rows_out") or 0) / lookups if lookups else u
    if not row["cache_fraction"]:
        return {"storage read": rows_in * storage, "storage write": rows_out * storage}
    hits = row.get("hit_rate") or 0.0
    cached = _lines(dim * 4)
    return {
        "tags": float(_lines(ways * 4)),
        "bookkeeping": hits * (2 if row.get("policy") == "lfu" else 1),
        "cached row": (1 + u) * cached,
        "miss fill": rows_in * (storage + cached),
        "write-back": rows_out * (cached + storage),
    }


def attach_bounds(
    rows: list[dict[str, Any]],
    table_sizes: list[int],
    u: float,
    costs: AccessCosts,
    popularity: Popularity,
    bags_per_lookup: float = 1.0,
) -> None:
    """Add `bound_samples_per_s`, `fraction_of_bound`, `bound_ns_per_lookup` and `lines_per_lookup` (by term)
    to measured rows. `bags_per_lookup`: pooled outputs per lookup (1: one id per bag, the bench's workload)."""
    lookups_per_sample = len(table_sizes)
    for row in rows:
        row["bound_samples_per_s"] = row["fraction_of_bound"] = row["bound_ns_per_lookup"] = None
        if not str(row.get("status", "")).startswith("ok") or not row.get("samples_per_s"):
            continue
        terms = lookup_terms(row, sum(table_sizes), u, costs, popularity, bags_per_lookup)
        if not terms:
            continue
        per_lookup = sum(terms.values())
        row["bound_ns_per_lookup"] = {name: seconds * 1e9 for name, seconds in terms.items()}
        lines = lookup_lines(row, u, bags_per_lookup=bags_per_lookup if costs.copy_bytes_per_s else None)
        if lines:
            row["lines_per_lookup"] = {**lines, "total": sum(lines.values())}
        row["bound_samples_per_s"] = 1.0 / (lookups_per_sample * per_lookup)
        row["fraction_of_bound"] = row["samples_per_s"] / row["bound_samples_per_s"]
