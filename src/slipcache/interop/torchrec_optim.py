"""The sharded tables' optimizer as TorchRec's `KeyedOptimizer`, so `DistributedModelParallel.fused_optimizer`
(a `CombinedOptimizer`), warm-up wrappers and learning-rate schedulers reach them.

The update itself stays fused in backward (each collection applies it as the backward pass ends), as in
TorchRec's fused tables: `step()` and `zero_grad()` have nothing to do. What the optimizer carries is its
hyper-parameters: one param group with `lr` and `weight_decay`. A scheduler that sets the group's `lr`
is followed at the module's next forward, so the very next backward updates the rows with it.

The optimizer state (Adagrad's sums, Adam's moments) lives in the collections' `optimizer_state` buffers
and is saved with the module's state_dict; the `KeyedOptimizer` state is left empty.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchrec.optim.fused import FusedOptimizer

from slipcache.errors import InvalidInputError


class CachedTablesOptimizer(FusedOptimizer):
    """Hyper-parameters of a rank's slipcache collections, keyed by table shard (`<name>.rows`)."""

    def __init__(self, collections: list[Any]) -> None:
        self._collections = collections
        # one placeholder per table shard: KeyedOptimizer identifies params (and groups) by tensor
        params: dict[str, Tensor] = {
            f"{name}.rows": torch.empty(0) for collection in collections for name in collection.table_names
        }
        first = collections[0].config if collections else None
        group = {
            "params": list(params.values()),
            "lr": first.lr if first else 0.0,
            "weight_decay": first.weight_decay if first else 0.0,
        }
        super().__init__(params, {}, [group])

    def follow_param_groups(self) -> None:
        """Hand the group's `lr` and `weight_decay` (as a scheduler left them) to the collections."""
        group = next(iter(self.param_groups))
        lr, decay = float(group["lr"]), float(group["weight_decay"])
        if not decay >= 0:
            raise InvalidInputError(f"weight_decay must be >= 0, got {decay}")
        for collection in self._collections:
            if collection.lr != lr:
                collection.lr = lr
            collection.config.weight_decay = decay

    def step(self, closure: Any = None) -> None:
        """The rows were updated in backward; this only hands over changed hyper-parameters."""
        self.follow_param_groups()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """No gradients are kept: each backward's are applied as it ends."""
