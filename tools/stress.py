"""Stress test of training runs: kill -9 at random moments, flipped checkpoint bytes, a full disk, bad input.

Not part of CI (it takes minutes). Usage:

    PYTHONPATH=src nice python tools/stress.py --workdir /tmp/slipcache-stress --kills 20 --flips 40

1. Reference: one uninterrupted small training run (`slipcache train` in a subprocess).
2. Kill trials: start the same run, SIGKILL it at a random moment, continue it the way a user would
   (`--resume RUN` when the run directory holds a run, the original command when it does not), sometimes
   killing the continuation too, until it finishes; then compare the final checkpoint's tensors and
   progress, the metrics.jsonl events (timing fields aside) and summary.json with the reference's.
3. Byte flips: flip 1-4 random bytes of the reference's final checkpoint; `slipcache eval` and
   `--resume` must either fail with one line or (a harmless flip in the header's padding) give exactly
   the undamaged results.
4. Full disk (needs root for a tmpfs; skipped otherwise): the run directory on a tmpfs too small for the
   first checkpoint, then for the second; after the one-line error, the tmpfs grows and `--resume`
   must finish with the reference's results.
5. Bad input: a list of known bad inputs through the CLI; each must exit 2 with one line on stderr.
6. Ownership (tools/stress_runs.py): two writers on one run directory (the second refused in one line, the
   first identical to the reference); each resumable setting changed with --allow-changes (refused
   without it; the final checkpoint holds the new value); the data regenerated or bytes flipped under a
   run (eval and --resume refuse in one line what the fingerprint sees).

7. Paths (tools/stress_paths.py): a link planted at each file or directory a resumed run writes (the
   victim untouched; the link replaced or refused in one line); `export --force` aimed at its own run,
   its parent, a directory inside it and a directory holding another run (refused, nothing changed);
   runs moved between 2 processes (torchrun) and 1 with kills in between (each continuation resumes
   from the newest complete checkpoint, whoever wrote it).

A failure is any mismatch, traceback or multi-line error; the tool prints a JSON summary and exits 1
when there was one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import stress_paths  # tools/, beside this file
import stress_runs
import torch

from slipcache.cli import main as cli_main
from slipcache.training import checkpoint

# Small enough for ~10 s per run on a loaded 2-core machine; cached int8 embeddings, the real path.
RUN_CONFIG = {
    "synthetic_samples": 40_000,
    "synthetic_scale": 0.002,
    "samples": 24_576,
    "batch_size": 256,
    "bottom_mlp": [64, 16],
    "top_mlp": [64, 1],
    "eval_samples": 2_000,
    "checkpoint_every": 3_072,
    "log_every": 1_024,
    "eval_every": 6_144,
}
SUMMARY_KEYS = ("auc", "logloss", "accuracy", "normalized_entropy", "train_samples", "cache_hit_rate")


def timing_free(value: Any) -> Any:
    """Events and progress without wall-clock fields, which differ between any two runs (a checkpoint
    event's bytes too: the file holds the events before it, timings included)."""
    if isinstance(value, dict):
        return {
            k: timing_free(v)
            for k, v in value.items()
            if not (k.endswith("_s") or k.endswith("seconds") or k in ("events", "bytes"))
        }
    if isinstance(value, list):
        return [timing_free(v) for v in value]
    return value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def outcome(run: Path) -> dict[str, Any]:
    """What a finished run leaves that must not depend on interruptions."""
    state = checkpoint.load_checkpoint(run / "checkpoints")
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "dense": state["dense"],
        "embeddings": state["embeddings"],
        "progress": timing_free(state["progress"]),
        "events": timing_free(events),
        "summary": {k: summary[k] for k in SUMMARY_KEYS},
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if not same(a[k], b[k])]


class Runner:
    """`slipcache train` in subprocesses with a fixed environment."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir = workdir
        self.config = config
        # A snapshot of the package: edits to the working tree during the (long) run cannot mix versions.
        src = workdir / "src"
        shutil.copytree(Path(__file__).resolve().parents[1] / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
        self.env = {
            **os.environ,
            "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1",
            "SLIPCACHE_CACHE_DIR": str(workdir / "cache"),
        }

    def command(self, run: Path) -> list[str]:
        """How a user continues `run`: --resume when it holds a run, else the original command."""
        base = [sys.executable, "-m", "slipcache.cli", "train", "--no-progress"]
        if (run / "config.json").is_file():
            return [*base, "--resume", str(run)]
        return [*base, "--config", str(self.config), "--out", str(run)]

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(args, env=self.env, stdout=out, stderr=out, cwd=self.workdir)

    def run(self, args: list[str], log: Path, timeout: float = 600) -> int:
        process = self.start(args, log)
        return process.wait(timeout=timeout)


def _stamp(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def wait_until_training(process: subprocess.Popen, run: Path) -> float | None:
    """Seconds until the process has (re)written the run's metrics.jsonl, i.e. set the run up and is
    about to train (None if it exited first). Startup before that is mostly importing torch."""
    before = _stamp(run / "metrics.jsonl")
    started = time.perf_counter()
    while process.poll() is None:
        if _stamp(run / "metrics.jsonl") != before:
            return time.perf_counter() - started
        time.sleep(0.02)
    return None


def kill_trial(runner: Runner, run: Path, log: Path, timing: dict[str, float], rng: random.Random) -> dict[str, Any]:
    """Kill the run at a random moment (again with probability 0.3 per continuation, at most 3 kills),
    then let it finish. One kill in five lands during startup, the others uniformly over the time the
    reference spent setting up and training. Returns what happened."""
    kills: list[str] = []
    stages: list[str] = []
    while True:
        args = runner.command(run)
        stages.append("resume" if "--resume" in args else "start")
        process = runner.start(args, log)
        if len(kills) == 0 or (len(kills) < 3 and rng.random() < 0.3):
            during_startup = rng.random() < 0.2
            if during_startup:
                delay = rng.uniform(0.1, 1.0) * timing["startup"]
            else:  # the reference's time from setup to exit, less its final test evaluation and report
                delay = rng.uniform(0.0, 0.8) * timing["training"]
                if wait_until_training(process, run) is None:
                    delay = 0.0
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
                kills.append(f"{'startup' if during_startup else 'training'} +{delay:.2f}s")
                continue
        code = process.wait(timeout=900)
        if not kills:  # it finished before the kill: a trial needs one, so start it over
            shutil.rmtree(run)
            stages.clear()
            continue
        if code != 0:
            return {"kills": kills, "stages": stages, "error": f"exit {code}; see {log}"}
        return {"kills": kills, "stages": stages}


def flip_trials(reference: Path, workdir: Path, trials: int, rng: random.Random) -> list[dict[str, Any]]:
    """Flip bytes of the final checkpoint; eval and resume must fail in one line or be unaffected."""
    latest = reference / "checkpoints" / checkpoint.LATEST
    clean = cli(["eval", "--checkpoint", str(latest), "--samples", "2000"])
    results = []
    for i in range(trials):
        data = bytearray(latest.read_bytes())
        positions = sorted(rng.randrange(len(data)) for _ in range(rng.randint(1, 4)))
        for p in positions:
            data[p] ^= rng.randint(1, 255)
        damaged = workdir / "flips" / f"flip-{i}.pt"
        damaged.parent.mkdir(parents=True, exist_ok=True)
        damaged.write_bytes(bytes(data))
        got = cli(["eval", "--checkpoint", str(damaged), "--samples", "2000"])
        results.append(classify(got, clean, positions, "eval"))
        # The same damage in a run's latest.pt under --resume (a copy of the finished reference run).
        run = workdir / "flips" / f"run-{i}"
        shutil.copytree(reference, run)
        target = run / "checkpoints" / checkpoint.LATEST
        target.unlink()  # a hard link to the newest periodic file: damage a copy, as a disk would
        target.write_bytes(bytes(data))
        resumed = cli(["train", "--resume", str(run), "--no-progress"])
        results.append(classify(resumed, None, positions, "resume"))
        shutil.rmtree(run)
    return results


def classify(got: dict[str, Any], clean: dict[str, Any] | None, positions: list[int], what: str) -> dict[str, Any]:
    in_header = all(p < checkpoint.HEADER_BYTES for p in positions)
    result = {"what": what, "positions": positions, "in_header": in_header, "code": got["code"]}
    if got["code"] == 2 and got["one_line"]:
        result["verdict"] = "one-line error"
        result["message"] = got["err"].strip()[:160]
    elif got["code"] == 0 and clean is not None and got["out"] == clean["out"]:
        result["verdict"] = "unaffected"  # e.g. a space of the header's padding turned into a tab
    elif got["code"] == 0 and clean is None and in_header:
        result["verdict"] = "unaffected"
    else:
        result["verdict"] = "FAILURE"
        result["message"] = (got["err"] or got["out"]).strip()[-300:]
    return result


def cli(argv: list[str]) -> dict[str, Any]:
    """The `slipcache` command in this process; a traceback counts as exit code 99."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
        except Exception as exc:  # noqa: BLE001 - this is what the tool looks for
            code = 99
            print(f"TRACEBACK {type(exc).__name__}: {exc}", file=err)
    errors = [line for line in err.getvalue().splitlines() if "warning:" not in line]
    return {"code": code, "out": out.getvalue(), "err": "\n".join(errors), "one_line": len(errors) == 1}


def full_disk_trials(runner: Runner, workdir: Path, reference: Path, expected: dict[str, Any]) -> list[dict[str, Any]]:
    """The run directory on a tmpfs that fills at the first, then at the second checkpoint."""
    if os.geteuid() != 0:
        return [{"skipped": "needs root to mount a tmpfs"}]
    ckpt_bytes = (reference / "checkpoints" / checkpoint.LATEST).stat().st_size
    results = []
    for name, size in (("first checkpoint", ckpt_bytes // 2), ("second checkpoint", int(ckpt_bytes * 1.6))):
        mount = workdir / f"disk-{name.split()[0]}"
        mount.mkdir(exist_ok=True)
        kib = max(size // 1024, 64)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mount)]).returncode:
            return [{"skipped": "mount -t tmpfs failed"}]
        try:
            run = mount / "run"
            log = workdir / f"disk-{name.split()[0]}.log"
            process = subprocess.run(
                [sys.executable, "-m", "slipcache.cli", "train", "--no-progress", "--config", str(runner.config),
                 "--out", str(run)],
                env=runner.env, capture_output=True, text=True, cwd=workdir,
            )  # fmt: skip
            log.write_text(process.stdout + process.stderr)
            errors = [line for line in process.stderr.splitlines() if line.strip()]
            result: dict[str, Any] = {"full_at": name, "tmpfs_kib": kib, "code": process.returncode,
                                      "message": errors[-1] if errors else ""}  # fmt: skip
            result["one_line"] = len(errors) == 1 and process.returncode == 2 and "No space left" in errors[0]
            left = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
            result["checkpoints_left"] = left
            subprocess.run(["mount", "-o", "remount,size=65536k", str(mount)], check=True)
            code = runner.run(runner.command(run), log)
            result["resumed_code"] = code
            result["matches_reference"] = code == 0 and not differences(outcome(run), expected)
            result["verdict"] = "ok" if result["one_line"] and result["matches_reference"] else "FAILURE"
            results.append(result)
        finally:
            subprocess.run(["umount", str(mount)])
    return results


def bad_input_trials(workdir: Path, reference: Path) -> list[dict[str, Any]]:
    """Known bad inputs through the CLI: each must exit 2 with one line."""
    bad = workdir / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "notes.txt").write_text("a user's file\n")
    long_line = bad / "long-line.tsv"
    good = "\t".join(["1"] + ["3"] * 13 + ["0000abcd"] * 26)
    with open(long_line, "w") as f:  # a 50 MB line without tabs between two good lines
        f.write(good + "\n" + "x" * 50_000_000 + "\n" + good + "\n")
    strays = bad / "data-dir"
    strays.mkdir(exist_ok=True)
    (strays / "day_0.tsv").write_text((good + "\n") * 50)
    (strays / "NOTES.md").write_text("# my notes\n")
    huge_dense = bad / "huge-dense.tsv"
    huge_dense.write_text((good + "\n") * 20 + "\t".join(["1", "1" * 44] + ["3"] * 12 + ["0000abcd"] * 26) + "\n")
    state = checkpoint.load_checkpoint(reference / "checkpoints")
    crafted = bad / "crafted.pt"
    checkpoint.save_checkpoint(crafted, {**state, "config": {**state["config"], "lr": "fast"}})
    old = bad / "old-format.pt"
    torch.save({"format": "slipcache-checkpoint", "version": 1}, old)
    fresh = str(bad / "run")
    other_run = bad / "other-run"
    shutil.copytree(reference, other_run)
    cases = [
        ("--cache-size inf", ["train", "--out", fresh, "--cache-size", "inf"]),
        ("--lr inf", ["train", "--out", fresh, "--lr", "inf"]),
        ("--seed -1", ["train", "--out", fresh, "--seed", "-1"]),
        ("--out naming a file", ["train", "--out", str(bad / "notes.txt")]),
        ("--out under a file", ["train", "--out", str(bad / "notes.txt" / "run")]),
        ("--out a non-empty non-run directory", ["train", "--out", str(bad)]),
        ("--out an existing run", ["train", "--out", str(reference)]),
        ("--resume RUN --quick (changes the run)", ["train", "--resume", str(reference), "--quick"]),
        ("--resume A --out existing run B", ["train", "--resume", str(reference), "--out", str(other_run)]),
        ("eval --samples 0", ["eval", "--checkpoint", str(reference), "--samples", "0"]),
        ("eval of a crafted checkpoint (lr: 'fast')", ["eval", "--checkpoint", str(crafted)]),
        ("eval of a format-1 checkpoint", ["eval", "--checkpoint", str(old)]),
        ("--strict with a 44-digit dense value", ["train", "--out", fresh, "--data", str(huge_dense), "--strict"]),
        ("a stray file in a data directory", ["train", "--out", fresh, "--data", str(strays)]),
        ("--strict with a 50 MB line", ["train", "--out", fresh, "--data", str(long_line), "--strict"]),
        ("--lr 1e308", ["train", "--out", fresh, "--lr", "1e308"]),
        ('--out ""', ["train", "--out", ""]),
        ("synth --out a non-empty non-dataset directory", ["synth", "--out", str(bad), "--samples", "100"]),
        ("preprocess --max-rows 3000000000", ["preprocess", str(huge_dense), "--out", fresh, "--vocab", "hash",
                                              "--max-rows", "3000000000"]),
    ]  # fmt: skip
    results = []
    for name, argv in cases:
        got = cli([*argv, "--no-progress"] if argv[0] == "train" else argv)
        ok = got["code"] == 2 and got["one_line"]
        results.append({"input": name, "code": got["code"], "message": got["err"].strip()[:240],
                        "verdict": "one-line error" if ok else "FAILURE"})  # fmt: skip
        shutil.rmtree(fresh, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/slipcache-stress"))
    parser.add_argument("--kills", type=int, default=20, help="kill/resume trials (default 20)")
    parser.add_argument("--flips", type=int, default=20, help="byte-flip trials (each: eval and resume)")
    parser.add_argument("--concurrent", type=int, default=6, help="two-writer trials (default 6)")
    parser.add_argument("--data-trials", type=int, default=9, help="data changed under a run (default 9)")
    parser.add_argument("--chains", type=int, default=3, help="runs moved between 2 processes and 1 with kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    workdir = args.workdir.resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    os.environ["SLIPCACHE_CACHE_DIR"] = str(workdir / "cache")
    config = workdir / "run-config.json"
    config.write_text(json.dumps(RUN_CONFIG))
    runner = Runner(workdir, config)

    reference = workdir / "reference"
    runner.run(runner.command(reference), workdir / "reference.log")  # generates the data set first
    shutil.rmtree(reference)
    started = time.perf_counter()
    process = runner.start(runner.command(reference), workdir / "reference.log")
    startup = wait_until_training(process, reference) or 0.0
    if process.wait():
        print(f"reference run failed; see {workdir / 'reference.log'}")
        return 1
    duration = time.perf_counter() - started
    timing = {"startup": startup, "training": duration - startup}
    expected = outcome(reference)
    print(f"reference: {duration:.1f} s ({startup:.1f} s startup), {len(expected['events'])} events", flush=True)

    kills = []
    for i in range(args.kills):
        run = workdir / f"kill-{i}"
        trial = kill_trial(runner, run, workdir / f"kill-{i}.log", timing, rng)
        if "error" not in trial:
            diff = differences(outcome(run), expected)
            leftovers = [p.name for p in run.rglob(".*") if p.is_file()]
            trial["verdict"] = "FAILURE" if diff or leftovers else "identical"
            if diff or leftovers:
                trial["differs"] = diff
                trial["leftover_temp_files"] = leftovers
        else:
            trial["verdict"] = "FAILURE"
        kills.append(trial)
        print(f"kill {i}: {trial}", flush=True)
        if trial["verdict"] != "FAILURE":
            shutil.rmtree(run)

    owners = stress_runs.concurrent_trials(runner, workdir, expected, args.concurrent, outcome, differences)
    print(f"concurrent writers: {[t['verdict'] for t in owners]}", flush=True)
    skipping = workdir / "reference-skipping"
    runner.run(stress_runs.train_command(runner, skipping, "--skip-rule", "stale", "--stale-warmup", "none"),
               workdir / "reference-skipping.log")  # fmt: skip
    changes = stress_runs.changed_setting_trials(cli, workdir, reference, skipping)
    print(f"changed settings: {[t['verdict'] for t in changes]}", flush=True)
    data_changes = stress_runs.changed_data_trials(cli, runner, workdir, args.data_trials, rng)
    print(f"changed data: {[t['verdict'] for t in data_changes]}", flush=True)
    links = stress_paths.link_trials(cli, workdir, reference)
    print(f"linked run files: {[t['verdict'] for t in links]}", flush=True)
    exports = stress_paths.export_trials(cli, workdir, reference)
    print(f"export at its own run: {[t['verdict'] for t in exports]}", flush=True)
    chains = [stress_paths.chain_trial(runner, workdir, i, rng, duration) for i in range(args.chains)]
    print(f"2 -> 1 -> 2 chains: {[t['verdict'] for t in chains]}", flush=True)
    flips = flip_trials(reference, workdir, args.flips, rng)
    disk = full_disk_trials(runner, workdir, reference, expected)
    bad = bad_input_trials(workdir, reference)
    report = {
        "run_config": RUN_CONFIG,
        "reference_seconds": {k: round(v, 1) for k, v in timing.items()},
        "kill_trials": len(kills),
        "kills": sum(len(t["kills"]) for t in kills),
        "kill_failures": sum(t["verdict"] == "FAILURE" for t in kills),
        "continued_by": {
            "resume": sum(s == "resume" for t in kills for s in t["stages"][1:]),
            "rerun (no run directory yet)": sum(s == "start" for t in kills for s in t["stages"][1:]),
        },
        "flip_trials": len(flips),
        "flip_failures": sum(r["verdict"] == "FAILURE" for r in flips),
        "flip_verdicts": {v: sum(r["verdict"] == v for r in flips) for v in {r["verdict"] for r in flips}},
        "concurrent_trials": len(owners),
        "concurrent_failures": sum(t["verdict"] == "FAILURE" for t in owners),
        "changed_setting_trials": len(changes),
        "changed_setting_failures": sum(t["verdict"] == "FAILURE" for t in changes),
        "changed_data_trials": len(data_changes),
        "changed_data_verdicts": {
            v: sum(t["verdict"] == v for t in data_changes) for v in {t["verdict"] for t in data_changes}
        },
        "link_verdicts": {t["file"]: t["verdict"] for t in links},
        "export_verdicts": {t["out"]: t["verdict"] for t in exports},
        "chain_trials": len(chains),
        "chain_kills": sum(s["killed"] for t in chains for s in t["steps"]),
        "chain_failures": sum(t["verdict"] == "FAILURE" for t in chains),
        "disk": disk,
        "bad_input": bad,
        "concurrent_details": owners,
        "changed_setting_details": changes,
        "changed_data_details": data_changes,
        "kill_details": kills,
        "link_details": links,
        "chain_details": chains,
        "flip_details": flips,
    }
    failures = report["kill_failures"] + report["flip_failures"] + report["concurrent_failures"]
    failures += report["changed_setting_failures"] + sum(t["verdict"] == "FAILURE" for t in data_changes)
    failures += sum(d.get("verdict") == "FAILURE" for d in disk) + sum(b["verdict"] == "FAILURE" for b in bad)
    failures += sum(t["verdict"] == "FAILURE" for t in [*links, *exports, *chains])
    report["failures"] = failures
    text = json.dumps(report, indent=1, default=str)
    (workdir / "stress.json").write_text(text)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("details")}, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
