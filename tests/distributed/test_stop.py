"""Under torchrun, a rank that dies: every surviving rank says so in one line before torchrun's report.

Three ranks started by torchrun itself; rank 1 kills itself with SIGKILL while ranks 0 and 2 compute
outside any collective, so only torchrun's SIGTERM reaches them (the case that used to die silently).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import free_port

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import torch.distributed as dist
from slipcache.distributed.launch import init_from_env, redirect_output
ctx = init_from_env()
if ctx.rank != 0:
    redirect_output(Path(sys.argv[1]), ctx.rank)
dist.barrier()
if ctx.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # busy, in no collective
    sum(range(10000))
"""


@pytest.mark.slow
def test_surviving_ranks_print_one_line_before_torchruns_report(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
               str(free_port()), "--monitor-interval", "0.2", str(script), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)  # a hang guard only
    console = done.stdout + done.stderr
    assert done.returncode != 0
    for rank in (0, 2):
        line = f"slipcache train: error: rank {rank}: stopped by torchrun because another rank exited"
        assert console.count(line) == 1, console[-3000:]
        assert console.index(line) < console.index("ChildFailedError")  # before torchrun's own report
    assert "rank 1:" not in console  # the dead rank says nothing; nobody speaks for it twice
    log = (tmp_path / "rank-2.log").read_text()
    assert log.count("rank 2: stopped by torchrun because another rank exited") == 1
