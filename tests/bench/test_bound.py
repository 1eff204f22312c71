"""The bound of `slipcache bench embedding`: accesses per lookup priced by the probe, as the model says."""

import pytest
import torch

from slipcache.bench.bound import AccessCosts, Popularity, attach_bounds, unique_share


def fake_probe(table_bytes: int, row_bytes: int, batch_rows: int, seconds: float) -> dict[str, float]:
    """1 ns per access up to 1 MiB, 100 ns beyond; calls recorded."""
    fake_probe.calls.append((table_bytes, row_bytes))
    return {"rows_per_s": 1e9 if table_bytes <= 1 << 20 else 1e7}


fake_probe.calls = []


def test_unique_share_counts_first_lookups_of_a_row_per_step() -> None:
    batches = torch.tensor([[[0, 1], [0, 1]], [[0, 0], [1, 1]]])  # table sizes 2 and 2
    assert unique_share(batches, [2, 2]) == pytest.approx((2 / 4 + 4 / 4) / 2)


class Flat:
    """Every row equally used: nothing fits the L3 in a useful share."""

    def __init__(self, share: float = 0.0) -> None:
        self.share = share

    def top(self, rows: float) -> float:
        return self.share


def test_popularity_ranks_rows_by_use() -> None:
    batches = torch.tensor([[[0, 1], [0, 1], [0, 0], [1, 1]]])  # table sizes 2, 2: row 0 x3, row 3 x3, row 2 x2
    popularity = Popularity(batches, [2, 2])
    assert popularity.top(1) == pytest.approx(3 / 8) and popularity.top(2) == pytest.approx(6 / 8)
    assert popularity.top(0) == 0.0 and popularity.top(99) == pytest.approx(1.0)


def test_the_hot_share_is_priced_at_the_l3s_size() -> None:
    costs = AccessCosts(0.1, max_probe_bytes=1 << 30, probe=fake_probe, cache_bytes=2 << 20)
    row = {"impl": "fbgemm", "precision": "fp32", "dim": 16, "cache_fraction": 0.0, "status": "ok",
           "samples_per_s": 1e6}
    attach_bounds([row], [1_000_000], 0.5, costs, Flat(0.5))
    assert row["bound_ns_per_lookup"] == {"table row": pytest.approx(1.5 * (0.5 * 1.0 + 0.5 * 100.0))}


def test_bounds_follow_the_model() -> None:
    fake_probe.calls.clear()
    costs = AccessCosts(0.1, max_probe_bytes=1 << 30, probe=fake_probe, cache_bytes=2 << 20)
    sizes = [1_000_000, 1_000_000]  # 2 lookups per sample
    rows = [
        {"impl": "fbgemm", "precision": "fp32", "dim": 16, "cache_fraction": 0.0, "status": "ok", "samples_per_s": 1e6},
        {
            "impl": "slipcache", "precision": "int8", "dim": 16, "cache_fraction": 0.001, "policy": "lru",
            "status": "ok", "samples_per_s": 2e6, "lookups": 1000, "rows_in": 100, "rows_out": 50, "hit_rate": 0.9,
        },
        {"impl": "fbgemm", "precision": "fp32", "dim": 16, "cache_fraction": 0.0, "status": "not installed",
         "samples_per_s": None},
    ]
    attach_bounds(rows, sizes, 0.5, costs, Flat())
    table, ours, absent = rows
    # A 128 MB table: 100 ns per access, (1 + u) accesses per lookup.
    assert table["bound_ns_per_lookup"] == {"table row": pytest.approx(150.0)}
    assert table["bound_samples_per_s"] == pytest.approx(1 / (2 * 150e-9))
    assert table["fraction_of_bound"] == pytest.approx(1e6 * 2 * 150e-9)
    # 2,000 cached slots (in the fast range); storage of 2 M rows: payload, bias and scale each 100 ns.
    terms = ours["bound_ns_per_lookup"]
    assert terms["tags"] == pytest.approx(1.0) and terms["bookkeeping"] == pytest.approx(1.0)
    assert terms["cached row"] == pytest.approx(1.5)
    assert terms["miss fill"] == pytest.approx(0.1 * 300.0)
    assert terms["write-back"] == pytest.approx(0.05 * (1.0 + 300.0))
    assert absent["bound_samples_per_s"] is None and absent["fraction_of_bound"] is None
    # Lines: a dim-16 fp32 row is one line; an int8 row of 16 bytes one line, its bias and scale one each.
    assert table["lines_per_lookup"] == {"table row": 1.5, "total": 1.5}
    lines = ours["lines_per_lookup"]
    assert lines["tags"] == 1 and lines["bookkeeping"] == pytest.approx(0.9) and lines["cached row"] == 1.5
    assert lines["miss fill"] == pytest.approx(0.1 * (3 + 1)) and lines["write-back"] == pytest.approx(0.05 * 4)
    assert lines["total"] == pytest.approx(1 + 0.9 + 1.5 + 0.4 + 0.2)
    assert "lines_per_lookup" not in absent
    assert len(fake_probe.calls) == len(set(fake_probe.calls))  # each size probed once
    assert all(size <= 1 << 30 for size, _ in fake_probe.calls)


def test_the_output_and_its_gradient_are_priced_at_the_copy_bandwidth() -> None:
    """Every configuration streams the pooled output and its gradient, whatever its tables hold: one copy of
    dim x 4 bytes per bag, 2 lines per bag of a 16-dim row."""
    costs = AccessCosts(0.1, max_probe_bytes=1 << 30, probe=fake_probe, cache_bytes=2 << 20,
                        copy_bytes_per_s=64e9)  # 64 bytes per ns
    rows = [
        {"impl": "fbgemm", "precision": "fp32", "dim": 16, "cache_fraction": 0.0, "status": "ok", "samples_per_s": 1e6},
        {"impl": "slipcache", "precision": "int8", "dim": 16, "cache_fraction": 0.0, "status": "ok",
         "samples_per_s": 1e6, "lookups": 1000, "rows_in": 500, "rows_out": 500},
    ]
    attach_bounds(rows, [1_000_000], 0.5, costs, Flat(), bags_per_lookup=0.5)
    for row in rows:
        assert row["bound_ns_per_lookup"]["output and gradient"] == pytest.approx(0.5 * 16 * 4 / 64)
        assert row["lines_per_lookup"]["output and gradient"] == pytest.approx(0.5 * 2)
    table, ours = rows
    assert table["bound_ns_per_lookup"]["table row"] == pytest.approx(150.0)
    assert table["bound_samples_per_s"] == pytest.approx(1 / (150.5e-9))
    assert ours["lines_per_lookup"]["total"] == pytest.approx(0.5 * 3 + 0.5 * 3 + 1.0)
