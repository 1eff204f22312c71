"""`slipcache export`: each layout loads back and looks rows up as the trained model does."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from slipcache import cli, export
from slipcache.training import checkpoint as ckpt
from slipcache.training import trainer as train
from slipcache.training.backend import build_model
from slipcache.training.config import CONFIG_FIELDS, TrainConfig
from tests.helpers import make_dataset, tiny_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    data = make_dataset(root / "data", n=1000)
    config = tiny_config(data, root / "run", embeddings="cached", precision="int8", cache_size=0.2, epochs=1)
    train.train(config)
    return root / "run"


def _trained_lookups(run: Path, ids: torch.Tensor) -> torch.Tensor:
    """Pooled rows [B, T, D] of the checkpoint's own collection (its forward, not export_tables)."""
    state = ckpt.load_checkpoint(run / "checkpoints")
    config = TrainConfig.from_flat({k: v for k, v in state["config"].items() if k in CONFIG_FIELDS})
    model = build_model(config, state["table_sizes"], num_dense=13)
    model.embeddings.load_state_dict(state["embeddings"])
    model.eval()
    with torch.no_grad():
        return model.embeddings(ids)


def _ids(sizes: list[int], n: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.stack([torch.randint(0, s, (n,), generator=gen) for s in sizes], dim=1)


def test_every_export_loads_back_and_matches_the_trained_lookups(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    info = json.loads((out / "tables.json").read_text())
    sizes = [t["num_embeddings"] for t in info]
    ids = _ids(sizes)
    expected = _trained_lookups(run_dir, ids)

    bags = torch.load(out / "embedding_bags.pt")
    for t, table in enumerate(info):
        bag = nn.EmbeddingBag(table["num_embeddings"], table["embedding_dim"], mode="sum")
        bag.load_state_dict(bags[table["name"]])
        torch.testing.assert_close(bag(ids[:, t : t + 1]), expected[:, t], rtol=0, atol=1e-6)

    fused = torch.load(out / "fbgemm_int8.pt")
    for table in info:
        rows = export.dequantize_rowwise_int8(fused[table["name"]])
        assert fused[table["name"]].shape == (table["num_embeddings"], table["embedding_dim"] + 8)
        fp32 = bags[table["name"]]["weight"]
        half_step = (fp32.amax(1) - fp32.amin(1)) / 255 / 2 + 1e-7
        assert bool(((rows - fp32).abs() <= half_step[:, None]).all())


def test_int8_layout_is_fbgemms() -> None:
    fbgemm_gpu = pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu-cpu not installed")
    assert fbgemm_gpu is not None
    table = torch.randn(50, 16) * torch.rand(50, 1) * 3
    ours = export.quantize_rowwise_int8(table)
    theirs = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(ours)
    torch.testing.assert_close(theirs, export.dequantize_rowwise_int8(ours), rtol=0, atol=1e-6)
    reference = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(table)
    # Same scale and bias bytes; codes may differ by one where a value sits on a rounding boundary.
    torch.testing.assert_close(ours[:, -8:], reference[:, -8:], rtol=0, atol=0)
    assert int((ours[:, :-8].int() - reference[:, :-8].int()).abs().max()) <= 1


def test_tbe_int8_export_loads_into_fbgemms_inference_tables(run_dir: Path, tmp_path: Path) -> None:
    """Lookups through `IntNBitTableBatchedEmbeddingBagsCodegen` built from the file equal the trained
    lookups within half a quantization step per pooled row."""
    pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu-cpu not installed")
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    out = tmp_path / "exported"
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(out), "--format", "tbe-int8"]) == 0
    info = json.loads((out / "tables.json").read_text())
    specs = [(t["name"], t["num_embeddings"], t["embedding_dim"], SparseType.INT8, EmbeddingLocation.HOST)
             for t in info]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        specs,
        weight_lists=torch.load(out / "fbgemm_tbe_int8.pt"),
        device="cpu",
        output_dtype=SparseType.FP32,
        pooling_mode=PoolingMode.SUM,
    )
    sizes = [t["num_embeddings"] for t in info]
    ids = _ids(sizes, n=32)
    bags = torch.cat([ids, torch.flip(ids, [0])], dim=0).view(2, 32, -1)  # bags of 2 ids per table
    values = bags.permute(2, 1, 0).reshape(-1).to(torch.int32)  # table-major, then sample, then the 2 ids
    offsets = torch.arange(0, values.numel() + 1, 2, dtype=torch.int32)
    got = tbe(values, offsets).view(32, len(info), -1)
    expected = _trained_lookups(run_dir, ids) + _trained_lookups(run_dir, torch.flip(ids, [0]))
    tables = export.load_tables(run_dir)
    tolerance = max(float((w.amax(1) - w.amin(1)).max()) for w in tables) / 255  # two halves of a step
    assert float((got - expected).abs().max()) <= tolerance * 1.01 + 1e-6
    assert float((got - expected).abs().max()) > 0  # quantized, not the fp32 rows


def test_torchrec_state_dict_loads_into_an_embedding_bag_collection(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchrec", reason="torchrec not installed (pip install 'slipcache[torchrec]')")
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    out = tmp_path / "exported"
    export.export_tables(export.load_tables(run_dir), out, ("torchrec",))
    info = json.loads((out / "tables.json").read_text())
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                **{k: t[k] for k in ("name", "feature_names", "num_embeddings", "embedding_dim")}
            )
            for t in info
        ],
        device=torch.device("cpu"),
    )
    ebc.load_state_dict(torch.load(out / "torchrec_ebc.pt"))
    ids = _ids([t["num_embeddings"] for t in info])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[t["feature_names"][0] for t in info],
        values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int64),
    )
    pooled = ebc(kjt).values().view(ids.shape[0], len(info), -1)
    torch.testing.assert_close(pooled, _trained_lookups(run_dir, ids), rtol=0, atol=1e-6)


def test_export_refuses_in_one_line_when_disk_or_memory_is_short(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from collections import namedtuple

    from slipcache import export, memory

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    need = r"^export: fp32 of .* rows at dim .* need .* GB on disk \(fp32 .* GB\), .* free"
    with pytest.raises(memory.SlipcacheError, match=need):
        export.check_room(run_dir, tmp_path / "new" / "dir", ("fp32",))
    assert not (tmp_path / "new").exists()  # nothing written
    monkeypatch.undo()
    monkeypatch.setenv(memory.ENV_AVAILABLE, "0.5")
    with pytest.raises(memory.MemoryShortError, match=r"^export: .* need .* available 0.5 GB"):
        export.check_room(run_dir, tmp_path, ("int8",))
