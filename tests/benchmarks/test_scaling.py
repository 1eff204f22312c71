"""The scaling model (docs/scaling.md)."""

from __future__ import annotations

import pytest

from benchmarks import scaling


@pytest.mark.slow
def test_memory_per_rank_falls_with_the_world_and_the_tables_print(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = scaling.KAGGLE_CARDINALITIES
    per_rank = [scaling.max_rank_gib(sizes, 16, "int8", 0.05, n) for n in (1, 8, 64)]
    assert per_rank[0] > per_rank[1] > per_rank[2] > 0
    assert per_rank[0] / per_rank[1] == pytest.approx(8, rel=0.3)  # the biggest table caps the split
    assert scaling.inter_node_share(8) == 0.0 and scaling.inter_node_share(16) == pytest.approx(8 / 15)
    assert scaling.traffic_per_sample(26, 16, 1).total == 0.0
    scaling.main()
    out = capsys.readouterr().out
    assert "### Criteo Kaggle" in out and "### Criteo 1TB" in out and "| INT8 + 5 % cache |" in out
