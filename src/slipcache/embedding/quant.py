"""Row-wise quantized storage for embedding rows: fp32, fp16, bf16, int8 and int4.

Integer rows keep per-row quantization parameters: a bias (the row minimum, fp16, rounded down) and a
scale stored as one byte on a log grid (eighth-octave steps, rounded up). Three bytes per row instead of the
usual eight (two fp32) or four (two fp16): at dim 16 the parameters would otherwise cost a third of an int8
row. Rounding the bias down and the scale up keeps every value of the row inside the representable range,
so stochastic rounding stays unbiased.

Range: stored values never overflow and never hold inf or NaN. Values beyond what a precision represents
(fp16: ±65504; int rows: a bias within ±65504 and a span up to the top of the scale grid, about 59,800 for
int8 and 3,500 for int4) are saturated, and inf/NaN are replaced (NaN by 0, ±inf by the largest value); both
are counted per row and reported by the collection's `stats()`. No byte is added to a row for this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from slipcache import _native
from slipcache._native import quantize
from slipcache.embedding.hostmem import StorageFile, host_empty, host_zeros

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
ROUNDINGS = ("stochastic", "nearest")

FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_BITS = {"int8": 8, "int4": 4}

# scale = 2 ** ((code - SCALE_CODE_ZERO) / SCALE_STEPS_PER_OCTAVE), code in [0, 255]:
# scales from 2^-24 to about 2^7.9, a step of 9 % between neighbouring codes.
SCALE_STEPS_PER_OCTAVE = 8
SCALE_CODE_ZERO = 192
FP16_MAX = 65504.0
# The largest finite value each precision stores; int rows are limited by their fp16 bias.
VALUE_LIMIT = {
    "fp32": torch.finfo(torch.float32).max,
    "fp16": FP16_MAX,
    "bf16": torch.finfo(torch.bfloat16).max,
    "int8": FP16_MAX,
    "int4": FP16_MAX,
}
# The widest row an int precision stores: the top of the scale grid, less room for the bias rounding down
# (an fp16 step is at most 32 below 65504).
INT_MAX_SPAN = {bits: ((1 << bits) - 1) * 2 ** ((255 - 192) / 8) - 64 for bits in (8, 4)}


class Fitted(NamedTuple):
    """Rows made storable, with per-row counts of the values changed (None when no value was)."""

    values: Tensor
    saturated: Tensor | None  # [n] finite values clamped to the representable range
    nonfinite: Tensor | None  # [n] inf and NaN values replaced


def fit_to_range(x: Tensor, limit: float, max_span: float | None = None) -> Fitted:
    """Replace inf/NaN, clamp values to ±limit and, when a row is wider than `max_span`, to a window of that
    width around the row's median (so an outlier is clipped rather than the rest of the row)."""
    if not x.numel():
        return Fitted(x, None, None)
    if max_span is None:  # one pass over all values is enough to know that nothing needs fitting
        lowest, highest = torch.aminmax(x)
        if bool((lowest >= -limit) & (highest <= limit)):  # false for NaN too
            return Fitted(x, None, None)
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    ok = (lo >= -limit) & (hi <= limit)  # false for NaN rows too
    if max_span is not None:
        ok &= hi - lo <= max_span
    if bool(ok.all()):
        return Fitted(x, None, None)
    bad = torch.nonzero(~ok).squeeze(1)
    rows = x[bad]
    nonfinite = ~torch.isfinite(rows)
    finite = torch.nan_to_num(rows, nan=0.0, posinf=limit, neginf=-limit)
    fitted = finite.clamp(-limit, limit)
    if max_span is not None:
        wide = (fitted.amax(dim=1) - fitted.amin(dim=1)) > max_span
        if bool(wide.any()):
            low = (fitted[wide].median(dim=1).values - max_span / 2).clamp(-limit, limit - max_span)
            fitted[wide] = torch.minimum(torch.maximum(fitted[wide], low[:, None]), (low + max_span)[:, None])
    saturated = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    replaced = torch.zeros_like(saturated)
    saturated[bad] = ((fitted != finite) & ~nonfinite).sum(dim=1)
    replaced[bad] = nonfinite.sum(dim=1)
    x = x.clone()
    x[bad] = fitted
    return Fitted(x, saturated, replaced)


_SCALES = torch.exp2((torch.arange(256, dtype=torch.float64) - SCALE_CODE_ZERO) / SCALE_STEPS_PER_OCTAVE).float()
_scales_on: dict[torch.device, Tensor] = {}


def decode_scale(code: Tensor) -> Tensor:
    """A table lookup: the same code decodes to the same float whatever else is in the batch (a vectorized
    exp2 differs in the last bit between its SIMD body and its tail)."""
    table = _scales_on.get(code.device)
    if table is None:
        table = _scales_on[code.device] = _SCALES.to(code.device)
    return table[code.long()]


def encode_scale(needed: Tensor) -> Tensor:
    """Smallest code whose scale is at least `needed` (clamped to the grid): a search of the decoded table,
    so the code is exact (a log2 of `needed` can land one step high on a grid value) and the compiled pass
    finds the same one."""
    tiny = torch.finfo(torch.float32).tiny
    table = decode_scale(torch.arange(256, dtype=torch.uint8, device=needed.device))
    code = torch.searchsorted(table, needed.clamp_min(tiny).contiguous())
    return code.clamp_(max=255).to(torch.uint8)


def round_down_fp16(x: Tensor) -> Tensor:
    """fp16 values <= x (clamped to the fp16 range)."""
    x = x.clamp(-FP16_MAX, FP16_MAX)  # below -65504, -65504 (never -inf)
    h = x.half()
    too_big = h.float() > x
    return torch.where(too_big, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def random_uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    return torch.rand(shape, generator=generator, device=device)


def quantize_int(
    x: Tensor, bits: int, rounding: str, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 rows [n, D] -> (codes uint8 [n, D] in [0, 2^bits - 1], bias fp16 [n], scale code uint8 [n])."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    hi = x.amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    bias = round_down_fp16(lo)
    scale_code = encode_scale((hi - bias.float()) / levels)
    scaled = (x - bias.float()[:, None]) / decode_scale(scale_code)[:, None]
    if rounding == "stochastic":
        scaled = torch.floor(scaled + random_uniform(tuple(scaled.shape), generator, scaled.device))
    else:
        scaled = torch.round(scaled)
    codes = scaled.clamp_(0, levels).to(torch.uint8)
    return codes, bias, scale_code


def dequantize_int(codes: Tensor, bias: Tensor, scale_code: Tensor) -> Tensor:
    return bias.float()[:, None] + decode_scale(scale_code)[:, None] * codes.float()


def pack_int4(codes: Tensor) -> Tensor:
    """[n, D] values in [0, 15] -> [n, ceil(D / 2)] bytes, low nibble first."""
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: Tensor, dim: int) -> Tensor:
    out = torch.stack((packed & 0xF, packed >> 4), dim=2).reshape(packed.shape[0], -1)
    return out[:, :dim]


def round_float(x: Tensor, dtype: torch.dtype, rounding: str, generator: torch.Generator | None) -> Tensor:
    """fp32 -> fp16/bf16, nearest or stochastic between the two neighbouring representable values."""
    if dtype == torch.float32:
        return x.clone()
    if dtype == torch.float16:
        x = x.clamp(-FP16_MAX, FP16_MAX)
    nearest = x.to(dtype)
    if rounding == "nearest":
        return nearest
    above = nearest.float() > x
    other = torch.nextafter(nearest, torch.where(above, -torch.inf, torch.inf).to(dtype))
    lo = torch.where(above, other, nearest).float()
    hi = torch.where(above, nearest, other).float()
    gap = hi - lo
    p_hi = torch.where(gap > 0, (x - lo) / gap, torch.zeros_like(x))
    take_hi = random_uniform(tuple(x.shape), generator, x.device) < p_hi
    return torch.where(take_hi, hi, lo).to(dtype)


class RowStorage(nn.Module):
    """Every embedding row in its storage precision; reads return fp32, writes round.

    Reads gather the compact bytes on the storage device and dequantize on the compute device, so only
    stored bytes cross between host and accelerator. `version` changes with every write (and with a loaded
    state or a device move): a copy of rows read at one version is still current while it is the same.
    """

    # buffers (register_buffer), declared for the type checker
    payload: Tensor
    bias: Tensor  # integer precisions only
    scale_code: Tensor  # integer precisions only

    def __init__(
        self,
        num_rows: int,
        dim: int,
        precision: str,
        device: torch.device | str = "cpu",
        *,
        empty: bool = False,
        path: str | None = None,
        huge_pages: str = "off",
    ) -> None:
        """`empty`: leave the rows unset (the caller writes every one): no pass that zeroes gigabytes first.
        `path`: a directory to keep the rows' codes in, in a memory-mapped file (host storage only). Their
        quantization parameters (3 bytes a row) stay in memory: a row read from the disk then costs the pages
        of its codes alone, one (two where a row straddles a page boundary), not one more per parameter.
        `huge_pages`: as `EmbeddingConfig.huge_pages`."""
        super().__init__()
        alloc = host_empty if empty else host_zeros

        def new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
            return alloc(shape, dtype, device, huge_pages)

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.version = 0
        self.num_rows, self.dim, self.precision = num_rows, dim, precision
        device = torch.device(device)
        if precision in FLOAT_DTYPES:
            shape, dtype = (num_rows, dim), FLOAT_DTYPES[precision]
        else:
            shape, dtype = (num_rows, dim if precision == "int8" else (dim + 1) // 2), torch.uint8
        self.file: StorageFile | None = None  # where the payload lives in a mapped file (read ahead from the disk)
        if path is not None and device.type == "cpu":
            self.file = StorageFile(num_rows * shape[1] * dtype.itemsize, path)
            self.register_buffer("payload", self.file.tensor.view(dtype).view(shape))
        else:
            self.register_buffer("payload", new(shape, dtype=dtype, device=device))
        if precision in INT_BITS:
            self.register_buffer("bias", new((num_rows,), dtype=torch.float16, device=device))
            self.register_buffer("scale_code", new((num_rows,), dtype=torch.uint8, device=device))

    @property
    def payload_file(self) -> StorageFile | None:
        """The mapped file the payload still is: none after a move off the CPU, a copy or a replaced buffer."""
        return self.file if self.file is not None and self.file.holds(self.payload) else None

    @property
    def in_file(self) -> bool:
        """Whether the payload lives in a mapped file (rows read from the disk, read ahead)."""
        return self.payload_file is not None

    def _apply(self, fn: Any, recurse: bool = True) -> RowStorage:
        self.version += 1
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super()._load_from_state_dict(*args, **kwargs)

    @property
    def bytes_per_row(self) -> int:
        """Stored bytes of one row, parameters included: what a row costs to move."""
        return sum(self.row_bytes())

    def row_bytes(self) -> tuple[int, int]:
        """(payload, quantization parameters) bytes of one row."""
        sizes = [t.element_size() * (t[0].numel() if t.dim() > 1 else 1) for t in self.buffers()]
        return sizes[0], sum(sizes[1:])

    def pin_memory_(self) -> RowStorage:
        for name, buf in list(self._buffers.items()):
            if buf is not None and buf.device.type == "cpu":
                self._buffers[name] = buf.pin_memory()
        return self

    def read(self, rows: Tensor, device: torch.device) -> Tensor:
        """fp32 values [n, D] of `rows`, on `device`."""
        rows = rows.to(self.payload.device)
        on_cpu = torch.device(device).type == "cpu" and self.payload.device.type == "cpu"
        if on_cpu and self.dim and quantize.available():
            ints = self.precision in INT_BITS  # bias and scale code beside the payload
            return quantize.dequantize_rows(
                self.precision, self.payload, self.bias if ints else None, self.scale_code if ints else None,
                scales=_SCALES, rows=rows.long().contiguous(), dim=self.dim,
            )
        return self.read_traceable(rows, device)

    def read_traceable(self, rows: Tensor, device: torch.device) -> Tensor:
        """`read` in torch operations only (what torch.export and torch.compile trace; accelerators read so)."""
        rows = rows.to(self.payload.device)
        payload = self.payload.index_select(0, rows).to(device, non_blocking=True)
        if self.precision in FLOAT_DTYPES:
            return payload.float()
        bias = self.bias.index_select(0, rows).to(device, non_blocking=True)
        scale_code = self.scale_code.index_select(0, rows).to(device, non_blocking=True)
        codes = payload if self.precision == "int8" else unpack_int4(payload, self.dim)
        return dequantize_int(codes, bias, scale_code)

    def read_into(self, rows: Tensor, out: Tensor, out_rows: Tensor) -> bool:
        """`out[out_rows] = read(rows)` (distinct `out_rows`, fp32 `out` on the CPU) in the compiled pass, each
        row decoded straight into its place (no [n, D] copy written and read again); False, having done
        nothing, where that pass cannot run (then the caller reads and copies)."""
        if not (
            self.dim
            and self.payload.device.type == "cpu"
            and quantize.available()
            and _native.usable(rows, out, out_rows)
            and out.dtype == torch.float32
            and rows.dtype == out_rows.dtype == torch.int64
        ):
            return False
        ints = self.precision in INT_BITS
        quantize.dequantize_rows(
            self.precision, self.payload, self.bias if ints else None, self.scale_code if ints else None,
            scales=_SCALES, rows=rows, dim=self.dim, out=out, out_rows=out_rows,
        )
        return True

    def encode(
        self, values: Tensor, rounding: str, generator: torch.Generator | None
    ) -> tuple[list[Tensor], Fitted]:
        """fp32 rows -> the stored tensors, in buffer order, on the values' device; and what was saturated."""
        bits = INT_BITS.get(self.precision)
        fitted = fit_to_range(values, VALUE_LIMIT[self.precision], INT_MAX_SPAN[bits] if bits else None)
        values = fitted.values
        if bits is None:
            return [round_float(values, FLOAT_DTYPES[self.precision], rounding, generator)], fitted
        codes, bias, scale_code = quantize_int(values, bits, rounding, generator)
        if self.precision == "int4":
            codes = pack_int4(codes)
        return [codes, bias, scale_code], fitted

    def _write_compiled(
        self,
        values: Tensor,
        rounding: str,
        generator: torch.Generator | None,
        rows: Tensor | None,
        targets: list[Tensor],
        source: Tensor | None = None,
    ) -> Fitted | None:
        """`write` (`targets` the buffers, at `rows`) or `write_range` (`targets` the buffers' slices, rows
        None) in the compiled pass; None where it cannot run.

        Draws the same noise as `encode` (compiled too, from the same generator stream) and fits the same
        rows, so the stored bytes and the generator's state after are the same. With `source`, row i is
        `values[source[i]]` (read in place)."""
        if not (
            self.dim
            and (self.precision in INT_BITS or rounding == "stochastic")  # torch's own casts round to nearest fast
            and values.device.type == "cpu"
            and self.payload.device.type == "cpu"
            and values.dtype == torch.float32
            and quantize.available()
        ):
            return None
        values = values.contiguous()
        n = values.shape[0] if source is None else source.numel()
        bits = INT_BITS.get(self.precision)
        noise = None
        limit, max_span = VALUE_LIMIT[self.precision], INT_MAX_SPAN[bits] if bits else None
        if rounding == "stochastic" and self.precision != "fp32" and _native.threads() == 1:
            # One pass that draws each row's noise as it rounds the row (no [n, D] noise tensor written and
            # read back): the same values in the same order, so the same bytes. On a copy of the generator's
            # state, kept only when every row fitted; else the state is left and the general pass below
            # draws and fits as before.
            state = quantize.stream_state(generator)
            if state is not None:
                count = quantize.quantize_rows(
                    values, self.precision, *targets, rows=rows, limit=limit, max_span=max_span, source=source,
                    stream=state, scales=_SCALES,
                )
                if not count:
                    (torch.default_generator if generator is None else generator).set_state(state)
                    return Fitted(values, None, None)
        if rounding == "stochastic" and self.precision != "fp32":
            shape = (n, self.dim)
            noise = quantize.uniform(shape, generator)
            if noise is None:
                noise = random_uniform(shape, generator, values.device)
        bad = torch.empty(n, dtype=torch.uint8)
        count = quantize.quantize_rows(
            values, self.precision, *targets, noise=noise, rows=rows, bad=bad, limit=limit, max_span=max_span,
            source=source, scales=_SCALES,
        )
        if not count:
            return Fitted(values, None, None)
        fix = torch.nonzero(bad).squeeze(1)
        fitted = fit_to_range(values[fix if source is None else source[fix]], limit, max_span)
        # Fitted rows are stored as they are (a window's float rounding may exceed max_span by an ulp).
        quantize.quantize_rows(
            fitted.values.contiguous(), self.precision, *targets, noise=None if noise is None else noise[fix],
            rows=fix if rows is None else rows[fix], limit=float("inf"), scales=_SCALES,
        )
        counts = []
        for part in (fitted.saturated, fitted.nonfinite):
            full = torch.zeros(n, dtype=torch.int64)
            if part is not None:
                full[fix] = part
            counts.append(full)
        return Fitted(values, counts[0], counts[1])

    def write(
        self,
        rows: Tensor,
        values: Tensor,
        rounding: str,
        generator: torch.Generator | None,
        source: Tensor | None = None,
    ) -> Fitted:
        """Round fp32 `values` [n, D] into storage at unique `rows`; returns the per-row saturation counts.

        With `source` [n], row i is `values[source[i]]` (evicted rows read from their cache slots): the
        compiled pass reads them in place, the torch path gathers them first."""
        rows = rows.to(self.payload.device)
        self.version += 1
        done = self._write_compiled(values, rounding, generator, rows.contiguous(), list(self.buffers()), source)
        if done is not None:
            return done
        if source is not None:
            values = values.index_select(0, source.to(values.device))
        encoded, fitted = self.encode(values, rounding, generator)
        for buf, tensor in zip(self.buffers(), encoded, strict=True):
            buf.index_copy_(0, rows, tensor.to(buf.device, non_blocking=True))
        return fitted

    def write_range(
        self, start: int, values: Tensor, rounding: str, generator: torch.Generator | None
    ) -> Fitted:
        """Contiguous write, for initialization and loading whole tables. Rows in a file are rounded into a
        buffer and written with pwrite (`StorageFile.write`), never through the map."""
        end = start + values.shape[0]
        self.version += 1
        targets = [buf[start:end] for buf in self.buffers()]
        file = self.payload_file
        if file is not None:
            targets[0] = torch.empty_like(targets[0])
        fitted = self._write_compiled(values, rounding, generator, None, targets)
        if fitted is None:
            encoded, fitted = self.encode(values, rounding, generator)
            for target, tensor in zip(targets, encoded, strict=True):
                target.copy_(tensor)
        if file is not None:
            file.write(file.offset_of(self.payload[start:end]), targets[0])
        return fitted


class TableRowStorage(nn.Module):
    """Tables in different precisions behind the `RowStorage` interface (global rows in, fp32 out).

    One `RowStorage` per precision holds the rows of its tables back to back; a global row maps to a part
    and a local row through its table. Used only when the precisions differ: one precision is one
    `RowStorage`, as before.
    """

    # buffers (register_buffer), declared for the type checker
    _offsets: Tensor
    _table_part: Tensor
    _local_start: Tensor

    def __init__(
        self,
        table_sizes: list[int],
        dim: int,
        precisions: list[str],
        device: torch.device | str,
        *,
        empty: bool = False,
        path: str | None = None,
        huge_pages: str = "off",
    ) -> None:
        super().__init__()
        self.dim = dim
        kinds = [p for p in PRECISIONS if p in precisions]
        local_start, rows_in = [], dict.fromkeys(kinds, 0)
        for size, precision in zip(table_sizes, precisions, strict=True):
            local_start.append(rows_in[precision])
            rows_in[precision] += size
        parts = nn.ModuleDict({p: RowStorage(rows_in[p], dim, p, device, empty=empty, path=path,
                                                huge_pages=huge_pages) for p in kinds})
        # A ModuleDict (the parts are child modules: state dict, device moves); to a type checker, what it is here.
        self.parts = cast("Mapping[str, RowStorage]", parts)
        self._kinds = kinds
        offsets = torch.zeros(len(table_sizes) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(table_sizes, dtype=torch.int64), 0, out=offsets[1:])
        self.register_buffer("_offsets", offsets.to(device), persistent=False)
        self.register_buffer(
            "_table_part", torch.tensor([kinds.index(p) for p in precisions], device=device), persistent=False
        )
        self.register_buffer("_local_start", torch.tensor(local_start, device=device), persistent=False)
        self.num_rows = int(offsets[-1])

    @property
    def version(self) -> int:
        """Changes whenever a part's rows change."""
        return sum(part.version for part in self.parts.values())

    def _locate(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(part index, row within the part) of global rows."""
        rows = rows.to(self._offsets.device)
        table = torch.searchsorted(self._offsets, rows, right=True) - 1
        return self._table_part[table], rows - self._offsets[table] + self._local_start[table]

    def row_bytes_of(self, precision: str) -> tuple[int, int]:
        return self.parts[precision].row_bytes()

    def table_start(self, table: int) -> int:
        """The first row of `table` in the part of its precision."""
        return int(self._local_start[table])

    def pin_memory_(self) -> TableRowStorage:
        for part in self.parts.values():
            part.pin_memory_()
        return self

    def read_traceable(self, rows: Tensor, device: torch.device) -> Tensor:
        """`read` in torch operations only and without a branch on the rows' values (torch.export): every
        part reads every row (clamped into its range) and each row keeps its own part's value."""
        part_of, local = self._locate(rows)
        out = torch.zeros(rows.numel(), self.dim, device=device)
        for index, kind in enumerate(self._kinds):
            part = self.parts[kind]
            values = part.read_traceable(local.clamp(0, part.num_rows - 1), device)
            out = torch.where((part_of == index).to(device)[:, None], values, out)
        return out

    def read(self, rows: Tensor, device: torch.device) -> Tensor:
        part_of, local = self._locate(rows)
        out = torch.empty(rows.numel(), self.dim, device=device)
        for index, kind in enumerate(self._kinds):
            mine = part_of == index
            if bool(mine.any()):
                out[mine.to(device)] = self.parts[kind].read(local[mine], device)
        return out

    def write(
        self,
        rows: Tensor,
        values: Tensor,
        rounding: str,
        generator: torch.Generator | None,
        source: Tensor | None = None,
    ) -> Fitted:
        if source is not None:
            values = values.index_select(0, source.to(values.device))
        part_of, local = self._locate(rows)
        part_of = part_of.to(values.device)
        totals: dict[str, Tensor | None] = {"saturated": None, "nonfinite": None}
        for index, kind in enumerate(self._kinds):
            mine = part_of == index
            if not bool(mine.any()):
                continue
            fitted = self.parts[kind].write(local[mine.to(local.device)], values[mine], rounding, generator)
            for name, total in totals.items():
                counts = getattr(fitted, name)
                if counts is not None:
                    if total is None:
                        total = totals[name] = torch.zeros(values.shape[0], dtype=torch.int64, device=values.device)
                    total[mine] = counts
        return Fitted(values, totals["saturated"], totals["nonfinite"])

    def write_range(self, start: int, values: Tensor, rounding: str, generator: torch.Generator | None) -> Fitted:
        """Contiguous rows of one table."""
        part_of, local = self._locate(torch.tensor([start]))
        return self.parts[self._kinds[int(part_of)]].write_range(int(local), values, rounding, generator)
