"""What a storage layout that keeps an INT8 row's scale and bias beside its codes would buy, before building it.

Today an INT8 table is three arrays: the codes `[rows, dim]` uint8, an fp16 bias per row and a uint8 scale code
per row. A row read or written touches a line in each (at dim 64: three lines). Inline, a row is its codes
followed by its bias and scale code (`dim + 4` bytes: two lines at dim 64, often one at dim 32).

This benchmark times the same two kernels on both layouts, over the Kaggle tables (33.8 M rows at scale 1)
and `bench embedding`'s power-law batches (`slipcache.bench.workload`):
- the forward gather: every lookup's row dequantized and summed into its sample's output;
- the update: every distinct row of the batch dequantized, a gradient row added, a new bias and scale found,
  and the row requantized with stochastic rounding (a counter-based noise, the same on both layouts).
and, as the bound beside them, fp32 rows (four lines at dim 64) gathered and updated by SGD. The kernels are
compiled here with `-O3 -march=native -ffast-math` (so that they vectorize) into the documented cache; they
are a model of the step's memory traffic, not the product's kernels. Prints ns per lookup and per distinct
row, medians over the batches, and the ratios. Run from the repository root:

    python -m benchmarks.row_layout --dims 64 128 --huge-pages
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from slipcache.bench.machine import describe_machine
from slipcache.bench.workload import make_workload
from slipcache.cache_dir import default_cache_root
from slipcache.data.kaggle import kaggle_table_sizes
from slipcache.errors import SlipcacheError
from slipcache.memory import limiting_memory, peak_rss_bytes

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <sys/mman.h>
#include <immintrin.h>

void *layout_alloc(int64_t bytes, int huge) {
    void *p = mmap(0, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 0;
    if (huge) madvise(p, (size_t)bytes, MADV_HUGEPAGE);
    return p;
}
void layout_free(void *p, int64_t bytes) { munmap(p, (size_t)bytes); }

static inline uint32_t mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x;
}
/* every byte of `n` written (no page fault is timed later), codes of a mid-range spread */
void layout_fill(uint8_t *p, int64_t n, uint32_t seed) {
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)(mix((uint32_t)i ^ seed) & 0x7f) + 64;
}

static float SCALES[256];  /* scale code -> scale: geometric from 1e-7, x1.1 a step */
void layout_init(void) { for (int c = 0; c < 256; c++) SCALES[c] = 1e-7f * powf(1.1f, (float)c); }
static inline uint8_t code_for(float needed) {
    if (!(needed > SCALES[0])) return 0;
    int c = (int)ceilf(logf(needed / SCALES[0]) / logf(1.1f));
    if (c > 255) c = 255;
    while (c < 255 && SCALES[c] < needed) c++;
    return (uint8_t)c;
}

/* One row's update in place: x = bias + scale * code - grad; new bias = min, scale >= (max - min) / 255;
   codes = floor((x - bias) / scale + u), u from a counter-based hash of (seed, row, column). */
static inline void update_row(uint8_t *codes, uint16_t *bias, uint8_t *scode, int64_t dim, int64_t row,
                              const float *grad, uint32_t seed) {
    float x[512];
    float b = _cvtsh_ss(*bias), s = SCALES[*scode];
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t j = 0; j < dim; j++) {
        x[j] = b + s * (float)codes[j] - grad[j];
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    uint8_t c = code_for((hi - lo) / 255.0f);
    float ns = SCALES[c];
    uint16_t nb = _cvtss_sh(lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    float fb = _cvtsh_ss(nb);
    uint32_t key = seed ^ (uint32_t)row * 0x9e3779b9U;
    for (int64_t j = 0; j < dim; j++) {
        float u = (float)(mix(key + (uint32_t)j) >> 8) * (1.0f / 16777216.0f);
        float q = floorf((x[j] - fb) / ns + u);
        codes[j] = (uint8_t)(q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q));
    }
    *bias = nb;
    *scode = c;
}

#define AHEAD 8
/* split layout: codes [rows, dim], bias [rows] fp16, scale code [rows] */
void split_update(uint8_t *codes, uint16_t *bias, uint8_t *scode, int64_t dim, const int64_t *rows,
                  int64_t n, const float *grad, uint32_t seed) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t r = rows[i + AHEAD];
            for (int64_t o = 0; o < dim; o += 64) _mm_prefetch((const char *)(codes + r * dim + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(bias + r), _MM_HINT_T0);
            _mm_prefetch((const char *)(scode + r), _MM_HINT_T0);
        }
        int64_t r = rows[i];
        update_row(codes + r * dim, bias + r, scode + r, dim, r, grad + (i & 15) * dim, seed);
    }
}
void split_gather(const uint8_t *codes, const uint16_t *bias, const uint8_t *scode, int64_t dim,
                  const int64_t *ids, int64_t n, int64_t per_sample, float *out) {
    for (int64_t k = 0; k < n; k++) {
        if (k + AHEAD < n) {
            int64_t r = ids[k + AHEAD];
            for (int64_t o = 0; o < dim; o += 64) _mm_prefetch((const char *)(codes + r * dim + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(bias + r), _MM_HINT_T0);
            _mm_prefetch((const char *)(scode + r), _MM_HINT_T0);
        }
        int64_t r = ids[k];
        float b = _cvtsh_ss(bias[r]), s = SCALES[scode[r]];
        float *o = out + (k / per_sample) * dim;
        const uint8_t *c = codes + r * dim;
        for (int64_t j = 0; j < dim; j++) o[j] += b + s * (float)c[j];
    }
}

/* inline layout: each row is dim codes, its fp16 bias, its scale code and a pad byte (dim + 4 bytes) */
void inline_update(uint8_t *rows_base, int64_t dim, const int64_t *rows, int64_t n, const float *grad,
                   uint32_t seed) {
    int64_t stride = dim + 4;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const char *p = (const char *)(rows_base + rows[i + AHEAD] * stride);
            for (int64_t o = 0; o < stride; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
            _mm_prefetch(p + stride - 1, _MM_HINT_T0);
        }
        int64_t r = rows[i];
        uint8_t *row = rows_base + r * stride;
        update_row(row, (uint16_t *)(row + dim), row + dim + 2, dim, r, grad + (i & 15) * dim, seed);
    }
}
void inline_gather(const uint8_t *rows_base, int64_t dim, const int64_t *ids, int64_t n, int64_t per_sample,
                   float *out) {
    int64_t stride = dim + 4;
    for (int64_t k = 0; k < n; k++) {
        if (k + AHEAD < n) {
            const char *p = (const char *)(rows_base + ids[k + AHEAD] * stride);
            for (int64_t o = 0; o < stride; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
            _mm_prefetch(p + stride - 1, _MM_HINT_T0);
        }
        const uint8_t *row = rows_base + ids[k] * stride;
        uint16_t hb; memcpy(&hb, row + dim, 2);
        float b = _cvtsh_ss(hb), s = SCALES[row[dim + 2]];
        float *o = out + (k / per_sample) * dim;
        for (int64_t j = 0; j < dim; j++) o[j] += b + s * (float)row[j];
    }
}

/* fp32 rows: the gather sums them, the update is SGD in place */
void fp32_update(float *weights, int64_t dim, const int64_t *rows, int64_t n, const float *grad) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            for (int64_t o = 0; o < dim; o += 16)
                _mm_prefetch((const char *)(weights + rows[i + AHEAD] * dim + o), _MM_HINT_T0);
        float *w = weights + rows[i] * dim;
        const float *g = grad + (i & 15) * dim;
        for (int64_t j = 0; j < dim; j++) w[j] -= g[j];
    }
}
void fp32_gather(const float *weights, int64_t dim, const int64_t *ids, int64_t n, int64_t per_sample, float *out) {
    for (int64_t k = 0; k < n; k++) {
        if (k + AHEAD < n)
            for (int64_t o = 0; o < dim; o += 16)
                _mm_prefetch((const char *)(weights + ids[k + AHEAD] * dim + o), _MM_HINT_T0);
        const float *w = weights + ids[k] * dim;
        float *o = out + (k / per_sample) * dim;
        for (int64_t j = 0; j < dim; j++) o[j] += w[j];
    }
}
"""
FLAGS = ("-O3", "-march=native", "-ffast-math", "-shared", "-fPIC")  # fast-math: the min/max reductions vectorize
LAYOUTS = ("split", "inline", "fp32")
ROW_BYTES = {"split": lambda dim: dim, "inline": lambda dim: dim + 4, "fp32": lambda dim: 4 * dim}
I64, F32, U8, U16 = (ctypes.POINTER(t) for t in (ctypes.c_int64, ctypes.c_float, ctypes.c_uint8, ctypes.c_uint16))


def compile_kernels() -> ctypes.CDLL:
    """The kernels, built once per source and flags into the documented cache (`<cache>/bench/`)."""
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + platform.machine()).encode()).hexdigest()[:16]
    directory = default_cache_root() / "bench"
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"row_layout-{key}.so"
    if not library.exists():
        source = directory / f"row_layout-{key}.c"
        source.write_text(SOURCE)
        partial = directory / f"row_layout-{key}.so.{os.getpid()}"
        result = subprocess.run(["gcc", *FLAGS, "-o", str(partial), str(source), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise SlipcacheError(f"gcc failed on the layout kernels: {result.stderr.strip().splitlines()[-1]}")
        partial.replace(library)
    lib = ctypes.CDLL(str(library))
    lib.layout_alloc.restype = ctypes.c_void_p
    lib.layout_alloc.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.layout_free.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.layout_fill.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32]
    lib.layout_init()
    return lib


class Buffer:
    """`nbytes` of anonymous memory (huge pages advised when asked), every byte written before use."""

    def __init__(self, lib: ctypes.CDLL, nbytes: int, huge: bool, seed: int) -> None:
        self.lib, self.nbytes = lib, nbytes
        self.address = lib.layout_alloc(nbytes, int(huge))
        if not self.address:
            raise SlipcacheError(f"cannot map {nbytes / 2**30:.2f} GiB for the layout benchmark")
        lib.layout_fill(self.address, nbytes, seed)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *_: object) -> None:
        self.lib.layout_free(self.address, self.nbytes)


def ptr(array: np.ndarray, kind: type) -> object:
    return array.ctypes.data_as(kind)


BIAS = int(np.array(-0.05, np.float16).view(np.uint16))
SCALE_CODE = 87  # 1e-7 * 1.1 ** 87 >= 0.1 / 255, the kernels' scale of codes 0..255 over [-0.05, 0.05)


def start_rows(buffer: Buffer, layout: str, dim: int, num_rows: int) -> None:
    """Each row's bias and scale code set to BIAS and SCALE_CODE (its codes stay the fill's)."""
    raw = np.frombuffer((ctypes.c_uint8 * buffer.nbytes).from_address(buffer.address), np.uint8)
    if layout == "split":
        raw[: 2 * num_rows].view(np.uint16)[:] = BIAS
        raw[2 * num_rows :] = SCALE_CODE
    else:
        rows = raw.reshape(num_rows, dim + 4)
        rows[:, dim : dim + 2] = np.array([BIAS], np.uint16).view(np.uint8)
        rows[:, dim + 2] = SCALE_CODE


def time_layout(lib: ctypes.CDLL, layout: str, dim: int, num_rows: int, batches: list[np.ndarray],
                distinct: list[np.ndarray], huge: bool, tables: int) -> dict[str, float]:
    """Median ns per lookup (gather) and per distinct row (update) of one layout over the batches."""
    grads = np.random.default_rng(1).standard_normal((16, dim)).astype(np.float32) * 1e-3
    gather_ns, update_ns = [], []
    row_bytes = ROW_BYTES[layout](dim)
    with Buffer(lib, num_rows * row_bytes, huge, 7) as rows, Buffer(lib, num_rows * 3, huge, 8) as meta:
        if layout == "split":  # the bias (fp16) and scale code arrays from one buffer, like today's storage
            bias = ctypes.cast(meta.address, U16)
            scode = ctypes.cast(meta.address + 2 * num_rows, U8)
        if layout == "fp32":  # codes of 64..191 read as floats would be huge: start the rows at 0.01
            np.frombuffer((ctypes.c_float * (num_rows * dim)).from_address(rows.address), np.float32)[:] = 0.01
        else:  # every row in [-0.05, 0.05): bias -0.05 and the scale code of 0.1 / 255 (byte noise could be NaN)
            start_rows(rows if layout == "inline" else meta, layout, dim, num_rows)
        for step, (ids, uniq) in enumerate(zip(batches, distinct, strict=True)):
            out = np.zeros((ids.size // tables, dim), np.float32)
            t0 = time.perf_counter_ns()
            if layout == "split":
                lib.split_gather(ctypes.cast(rows.address, U8), bias, scode, ctypes.c_int64(dim), ptr(ids, I64),
                                 ctypes.c_int64(ids.size), ctypes.c_int64(tables), ptr(out, F32))
            elif layout == "inline":
                lib.inline_gather(ctypes.cast(rows.address, U8), ctypes.c_int64(dim), ptr(ids, I64),
                                  ctypes.c_int64(ids.size), ctypes.c_int64(tables), ptr(out, F32))
            else:
                lib.fp32_gather(ctypes.cast(rows.address, F32), ctypes.c_int64(dim), ptr(ids, I64),
                                ctypes.c_int64(ids.size), ctypes.c_int64(tables), ptr(out, F32))
            t1 = time.perf_counter_ns()
            if layout == "split":
                lib.split_update(ctypes.cast(rows.address, U8), bias, scode, ctypes.c_int64(dim), ptr(uniq, I64),
                                 ctypes.c_int64(uniq.size), ptr(grads, F32), ctypes.c_uint32(step))
            elif layout == "inline":
                lib.inline_update(ctypes.cast(rows.address, U8), ctypes.c_int64(dim), ptr(uniq, I64),
                                  ctypes.c_int64(uniq.size), ptr(grads, F32), ctypes.c_uint32(step))
            else:
                lib.fp32_update(ctypes.cast(rows.address, F32), ctypes.c_int64(dim), ptr(uniq, I64),
                                ctypes.c_int64(uniq.size), ptr(grads, F32))
            t2 = time.perf_counter_ns()
            if step > 0:  # the first batch warms the caches and the TLB
                gather_ns.append((t1 - t0) / ids.size)
                update_ns.append((t2 - t1) / uniq.size)
    return {"gather_ns_per_lookup": statistics.median(gather_ns), "update_ns_per_row": statistics.median(update_ns)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--scale", type=float, default=1.0, help="Kaggle's tables times this (1 = 33.8 M rows)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="layouts interleaved, this many times")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                        help="fp32 is the bound beside them: leave it out where its tables do not fit")
    parser.add_argument("--huge-pages", action="store_true", help="advise transparent huge pages on the tables")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()[0]
    if any(d < 8 or d > 512 or d % 4 for d in args.dims):
        parser.error("--dims must be multiples of 4 in [8, 512]")
    sizes = kaggle_table_sizes(args.scale)
    offsets = np.cumsum([0, *sizes[:-1]])
    num_rows = int(sum(sizes))
    largest = max(ROW_BYTES[layout](dim) * num_rows + 3 * num_rows for layout in args.layouts for dim in args.dims)
    ids_bytes = 2 * args.steps * args.batch_size * len(sizes) * 8  # the batches and their distinct rows
    limit = limiting_memory()
    if limit is not None and largest + ids_bytes > limit[0]:
        raise SystemExit(f"row_layout: error: the largest tables ({largest / 2**30:.1f} GiB) and the batches need "
                         f"more than the {limit[0] / 2**30:.1f} GiB of {limit[1]}; lower --scale or --dims, or "
                         "leave fp32 out of --layouts")
    print(f"row_layout: {num_rows:,} rows; the largest tables mapped at once take {largest / 2**30:.2f} GiB, "
          f"the batches {ids_bytes / 2**30:.2f} GiB", flush=True)
    lib = compile_kernels()
    workload = make_workload(sizes, batch_size=args.batch_size, warmup_steps=0, timed_steps=args.steps, seed=0)
    batches = [np.ascontiguousarray((b.numpy() + offsets).reshape(-1)) for b in workload.batches]
    distinct = [np.unique(b) for b in batches]
    mean_distinct = statistics.mean(d.size for d in distinct)
    print(f"row_layout: {args.steps} batches of {args.batch_size} x {len(sizes)} lookups, "
          f"{mean_distinct:,.0f} distinct rows a batch", flush=True)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for dim in args.dims:
        per = results.setdefault(str(dim), {layout: [] for layout in args.layouts})
        for round_ in range(args.rounds):
            order = args.layouts if round_ % 2 == 0 else args.layouts[::-1]  # interleaved, each first in turn
            for layout in order:
                per[layout].append(time_layout(lib, layout, dim, num_rows, batches, distinct, args.huge_pages,
                                               len(sizes)))
        med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in per.items()}
        for layout, m in med.items():
            print(f"dim {dim:4d} {layout:7s} gather {m['gather_ns_per_lookup']:6.1f} ns/lookup   "
                  f"update {m['update_ns_per_row']:6.1f} ns/row", flush=True)
        if "split" in med and "inline" in med:
            g = med["split"]["gather_ns_per_lookup"] / med["inline"]["gather_ns_per_lookup"]
            u = med["split"]["update_ns_per_row"] / med["inline"]["update_ns_per_row"]
            print(f"dim {dim:4d} inline is {g:.2f}x split on the gather, {u:.2f}x on the update", flush=True)
    report = {
        "command": "python -m benchmarks.row_layout " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**describe_machine(), "torch_threads": 1, "load_avg_1m_start": load_at_start},
        "rows": num_rows, "batch_size": args.batch_size, "steps": args.steps, "huge_pages": args.huge_pages,
        "mean_distinct_rows": mean_distinct, "load_avg_1m_end": os.getloadavg()[0],
        "peak_rss_bytes": peak_rss_bytes(), "rounds": results,
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
