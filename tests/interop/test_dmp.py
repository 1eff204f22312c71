"""Our collection in a 2-process gloo job, under TorchRec's `DistributedModelParallel`, DDP, FSDP and a
hand-written wrapper.

None of them shards it: each would keep a full, diverging copy per rank. The first training forward
refuses with one line on every rank whatever the wrapper (the check is about the job, not the call
stack); evaluation (read-only) still runs, and a model marked `allow_independent_replicas` trains.
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


class _AveragesDenseGradients(torch.nn.Module):
    """A hand-written data-parallel wrapper: no torch or TorchRec class a stack walk would recognise."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.register_hook(lambda grad: _all_reduce_mean(grad))

    def forward(self, *inputs: object) -> torch.Tensor:
        return self.model(*inputs)


def _all_reduce_mean(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    torch.distributed.all_reduce(grad)
    return grad / torch.distributed.get_world_size()


def _wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    if wrapper == "dmp":
        from torchrec.distributed.model_parallel import DistributedModelParallel

        return DistributedModelParallel(model, device=torch.device("cpu"))
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    return _AveragesDenseGradients(model)


def _wrapped_training_is_refused(rank: int, world_size: int, wrappers: tuple[str, ...]) -> None:
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    for wrapper in wrappers:
        _check_refused(rank, wrapper)


def _check_refused(rank: int, wrapper: str) -> None:
    from slipcache.errors import SlipcacheError

    model = _model()
    tables_before = [t.clone() for t in model.sparse_arch.embedding_bag_collection.export_tables()]
    wrapped = _wrap(model, wrapper)
    dense, kjt = _batch(rank)
    with pytest.raises(SlipcacheError) as caught:
        wrapped(dense, kjt)
    message = str(caught.value)
    assert "\n" not in message
    assert "job of 2 processes" in message
    assert "torchrun --nproc-per-node N --no-python slipcache train" in message
    assert "allow_independent_replicas" in message
    after = model.sparse_arch.embedding_bag_collection.export_tables()
    assert all(torch.equal(a, b) for a, b in zip(after, tables_before, strict=True))  # nothing trained
    wrapped.eval()
    with torch.no_grad():
        assert wrapped(dense, kjt).shape == (4, 1)  # read-only lookups are equal on every rank: allowed


@pytest.mark.slow
def test_training_under_dmp_ddp_or_a_custom_wrapper_is_refused_on_every_rank() -> None:
    run_ranks(_wrapped_training_is_refused, ("dmp", "ddp", "custom"))


@pytest.mark.slow
def test_training_under_fsdp_is_refused_on_every_rank() -> None:
    run_ranks(_wrapped_training_is_refused, ("fsdp",))


def _independent_replicas_train(rank: int, world_size: int) -> None:
    from slipcache.embedding.replicas import allow_independent_replicas

    torch.manual_seed(0)  # a fixed draw: with four samples, an unlucky one leaves every ReLU dead and no gradient
    model = allow_independent_replicas(_model())
    tables_before = [t.clone() for t in model.sparse_arch.embedding_bag_collection.export_tables()]
    dense, kjt = _batch(rank)
    model(dense, kjt).sum().backward()  # each rank its own batch: its own tables, on purpose
    after = model.sparse_arch.embedding_bag_collection.export_tables()
    assert not all(torch.equal(a, b) for a, b in zip(after, tables_before, strict=True))


@pytest.mark.slow
def test_a_model_marked_as_independent_replicas_trains_in_a_multi_process_job() -> None:
    run_ranks(_independent_replicas_train)


def test_marking_a_model_without_our_tables_is_refused() -> None:
    from slipcache.embedding.replicas import allow_independent_replicas
    from slipcache.errors import SlipcacheError

    with pytest.raises(SlipcacheError, match="holds no CachedEmbeddingBagCollection"):
        allow_independent_replicas(torch.nn.Linear(2, 2))
