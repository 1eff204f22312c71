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
    model.json, model.pt, vocabulary.pt
                        the rest of the model: its configuration, the dense layers' state dict and the
                        run's vocabulary (`slipcache.serving`), so `slipcache.load_model(DIR)` scores and
                        `slipcache predict` maps new raw rows as the training data was mapped

The values are the trained fp32 rows: cached rows overlaid on storage, exactly what the model reads.
Names follow TorchRec's Criteo convention (feature `cat_{t}`, table `t_cat_{t}`).

Streaming: the MLPerf tables are 104.5 GB in fp32, so the export holds the trained (quantized) model and
one chunk of rows (`CHUNK_BYTES` of fp32) at a time. One pass over the tables feeds every format; each
file is the one `torch.save` of the whole structure would write (`slipcache.torchfile`), its tensors written
record by record. The files go into a temporary directory beside `--out`, renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from slipcache.errors import SlipcacheError
from slipcache.options import add_huge_pages_flag, add_threads_flag
from slipcache.torchfile import TensorSlot, TorchFileWriter

if TYPE_CHECKING:
    from slipcache.model import DLRM

FORMATS = ("fp32", "torchrec", "int8", "tbe-int8")
FILES = {
    "fp32": "embedding_bags.pt",
    "torchrec": "torchrec_ebc.pt",
    "int8": "fbgemm_int8.pt",
    "tbe-int8": "fbgemm_tbe_int8.pt",
}


# fp32 rows read, converted and written at once (8 MiB): small enough that the allocator reuses its
# buffers instead of mapping fresh pages for every chunk (64 MiB chunks spent 12x the system time).
CHUNK_BYTES = 1 << 23
# The rest of the model, beside the tables (read by `slipcache.serving.load_model`).
MODEL_FORMAT = "slipcache-model"
MODEL_VERSION = 1
MODEL_INFO = "model.json"
MODEL_FILE = "model.pt"
STAGING_SUFFIX = ".export-tmp"  # the directory an export writes into before it is renamed to --out
PROGRESS_VALUES = 1 << 30  # a progress bar from this many values on (as for creating tables)


def table_name(t: int) -> str:
    return f"t_cat_{t}"


def feature_name(t: int) -> str:
    return f"cat_{t}"


class TableRows:
    """The fp32 rows of a model's tables, read a bounded chunk of rows at a time (at the MLPerf sizes the
    tables are 104.5 GB in fp32: an export may hold the quantized model, never the tables in fp32)."""

    def __init__(self, sizes: list[int], dim: int, read: Callable[[int, int, int], torch.Tensor]) -> None:
        self.sizes, self.dim, self._read = [int(n) for n in sizes], int(dim), read
        self.chunk_rows = max(1, CHUNK_BYTES // (4 * self.dim))

    def chunks(self, t: int) -> Iterator[torch.Tensor]:
        """Table `t`'s rows in order, `chunk_rows` at a time (fp32, CPU)."""
        for start in range(0, self.sizes[t], self.chunk_rows):
            yield self._read(t, start, min(start + self.chunk_rows, self.sizes[t])).detach().float().cpu()

    @classmethod
    def of_tensors(cls, tables: list[torch.Tensor]) -> TableRows:
        return cls([t.shape[0] for t in tables], tables[0].shape[1], lambda t, a, b: tables[t][a:b])

    @classmethod
    def of_model(cls, embeddings: Any) -> TableRows:
        """A trained collection's rows: cached rows overlaid on storage, exactly what the model reads."""
        if hasattr(embeddings, "read_rows") and not hasattr(embeddings, "bags"):
            offsets = [int(o) for o in embeddings.table_offsets]

            def read(t: int, start: int, stop: int) -> torch.Tensor:
                rows = torch.arange(offsets[t] + start, offsets[t] + stop, device=embeddings.device)
                with torch.no_grad():
                    return embeddings.read_rows(rows)

            return cls(list(embeddings.table_sizes), embeddings.dim, read)
        bags = embeddings.bags  # the fp32 nn.EmbeddingBag baseline
        return cls([b.num_embeddings for b in bags], bags[0].embedding_dim, lambda t, a, b: bags[t].weight[a:b])


def open_tables(checkpoint: str | Path) -> TableRows:
    """The tables of a training checkpoint (file, checkpoints dir or run dir; one process or many: a run of
    N processes is read from its newest complete checkpoint, every rank's shards), read chunk by chunk."""
    return open_model(checkpoint)[0]


def open_model(checkpoint: str | Path, huge_pages: str = "off") -> tuple[TableRows, Callable[[Path], None]]:
    """The checkpoint's tables, and a writer of the rest of the model (model.json, model.pt, vocabulary.pt)
    into an export directory."""
    from slipcache.data.vocabulary import Vocabulary
    from slipcache.training.saved_run import dense_inputs, find_checkpoint, load_saved_model

    saved = find_checkpoint(checkpoint, "--checkpoint").read()
    model = load_saved_model(saved, dense_inputs(saved.state), huge_pages=huge_pages)
    sizes = [int(n) for n in saved.state["table_sizes"]]
    vocabulary = Vocabulary.of_run(saved.state["config"], sizes)
    vocabulary.check_sizes(sizes)

    def write_model(directory: Path) -> None:
        write_model_files(directory, model, vocabulary, saved.state["config"], saved.path)

    return TableRows.of_model(model.embeddings), write_model


def write_model_files(
    directory: Path, model: DLRM, vocabulary: Any, config: dict[str, Any], checkpoint: Path
) -> None:
    """model.json (the configuration, the table files, the vocabulary), model.pt (the dense layers) and,
    for a frequency vocabulary, vocabulary.pt: each read by plain `torch.load(..., weights_only=True)`."""
    import dataclasses

    from slipcache.data.vocabulary import VOCABULARY_FILE

    dense = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    torch.save(dense, directory / MODEL_FILE)
    if vocabulary.kind == "frequency":
        torch.save(vocabulary.tensors(), directory / VOCABULARY_FILE)
    tables = sorted(p.name for p in directory.iterdir() if p.name in FILES.values())
    info = {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "model": dataclasses.asdict(model.config),
        "tables": tables,
        "table_names": [table_name(t) for t in range(len(model.config.table_sizes))],
        "feature_names": [feature_name(t) for t in range(len(model.config.table_sizes))],
        "vocabulary": vocabulary.info(),
        "trained": {"checkpoint": str(checkpoint), "config": config},
    }
    (directory / MODEL_INFO).write_text(json.dumps(info, indent=1) + "\n")


def load_tables(checkpoint: str | Path) -> list[torch.Tensor]:
    """Every fp32 table of a checkpoint at once (small runs and tests; `open_tables` streams)."""
    rows = open_tables(checkpoint)
    return [torch.cat(list(rows.chunks(t))) for t in range(len(rows.sizes))]


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


def _slots(fmt: str, sizes: list[int], dim: int) -> tuple[Any, list[list[TensorSlot]]]:
    """A format's file structure (what torch.load returns) with slots for the tensors, and each table's
    slots in the order their bytes are written."""
    f32, u8 = torch.float32, torch.uint8
    if fmt in ("fp32", "torchrec"):
        per = [[TensorSlot(f32, (n, dim))] for n in sizes]
        if fmt == "fp32":
            return {table_name(t): {"weight": s[0]} for t, s in enumerate(per)}, per
        return {f"embedding_bags.{table_name(t)}.weight": s[0] for t, s in enumerate(per)}, per
    if fmt == "int8":
        per = [[TensorSlot(u8, (n, dim + 8))] for n in sizes]
        return {table_name(t): s[0] for t, s in enumerate(per)}, per
    if fmt == "tbe-int8":
        per = [[TensorSlot(u8, (n, dim)), TensorSlot(u8, (n, 4))] for n in sizes]
        return [tuple(s) for s in per], per
    raise SlipcacheError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _convert(fmt: str, chunk: torch.Tensor) -> list[torch.Tensor]:
    """A chunk of fp32 rows in a format: one tensor per slot of the table (every layout is per row)."""
    if fmt in ("fp32", "torchrec"):
        return [chunk.contiguous()]
    if fmt == "int8":
        return [quantize_rowwise_int8(chunk)]
    return list(quantize_tbe_int8(chunk))


def write_tables(rows: TableRows, directory: Path, formats: tuple[str, ...]) -> dict[str, Path]:
    """Each format's file in `directory`, all in one pass over the tables, a chunk of rows at a time.

    A table's first slot is written as its chunks come; its later slots (tbe-int8's scale and bias, 4 bytes
    a row) are kept until the table ends, as the file holds them after its codes.
    """
    files: dict[str, tuple[TorchFileWriter, list[list[TensorSlot]]]] = {}
    try:
        for fmt in formats:
            structure, per_table = _slots(fmt, rows.sizes, rows.dim)
            files[fmt] = (TorchFileWriter(directory / FILES[fmt], structure), per_table)
        total = sum(rows.sizes)
        with tqdm(total=total, unit="rows", unit_scale=True, desc="exporting", leave=False,
                  disable=total * rows.dim < PROGRESS_VALUES or not sys.stderr.isatty()) as bar:
            for t in range(len(rows.sizes)):
                later: dict[str, list[list[torch.Tensor]]] = {fmt: [] for fmt in formats}
                for chunk in rows.chunks(t):
                    for fmt, (writer, per_table) in files.items():
                        first, *rest = _convert(fmt, chunk)
                        writer.write(per_table[t][0], first)
                        later[fmt].append(rest)
                    bar.update(chunk.shape[0])
                for fmt, (writer, per_table) in files.items():
                    for i, slot in enumerate(per_table[t][1:]):
                        for pieces in later[fmt]:
                            writer.write(slot, pieces[i])
        for writer, _ in files.values():
            writer.close()
    except BaseException:
        for writer, _ in files.values():
            writer.abort()
        raise
    info = [
        {"name": table_name(t), "feature_names": [feature_name(t)], "num_embeddings": n, "embedding_dim": rows.dim}
        for t, n in enumerate(rows.sizes)
    ]
    (directory / "tables.json").write_text(json.dumps(info, indent=1) + "\n")
    return {fmt: directory / FILES[fmt] for fmt in formats}


def export_tables(
    tables: list[torch.Tensor] | TableRows, out: str | Path, formats: tuple[str, ...] = FORMATS, *, force: bool = False,
    write_more: Callable[[Path], None] | None = None,
) -> dict[str, Path]:
    """Write the tables into directory `out` in each of `formats`; returns {format: file}.

    All or nothing: the files are written into a temporary sibling of `out` and renamed into place at the
    end, so an interrupted export leaves `out` as it was. An `out` that holds files is refused unless
    `force` (then its contents are replaced, only once the new ones are complete). `write_more` writes
    further files into the directory before it moves into place (the model beside its tables).
    """
    out = Path(out)
    for fmt in formats:
        _slots(fmt, [1], 1)  # an unknown format stops before anything is written
    staging = staging_dir(out, force)
    try:
        rows = tables if isinstance(tables, TableRows) else TableRows.of_tensors(tables)
        written = write_tables(rows, staging, formats)
        if write_more is not None:
            write_more(staging)
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {fmt: out / path.name for fmt, path in written.items()}


def check_out(out: Path, force: bool, source: Path | None = None) -> None:
    """Refuse an `--out` that is a file; that is, holds or lies inside `source` (the run directory, or the
    loose checkpoint file, the export reads); that holds files, unless `force`. Even with `force`, a
    directory holding a slipcache run or dataset is never replaced (one in use by a run: exit code 3)."""
    if out.is_symlink():  # the export replaces --out whole by a rename: a link would be renamed, not its target
        raise SlipcacheError(
            f"--out {out} is a symbolic link (to {os.readlink(out)}); an export replaces its --out whole and never "
            "writes through a link: give the directory itself"
        )
    if out.exists() and not out.is_dir():
        raise SlipcacheError(f"--out {out} exists and is not a directory")
    if source is not None:
        where, read = out.expanduser().resolve(), Path(source).expanduser().resolve()
        if where == read or read.is_relative_to(where) or where.is_relative_to(read):
            relation = "is" if where == read else "holds" if read.is_relative_to(where) else "lies inside"
            raise SlipcacheError(
                f"--out {out} {relation} {read}, which the export reads; choose a directory outside it"
            )
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise SlipcacheError(
                f"--out {out} is not empty; choose a new directory, or --force to replace its contents"
            )
        _refuse_runs_and_datasets(out)


def _refuse_runs_and_datasets(out: Path) -> None:
    """`--force` replaces exports and stray files, never a run or a dataset anywhere under `out`."""
    from slipcache.training import runlock
    from slipcache.training.rundir import holds_run_or_dataset

    for directory, names, files in os.walk(out):  # links are not followed
        here = Path(directory)
        if runlock.LOCK_NAME in files:
            runlock.refuse_if_held(here)
        what = holds_run_or_dataset(here, names, files)
        if what is not None:
            raise SlipcacheError(
                f"--out {out} holds a slipcache {what} ({here}); --force never replaces a run or a dataset: "
                "choose another --out"
            )


def staging_dir(out: Path, force: bool) -> Path:
    """A new empty temporary directory beside `out` (same filesystem: the final rename is atomic)."""
    check_out(out, force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=STAGING_SUFFIX, dir=out.parent))
    except OSError as exc:
        raise SlipcacheError(f"{out}: cannot create output directory: {exc}") from exc


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the complete export to `out`; a replaced `out` is moved aside first, then removed."""
    staging.chmod(0o755)  # mkdtemp's 0700 is for the unfinished files only
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".replaced", dir=out.parent))
        os.replace(out, old)  # onto the empty directory mkdtemp made
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)  # onto nothing, or onto an empty directory


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    parser.add_argument(
        "--out", required=True,
        help="directory to write the exported model into: tables, dense layers, configuration and vocabulary "
        "(new or empty; written beside it, then renamed into place)",
    )
    parser.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
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


# Bytes per row of each format's file (fp32 rows: dim * 4; int8: codes + fp32 scale and bias; tbe-int8:
# codes + fp16 scale and bias), and per table and per file: the zip records' headers, alignment, the pickle.
_ROW_BYTES = {
    "fp32": lambda d: 4 * d, "torchrec": lambda d: 4 * d, "int8": lambda d: d + 8, "tbe-int8": lambda d: d + 4
}
_TABLE_BYTES = 512
_FILE_BYTES = 1 << 16


def file_bytes(fmt: str, sizes: list[int], dim: int) -> int:
    """The size of a format's file for these tables (an upper bound within a few hundred bytes a table)."""
    return sum(sizes) * _ROW_BYTES[fmt](dim) + len(sizes) * _TABLE_BYTES * (2 if fmt == "tbe-int8" else 1) + _FILE_BYTES


def check_room(checkpoint: str | Path, out: str | Path, formats: tuple[str, ...]) -> None:
    """Before reading a table: refuse in one line when the export cannot fit the memory (the trained model,
    then a chunk of rows in each format beside it) or the disk under `out` (every file)."""
    from slipcache.embedding.config import EmbeddingConfig
    from slipcache.memory import GB, require_tables_fit
    from slipcache.training.saved_run import find_checkpoint

    state = find_checkpoint(checkpoint, "--checkpoint").read().state  # the small part: sizes and config
    sizes, dim = [int(n) for n in state["table_sizes"]], int(state["config"].get("embedding_dim", 16))
    rows = sum(sizes)
    chunk_rows = min(max(1, CHUNK_BYTES // (4 * dim)), max(sizes))
    # A chunk in fp32, its conversion into each format, and tbe-int8's scale and bias of the largest table.
    extra = chunk_rows * dim * 4 * (1 + len(formats)) + (max(sizes) * 4 if "tbe-int8" in formats else 0)
    config = state["config"]
    settings = {key: config[key] for key in ("precision", "cache_size", "cache_rows", "optimizer")
                if config.get(key) is not None}
    require_tables_fit(EmbeddingConfig(sizes, dim, **settings), "export",
                       embeddings=config.get("embeddings", "cached"), extra_bytes=extra)
    need = {fmt: file_bytes(fmt, sizes, dim) for fmt in formats}
    target = Path(out).parent  # the files are written beside --out, then renamed into it
    while not target.exists() and target != target.parent:
        target = target.parent
    free = shutil.disk_usage(target).free
    if sum(need.values()) > free:
        each = ", ".join(f"{fmt} {n / GB:.1f}" for fmt, n in need.items())
        fits = [fmt for fmt in FORMATS if file_bytes(fmt, sizes, dim) <= free]
        hint = f"alone, {' or '.join('--format ' + f for f in fits)} fits" if fits else "no format fits alone"
        raise SlipcacheError(
            f"export: {', '.join(formats)} of {rows:,} rows at dim {dim} need {sum(need.values()) / GB:.1f} GB on "
            f"disk ({each} GB), {target} has {free / GB:.1f} GB free; {hint}, or choose another --out"
        )


def run_export(args: argparse.Namespace) -> int:
    from slipcache.memory import GB, peak_rss_bytes

    formats = tuple(dict.fromkeys(args.formats or FORMATS))
    out = Path(args.out)
    from slipcache.training.saved_run import find_checkpoint

    saved = find_checkpoint(args.checkpoint, "--checkpoint")
    check_out(out, args.force, saved.run_dir or saved.path)  # never into (or over) what it reads
    check_room(args.checkpoint, out, formats)
    started = time.perf_counter()
    rows, write_model = open_model(args.checkpoint, args.huge_pages)
    written = export_tables(rows, out, formats, force=args.force, write_more=write_model)
    print(f"{len(rows.sizes)} tables, {sum(rows.sizes):,} rows of dim {rows.dim}")
    for fmt, path in written.items():
        print(f"  {fmt:<9} {path} ({np.format_float_positional(path.stat().st_size / 2**20, 2)} MiB)")
    vocabulary = json.loads((out / "model.json").read_text())["vocabulary"]
    print(f"  model     {out / 'model.json'}, {out / 'model.pt'} (dense layers); vocabulary: {vocabulary['kind']}"
          f"{'' if vocabulary['kind'] in ('frequency', 'hash') else ' (' + vocabulary['note'] + ')'}")
    print(f"  load it:  slipcache.load_model({str(out)!r}); score raw files: slipcache predict --checkpoint {out} "
          "FILE --out scores.txt")
    print(f"{time.perf_counter() - started:.1f} s (reading the checkpoint included), "
          f"peak RSS {peak_rss_bytes() / GB:.2f} GB")
    return 0
