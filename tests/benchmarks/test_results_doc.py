"""docs/results.md is the generator's output from the committed JSON, so it cannot drift from the runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import results


def test_results_page_is_generated_from_the_committed_json() -> None:
    stale = "docs/results.md is stale: run `python -m benchmarks.results`"
    assert results.OUTPUT.read_text() == results.render(), stale


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


def test_a_new_section_is_a_json_file_and_a_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs, sections = tmp_path / "docs", tmp_path / "sections"
    (docs / "scale").mkdir(parents=True)
    sections.mkdir()
    (docs / "scale" / "scale.json").write_text('{"command": "slipcache train --scale 1", "ratio": 3.19}')
    (sections / "00-head.md").write_text("# Results")
    (sections / "80-scale.md").write_text(
        '{% set run = load("scale/scale.json") %}\n## Scale\n\n{{ provenance(command=run.command) }}\n\n'
        "Memory {{ run.ratio | x }}: {{ verdict(run.ratio >= 3.0) }}.\n"
    )
    monkeypatch.setattr(results, "DOCS", docs)
    monkeypatch.setattr(results, "SECTIONS", sections)
    results.load.cache_clear()
    try:
        page = results.render()
    finally:
        results.load.cache_clear()
    assert page == (results.HEADER + "# Results\n\n## Scale\n\n- **Command**: `slipcache train --scale 1`\n\n"
                    "Memory 3.19x: **met**.\n")
