"""TorchRec's `quantize_embeddings` (and `quantize_inference_model`, which calls it) on a model holding
`KeyedCachedEmbeddingBagCollection`.

TorchRec swaps the modules its mapping names (its own `EmbeddingBagCollection`); any other module is left
as it is without a word. Ours is left only when asked to be:

- named in the call (`additional_qconfig_spec_keys=[KeyedCachedEmbeddingBagCollection]`,
  `additional_mapping={KeyedCachedEmbeddingBagCollection: KeyedCachedEmbeddingBagCollection}`), TorchRec's
  module swap calls our `from_float`, which stores every table at the dtype asked for (`per_table_weight_dtype`
  by table name) and keeps the module: the rows are rounded to nearest into that precision;
- not named, the call is refused in one line that says how to name it (a plain
  `torch.ao.quantization.quantize_dynamic` of the dense layers is left alone).

torchrec is not imported here: its quantization is recognised by the call's own frame.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from slipcache.errors import SlipcacheError

# a quantization dtype -> our storage precision (TorchRec's quantized tables: its DataType of the same name)
PRECISION_OF_DTYPE = {
    torch.qint8: "int8",
    torch.quint8: "int8",
    torch.quint4x2: "int4",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
}
DATA_TYPE_OF_PRECISION = {"int8": "INT8", "int4": "INT4", "fp16": "FP16", "bf16": "BF16", "fp32": "FP32"}
_QUANTIZERS = {("torchrec.inference.modules", "quantize_embeddings")}

REFUSAL = (
    "torchrec's quantize_embeddings does not reach slipcache's tables unless named: pass "
    "additional_qconfig_spec_keys=[KeyedCachedEmbeddingBagCollection], additional_mapping="
    "{KeyedCachedEmbeddingBagCollection: KeyedCachedEmbeddingBagCollection} (their rows are then stored at "
    "the dtype asked for), or leave the collection out of the model quantized"
)


def in_torchrec_quantization() -> bool:
    """Whether TorchRec's `quantize_embeddings` is running further up the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _QUANTIZERS:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def check_qconfig(value: Any) -> None:
    """Called as a quantization pass sets a module's `qconfig`: None inside TorchRec's quantize_embeddings
    means our module was not named in it, which is refused (TorchRec would leave it as it is)."""
    if value is None and in_torchrec_quantization():
        raise SlipcacheError(REFUSAL)


def precisions_of(qconfig: Any, table_names: list[str]) -> dict[str, str]:
    """The storage precision of each table asked for by TorchRec's `QuantConfig` (`weight`'s dtype,
    `per_table_weight_dtype` by table name); an output dtype other than fp32 is refused."""
    output = qconfig.activation().dtype
    if output != torch.float32:
        raise SlipcacheError(
            f"slipcache's tables give fp32 lookups; quantize_embeddings(output_dtype={output}) is refused"
        )
    default = qconfig.weight().dtype
    per_table = dict(getattr(qconfig, "per_table_weight_dtype", None) or {})
    unknown = sorted(set(per_table) - set(table_names))
    if unknown:
        raise SlipcacheError(f"per_table_weight_dtype names tables the collection lacks: {', '.join(unknown)}")
    chosen = {}
    for name in table_names:
        dtype = per_table.get(name, default)
        if dtype not in PRECISION_OF_DTYPE:
            raise SlipcacheError(
                f"table {name!r}: quantization dtype {dtype} has no storage precision here "
                "(torch.qint8, quint8, quint4x2, float16, bfloat16, float32)"
            )
        chosen[name] = PRECISION_OF_DTYPE[dtype]
    return chosen
