"""`slipcache export`: a trained checkpoint's tables in the layouts serving stacks load.

Written into `--out DIR`:

    embedding_bags.pt   {"t_cat_0": nn.EmbeddingBag state dict, ...}: fp32 weights, one bag per table
    torchrec_ebc.pt     a torchrec EmbeddingBagCollection state dict ("embedding_bags.t_cat_0.weight", ...)
    fbgemm_int8.pt      {"t_cat_0": uint8 [rows, dim + 8], ...}: FBGEMM's row-wise INT8 layout, each row
                        its codes then fp32 scale and fp32 bias (little endian), as
                        torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat reads it
    fbgemm_tbe_int8.pt  [(codes uint8 [rows, dim], scale_bias uint8 [rows, 4]), ...] per table: the
                        `weight_lists` that FBGEMM's inference tables
                        (`IntNBitTableBatchedEmbeddingBagsCodegen`, SparseType.INT8) take, fp16 scale
                        and bias per row (they keep them in front of the codes)
    tables.json         names, features, rows and dim of each table, to rebuild the modules

The values are the trained fp32 rows: cached rows overlaid on storage, exactly what the model reads.
Names follow TorchRec's Criteo convention (feature `cat_{t}`, table `t_cat_{t}`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipcache.cli import add_huge_pages_flag, add_threads_flag
from slipcache.errors import SlipcacheError

FORMATS = ("fp32", "torchrec", "int8", "tbe-int8")
FILES = {
    "fp32": "embedding_bags.pt",
    "torchrec": "torchrec_ebc.pt",
    "int8": "fbgemm_int8.pt",
    "tbe-int8": "fbgemm_tbe_int8.pt",
}


def table_name(t: int) -> str:
    return f"t_cat_{t}"


def feature_name(t: int) -> str:
    return f"cat_{t}"


def load_tables(checkpoint: str | Path) -> list[torch.Tensor]:
    """The fp32 tables of a training checkpoint (file, checkpoints dir or run dir; one process or many:
    a run of N processes is read from its newest complete checkpoint, every rank's shards)."""
    from slipcache.training.saved_run import find_checkpoint, load_saved_model

    saved = find_checkpoint(checkpoint, "--checkpoint")
    state = saved.read()
    model = load_saved_model(saved, state, num_dense=1, dense=False)  # the dense part is not exported
    embeddings = model.embeddings
    with torch.no_grad():
        if hasattr(embeddings, "export_tables"):
            return [t.detach().float().cpu() for t in embeddings.export_tables()]
        return [bag.weight.detach().float().clone() for bag in embeddings.bags]


def quantize_rowwise_int8(table: torch.Tensor) -> torch.Tensor:
    """FBGEMM's fused 8-bit row-wise layout: per row round((x - min) / scale) codes, fp32 scale, fp32 bias."""
    table = table.float()
    low = table.min(dim=1, keepdim=True).values
    high = table.max(dim=1, keepdim=True).values
    scale = (high - low) / 255.0
    inverse = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-30), torch.zeros_like(scale))
    codes = torch.round((table - low) * inverse).clamp_(0, 255).to(torch.uint8)
    params = torch.cat([scale, low], dim=1).contiguous().view(torch.uint8)  # 8 bytes per row
    return torch.cat([codes, params], dim=1)


def dequantize_rowwise_int8(fused: torch.Tensor) -> torch.Tensor:
    """The fp32 rows of `quantize_rowwise_int8`'s layout (what FBGEMM's inverse op computes)."""
    params = fused[:, -8:].contiguous().view(torch.float32)
    return fused[:, :-8].float() * params[:, :1] + params[:, 1:]


def _fp16_toward(values: torch.Tensor, direction: float) -> torch.Tensor:
    """`values` in fp16, rounded toward `direction` (-inf or +inf) so the fp16 grid still spans the row."""
    half = values.half()
    outside = half.float() > values if direction < 0 else half.float() < values
    return torch.where(outside, torch.nextafter(half, torch.full_like(half, direction)), half)


def quantize_tbe_int8(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FBGEMM inference INT8 rows: codes [rows, dim] and per row fp16 scale then fp16 bias, as bytes [rows, 4].

    The bias is the row minimum rounded down in fp16 and the scale the span / 255 rounded up, so every value
    lies on the grid's span; codes round to nearest (error at most half a step).
    """
    table = table.float()
    bias = _fp16_toward(table.min(dim=1, keepdim=True).values, float("-inf"))
    scale = _fp16_toward((table.max(dim=1, keepdim=True).values - bias.float()) / 255.0, float("inf"))
    inverse = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    codes = torch.round((table - bias.float()) * inverse).clamp_(0, 255).to(torch.uint8)
    scale_bias = torch.cat([scale, bias], dim=1).contiguous().view(torch.uint8)
    return codes.contiguous(), scale_bias


def export_tables(
    tables: list[torch.Tensor], out: str | Path, formats: tuple[str, ...] = FORMATS
) -> dict[str, Path]:
    """Write `tables` into `out` in each of `formats`; returns {format: file}."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SlipcacheError(f"{out}: cannot create output directory: {exc}") from exc
    written: dict[str, Path] = {}
    for fmt in formats:
        if fmt == "fp32":
            value: Any = {table_name(t): {"weight": w.contiguous()} for t, w in enumerate(tables)}
        elif fmt == "torchrec":
            value = {f"embedding_bags.{table_name(t)}.weight": w.contiguous() for t, w in enumerate(tables)}
        elif fmt == "int8":
            value = {table_name(t): quantize_rowwise_int8(w) for t, w in enumerate(tables)}
        elif fmt == "tbe-int8":
            value = [quantize_tbe_int8(w) for w in tables]
        else:
            raise SlipcacheError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        written[fmt] = out / FILES[fmt]
        torch.save(value, written[fmt])
    info = [
        {
            "name": table_name(t),
            "feature_names": [feature_name(t)],
            "num_embeddings": w.shape[0],
            "embedding_dim": w.shape[1],
        }
        for t, w in enumerate(tables)
    ]
    (out / "tables.json").write_text(json.dumps(info, indent=1) + "\n")
    return written


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    parser.add_argument("--out", required=True, help="directory to write the exported tables into")
    add_threads_flag(parser)
    add_huge_pages_flag(parser)
    parser.add_argument(
        "--format",
        dest="formats",
        action="append",
        choices=FORMATS,
        help="fp32 (nn.EmbeddingBag), torchrec (EmbeddingBagCollection), int8 (FBGEMM fused row-wise) or "
        "tbe-int8 (FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen weight_lists); "
        "repeat for several (default: all)",
    )


# Bytes per row of each format's file, beside the fp32 row (dim * 4) that every format starts from.
_ROW_BYTES = {"fp32": lambda d: 4 * d, "torchrec": lambda d: 4 * d, "int8": lambda d: d + 8, "tbe-int8": lambda d: d + 4}


def check_room(checkpoint: str | Path, out: str | Path, formats: tuple[str, ...]) -> None:
    """Before reading a table: refuse in one line when the export cannot fit the memory (the model and
    every table in fp32) or the disk under `out` (every file)."""
    import shutil

    from slipcache.memory import GB, require_tables_fit
    from slipcache.training.saved_run import find_checkpoint

    state = find_checkpoint(checkpoint, "--checkpoint").read()  # the small part: sizes and config
    sizes, dim = [int(n) for n in state["table_sizes"]], int(state["config"].get("embedding_dim", 16))
    rows = sum(sizes)
    config = state["config"]
    if config.get("embeddings", "cached") == "cached":  # the trained model, then every table in fp32 beside it
        require_tables_fit(
            sizes, dim, what="export", precision=config.get("precision", "int8"),
            cache_size=config.get("cache_size", 0.05), cache_rows=config.get("cache_rows"),
            optimizer=config.get("optimizer", "sgd"), extra_bytes=rows * dim * 4,
        )
    else:
        require_tables_fit(sizes, dim, what="export", embeddings="torch", extra_bytes=rows * dim * 4)
    need = sum(rows * _ROW_BYTES[f](dim) for f in formats)
    target = Path(out)
    while not target.exists() and target != target.parent:
        target = target.parent
    free = shutil.disk_usage(target).free
    if need > free:
        raise SlipcacheError(
            f"export: {', '.join(formats)} of {rows:,} rows at dim {dim} need {need / GB:.1f} GB on disk, "
            f"{target} has {free / GB:.1f} GB free; export fewer formats (--format int8 takes "
            f"{rows * _ROW_BYTES['int8'](dim) / GB:.1f} GB) or choose another --out"
        )


def run_export(args: argparse.Namespace) -> int:
    check_room(args.checkpoint, args.out, tuple(args.formats or FORMATS))
    tables = load_tables(args.checkpoint)
    written = export_tables(tables, args.out, tuple(args.formats or FORMATS))
    rows = sum(t.shape[0] for t in tables)
    print(f"{len(tables)} tables, {rows:,} rows of dim {tables[0].shape[1]}")
    for fmt, path in written.items():
        print(f"  {fmt:<9} {path} ({np.format_float_positional(path.stat().st_size / 2**20, 2)} MiB)")
    return 0
