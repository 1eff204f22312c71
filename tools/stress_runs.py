"""tools/stress.py's trials of who owns a run and what it runs on: concurrent writers, settings changed on
resume, data changed under a run. Each trial returns a dict with a "verdict" ("FAILURE" counts)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipcache.training import checkpoint

# `--allow-changes` resumes and what the final checkpoint must then hold (a probe of the trained state,
# not of config.json): setting -> (flag value, where it shows). The skipping one runs on a skipping run.
CHANGES = {
    "lr": ("0.05", "embedding and dense optimizer lr"),
    "dense_lr": ("0.02", "dense optimizer lr"),
    "samples": ("27648", "samples trained"),
    "stale_target": ("0.1", "the skipping guard's and detector's target"),
}


def train_command(runner: Any, run: Path, *flags: str) -> list[str]:
    """The stress run's configuration into a new `run`, with extra flags."""
    base = [sys.executable, "-m", "slipcache.cli", "train", "--no-progress", "--config", str(runner.config)]
    return [*base, "--out", str(run), *flags]


def truncated_copy(run: Path, to: Path) -> Path:
    """A copy of a finished run as if it had stopped at its older periodic checkpoint (the newest removed)."""
    shutil.copytree(run, to)
    periodic = sorted((to / "checkpoints").glob("ckpt-*.pt"))
    periodic[-1].unlink()
    latest = to / "checkpoints" / checkpoint.LATEST
    latest.unlink()
    shutil.copyfile(periodic[-2], latest)
    (to / "summary.json").unlink()
    return to


def _tail(log: Path) -> str:
    """The last lines a process wrote to its log (the refused one wrote only its error)."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-3:])


def _one_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "warning:" not in line]


def concurrent_trials(runner: Any, workdir: Path, expected: dict[str, Any], trials: int,
                      outcome: Any, differences: Any) -> list[dict[str, Any]]:
    """Two writers on one run directory: started together into one new --out, and a --resume started while
    the run trains (a scheduler restarting a job whose old copy still runs). The second must stop with one
    line naming the first (exit 3; exit 2 "already holds a run" when the first had checkpointed), the
    one that got it must finish exactly as the reference (started together, either may win)."""
    results = []
    for i in range(trials):
        kind = "two starts into one --out" if i % 2 == 0 else "--resume while it trains"
        run = workdir / f"owner-{i}"
        log = workdir / f"owner-{i}.log"
        first = runner.start(runner.command(run), log)
        if kind == "--resume while it trains":
            while first.poll() is None and not (run / "metrics.jsonl").is_file():
                time.sleep(0.05)
            time.sleep(random.Random(i).uniform(0.0, 2.0))
            args = [sys.executable, "-m", "slipcache.cli", "train", "--no-progress", "--resume", str(run)]
        else:
            args = runner.command(run)
        second = subprocess.Popen(args, env=runner.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, cwd=workdir)  # fmt: skip
        second_err = second.communicate(timeout=900)[1]
        code = first.wait(timeout=900)
        # Started together, either may take the directory first; the other must be refused, naming it.
        winner, loser, loser_err = (first, second, second_err) if second.returncode else (second, first, _tail(log))
        errors = _one_line(loser_err)
        refused = (loser.returncode == 3 and f"PID {winner.pid}" in loser_err) or (
            loser.returncode == 2 and "already holds a run" in loser_err
        )
        result: dict[str, Any] = {"trial": kind, "first_code": code, "second_code": second.returncode,
                                  "message": errors[-1][:200] if errors else ""}  # fmt: skip
        same = winner.returncode == 0 and not differences(outcome(run), expected)
        if code == 0 and second.returncode == 0 and same:  # the second started after the first had ended
            result["verdict"] = "void: no overlap"
        else:
            one_refused = refused and len(errors) == 1 and same
            result["verdict"] = "one refused, the other identical" if one_refused else "FAILURE"
        results.append(result)
        if result["verdict"] != "FAILURE":
            shutil.rmtree(run)
    return results


def _probe(state: dict[str, Any], name: str) -> Any:
    if name == "lr":
        return [state["embeddings"]["_extra_state"]["lr"], state["dense_optimizer"]["param_groups"][0]["lr"]]
    if name == "dense_lr":
        return state["dense_optimizer"]["param_groups"][0]["lr"]
    if name == "samples":
        return state["progress"]["samples"] + state["progress"]["skipped"]
    return [state["skipping"]["guard"]["target"], state["skipping"]["detector"]["target"]]


def changed_setting_trials(cli: Any, workdir: Path, reference: Path, skipping: Path) -> list[dict[str, Any]]:
    """Resume a run stopped at its older checkpoint with one setting changed: refused without
    --allow-changes (one line, nothing written), and with it config.json and the trained state both hold
    the new value. Also: a flag given with its default value counts as given."""
    results = []
    for name, (value, where) in CHANGES.items():
        source = skipping if name == "stale_target" else reference
        run = truncated_copy(source, workdir / f"change-{name}")
        flag = [f"--{name.replace('_', '-')}", value]
        before = (run / "config.json").read_bytes()
        refused = cli(["train", "--resume", str(run), "--no-progress", *flag])
        untouched = (run / "config.json").read_bytes() == before
        got = cli(["train", "--resume", str(run), "--no-progress", "--allow-changes", *flag])
        recorded = json.loads((run / "config.json").read_text()).get(name)
        state = checkpoint.load_checkpoint(run / "checkpoints")
        probe = _probe(state, name)
        want = float(value)
        if name == "samples":
            took = probe >= want
        elif name == "stale_target":
            took = 0 < probe[0] <= want and 0 < probe[1] <= want  # the guard may only lower it
        else:
            took = probe == [want, want] if isinstance(probe, list) else probe == want
        ok = refused["code"] == 2 and refused["one_line"] and untouched and got["code"] == 0
        ok = ok and recorded == (int(value) if name == "samples" else want) and took
        results.append({"setting": name, "value": value, "checked": where, "found": probe,
                        "refused_without_allow": refused["err"].strip()[:160],
                        "verdict": "takes effect" if ok else "FAILURE"})  # fmt: skip
        if ok:
            shutil.rmtree(run)
    run = truncated_copy(reference, workdir / "change-default")
    config = json.loads((run / "config.json").read_text())
    for path in (run / "checkpoints").glob("*.pt"):  # the run trained with lr 0.5, not the default 0.3
        state = checkpoint.load_checkpoint(path)
        state["config"]["lr"] = 0.5
        checkpoint.save_checkpoint(path, state)
    (run / "config.json").write_text(json.dumps({**config, "lr": 0.5}))
    got = cli(["train", "--resume", str(run), "--no-progress", "--lr", "0.3"])
    ok = got["code"] == 2 and "lr 0.5 -> 0.3" in got["err"]
    results.append({"setting": "lr given at its default value", "value": "0.3", "checked": "counts as given",
                    "refused_without_allow": got["err"].strip()[:160],
                    "verdict": "counts as given" if ok else "FAILURE"})  # fmt: skip
    return results


def changed_data_trials(cli: Any, runner: Any, workdir: Path, trials: int, rng: random.Random) -> list[dict[str, Any]]:
    """A run on a dataset that then changes under it. Regenerated with another seed (same sizes): eval and
    --resume must refuse in one line, and go on with --allow-changes. A few flipped bytes in a data file:
    the fingerprint samples blocks, so only flips inside them are seen; counted, not failed."""
    data = workdir / "data-run-data"
    synth = ["synth", "--samples", "40000", "--scale", "0.002", "--no-progress"]
    cli([*synth, "--out", str(data)])
    run = workdir / "data-run"
    code = runner.run(train_command(runner, run, "--data", str(data)), workdir / "data-run.log")
    if code:
        return [{"trial": "data run", "verdict": "FAILURE", "message": f"exit {code}"}]
    pristine = workdir / "data-pristine"
    shutil.copytree(data, pristine)
    results = []
    for i in range(trials):
        regenerate = i % 3 == 0
        if regenerate:
            cli([*synth, "--out", str(data), "--force", "--seed", str(100 + i)])
            what = f"regenerated (seed {100 + i})"
        else:
            target = rng.choice(sorted(data.glob("*.npy")))
            raw = bytearray(target.read_bytes())
            for p in (rng.randrange(128, len(raw)) for _ in range(rng.randint(1, 4))):
                raw[p] ^= rng.randint(1, 255)
            target.write_bytes(bytes(raw))
            what = f"bytes flipped in {target.name}"
        ev = cli(["eval", "--checkpoint", str(run), "--samples", "2000"])
        copy = truncated_copy(run, workdir / f"data-{i}")
        res = cli(["train", "--resume", str(copy), "--no-progress"])
        refused = [r["code"] == 2 and r["one_line"] and "not the data the run trained on" in r["err"]
                   for r in (ev, res)]
        allowed = cli(["eval", "--checkpoint", str(run), "--samples", "2000", "--allow-changes"])["code"] == 0
        clean = all(r["code"] == 0 or (r["code"] == 2 and r["one_line"]) for r in (ev, res))
        if regenerate:
            verdict = "refused, --allow-changes proceeds" if all(refused) and allowed else "FAILURE"
        elif all(refused):
            verdict = "flip seen: refused"
        elif clean and not any(refused):  # ran, or stopped in one line on a damaged value it read
            verdict = "flip not sampled: not seen"
        else:
            verdict = "FAILURE"
        results.append({"trial": what, "eval_code": ev["code"], "resume_code": res["code"],
                        "message": (ev["err"] or "").strip()[:200], "verdict": verdict})  # fmt: skip
        shutil.rmtree(copy)
        shutil.rmtree(data)
        shutil.copytree(pristine, data)
    return results
