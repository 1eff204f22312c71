"""What the export's chunk size costs: user and system CPU seconds of streaming one INT4 table into the
int8 export format, per chunk size, interleaved over rounds.

    OMP_NUM_THREADS=1 python -m benchmarks.export_chunks --mib 64 8 2 [--rows 2000000] [--rounds 3]

Large chunks are fresh memory maps for every chunk (page faults: system time); small ones are reused.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from slipcache import export
from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.embedding.config import EmbeddingConfig


def _clock() -> tuple[float, float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, time.perf_counter()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 8, 2], help="chunk sizes in MiB of fp32")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    config = EmbeddingConfig(table_sizes=[args.rows], dim=args.dim, precision="int4", cache_size=0.01)
    rows = export.TableRows.of_model(CachedEmbeddingBagCollection(config))
    default = export.CHUNK_BYTES
    try:
        for round_ in range(args.rounds):
            for mib in args.mib:
                export.CHUNK_BYTES = mib << 20
                rows.chunk_rows = max(1, export.CHUNK_BYTES // (4 * args.dim))
                directory = Path(tempfile.mkdtemp(prefix="slipcache-export-chunks-"))
                try:
                    user, system, wall = _clock()
                    export.write_tables(rows, directory, ("int8",))
                    after = _clock()
                finally:
                    shutil.rmtree(directory)
                print(f"round {round_} chunk {mib:3d} MiB: user {after[0] - user:5.2f} s, "
                      f"system {after[1] - system:5.2f} s, wall {after[2] - wall:5.2f} s", flush=True)
    finally:
        export.CHUNK_BYTES = default


if __name__ == "__main__":
    main()
