"""tools/stress.py's trials of where a run writes and what it resumes from: links planted in a run
directory, runs moved between 2 processes and 1 with kills in between, and `export` aimed at its own run.
Each trial returns a dict with a "verdict" ("FAILURE" counts)."""

from __future__ import annotations

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

from slipcache.training.saved_run import find_checkpoint

# Files and directories a resumed run writes; a link at each, to a victim outside the run.
LINKED = ("metrics.jsonl", "config.json", "summary.json", "report.md", "training.png", "run.lock", "checkpoints")


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def link_trials(cli: Any, workdir: Path, reference: Path) -> list[dict[str, Any]]:
    """A copy of the finished reference with one run file replaced by a link to a victim, resumed: the
    victim must be untouched, and the resume either replaced the link by a regular file (exit 0) or
    refused it in one line (exit 2)."""
    results = []
    for name in LINKED:
        run, victim = workdir / f"link-{name}", workdir / f"victim-{name}"
        shutil.copytree(reference, run, symlinks=True)
        target = run / name
        if target.is_dir():
            target.rename(victim)
        else:
            target.unlink(missing_ok=True)
            victim.write_text("precious\n")
        target.symlink_to(victim)
        before = _files(victim) if victim.is_dir() else victim.read_bytes()
        got = cli(["train", "--resume", str(run), "--no-progress"])
        after = _files(victim) if victim.is_dir() else victim.read_bytes()
        replaced = got["code"] == 0 and not target.is_symlink()
        refused = got["code"] == 2 and got["one_line"] and "is a symbolic link" in got["err"]
        verdict = "FAILURE" if after != before or not (replaced or refused) else "replaced" if replaced else "refused"
        results.append({"file": name, "code": got["code"], "verdict": verdict, "err": got["err"][-300:]})
        shutil.rmtree(run)
        shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    return results


def export_trials(cli: Any, workdir: Path, reference: Path) -> list[dict[str, Any]]:
    """`export --force` aimed at the run it reads (the run, its parent, a directory inside it) and at a
    directory holding another run: refused in one line, nothing under the run changed."""
    home = workdir / "export-home"
    run = home / "run"
    shutil.copytree(reference, run, symlinks=True)
    other = workdir / "export-other"
    shutil.copytree(reference, other / "nested" / "run", symlinks=True)
    results = []
    for what, out in (("the run", run), ("its parent", home), ("inside it", run / "exported"), ("another run", other)):
        before = _files(home), _files(other)
        got = cli(["export", "--checkpoint", str(run), "--out", str(out), "--force", "--format", "int8"])
        untouched = (_files(home), _files(other)) == before
        ok = got["code"] == 2 and got["one_line"] and untouched
        results.append({"out": what, "code": got["code"], "verdict": "refused" if ok else "FAILURE",
                        "err": got["err"][-300:]})
    shutil.rmtree(home)
    shutil.rmtree(other)
    return results


def _samples_of(run: Path) -> int | None:
    """Samples of the newest complete checkpoint of `run` (None: none yet)."""
    try:
        saved = find_checkpoint(run, "--resume")
    except Exception:  # noqa: BLE001 - no run directory yet
        return None
    name = saved.path.name
    if name == "latest.pt":  # a hard link to its periodic file
        same = [p for p in saved.path.parent.glob("ckpt-*.pt") if p.samefile(saved.path)]
        name = same[0].name if same else ""
    digits = "".join(c for c in name if c.isdigit())
    return int(digits) if digits else None


def chain_trial(runner: Any, workdir: Path, index: int, rng: random.Random, seconds: float) -> dict[str, Any]:
    """One run started by 2 processes (torchrun) and continued by 1 (a one-process checkpoint does not resume
    on 2), the first start killed at a random
    moment and each continuation with probability 0.5 (at most 4 kills), until it finishes (a first start
    that finished before its kill is started over). Every continuation changes
    --eval-samples (with --allow-changes), so config.json records the samples each one resumed from; each
    must be the newest complete checkpoint there was when it started."""
    run, log = workdir / f"chain-{index}", workdir / f"chain-{index}.log"
    steps: list[dict[str, Any]] = []
    kills, world = 0, 2
    for attempt in range(12):
        newest = _samples_of(run)
        base = [sys.executable, "-m", "slipcache.cli", "train", "--no-progress"]
        if world == 2:
            base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "slipcache.cli", "train", "--no-progress"]
        if (run / "config.json").is_file():
            args = [*base, "--resume", str(run), "--allow-changes", "--eval-samples", str(1000 + attempt)]
        else:
            args = [*base, "--config", str(runner.config), "--out", str(run)]
        with open(log, "ab") as out:
            process = subprocess.Popen(args, env=runner.env, stdout=out, stderr=out, cwd=runner.workdir,
                                       start_new_session=True)
        killed = False
        if kills == 0 or (kills < 4 and rng.random() < 0.5):  # the first always: the run must change hands
            try:
                process.wait(timeout=rng.uniform(0.3, 1.0) * seconds)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                killed, kills = True, kills + 1
                time.sleep(0.5)  # the group's processes are gone before the next start
        code = process.wait(timeout=900)
        if kills == 0:  # finished before the kill: the trial needs a change of hands, start it over
            shutil.rmtree(run)
            steps.clear()
            continue
        steps.append({"processes": world, "resumed_from_newest": newest, "killed": killed, "code": code})
        if not killed and code != 0:
            return {"steps": steps, "verdict": "FAILURE", "error": f"exit {code}; see {log}"}
        if not killed:
            break
        world = 1  # a 2-process step read by one process; one process's file stays with one
    else:
        return {"steps": steps, "verdict": "FAILURE", "error": "did not finish in 12 continuations"}
    config = json.loads((run / "config.json").read_text())
    recorded = [entry["samples"] for entry in config.get("changed_on_resume", [])]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = [e["samples"] for e in events if e["event"] == "checkpoint"]
    # each continuation that got as far as writing config.json resumed from the newest it could see
    expected = [s["resumed_from_newest"] for s in steps[1:] if s["resumed_from_newest"] is not None]
    monotonic = all(a < b for a, b in zip(saved, saved[1:], strict=False))
    remaining = iter(expected)  # in order, each one resumed from (a rewind breaks the order)
    ok = monotonic and all(any(r == e for e in remaining) for r in recorded)
    summary = json.loads((run / "summary.json").read_text())
    verdict = "newest won" if ok and summary["train_samples"] == runner_budget(runner) else "FAILURE"
    return {"steps": steps, "recorded_resumes": recorded, "checkpoint_events": saved, "verdict": verdict}


def runner_budget(runner: Any) -> int:
    return int(json.loads(Path(runner.config).read_text())["samples"])
