"""docs/results.md is the generator's output from the committed JSON, so it cannot drift from the runs."""

from __future__ import annotations

import pytest

from benchmarks import results


def test_results_page_is_generated_from_the_committed_json() -> None:
    assert results.OUTPUT.read_text() == results.render(), "docs/results.md is stale: run `python -m benchmarks.results`"


def test_filters_render_missing_values_as_a_dash_and_signs_with_a_minus() -> None:
    assert results.sgn(-0.00021) == "−0.0002" and results.sgn(0.0001) == "+0.0001"
    assert results.x(None) == results.DASH and results.pct(float("nan")) == results.DASH
    assert results.k(1_240_400) == "1,240k" and results.n(1288389.4) == "1,288,389"


def test_a_record_cell_is_found_by_its_row_and_column() -> None:
    t = {"columns": ["setup", "ΔAUC"], "rows": [["**INT8**", "**−0.0002**"], ["fp32", "–"]]}
    assert results.cell(t, "INT8", "ΔAUC") == "−0.0002"
    with pytest.raises(KeyError):
        results.cell(t, "INT4", "ΔAUC")
    assert results.table(t).splitlines()[1] == "|---|---|"
