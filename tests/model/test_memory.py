"""The memory pre-check: bytes needed are known before allocating, and a shortfall is one clear line."""

import dataclasses
import types
from pathlib import Path

import pytest

from slipcache import memory
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.errors import SlipcacheError
from slipcache.memory import GB, MemoryShortError, require_tables_fit, table_bytes
from slipcache.model import build_embeddings

MLPERF = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
          155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]


def test_mlperf_tables_in_int4_with_a_one_percent_cache_are_costed_without_allocating() -> None:
    need = table_bytes(MLPERF, 128, precision="int4", cache_size=0.01)
    # 13.07 GB of codes + 0.61 GB of row parameters + 1.05 GB of fp32 cache + its bookkeeping
    assert 14.7 * GB < need < 14.8 * GB
    assert table_bytes(MLPERF, 128, embeddings="torch") == sum(MLPERF) * 128 * 4


def test_a_shortfall_names_need_available_and_what_would_fit() -> None:
    with pytest.raises(MemoryShortError) as info:
        require_tables_fit(MLPERF, 128, what="train", precision="int8", cache_size=0.05, available=int(17 * GB))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("train: 204,184,588 rows at dim 128 in int8 + 0.05 cache need ")
    assert "available 17.0 GB" in message
    assert "would fit: --precision int4 --cache-size 0.01 (14.7 GB)" in message
    assert "slipcache plan --budget-gb" in message


def test_what_fits_prefers_the_best_precision_that_fits() -> None:
    assert "--precision int4 --cache-size 0.05" in memory.what_fits(MLPERF, 128, int(22 * GB))
    assert "--precision fp16 --cache-size 0.05" in memory.what_fits(MLPERF[:9], 16, int(22 * GB))
    assert memory.what_fits(MLPERF, 512, int(22 * GB)).startswith("nothing fits: even --precision int4")


def test_tables_that_fit_pass_and_return_their_bytes() -> None:
    need = require_tables_fit([1000, 10], 16, what="train", precision="int8", cache_size=0.05, available=int(2 * GB))
    assert need == table_bytes([1000, 10], 16, precision="int8", cache_size=0.05)


def test_absurd_dim_and_hashed_ids_hit_the_same_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.ENV_AVAILABLE, "2")
    with pytest.raises(MemoryShortError, match=r"^embedding tables: 1,100 rows at dim 10000000 in int8"):
        build_embeddings([1000, 100], 10_000_000, precision="int8")
    with pytest.raises(MemoryShortError, match=r"in fp32 torch tables need"):
        build_embeddings([2**31], 16, embeddings="torch")
    # a TorchRec feature hashed to ids up to 2^40: max id + 1 rows, fp32
    with pytest.raises(MemoryShortError, match=r"^torchrec: 1,099,511,627,776 rows at dim 16 in fp32 need"):
        require_tables_fit([2**40], 16, what="torchrec", precision="fp32", cache_size=0.0)
    with pytest.raises(memory.SlipcacheError, match="dim must be positive"):
        require_tables_fit([10], 0, what="train")


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "memory.max").write_text("8000000000\n")
    (tmp_path / "memory.current").write_text("3000000000\n")
    assert memory._cgroup_headroom(tmp_path) == 5_000_000_000
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_headroom(tmp_path) is None
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 7_000_000_000)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: 5_000_000_000)
    assert memory.available_bytes() == 5_000_000_000
    monkeypatch.setenv(memory.ENV_AVAILABLE, "1.5")
    assert memory.available_bytes() == 1_500_000_000
    monkeypatch.setenv(memory.ENV_AVAILABLE, "lots")
    with pytest.raises(memory.SlipcacheError, match=memory.ENV_AVAILABLE):
        memory.available_bytes()


def test_storage_in_files_counts_only_what_stays_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes, dim = [40_000_000, 1000], 128
    in_ram = EmbeddingConfig(sizes, dim=dim, precision="int4", cache_size=0.01, optimizer="rowwise_adagrad")
    in_files = EmbeddingConfig(**{**dataclasses.asdict(in_ram), "storage_path": str(tmp_path / "rows")})
    parts = CachedEmbeddingBagCollection.estimate_memory(in_ram)["components"]
    storage = parts["storage_payload"]  # the rows' codes; their quantization parameters stay in memory
    assert memory.config_bytes(in_files) == memory.config_bytes(in_ram) - storage
    assert memory.require_storage_room(in_files, "train") == storage
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=storage - 1))
    with pytest.raises(SlipcacheError, match=r"^train: the row storage needs 2\.\d GB on disk under .*rows"):
        memory.require_config_fits(in_files, "train")
    assert not (tmp_path / "rows").exists()  # refused before anything was created


def test_settings_left_out_take_the_collections_defaults() -> None:
    assert table_bytes([1000, 10], 16) == memory.config_bytes(EmbeddingConfig(table_sizes=[1000, 10], dim=16))
