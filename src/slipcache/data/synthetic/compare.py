"""`synth --compare`: a window of synthetic rows against the first rows of a real file, statistic by
statistic, each with its tolerance.
"""

from __future__ import annotations

import math
import os
from typing import Any

from slipcache.data.synthetic.generate import DEFAULT_SAMPLES, GENERATOR_VERSIONS, synthetic_rows
from slipcache.data.synthetic.v3 import DAYS, DRIFT_RATE, MISSING_ROW, NEW_ENTITY_RATE
from slipcache.errors import SlipcacheError

# `synth --compare`: how far each statistic of a synthetic window may be from the real one (missing rates:
# at least three binomial standard errors at the sample's size).
COMPARE_TOLERANCE = {
    "co_recurrence": 0.10, "correlation": 0.15, "recur_share": 0.10, "missing_rate": 0.03,
    # Signal figures (slipcache.data.stats.signal). Target AUC on 1/6 of ~2,000 rows has a standard error
    # of about 0.035: +-0.06 is shape (signal or none), not value. Shares of rows: as missing rates.
    "target_auc": 0.06, "zero_share": 0.05, "negative_share": 0.03, "log10_median": 0.3,
    "count_band": 0.10, "link_purity": 0.15,
}  # fmt: skip
SIGNAL_TABLES = ("C3", "C4", "C12", "C16", "C21")  # target AUC compared: the big tables
BAND_TABLES = ("C7", "C11", "C13", "C15", "C18")  # ad and site tables: how hot their heads are
COMPARE_ROWS = 100_000  # real rows read from the start of the file (the window compared)


def compare_with_real(
    real_path: str | os.PathLike[str],
    *,
    max_rows: int = COMPARE_ROWS,
    day: int = 0,
    generators: tuple[str, ...] = tuple(GENERATOR_VERSIONS),
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
) -> dict[str, Any]:
    """Statistics of the first rows of a real file against the same number of contiguous synthetic rows
    from the start of day `day`, per generator, each statistic with its tolerance and pass/fail.

    Like with like: the real rows are one contiguous window from the start of a log, an empty field
    counts as a value (the generators' row 0), and both sides go through `slipcache.data.stats`.
    """
    from slipcache.data.stats import compute_stats, compute_stats_arrays

    real = compute_stats(real_path, max_rows=max_rows)
    rows = int(real["rows"])
    if rows < 2:
        raise SlipcacheError(f"{real_path}: {rows} good rows; at least 2 are needed to compare")
    if not 0 <= day < days:
        raise SlipcacheError(f"day must be in 0..{days - 1}, got {day}")
    start = int(round(day * num_samples / days))
    stats = {"real": real}
    for name in generators:
        dense, ids, labels = synthetic_rows(start, rows, num_samples=num_samples, scale=scale, seed=seed,
                                            generator=name, days=days, new_entity_rate=new_entity_rate,
                                            drift_rate=drift_rate)
        stats[name] = compute_stats_arrays(ids, dense, labels, missing_value=MISSING_ROW)

    def corr(result: dict[str, Any], a: str, b: str) -> float | None:
        names = result["recurrence_correlation"]["tables"]
        return result["recurrence_correlation"]["matrix"][names.index(a)][names.index(b)]

    checks: list[tuple[str, str, Any]] = [
        ("big-table co-recurrence", "co_recurrence", lambda r: r["co_recurrence"]["all_recur"])
    ]
    big = real["big_tables"]
    for i, a in enumerate(big):
        for b in big[i + 1 :]:
            checks.append((f"recurrence corr {a}-{b}", "correlation", lambda r, a=a, b=b: corr(r, a, b)))
    for t, table in enumerate(real["tables"]):
        for key in ("recur_share", "missing_rate"):
            label = f"{table['name']} {key.replace('_', ' ')}"
            checks.append((label, key, lambda r, t=t, key=key: r["tables"][t][key] or 0.0))
    checks += _signal_checks(real)
    lines = []
    for label, kind, get in checks:
        real_value = get(real)
        tolerance = COMPARE_TOLERANCE[kind]
        if kind in ("missing_rate", "zero_share", "negative_share", "count_band") and real_value is not None:
            # a share of rows: at least three binomial standard errors of the sample
            tolerance = max(tolerance, 3.0 * math.sqrt(real_value * (1.0 - real_value) / rows))
        tolerance = round(tolerance, 3)
        values = {name: get(stats[name]) for name in generators}
        passed = {
            name: (v is None and real_value is None)
            or (v is not None and real_value is not None and abs(v - real_value) <= tolerance + 1e-9)
            for name, v in values.items()
        }
        lines.append(
            {"statistic": label, "real": real_value, **values, "tolerance": tolerance, "pass": passed}
        )
    return {
        "real_path": str(real_path),
        "rows": rows,
        "window_start": start,
        "settings": {"scale": scale, "seed": seed, "num_samples": num_samples, "days": days},
        "generators": list(generators),
        "lines": lines,
        "passed": {name: sum(line["pass"][name] for line in lines) for name in generators},
    }


def _signal_checks(real: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """Where the signal sits: target AUC of the big tables, dense shapes, ad/site heads, table links."""
    names = [t["name"] for t in real["tables"]]
    checks: list[tuple[str, str, Any]] = []
    for table in SIGNAL_TABLES:
        t = names.index(table)
        checks.append((f"{table} target AUC", "target_auc", lambda r, t=t: r["tables"][t]["target_auc"]))
    for j, feature in enumerate(real.get("dense") or []):
        name = feature["name"]
        checks.append((f"{name} zero share", "zero_share", lambda r, j=j: _dense(r, j, "zero_share")))
        checks.append((f"{name} log10 median", "log10_median", lambda r, j=j: _log_median(r, j)))
    if real.get("dense"):
        checks.append(("I2 negative share", "negative_share", lambda r: _dense(r, 1, "negative_share")))
    for table in BAND_TABLES:
        t = names.index(table)
        for band in ("2-9", ">=100"):
            checks.append((f"{table} lookups to values seen {band}", "count_band",
                           lambda r, t=t, band=band: r["tables"][t]["lookup_share_by_count"][band]))
    for i, link in enumerate(real.get("links") or []):
        checks.append((f"link {link['from']}->{link['to']} purity", "link_purity",
                       lambda r, i=i: r["links"][i]["purity"] if r.get("links") else None))
    return checks


def _dense(result: dict[str, Any], j: int, key: str) -> float | None:
    dense = result.get("dense")
    return None if not dense else dense[j][key]


def _log_median(result: dict[str, Any], j: int) -> float | None:
    dense = result.get("dense")
    if not dense or dense[j]["quantiles"] is None:
        return None
    return math.log10(max(dense[j]["quantiles"]["0.5"], 0.0) + 1.0)  # log10(1 + median): zero medians too


def format_comparison(result: dict[str, Any]) -> str:
    gens = result["generators"]
    settings = result["settings"]
    head = (
        f"{result['real_path']}: first {result['rows']} rows against synthetic rows "
        f"{result['window_start']}..{result['window_start'] + result['rows'] - 1} "
        f"(scale {settings['scale']:g}, seed {settings['seed']}, {settings['num_samples']} rows over "
        f"{settings['days']} days); an empty field counts as a value"
    )

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    width = max(len(line["statistic"]) for line in result["lines"])
    header = f"{'statistic':<{width}}  {'real':>6}  " + "  ".join(f"{g:>6}" for g in gens)
    header += "    tol  " + "  ".join(f"{g:>4}" for g in gens)
    rows = [head, "", header]
    for line in result["lines"]:
        text = f"{line['statistic']:<{width}}  {num(line['real']):>6}  "
        text += "  ".join(f"{num(line[g]):>6}" for g in gens)
        text += f"  ±{line['tolerance']:.2f}  " + "  ".join(
            f"{'ok' if line['pass'][g] else 'FAIL':>4}" for g in gens
        )
        rows.append(text)
    total = len(result["lines"])
    rows.append("")
    rows.append("within tolerance: " + ", ".join(f"{g} {result['passed'][g]}/{total}" for g in gens))
    return "\n".join(rows)
