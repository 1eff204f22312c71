"""The report of `slipcache bench embedding`: ratios to FBGEMM fp32, the targets, and the text and markdown
tables of throughput, memory and the phase profile.
"""

from __future__ import annotations

import sys
from typing import Any

from slipcache.bench.timing import GB


def _attach_ratios(rows: list[dict[str, Any]]) -> None:
    """samples/s (and samples per CPU second) over FBGEMM fp32's at the same dim (None where that row did not
    run)."""
    base = {
        r["dim"]: r["samples_per_s"]
        for r in rows
        if r["name"] == "fbgemm-fp32" and r["status"] == "ok" and r["samples_per_s"]
    }
    cpu_base = {
        r["dim"]: r.get("samples_per_cpu_s")
        for r in rows
        if r["name"] == "fbgemm-fp32" and r["status"] == "ok" and r.get("samples_per_cpu_s")
    }
    for r in rows:
        ref = base.get(r["dim"])
        r["ratio_vs_fbgemm_fp32"] = r["samples_per_s"] / ref if ref and r["samples_per_s"] else None
        cpu_ref, cpu = cpu_base.get(r["dim"]), r.get("samples_per_cpu_s")
        r["ratio_vs_fbgemm_fp32_cpu"] = cpu / cpu_ref if cpu_ref and cpu else None


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The memory and throughput targets, each PASS, MISS or N/A (not measured in this run)."""
    by = {(r["name"], r["dim"]): r for r in rows}
    out: list[dict[str, Any]] = []

    def add(target: str, value: float | None, threshold: float, unit: str) -> None:
        result = "N/A" if value is None else ("PASS" if value >= threshold else "MISS")
        out.append({"target": target, "value": value, "threshold": threshold, "unit": unit, "result": result})

    for name in ("slipcache-int8-lru5", "slipcache-int8-lfu5"):
        r = by.get((name, 64))
        add(f"{name} memory ratio at dim 64 >= 3.0x", r["memory_ratio"] if r else None, 3.0, "x")
    r = by.get(("slipcache-int4-lru1", 128))
    add("slipcache-int4-lru1 memory ratio at dim 128 >= 7.0x", r["memory_ratio"] if r else None, 7.0, "x")
    # Throughput against FBGEMM fp32 at the same dim (the targets).
    dims = sorted({r["dim"] for r in rows})
    for dim in dims:
        for name, threshold in (("slipcache-int8-lru5", 1.0), ("slipcache-fp32", 1.0), ("slipcache-int4-lru1", 0.8)):
            r = by.get((name, dim))
            if r is None:
                continue
            add(
                f"{name} samples/s at dim {dim} >= {threshold:g}x FBGEMM fp32",
                r["ratio_vs_fbgemm_fp32"],
                threshold,
                "x fbgemm fp32",
            )
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The result table, plain (for the terminal) or markdown (bench.md)."""
    header = [
        "dim",
        "name",
        "samples/s",
        "min-max",
        "x fbgemm fp32",
        "samples/CPU-s",
        "x fbgemm (CPU)",
        "of bound",
        "GB",
        "mem ratio",
        "hit rate",
        "evict/step",
        "B moved/sample",
        "status",
    ]
    lines = []
    for r in rows:
        lines.append(
            [
                str(r["dim"]),
                r["name"],
                _fmt(r["samples_per_s"], ",.0f"),
                _spread(r),
                _fmt(r["ratio_vs_fbgemm_fp32"], ".2f"),
                _fmt(r.get("samples_per_cpu_s"), ",.0f"),
                _fmt(r.get("ratio_vs_fbgemm_fp32_cpu"), ".2f"),
                _fmt(r.get("fraction_of_bound"), ".2f"),
                _fmt(None if r["bytes"] is None else r["bytes"] / GB, ".3f"),
                _fmt(r["memory_ratio"], ".2f"),
                _fmt(r["hit_rate"], ".3f"),
                _fmt(r.get("evictions_per_step"), ",.0f"),
                _fmt(r["bytes_moved_per_sample"], ",.0f"),
                r["status"],
            ]
        )
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(cells) + " |" for cells in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(header)]

    def fmt_line(cells: list[str]) -> str:
        numeric = range(2, 13)  # right-align the number columns
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt_line(header), fmt_line(["-" * w for w in widths])] + [fmt_line(c) for c in lines])


def _spread(r: dict[str, Any]) -> str:
    if r.get("samples_per_s_min") is None:
        return "-"
    return f"{r['samples_per_s_min'] / 1e3:,.0f}k-{r['samples_per_s_max'] / 1e3:,.0f}k"


def format_profile(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """µs per sample in each phase of our step, one line per configuration and dim."""
    profiled = [r for r in rows if r.get("phase_us_per_sample")]
    if not profiled:
        return ""
    phases = list(profiled[0]["phase_us_per_sample"])
    header = ["dim", "name", *phases]
    lines = [
        [str(r["dim"]), r["name"], *(f"{r['phase_us_per_sample'][p]:.3f}" for p in phases)] for r in profiled
    ]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    return "\n".join(
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        for cells in [header, *lines]
    )


def format_bound(result: dict[str, Any]) -> list[str]:
    """Markdown lines: the access costs the probes measured, and each configuration's bound by term."""
    costs = (result.get("probes") or {}).get("access_costs")
    bounded = [r for r in result["rows"] if r.get("bound_ns_per_lookup")]
    if not costs or not bounded:
        return []
    lines = ["## Bound (ns per lookup, by access)", ""]
    lines.append(
        "Access costs measured: "
        + "; ".join(
            f"{c['row_bytes']} B rows in {_binary(c['working_set_bytes'])}: {c['ns_per_access']:.1f} ns"
            for c in costs
        )
        + f" (share of first lookups of a row in a step u = {result.get('unique_share', 0):.3f})."
    )
    copy = (result.get("probes") or {}).get("sequential_copy")
    if copy and any("output and gradient" in r["bound_ns_per_lookup"] for r in bounded):
        lines.append(
            f"The output and its gradient (4 x dim bytes each per bag) are priced at the copy probe's "
            f"{copy['copy_gb_s']:.1f} GB/s."
        )
    lines.append("")
    for r in bounded:
        terms = ", ".join(f"{k} {v:.1f}" for k, v in r["bound_ns_per_lookup"].items())
        touched = r.get("lines_per_lookup") or {}
        counted = ", ".join(f"{k} {v:.2f}" for k, v in touched.items() if k != "total")
        lines.append(
            f"- dim {r['dim']} {r['name']}: {terms}; bound {r['bound_samples_per_s']:,.0f} samples/s, "
            f"measured {r['fraction_of_bound']:.2f} of it"
            + (f"; 64-byte lines per lookup {touched['total']:.2f} ({counted})" if touched else "")
        )
    return [*lines, ""]


def _binary(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:,.0f} {unit}"
    return f"{size:,.0f} B"


def format_targets(targets: list[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        value = (
            "not measured"
            if t["value"] is None
            else f"{t['value']:.2f}{'x' if t['unit'] == 'x' else ' ' + t['unit']}"
        )
        lines.append(f"{t['result']:4s}  {t['target']}: {value}")
    return "\n".join(lines)


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    probes = result.get("probes") or {}
    w = result["workload"]
    parts = [
        "# slipcache bench embedding",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- machine: {m['cpu_model']}, {m['logical_cores']} cores, torch threads {m['torch_threads']}, "
        f"compiled-loop threads {m.get('loop_threads', 1)}, load average "
        f"{_fmt(m.get('load_avg_1m_start'), '.1f')} at start, "
        f"{(m['memory_total_bytes'] or 0) / GB:.1f} GB RAM; torch {m['torch']}, numpy {m['numpy']}, "
        f"fbgemm_gpu {m['fbgemm_gpu'] or 'not installed'}",
    ]
    if probes:
        copy, gather = probes["sequential_copy"], probes["random_gather"]
        parts.append(
            f"- memory probes: sequential copy {copy['copy_gb_s']:.1f} GB/s copied; random 64-byte row gather "
            f"from {gather['table_bytes'] / GB:.1f} GB: {gather['rows_per_s'] / 1e6:.1f} M rows/s"
        )
    parts += [
        f"- workload: {w['tables']} tables, {w['rows']:,} rows, batch {w['batch_size']}, {w['id_distribution']}; "
        f"top 1% / 5% of rows take {w['lookup_share_top_1pct_rows']:.0%} / {w['lookup_share_top_5pct_rows']:.0%} "
        f"of lookups; {w['warmup_steps']} warm-up steps ({w['cache_warmup_steps']} with a cache) + "
        f"{w['timed_steps']} timed steps of forward + backward + update; "
        + (
            "each cache first prefilled with the rows the id distribution makes most probable"
            if w.get("prefill")
            else "caches start empty (no prefill)"
        ),
        f"- memory budget: {result['memory_budget_gb']:.1f} GB",
        "",
        format_table(result["rows"], markdown=True),
        "",
        f"`samples/s` is the median of {result['rounds']} interleaved rounds, `min-max` their range; "
        + (
            f"each timed section replayed its batches to last {result['min_seconds']:g} s (replayed batches "
            "find their rows cached: see `replayed_batches`)."
            if result["min_seconds"]
            else "no timed batch was replayed."
        ),
        "",
        "`samples/CPU-s` = samples per second of this process's CPU time over the timed steps (median of the "
        "rounds), `x fbgemm (CPU)` its ratio to FBGEMM fp32's: on a machine shared with other jobs, where "
        "descheduling stretches wall time, these are the comparable figures.",
        "",
        "`of bound` = samples/s over the configuration's own bound: the samples/s at which its random memory "
        "accesses alone, priced by the random-gather probe at their working-set and row sizes, would take the "
        "whole step (the model: `slipcache.bench.bound`, docs/design.md).",
        "",
        *format_bound(result),
        f"## Phase profile (µs per sample, {result.get('profile_clock', 'wall')} clock)",
        "",
        format_profile(result["rows"], markdown=True) or "(not profiled)",
        "",
        "`mem ratio` = fp32 bytes / bytes held; `hit rate`, `evict/step` (rows written back to storage per "
        "step) and `B moved/sample` (cache <-> storage traffic) cover the timed steps only.",
        "",
        "## Targets",
        "",
        *[f"- {line}" for line in format_targets(result["targets"]).splitlines()],
        "",
        *[f"**Warning:** {w}\n" for w in result.get("warnings", [])],
    ]
    return "\n".join(parts)


def progress(message: str) -> None:
    """A line of benchmark progress on stderr, so stdout keeps only the results."""
    print(message, file=sys.stderr, flush=True)
