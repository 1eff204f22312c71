"""`slipcache experiment`: the two papers' questions as grids of training runs, and a report answering them.

Mixed precision (Yang et al., arXiv 2010.11305) and Slipstream stale-input skipping (Maboud et al.,
arXiv 2404.04270) each become a grid of *setups* (one `TrainConfig` variant each), run over seeds as
*cells* (setup x seed) through `slipcache.training.trainer.train`. The output directory:

    DIR/cells/<cell-id>/   one training run directory (summary.json, metrics.jsonl, ...) plus cell.json,
                           written last: a cell with cell.json is done and never run again; one
                           without it (a crash) is deleted and rerun from scratch
    DIR/results.json       every cell (config, seed, summary, embedding traffic), mean/std per setup,
                           the machine description and memory probes
    DIR/report.md          tables, plots (*.png) and a generated answer per research question

The cell id holds a hash of the run's whole config, so changing a preset or an option makes new cells
instead of silently reusing results of a different run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.accuracy import ACCURACY_SEEDS, accuracy_grid, accuracy_intervals, accuracy_section
from benchmarks.mixed_precision import (
    BASELINE,
    derived_metrics,
    mixed_precision_grid,
    mixed_precision_section,
    plot_accuracy_memory,
    plot_cache_sweep,
    plot_rounding,
    plot_traffic,
)
from benchmarks.paired import PER_SEED, mean_std, on_seeds
from benchmarks.render import fmt_value, markdown_table
from benchmarks.runner import (
    ACCURACY,
    EXPERIMENTS,
    NAMES,
    PAPER,
    PRESETS,
    Plan,
    Preset,
    Setup,
    fmt_duration,
    prepare_experiment_data,
    run_cells,
)
from benchmarks.slipstream import (
    add_timing,
    plot_skip_speedup,
    plot_stale_rows,
    slipstream_grid,
    slipstream_section,
    stale_name,
)
from slipcache.bench.experiment import AS_COMMAND, COMMAND
from slipcache.cli import OneLineErrors
from slipcache.data.synthetic import DEFAULT_GENERATOR, GENERATOR_VERSIONS
from slipcache.errors import SlipcacheError
from slipcache.plotting import STYLE, pyplot
from slipcache.training.rundir import write_json

RESULTS_FORMAT = "slipcache-experiments"
RESULTS_VERSION = 1
METRICS = (
    "auc", "logloss", "accuracy", "samples_per_s", "train_wall_s", "cache_hit_rate", "memory_ratio",
    "embedding_bytes", "skipped_fraction", "train_samples",
)  # fmt: skip
DERIVED = (
    "rows_moved_per_sample", "bytes_moved_per_sample", "unified_bytes_per_sample", "touched_bytes_per_sample",
    "step_ms", "bound_samples_per_s", "bound_fraction",
)  # fmt: skip


def aggregate(setups: list[Setup], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean/std per setup over seeds, plus deltas paired by seed against the setup's reference.

    References: the fp32 no-cache run for mixed precision; the same storage without skipping for
    slipstream (speedup = reference train time / train time, same seed).
    """
    by_setup: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_setup.setdefault(r["setup"], []).append(r)
    out = []
    for setup in setups:
        rows = by_setup.get(setup.name, [])
        ref_name = BASELINE if setup.experiment in ("mixed-precision", ACCURACY) else stale_name(setup.group, None)
        ref = {r["seed"]: r for r in by_setup.get(ref_name, [])}
        paired = _paired_with(ref)
        entry: dict[str, Any] = {
            "experiment": setup.experiment,
            "name": setup.name,
            "group": setup.group,
            "questions": setup.questions,
            "overrides": setup.overrides,
            "seeds": len(rows),
            "reference": ref_name,
            "metrics": {k: mean_std(r["summary"].get(k) for r in rows) for k in METRICS},
        }
        entry["metrics"].update({k: mean_std(r["derived"].get(k) for r in rows) for k in DERIVED})
        entry["metrics"]["auc_delta"] = mean_std(paired("auc", r, lambda a, b: a - b) for r in rows)
        entry["metrics"]["logloss_delta"] = mean_std(paired("logloss", r, lambda a, b: a - b) for r in rows)
        entry["metrics"]["speedup"] = mean_std(paired("train_wall_s", r, lambda a, b: b / a) for r in rows)
        entry["per_seed"] = {
            str(r["seed"]): {
                **{k: r["summary"].get(k) for k in PER_SEED},
                "auc_delta": paired("auc", r, lambda a, b: a - b),
                "speedup": paired("train_wall_s", r, lambda a, b: b / a),
            }
            for r in rows
        }
        out.append(entry)
    return out


def _paired_with(ref: dict[int, dict[str, Any]]) -> Callable[..., float | None]:
    """fn(value, reference value) of one summary key, against the same seed's reference (else its mean)."""
    means = {}

    def paired(key: str, record: dict[str, Any], fn: Callable[[float, float], float]) -> float | None:
        if record["seed"] in ref:
            base = ref[record["seed"]]["summary"].get(key)
        else:
            if key not in means:
                means[key] = (mean_std(r["summary"].get(key) for r in ref.values()) or {}).get("mean")
            base = means[key]
        value = record["summary"].get(key)
        return fn(value, base) if value is not None and base else None

    return paired


def machine_section(machine: dict[str, Any], probes: dict[str, Any], threads: int) -> list[str]:
    gather, copy = probes.get("random_gather", {}), probes.get("sequential_copy", {})
    return [
        "## Machine", "",
        f"{machine.get('cpu_model')}, {machine.get('usable_cores')} usable cores, "
        f"{(machine.get('memory_total_bytes') or 0) / 2**30:.0f} GiB; torch {machine.get('torch')} with "
        f"{threads} thread(s) per run (two threads on two shared cores ran ~40x slower than one here: OpenMP "
        "workers spin while other jobs hold the cores).", "",
        *markdown_table(["probe", "result"], [
            ["sequential copy", f"{fmt_value(copy.get('copy_gb_s'), '.2f')} GB/s copied "
                                f"({fmt_value(copy.get('traffic_gb_s'), '.2f')} GB/s read + written)"],
            ["random 64-byte row gather", f"{fmt_value((gather.get('rows_per_s') or 0) / 1e6, '.1f')} M rows/s "
                                          f"= {fmt_value(gather.get('gb_s'), '.2f')} GB/s from a "
                                          f"{(gather.get('table_bytes') or 0) / 2**20:.0f} MiB table"],
        ]),
        "",
        "The memory bound in RQ5 divides the gather rate by the cache lines a training sample touches in the "
        "embedding layer (26 lookups read and write a row; cache misses add the rows moved in and out).", "",
    ]


def write_report(out: Path, results: dict[str, Any]) -> Path:
    """report.md and its PNGs from results.json's content (so a report can be rebuilt from it)."""
    plt = pyplot()
    entries = results["setups"]
    mp = [e for e in entries if e["experiment"] == "mixed-precision"]
    accuracy = [e for e in entries if e["experiment"] == ACCURACY]
    stale = [e for e in entries if e["experiment"] == "slipstream"]
    events = {}
    for e in stale:  # seed-0 event series of each setup
        cell = next((c for c in results["cells"] if c["setup"] == e["name"] and c["seed"] == 0), None)
        if cell:
            path = out / "cells" / cell["id"] / "metrics.jsonl"
            text = path.read_text() if path.is_file() else ""
            events[e["name"]] = [json.loads(line) for line in text.splitlines() if line.strip()]
    with plt.rc_context(STYLE):
        plots = {
            "accuracy_memory": plot_accuracy_memory(mp, out / "accuracy_vs_memory.png"),
            "cache_sweep": plot_cache_sweep(on_seeds([e for e in mp if {"RQ2", "RQ3"} & set(e["questions"])])[0],
                                            out / "cache_sweep.png"),
            "rounding": plot_rounding(mp, out / "rounding.png"),
            "traffic": plot_traffic(mp, out / "bytes_moved.png"),
            "skip_speedup": plot_skip_speedup(stale, out / "skip_speedup.png"),
            "stale_rows": plot_stale_rows(stale, events, out / "stale_rows.png"),
        }
    preset = results["preset"]
    lines = [
        "# slipcache experiments", "",
        f"`slipcache experiment {results['name']}` ({preset['name']} preset), "
        f"written {results['written']}. Synthetic Criteo-Kaggle-shaped data at scale {preset['scale']:g} unless "
        f"`--data` was given ({results.get('data') or 'synthetic'}); every number below is generated from "
        "`results.json`.", "",
    ]
    lines += machine_section(results["machine"], results["probes"], results["threads"])
    if mp:
        lines += mixed_precision_section(mp, plots, results.get("table_sizes"))
    if stale:
        lines += slipstream_section(stale, plots, results.get("repeats", 1), results["threads"])
    if accuracy:
        lines += accuracy_section(out, results, accuracy)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def quick_estimates() -> dict[str, tuple[int, float]]:
    """(runs, estimated seconds) of each study's `--quick` grid at its default seeds: the up-front estimate
    each study prints as it starts (`Plan.estimate_s`, one thread), data generation not included."""
    preset = PRESETS["quick"]
    grids = {"mixed-precision": mixed_precision_grid, "slipstream": slipstream_grid, ACCURACY: accuracy_grid}
    estimates = {}
    for name, grid in grids.items():
        seeds = ACCURACY_SEEDS if name == ACCURACY else preset.key_seeds
        plan = Plan(preset, Path("."), None, seeds, repeats=preset.repeats)
        cells = plan.cells(grid(preset, seeds))
        estimates[name] = (len(cells), sum(plan.estimate_s(cell) for cell in cells))
    return estimates


def quick_help() -> str:
    """`--quick`'s help: what each study's quick grid takes, from the same estimate the study prints."""
    estimates = quick_estimates()
    minutes = {name: max(1, round(seconds / 60)) for name, (_, seconds) in estimates.items()}
    runs = estimates[ACCURACY][0]
    return (
        "tiny data and a reduced grid that exercises every question and plot; about "
        f"{minutes['mixed-precision']} min for mixed-precision, {minutes['slipstream']} min for slipstream, "
        f"{minutes['mixed-precision'] + minutes['slipstream']} min for all and {minutes[ACCURACY]} min for "
        f"accuracy ({runs} runs of {PRESETS['quick'].accuracy_epochs} epochs) on one thread, plus a minute or "
        "two of data generation; each study prints its estimate as it starts"
    )


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    hidden = argparse.SUPPRESS
    parser.add_argument("name", choices=NAMES, help="which experiment grid to run")
    parser.add_argument("--out", required=True, help="output directory (reused: finished runs are kept)")
    parser.add_argument("--quick", action="store_true", help=quick_help())
    parser.add_argument("--data", default=None, help="a preprocessed dataset dir (or raw Criteo files, "
                        "preprocessed once into OUT/data); default: synthetic data. Slipstream runs whole "
                        "epochs of its training split")
    parser.add_argument("--generator", choices=tuple(GENERATOR_VERSIONS), default=DEFAULT_GENERATOR,
                        help="synthetic data generator (default %(default)s; earlier ones reproduce earlier figures)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds of the key setups (default 3, quick 1; accuracy: 5); sweep setups run one seed")
    parser.add_argument("--repeats", type=int, default=None,
                        help="slipstream: timed runs of seed 0 per setup, interleaved A B A B (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1: on a shared machine more threads oversubscribe)")
    parser.add_argument("--accuracy-epochs", type=int, default=None,
                        help="accuracy: passes over the training split (default 3, quick 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per batch (default 512)")
    parser.add_argument("--setup", action="append", default=None, metavar="NAME",
                        help="run only this setup of the grid (its full name, as in the report; repeatable), "
                        "e.g. a baseline and one setting for a timing rerun")
    # Hidden size overrides, for tests and for fitting a time budget.
    for flag, kind in (("--scale", float), ("--dataset-samples", int), ("--train-samples", int),
                       ("--stale-dataset-samples", int), ("--stale-epochs", int), ("--eval-samples", int),
                       ("--probe-seconds", float), ("--probe-table-bytes", int)):
        parser.add_argument(flag, type=kind, default=None, help=hidden)


def _resolve_preset(args: argparse.Namespace) -> Preset:
    preset = PRESETS["quick" if args.quick else "full"]
    changes = {name: getattr(args, name) for name in ("scale", "dataset_samples", "train_samples",
                                                       "stale_dataset_samples", "stale_epochs", "eval_samples",
                                                       "probe_seconds", "probe_table_bytes", "accuracy_epochs",
                                                       "batch_size")
               if getattr(args, name, None) is not None}
    for name, value in changes.items():
        if not value > 0:
            raise SlipcacheError(f"--{name.replace('_', '-')} must be positive, got {value}")
    return Preset(**{**asdict(preset), **changes})


def run_experiment(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> int:
    log = log or (lambda line: print(line, flush=True))
    if args.threads < 1:
        raise SlipcacheError(f"--threads must be at least 1, got {args.threads}")
    preset = _resolve_preset(args)
    seeds = args.seeds if args.seeds is not None else ACCURACY_SEEDS if args.name == ACCURACY else preset.key_seeds
    if seeds < 1:
        raise SlipcacheError(f"--seeds must be at least 1, got {seeds}")
    repeats = args.repeats if getattr(args, "repeats", None) is not None else preset.repeats
    if repeats < 1:
        raise SlipcacheError(f"--repeats must be at least 1, got {repeats}")
    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SlipcacheError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, preset, seeds, repeats, names, out, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace, preset: Preset, seeds: int, repeats: int, names: list[str], out: Path,
         log: Callable[[str], None]) -> int:
    from slipcache.bench.machine import describe_machine, probe_memory

    start = time.perf_counter()
    data, table_sizes = prepare_experiment_data(args.data, out)
    generator = getattr(args, "generator", DEFAULT_GENERATOR)
    plan = Plan(preset, out, data, seeds, generator=generator, repeats=repeats)
    setups: list[Setup] = []
    records: list[dict[str, Any]] = []
    log(f"probing memory ({2 * preset.probe_seconds:g} s) ...")
    probes = probe_memory(table_bytes=preset.probe_table_bytes, copy_bytes=min(preset.probe_table_bytes, 256 << 20),
                          seconds=preset.probe_seconds)
    for name in names:
        grids = {"mixed-precision": mixed_precision_grid, "slipstream": slipstream_grid, ACCURACY: accuracy_grid}
        grid = grids[name](preset, seeds)
        only = getattr(args, "setup", None)
        if only:
            unknown = sorted(set(only) - {s.name for s in grid})
            if unknown:
                raise SlipcacheError(f"no setup named {unknown[0]!r} in the {name} grid; its setups: "
                                     + "; ".join(s.name for s in grid))
            grid = [s for s in grid if s.name in only]
        if data is None:  # generate the synthetic data up front, so the first cell's time is its own
            from slipcache.data.synthetic import default_synthetic_path, synthetic_table_sizes

            n = preset.stale_dataset_samples if name == "slipstream" else preset.dataset_samples
            dataset = default_synthetic_path(None, n, preset.scale, 0, generator=generator, progress=True).name
            table_sizes = synthetic_table_sizes(preset.scale)
        setups += grid
        records += run_cells(plan, plan.cells(grid, dataset if data is None else ""), name, log)
    num_tables = len(table_sizes) if table_sizes else 26
    for record in records:
        record["derived"] = derived_metrics(record, probes, num_tables)
    results = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "name": args.name,
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "preset": asdict(preset),
        "seeds": seeds,
        "repeats": repeats,
        "threads": args.threads,
        "data": data,
        "generator": None if data is not None else generator,
        "table_sizes": table_sizes,
        "machine": describe_machine(),
        "probes": probes,
        "paper": PAPER,
        "cells": records,
        "setups": aggregate(setups, [r for r in records if not r.get("repeat")]),
    }
    add_timing(results["setups"], records)
    if ACCURACY in names:
        results["accuracy"] = accuracy_intervals([e for e in results["setups"] if e["experiment"] == ACCURACY])
    write_json(out / "results.json", results)
    report = write_report(out, results)
    log(f"wrote {out / 'results.json'} and {report} in {fmt_duration(time.perf_counter() - start)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.studies STUDY --out DIR` (the same as `slipcache experiment` in a checkout), or
    `python -m benchmarks.studies accuracy_at_scale --resume` for a study that outlives a session."""
    import sys

    from benchmarks import long_studies

    argv = sys.argv[1:] if argv is None else argv
    via_command = argv[:1] == [AS_COMMAND]  # run by `slipcache experiment`: its name in usage and errors
    argv = argv[1:] if via_command else argv
    prog = COMMAND if via_command else "python -m benchmarks.studies"
    parser_class = OneLineErrors if via_command else argparse.ArgumentParser
    try:
        if argv and argv[0] in long_studies.STUDIES:
            parser = parser_class(prog=prog, description=long_studies.__doc__.splitlines()[0])
            parser.add_argument("name", choices=tuple(long_studies.STUDIES))
            parser.add_argument("--out", default=None, help="run root: one directory per arm x seed (default: "
                                "the slipcache cache, studies/<study>)")
            long_studies.add_arguments(parser)
            return long_studies.run_study(parser.parse_args(argv), lambda line: print(line, flush=True))
        parser = parser_class(prog=prog, description=__doc__.splitlines()[0])
        add_experiment_arguments(parser)
        return run_experiment(parser.parse_args(argv))
    except SlipcacheError as exc:
        print(f"{COMMAND if via_command else 'benchmarks.studies'}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
