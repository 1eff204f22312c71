"""How much a model can know after each part of a time-ordered epoch: the coverage ceilings on the first
validation rows, counted over a growing prefix of the training split.

    python -m benchmarks.ceiling_curve --samples 45840617 --points 16 --val-rows 500000 --json FILE
    python -m benchmarks.ceiling_curve --json FILE --plot docs/studies/schedule_pilot.png

A model trained on a time-ordered log keeps meeting new users, ads and sites, so its validation AUC rises for
as long as the data's coverage does, whatever its schedule. This curve is the data's own learning curve: a
model whose validation curve runs parallel to it has learned what the prefix allows, and the gain the curve
itself makes over the last quarter is the part of a model's late gain that no schedule can remove.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.data.synthetic.ceiling import CoverageCeiling
from slipcache.data.synthetic.generate import _log_rows, make_generator, split_bounds
from slipcache.metrics import auc


def coverage_curve(samples: int, scale: float, seed: int, generator: str, points: int, val_rows: int) -> dict[str, Any]:
    """[training rows counted, teacher AUC, coverage AUC for k = 1, 10, 100] on the first `val_rows`
    validation rows, at `points` evenly spaced prefixes of the training split."""
    gen = make_generator(generator, scale, seed, num_samples=samples)
    gen.calibrate()
    bounds = split_bounds(samples, 0.1, 0.1, "slipcache")
    val = (bounds["val"][0], min(bounds["val"][1], bounds["val"][0] + val_rows))
    rows: dict[str, list[np.ndarray]] = {"dense": [], "params": [], "sources": [], "labels": []}
    for start, end, dense, _, _, labels, (params, sources) in _log_rows(gen, seed, samples, [val]):
        lo, hi = max(val[0], start) - start, min(val[1], end) - start
        for name, part in (("dense", dense), ("params", params), ("sources", sources), ("labels", labels)):
            rows[name].append(part[lo:hi])
    dense, params, sources, labels = (np.concatenate(rows[k]) for k in ("dense", "params", "sources", "labels"))
    ceiling = CoverageCeiling(gen)
    n_train = bounds["train"][1]
    marks = [round(n_train * (i + 1) / points) for i in range(points)]
    curve = []
    for start, end, _, _, _, _, (_, chunk_sources) in _log_rows(gen, seed, samples, [bounds["train"]]):
        end = min(end, n_train)
        for mark in [m for m in marks if start < m <= end]:
            ceiling.add_train(chunk_sources[: mark - start])
            scores = {k: auc(labels, v) for k, v in ceiling.masked_logits(dense, params, sources).items()}
            curve.append([mark, scores["teacher"], *(scores[str(k)] for k in ceiling.ks)])
            chunk_sources = chunk_sources[mark - start :]
            start = mark
        ceiling.add_train(chunk_sources[: end - start])
    columns = ["train_rows", "teacher_auc", *(f"coverage_auc_{k}" for k in ceiling.ks)]
    return {
        "columns": columns,
        "curve": curve,
        "gain_last_quarter": last_quarter_gains(columns, curve),
        "val_rows": int(len(labels)),
        "data": {"generator": generator, "samples": samples, "scale": scale, "seed": seed},
    }


def last_quarter_gains(columns: list[str], curve: list[list[float]]) -> dict[str, float | None]:
    """Per ceiling: its value at the end minus at 3/4 of the training rows, as for a model's validation curve."""
    from benchmarks.long_studies import gain_last_quarter

    return {name: gain_last_quarter([[0.0, row[0], row[i]] for row in curve]) for i, name in enumerate(columns)
            if i > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=45_840_617)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generator", default="v5")
    parser.add_argument("--points", type=int, default=16)
    parser.add_argument("--val-rows", type=int, default=500_000)
    parser.add_argument("--json", type=Path, required=True, help="the curve's file (written, or read with --plot)")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="only draw docs/studies/schedule_pilot.json's curves against the one in --json")
    args = parser.parse_args(argv)
    if args.plot:
        pilot = json.loads((Path(__file__).resolve().parent.parent / "docs/studies/schedule_pilot.json").read_text())
        print(f"wrote {plot_pilot(pilot, json.loads(args.json.read_text()), args.plot)}")
        return 0
    t0 = time.perf_counter()
    result = coverage_curve(args.samples, args.scale, args.seed, args.generator, args.points, args.val_rows)
    result["seconds"] = time.perf_counter() - t0
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["curve"]:
        print(f"{row[0]:>11,} rows: teacher {row[1]:.4f}, coverage " + ", ".join(f"{v:.4f}" for v in row[2:]))
    return 0



def plot_pilot(pilot: dict[str, Any], coverage: dict[str, Any] | None, out: Path) -> Path:
    """The pilot's validation curves against the data's coverage ceilings over the same training rows."""
    from slipcache.plotting import STYLE, pyplot

    plt = pyplot()
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for run in pilot["runs"]:
            curve = np.array([[s, a] for _, s, a in run["curve"]], dtype=float)
            ax.plot(curve[:, 0] / 1e6, curve[:, 1], marker="o", ms=3, label=f"{run['arm']} (validation AUC)")
        if coverage:
            cov = np.array(coverage["curve"], dtype=float)
            for column, style in ((3, "--"), (4, ":")):
                name = coverage["columns"][column].replace("coverage_auc_", "coverage ceiling, k = ")
                ax.plot(cov[:, 0] / 1e6, cov[:, column], "k" + style, label=name)
        ax.set(xlabel="training rows seen (millions)", ylabel="AUC on the first validation rows",
               title="schedule pilot: one epoch of the Kaggle-sized log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
