"""A rank's part of every batch (`BatchIterator(part=(rank, N))`): the whole-batch iterator's batches,
sliced, on every format the trainer reads; only the slice's rows are read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slipcache.data.batches import BatchIterator, slice_bounds
from slipcache.data.dataset import SplitArrays
from slipcache.data.formats import open_any
from slipcache.data.mapped import LazyColumn, Piece
from tests.data.test_formats import write_dlrm, write_mlperf, write_torchrec
from tests.helpers import make_dataset

ITERATIONS = [  # (batch size, iterator options): shuffled chunks, time order, resume, a short last batch
    (64, {"shuffle": True, "seed": 3, "epoch": 1, "drop_last": True}),
    (50, {"shuffle": True, "in_order": True, "seed": 1, "drop_last": True, "start_batch": 7, "chunk_batches": 3}),
    (37, {"drop_last": False, "chunk_batches": 2}),  # evaluation: in order, a last batch of 23 rows
]


def _check_parts_equal_whole(split: Any, batch_size: int, options: dict[str, Any], world: int) -> None:
    whole = list(BatchIterator(split, batch_size, **options))
    assert whole
    for rank in range(world):
        parts = list(BatchIterator(split, batch_size, part=(rank, world), **options))
        assert len(parts) == len(whole)
        for got, want in zip(parts, whole, strict=True):
            start, end = slice_bounds(len(want), world, rank)
            assert got.rows == (start, end) and len(got) == len(want)
            assert torch.equal(got.labels, want.labels)  # the global batch's labels
            assert torch.equal(got.dense, want.dense[start:end])
            assert torch.equal(got.sparse, want.sparse[start:end])


@pytest.mark.parametrize("kind", ["ours", "torchrec", "dlrm", "mlperf"])
def test_each_rank_gets_its_slice_of_the_same_batches_on_every_format(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / kind
    if kind == "ours":
        make_dataset(data, n=1200)
    elif kind == "torchrec":
        write_torchrec(data, n=600)
    elif kind == "dlrm":
        write_dlrm(data, compressed=False)
    else:
        write_mlperf(data, with_val=True)
    split = open_any(data).split("train")
    for batch_size, options in ITERATIONS:
        for world in (2, 3):
            _check_parts_equal_whole(split, batch_size, options, world)


def test_a_sample_filter_gives_each_rank_its_slice_of_the_filtered_batches(tmp_path: Path) -> None:
    split = open_any(make_dataset(tmp_path / "d", n=900)).split("train")

    def odd_first_id(sparse: np.ndarray) -> np.ndarray:
        return sparse[:, 0] % 2 == 1

    for world in (2, 3):
        _check_parts_equal_whole(split, 40, {"shuffle": True, "seed": 2, "sample_filter": odd_first_id}, world)


def test_a_rank_reads_only_its_rows_and_the_labels() -> None:
    """Rows converted per column, through the lazy columns the external formats read with."""
    n, batch = 1000, 64
    read = {"labels": 0, "dense": 0, "sparse": 0}
    rng = np.random.default_rng(0)
    raw = {"labels": rng.integers(0, 2, n), "dense": rng.random((n, 13)), "sparse": rng.integers(0, 9, (n, 26))}

    def counting(name: str) -> Any:
        def convert(rows: np.ndarray) -> np.ndarray:
            read[name] += len(rows)
            return np.asarray(rows)

        return convert

    split = SplitArrays(
        *(
            LazyColumn([Piece(raw[name], 0, n)], counting(name), raw[name].shape[1:], dtype)
            for name, dtype in (("labels", np.float32), ("dense", np.float32), ("sparse", np.int32))
        )
    )
    iterator = BatchIterator(split, batch, shuffle=True, drop_last=True, part=(1, 2))
    batches = list(iterator)
    trained = len(batches) * batch
    assert read == {"labels": trained, "dense": trained // 2, "sparse": trained // 2}
    assert iterator.bytes_read == trained * 4 + trained // 2 * (13 * 4 + 26 * 4)


def test_a_part_outside_the_world_is_refused() -> None:
    from slipcache.errors import SlipcacheError

    split = SplitArrays(np.zeros(4, np.float32), np.zeros((4, 13), np.float32), np.zeros((4, 26), np.int32))
    with pytest.raises(SlipcacheError, match="part must be"):
        BatchIterator(split, 2, part=(2, 2))
