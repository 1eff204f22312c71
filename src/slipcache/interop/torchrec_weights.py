"""Weights between our TorchRec-facing tables and TorchRec's own `EmbeddingBagCollection`.

Our state_dict keeps its own keys (each table group's storage, cache, optimizer state and counters, under
`collections.<g>.`); TorchRec's holds one fp32 `embedding_bags.<table>.weight` per table. The mapping:

    torchrec_state_dict(ours)                 -> {"embedding_bags.<table>.weight": fp32 [rows, dim]}
    load_torchrec_state_dict(ours, state)     <- the same keys (e.g. a TorchRec EBC's state_dict())
    from_torchrec(ebc, precision="int8", ...) a TorchRec-trained EBC's weights in our tables, any precision
    to_torchrec(ours)                         a TorchRec EBC holding our current fp32 rows: serve it through
                                              TorchRec's quantization (`torchrec.inference.modules.
                                              quantize_embeddings(model, dtype=torch.qint8)`)

Values are the rows the model reads (cached rows overlaid on storage); loading rounds fp32 to nearest
into the storage precision and empties the caches. A plain `ours.load_state_dict(torchrec_state)` (or a whole
model's) loads TorchRec's keys the same way (`KeyedCachedEmbeddingBagCollection._load_from_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from slipcache.errors import InvalidInputError
from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection, import_torchrec

PREFIX = "embedding_bags."  # an EmbeddingBagCollection's; an EmbeddingCollection's is "embeddings."


def torchrec_key(table: str, prefix: str = PREFIX) -> str:
    """TorchRec's state_dict key of a table's weight in a bag (`prefix` "embedding_bags.") or a sequence
    ("embeddings.") collection."""
    return f"{prefix}{table}.weight"


def torchrec_state_dict(module: KeyedCachedEmbeddingBagCollection) -> dict[str, Tensor]:
    """Every table's current fp32 rows under TorchRec's keys: `embedding_bags.<table>.weight`, or
    `embeddings.<table>.weight` for a sequence collection."""
    with torch.no_grad():
        tables = module.export_tables()
    prefix = module.torchrec_prefix
    return {
        torchrec_key(n, prefix): t.detach().float().cpu()
        for n, t in zip(module.table_names, tables, strict=True)
    }


def load_torchrec_state_dict(
    module: KeyedCachedEmbeddingBagCollection, state_dict: Mapping[str, Any], strict: bool = True
) -> None:
    """Load TorchRec-keyed weights (fp32 or fp16) into our tables, rounded to their storage precision.

    Keys under a prefix (a whole model's state_dict: `sparse_arch.embedding_bag_collection.embedding_bags...`)
    are found by their suffix; with `strict`, a table without weights or a weight of no table is an error.
    """
    found: dict[str, Tensor] = {}
    unused = []
    for key, value in state_dict.items():
        name = _table_of_key(key, module.torchrec_prefix)
        if name in module.table_names:
            if name in found:
                raise InvalidInputError(
                    f"two weights for table {name!r} (keys ending in {torchrec_key(name, module.torchrec_prefix)})"
                )
            found[name] = value
        elif name is not None:
            unused.append(key)
    missing = [n for n in module.table_names if n not in found]
    if strict and (missing or unused):
        detail = f"no weight for table {missing[0]!r}" if missing else f"{unused[0]!r} matches no table"
        raise InvalidInputError(f"TorchRec state_dict does not match these tables: {detail}")
    current = module.export_tables() if missing else None
    tables = [
        found[n].detach().float().cpu() if n in found else current[i]  # type: ignore[index]
        for i, n in enumerate(module.table_names)
    ]
    module.load_tables(tables)


def _table_of_key(key: str, prefix: str) -> str | None:
    """The table of a `...<prefix><table>.weight` key, else None."""
    if not key.endswith(".weight") or prefix not in key:
        return None
    return key[key.rindex(prefix) + len(prefix) : -len(".weight")]


def from_torchrec(ebc: Any, **options: Any) -> KeyedCachedEmbeddingBagCollection:
    """Our tables with a TorchRec `EmbeddingBagCollection`'s configs, weights and weighting.

    `options` are our `EmbeddingConfig` fields (precision, cache_size, optimizer, lr, ...): a TorchRec-trained
    fp32 collection continues training in INT8 or INT4 behind a cache.
    """
    ours = KeyedCachedEmbeddingBagCollection(
        ebc.embedding_bag_configs(), is_weighted=bool(ebc.is_weighted()), **options
    )
    load_torchrec_state_dict(ours, ebc.state_dict())
    return ours


def to_torchrec(module: KeyedCachedEmbeddingBagCollection) -> Any:
    """A TorchRec `EmbeddingBagCollection` (fp32, CPU) holding our tables' current rows, for serving."""
    torchrec = import_torchrec()
    ebc = torchrec.EmbeddingBagCollection(
        tables=module.embedding_bag_configs(), is_weighted=module.is_weighted(), device=torch.device("cpu")
    )
    ebc.load_state_dict(torchrec_state_dict(module))
    return ebc
