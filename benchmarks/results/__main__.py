"""`python -m benchmarks.results [--check]`: rewrite docs/results.md, or exit 1 if it differs."""

from __future__ import annotations

import argparse
import sys

from benchmarks.results import OUTPUT, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when docs/results.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run `python -m benchmarks.results`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
