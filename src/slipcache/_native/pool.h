/* What the compiled loops share: the worker pool's interface (pool.c), per-thread scratch memory and the
   row loops' helpers. Each .c file includes this header and compiles on its own; build.py compiles them
   into one library, with this header's text in its cache key. Functions shared between the files are
   hidden: the library exports only the loops the Python wrappers declare. */
#ifndef SLIPCACHE_POOL_H
#define SLIPCACHE_POOL_H

#include <stddef.h>
#include <stdint.h>

#define SLIPCACHE_INTERNAL __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------ the worker pool (pool.c) */
typedef void (*part_fn)(void *args, int64_t part, int64_t parts);

#define POOL_MAX 256 /* threads per job at most; a job has at most this many parts */

/* fn(args, p, parts) for p in [0, parts), on the pool when it is free, else all on the calling thread. */
SLIPCACHE_INTERNAL void run_parts(part_fn fn, void *args, int64_t parts);
/* Parts for n items of which each part should get at least `grain`: at most the pool's threads. */
SLIPCACHE_INTERNAL int64_t parts_for(int64_t n, int64_t grain);
/* Parts for a split by position, where more parts cost nothing: up to a few per thread. */
SLIPCACHE_INTERNAL int64_t chunks_for(int64_t n, int64_t grain);

/* [lo, hi) of part p of n items split into `parts` contiguous ranges. */
static inline void part_range(int64_t n, int64_t p, int64_t parts, int64_t *lo, int64_t *hi) {
    *lo = (int64_t)((__int128)n * p / parts);
    *hi = (int64_t)((__int128)n * (p + 1) / parts);
}

/* A split by position: part p handles items [lo, hi) and returns what it found (hits, bad rows, a flag). */
typedef int64_t (*range_fn)(void *args, int64_t lo, int64_t hi, int64_t part);
/* n items split into `parts` (at most POOL_MAX) contiguous ranges, run with run_parts: the sum of what the
   parts return; results (NULL, or room for `parts`) gets each part's own answer, in part order. */
SLIPCACHE_INTERNAL int64_t run_ranges(range_fn fn, void *args, int64_t n, int64_t parts, int64_t *results);

/* ------------------------------------------------------------------ per-thread scratch (pool.c)
   A buffer per kind and per calling thread, kept between calls and grown on demand (zeroed when it grows),
   instead of a malloc per call; freed when its thread exits. NULL when the memory cannot be had. Each kind
   has one user at a time on a thread (the loops do not nest). */
enum { SCRATCH_ORDER, SCRATCH_MARKS, SCRATCH_UNIQUE, SCRATCH_ASSIGN, SCRATCH_COUNTS, SCRATCH_KINDS };
SLIPCACHE_INTERNAL void *thread_scratch(int kind, size_t bytes);

/* ------------------------------------------------------------------ the row loops' helpers
   Row loops (copy, update, finite check) get an AVX2 clone picked at load time on CPUs that have it, the
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

/* ------------------------------------------------------------------ hand-vectorized row kernels (simd.c)
   Chosen at run time: the best level the CPU supports, lowered by SLIPCACHE_NATIVE_SIMD or
   slipcache_set_simd; each has a plain loop, the reference the tests compare with bit for bit. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(SLIPCACHE_NO_CLONES)
#define SLIPCACHE_X86_SIMD 1
#else
#define SLIPCACHE_X86_SIMD 0
#endif
enum { SIMD_SCALAR = 0, SIMD_AVX2 = 1, SIMD_AVX512 = 2 };
SLIPCACHE_INTERNAL int simd_level(void);

/* torch's CPU generator (mt19937): its 624 words, draws left until the next twist, the next word. */
#define MT_N 624
#define MT_M 397
typedef struct { uint32_t mt[MT_N]; int32_t left; uint64_t next; } mt_stream;
/* From / into a CPU Generator's saved state (get_state(): seed u64, left i32, seeded i32, next u64, the
   624 words as u64, ...); mt_load returns -1 for a state it cannot read. */
SLIPCACHE_INTERNAL int mt_load(mt_stream *g, const uint8_t *state);
SLIPCACHE_INTERNAL void mt_store(const mt_stream *g, uint8_t *state);
/* The next n values of torch.rand from the stream. */
SLIPCACHE_INTERNAL void mt_uniform(mt_stream *g, float *out, int64_t n);
/* m values of a row to int8 codes (int4 = 0) or packed int4 codes: floor((x - bias) / scale + u) with
   noise u, else round-half-even, clamped to [0, top]. */
SLIPCACHE_INTERNAL void quantize_codes(const float *x, const float *u, int64_t m, float bias, float scale, float top,
                                       int int4, uint8_t *out);
/* A row of dim int8 (or packed int4) codes to bias + scale * code. */
SLIPCACHE_INTERNAL void dequantize_codes(const uint8_t *x, int64_t dim, float bias, float scale, int int4, float *out);

#define AHEAD 16 /* software pipelines: a later item's memory is fetched this many items ahead */

/* Prefetch the `bytes` at p (each cache line), for reading or (write = 1) writing. */
static inline void prefetch_span(const void *p, size_t bytes, int write) {
    for (size_t k = 0; k < bytes; k += 64) {
        if (write) __builtin_prefetch((const char *)p + k, 1);
        else __builtin_prefetch((const char *)p + k, 0);
    }
}

#endif
