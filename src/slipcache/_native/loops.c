#include <math.h>
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

/* Must match RowCache.set_of: ((r ^ (r >> 17)) * M >> 5) mod num_sets, with wrapping int64;
   M = 0 marks a cache that holds every row: set r / ways (-1 for a row beyond the last set). */
static inline int64_t set_of(int64_t r, int64_t multiplier, int64_t num_sets, int64_t ways) {
    if (multiplier == 0) return (r >= 0 && r / ways < num_sets) ? r / ways : -1;
    int64_t mixed = (int64_t)((uint64_t)(r ^ (r >> 17)) * (uint64_t)multiplier);
    int64_t s = (mixed >> 5) % num_sets;
    return s < 0 ? s + num_sets : s;
}

/* The slot of row r among the `ways` slots from `first` (-1: not there); the first way on a tie, as the torch
   lookup's max picks it. Up to 64 ways, every way is compared into a bit mask, without a branch per way:
   the way that matches is random, so an early exit mispredicts once a lookup (as much as a cache hit costs). */
static inline int64_t find_way(const void *slot_rows, int wide, int64_t first, int64_t ways, int64_t r) {
    if (ways <= 64) {
        uint64_t mask = 0;
        if (wide) {
            const int64_t *resident = (const int64_t *)slot_rows + first;
            for (int64_t w = 0; w < ways; w++) mask |= (uint64_t)(resident[w] == r) << w;
        } else {
            const int32_t *resident = (const int32_t *)slot_rows + first;
            if (r != (int32_t)r) return -1;  /* beyond the narrow tags' range: never resident */
            int32_t narrow = (int32_t)r;
            for (int64_t w = 0; w < ways; w++) mask |= (uint64_t)(resident[w] == narrow) << w;
        }
        return mask ? first + __builtin_ctzll(mask) : -1;
    }
    for (int64_t w = 0; w < ways; w++) {
        int64_t resident = wide ? ((const int64_t *)slot_rows)[first + w] : ((const int32_t *)slot_rows)[first + w];
        if (resident == r) return first + w;
    }
    return -1;
}

typedef struct {
    const void *slot_rows; int wide; int64_t num_sets, ways, multiplier;
    const int64_t *rows; int64_t n; int64_t *out_slots; int32_t *last_used, *use_count; int32_t step;
    int64_t hits; int shared;  /* shared: other threads touch the same cache state */
} lookup_args;

/* A hit's bookkeeping. When a job is split, parts may hit the same slot at once: last_used takes the same
   step from each (a relaxed atomic store: a plain store on x86), use_count's additions are atomic, so the
   counts are exactly one thread's. */
static inline void touch_slot(const lookup_args *a, int64_t slot) {
    if (a->last_used) __atomic_store_n(a->last_used + slot, a->step, __ATOMIC_RELAXED);
    if (!a->use_count) return;
    if (a->shared) __atomic_fetch_add(a->use_count + slot, 1, __ATOMIC_RELAXED);
    else a->use_count[slot] += 1;
}

static void lookup_all(lookup_args *a) {
    int64_t hits = 0;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t r = a->rows[i];
        int64_t set = set_of(r, a->multiplier, a->num_sets, a->ways);
        int64_t slot = set >= 0 ? find_way(a->slot_rows, a->wide, set * a->ways, a->ways, r) : -1;
        a->out_slots[i] = slot;
        if (slot >= 0) {
            hits++;
            touch_slot(a, slot);
        }
    }
    a->hits = hits;
}

/* Lookups split by position: part p serves the contiguous range p of them (a copy of the arguments with the
   arrays advanced to its first lookup). Every write of a part is to its own positions, apart from the
   touches (see touch_slot). */
#define LOOKUP_GRAIN 1024 /* lookups per part at least: smaller batches stay on one thread */

typedef struct { lookup_args base; int64_t hits[POOL_MAX]; } lookup_job;

static void lookup_part(void *job_, int64_t part, int64_t parts) {
    lookup_job *job = job_;
    lookup_args a = job->base;
    int64_t lo, hi;
    part_range(a.n, part, parts, &lo, &hi);
    a.rows += lo, a.out_slots += lo, a.n = hi - lo;
    lookup_all(&a);
    job->hits[part] = a.hits;
}

/* Slot of each row (-1 on a miss); hits get last_used = step and use_count += 1. Returns the hits. */
int64_t lookup(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
               const int64_t *rows, int64_t n, int64_t *out_slots, int32_t *last_used, int32_t *use_count,
               int32_t step) {
    int64_t parts = chunks_for(n, LOOKUP_GRAIN), hits = 0;
    lookup_job job = {{slot_rows, wide, num_sets, ways, multiplier, rows, n, out_slots, last_used, use_count,
                       step, 0, parts > 1}, {0}};
    run_parts(lookup_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) hits += job.hits[p];
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
    int64_t first_table;  /* the table of the first lookup (its position mod tables) */
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
ROW_LOOPS static void lookup_gather_all(gather_args *g) {
    lookup_args *a = &g->probe;
    int64_t hits = 0, dim = g->dim, tables = g->tables, n = a->n, next_table = g->first_table;
    size_t row_bytes = (size_t)dim * sizeof(float), way_bytes = (size_t)a->ways * (a->wide ? 8 : 4);
    int64_t sets[RING];
    int64_t slots[RING];
    for (int64_t j = -AHEAD; j < n + AHEAD; j++) {
        int64_t next = j + AHEAD;
        if (next < n) {
            int64_t set = set_of(a->rows[next], a->multiplier, a->num_sets, a->ways);
            sets[next & (RING - 1)] = set;
            if (set >= 0)
                prefetch_span((const char *)a->slot_rows + set * way_bytes, way_bytes, 0);
        }
        if (j >= 0 && j < n) {
            int64_t set = sets[j & (RING - 1)];
            int64_t slot = set >= 0 ? find_way(a->slot_rows, a->wide, set * a->ways, a->ways, a->rows[j]) : -1;
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
            int64_t slot = slots[i & (RING - 1)];
            a->out_slots[i] = slot;
            if (slot >= 0) {
                hits++;
                g->table_hits[table]++;
                touch_slot(a, slot);
                const float *src = g->weights + slot * dim;
                float *dst = g->out + i * dim;
                for (int64_t k = 0; k < dim; k++) dst[k] = src[k];
            }
        }
    }
    a->hits = hits;
}

typedef struct { gather_args base; int64_t hits[POOL_MAX]; } gather_job;

/* Part p of the forward: its range of lookups, its own row of per-table hit counts. */
static void gather_part(void *job_, int64_t part, int64_t parts) {
    gather_job *job = job_;
    gather_args g = job->base;
    int64_t lo, hi;
    part_range(g.probe.n, part, parts, &lo, &hi);
    g.probe.rows += lo, g.probe.out_slots += lo, g.probe.n = hi - lo;
    g.out += lo * g.dim;
    g.first_table = lo % g.tables;
    g.table_hits += part * g.tables;
    lookup_gather_all(&g);
    job->hits[part] = g.probe.hits;
}

/* `lookup` over single-hot lookups [batch, tables] that also copies each hit's cached row into out[i]
   (misses are left for the caller) and adds per-table lookups, hits and misses to the counters
   ([tables, stride] int64, columns lookups_col, hits_col, misses_col). Returns the hits, or -1 when the
   per-table scratch cannot be had (nothing is written then). */
int64_t lookup_gather(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
                      const int64_t *rows, int64_t batch, int64_t tables, int64_t *out_slots,
                      int32_t *last_used, int32_t *use_count, int32_t step, const float *weights, int64_t dim,
                      float *out, int64_t *counters, int64_t stride, int64_t lookups_col, int64_t hits_col,
                      int64_t misses_col) {
    int64_t parts = chunks_for(batch * tables, LOOKUP_GRAIN), hits = 0;
    int64_t *table_hits = calloc((size_t)(tables * parts), sizeof(int64_t));  /* [parts, tables] */
    if (!table_hits) return -1;
    gather_job job = {{{slot_rows, wide, num_sets, ways, multiplier, rows, batch * tables, out_slots, last_used,
                        use_count, step, 0, parts > 1},
                       weights, dim, out, tables, table_hits, 0}, {0}};
    run_parts(gather_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) hits += job.hits[p];
    for (int64_t k = 0; k < tables; k++) {
        int64_t table = 0;
        for (int64_t p = 0; p < parts; p++) table += table_hits[p * tables + k];
        counters[k * stride + lookups_col] += batch;
        counters[k * stride + hits_col] += table;
        counters[k * stride + misses_col] += batch - table;
    }
    free(table_hits);
    return hits;
}

/* Whether all n floats are finite (no exponent of all ones: inf or NaN). */
ROW_LOOPS static int all_finite(const float *values, int64_t n) {
    const uint32_t *bits = (const uint32_t *)values;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;
    return bad == 0;
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
static int all_finite_split(const float *values, int64_t n);

int64_t finite_values(const float *values, int64_t n) {
    return all_finite_split(values, n);
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
    size_t way_bytes = (size_t)ways * (wide ? 8 : 4), key_bytes = (size_t)ways * sizeof(int32_t);
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {  /* the missing rows' sets are random lines: fetch a later set's while ranking this one */
            int64_t later = set_of(rows[i + AHEAD], multiplier, num_sets, ways);
            if (later >= 0) {
                prefetch_span((const char *)slot_rows + later * way_bytes, way_bytes, 0);
                prefetch_span(last_used + later * ways, key_bytes, 0);
                if (use_count) prefetch_span(use_count + later * ways, key_bytes, 0);
            }
        }
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

/* Must match filtering.uniform: splitmix64 of (seed mix + position of the input in the run), top 53 bits. */
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
    int64_t slot_lo, slot_hi;  /* the slots this thread owns: updates of other slots are skipped */
    const int64_t *order;      /* when given: the n positions to update, in batch order (else 0..n-1) */
} sgd_args;

/* Whether any of the n floats at v is inf or NaN (exponent all ones). */
static inline int any_nonfinite(const float *v, int64_t n) {
    uint32_t bad = 0;
    for (int64_t d = 0; d < n; d++) {
        uint32_t bits;
        __builtin_memcpy(&bits, v + d, sizeof bits);
        bad |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    return bad != 0;
}

/* The updates in batch order; returns whether an updated value is inf or NaN. */
ROW_LOOPS static int sgd_all(const sgd_args *a) {
    size_t row_bytes = (size_t)a->dim * sizeof(float);
    int nonfinite = 0;
    for (int64_t k = 0; k < a->n; k++) {
        int64_t i = a->order ? a->order[k] : k, ahead = k + AHEAD;
        int64_t later = ahead < a->n ? a->slots[a->order ? a->order[ahead] : ahead] : -1;
        if (later >= a->slot_lo && later < a->slot_hi)  /* a later row on its way while this one is updated */
            prefetch_span(a->weights + later * a->dim, row_bytes, 1);
        int64_t s = a->slots[i];
        if (s < a->slot_lo || s >= a->slot_hi) continue;  /* -1 (the row is not cached) or another's slot */
        float *w = a->weights + s * a->dim;
        const float *g = a->grad + i * a->dim;
        for (int64_t d = 0; d < a->dim; d++) w[d] -= a->lr * g[d];
        /* A value that overflowed stays inf or NaN through later updates: checking each write finds it. */
        nonfinite |= any_nonfinite(w, a->dim);
    }
    return nonfinite;
}

/* The scatter split by the rows it writes: part p owns the slots of range p of [0, num_slots) and walks every
   lookup in batch order, applying only its own slots' updates. Each slot's additions are made by one thread
   in batch order, exactly as on one thread: results are bit-identical for any thread count. */
#define UPDATE_GRAIN 1024 /* lookups per part at least */

typedef struct { sgd_args base; int64_t num_slots; int64_t *order; int nonfinite[POOL_MAX]; } sgd_job;

/* Part p first lists the positions of its own slots, in batch order and without a branch (whose outcome
   would be a coin toss per lookup), then updates only those. */
static void sgd_part(void *job_, int64_t part, int64_t parts) {
    sgd_job *job = job_;
    sgd_args a = job->base;
    part_range(job->num_slots, part, parts, &a.slot_lo, &a.slot_hi);
    if (job->order) {
        int64_t *order = job->order + part * a.n, count = 0;
        for (int64_t i = 0; i < a.n; i++) {
            int64_t s = a.slots[i];
            order[count] = i;
            count += (s >= a.slot_lo) & (s < a.slot_hi);
        }
        a.order = order, a.n = count;
    }
    job->nonfinite[part] = sgd_all(&a);
}

static int sgd_split(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, const float *grad,
                     int64_t n, float lr) {
    int64_t parts = parts_for(n, UPDATE_GRAIN), nonfinite = 0;
    if (parts > num_slots) parts = num_slots > 1 ? num_slots : 1;
    /* Without memory for the position lists each part tests every lookup instead (the same updates). */
    int64_t *order = n >= UPDATE_GRAIN ? malloc((size_t)(parts * n) * sizeof(int64_t)) : 0;
    sgd_job job = {{weights, dim, slots, grad, n, lr, 0, num_slots, 0}, num_slots, order, {0}};
    run_parts(sgd_part, &job, parts);
    free(order);
    for (int64_t p = 0; p < parts; p++) nonfinite |= job.nonfinite[p];
    return nonfinite != 0;
}

/* all_finite over contiguous ranges, one per part. */
#define FINITE_GRAIN 65536 /* values per part at least */

typedef struct { const float *values; int64_t n; int finite[POOL_MAX]; } finite_job;

static void finite_part(void *job_, int64_t part, int64_t parts) {
    finite_job *job = job_;
    int64_t lo, hi;
    part_range(job->n, part, parts, &lo, &hi);
    job->finite[part] = all_finite(job->values + lo, hi - lo);
}

static int all_finite_split(const float *values, int64_t n) {
    int64_t parts = chunks_for(n, FINITE_GRAIN);
    finite_job job = {values, n, {0}};
    run_parts(finite_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) {
        if (!job.finite[p]) return 0;
    }
    return 1;
}

/* weights[slots[i]] -= lr * grad[i] in batch order per slot. Returns -1, -3 when an updated value is inf or
   NaN (an overflow: the caller clamps), or the index of the first slot outside [0, num_slots) (then nothing
   is written). */
int64_t sgd_update(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, const float *grad,
                   int64_t n, float lr) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) return i;
    }
    return sgd_split(weights, num_slots, dim, slots, grad, n, lr) ? -3 : -1;
}

/* The fused SGD step of one backward: nothing is written unless every value of grad [n, dim] is finite
   (returns -2), and lookups with slot -1 (rows outside the cache) are left to the caller. Returns -1, -3
   when an updated value is inf or NaN (the caller clamps), or the index of the first slot >= num_slots
   (then nothing is written). */
int64_t sgd_update_finite(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots,
                          const float *grad, int64_t n, float lr) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] >= num_slots) return i;
    }
    if (!all_finite_split(grad, n * dim)) return -2;
    return sgd_split(weights, num_slots, dim, slots, grad, n, lr) ? -3 : -1;
}

/* ------------------------------------------------------------------ Adagrad: one pass per unique row
   For each unique row i (its gradient already summed, grad [n, dim]): target row t = slots ? slots[i] : i,
   state row r = state_rows[i]. Per value (rowwise = 0): state[r][d] += g*g; w[d] += g / (sqrt(state) + eps)
   * -lr. Row-wise (rowwise = 1): state[r] += mean of g*g over the row (summed in double, torch sums fp32 in
   its own order: the one value that can differ); then every value takes g / (sqrt(state) + eps) * -lr. The
   same fp32 operations as the torch step otherwise (no contraction), so results agree within a few ulp. */
typedef struct {
    float *weights; int64_t dim; const int64_t *slots; float *state; const int64_t *state_rows;
    const float *grad; int64_t n; int rowwise; float lr, eps;
} adagrad_args;

ROW_LOOPS static int adagrad_all(const adagrad_args *a) {
    int nonfinite = 0;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t t = a->slots ? a->slots[i] : i;
        float *w = a->weights + t * a->dim;
        const float *g = a->grad + i * a->dim;
        if (a->rowwise) {
            double squares = 0.0;
            for (int64_t d = 0; d < a->dim; d++) squares += (double)g[d] * (double)g[d];
            float *s = a->state + a->state_rows[i];
            float accumulated = *s + (float)(squares / (double)a->dim);
            *s = accumulated;
            float denominator = sqrtf(accumulated) + a->eps;
            for (int64_t d = 0; d < a->dim; d++) w[d] += g[d] / denominator * -a->lr;
        } else {
            float *s = a->state + a->state_rows[i] * a->dim;
            for (int64_t d = 0; d < a->dim; d++) {
                float accumulated = s[d] + g[d] * g[d];
                s[d] = accumulated;
                w[d] += g[d] / (sqrtf(accumulated) + a->eps) * -a->lr;
            }
        }
        nonfinite |= any_nonfinite(w, a->dim);
    }
    return nonfinite;
}

/* Split by position: the rows are distinct (one summed gradient per row), so each part writes its own
   weight and state rows, with one thread's arithmetic. */
#define ADAGRAD_GRAIN 256 /* rows per part at least */

typedef struct { adagrad_args base; int nonfinite[POOL_MAX]; } adagrad_job;

static void adagrad_part(void *job_, int64_t part, int64_t parts) {
    adagrad_job *job = job_;
    adagrad_args a = job->base;
    int64_t lo, hi;
    part_range(a.n, part, parts, &lo, &hi);
    if (a.slots) a.slots += lo;
    else a.weights += lo * a.dim;  /* target row i */
    a.state_rows += lo, a.grad += lo * a.dim, a.n = hi - lo;
    job->nonfinite[part] = adagrad_all(&a);
}

/* The Adagrad or row-wise Adagrad step of n unique rows. Returns -1, -3 when an updated weight is inf or NaN
   (an overflow: the caller fits the rows to fp32's range, as after SGD), or the index of the first target
   slot outside [0, num_slots) or state row outside [0, num_state_rows) (then nothing is written). */
int64_t adagrad_update(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, float *state,
                       int64_t num_state_rows, const int64_t *state_rows, const float *grad, int64_t n,
                       int rowwise, float lr, float eps) {
    for (int64_t i = 0; i < n; i++) {
        int64_t t = slots ? slots[i] : i;
        if (t < 0 || t >= num_slots || state_rows[i] < 0 || state_rows[i] >= num_state_rows) return i;
    }
    adagrad_job job = {{weights, dim, slots, state, state_rows, grad, n, rowwise, lr, eps}, {0}};
    int64_t parts = chunks_for(n, ADAGRAD_GRAIN), nonfinite = 0;
    run_parts(adagrad_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) nonfinite |= job.nonfinite[p];
    return nonfinite ? -3 : -1;
}

/* ------------------------------------------------------------------ quantize: fp32 rows -> storage rows
   The same arithmetic as slipcache.embedding.quant, in one pass per row (bit-identical; tests compare):
   int8/int4 rows get bias = the row minimum rounded down to fp16 and scale code = the smallest code whose
   decoded scale (the caller's table `scales`) covers (max - bias) / levels; codes are
   floor((x - bias) / scale + u) with the caller's noise u, or round-half-even without it. fp16/bf16 rows
   round to nearest even, or stochastically between the two neighbours with probability by distance. */
enum { Q_INT8 = 0, Q_INT4 = 1, Q_FP16 = 2, Q_BF16 = 3, Q_FP32 = 4 };

static inline uint32_t float_bits(float f) { union { float f; uint32_t u; } v = {.f = f}; return v.u; }
static inline float bits_float(uint32_t u) { union { uint32_t u; float f; } v = {.u = u}; return v.f; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) return bits_float(sign | float_bits((float)man * 5.9604644775390625e-8f));  /* man * 2^-24 */
    if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
    return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* |f| as fp16 bits rounded toward zero, and whether that was inexact (|f| below 65520, finite). */
static inline uint16_t half_magnitude(uint32_t a, int *inexact) {
    if (a < 0x38800000u) {  /* below 2^-14: an fp16 subnormal, in units of 2^-24 (exact scaling) */
        float m = bits_float(a) * 16777216.0f;
        uint32_t h = (uint32_t)m;
        *inexact = (float)h != m;
        return (uint16_t)h;
    }
    *inexact = (a & 0x1fffu) != 0;
    return (uint16_t)((a - 0x38000000u) >> 13);
}

/* The largest fp16 <= f, f clamped to +-65504 (quant.round_down_fp16). */
static inline uint16_t half_round_down(float f) {
    if (f > 65504.0f) f = 65504.0f;
    if (f < -65504.0f) f = -65504.0f;
    uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u;
    int inexact;
    uint16_t h = half_magnitude(x & 0x7fffffffu, &inexact);
    return (uint16_t)(sign | (uint32_t)(h + (sign && inexact)));
}

/* f (finite, |f| <= 65504) to fp16, round half to even. */
static inline uint16_t half_nearest(float f) {
    uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a < 0x38800000u) return (uint16_t)(sign | (uint32_t)rintf(bits_float(a) * 16777216.0f));
    uint32_t h = (a - 0x38000000u) >> 13, rest = a & 0x1fffu;
    h += rest > 0x1000u || (rest == 0x1000u && (h & 1));
    return (uint16_t)(sign | h);
}

static inline uint16_t bf16_nearest(float f) {  /* torch's conversion (inputs are finite here) */
    uint32_t x = float_bits(f);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

static inline float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

/* The neighbour of a 16-bit float toward +inf (up) or -inf, as nextafter does. */
static inline uint16_t step16(uint16_t h, int up) {
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    return (uint16_t)(((h & 0x8000) == 0) == up ? h + 1 : h - 1);
}

static inline uint16_t round16(float x, const float *u, int bf16) {
    if (!bf16) x = x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x);
    uint16_t near = bf16 ? bf16_nearest(x) : half_nearest(x);
    if (!u) return near;
    float nearf = bf16 ? bf16_to_float(near) : half_to_float(near);
    int above = nearf > x;
    uint16_t other = step16(near, !above);
    float otherf = bf16 ? bf16_to_float(other) : half_to_float(other);
    float lo = above ? otherf : nearf, hi = above ? nearf : otherf, gap = hi - lo;
    float p_hi = gap > 0 ? (x - lo) / gap : 0.0f;
    uint16_t lo_bits = above ? other : near, hi_bits = above ? near : other;
    return *u < p_hi ? hi_bits : lo_bits;
}

/* The smallest code whose scale covers `needed` (255 when none does): scales ascend. */
static inline uint8_t scale_code_for(float needed, const float *scales) {
    if (needed < 1.17549435e-38f) needed = 1.17549435e-38f;  /* quant: needed.clamp_min(tiny) */
    int lo = 0, hi = 255;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (scales[mid] >= needed) hi = mid; else lo = mid + 1;
    }
    return (uint8_t)lo;
}

#define QUANTIZE_BLOCK 256  /* even: int4 blocks pack whole bytes */

static inline void quantize_block(const float *x, const float *u, int64_t m, float bias, float scale, float top,
                                  uint8_t *codes) {
    if (u) {
        for (int64_t j = 0; j < m; j++) {
            float s = floorf((x[j] - bias) / scale + u[j]);
            codes[j] = (uint8_t)(s < 0.0f ? 0.0f : (s > top ? top : s));
        }
    } else {
        for (int64_t j = 0; j < m; j++) {
            float s = rintf((x[j] - bias) / scale);
            codes[j] = (uint8_t)(s < 0.0f ? 0.0f : (s > top ? top : s));
        }
    }
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* The row's minimum and maximum, and whether it holds inf or NaN: eight lanes at a time (vector extensions,
   so each target clone gets its own instructions). */
static inline int row_range(const float *x, int64_t dim, float *lo_out, float *hi_out) {
    float lo = x[0], hi = x[0];
    uint32_t special = 0;
    int64_t j = 0;
    if (dim >= 8) {
        v8f lo8, hi8;
        v8i sp8 = {0};
        const v8i exp8 = {0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000,
                          0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000};
        __builtin_memcpy(&lo8, x, sizeof lo8);
        hi8 = lo8;
        for (; j + 8 <= dim; j += 8) {
            v8f v;
            __builtin_memcpy(&v, x + j, sizeof v);
            v8i vi = (v8i)v, below = v < lo8, above = v > hi8;
            lo8 = (v8f)(((v8i)v & below) | ((v8i)lo8 & ~below));
            hi8 = (v8f)(((v8i)v & above) | ((v8i)hi8 & ~above));
            sp8 |= (vi & exp8) == exp8;
        }
        lo = lo8[0], hi = hi8[0];
        for (int k = 0; k < 8; k++) {
            lo = lo8[k] < lo ? lo8[k] : lo;
            hi = hi8[k] > hi ? hi8[k] : hi;
            special |= (uint32_t)sp8[k];
        }
    }
    for (; j < dim; j++) {
        float v = x[j];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        special |= (float_bits(v) & 0x7f800000u) == 0x7f800000u;
    }
    *lo_out = lo, *hi_out = hi;
    return special != 0;
}

typedef struct {
    const float *values; int64_t n, dim; int kind; const float *noise, *scales; float limit, max_span;
    const int64_t *rows; void *payload; uint16_t *bias; uint8_t *scale_code; uint8_t *bad;
    int64_t start, stop, bad_count; const int64_t *source;
} quantize_args;

ROW_LOOPS static void quantize_all(quantize_args *a) {
    const int64_t dim = a->dim;
    const int64_t width = a->kind == Q_INT4 ? (dim + 1) / 2 : dim;
    const int levels = a->kind == Q_INT8 ? 255 : 15;
    const size_t payload_bytes = (size_t)(a->kind == Q_FP32 ? dim * 4 : a->kind >= Q_FP16 ? dim * 2 : width);
    for (int64_t i = a->start; i < a->stop; i++) {
        if (i + AHEAD < a->stop) {  /* scattered rows (evictions): a later row's lines on their way */
            int64_t later = i + AHEAD;
            if (a->source) prefetch_span(a->values + a->source[later] * dim, (size_t)dim * sizeof(float), 0);
            if (a->rows) {
                int64_t r = a->rows[later];
                prefetch_span((char *)a->payload + r * (int64_t)payload_bytes, payload_bytes, 1);
                if (a->bias) __builtin_prefetch(a->bias + r, 1);
                if (a->scale_code) __builtin_prefetch(a->scale_code + r, 1);
            }
        }
        const float *x = a->values + (a->source ? a->source[i] : i) * dim;  /* e.g. an evicted row's slot */
        const float *u = a->noise ? a->noise + i * dim : 0;
        float lo, hi;
        int special = row_range(x, dim, &lo, &hi);
        int fits = !special && lo >= -a->limit && hi <= a->limit && (a->max_span < 0 || hi - lo <= a->max_span);
        if (a->bad) a->bad[i] = !fits;
        if (!fits) { a->bad_count++; continue; }
        int64_t r = a->rows ? a->rows[i] : i;
        if (a->kind == Q_FP32) {
            float *out = (float *)a->payload + r * dim;
            for (int64_t j = 0; j < dim; j++) out[j] = x[j];
            continue;
        }
        if (a->kind == Q_FP16 || a->kind == Q_BF16) {
            uint16_t *out = (uint16_t *)a->payload + r * dim;
            for (int64_t j = 0; j < dim; j++) out[j] = round16(x[j], u ? u + j : 0, a->kind == Q_BF16);
            continue;
        }
        uint16_t bias = half_round_down(lo);
        float biasf = half_to_float(bias);
        uint8_t code = scale_code_for((hi - biasf) / (float)levels, a->scales);
        float scale = a->scales[code], top = (float)levels;
        a->bias[r] = bias;
        a->scale_code[r] = code;
        uint8_t *out = (uint8_t *)a->payload + r * width;
        uint8_t codes[QUANTIZE_BLOCK + 1];
        for (int64_t j0 = 0; j0 < dim; j0 += QUANTIZE_BLOCK) {  /* blocks keep the inner loops simple */
            int64_t m = dim - j0 < QUANTIZE_BLOCK ? dim - j0 : QUANTIZE_BLOCK;
            quantize_block(x + j0, u ? u + j0 : 0, m, biasf, scale, top, codes);
            if (a->kind == Q_INT8) {
                for (int64_t j = 0; j < m; j++) out[j0 + j] = codes[j];
            } else {
                if (m & 1) codes[m] = 0;
                for (int64_t j = 0; j < (m + 1) / 2; j++)
                    out[j0 / 2 + j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
            }
        }
    }
}

/* Split by row range: the target rows are distinct (a write stores each row once), so the parts write
   disjoint storage rows; the noise was drawn before, row by row. */
#define QUANTIZE_GRAIN 512 /* rows per part at least */

typedef struct { quantize_args base; int64_t bad_count[POOL_MAX]; } quantize_job;

static void quantize_part(void *job_, int64_t part, int64_t parts) {
    quantize_job *job = job_;
    quantize_args a = job->base;
    part_range(a.n, part, parts, &a.start, &a.stop);
    quantize_all(&a);
    job->bad_count[part] = a.bad_count;
}

/* Quantize fp32 rows values[n, dim] into storage: row i goes to storage row rows[i] (i when rows is NULL)
   of `payload` (uint8 [*, dim] int8, [*, (dim+1)/2] int4 low nibble first, uint16 bits fp16/bf16, float
   fp32), `bias` (fp16 bits) and `scale_code` (int kinds only). `noise` (uniform [n, dim], or NULL for
   nearest) drives stochastic rounding. A row with inf/NaN, a value beyond +-limit or (max_span >= 0) a
   span beyond max_span is not written: bad[i] = 1 (when given) and it is counted in the return value.
   With `source` (non-NULL), row i is read from values[source[i]] instead (evicted rows from their cache
   slots, without a gathered copy). */
int64_t quantize_rows(const float *values, int64_t n, int64_t dim, int kind, const float *noise,
                      const float *scales, float limit, float max_span, const int64_t *rows, void *payload,
                      uint16_t *bias, uint8_t *scale_code, uint8_t *bad, const int64_t *source) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    quantize_job job = {{values, n, dim, kind, noise, scales, limit, max_span, rows, payload, bias, scale_code,
                         bad, 0, n, 0, source}, {0}};
    int64_t parts = chunks_for(n, QUANTIZE_GRAIN), bad_count = 0;
    run_parts(quantize_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) bad_count += job.bad_count[p];
    return bad_count;
}

/* Storage rows -> fp32: out[i] = row rows[i] decoded, as quant.dequantize_int does (bias + scale * code,
   each rounded to fp32, no contraction: bit-identical) or the float kinds' exact widening. One pass with the
   rows' payload and parameters prefetched AHEAD rows on (misses are scattered over the whole table). */
ROW_LOOPS static int64_t dequantize_span(const void *payload, int kind, const uint16_t *bias,
                                         const uint8_t *scale_code, const float *scales, const int64_t *rows,
                                         int64_t n, int64_t dim, float *out) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    const int64_t width = kind == Q_INT4 ? (dim + 1) / 2 : dim;
    const size_t row_bytes = (size_t)(kind == Q_FP32 ? dim * 4 : kind >= Q_FP16 ? dim * 2 : width);
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t later = rows[i + AHEAD];
            prefetch_span((const char *)payload + later * (int64_t)row_bytes, row_bytes, 0);
            if (bias) __builtin_prefetch(bias + later, 0);
            if (scale_code) __builtin_prefetch(scale_code + later, 0);
        }
        int64_t r = rows[i];
        float *o = out + i * dim;
        if (kind == Q_FP32) {
            const float *x = (const float *)payload + r * dim;
            for (int64_t j = 0; j < dim; j++) o[j] = x[j];
        } else if (kind == Q_FP16 || kind == Q_BF16) {
            const uint16_t *x = (const uint16_t *)payload + r * dim;
            for (int64_t j = 0; j < dim; j++) o[j] = kind == Q_FP16 ? half_to_float(x[j]) : bf16_to_float(x[j]);
        } else {
            float b = half_to_float(bias[r]), scale = scales[scale_code[r]];
            const uint8_t *x = (const uint8_t *)payload + r * width;
            if (kind == Q_INT8) {
                for (int64_t j = 0; j < dim; j++) o[j] = b + scale * (float)x[j];
            } else {  /* a byte at a time, low nibble first: the loop vectorizes */
                int64_t pairs = dim / 2;
                for (int64_t j = 0; j < pairs; j++) {
                    o[2 * j] = b + scale * (float)(x[j] & 15);
                    o[2 * j + 1] = b + scale * (float)(x[j] >> 4);
                }
                if (dim & 1) o[dim - 1] = b + scale * (float)(x[pairs] & 15);
            }
        }
    }
    return 0;
}

/* Split by position: part p decodes its range of the rows into its range of `out` (reads only, elsewhere). */
#define DEQUANTIZE_GRAIN 512 /* rows per part at least */

typedef struct {
    const void *payload; int kind; const uint16_t *bias; const uint8_t *scale_code; const float *scales;
    const int64_t *rows; int64_t n, dim; float *out; int64_t status[POOL_MAX];
} dequantize_job;

static void dequantize_part(void *job_, int64_t part, int64_t parts) {
    dequantize_job *j = job_;
    int64_t lo, hi;
    part_range(j->n, part, parts, &lo, &hi);
    j->status[part] = dequantize_span(j->payload, j->kind, j->bias, j->scale_code, j->scales, j->rows + lo, hi - lo,
                                      j->dim, j->out + lo * j->dim);
}

int64_t dequantize_rows(const void *payload, int kind, const uint16_t *bias, const uint8_t *scale_code,
                        const float *scales, const int64_t *rows, int64_t n, int64_t dim, float *out) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    dequantize_job job = {payload, kind, bias, scale_code, scales, rows, n, dim, out, {0}};
    int64_t parts = chunks_for(n, DEQUANTIZE_GRAIN);
    run_parts(dequantize_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) {
        if (job.status[p] != 0) return job.status[p];
    }
    return 0;
}

/* ------------------------------------------------------------------ torch's CPU random stream
   torch.rand(..., generator=g) on CPU: g's mt19937 draws 32 bits per value, in order, and the value is
   (bits & 0xffffff) * 2^-24. `state` is the generator's saved state (Generator.get_state(): seed u64, left
   i32, seeded i32, next u64, state u64[624], ...), advanced in place so that set_state continues the stream
   exactly where torch would. The loader checks the draws against torch.rand before using them. */
#define MT_N 624
#define MT_M 397

static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

int64_t torch_uniform(uint8_t *state, float *out, int64_t n) {
    int32_t left;
    uint64_t next, words[MT_N];
    uint32_t mt[MT_N];
    __builtin_memcpy(&left, state + 8, sizeof left);
    __builtin_memcpy(&next, state + 16, sizeof next);
    __builtin_memcpy(words, state + 24, sizeof words);
    if (left < 1 || left > MT_N || next > MT_N) return -1;
    for (int k = 0; k < MT_N; k++) mt[k] = (uint32_t)words[k];
    for (int64_t i = 0; i < n; i++) {
        if (--left == 0) {
            int k = 0;
            for (; k < MT_N - MT_M; k++) mt[k] = mt[k + MT_M] ^ mt_twist(mt[k], mt[k + 1]);
            for (; k < MT_N - 1; k++) mt[k] = mt[k + MT_M - MT_N] ^ mt_twist(mt[k], mt[k + 1]);
            mt[MT_N - 1] = mt[MT_M - 1] ^ mt_twist(mt[MT_N - 1], mt[0]);
            left = MT_N;
            next = 0;
        }
        uint32_t y = mt[next++];
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        y ^= y >> 18;
        out[i] = (float)(y & 0xffffffu) * 5.9604644775390625e-8f;  /* 2^-24 */
    }
    for (int k = 0; k < MT_N; k++) words[k] = mt[k];
    __builtin_memcpy(state + 8, &left, sizeof left);
    __builtin_memcpy(state + 16, &next, sizeof next);
    __builtin_memcpy(state + 24, words, sizeof words);
    return 0;
}

/* Multi-hot pooling: out[bags[i]] += values[i] (times weights[i] when given), in value order, as torch's
   index_add_ of the (weighted) values does. `out` [num_bags, dim] starts zeroed by the caller. Returns -1,
   or the index of the first bag outside [0, num_bags) (nothing is written then). */
ROW_LOOPS int64_t pool_bags(const float *values, const int64_t *bags, const float *weights, int64_t n,
                            int64_t dim, float *out, int64_t num_bags) {
    for (int64_t i = 0; i < n; i++) {
        if (bags[i] < 0 || bags[i] >= num_bags) return i;
    }
    for (int64_t i = 0; i < n; i++) {
        const float *v = values + i * dim;
        float *o = out + bags[i] * dim;
        if (weights) {
            float w = weights[i];
            for (int64_t d = 0; d < dim; d++) o[d] += v[d] * w;
        } else {
            for (int64_t d = 0; d < dim; d++) o[d] += v[d];
        }
    }
    return -1;
}
