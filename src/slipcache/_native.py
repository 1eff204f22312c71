"""Optional compiled loops for the CPU hot path: cache lookup, the fused SGD update, the stale-input filter.

Each is a plain loop over the lookups of a batch. In torch they take several passes over
[lookups, ways] temporaries; in C they are one pass. The lookup and the update run on
`torch.get_num_threads()` threads for large batches: thread t takes the lookups whose cache set (lookup)
or slot (update) is t modulo the thread count, in batch order, so no two threads write one slot and
every slot sees its updates in the same order whatever the thread count: results do not depend on it. The C source is compiled with the system's C
compiler on first use (about a second) into a per-user cache and loaded with ctypes; without a
compiler, or with SLIPCACHE_NATIVE=0, the pure-torch path runs. Tests check the two agree.

The cache (`$SLIPCACHE_CACHE_DIR/native`, default `~/.cache/slipcache/native`) is a directory of mode 0700;
a directory or library that another user owns or could write is refused (the torch path runs, with a
warning), builds are renamed into place whole, the file name keys the source, compiler, flags and CPU
architecture, and a cached library that fails to load is rebuilt once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* Row loops (copy, update, finite check) get an AVX2 clone picked at load time on CPUs that have it, the
   baseline elsewhere: the cached library may move between machines, so no -march=native. -ffp-contract=off
   keeps a*b+c unfused (avx2 does not imply fma anyway): results stay bit-identical to torch. */
#if defined(__x86_64__) && defined(__has_attribute) && !defined(SLIPCACHE_NO_CLONES)
#if __has_attribute(target_clones)
#define ROW_LOOPS __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef ROW_LOOPS
#define ROW_LOOPS
#endif

/* Run part(arg_t) for t = 0..threads-1: threads-1 new threads and the caller; joined before returning. */
#define MAX_THREADS 64
static void run_parts(void *(*part)(void *), void *args, size_t arg_size, int64_t threads) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], 0, part, (char *)args + t * arg_size) == 0;
    part(args);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], 0);
        else part((char *)args + t * arg_size);  /* no thread to be had: do its share here */
    }
}

/* Must match RowCache.set_of: ((r ^ (r >> 17)) * M >> 5) mod num_sets, with wrapping int64;
   M = 0 marks a cache that holds every row: set r / ways (-1 for a row beyond the last set). */
static inline int64_t set_of(int64_t r, int64_t multiplier, int64_t num_sets, int64_t ways) {
    if (multiplier == 0) return (r >= 0 && r / ways < num_sets) ? r / ways : -1;
    int64_t mixed = (int64_t)((uint64_t)(r ^ (r >> 17)) * (uint64_t)multiplier);
    int64_t s = (mixed >> 5) % num_sets;
    return s < 0 ? s + num_sets : s;
}

typedef struct {
    const void *slot_rows; int wide; int64_t num_sets, ways, multiplier;
    const int64_t *rows; int64_t n; int64_t *out_slots; int32_t *last_used, *use_count; int32_t step;
    int64_t part, parts, hits;
} lookup_args;

static void *lookup_part(void *p) {
    lookup_args *a = (lookup_args *)p;
    int64_t hits = 0;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t r = a->rows[i];
        int64_t set = set_of(r, a->multiplier, a->num_sets, a->ways);
        if (a->parts > 1 && (set < 0 ? 0 : set) % a->parts != a->part) continue;
        int64_t first = set * a->ways, slot = -1;
        for (int64_t w = 0; set >= 0 && w < a->ways; w++) {
            int64_t resident = a->wide ? ((const int64_t *)a->slot_rows)[first + w]
                                       : ((const int32_t *)a->slot_rows)[first + w];
            if (resident == r) { slot = first + w; break; }
        }
        a->out_slots[i] = slot;
        if (slot >= 0) {
            hits++;
            if (a->last_used) a->last_used[slot] = a->step;
            if (a->use_count) a->use_count[slot] += 1;
        }
    }
    a->hits = hits;
    return 0;
}

/* Slot of each row (-1 on a miss); hits get last_used = step and use_count += 1. Returns the hits. */
int64_t lookup(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
               const int64_t *rows, int64_t n, int64_t *out_slots, int32_t *last_used, int32_t *use_count,
               int32_t step, int64_t threads) {
    lookup_args args[MAX_THREADS];
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 0; t < threads; t++)
        args[t] = (lookup_args){slot_rows, wide, num_sets, ways, multiplier, rows, n, out_slots, last_used,
                                use_count, step, t, threads, 0};
    run_parts(lookup_part, args, sizeof(lookup_args), threads);
    int64_t hits = 0;
    for (int64_t t = 0; t < threads; t++) hits += args[t].hits;
    return hits;
}

/* Global row of each single-hot id: rows[i] = offsets[i % tables] + ids[i] for ids [batch, tables].
   Returns -1, or the index of the first id outside its table (rows after it are not written). */
int64_t global_rows(const int64_t *ids, int64_t batch, int64_t tables, const int64_t *offsets, int64_t *rows) {
    for (int64_t b = 0, i = 0; b < batch; b++) {
        for (int64_t t = 0; t < tables; t++, i++) {
            int64_t id = ids[i];
            if (id < 0 || id >= offsets[t + 1] - offsets[t]) return i;
            rows[i] = offsets[t] + id;
        }
    }
    return -1;
}

typedef struct {
    lookup_args probe; const float *weights; int64_t dim; float *out; int64_t tables; int64_t *table_hits;
} gather_args;

/* Prefetch the `bytes` at p (each cache line), for reading or (write = 1) writing. */
static inline void prefetch_span(const void *p, size_t bytes, int write) {
    for (size_t k = 0; k < bytes; k += 64) {
        if (write) __builtin_prefetch((const char *)p + k, 1);
        else __builtin_prefetch((const char *)p + k, 0);
    }
}

/* A software pipeline over the lookups, AHEAD apart per stage: the set of lookup j + AHEAD is computed and
   its ways fetched; lookup j is probed and its cached row and bookkeeping fetched; lookup j - AHEAD is
   served (touched, copied, counted). Each lookup's loads then overlap with other lookups' instead of
   waiting one after another. */
#define AHEAD 16
#define RING 64 /* > 2 * AHEAD, a power of two */
ROW_LOOPS static void *lookup_gather_part(void *p) {
    gather_args *g = (gather_args *)p;
    lookup_args *a = &g->probe;
    int64_t hits = 0, dim = g->dim, tables = g->tables, n = a->n, next_table = 0;
    size_t row_bytes = (size_t)dim * sizeof(float), way_bytes = (size_t)a->ways * (a->wide ? 8 : 4);
    int64_t sets[RING];
    int64_t slots[RING];
    for (int64_t j = -AHEAD; j < n + AHEAD; j++) {
        int64_t next = j + AHEAD;
        if (next < n) {
            int64_t set = set_of(a->rows[next], a->multiplier, a->num_sets, a->ways);
            if (a->parts > 1 && (set < 0 ? 0 : set) % a->parts != a->part) set = -2;  /* another thread's */
            sets[next & (RING - 1)] = set;
            if (set >= 0)
                prefetch_span((const char *)a->slot_rows + set * way_bytes, way_bytes, 0);
        }
        if (j >= 0 && j < n) {
            int64_t set = sets[j & (RING - 1)], r = a->rows[j], slot = -1;
            int64_t first = set * a->ways;
            for (int64_t w = 0; set >= 0 && w < a->ways; w++) {
                int64_t resident = a->wide ? ((const int64_t *)a->slot_rows)[first + w]
                                           : ((const int32_t *)a->slot_rows)[first + w];
                if (resident == r) { slot = first + w; break; }
            }
            slots[j & (RING - 1)] = slot;
            if (slot >= 0) {
                prefetch_span(g->weights + slot * dim, row_bytes, 0);
                __builtin_prefetch(a->last_used + slot, 1);
                if (a->use_count) __builtin_prefetch(a->use_count + slot, 1);
            }
        }
        int64_t i = j - AHEAD;
        if (i >= 0) {
            int64_t table = next_table;  /* i % tables, without a division */
            if (++next_table == tables) next_table = 0;
            if (sets[i & (RING - 1)] == -2) continue;
            int64_t slot = slots[i & (RING - 1)];
            a->out_slots[i] = slot;
            if (slot >= 0) {
                hits++;
                g->table_hits[table]++;
                if (a->last_used) a->last_used[slot] = a->step;
                if (a->use_count) a->use_count[slot] += 1;
                const float *src = g->weights + slot * dim;
                float *dst = g->out + i * dim;
                for (int64_t k = 0; k < dim; k++) dst[k] = src[k];
            }
        }
    }
    a->hits = hits;
    return 0;
}

/* `lookup` over single-hot lookups [batch, tables] that also copies each hit's cached row into out[i]
   (misses are left for the caller) and adds per-table lookups, hits and misses to the counters
   ([tables, stride] int64, columns lookups_col, hits_col, misses_col). Returns the hits, or -1 when the
   per-table scratch cannot be had (nothing is written then). */
int64_t lookup_gather(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
                      const int64_t *rows, int64_t batch, int64_t tables, int64_t *out_slots,
                      int32_t *last_used, int32_t *use_count, int32_t step, const float *weights, int64_t dim,
                      float *out, int64_t *counters, int64_t stride, int64_t lookups_col, int64_t hits_col,
                      int64_t misses_col, int64_t threads) {
    gather_args args[MAX_THREADS];
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t *table_hits = calloc((size_t)(threads * tables), sizeof(int64_t));
    if (!table_hits) return -1;
    for (int64_t t = 0; t < threads; t++)
        args[t] = (gather_args){{slot_rows, wide, num_sets, ways, multiplier, rows, batch * tables, out_slots,
                                 last_used, use_count, step, t, threads, 0},
                                weights, dim, out, tables, table_hits + t * tables};
    run_parts(lookup_gather_part, args, sizeof(gather_args), threads);
    int64_t hits = 0;
    for (int64_t t = 0; t < threads; t++) hits += args[t].probe.hits;
    for (int64_t k = 0; k < tables; k++) {
        int64_t table = 0;
        for (int64_t t = 0; t < threads; t++) table += table_hits[t * tables + k];
        counters[k * stride + lookups_col] += batch;
        counters[k * stride + hits_col] += table;
        counters[k * stride + misses_col] += batch - table;
    }
    free(table_hits);
    return hits;
}

typedef struct { const uint32_t *bits; int64_t n; int bad; } finite_args;

ROW_LOOPS static void *finite_part(void *p) {
    finite_args *a = (finite_args *)p;
    uint32_t bad = 0;
    for (int64_t i = 0; i < a->n; i++) bad |= (a->bits[i] & 0x7f800000u) == 0x7f800000u;  /* inf or NaN */
    a->bad = bad != 0;
    return 0;
}

/* Whether all n floats are finite, on `threads` threads over contiguous chunks. */
static int all_finite(const float *values, int64_t n, int64_t threads) {
    finite_args args[MAX_THREADS];
    int64_t chunk = (n + threads - 1) / threads;
    for (int64_t t = 0; t < threads; t++) {
        int64_t start = t * chunk < n ? t * chunk : n, stop = (t + 1) * chunk < n ? (t + 1) * chunk : n;
        args[t] = (finite_args){(const uint32_t *)values + start, stop - start, 0};
    }
    run_parts(finite_part, args, sizeof(finite_args), threads);
    for (int64_t t = 0; t < threads; t++) if (args[t].bad) return 0;
    return 1;
}

/* The distinct values of rows[0..n) in order of first occurrence into `unique`, and for each i the index of
   rows[i] there into `inverse`. Returns their count, or -1 without scratch memory (nothing written). */
int64_t unique_rows(const int64_t *rows, int64_t n, int64_t *unique, int64_t *inverse) {
    int64_t capacity = 16;
    while (capacity < 2 * n) capacity <<= 1;
    int64_t *table = malloc((size_t)capacity * sizeof(int64_t));  /* index into unique, -1 when free */
    if (!table) return -1;
    for (int64_t k = 0; k < capacity; k++) table[k] = -1;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int64_t h = (int64_t)(((uint64_t)r * 0x9E3779B97F4A7C15ull) >> 20) & (capacity - 1);
        while (table[h] >= 0 && unique[table[h]] != r) h = (h + 1) & (capacity - 1);
        if (table[h] < 0) { table[h] = count; unique[count++] = r; }
        inverse[i] = table[h];
    }
    free(table);
    return count;
}

/* Whether all n floats are finite (exported: the general update's check). */
int64_t finite_values(const float *values, int64_t n, int64_t threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return all_finite(values, n, threads);
}

/* RowCache.assign for LRU and LFU (no lookahead window), unpartitioned: slots for the unique missing `rows`.
   The rows of one set take its evictable ways (not pinned: last_used < pin_since, or empty) in victim order
   (empty first, then ascending key = last_used, or use_count when given; ties by way), in the order the
   rows come; rows beyond the evictable count get -1. Victims (resident rows displaced) are listed in row
   order. Returns the victim count, or -1 when scratch memory cannot be had (nothing written then). */
typedef struct { int64_t set; int64_t taken; int64_t evictable; int64_t order; } set_entry;

int64_t assign_slots(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
                     const int32_t *last_used, const int32_t *use_count, int32_t pin_since, const int64_t *rows,
                     int64_t n, int64_t *out_slots, int64_t *victim_slots, int64_t *victim_rows) {
    int64_t capacity = 16;
    while (capacity < 2 * n) capacity <<= 1;
    set_entry *table = malloc((size_t)capacity * sizeof(set_entry));
    int32_t *orders = malloc((size_t)(n > 0 ? n : 1) * (size_t)ways * sizeof(int32_t));
    int64_t *keys = malloc((size_t)ways * sizeof(int64_t));
    if (!table || !orders || !keys) { free(table); free(orders); free(keys); return -1; }
    for (int64_t k = 0; k < capacity; k++) table[k].set = -1;
    int64_t used_orders = 0, victims = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t set = set_of(rows[i], multiplier, num_sets, ways);
        if (set < 0) { out_slots[i] = -1; continue; }
        int64_t h = (int64_t)(((uint64_t)set * 0x9E3779B97F4A7C15ull) >> 20) & (capacity - 1);
        while (table[h].set >= 0 && table[h].set != set) h = (h + 1) & (capacity - 1);
        set_entry *e = &table[h];
        if (e->set < 0) {  /* first row of this set: rank its ways as victims */
            int32_t *order = orders + used_orders * ways;
            int64_t evictable = 0;
            for (int64_t w = 0; w < ways; w++) {
                int64_t slot = set * ways + w;
                int64_t resident = wide ? ((const int64_t *)slot_rows)[slot] : ((const int32_t *)slot_rows)[slot];
                int64_t key;
                if (resident == -1) key = -1;
                else if (last_used[slot] >= pin_since) key = INT64_MAX;  /* pinned */
                else key = use_count ? use_count[slot] : last_used[slot];
                evictable += key != INT64_MAX;
                /* insertion: after every way of an equal key (a stable sort) */
                int64_t at = w;
                while (at > 0 && keys[at - 1] > key) { keys[at] = keys[at - 1]; order[at] = order[at - 1]; at--; }
                keys[at] = key;
                order[at] = (int32_t)w;
            }
            *e = (set_entry){set, 0, evictable, used_orders++};
        }
        int64_t rank = e->taken++;
        if (rank >= e->evictable) { out_slots[i] = -1; continue; }
        int64_t slot = set * ways + orders[e->order * ways + rank];
        out_slots[i] = slot;
        int64_t resident = wide ? ((const int64_t *)slot_rows)[slot] : ((const int32_t *)slot_rows)[slot];
        if (resident != -1) { victim_slots[victims] = slot; victim_rows[victims] = resident; victims++; }
    }
    free(table); free(orders); free(keys);
    return victims;
}

/* Stale-input filter: per input, whether at least `required` of its lookups are stale (flag 3) and hot
   (flag != 0). Returns -1, or the index of the first id outside its table (nothing after it is written). */
/* One input: its hot and stale lookups, counted until fewer than `required` hot ones are still possible
   (then neither count can reach it: stale rows are hot); -1, or the table of the first id outside its table.
   Every id is range-checked; the flag reads, random accesses into a byte per row, stop early: with
   required = every lookup (alpha = 1) a cold input costs its first cold lookup, not all of them. */
static inline int64_t classify_one(const int32_t *row, int64_t tables, const int64_t *offsets,
                                   const uint8_t *flags, int64_t required, int64_t *num_hot, int64_t *num_stale) {
    for (int64_t t = 0; t < tables; t++) {
        if (row[t] < 0 || row[t] >= offsets[t + 1] - offsets[t]) return t;
    }
    *num_hot = *num_stale = 0;
    for (int64_t t = 0; t < tables; t++) {
        uint8_t flag = flags[offsets[t] + row[t]];
        *num_hot += flag != 0;
        *num_stale += flag == 3;
        if (*num_hot + (tables - 1 - t) < required) break;
    }
    return -1;
}

int64_t classify_inputs(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                        const uint8_t *flags, int64_t required, uint8_t *stale, uint8_t *hot) {
    for (int64_t i = 0; i < n; i++) {
        int64_t num_hot, num_stale, bad = classify_one(ids + i * tables, tables, offsets, flags, required, &num_hot, &num_stale);
        if (bad >= 0) return i * tables + bad;
        stale[i] = num_stale >= required;
        hot[i] = num_hot >= required;
    }
    return -1;
}

/* Must match detector._uniform: splitmix64 of (seed mix + position of the input in the run), top 53 bits. */
static inline double uniform_at(uint64_t seed_mix, uint64_t position) {
    uint64_t z = position + seed_mix + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

/* The skip filter in one pass: an input with >= required stale lookups is skipped (keep 0) when skipping,
   unless drawn as a control (uniform_at(seed_mix, start + i) < control_share: kept, control 1).
   counts: hot inputs, would-be-skipped inputs, controls. Returns -1 or the index of the first bad id. */
int64_t filter_inputs(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                      const uint8_t *flags, int64_t required, int64_t skipping, double control_share,
                      uint64_t seed_mix, uint64_t start, uint8_t *keep, uint8_t *control, int64_t *counts) {
    int64_t hot = 0, would_skip = 0, controls = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t num_hot, num_stale, bad = classify_one(ids + i * tables, tables, offsets, flags, required, &num_hot, &num_stale);
        if (bad >= 0) return i * tables + bad;
        hot += num_hot >= required;
        int skip = skipping && num_stale >= required;
        int is_control = skip && control_share > 0.0 && uniform_at(seed_mix, start + (uint64_t)i) < control_share;
        would_skip += skip;
        controls += is_control;
        keep[i] = !skip || is_control;
        control[i] = is_control;
    }
    counts[0] = hot; counts[1] = would_skip; counts[2] = controls;
    return -1;
}

/* Update counting of the convergence rule: for every lookup of a hot row (flag != 0), counts[position]++,
   the position found in the open-addressing hash of the hot rows (HotIndex: Fibonacci hash, linear probing,
   keys -1 = empty). Ids are trained ones, validated by the filter already. Returns the lookups counted. */
int64_t count_hot_updates(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                          const uint8_t *flags, const int64_t *keys, const int32_t *values, int64_t bits,
                          int64_t *counts) {
    uint64_t mask = ((uint64_t)1 << bits) - 1, shift = 64 - (uint64_t)bits;
    int64_t counted = 0;
    for (int64_t i = 0; i < n * tables; i++) {
        int64_t row = offsets[i % tables] + ids[i];
        if (!flags[row]) continue;
        uint64_t slot = ((uint64_t)row * 0x9E3779B97F4A7C15ULL) >> shift;
        while (keys[slot] != row && keys[slot] != -1) slot = (slot + 1) & mask;
        if (keys[slot] == row) { counts[values[slot]]++; counted++; }
    }
    return counted;
}

typedef struct {
    float *weights; int64_t dim; const int64_t *slots; const float *grad; int64_t n; float lr;
    int64_t part, parts;
} sgd_args;

ROW_LOOPS static void *sgd_part(void *p) {
    sgd_args *a = (sgd_args *)p;
    size_t row_bytes = (size_t)a->dim * sizeof(float);
    for (int64_t i = 0; i < a->n; i++) {
        if (i + AHEAD < a->n && a->slots[i + AHEAD] >= 0)  /* a later row on its way while this one is updated */
            prefetch_span(a->weights + a->slots[i + AHEAD] * a->dim, row_bytes, 1);
        int64_t s = a->slots[i];
        if (s < 0 || (a->parts > 1 && s % a->parts != a->part)) continue;  /* -1: the row is not cached */
        float *w = a->weights + s * a->dim;
        const float *g = a->grad + i * a->dim;
        for (int64_t d = 0; d < a->dim; d++) w[d] -= a->lr * g[d];
    }
    return 0;
}

/* weights[slots[i]] -= lr * grad[i] in batch order per slot. Returns -1, or the index of the first slot
   outside [0, num_slots) (then nothing is written). */
int64_t sgd_update(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, const float *grad,
                   int64_t n, float lr, int64_t threads) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) return i;
    }
    sgd_args args[MAX_THREADS];
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 0; t < threads; t++) args[t] = (sgd_args){weights, dim, slots, grad, n, lr, t, threads};
    run_parts(sgd_part, args, sizeof(sgd_args), threads);
    return -1;
}

/* The fused SGD step of one backward: nothing is written unless every value of grad [n, dim] is finite
   (returns -2), and lookups with slot -1 (rows outside the cache) are left to the caller. Returns -1, or
   the index of the first slot >= num_slots (then nothing is written). */
int64_t sgd_update_finite(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots,
                          const float *grad, int64_t n, float lr, int64_t threads) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] >= num_slots) return i;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (!all_finite(grad, n * dim, threads)) return -2;
    sgd_args args[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) args[t] = (sgd_args){weights, dim, slots, grad, n, lr, t, threads};
    run_parts(sgd_part, args, sizeof(sgd_args), threads);
    return -1;
}
"""

_library: ctypes.CDLL | None = None
_tried = False


_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
# A compiler or C library without ifunc support (target_clones) builds the same source once more without it.
_FALLBACK_FLAGS = ("-DSLIPCACHE_NO_CLONES",)
BUILD_TIMEOUT_S = 120.0  # a compiler that hangs must not hang training: the torch path runs instead


class UnsafeCacheError(OSError):
    """A cache path that another user could have written: never load from it."""


class NoCompilerError(OSError):
    """No C compiler: the documented torch-only setup, not worth a warning."""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cache_key(compiler: str, flags: tuple[str, ...] = _FLAGS) -> str:
    """Source, compiler (its resolved path and version), flags and CPU architecture: any change rebuilds."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = (_SOURCE, os.path.realpath(compiler), version, " ".join(flags), platform.machine(), sys.platform)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _check_private(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise UnsafeCacheError(f"{path} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise UnsafeCacheError(f"{path} is writable by its group or by everyone (mode {st.st_mode & 0o777:o})")


def private_directory(path: Path) -> Path:
    """`path` created with mode 0700, or checked: a real directory of ours that no one else can write."""
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    root_st = os.stat(root)
    sticky = bool(root_st.st_mode & stat.S_ISVTX)
    if root_st.st_mode & 0o002 and not sticky:  # anyone could swap our directory for theirs
        raise UnsafeCacheError(f"{root} is writable by everyone")
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{path} is not a directory (a link or a file)")
    _check_private(path, st)
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours and not writable by others: make it private as well
    return path


def _build(compiler: str, target: Path) -> None:
    """Compile into a private temporary directory beside `target`, then rename: never half-written."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "native.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        for extra in ((), _FALLBACK_FLAGS):
            try:
                result = subprocess.run(
                    [compiler, *_FLAGS, *extra, "-o", str(built), str(source)],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired as exc:
                raise OSError(f"the C compiler took over {BUILD_TIMEOUT_S:g} s") from exc
            if result.returncode == 0:
                break
        if result.returncode != 0:
            raise OSError(f"the C compiler failed: {(result.stderr or '').strip().splitlines()[:1]}")
        os.chmod(built, 0o700)
        os.replace(built, target)


def _open_checked(target: Path) -> ctypes.CDLL:
    """Load `target` once checked to be our own regular file that no one else can write.

    It lies in our 0700 directory, so no one else can swap it between the check and the load.
    """
    st = os.lstat(target)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheError(f"{target} is not a regular file")
    _check_private(target, st)
    return ctypes.CDLL(str(target))


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """The compiled library from `cache_dir`, built there first if needed; OSError says why not.

    A cached file that is not safe to load (not ours, writable by others, a link) or that fails to load
    is removed and built again, once.
    """
    compiler = _compiler()
    if compiler is None:
        raise NoCompilerError("no C compiler found (set CC)")
    directory = private_directory(cache_dir)
    target = directory / f"slipcache_native_{cache_key(compiler)}.so"
    for attempt in range(2):
        if not os.path.lexists(target):
            _build(compiler, target)
        try:
            library = _open_checked(target)
            _declare(library)
            return library
        except (OSError, AttributeError) as exc:  # unsafe, corrupt, or missing a symbol
            if attempt:
                raise OSError(f"{target} does not load after a rebuild: {exc}") from exc
            target.unlink(missing_ok=True)  # our private directory: the file can be replaced
    raise AssertionError("unreachable")


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.lookup.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int32, i64]
    library.lookup.restype = i64
    library.sgd_update.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_float, i64]
    library.sgd_update.restype = i64
    library.classify_inputs.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]
    library.classify_inputs.restype = i64
    library.filter_inputs.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ctypes.c_double, ctypes.c_uint64,
                                      ctypes.c_uint64, ptr, ptr, ptr]
    library.filter_inputs.restype = i64
    library.count_hot_updates.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr]
    library.count_hot_updates.restype = i64
    library.global_rows.argtypes = [ptr, i64, i64, ptr, ptr]
    library.global_rows.restype = i64
    library.lookup_gather.argtypes = [
        ptr, ctypes.c_int, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int32, ptr, i64, ptr, ptr,
        i64, i64, i64, i64, i64,
    ]
    library.lookup_gather.restype = i64
    library.unique_rows.argtypes = [ptr, i64, ptr, ptr]
    library.unique_rows.restype = i64
    library.finite_values.argtypes = [ptr, i64, i64]
    library.finite_values.restype = i64
    library.assign_slots.argtypes = [
        ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ctypes.c_int32, ptr, i64, ptr, ptr, ptr,
    ]
    library.assign_slots.restype = i64
    library.sgd_update_finite.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_float, i64]
    library.sgd_update_finite.restype = i64


def native() -> ctypes.CDLL | None:
    """The compiled library, or None when disabled or unavailable (then a warning says why, once)."""
    global _library, _tried
    if not _tried:
        _tried = True
        if os.environ.get("SLIPCACHE_NATIVE", "1") != "0":
            from slipcache.cache_dir import default_cache_root

            try:
                _library = load_library(default_cache_root() / "native")
            except NoCompilerError:
                _library = None
            except OSError as exc:
                _library = None
                warnings.warn(f"slipcache: compiled loops unavailable, using torch: {exc}", stacklevel=2)
    return _library




def threads_for(n: int, threads: int | None = None) -> int:
    """Threads for a loop over `n` lookups: `threads` if given, else 1.

    Why not torch's count: the loops split their work by cache set or slot, so every thread scans all `n`
    lookups, and threads start per call. On the 2-core machine two threads made the fused step slower
    (INT8 + 5 %, dim 16: lookup + gather 0.60 -> 1.46 µs, backward 0.24 -> 0.78 µs per sample;
    docs/results.md §1d), so more threads are for callers who measured that they help.
    """
    return 1 if threads is None else max(1, threads)


def usable(*tensors: Tensor) -> bool:
    return native() is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _check(name: str, tensor: Tensor | None, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...]) -> None:
    """The C loops trust their pointers: refuse anything but a contiguous CPU tensor of the expected layout."""
    if tensor is None:
        return
    if (
        tensor.device.type != "cpu"
        or tensor.dtype not in dtypes
        or not tensor.is_contiguous()
        or tensor.dim() != len(shape)
        or any(want is not None and have != want for have, want in zip(tensor.shape, shape, strict=True))
    ):
        want_shape = tuple("*" if s is None else s for s in shape)
        raise ValueError(
            f"compiled loop: {name} must be a contiguous CPU tensor of dtype {'/'.join(map(str, dtypes))} "
            f"and shape {want_shape}; got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )


def _check_cache_state(slot_rows: Tensor, last_used: Tensor | None, use_count: Tensor | None, slots: int) -> None:
    """The cache's per-slot arrays, as every cache loop reads them."""
    _check("slot_rows", slot_rows, (torch.int32, torch.int64), (slots,))
    _check("last_used", last_used, (torch.int32,), (slots,))
    _check("use_count", use_count, (torch.int32,), (slots,))


def lookup(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    rows: Tensor,
    last_used: Tensor | None,
    use_count: Tensor | None,
    step: int,
    threads: int | None = None,
) -> Tensor:
    """Slot per row (-1 on a miss); hits get last_used = step and use_count += 1 when given."""
    library = native()
    assert library is not None
    rows = rows.contiguous()
    _check_cache_state(slot_rows, last_used, use_count, num_sets * ways)
    _check("rows", rows, (torch.int64,), (None,))
    slots = torch.empty_like(rows)
    library.lookup(
        slot_rows.data_ptr(),
        int(slot_rows.dtype == torch.int64),
        num_sets,
        ways,
        multiplier,
        rows.data_ptr(),
        rows.numel(),
        slots.data_ptr(),
        last_used.data_ptr() if last_used is not None else None,
        use_count.data_ptr() if use_count is not None else None,
        step,
        threads_for(rows.numel(), threads),
    )
    return slots


def sgd_update(weights: Tensor, slots: Tensor, grad: Tensor, lr: float, threads: int | None = None) -> None:
    """weights[slots[i]] -= lr * grad[i], for repeated slots too (in batch order, on any thread count)."""
    library = native()
    assert library is not None
    slots, grad = slots.contiguous(), grad.contiguous().float()  # a read-only input may be converted
    _run_sgd(library.sgd_update, weights, slots, grad, lr, threads)


def _run_sgd(loop: Callable[..., int], weights: Tensor, slots: Tensor, grad: Tensor, lr: float, threads: int | None) -> int:
    """Check the arguments of an SGD loop, run it and return its code; a slot out of range raises."""
    _check("weights", weights, (torch.float32,), (None, None))
    _check("slots", slots, (torch.int64,), (None,))
    _check("grad", grad, (torch.float32,), (slots.numel(), weights.shape[1]))
    code = loop(
        weights.data_ptr(),
        weights.shape[0],
        weights.shape[1],
        slots.data_ptr(),
        grad.data_ptr(),
        slots.numel(),
        lr,
        threads_for(slots.numel(), threads),
    )
    if code >= 0:
        raise ValueError(f"compiled loop: slot {int(slots[code])} is outside [0, {weights.shape[0]})")
    return code


def global_rows(ids: Tensor, offsets: Tensor, out: Tensor | None = None) -> tuple[Tensor, int]:
    """(offsets[t] + ids[:, t] flattened, -1) for int64 ids [B, T], or (partial rows, index of the first id
    outside its table `[0, offsets[t + 1] - offsets[t])`). Written into `out` [B * T] when given."""
    library = native()
    assert library is not None
    _check("ids", ids, (torch.int64,), (None, offsets.numel() - 1))
    _check("offsets", offsets, (torch.int64,), (ids.shape[1] + 1,))
    rows = torch.empty(ids.numel(), dtype=torch.int64) if out is None else out
    _check("out", rows, (torch.int64,), (ids.numel(),))
    bad = library.global_rows(ids.data_ptr(), ids.shape[0], ids.shape[1], offsets.data_ptr(), rows.data_ptr())
    return rows, int(bad)


def lookup_gather(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    rows: Tensor,
    tables: int,
    last_used: Tensor,
    use_count: Tensor | None,
    step: int,
    weights: Tensor,
    out: Tensor,
    counters: Tensor,
    columns: tuple[int, int, int],
    threads: int | None = None,
    slots: Tensor | None = None,
) -> tuple[Tensor, int]:
    """The forward's one pass over single-hot lookups `rows` [B * T] (table = position mod T): `lookup`'s
    slots and touches, each hit's row of `weights` copied into `out` [B * T, D] (miss rows are left as they
    are), and per-table lookups, hits and misses added to `counters` [T, C] at `columns`. Returns
    (slots, hits); the slots are written into `slots` when given."""
    library = native()
    assert library is not None
    slots_count = num_sets * ways
    _check_cache_state(slot_rows, last_used, use_count, slots_count)
    _check("weights", weights, (torch.float32,), (slots_count, None))
    if tables < 1 or rows.numel() % tables:
        raise ValueError(f"compiled loop: {rows.numel()} lookups are not whole rows of {tables} tables")
    _check("rows", rows, (torch.int64,), (None,))
    _check("out", out, (torch.float32,), (rows.numel(), weights.shape[1]))
    _check("counters", counters, (torch.int64,), (tables, None))
    if not all(0 <= c < counters.shape[1] for c in columns):
        raise ValueError(f"compiled loop: counter columns {columns} outside [0, {counters.shape[1]})")
    slots = torch.empty_like(rows) if slots is None else slots
    _check("slots", slots, (torch.int64,), (rows.numel(),))
    hits = library.lookup_gather(
        slot_rows.data_ptr(),
        int(slot_rows.dtype == torch.int64),
        num_sets,
        ways,
        multiplier,
        rows.data_ptr(),
        rows.numel() // tables,
        tables,
        slots.data_ptr(),
        last_used.data_ptr(),
        use_count.data_ptr() if use_count is not None else None,
        step,
        weights.data_ptr(),
        weights.shape[1],
        out.data_ptr(),
        counters.data_ptr(),
        counters.shape[1],
        *columns,
        threads_for(rows.numel(), threads),
    )
    if hits < 0:
        raise MemoryError("compiled loop: no memory for the per-table hit counts")
    return slots, int(hits)


def unique_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(distinct rows in order of first occurrence, index of each row there): `torch.unique(rows,
    return_inverse=True)` by hashing instead of sorting, for callers that do not need the rows sorted."""
    library = native()
    assert library is not None
    _check("rows", rows, (torch.int64,), (None,))
    unique, inverse = torch.empty_like(rows), torch.empty_like(rows)
    count = library.unique_rows(rows.data_ptr(), rows.numel(), unique.data_ptr(), inverse.data_ptr())
    if count < 0:
        raise MemoryError("compiled loop: no memory for the distinct rows")
    return unique[:count], inverse


def all_finite(values: Tensor, threads: int | None = None) -> bool:
    """Whether every value of a contiguous fp32 CPU tensor is finite, in one pass (torch.isfinite(x).all()
    takes several, with a temporary as large as x)."""
    library = native()
    assert library is not None
    _check("values", values, (torch.float32,), (None,) * values.dim())
    return bool(library.finite_values(values.data_ptr(), values.numel(), threads_for(values.numel(), threads)))


def assign_slots(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    last_used: Tensor,
    use_count: Tensor | None,
    pin_since: int,
    rows: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`RowCache.assign` for LRU/LFU without a window in one pass: (slot of each unique missing row or -1,
    victim slots, victim rows)."""
    library = native()
    assert library is not None
    slots_count = num_sets * ways
    _check_cache_state(slot_rows, last_used, use_count, slots_count)
    _check("rows", rows, (torch.int64,), (None,))
    slots, victim_slots, victim_rows = torch.empty_like(rows), torch.empty_like(rows), torch.empty_like(rows)
    victims = library.assign_slots(
        slot_rows.data_ptr(),
        int(slot_rows.dtype == torch.int64),
        num_sets,
        ways,
        multiplier,
        last_used.data_ptr(),
        use_count.data_ptr() if use_count is not None else None,
        max(-(2**31), min(pin_since, 2**31 - 1)),
        rows.data_ptr(),
        rows.numel(),
        slots.data_ptr(),
        victim_slots.data_ptr(),
        victim_rows.data_ptr(),
    )
    if victims < 0:
        raise MemoryError("compiled loop: no memory for the cache assignment")
    return slots, victim_slots[:victims], victim_rows[:victims]


def sgd_update_finite(weights: Tensor, slots: Tensor, grad: Tensor, lr: float, threads: int | None = None) -> bool:
    """`sgd_update` for the lookups with a slot (-1: skipped), applied only if every value of `grad` is
    finite; returns whether it was."""
    library = native()
    assert library is not None
    return _run_sgd(library.sgd_update_finite, weights, slots, grad, lr, threads) == -1


def classify_inputs(
    ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, required: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(stale, hot) bool[n] for int32 ids [n, T] over per-row flag bytes; None if an id is out of its table.

    The caller checks that the library is there and that ids is a C-contiguous int32 [n, T] array.
    """
    library = native()
    assert library is not None
    n, tables = ids.shape
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if (
        ids.dtype != np.int32
        or not ids.flags.c_contiguous
        or flags.dtype != np.uint8
        or not flags.flags.c_contiguous
        or offsets.shape != (tables + 1,)
        or flags.shape[0] < offsets[-1]
    ):
        raise ValueError(
            "compiled loop: ids must be C-contiguous int32 [n, T], offsets [T + 1], flags uint8 covering every row"
        )
    stale, hot = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
    bad = library.classify_inputs(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data, required,
                                  stale.ctypes.data, hot.ctypes.data)
    return None if bad >= 0 else (stale, hot)


def filter_inputs(
    ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, required: int, skipping: bool, control_share: float,
    seed_mix: int, start: int,
) -> tuple[np.ndarray, np.ndarray, int, int, int] | None:
    """(keep, control, hot inputs, would-be-skipped, controls) of the skip filter; None if an id is out of range.

    Same contract as `classify_inputs` for ids/offsets/flags; the control draw is detector._uniform's.
    """
    library = native()
    assert library is not None
    n, tables = ids.shape
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if (ids.dtype != np.int32 or not ids.flags.c_contiguous or flags.dtype != np.uint8 or not flags.flags.c_contiguous
            or offsets.shape != (tables + 1,) or flags.shape[0] < offsets[-1]):
        raise ValueError("compiled loop: bad arrays for filter_inputs")
    keep, control = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
    counts = np.zeros(3, dtype=np.int64)
    bad = library.filter_inputs(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data, required,
                                int(skipping), float(control_share), seed_mix, start, keep.ctypes.data,
                                control.ctypes.data, counts.ctypes.data)
    return None if bad >= 0 else (keep, control, int(counts[0]), int(counts[1]), int(counts[2]))


def count_hot_updates(ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, keys: np.ndarray, values: np.ndarray,
                      counts: np.ndarray) -> int:
    """counts[hot position of each hot lookup] += 1, in one pass; returns the lookups counted.

    `keys`/`values` are a HotIndex's table (its size a power of two), `flags` the detector's per-row bytes
    (non-zero = hot). The caller checks that the library is there; ids must be valid C-contiguous int32 [n, T].
    """
    library = native()
    assert library is not None
    n, tables = ids.shape
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    bits = int(keys.size).bit_length() - 1
    if (
        ids.dtype != np.int32 or not ids.flags.c_contiguous or offsets.shape != (tables + 1,)
        or flags.dtype != np.uint8 or flags.shape[0] < offsets[-1] or keys.dtype != np.int64
        or values.dtype != np.int32 or keys.size != 1 << bits or values.size != keys.size
        or counts.dtype != np.int64 or not counts.flags.c_contiguous
    ):
        raise ValueError("compiled loop: bad arrays for count_hot_updates")
    return int(library.count_hot_updates(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data,
                                         keys.ctypes.data, values.ctypes.data, bits, counts.ctypes.data))
