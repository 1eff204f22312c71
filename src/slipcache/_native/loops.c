/* The cache's loops: lookup (and touch), the forward's lookup and gather, the distinct rows of a batch and
   the slots of missing rows (LRU and LFU). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "pool.h"

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

static int64_t lookup_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    (void)part;
    lookup_args a = *(const lookup_args *)args;
    a.rows += lo, a.out_slots += lo, a.n = hi - lo;
    lookup_all(&a);
    return a.hits;
}

/* Slot of each row (-1 on a miss); hits get last_used = step and use_count += 1. Returns the hits. */
int64_t lookup(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
               const int64_t *rows, int64_t n, int64_t *out_slots, int32_t *last_used, int32_t *use_count,
               int32_t step) {
    int64_t parts = chunks_for(n, LOOKUP_GRAIN);
    lookup_args a = {slot_rows, wide, num_sets, ways, multiplier, rows, n, out_slots, last_used, use_count, step, 0,
                     parts > 1};
    return run_ranges(lookup_range, &a, n, parts, NULL);
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

/* A software pipeline over the lookups, AHEAD apart per stage: the set of lookup j + AHEAD is computed and
   its ways fetched; lookup j is probed and its cached row and bookkeeping fetched; lookup j - AHEAD is
   served (touched, copied, counted). Each lookup's loads then overlap with other lookups' instead of
   waiting one after another. */
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

/* Part p of the forward: its range of lookups, its own row of per-table hit counts. */
static int64_t gather_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    gather_args g = *(const gather_args *)args;
    g.probe.rows += lo, g.probe.out_slots += lo, g.probe.n = hi - lo;
    g.out += lo * g.dim;
    g.first_table = lo % g.tables;
    g.table_hits += part * g.tables;
    lookup_gather_all(&g);
    return g.probe.hits;
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
    int64_t parts = chunks_for(batch * tables, LOOKUP_GRAIN);
    size_t hit_bytes = (size_t)(tables * parts) * sizeof(int64_t);
    int64_t *table_hits = thread_scratch(SCRATCH_COUNTS, hit_bytes);  /* [parts, tables], kept between calls */
    if (!table_hits) return -1;
    memset(table_hits, 0, hit_bytes);
    gather_args g = {{slot_rows, wide, num_sets, ways, multiplier, rows, batch * tables, out_slots, last_used,
                      use_count, step, 0, parts > 1},
                     weights, dim, out, tables, table_hits, 0};
    int64_t hits = run_ranges(gather_range, &g, batch * tables, parts, NULL);
    for (int64_t k = 0; k < tables; k++) {
        int64_t table = 0;
        for (int64_t p = 0; p < parts; p++) table += table_hits[p * tables + k];
        counters[k * stride + lookups_col] += batch;
        counters[k * stride + hits_col] += table;
        counters[k * stride + misses_col] += batch - table;
    }
    return hits;
}

/* The distinct values of rows[0..n) in order of first occurrence into `unique`, and for each i the index of
   rows[i] there into `inverse`. Returns their count, or -1 without scratch memory (nothing written). */
int64_t unique_rows(const int64_t *rows, int64_t n, int64_t *unique, int64_t *inverse) {
    int64_t capacity = 16;
    while (capacity < 2 * n) capacity <<= 1;
    /* index into unique, -1 when free: the calling thread's scratch, kept between calls */
    int64_t *table = thread_scratch(SCRATCH_UNIQUE, (size_t)capacity * sizeof(int64_t));
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
    return count;
}
/* The distinct values of the taken rows in ascending order, as torch.unique(taken, return_inverse=True,
   return_counts=True) gives them (the same tensors: a function of the values alone), where the taken rows
   are rows[i] for the i with slots[i] < 0, in order (the forward's misses; their positions into
   `positions`, their count into *taken), or every row when `slots` is NULL (positions unused). One pass
   hashes each taken row to its first occurrence (the distinct rows, their counts); an LSD radix sort of the
   distinct rows alone, a byte at a time, skipping the bytes they all share, orders them; each taken row's
   index follows from its first occurrence's rank. Scratch memory is the calling thread's, kept between
   calls. Returns the count of distinct rows, -1 without scratch memory, -2 for more than 2^30 rows (nothing
   written then: the caller sorts with torch). `counts` may be NULL. */
int64_t sorted_unique(const int64_t *rows, const int64_t *slots, int64_t n, int64_t *positions, int64_t *unique,
                      int64_t *inverse, int64_t *counts, int64_t *taken) {
    if (n < 0 || n > ((int64_t)1 << 30)) return -2;
    int64_t m = n;
    if (slots) {  /* the misses' positions, without a branch per lookup */
        m = 0;
        for (int64_t i = 0; i < n; i++) {
            positions[m] = i;
            m += slots[i] < 0;
        }
    }
    *taken = m;
    if (m == 0) return 0;
    int bits = 4;
    while (((int64_t)1 << bits) < 2 * m) bits++;
    int64_t capacity = (int64_t)1 << bits, mask = capacity - 1;
    size_t table_bytes = (size_t)capacity * sizeof(int32_t), m4 = (size_t)m * sizeof(int32_t);
    size_t m8 = (size_t)m * sizeof(int64_t);
    char *memory = thread_scratch(SCRATCH_UNIQUE, table_bytes + 4 * m4 + 2 * m8);
    if (!memory) return -1;
    int32_t *table = (int32_t *)memory;             /* index into unique, -1 when free */
    int32_t *first = (int32_t *)(memory + table_bytes);  /* each taken row's first occurrence */
    int32_t *ids = first + m, *ids_b = ids + m, *rank = ids_b + m;
    int64_t *keys_b = (int64_t *)(memory + table_bytes + 4 * m4), *uses = keys_b + m;
    memset(table, 0xff, table_bytes);
    int64_t count = 0;
    for (int64_t k = 0; k < m; k++) {
        int64_t r = rows[slots ? positions[k] : k];
        int64_t h = (int64_t)(((uint64_t)r * 0x9E3779B97F4A7C15ull) >> (64 - bits));
        while (table[h] >= 0 && unique[table[h]] != r) h = (h + 1) & mask;
        if (table[h] < 0) {
            table[h] = (int32_t)count;
            unique[count] = r;
            uses[count++] = 0;
        }
        first[k] = table[h];
        uses[first[k]]++;
    }
    /* Signed order: the sign bit flipped, the keys sort as unsigned. One pass counts every byte's values. */
    const uint64_t flip = (uint64_t)1 << 63;
    static const int BYTES = 8;
    uint32_t histogram[8][256];
    memset(histogram, 0, sizeof histogram);
    for (int64_t j = 0; j < count; j++) {
        uint64_t key = (uint64_t)unique[j] ^ flip;
        for (int b = 0; b < BYTES; b++) histogram[b][(key >> (8 * b)) & 255]++;
        ids[j] = (int32_t)j;
    }
    int64_t *keys = unique;
    for (int b = 0; b < BYTES; b++) {
        uint32_t *bucket = histogram[b];
        if (bucket[(((uint64_t)keys[0] ^ flip) >> (8 * b)) & 255] == (uint32_t)count) continue;  /* all share it */
        uint32_t offset[256], sum = 0;
        for (int c = 0; c < 256; c++) {
            offset[c] = sum;
            sum += bucket[c];
        }
        for (int64_t j = 0; j < count; j++) {
            uint32_t at = offset[(((uint64_t)keys[j] ^ flip) >> (8 * b)) & 255]++;
            keys_b[at] = keys[j];
            ids_b[at] = ids[j];
        }
        int64_t *swap_keys = keys;
        keys = keys_b, keys_b = swap_keys;
        int32_t *swap_ids = ids;
        ids = ids_b, ids_b = swap_ids;
    }
    if (keys != unique) memcpy(unique, keys, (size_t)count * sizeof(int64_t));
    for (int64_t j = 0; j < count; j++) {
        rank[ids[j]] = (int32_t)j;
        if (counts) counts[j] = uses[ids[j]];
    }
    for (int64_t k = 0; k < m; k++) inverse[k] = rank[first[k]];
    return count;
}

/* The forward's misses once their rows have slots: for each missed lookup k (at position positions[k], its
   distinct row inverse[k]), slots[positions[k]] = assigned[inverse[k]], and where that slot is not -1 the
   cached row (just filled) is copied into out[positions[k]] (rows served from storage are left to the
   caller). One pass instead of four indexed copies, the slot's row prefetched AHEAD lookups on. Everything
   is checked first (nothing written then): returns -1, or the index k of the first miss whose position
   is outside [0, n), whose row is outside [0, count) or whose slot is outside [-1, num_slots). */
ROW_LOOPS int64_t fill_misses(const int64_t *positions, const int64_t *inverse, int64_t m, const int64_t *assigned,
                              int64_t count, int64_t *slots, int64_t n, const float *weights, int64_t num_slots,
                              int64_t dim, float *out) {
    for (int64_t k = 0; k < m; k++) {
        if ((uint64_t)positions[k] >= (uint64_t)n || (uint64_t)inverse[k] >= (uint64_t)count) return k;
        int64_t slot = assigned[inverse[k]];
        if (slot < -1 || slot >= num_slots) return k;
    }
    size_t row_bytes = (size_t)dim * sizeof(float);
    for (int64_t k = 0; k < m; k++) {
        if (k + AHEAD < m) {
            int64_t later = assigned[inverse[k + AHEAD]];
            if (later >= 0) prefetch_span(weights + later * dim, row_bytes, 0);
        }
        int64_t slot = assigned[inverse[k]], at = positions[k];
        slots[at] = slot;
        if (slot < 0) continue;
        const float *src = weights + slot * dim;
        float *dst = out + at * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = src[d];
    }
    return -1;
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
    /* The set table, the victim orders and one set's keys: the calling thread's scratch, kept between calls. */
    size_t table_bytes = (size_t)capacity * sizeof(set_entry), key_bytes_all = (size_t)ways * sizeof(int64_t);
    char *memory = thread_scratch(SCRATCH_ASSIGN, table_bytes + key_bytes_all
                                                  + (size_t)(n > 0 ? n : 1) * (size_t)ways * sizeof(int32_t));
    if (!memory) return -1;
    set_entry *table = (set_entry *)memory;
    int64_t *keys = (int64_t *)(memory + table_bytes);
    int32_t *orders = (int32_t *)(memory + table_bytes + key_bytes_all);
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
    return victims;
}
