"""Record the run a study's pinned orchestrator stopped on, when that run diverged, so `--resume` goes past it.

Studies pinned to a commit older than the orchestrator's own record of failed runs stop at a diverged run (the
positive control of the accuracy study diverges by design). This reads the orchestrator's last error line from
its log and appends the run as failed, with its validation curve, using this checkout's study code:

    python -m benchmarks.record_divergence accuracy_converged LOG RUN_ROOT [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.long_studies import STUDIES, STUDIES_DIR, eval_curve, update_file
from slipcache.errors import SlipcacheError

STOPPED = re.compile(
    r"error: (\S+) seed (\d+) failed \(exit 1\): slipcache\.errors\.SlipcacheError: (training loss is nan[^;]*)"
)


def record_divergence(name: str, log: Path, root: Path, out_file: Path) -> dict:
    """Append the diverged run the log's last failure names to `out_file`; returns its record."""
    failures = [line for line in log.read_text().splitlines() if "failed (exit" in line]
    match = STOPPED.search(failures[-1]) if failures else None
    if match is None:
        raise SlipcacheError(f"{log}: its last failure is not a diverged run: {failures[-1] if failures else 'none'}")
    arm, seed = match.group(1), int(match.group(2))
    results = json.loads(out_file.read_text())
    if any((r["arm"], r["seed"]) == (arm, seed) for r in results["runs"]):
        raise SlipcacheError(f"{arm} seed {seed} is recorded in {out_file} already")
    record = {
        "arm": arm, "seed": seed, "commit": results["commit"], "run_dir": f"{arm}-s{seed}", "test_auc": None,
        "test_logloss": None, "failed": f"{match.group(3)}: the run diverged",
        "curve": eval_curve(root / f"{arm}-s{seed}" / "metrics.jsonl"),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    update_file(out_file, STUDIES[name], record)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=sorted(STUDIES))
    parser.add_argument("log", type=Path, help="the orchestrator's output")
    parser.add_argument("root", type=Path, help="the study's run directories (its --out)")
    parser.add_argument("--json", type=Path, default=None, help="the study file (default docs/studies/<study>.json)")
    args = parser.parse_args()
    record = record_divergence(args.study, args.log, args.root, args.json or STUDIES_DIR / f"{args.study}.json")
    print(f"recorded {record['arm']} seed {record['seed']} as failed: {record['failed']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
