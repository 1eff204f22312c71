"""`python -m benchmarks.generator_signal`: the big tables' target AUC of each generator against the real rows.

Why over many windows: on 1,999 rows (the size of the real sample) one window's target AUC swings by about
±0.04, so a generator is judged by its mean over windows of several seeds, against the real sample's value.
"""

from __future__ import annotations

import argparse
import json
import statistics

from slipcache.data.criteo import read_chunks
from slipcache.data.stats.signal import target_auc
from slipcache.data.synthetic import GENERATOR_VERSIONS, synthetic_rows

BIG_TABLES = {"C3": 2, "C4": 3, "C12": 11, "C16": 15, "C21": 20}
KAGGLE_ROWS = 45_840_617


def real_figures(path: str) -> tuple[int, dict[str, float | None]]:
    chunks = list(read_chunks(path))
    cats = [c.categorical for c in chunks]
    labels = [c.labels for c in chunks]
    import numpy as np

    ids, y = np.concatenate(cats), np.concatenate(labels)
    return len(y), {name: target_auc(ids[:, t], y) for name, t in BIG_TABLES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.generator_signal", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--real", default="../shared/data/criteo/kaggle_train_tiny.csv", help="real Criteo rows"
    )
    parser.add_argument(
        "--seeds", type=int, default=12, help="synthetic windows (seeds 0..N-1) per generator"
    )
    parser.add_argument("--generators", nargs="+", default=["v5", "v4"], choices=tuple(GENERATOR_VERSIONS))
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    rows, real = real_figures(args.real)
    out = {
        "real": {"path": args.real, "rows": rows, "target_auc": real},
        "seeds": args.seeds,
        "generators": {},
    }
    print(
        f"big tables' target AUC on {rows:,}-row windows: the real rows, and each generator's mean (sem) over "
        f"{args.seeds} seeds (scale 1)"
    )
    print(f"{'':10}" + "".join(f"{name:>16}" for name in BIG_TABLES))
    print(f"{'real':10}" + "".join(f"{real[name]:>16.3f}" for name in BIG_TABLES))
    for gen in args.generators:
        per_table: dict[str, list[float]] = {name: [] for name in BIG_TABLES}
        for seed in range(args.seeds):
            _, ids, labels = synthetic_rows(0, rows, generator=gen, seed=seed, num_samples=KAGGLE_ROWS)
            for name, t in BIG_TABLES.items():
                value = target_auc(ids[:, t], labels)
                if value is not None:
                    per_table[name].append(value)
        stats = {
            name: {"mean": statistics.fmean(v), "sem": statistics.stdev(v) / len(v) ** 0.5}
            for name, v in per_table.items()
        }
        out["generators"][gen] = stats
        cells = "".join(f"{s['mean']:>9.3f} ({s['sem']:.3f})" for s in stats.values())
        gaps = [abs(stats[name]["mean"] - real[name]) for name in BIG_TABLES]
        print(f"{gen:10}{cells}   largest gap to real {max(gaps):.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
