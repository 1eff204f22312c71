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


def test_the_equal_compute_control_reads_the_baseline_at_the_arms_cpu_seconds() -> None:
    """stale stopped at 150 CPU s with 0.70; the baseline had 0.60 at 100 s and 0.80 at 200 s: 0.70 at 150 s."""
    baseline = [[100.0, 1000, 0.60], [200.0, 2000, 0.80]]
    study = {"runs": [
        {"arm": "baseline", "seed": 0, "curve": baseline},
        {"arm": "stale", "seed": 0, "curve": [[50.0, 500, 0.5], [150.0, 1500, 0.70]]},
        {"arm": "baseline", "seed": 1, "curve": baseline},
        {"arm": "stale", "seed": 1, "curve": [[250.0, 2500, 0.85]]},  # past the baseline's end: its last
        {"arm": "random", "seed": 0, "curve": [[50.0, 500, 0.65]]},  # before its first: its first
    ]}
    both = results.early_stop_comparison(study, "stale")
    assert both is not None and both["n"] == 2
    assert both["mean_diff"] == pytest.approx((0.0 + 0.05) / 2)
    one = results.early_stop_comparison(study, "random")
    assert one is not None and one["mean_diff"] == pytest.approx(0.05) and one["ci95"] is None
    assert results.early_stop_comparison(study, "freeze-random") is None
