"""The skip-rule study: each skip rule against random skipping at the same share and against the run
without skipping stopped early at the same trained samples, paired by seed.

    python -m benchmarks.skip_rules run --out docs/experiments/skip-rules [--seeds 3] [--rows 600000]
    python -m benchmarks.skip_rules report --out docs/experiments/skip-rules

`run` trains, per seed, the baseline (no skipping), each rule, and for each rule the random control at
the share that rule skipped (so a rule's control starts once the rule's run has finished); up to
`--workers` runs at a time, each one torch thread, at the driver's niceness (run it under `nice`). Every run
evaluates on the whole validation split at one fixed schedule (every `--eval-every` consumed inputs,
trained or skipped).
`report` writes results.json (the raw figures of every run), report.md and auc.png beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RULES = {  # rule name -> train flags (the random control takes the rule's measured share)
    "stale (tuned, D=0.5)": ["--skip-rule", "stale", "--stale-preset", "tuned", "--stale-target", "0.5"],
    "stale (paper preset, D=0.5)": ["--skip-rule", "stale", "--stale-preset", "paper", "--stale-target", "0.5"],
    "loss (r=0.5)": ["--skip-rule", "loss", "--prune-share", "0.5"],
}
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided 95 % t quantiles by degrees of freedom
TARGET_MARGINS = (0.0005, 0.001, 0.002)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def common_flags(args: argparse.Namespace, config: Path) -> list[str]:
    return ["--config", str(config), "--epochs", str(args.epochs), "--eval-every", str(args.eval_every),
            "--eval-samples", str(args.eval_samples), "--quiet"]


def launch(args: argparse.Namespace, name: str, seed: int, flags: list[str], config: Path) -> subprocess.Popen:
    run = Path(args.out) / "runs" / f"{slug(name)}-s{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "slipcache.cli", "train", *common_flags(args, config),  # niceness: the driver's
           "--seed", str(seed), "--out", str(run), *flags]
    (Path(args.out) / "runs").mkdir(parents=True, exist_ok=True)
    log = open(Path(args.out) / "runs" / f"{slug(name)}-s{seed}.log", "w")  # noqa: SIM115 - closed by the OS at exit
    print(time.strftime("%H:%M:%S"), "start", name, "seed", seed, flush=True)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def summary_of(args: argparse.Namespace, name: str, seed: int) -> dict[str, Any] | None:
    path = Path(args.out) / "runs" / f"{slug(name)}-s{seed}" / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def random_flags(rule: str, summary: dict[str, Any], hot_share: float) -> list[str]:
    """Random skipping at the share the rule skipped, on the rule's schedule: for a stale rule, the same
    preset with D = the share of hot inputs it skipped; for loss pruning (which does not look at hot inputs)
    the same share of all inputs (D = skipped share / hot share), from the second epoch, as pruning."""
    if summary["staleness"]["rule"] == "loss":
        share = min(1.0, summary["skipped_fraction"] / hot_share)
        return ["--skip-rule", "random", "--stale-preset", "tuned", "--stale-target", f"{share:.4f}",
                "--stale-warmup", "epoch"]
    flags = list(RULES[rule])
    flags[flags.index("--skip-rule") + 1] = "random"
    flags[flags.index("--stale-target") + 1] = f"{summary['staleness']['hot_skipped_fraction']:.4f}"
    return flags


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "data.toml"
    config.write_text(f"synthetic_samples = {args.rows}\n")
    from slipcache.data.synthetic import default_synthetic_path

    default_synthetic_path(None, args.rows, 0.05, 0, progress=False)  # once, before runs race to make it
    tasks: list[tuple[str, int, list[str] | None, str | None]] = []  # name, seed, flags, depends on rule
    for seed in range(args.seeds):
        tasks.append(("baseline", seed, [], None))
        for i, (rule, flags) in enumerate(RULES.items()):
            if seed >= args.rule_seeds[i]:
                continue  # fewer seeds for this rule (time)
            tasks.append((rule, seed, flags, None))
            tasks.append((f"random at {rule}", seed, None, rule))
    running: list[tuple[subprocess.Popen, str, int]] = []
    while tasks or running:
        for proc, name, seed in list(running):
            if proc.poll() is not None:
                running.remove((proc, name, seed))
                print(time.strftime("%H:%M:%S"), "done", name, "seed", seed, "rc", proc.returncode, flush=True)
        for task in list(tasks):
            if len(running) >= args.workers:
                break
            name, seed, flags, depends = task
            if summary_of(args, name, seed) is not None:
                tasks.remove(task)
                continue
            if (Path(args.out) / "runs" / f"{slug(name)}-s{seed}").exists():
                continue  # started by an earlier driver and still running: wait for its summary
            if depends is not None:
                base = summary_of(args, depends, seed)
                if base is None:
                    if not any(n == depends and s == seed for _, n, s in running) and not any(
                            t[0] == depends and t[1] == seed for t in tasks):
                        tasks.remove(task)  # the rule's run failed: no control
                    continue
                hot_share = 0.62
                if base["staleness"]["rule"] == "loss":  # the hot share of inputs, as the tuned stale run saw it
                    tuned = summary_of(args, next(iter(RULES)), seed)
                    if tuned is None:
                        continue
                    hot_share = tuned["staleness"]["hot_inputs_seen"] / max(tuned["staleness"]["inputs_seen"], 1)
                flags = random_flags(depends, base, hot_share)
            tasks.remove(task)
            running.append((launch(args, name, seed, flags, config), name, seed))
        time.sleep(2)


def curve(run_dir: Path) -> list[dict[str, float]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"trained": e["samples"], "cpu": e["train_cpu_s"], "auc": e["val_auc"]} for e in events
            if e.get("val_auc") is not None]


def interp(points: list[dict[str, float]], x_key: str, x: float) -> float | None:
    xs = [p[x_key] for p in points]
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    return float(np.interp(x, xs, [p["auc"] for p in points]))


def first_crossing(points: list[dict[str, float]], x_key: str, target: float) -> float | None:
    for a, b in zip(points, points[1:], strict=False):
        if b["auc"] >= target > a["auc"]:
            return a[x_key] + (target - a["auc"]) / (b["auc"] - a["auc"]) * (b[x_key] - a[x_key])
    return points[0][x_key] if points and points[0]["auc"] >= target else None


def ci(values: list[float]) -> dict[str, Any]:
    n = len(values)
    mean = float(np.mean(values))
    half = T_95[n - 1] * float(np.std(values, ddof=1)) / math.sqrt(n) if n > 1 else None
    return {"mean": mean, "ci95": half, "n": n, "values": values}


def report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for summary_path in sorted((out / "runs").glob("*/summary.json")):
        run_dir = summary_path.parent
        name, seed = run_dir.name.rsplit("-s", 1)
        summary = json.loads(summary_path.read_text())
        runs.setdefault(name, {})[int(seed)] = {
            "summary": {k: summary.get(k) for k in ("auc", "logloss", "train_samples", "skipped_fraction",
                                                    "train_cpu_s", "train_wall_s")},
            "val_final": curve(run_dir)[-1]["auc"] if curve(run_dir) else None,
            "curve": curve(run_dir),
            "staleness": summary.get("staleness"),
            "config": {k: v for k, v in summary.get("config", {}).items() if k.startswith(("skip", "stale", "prune"))},
        }
    base = runs.get("baseline", {})
    rows = []
    for rule in RULES:
        mine, control = runs.get(slug(rule), {}), runs.get(slug(f"random at {rule}"), {})
        seeds = sorted(set(mine) & set(control) & set(base))
        if not seeds:
            continue
        d_random = [mine[s]["val_final"] - control[s]["val_final"] for s in seeds]
        d_random_test = [mine[s]["summary"]["auc"] - control[s]["summary"]["auc"] for s in seeds]
        d_early = []
        for s in seeds:
            early = interp(base[s]["curve"], "trained", mine[s]["curve"][-1]["trained"])
            d_early.append(mine[s]["val_final"] - early if early is not None else float("nan"))
        d_base = [mine[s]["val_final"] - base[s]["val_final"] for s in seeds]
        speed = {}
        for margin in TARGET_MARGINS:
            ratios = []
            for s in seeds:
                target = base[s]["val_final"] - margin
                tb = first_crossing(base[s]["curve"], "cpu", target)
                tr = first_crossing(mine[s]["curve"], "cpu", target)
                ratios.append(tb / tr if tb and tr else float("nan"))
            speed[f"-{margin:g}"] = ratios
        rows.append({
            "rule": rule, "seeds": seeds,
            "skipped_fraction": ci([mine[s]["summary"]["skipped_fraction"] for s in seeds]),
            "random_skipped_fraction": ci([control[s]["summary"]["skipped_fraction"] for s in seeds]),
            "val_auc_minus_random": ci(d_random), "test_auc_minus_random": ci(d_random_test),
            "val_auc_minus_early_stop": ci(d_early), "val_auc_minus_baseline": ci(d_base),
            "cpu_speedup_to_target": speed,
            "cpu_speedup_median": {k: (None if all(math.isnan(v) for v in vals) else float(np.nanmedian(vals)))
                                   for k, vals in speed.items()},
        })
    stamps = sorted(p.stat().st_mtime for p in (out / "runs").glob("*/summary.json"))
    when = " to ".join(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) for t in (stamps[0], stamps[-1]))
    first = next(iter(next(iter(runs.values())).values()))
    provenance = {
        "command": "nice -n 10 python -m benchmarks.skip_rules run --out DIR " + " ".join(args.run_flags or []),
        "machine": f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), one torch thread per "
                   f"run at niceness 10, shared with other jobs (load average {args.load or 'not recorded'})",
        "date": when + " (last run finished)",
        "data": f"synthetic generator v4, scale 0.05, {args.rows:,} rows, {args.epochs} epochs, dataset seed 0",
        "source": "docs/experiments/skip-rules/ (results.json, report.md, auc.png)",
    }
    del first
    results = {"command": " ".join(sys.argv), "provenance": provenance, "rows": rows, "runs": runs,
               "settings": vars(args)}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    lines = ["| rule | skipped (rule / random) | val AUC − random | test AUC − random | val AUC − baseline stopped "
             "at the same trained samples | val AUC − full baseline "
             "| CPU-time speedup to baseline − 0.0005 / − 0.001 / − 0.002 |",
             "|---|---|---|---|---|---|---|"]

    def fmt(c: dict[str, Any]) -> str:
        return f"{c['mean']:+.4f} ± {c['ci95']:.4f}" if c["ci95"] is not None else f"{c['mean']:+.4f}"

    for r in rows:
        sp = " / ".join("–" if all(math.isnan(v) for v in vals) else
                        f"{np.nanmedian(vals):.2f}x" for vals in r["cpu_speedup_to_target"].values())
        lines.append(f"| {r['rule']} | {r['skipped_fraction']['mean']:.3f} / "
                     f"{r['random_skipped_fraction']['mean']:.3f} "
                     f"| {fmt(r['val_auc_minus_random'])} | {fmt(r['test_auc_minus_random'])} "
                     f"| {fmt(r['val_auc_minus_early_stop'])} | {fmt(r['val_auc_minus_baseline'])} | {sp} |")
    lines += ["",
              "| run | hot inputs / inputs seen while classifying | skip bookkeeping, share of the loop's wall time |",
              "|---|---|---|"]
    for name, by_seed in sorted(runs.items()):
        blocks = [r["staleness"] for r in by_seed.values() if r["staleness"]]
        if not blocks:
            continue
        hot = [b["hot_inputs_seen"] / b["inputs_seen"] for b in blocks if b.get("hot_inputs_seen") is not None
               and b.get("inputs_seen")]
        over = [b["skip_overhead_s"] / r["summary"]["train_wall_s"] for b, r in
                zip(blocks, by_seed.values(), strict=False) if r["summary"].get("train_wall_s")]
        lines.append(f"| {name} | {np.mean(hot):.3f} |" if hot else f"| {name} | – |")
        lines[-1] += f" {np.mean(over):.3f} |" if over else " – |"
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(runs, out / "auc.png")
    print("\n".join(lines))


def plot(runs: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    from slipcache.plotting import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, by_seed in sorted(runs.items()):
        if 0 not in by_seed:
            continue
        pts = by_seed[0]["curve"]
        style = "--" if name.startswith("random") else "-"
        for ax, key in zip(axes, ("trained", "cpu"), strict=True):
            ax.plot([p[key] for p in pts], [p["auc"] for p in pts], style, label=name, lw=1.2)
    axes[0].set_xlabel("trained samples")
    axes[1].set_xlabel("training-loop CPU seconds (one torch thread)")
    for ax in axes:
        ax.set_ylabel("validation AUC (seed 0)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.skip_rules", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--out", default="docs/experiments/skip-rules")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=600_000, help="synthetic rows (v4, scale 0.05; 80/10/10)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=60_000)
    parser.add_argument("--eval-samples", type=int, default=60_000, help="validation samples per evaluation")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run-flags", nargs="*", help="report: the flags `run` was given (for the provenance)")
    parser.add_argument("--load", help="report: the load average during the runs (for the provenance)")
    parser.add_argument("--rule-seeds", type=lambda v: [int(x) for x in v.split(",")], default=[99, 99, 99],
                        help="seeds per rule, in the order of RULES (default: all)")
    args = parser.parse_args(argv)
    run(args) if args.command == "run" else report(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
