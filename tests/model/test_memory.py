"""The memory pre-check: bytes needed are known before allocating, and a shortfall is one clear line."""

import dataclasses
import os
import resource
import shutil
import types
from pathlib import Path

import pytest

from slipcache import memory
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.errors import SlipcacheError
from slipcache.memory import GB, MemoryShortError, require_tables_fit, table_bytes
from slipcache.model import ModelConfig, build_embeddings
from tests.helpers import cli_fails_in_one_line, make_dataset

MLPERF = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
          155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]


def test_mlperf_tables_in_int4_with_a_one_percent_cache_are_costed_without_allocating() -> None:
    need = table_bytes(EmbeddingConfig(MLPERF, 128, precision="int4", cache_size=0.01))
    # 13.07 GB of codes + 0.61 GB of row parameters + 1.05 GB of fp32 cache + its bookkeeping
    assert 14.7 * GB < need < 14.8 * GB
    assert table_bytes(EmbeddingConfig(MLPERF, 128), embeddings="torch") == sum(MLPERF) * 128 * 4


def test_a_shortfall_names_need_available_and_what_would_fit() -> None:
    with pytest.raises(MemoryShortError) as info:
        require_tables_fit(EmbeddingConfig(MLPERF, 128, precision="int8", cache_size=0.05), "train",
                           available=int(17 * GB))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("train: 204,184,588 rows at dim 128 in int8 + 0.05 cache need ")
    assert "available 17.0 GB" in message
    assert "would fit: --precision int4 --cache-size 0.01 (14.7 GB)" in message
    assert "slipcache plan --budget-gb" in message


def test_what_fits_prefers_the_best_precision_that_fits() -> None:
    assert "--precision int4 --cache-size 0.05" in memory.what_fits(EmbeddingConfig(MLPERF, 128), int(22 * GB))
    assert "--precision fp16 --cache-size 0.05" in memory.what_fits(EmbeddingConfig(MLPERF[:9], 16), int(22 * GB))
    nothing = memory.what_fits(EmbeddingConfig(MLPERF, 512, precision="int8", cache_rows=10), int(22 * GB))
    assert nothing.startswith("nothing fits: even --precision int4")


def test_tables_that_fit_pass_and_return_their_bytes() -> None:
    tables = EmbeddingConfig([1000, 10], 16, precision="int8", cache_size=0.05)
    assert require_tables_fit(tables, "train", available=int(2 * GB)) == table_bytes(tables)


def test_absurd_dim_and_hashed_ids_hit_the_same_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.ENV_AVAILABLE, "2")
    with pytest.raises(MemoryShortError, match=r"^embedding tables: 1,100 rows at dim 10000000 in int8"):
        build_embeddings([1000, 100], 10_000_000, precision="int8")
    with pytest.raises(MemoryShortError, match=r"in fp32 torch tables need"):
        build_embeddings([2**31], 16, embeddings="torch")
    # a TorchRec feature hashed to ids up to 2^40: max id + 1 rows, fp32
    with pytest.raises(MemoryShortError, match=r"^torchrec: 1,099,511,627,776 rows at dim 16 in fp32 need"):
        require_tables_fit(EmbeddingConfig([2**40], 16, precision="fp32", cache_size=0.0), "torchrec")


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
        memory.require_tables_fit(in_files, "train")
    assert not (tmp_path / "rows").exists()  # refused before anything was created


def _model(bottom: list[int], top: list[int], dim: int = 16) -> ModelConfig:
    return ModelConfig([10] * 26, 13, embedding_dim=dim, bottom_mlp=bottom, top_mlp=top)


@pytest.mark.usefixtures("private_cache_dir")
def test_model_bytes_price_the_mlps_and_per_batch_buffers() -> None:
    small = memory.model_bytes(_model([64, 16], [64, 1]), 256)
    wide_bottom = memory.model_bytes(_model([1_000_000_000, 16], [64, 1]), 256)
    assert small < 200e6
    assert wide_bottom > 13e9 * 4  # the first layer's weights alone (the allocator asked for 52 GB)
    assert memory.model_bytes(_model([64, 16], [100_000_000, 1]), 256) > 4 * 367 * 100_000_000
    # Adam keeps two floats per parameter: the state is priced
    assert memory.model_bytes(_model([64, 16], [64, 1]), 256, "adam") > small
    assert memory.model_bytes(_model([64, 100_000], [64, 1], dim=100_000), 256) > 256 * 26 * 100_000 * 4


@pytest.mark.usefixtures("private_cache_dir")
@pytest.mark.parametrize("flag", [["--bottom-mlp", "1000000000,16"], ["--top-mlp", "1000000000,1"]])
def test_wide_mlps_stop_before_allocating(flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = make_dataset(tmp_path / "data", n=400)
    argv = ["train", "--data", str(data), "--no-progress", "--out", str(tmp_path / "run"), *flag]
    err = cli_fails_in_one_line(argv, capsys,
                                "the MLPs and per-batch buffers alone do not fit: narrower --bottom-mlp / --top-mlp")
    assert "MLPs and per-batch buffers" in err and "GB" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.usefixtures("private_cache_dir")
def test_wide_mlps_in_a_config_file_stop_the_same_way(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = make_dataset(tmp_path / "data", n=400)
    config = tmp_path / "c.toml"
    config.write_text("bottom_mlp = [1000000000, 16]\n")
    argv = ["train", "--config", str(config), "--data", str(data), "--no-progress", "--out", str(tmp_path / "r")]
    cli_fails_in_one_line(argv, capsys, "the MLPs and per-batch buffers alone do not fit")


@pytest.mark.usefixtures("private_cache_dir")
def test_the_address_space_limit_is_one_of_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ENV_AVAILABLE, raising=False)
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 100 * 10**9)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: None)
    real = resource.getrlimit

    def limited(which: int) -> tuple[int, int]:
        if which == resource.RLIMIT_AS:
            return (6_000_000 * 1024, resource.RLIM_INFINITY)  # ulimit -v 6000000
        return real(which)

    monkeypatch.setattr(memory.resource, "getrlimit", limited)
    available, source = memory.limiting_memory()
    assert source == "the address-space limit, ulimit -v"
    assert available < 6_000_000 * 1024
    with pytest.raises(memory.MemoryShortError, match=r"available .* GB \(the address-space limit, ulimit -v\)"):
        memory.require_tables_fit(EmbeddingConfig([100_000_000], 16, precision="fp32", cache_size=0.0), "train")


@pytest.mark.usefixtures("private_cache_dir")
def test_under_ulimit_v_tables_stop_in_one_line(tmp_path: Path) -> None:
    """A real `ulimit -v`: 7.7 GB of tables against a 3 GB address space, in a process of its own."""
    import json
    import subprocess
    import sys

    data = make_dataset(tmp_path / "data", n=400)
    meta = json.loads((data / "meta.json").read_text())
    meta["table_sizes"][0] = 120_000_000  # ids stay small; the tables are sized by the meta data: 7.7 GB in fp32
    (data / "meta.json").write_text(json.dumps(meta))
    config = tmp_path / "big.toml"
    config.write_text(f'data = "{data}"\nprecision = "fp32"\ncache_size = 0.0\n')
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, resource.RLIM_INFINITY)); "
              "from slipcache.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(memory.ENV_AVAILABLE, None)
    done = subprocess.run([sys.executable, "-c", script, "train", "--config", str(config), "--no-progress",
                           "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600)
    err = done.stderr.strip()
    assert done.returncode == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    assert "(the address-space limit, ulimit -v)" in err


@pytest.mark.usefixtures("private_cache_dir")
def test_storage_path_on_a_file_and_sizes_on_a_tiny_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache import memory
    from slipcache.embedding.config import EmbeddingConfig

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for path, where in ((notes, "is a file"), (notes / "rows", "lies under the file")):
        config = EmbeddingConfig(table_sizes=[1000], dim=8, storage_path=str(path))
        with pytest.raises(SlipcacheError, match=where):
            memory.require_storage_room(config, "train")
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**6, 10**6 - 4096, 4096))
    config = EmbeddingConfig(table_sizes=[100_000], dim=16, storage_path=str(tmp_path / "rows"))
    with pytest.raises(SlipcacheError, match=r"needs \d+\.\d MB on disk under .*, which has 4\.1 kB free"):
        memory.require_storage_room(config, "train")
    assert notes.read_text() == "mine"

