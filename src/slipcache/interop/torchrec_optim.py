"""The sharded tables' optimizer as TorchRec's `KeyedOptimizer`, so `DistributedModelParallel.fused_optimizer`
(a `CombinedOptimizer`), warm-up wrappers and learning-rate schedulers reach them.

The update itself stays fused in backward (each collection applies it as the backward pass ends), as in
TorchRec's fused tables: `step()` and `zero_grad()` have nothing to do. What the optimizer carries is its
hyper-parameters: one param group with `lr` and `weight_decay`. A scheduler that sets the group's `lr`
is followed at the module's next forward, so the very next backward updates the rows with it.

The optimizer state (Adagrad's sums, Adam's moments) lives in the collections' `optimizer_state` buffers.
`state` reads it as TorchRec's fused optimizers show theirs (fp32 copies, one ShardedTensor per table and
state: `torchrec_checkpoint.optimizer_state`), so `state_dict()` goes into a `torch.distributed.checkpoint`
with the model's; `load_state_dict` (TorchRec's: it copies into the tensors `state` gave, then calls
`post_load_state_dict`) writes them back. Each read of `state` copies the state: read it to save or load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchrec.optim.fused import FusedOptimizer

from slipcache.errors import InvalidInputError
from slipcache.interop.torchrec_checkpoint import load_optimizer_state, optimizer_state
from slipcache.interop.torchrec_weights import torchrec_key


class CachedTablesOptimizer(FusedOptimizer):
    """Hyper-parameters and state of a rank's slipcache collections, keyed by TorchRec's table keys."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._collections = module.local_collections()
        # one placeholder per table this rank holds a shard of, under TorchRec's key: KeyedOptimizer
        # identifies params (and groups) by tensor
        names = dict.fromkeys(t.name for tables in module.local_tables for t in tables)
        self._placeholders = {name: torch.empty(0) for name in names}
        params = {
            torchrec_key(name, module.torchrec_prefix): placeholder for name, placeholder in self._placeholders.items()
        }
        first = self._collections[0].config if self._collections else None
        group = {
            "params": list(params.values()),
            "lr": first.lr if first else 0.0,
            "weight_decay": first.weight_decay if first else 0.0,
        }
        self._read: dict[Tensor, dict[str, Any]] = {}
        super().__init__(params, {}, [group])

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        """Copies of the tables' optimizer state, by placeholder param (what state_dict() saves)."""
        read = optimizer_state(self._module)
        self._read = {self._placeholders[name]: value for name, value in read.items()}
        return self._read

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise InvalidInputError("the tables' optimizer state is loaded with load_state_dict")

    def post_load_state_dict(self) -> None:
        """Write the state that load_state_dict copied into the last read back into the tables."""
        loaded = {name: self._read[p] for name, p in self._placeholders.items() if p in self._read}
        load_optimizer_state(self._module, loaded)

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
