/* The stale-input filter's loops: classify and filter inputs by their rows' flag bytes, and count the
   updates of hot rows (the convergence rule). Every id is range-checked before anything is written. */
#include <stdint.h>
#include "pool.h"

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

/* The slot of `row` in a hot index of 2^bits slots (keys -1 = empty, linear probing), -1 when it is not
   there. A probe sequence stops at an empty slot, or after every slot (a full table cannot loop forever). */
static inline int64_t hot_slot(const int64_t *keys, int64_t bits, int64_t row) {
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    uint64_t slot = bits ? ((uint64_t)row * 0x9E3779B97F4A7C15ULL) >> (64 - bits) : 0;  /* 1 slot: no shift by 64 */
    for (uint64_t probes = 0; probes <= mask; probes++, slot = (slot + 1) & mask) {
        if (keys[slot] == row) return (int64_t)slot;
        if (keys[slot] == -1) return -1;
    }
    return -1;
}

/* counts[position] += delta for each hot lookup among ids[0..stop) (position: the hot index's value of its
   row). Returns the lookups counted, or -1 - i for the first lookup i whose position is outside
   [0, num_counts) (the lookups before it counted). */
static int64_t add_hot_updates(const int32_t *ids, int64_t stop, int64_t tables, const int64_t *offsets,
                               const uint8_t *flags, const int64_t *keys, const int32_t *values, int64_t bits,
                               int64_t *counts, int64_t num_counts, int64_t delta) {
    int64_t counted = 0;
    for (int64_t i = 0, t = 0; i < stop; i++, t = t + 1 == tables ? 0 : t + 1) {
        int64_t row = offsets[t] + ids[i];
        if (!flags[row]) continue;
        int64_t slot = hot_slot(keys, bits, row);
        if (slot < 0) continue;
        int64_t position = values[slot];
        if (position < 0 || position >= num_counts) return -1 - i;
        counts[position] += delta;
        counted++;
    }
    return counted;
}

/* Update counting of the convergence rule: for every lookup of a hot row (flag != 0), counts[position]++,
   the position found in the open-addressing hash of the hot rows (HotIndex: Fibonacci hash, linear probing,
   keys -1 = empty, 2^bits slots). Ids [n, tables] are checked against their tables first (rows then lie in
   [offsets[0], offsets[tables]), which the caller checks against flags). Returns the lookups counted, -2 - i
   for the first id i outside its table, or -1 when the index holds a position outside [0, num_counts): in
   both cases counts are left as they were. */
int64_t count_hot_updates(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                          const uint8_t *flags, const int64_t *keys, const int32_t *values, int64_t bits,
                          int64_t *counts, int64_t num_counts) {
    for (int64_t b = 0, i = 0; b < n; b++) {
        for (int64_t t = 0; t < tables; t++, i++) {
            if (ids[i] < 0 || ids[i] >= offsets[t + 1] - offsets[t]) return -2 - i;
        }
    }
    int64_t counted = add_hot_updates(ids, n * tables, tables, offsets, flags, keys, values, bits, counts,
                                      num_counts, 1);
    if (counted >= 0) return counted;
    add_hot_updates(ids, -1 - counted, tables, offsets, flags, keys, values, bits, counts, num_counts, -1);
    return -1;  /* the counts of the lookups before the bad one taken back */
}
