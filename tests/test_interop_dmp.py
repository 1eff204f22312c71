"""Our collection under TorchRec's `DistributedModelParallel` (and plain DDP) on 2 gloo processes.

DMP has no sharder for it and would keep a full, diverging copy per rank: the first training forward
refuses with one line on every rank; evaluation (read-only) still runs.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from tests.ranks import run_ranks  # noqa: E402

SIZES = [50, 20, 30]


def _model() -> torch.nn.Module:
    from torchrec import EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=4, num_embeddings=n, feature_names=[f"f{t}"])
        for t, n in enumerate(SIZES)
    ]
    ebc = KeyedCachedEmbeddingBagCollection(tables, precision="fp32", lr=0.1)
    return DLRM(
        embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[4, 4], over_arch_layer_sizes=[4, 1]
    )


def _batch(rank: int) -> tuple[torch.Tensor, object]:
    from torchrec import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randint(0, n, (4,), generator=generator) for n in SIZES])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(len(SIZES))], values=ids.reshape(-1), lengths=torch.ones(12, dtype=torch.int64)
    )
    return torch.randn(4, 3, generator=generator), kjt


def _wrapped_training_is_refused(rank: int, world_size: int) -> None:
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    for wrapper in ("dmp", "ddp"):
        _check_refused(rank, wrapper)


def _check_refused(rank: int, wrapper: str) -> None:
    from slipcache.errors import SlipcacheError

    model = _model()
    tables_before = [t.clone() for t in model.sparse_arch.embedding_bag_collection.export_tables()]
    if wrapper == "dmp":
        from torchrec.distributed.model_parallel import DistributedModelParallel

        wrapped = DistributedModelParallel(model, device=torch.device("cpu"))
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    dense, kjt = _batch(rank)
    with pytest.raises(SlipcacheError) as caught:
        wrapped(dense, kjt)
    message = str(caught.value)
    assert "\n" not in message
    assert "torchrun --nproc-per-node N --no-python slipcache train" in message
    assert ("DistributedModelParallel" if wrapper == "dmp" else "DistributedDataParallel") in message
    after = model.sparse_arch.embedding_bag_collection.export_tables()
    assert all(torch.equal(a, b) for a, b in zip(after, tables_before, strict=True))  # nothing trained
    wrapped.eval()
    with torch.no_grad():
        assert wrapped(dense, kjt).shape == (4, 1)  # read-only lookups are equal on every rank: allowed


def test_training_under_dmp_or_ddp_is_refused_on_every_rank() -> None:
    run_ranks(_wrapped_training_is_refused)
