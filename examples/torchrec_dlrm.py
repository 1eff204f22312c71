"""TorchRec's DLRM with slipcache tables: INT8 rows behind a 5 % fp32 cache instead of fp32 tables.

    python examples/torchrec_dlrm.py                       # synthetic Criteo-shaped batches
    python examples/torchrec_dlrm.py --data DIR --steps 200  # any dataset `slipcache train --data` reads
    python examples/torchrec_dlrm.py --data DIR --table-sizes 100000  # hashed ids: rows per table

Sharded by TorchRec's DistributedModelParallel, checkpointed with torch.distributed.checkpoint and resumed
on another number of processes (`--steps` is the total: the resumed run trains steps N+1..M):

    torchrun --nproc-per-node 2 examples/torchrec_dlrm.py --dmp --steps N --checkpoint-dir DIR
    python examples/torchrec_dlrm.py --dmp --steps M --resume DIR

Needs the torchrec extra (see the README, "Using slipcache with TorchRec"). The only change to a TorchRec
training script: the `EmbeddingBagCollection` becomes a `KeyedCachedEmbeddingBagCollection` built from the
same `EmbeddingBagConfig`s, and the optimizer gets `model.parameters()` (the dense ones): the tables update
themselves in backward.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DLRM

from slipcache.data.batches import BatchIterator
from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection, sparse_to_kjt


def synthetic_batches(table_sizes: list[int], batch_size: int, steps: int, seed: int = 0):
    """Labels that depend on table 0's id and dense feature 0, so a few steps visibly learn."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(table_sizes[0], generator=gen) * 3
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, n, (batch_size,), generator=gen) for n in table_sizes], dim=1)
        dense = torch.rand(batch_size, 13, generator=gen) * 3
        logits = weights[ids[:, 0]] + 2 * (dense[:, 0] - 1.5)
        labels = (torch.rand(batch_size, generator=gen) < torch.sigmoid(logits)).float()
        yield dense, ids, labels


def open_data(data: str, table_sizes: list[int] | None, dim: int, precision: str):
    """The dataset, its tables checked against the memory first when sized by the ids' max + 1 (hashed
    ids would ask for billions of rows): one line saying to pass --table-sizes instead of a crash."""
    from slipcache.data.formats import open_any
    from slipcache.errors import SlipcacheError
    from slipcache.training.datasets import require_inferred_sizes_fit

    try:
        dataset = open_any(data, table_sizes=table_sizes)
        require_inferred_sizes_fit(dataset, dim=dim, precision=precision, cache_size=0.05)
    except SlipcacheError as exc:
        raise SystemExit(f"torchrec_dlrm.py: error: {exc}") from None
    return dataset


def dataset_batches(data: str, batch_size: int, steps: int, table_sizes: list[int] | None = None):
    from slipcache.data.formats import open_any

    dataset = open_any(data, table_sizes=table_sizes)
    for step, batch in enumerate(
        BatchIterator(dataset.split("train"), batch_size, shuffle=True, drop_last=True)
    ):
        if step == steps:
            return
        yield batch.dense, batch.sparse, batch.labels


def build(table_sizes: list[int], dim: int, **options) -> DLRM:
    tables = [
        EmbeddingBagConfig(name=f"t_cat_{t}", embedding_dim=dim, num_embeddings=n, feature_names=[f"cat_{t}"])
        for t, n in enumerate(table_sizes)
    ]
    embeddings = KeyedCachedEmbeddingBagCollection(tables, **options)
    return DLRM(
        embedding_bag_collection=embeddings,
        dense_in_features=13,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
    )


def train(model: DLRM, batches, lr: float = 0.5) -> list[float]:
    feature_names = model.sparse_arch.embedding_bag_collection.feature_names
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # dense parameters; tables update in backward
    losses = []
    for dense, ids, labels in batches:
        logits = model(dense, sparse_to_kjt(ids, feature_names)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_dmp(args: argparse.Namespace, table_sizes: list[int]) -> None:
    """DMP over the processes torchrun started (or this one alone), from a checkpoint if `--resume`; each
    rank trains its slice of every global batch; ends with the line `step M loss X` (the global batch's)."""
    import os
    import socket

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    # Before the group exists: imported later (TorchRec does it lazily), this module keeps the group alive in
    # its functions' default arguments, and a gloo thread outliving it can abort the process at exit.
    import torch.distributed.nn.functional  # noqa: F401
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder, slipcache_planner

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # one process: a group of one
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"torchrec_dlrm.py: error: --batch-size must be a multiple of the {world} processes")
    model = build(table_sizes, args.dim, precision=args.precision, cache_size=0.05, lr=0.5)
    sharders = [KeyedCachedEmbeddingBagCollectionSharder()]
    plan = slipcache_planner(Topology(world_size=world, compute_device="cpu")).collective_plan(
        model, sharders, dist.group.WORLD
    )
    model = DistributedModelParallel(model, device=torch.device("cpu"), sharders=sharders, plan=plan)
    optimizer = torch.optim.SGD(dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=0.5)
    # the tables' rows and their fused optimizer's state (empty for SGD; Adagrad's sums, Adam's moments)
    state = {
        "model": model.state_dict(),
        "optim": model.fused_optimizer.state_dict(),
        "step": torch.zeros((), dtype=torch.int64),
    }
    if args.resume:
        dcp.load(state, checkpoint_id=args.resume)
        model.load_state_dict(state["model"])
        model.fused_optimizer.load_state_dict(state["optim"])
    start = int(state["step"])
    feature_names = [f"cat_{t}" for t in range(len(table_sizes))]
    mine = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
    loss = torch.zeros(())
    for step, (dense, ids, labels) in enumerate(
        synthetic_batches(table_sizes, args.batch_size, args.steps), 1
    ):
        if step <= start:
            continue  # the batches the checkpointed run trained on
        logits = model(dense[mine], sparse_to_kjt(ids[mine], feature_names)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.fused_optimizer.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    if args.checkpoint_dir:
        state = {
            "model": model.state_dict(),
            "optim": model.fused_optimizer.state_dict(),
            "step": torch.tensor(args.steps),
        }
        dcp.save(state, checkpoint_id=args.checkpoint_dir)
    if rank == 0:
        print(f"step {args.steps} loss {float(loss) / world:.6f}")
    del model, optimizer, state  # they hold the group: let go of it before it is destroyed
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: synthetic batches)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--precision", default="int8")
    parser.add_argument(
        "--table-sizes",
        type=lambda text: [int(v) for v in text.split(",")],
        help="rows per table (one for all, or 26): ids are taken modulo them, as TorchRec's hashing does; "
        "default: the data's own counts, else max id + 1",
    )
    parser.add_argument(
        "--dmp", action="store_true", help="shard the tables with TorchRec's DistributedModelParallel"
    )
    parser.add_argument(
        "--checkpoint-dir", help="with --dmp: save a torch.distributed.checkpoint here at the end"
    )
    parser.add_argument(
        "--resume", help="with --dmp: continue from this checkpoint (any number of processes)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.dmp:
        if args.data:
            raise SystemExit("torchrec_dlrm.py: error: --dmp trains on synthetic batches (no --data)")
        train_dmp(args, [1000, 500, 20000] + [100] * 23)
        return
    if args.data:
        table_sizes = open_data(args.data, args.table_sizes, args.dim, args.precision).table_sizes
        batches = dataset_batches(args.data, args.batch_size, args.steps, args.table_sizes)
    else:
        table_sizes = [1000, 500, 20000] + [100] * 23
        batches = synthetic_batches(table_sizes, args.batch_size, args.steps)
    model = build(table_sizes, args.dim, precision=args.precision, cache_size=0.05, lr=0.5)
    losses = train(model, batches)
    tenth = max(1, len(losses) // 10)
    first, last = sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth
    stats = model.sparse_arch.embedding_bag_collection.stats()
    print(
        f"{len(losses)} steps: loss {first:.4f} (first tenth) -> {last:.4f} (last tenth); "
        f"cache hit rate {stats['hit_rate']:.3f}"
    )


if __name__ == "__main__":
    main()
