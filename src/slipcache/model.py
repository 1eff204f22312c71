"""DLRM (Naumov et al. 2019) and the fp32 `torch.nn.EmbeddingBag` baseline for its embeddings.

Data flow, top to bottom:

    dense [B, 13] --bottom MLP--> x [B, D]
    sparse ids [B, T] --embedding collection--> e [B, T, D]
    interaction: pairwise dot products of the T + 1 vectors {x, e_1..e_T} (upper triangle, no
                 diagonal) concatenated with x          -> [B, D + (T + 1) T / 2]
    top MLP -> logit [B]

The embedding collection is pluggable: `build_embeddings` returns either the baseline below or the
mixed-precision cached collection from `slipcache.embedding.collection`; both share the interface in
docs/design.md, so the model and the training loop do not care which one they get.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slipcache.embedding.tables import EmbeddingTables
from slipcache.errors import InvalidInputError, SettingError, SlipcacheError

if TYPE_CHECKING:
    from slipcache.embedding.collection import EmbeddingConfig

EMBEDDING_KINDS = ("cached", "torch")
INTERACTIONS = ("dot", "cat")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


@dataclass
class ModelConfig:
    """DLRM shape. Defaults follow the DLRM reference configuration for Criteo Kaggle."""

    table_sizes: list[int]
    num_dense: int = 13
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])  # last == embedding_dim
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])  # last == 1 (the logit)
    interaction: str = "dot"  # dot: pairwise dot products (DLRM); cat: the vectors side by side
    autocast: str | None = None  # "bf16": the MLPs and the interaction compute in bfloat16 (torch.autocast)

    def __post_init__(self) -> None:
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise SettingError("table_sizes", f"table sizes must be positive, got {self.table_sizes}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            message = f"the bottom MLP must end in the embedding dim {self.embedding_dim}, got {self.bottom_mlp}"
            raise SettingError("bottom_mlp", message)
        if any(n < 1 for n in [*self.bottom_mlp, *self.top_mlp]):
            raise SettingError("bottom_mlp" if min(self.bottom_mlp) < 1 else "top_mlp",
                               f"MLP layer sizes must be positive, got {self.bottom_mlp} and {self.top_mlp}")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise SettingError("top_mlp", f"the top MLP must end in 1 output (the logit), got {self.top_mlp}")
        if self.interaction not in INTERACTIONS:
            raise SettingError(
                "interaction", f"interaction must be one of {', '.join(INTERACTIONS)}, got {self.interaction!r}"
            )
        if self.autocast not in (None, *AUTOCAST_DTYPES):
            raise SettingError(
                "autocast", f"autocast must be one of {', '.join(AUTOCAST_DTYPES)} or none, got {self.autocast!r}"
            )

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP input: dot: D + (T+1)T/2 (16 + 27*26/2 = 367 for Criteo); cat: (T+1)D."""
        n = self.num_tables + 1
        if self.interaction == "cat":
            return n * self.embedding_dim
        return self.embedding_dim + n * (n - 1) // 2


class TorchEmbeddingBagCollection(EmbeddingTables):
    """fp32 baseline: one `nn.EmbeddingBag` per table with sparse gradients, as in the DLRM reference.

    It has no cache and no fused update (`fused_update=False`): the trainer steps a torch optimizer over
    `parameters()`, which receive sparse gradients.
    """

    # buffers (register_buffer), declared for the type checker
    _lookups: torch.Tensor

    fused_update = False

    def __init__(
        self, table_sizes: list[int], dim: int, *, lr: float = 0.1, seed: int = 0,
        weights: list[torch.Tensor] | None = None,
    ) -> None:
        """`weights`: trained fp32 tables [rows, dim] to use as they are (not copied: a memory-mapped file
        stays mapped), instead of drawing rows."""
        super().__init__()
        self.table_sizes = list(table_sizes)
        self.dim = dim
        self.lr = lr
        self.table_offsets = torch.tensor([0, *torch.tensor(self.table_sizes).cumsum(0).tolist()])
        self._sizes = torch.tensor(self.table_sizes, dtype=torch.long)
        if weights is not None:
            shapes = [tuple(w.shape) for w in weights]
            if shapes != [(n, dim) for n in self.table_sizes]:
                raise SlipcacheError(f"tables of shapes {shapes} do not match sizes {self.table_sizes} at dim {dim}")
            self.bags = nn.ModuleList(
                nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", sparse=True) for w in weights
            )
        else:
            bags = [nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in self.table_sizes]
            self.bags = nn.ModuleList(bags)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for bag, n in zip(bags, self.table_sizes, strict=True):
                    bound = math.sqrt(1.0 / n)  # DLRM reference init
                    bag.weight.uniform_(-bound, bound, generator=gen)
        self.register_buffer("_lookups", torch.zeros(len(self.table_sizes), dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids LongTensor [B, T], one id per table -> [B, T, D]."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != len(self.table_sizes):
            raise InvalidInputError(
                f"expected ids of shape [B, {len(self.table_sizes)}], got {getattr(ids, 'shape', type(ids))}"
            )
        ids = ids.long()
        if ids.numel() and (bool((ids < 0).any()) or bool((ids >= self._sizes).any())):
            raise InvalidInputError("embedding id out of range for its table")
        self._lookups += ids.shape[0]
        return torch.stack([bag(ids[:, t : t + 1]) for t, bag in enumerate(self.bags)], dim=1)

    @torch.no_grad()
    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Current fp32 values of global rows (row = table_offsets[t] + id)."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        tables = torch.searchsorted(self.table_offsets, rows, right=True) - 1
        out = torch.empty(rows.numel(), self.dim)
        for t in tables.unique().tolist():
            mask = tables == t
            out[mask] = self.bags[t].weight[rows[mask] - self.table_offsets[t]]
        return out

    @torch.no_grad()
    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Set the fp32 values of unique global rows (a feature that holds rows fixed: freezing)."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        tables = torch.searchsorted(self.table_offsets, rows, right=True) - 1
        for t in tables.unique().tolist():
            mask = tables == t
            self.bags[t].weight[rows[mask] - self.table_offsets[t]] = values[mask].to(torch.float32)

    def stats(self) -> dict[str, Any]:
        """Same keys as the cached collection; there is no cache, so its figures are zero."""
        lookups = int(self._lookups.sum())
        zero = {"hits": 0, "misses": 0, "evictions": 0, "rows_in": 0, "rows_out": 0}
        return {
            "lookups": lookups,
            **zero,
            "bytes_in": 0,
            "bytes_out": 0,
            "hit_rate": None,
            "per_table": [{"lookups": int(n), **zero, "hit_rate": None} for n in self._lookups],
        }

    def memory_report(self) -> dict[str, Any]:
        weight_bytes = sum(weight.numel() * weight.element_size() for weight in self.parameters())  # the bags' weights
        return {
            "components": {"fp32 weights": weight_bytes},
            "total_bytes": weight_bytes,
            "fp32_bytes": weight_bytes,
            "memory_ratio": 1.0,
        }

    def flush(self) -> None:
        """Nothing is cached: the weights are always current."""


# How the memory check names a model's `extra_bytes`, and what makes them smaller.
DENSE_PART = "MLPs and per-batch buffers"
DENSE_ADVICE = "narrower --bottom-mlp / --top-mlp, a smaller --dim or --batch-size"


def embedding_config(table_sizes: list[int], dim: int, **options: Any) -> EmbeddingConfig:
    """The cached collection's config, with a bad combination (e.g. from a config file) as a one-line error."""
    from slipcache.embedding.collection import EmbeddingConfig

    try:
        return EmbeddingConfig(table_sizes=list(table_sizes), dim=dim, **options)
    except ValueError as exc:  # e.g. a per-table list of the wrong length
        raise SlipcacheError(f"embedding configuration: {exc}") from exc


def build_embeddings(
    table_sizes: list[int], dim: int, *, embeddings: str = "cached", draw_rows: bool = True, extra_bytes: int = 0,
    **options: Any,
) -> EmbeddingTables:
    """The one place that picks an embedding implementation.

    `options`: `EmbeddingConfig` fields (precision, cache_size, cache_rows, policy, rounding, optimizer, lr,
    seed, ...); what is not given takes `EmbeddingConfig`'s default, the one place the defaults live.
    embeddings="torch": the fp32 `nn.EmbeddingBag` baseline (only lr and seed apply).
    embeddings="cached": mixed-precision storage with an fp32 cache (`slipcache.embedding.collection`);
    `draw_rows` False: a checkpoint's rows are loaded next, so none are drawn. `extra_bytes`: what the caller
    allocates next (the MLPs and per-batch buffers, `memory.model_bytes`), priced in the same check.
    """
    from slipcache.memory import require_tables_fit

    if embeddings not in EMBEDDING_KINDS:
        raise SlipcacheError(f"unknown embeddings {embeddings!r}; choose one of {', '.join(EMBEDDING_KINDS)}")
    config = embedding_config(table_sizes, dim, **options)
    require_tables_fit(config, "embedding tables", embeddings=embeddings, extra_bytes=extra_bytes,
                       extra_what=DENSE_PART, extra_advice=DENSE_ADVICE)
    if embeddings == "torch":
        return TorchEmbeddingBagCollection(table_sizes, dim, lr=config.lr, seed=config.seed)
    from slipcache.embedding.collection import CachedEmbeddingBagCollection

    return CachedEmbeddingBagCollection(config, draw_rows=draw_rows)


def _mlp(sizes: list[int], *, final_relu: bool) -> nn.Sequential:
    """Linear+ReLU stack with DLRM init: W ~ N(0, sqrt(2/(fan_in+fan_out))), b ~ N(0, sqrt(1/fan_out))."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        linear = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
        layers.append(linear)
        if final_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embeddings, dot-product interaction, top MLP -> one logit per sample."""

    # buffers (register_buffer), declared for the type checker
    _pair_rows: torch.Tensor
    _pair_cols: torch.Tensor

    def __init__(self, config: ModelConfig, embeddings: EmbeddingTables) -> None:
        super().__init__()
        if list(embeddings.table_sizes) != list(config.table_sizes) or embeddings.dim != config.embedding_dim:
            raise SlipcacheError("the embedding collection does not match the model's table sizes or dim")
        self.config = config
        self.bottom = _mlp([config.num_dense, *config.bottom_mlp], final_relu=True)
        self.embeddings = embeddings
        self.top = _mlp([config.interaction_dim, *config.top_mlp], final_relu=False)
        n = config.num_tables + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("_pair_rows", rows, persistent=False)
        self.register_buffer("_pair_cols", cols, persistent=False)

    def interact(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """x [B, D], emb [B, T, D] -> dot: [B, D + (T+1)T/2], x and every distinct pairwise dot product;
        cat: [B, (T+1)D], the vectors side by side."""
        z = torch.cat([x.unsqueeze(1), emb], dim=1)  # [B, T+1, D]
        if self.config.interaction == "cat":
            return z.flatten(1)
        dots = torch.bmm(z, z.transpose(1, 2))  # [B, T+1, T+1]
        return torch.cat([x, dots[:, self._pair_rows, self._pair_cols]], dim=1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with self._autocast(dense):
            x = self.bottom(dense)
        emb = self.embeddings(sparse)  # the tables keep their own precision: outside the autocast
        with self._autocast(dense):
            logits = self.top(self.interact(x, emb)).squeeze(1)
        return logits.float()  # the loss and the metrics in fp32

    def _autocast(self, like: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        """`--autocast`: the MLPs and the interaction in that dtype (autocast keeps fp32 where it must)."""
        dtype = AUTOCAST_DTYPES.get(self.config.autocast or "")
        return contextlib.nullcontext() if dtype is None else torch.autocast(like.device.type, dtype=dtype)

    def dense_parameters(self) -> list[nn.Parameter]:
        """MLP parameters: the ones the dense optimizer owns (embeddings are updated separately)."""
        return [*self.bottom.parameters(), *self.top.parameters()]
