"""`slipcache train` with its default threads against `--threads 1` and `--threads 2`, with and without
competing busy processes, interleaved: does the default hold on a shared machine?

Each run is a fresh `slipcache train` process (the thread policy is chosen at process start), timed from
start to exit; its summary.json gives the loop's samples/s. A round runs every variant once per load
(0, then N busy-looping processes started for the runs and stopped after), the variants' order rotating
from round to round. Prints per load and variant the wall time and samples/s as median [min-max] over the
rounds, the ratio to `--threads 1` and the load average before and after each run. Run from the repository
root (the figures in docs/threads.md come from this command):

    python -m benchmarks.busy_threads --rounds 3 --load 0 2 --json busy.json -- --quick --samples 40000

A variant is `LABEL=ARGS`: extra `slipcache train` arguments, optionally led by `NAME=VALUE` environment
settings (`--variant "spin=OMP_WAIT_POLICY=ACTIVE"`). With `--json FILE`, the rounds add to those the file
already holds and the table covers them all: on a shared machine, one round at a time under its lock.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_VARIANTS = ["default=", "threads 1=--threads 1", "threads 2=--threads 2"]
BUSY = "while True: pass"


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """'LABEL=[NAME=VALUE ...] ARGS' -> (label, environment, train arguments)."""
    label, _, rest = text.partition("=")
    env: dict[str, str] = {}
    args = shlex.split(rest)
    while args and "=" in args[0] and not args[0].startswith("-"):
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    return label, env, args


def run_once(train_args: list[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """One `slipcache train` process: wall seconds, the loop's samples/s and the load around it."""
    before = os.getloadavg()[0]
    command = [sys.executable, "-m", "slipcache.cli", "train", *train_args, "--quiet", "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": wall, "samples_per_s": summary["samples_per_s"], "train_wall_s": summary["train_wall_s"],
            "auc": summary["auc"], "load_before": before, "load_after": os.getloadavg()[0]}


def start_load(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]


def stop_load(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def report(results: dict[tuple[int, str], list[dict[str, Any]]], labels: list[str], loads: list[int]) -> str:
    lines = ["| busy processes | variant | wall s | train samples/s | wall / threads 1 | load avg (1 min) |",
             "|---|---|---|---|---|---|"]
    for load in loads:
        reference = results.get((load, "threads 1"))
        for label in labels:
            runs = results[(load, label)]
            walls = [r["wall_s"] for r in runs]
            ratio = (f"{statistics.median(walls) / statistics.median([r['wall_s'] for r in reference]):.2f}x"
                     if reference else "n/a")
            loadavg = [v for r in runs for v in (r["load_before"], r["load_after"])]
            lines.append(f"| {load} | {label} | {spread(walls, '.1f')} | "
                         f"{spread([r['samples_per_s'] for r in runs], ',.0f')} | {ratio} | "
                         f"{min(loadavg):.1f}-{max(loadavg):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy_threads", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", dest="variants", metavar="LABEL=ARGS",
                        help=f"a configuration to compare (repeatable; default: {'; '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy processes per condition")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    parser.add_argument("train_args", nargs="*", help="after --: arguments for every `slipcache train` run")
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in (args.variants or DEFAULT_VARIANTS)]
    labels = [label for label, _, _ in variants]
    results: dict[tuple[int, str], list[dict[str, Any]]] = {(n, label): [] for n in args.load for label in labels}
    saved = Path(args.json) if args.json else None
    if saved is not None and saved.is_file():
        for key, runs in json.loads(saved.read_text())["runs"].items():
            n, label = key.split(" busy / ", 1)
            results.setdefault((int(n), label), []).extend(runs)
    done = min(len(runs) for runs in results.values())
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    with tempfile.TemporaryDirectory(prefix="busy-threads-") as scratch:
        for r in range(done, done + args.rounds):
            loads = args.load if r % 2 == 0 else args.load[::-1]
            for n in loads:
                load = start_load(n)
                try:
                    order = variants[r % len(variants):] + variants[: r % len(variants)]
                    for label, env, extra in order:
                        out = Path(scratch) / f"r{r}-l{n}-{label.replace(' ', '_')}"
                        result = run_once([*args.train_args, *extra], env, out)
                        results[(n, label)].append(result)
                        print(f"round {r + 1}, {n} busy, {label}: {result['wall_s']:.1f} s wall, "
                              f"{result['samples_per_s']:,.0f} samples/s, load {result['load_before']:.1f}"
                              f"->{result['load_after']:.1f}", flush=True)
                finally:
                    stop_load(load)
    print(report(results, labels, args.load))
    if saved is not None:
        saved.write_text(json.dumps(
            {"train_args": args.train_args, "variants": args.variants or DEFAULT_VARIANTS,
             "runs": {f"{n} busy / {label}": runs for (n, label), runs in results.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
