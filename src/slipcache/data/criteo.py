"""Streaming readers of the raw Criteo formats, yielding chunks of numpy arrays.

Formats (detected from the first line):
- "tsv": Kaggle `train.txt` / Terabyte `day_N`: tab separated, label, I1..I13, C1..C26, no header.
  Trailing empty fields may be cut off, so 15 to 40 fields are accepted (missing ones are empty).
- "kaggle_csv": header `Id,Label,I1..I13,C1..C26` (CRLF line ends are fine); exactly 41 fields.
- "csv": header `label,I1..I13,C1..C26`; integer features may be written as floats (`260.0`); 40 fields.
Gzip input is recognized by its magic bytes, whatever the file name.

Why chunks: a Python loop per line only splits fields; all conversion (labels, dense floats, 8-digit hex
categoricals) is vectorized per chunk, which keeps parsing well above 100k rows/s. Lines are never all
in memory. Malformed lines are found per chunk with array masks, and only those are re-examined one
by one to say why.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from slipcache.errors import SlipcacheError

NUM_DENSE = 13
NUM_CATEGORICAL = 26
MISSING = -1  # categorical marker for an empty field (raw values are 0 .. 2**32 - 1)
DEFAULT_CHUNK_BYTES = 8 << 20
PAD = 24  # zero bytes after each block, so fixed-width reads past a field stay inside the buffer
TSV_MIN_FIELDS = 2 + NUM_DENSE  # label, I1..I13 and at least C1; the rest may be cut off
# Criteo lines are a few hundred bytes; a longer line is malformed, and reading one is bounded by this
# so a file without line ends cannot exhaust memory.
MAX_LINE_BYTES = 64 << 10
MAX_PARSE_LINES = 1 << 16  # lines whose fields are parsed at once: [lines, 40] int64 arrays, 20 MB each
DENSE_MAX = float(np.finfo(np.float32).max)  # dense values are stored as float32

# Hex digit value of each byte; 16 for the NUL padding of numpy bytes arrays, 255 for anything else.
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_HEX[0] = 16
_LABELS = {b"0": 0.0, b"1": 1.0, b"0.0": 0.0, b"1.0": 1.0}


@dataclass
class RawChunk:
    """Parsed good rows: labels float32 [n], dense float32 [n, 13] (NaN = missing),
    categorical int64 [n, 26] raw 32-bit values (MISSING = -1 for empty)."""

    labels: np.ndarray
    dense: np.ndarray
    categorical: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class ReadStats:
    """Line counts across files, with the first `max_examples` malformed lines as `file:line: reason`."""

    good: int = 0
    bad: int = 0
    examples: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    max_examples: int = 5

    def add_bad(self, message: str) -> None:
        self.bad += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(message)


@dataclass(frozen=True)
class _Layout:
    sep: bytes
    skip: int  # leading columns before the label (the Kaggle CSV `Id`)
    min_fields: int
    header: bool

    @property
    def full(self) -> int:
        return self.skip + 1 + NUM_DENSE + NUM_CATEGORICAL


LAYOUTS = {
    "tsv": _Layout(b"\t", 0, TSV_MIN_FIELDS, header=False),
    "kaggle_csv": _Layout(b",", 1, 1 + 1 + NUM_DENSE + NUM_CATEGORICAL, header=True),
    "csv": _Layout(b",", 0, 1 + NUM_DENSE + NUM_CATEGORICAL, header=True),
}


def detect_format(first_line: bytes) -> str:
    """Name of the format whose first line this is (see the module docstring)."""
    if first_line.startswith(b"\xef\xbb\xbf"):
        raise SlipcacheError(
            "starts with a UTF-8 byte-order mark (BOM), which is not part of the Criteo formats; remove it: "
            "sed -i '1s/^\\xEF\\xBB\\xBF//' FILE"
        )
    head = first_line.strip().lower()
    if head.startswith(b"id,label,i1,"):
        return "kaggle_csv"
    if head.startswith(b"label,i1,"):
        return "csv"
    if b"\t" in first_line:
        return "tsv"
    # The file's content is not echoed: a crafted run config can point --data at any file.
    fields = len(first_line.split(b","))
    raise SlipcacheError(
        "unrecognized format: expected tab-separated Criteo lines or a CSV header "
        f"'Id,Label,I1,...' or 'label,I1,...'; its first line has no tab and {fields} comma-separated fields"
    )


def check_raw_input(path: str | os.PathLike[str]) -> None:
    """One line unless `path` is a file that ends: a regular file or a pipe (`<(zcat ...)`); a character or
    block device (`/dev/zero`) or a socket would be read forever."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: the open says which
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        kind = "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
        raise SlipcacheError(f"{path}: is {kind}, not a Criteo data file")


def open_raw(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a raw file for binary line reading, transparently decompressing gzip."""
    p = Path(path)
    check_raw_input(p)
    try:
        raw = open(p, "rb")  # noqa: SIM115 - returned to the caller
    except FileNotFoundError as exc:
        raise SlipcacheError(f"{p}: no such file") from exc
    except IsADirectoryError as exc:
        raise SlipcacheError(f"{p}: is a directory, expected a Criteo data file") from exc
    except OSError as exc:
        raise SlipcacheError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    if raw.peek(2)[:2] == b"\x1f\x8b":
        return io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), 1 << 20)
    return raw


def read_chunks(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    stats: ReadStats | None = None,
) -> Iterator[RawChunk]:
    """Stream a raw Criteo file as RawChunks of the good rows of about `chunk_bytes` of input.

    Malformed lines are skipped and recorded in `stats` (pass one to see them), or with `strict`
    raise `SlipcacheError("file:line: reason")` at the first one.
    """
    stats = stats if stats is not None else ReadStats()
    name = str(path)
    with open_raw(path) as fh:
        try:
            first = _finish_line(fh)
            if not first:
                stats.formats[name] = "empty"
                return
            try:
                fmt = detect_format(first)
            except SlipcacheError as exc:
                raise SlipcacheError(f"{name}: {exc}") from exc
            stats.formats[name] = fmt
            layout = LAYOUTS[fmt]
            lineno = 2 if layout.header else 1
            pending = b"" if layout.header else first
            while True:
                block = pending + fh.read(max(chunk_bytes - len(pending), 1))
                pending = b""
                if not block:
                    return
                if not block.endswith(b"\n"):
                    block += _finish_line(fh)  # finish the last line
                    if not block.endswith(b"\n"):
                        block += b"\n"  # the file's last line has no line end
                chunk, lines = _parse_block(block, layout, name, lineno, strict, stats)
                lineno += lines
                if len(chunk):
                    yield chunk
        except (OSError, EOFError, zlib.error) as exc:
            raise SlipcacheError(f"{name}: read error: {exc}") from exc


def _finish_line(fh: BinaryIO) -> bytes:
    """The rest of the current line, cut after MAX_LINE_BYTES + 1 bytes (so it still reads as too long);
    the remainder of a longer line is read and dropped in bounded pieces."""
    head = fh.readline(MAX_LINE_BYTES + 1)
    if len(head) <= MAX_LINE_BYTES or head.endswith(b"\n"):
        return head
    while True:
        piece = fh.readline(MAX_LINE_BYTES + 1)
        if not piece or piece.endswith(b"\n"):
            return head + b"\n"


def _parse_block(
    block: bytes, layout: _Layout, name: str, lineno: int, strict: bool, stats: ReadStats
) -> tuple[RawChunk, int]:
    """Vectorized parse of complete lines (`block` ends with a newline); returns the good rows and
    the number of lines. Bad rows are masked out and reported.

    Memory follows the block's bytes, whatever its lines: lines that are malformed by their shape alone
    (blank, too few or too many fields, too long) are counted from per-line arrays of a few bytes each, and
    only the others get field arrays ([lines, 40] int64), MAX_PARSE_LINES at a time (16 M blank lines in a
    small gzip used to ask for 1.8 KB each)."""
    buf = np.frombuffer(block + bytes(PAD), dtype=np.uint8)
    newlines = np.flatnonzero(buf == 10)
    n = len(newlines)
    line_start = np.concatenate([[0], newlines[:-1] + 1])
    line_end = newlines - (buf[np.maximum(newlines - 1, 0)] == 13)  # CRLF
    line_end = np.maximum(line_end, line_start)
    seps = np.flatnonzero(buf == layout.sep[0])
    sep_line = np.searchsorted(newlines, seps)
    num_fields = np.bincount(sep_line, minlength=n) + 1
    bad = (num_fields < layout.min_fields) | (num_fields > layout.full)
    bad |= line_end == line_start  # blank line
    bad |= line_end - line_start > MAX_LINE_BYTES

    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    candidates = np.flatnonzero(~bad)
    for first in range(0, len(candidates), MAX_PARSE_LINES):
        lines = candidates[first : first + MAX_PARSE_LINES]
        lo, hi = int(lines[0]), int(lines[-1]) + 1
        s0, s1 = np.searchsorted(sep_line, [lo, hi])
        row_of = np.full(hi - lo, -1, dtype=np.int64)
        row_of[lines - lo] = np.arange(len(lines))
        rows = row_of[sep_line[s0:s1] - lo]
        use = rows >= 0
        labels, dense, cats, fields_bad = _parse_fields(
            block, buf, layout, lines, line_start, line_end, num_fields, seps[s0:s1][use], rows[use]
        )
        bad[lines] |= fields_bad
        keep = ~fields_bad
        parts.append((labels[keep], dense[keep], cats[keep]))

    bad_lines = np.flatnonzero(bad)
    if strict and len(bad_lines):
        i = int(bad_lines[0])
        raise SlipcacheError(f"{name}:{lineno + i}: {_reason(block[line_start[i] : line_end[i]], layout)}")
    for i in bad_lines[: max(0, stats.max_examples - len(stats.examples))]:
        stats.examples.append(f"{name}:{lineno + int(i)}: {_reason(block[line_start[i] : line_end[i]], layout)}")
    stats.bad += len(bad_lines)
    stats.good += n - len(bad_lines)
    if not parts:
        parts = [(np.zeros(0, np.float32), np.zeros((0, NUM_DENSE), np.float32),
                  np.zeros((0, NUM_CATEGORICAL), np.int64))]
    chunk = RawChunk(
        labels=np.concatenate([p[0] for p in parts]),
        dense=np.concatenate([p[1] for p in parts]),
        categorical=np.concatenate([p[2] for p in parts]),
    )
    return chunk, n


def _parse_fields(
    block: bytes, buf: np.ndarray, layout: _Layout, lines: np.ndarray, line_start: np.ndarray,
    line_end: np.ndarray, num_fields: np.ndarray, seps: np.ndarray, rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(labels, dense, categorical, bad) of the well-shaped `lines` (indices into the block's lines);
    `seps`: the separators of these lines, `rows`: the position in `lines` of each one's line."""
    m, full = len(lines), layout.full
    # Field boundaries [m, full]; fields cut off at the end of a line stay empty (start == end == 0).
    starts = np.zeros((m, full), dtype=np.int64)
    ends = np.zeros((m, full), dtype=np.int64)
    starts[:, 0] = line_start[lines]
    fields = num_fields[lines]
    rank = np.arange(len(seps)) - (np.cumsum(fields - 1) - (fields - 1))[rows]
    starts[rows, rank + 1] = seps + 1
    ends[rows, rank] = seps
    ends[np.arange(m), fields - 1] = line_end[lines]
    lengths = ends - starts

    skip = layout.skip
    label_start, label_len = starts[:, skip], lengths[:, skip]
    label_char = buf[label_start]
    label_ok = (label_len == 1) & ((label_char == 48) | (label_char == 49))
    label_values = (label_char == 49).astype(np.float32)
    for i in np.flatnonzero(~label_ok):  # e.g. "1.0"
        text = block[label_start[i] : label_start[i] + label_len[i]]
        label_ok[i] = text in _LABELS
        label_values[i] = _LABELS.get(text, 0.0)
    bad = ~label_ok

    d0, d1 = skip + 1, skip + 1 + NUM_DENSE
    dense, dense_bad = _parse_numbers(block, buf, starts[:, d0:d1].ravel(), lengths[:, d0:d1].ravel())
    bad |= dense_bad.reshape(m, NUM_DENSE).any(axis=1)
    cats, cat_bad = _parse_hex(buf, starts[:, d1:].ravel(), lengths[:, d1:].ravel())
    bad |= cat_bad.reshape(m, NUM_CATEGORICAL).any(axis=1)
    return label_values, dense.reshape(m, NUM_DENSE), cats.reshape(m, NUM_CATEGORICAL), bad


def _gather(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """Bytes [m, width] from each start; `buf` ends with enough zero padding."""
    return np.lib.stride_tricks.sliding_window_view(buf, width)[starts]


def _parse_numbers(
    block: bytes, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(float32 values with NaN for empty, bool bad) of dense fields.

    Plain decimals (`-12`, `260.0`) are parsed with array arithmetic, one character column at a
    time; anything else (`1e3`) goes through Python's float() one field at a time.
    """
    empty = lengths == 0
    width = int(min(max(lengths.max(initial=0), 1), PAD))
    chars = _gather(buf, starts, width)
    value = np.zeros(len(starts), dtype=np.float64)
    scale = np.ones(len(starts), dtype=np.float64)
    negative = chars[:, 0] == 45
    seen_dot = np.zeros(len(starts), dtype=bool)
    plain = ~empty & (lengths <= width)
    has_digit = np.zeros(len(starts), dtype=bool)
    for k in range(width):
        c = chars[:, k]
        inside = k < lengths
        digit = inside & (c >= 48) & (c <= 57)
        dot = inside & (c == 46)
        value = np.where(digit, value * 10.0 + (c.astype(np.float64) - 48.0), value)
        scale = np.where(digit & seen_dot, scale * 10.0, scale)
        plain &= ~inside | digit | (dot & ~seen_dot) | ((c == 45) & (k == 0))
        seen_dot |= dot
        has_digit |= digit
    plain &= has_digit
    values = np.where(negative, -value, value) / scale
    values[empty] = np.nan
    bad = np.zeros(len(starts), dtype=bool)
    for i in np.flatnonzero(~empty & ~plain):
        try:
            values[i] = float(block[starts[i] : starts[i] + lengths[i]])
        except ValueError:
            bad[i] = True
            continue
        bad[i] = not abs(values[i]) <= DENSE_MAX  # also inf and nan
    values[bad] = np.nan  # dropped with their line; no overflow in the cast below
    return values.astype(np.float32), bad


def _parse_hex(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values with MISSING for empty, bool bad) of categorical fields (8 hex digits or empty)."""
    digits = _HEX[_gather(buf, starts, 8)]
    empty = lengths == 0
    bad = ~empty & ((lengths != 8) | (digits >= 16).any(axis=1))
    packed = np.ascontiguousarray((digits[:, 0::2] << 4) | (digits[:, 1::2] & 15))
    values = packed.view(">u4").ravel().astype(np.int64)
    values[empty | bad] = MISSING
    return values, bad


def _reason(line: bytes, layout: _Layout) -> str:
    """Why one line is malformed (only called for lines the vectorized checks rejected)."""
    text = line.rstrip(b"\r\n")
    if not text.strip():
        return "blank line"
    if len(text) > MAX_LINE_BYTES:
        return f"line longer than {MAX_LINE_BYTES} bytes"
    f = text.split(layout.sep)
    if not layout.min_fields <= len(f) <= layout.full:
        expected = (
            f"{layout.min_fields} to {layout.full}" if layout.min_fields < layout.full else str(layout.full)
        )
        return f"expected {expected} fields, found {len(f)}"
    f += [b""] * (layout.full - len(f))
    label = f[layout.skip]
    if label not in _LABELS:
        return f"bad label {_show(label)} (expected 0 or 1)"
    d0 = layout.skip + 1
    for j, value in enumerate(f[d0 : d0 + NUM_DENSE]):
        if value:
            try:
                number = float(value)
            except ValueError:
                return f"non-numeric dense feature I{j + 1}: {_show(value)}"
            if not np.isfinite(number):
                return f"non-finite dense feature I{j + 1}: {_show(value)}"
            if abs(number) > DENSE_MAX:
                return f"dense feature I{j + 1} beyond the float32 range: {_show(value)}"
    for j, value in enumerate(f[d0 + NUM_DENSE :]):
        if value and (len(value) != 8 or (_HEX[np.frombuffer(value, dtype=np.uint8)] >= 16).any()):
            return f"categorical feature C{j + 1} is not 8 hex digits: {_show(value)}"
    return "malformed line"


def _show(value: bytes) -> str:
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= 24 else text[:21] + "...")
