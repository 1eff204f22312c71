/* Hand-vectorized row kernels, chosen at run time by what the CPU offers: the stochastic rounding's random
   stream (torch's mt19937, twisted and tempered 8 or 16 words at a time), the int8/int4 quantize of a row's
   values into codes, and the decode of a row's codes. Each has a plain C loop beside it: the reference the
   vector versions are tested against bit for bit (tests/native/test_quantize.py forces each level in turn).
   The vector versions do the same IEEE operations in the same order per value (a subtraction, a division,
   an addition, a floor; a multiplication and an addition; no fused multiply-add), so bit-identical results
   follow from the arithmetic, and the tests check them.

   The level: the best the CPU supports (AVX-512F, then AVX2, else the plain loops), lowered by
   SLIPCACHE_NATIVE_SIMD=scalar|avx2 in the environment or slipcache_set_simd(level). Functions carry gcc
   target attributes, so the library itself is built for the baseline and loads on any x86-64; elsewhere
   (and with SLIPCACHE_NO_CLONES) only the plain loops are compiled. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "pool.h"

#if SLIPCACHE_X86_SIMD
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ the level */
static int simd_chosen = -1;  /* atomic: -1 until first use */

static int simd_supported(void) {
#if SLIPCACHE_X86_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2")) return SIMD_AVX512;
    if (__builtin_cpu_supports("avx2")) return SIMD_AVX2;
#endif
    return SIMD_SCALAR;
}

static int simd_default(void) {
    int level = simd_supported();
    const char *wanted = getenv("SLIPCACHE_NATIVE_SIMD");
    if (wanted && (!strcmp(wanted, "scalar") || !strcmp(wanted, "0"))) level = SIMD_SCALAR;
    else if (wanted && !strcmp(wanted, "avx2") && level > SIMD_AVX2) level = SIMD_AVX2;
    return level;
}

int simd_level(void) {
    int level = __atomic_load_n(&simd_chosen, __ATOMIC_RELAXED);
    if (level < 0) {
        level = simd_default();
        __atomic_store_n(&simd_chosen, level, __ATOMIC_RELAXED);
    }
    return level;
}

/* The kernels' level from now on: 0 the plain loops, 1 AVX2, 2 AVX-512 (lowered to what the CPU supports),
   -1 the default (the environment's choice, else the best). Returns the level set. */
int64_t slipcache_set_simd(int64_t level) {
    int set = level < 0 ? simd_default() : (int)(level < simd_supported() ? level : simd_supported());
    __atomic_store_n(&simd_chosen, set, __ATOMIC_RELAXED);
    return set;
}

/* The kernels' level now (0 plain, 1 AVX2, 2 AVX-512). */
int64_t slipcache_simd(void) { return simd_level(); }

/* ------------------------------------------------------------------ torch's mt19937 stream
   torch.rand on CPU: 32 bits per value from the generator, in order, the value (bits & 0xffffff) * 2^-24.
   `left` counts the draws until the next twist as torch keeps it: a draw with left == 1 twists the 624
   words first (then left = 624 after it), any other draw takes left -= 1; `next` is the word drawn next. */
static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

static inline uint32_t mt_temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

static void twist_plain(uint32_t *mt) {
    int k = 0;
    for (; k < MT_N - MT_M; k++) mt[k] = mt[k + MT_M] ^ mt_twist(mt[k], mt[k + 1]);
    for (; k < MT_N - 1; k++) mt[k] = mt[k + MT_M - MT_N] ^ mt_twist(mt[k], mt[k + 1]);
    mt[MT_N - 1] = mt[MT_M - 1] ^ mt_twist(mt[MT_N - 1], mt[0]);
}

static void temper_plain(const uint32_t *mt, float *out, int64_t n) {
    for (int64_t j = 0; j < n; j++) out[j] = (float)(mt_temper(mt[j]) & 0xffffffu) * 5.9604644775390625e-8f;
}

#if SLIPCACHE_X86_SIMD
/* The twist W words at a time: word k takes words k, k + 1 (not yet twisted) and k + 397 (not yet, below
   227) or k - 227 (already twisted, at least W words back), so W consecutive words are independent. */
#define DEFINE_MT(NAME, TARGET, W)                                                                     \
    typedef uint32_t NAME##_u __attribute__((vector_size(4 * W)));                                     \
    typedef int32_t NAME##_i __attribute__((vector_size(4 * W)));                                      \
    typedef float NAME##_f __attribute__((vector_size(4 * W)));                                        \
    TARGET static inline NAME##_u NAME##_mix(NAME##_u u, NAME##_u v, NAME##_u far) {                   \
        NAME##_u y = (u & 0x80000000u) | (v & 0x7fffffffu);                                            \
        return far ^ (y >> 1) ^ ((NAME##_u)(-(v & 1u)) & 0x9908b0dfu);                                 \
    }                                                                                                  \
    TARGET static void NAME##_twist(uint32_t *mt) {                                                    \
        NAME##_u u, v, far;                                                                            \
        int k = 0;                                                                                     \
        for (; k + W <= MT_N - MT_M; k += W) {                                                         \
            memcpy(&u, mt + k, sizeof u), memcpy(&v, mt + k + 1, sizeof v);                            \
            memcpy(&far, mt + k + MT_M, sizeof far);                                                   \
            u = NAME##_mix(u, v, far);                                                                 \
            memcpy(mt + k, &u, sizeof u);                                                              \
        }                                                                                              \
        for (; k < MT_N - MT_M; k++) mt[k] = mt[k + MT_M] ^ mt_twist(mt[k], mt[k + 1]);                \
        for (; k + W <= MT_N - 1; k += W) {                                                            \
            memcpy(&u, mt + k, sizeof u), memcpy(&v, mt + k + 1, sizeof v);                            \
            memcpy(&far, mt + k + MT_M - MT_N, sizeof far);                                            \
            u = NAME##_mix(u, v, far);                                                                 \
            memcpy(mt + k, &u, sizeof u);                                                              \
        }                                                                                              \
        for (; k < MT_N - 1; k++) mt[k] = mt[k + MT_M - MT_N] ^ mt_twist(mt[k], mt[k + 1]);            \
        mt[MT_N - 1] = mt[MT_M - 1] ^ mt_twist(mt[MT_N - 1], mt[0]);                                   \
    }                                                                                                  \
    TARGET static void NAME##_temper(const uint32_t *mt, float *out, int64_t n) {                      \
        int64_t j = 0;                                                                                 \
        for (; j + W <= n; j += W) {                                                                   \
            NAME##_u y;                                                                                \
            memcpy(&y, mt + j, sizeof y);                                                              \
            y ^= y >> 11;                                                                              \
            y ^= (y << 7) & 0x9d2c5680u;                                                               \
            y ^= (y << 15) & 0xefc60000u;                                                              \
            y ^= y >> 18;                                                                              \
            NAME##_f f = __builtin_convertvector((NAME##_i)(y & 0xffffffu), NAME##_f);                 \
            f *= 5.9604644775390625e-8f;                                                               \
            memcpy(out + j, &f, sizeof f);                                                             \
        }                                                                                              \
        temper_plain(mt + j, out + j, n - j);                                                          \
    }
DEFINE_MT(mt8, __attribute__((target("avx2"))), 8)
DEFINE_MT(mt16, __attribute__((target("avx512f,avx2"))), 16)
#endif

int mt_load(mt_stream *g, const uint8_t *state) {
    uint64_t words[MT_N];
    memcpy(&g->left, state + 8, sizeof g->left);
    memcpy(&g->next, state + 16, sizeof g->next);
    memcpy(words, state + 24, sizeof words);
    if (g->left < 1 || g->left > MT_N || g->next > MT_N) return -1;
    /* torch keeps next + left = 625 between twists (left 1 after seeding: the next draw twists); a state
       beyond that would read past the 624 words */
    if (g->left > 1 && g->next + (uint64_t)g->left > MT_N + 1) return -1;
    for (int k = 0; k < MT_N; k++) g->mt[k] = (uint32_t)words[k];
    return 0;
}

void mt_store(const mt_stream *g, uint8_t *state) {
    uint64_t words[MT_N];
    for (int k = 0; k < MT_N; k++) words[k] = g->mt[k];
    memcpy(state + 8, &g->left, sizeof g->left);
    memcpy(state + 16, &g->next, sizeof g->next);
    memcpy(state + 24, words, sizeof words);
}

/* The next n values of the stream into out, as n torch.rand draws would give them. */
void mt_uniform(mt_stream *g, float *out, int64_t n) {
    void (*twist)(uint32_t *) = twist_plain;
    void (*temper)(const uint32_t *, float *, int64_t) = temper_plain;
#if SLIPCACHE_X86_SIMD
    int level = simd_level();
    if (level == SIMD_AVX512) twist = mt16_twist, temper = mt16_temper;
    else if (level == SIMD_AVX2) twist = mt8_twist, temper = mt8_temper;
#endif
    int64_t left = g->left, next = (int64_t)g->next;
    while (n > 0) {
        if (left == 1) {  /* the next draw twists first; it then leaves left at 624 */
            twist(g->mt);
            left = MT_N + 1, next = 0;
        }
        int64_t take = left - 1 < n ? left - 1 : n;
        temper(g->mt + next, out, take);
        out += take, n -= take, next += take, left -= take;
    }
    g->left = (int32_t)left, g->next = (uint64_t)next;
}

/* ------------------------------------------------------------------ int8/int4 codes of a row
   codes = floor((x - bias) / scale + u) with noise u, or round-half-even without it, clamped to [0, top];
   int4 packs two per byte, low nibble first (the last byte's high nibble 0 for an odd count). */
static void quantize_plain(const float *x, const float *u, int64_t m, float bias, float scale, float top, int int4,
                           uint8_t *out) {
    for (int64_t j = 0; j < m; j++) {
        float s = u ? floorf((x[j] - bias) / scale + u[j]) : rintf((x[j] - bias) / scale);
        uint8_t code = (uint8_t)(s < 0.0f ? 0.0f : (s > top ? top : s));
        if (!int4) out[j] = code;
        else if (j & 1) out[j / 2] |= (uint8_t)(code << 4);
        else out[j / 2] = code;
    }
}

#if SLIPCACHE_X86_SIMD
/* 8 values at a time; the rest (fewer than 8) by the plain loop. Returns how many it did. */
__attribute__((target("avx2"))) static int64_t quantize_avx2(const float *x, const float *u, int64_t m,
                                                             float bias, float scale, float top, int int4,
                                                             uint8_t *out) {
    const __m256 b = _mm256_set1_ps(bias), s = _mm256_set1_ps(scale), t = _mm256_set1_ps(top);
    const __m256 zero = _mm256_setzero_ps();
    /* int8: byte 0 of each 32-bit code to the front of its 128-bit half; int4: bytes 0 and 8 (the pairs). */
    const __m256i bytes8 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i bytes4 = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), b), s);
        if (u) v = _mm256_floor_ps(_mm256_add_ps(v, _mm256_loadu_ps(u + j)));
        else v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i c = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(v, zero), t));
        if (!int4) {
            __m256i p = _mm256_shuffle_epi8(c, bytes8);
            uint32_t lo = (uint32_t)_mm256_extract_epi32(p, 0), hi = (uint32_t)_mm256_extract_epi32(p, 4);
            memcpy(out + j, &lo, 4), memcpy(out + j + 4, &hi, 4);
        } else {  /* each 64-bit lane: its low code | its high code << 4 in the low byte */
            __m256i p = _mm256_shuffle_epi8(_mm256_or_si256(c, _mm256_srli_epi64(c, 28)), bytes4);
            uint16_t lo = (uint16_t)_mm256_extract_epi16(p, 0), hi = (uint16_t)_mm256_extract_epi16(p, 8);
            memcpy(out + j / 2, &lo, 2), memcpy(out + j / 2 + 2, &hi, 2);
        }
    }
    return j;
}

/* 16 values at a time, then 8 (AVX2); the rest by the plain loop. Returns how many it did. */
__attribute__((target("avx512f,avx2"))) static int64_t quantize_avx512(const float *x, const float *u, int64_t m,
                                                                       float bias, float scale, float top,
                                                                       int int4, uint8_t *out) {
    const __m512 b = _mm512_set1_ps(bias), s = _mm512_set1_ps(scale), t = _mm512_set1_ps(top);
    const __m512 zero = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= m; j += 16) {
        __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), b), s);
        if (u) v = _mm512_roundscale_ps(_mm512_add_ps(v, _mm512_loadu_ps(u + j)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        else v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i c = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(v, zero), t));
        if (!int4) {
            _mm_storeu_si128((__m128i *)(out + j), _mm512_cvtepi32_epi8(c));
        } else {
            __m128i p = _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28)));
            _mm_storel_epi64((__m128i *)(out + j / 2), p);
        }
    }
    if (j + 8 <= m) j += quantize_avx2(x + j, u ? u + j : 0, 8, bias, scale, top, int4, out + (int4 ? j / 2 : j));
    return j;
}
#endif

void quantize_codes(const float *x, const float *u, int64_t m, float bias, float scale, float top, int int4,
                    uint8_t *out) {
    int64_t done = 0;
#if SLIPCACHE_X86_SIMD
    int level = simd_level();
    if (level == SIMD_AVX512) done = quantize_avx512(x, u, m, bias, scale, top, int4, out);
    else if (level == SIMD_AVX2) done = quantize_avx2(x, u, m, bias, scale, top, int4, out);
#endif
    quantize_plain(x + done, u ? u + done : 0, m - done, bias, scale, top, int4, out + (int4 ? done / 2 : done));
}

/* ------------------------------------------------------------------ a row's codes decoded
   out[j] = bias + scale * code[j], each rounded to fp32 (the multiplication first, no contraction). */
static void dequantize_plain(const uint8_t *x, int64_t from, int64_t dim, float b, float scale, int int4,
                             float *out) {
    for (int64_t j = from; j < dim; j++) {
        unsigned code = int4 ? (j & 1 ? x[j / 2] >> 4 : x[j / 2] & 15u) : x[j];
        out[j] = b + scale * (float)code;
    }
}

#if SLIPCACHE_X86_SIMD
__attribute__((target("avx2"))) static int64_t dequantize_avx2(const uint8_t *x, int64_t dim, float b, float scale,
                                                               int int4, float *out) {
    const __m256 vb = _mm256_set1_ps(b), vs = _mm256_set1_ps(scale);
    const __m128i low = _mm_set1_epi8(15);
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8) {
        __m128i codes;
        if (!int4) {
            codes = _mm_loadl_epi64((const __m128i *)(x + j));
        } else {  /* 4 bytes -> 8 codes: low nibble, high nibble, next byte ... */
            int32_t four;
            memcpy(&four, x + j / 2, sizeof four);
            __m128i packed = _mm_cvtsi32_si128(four);
            codes = _mm_unpacklo_epi8(_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low));
        }
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
        _mm256_storeu_ps(out + j, _mm256_add_ps(vb, _mm256_mul_ps(vs, f)));
    }
    return j;
}

__attribute__((target("avx512f,avx2"))) static int64_t dequantize_avx512(const uint8_t *x, int64_t dim, float b,
                                                                         float scale, int int4, float *out) {
    const __m512 vb = _mm512_set1_ps(b), vs = _mm512_set1_ps(scale);
    const __m128i low = _mm_set1_epi8(15);
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16) {
        __m128i codes;
        if (!int4) {
            codes = _mm_loadu_si128((const __m128i *)(x + j));
        } else {
            __m128i packed = _mm_loadl_epi64((const __m128i *)(x + j / 2));
            codes = _mm_unpacklo_epi8(_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low));
        }
        __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
        _mm512_storeu_ps(out + j, _mm512_add_ps(vb, _mm512_mul_ps(vs, f)));
    }
    if (j + 8 <= dim) j += dequantize_avx2(x + (int4 ? j / 2 : j), 8, b, scale, int4, out + j);
    return j;
}
#endif

void dequantize_codes(const uint8_t *x, int64_t dim, float b, float scale, int int4, float *out) {
    int64_t done = 0;
#if SLIPCACHE_X86_SIMD
    int level = simd_level();
    if (level == SIMD_AVX512) done = dequantize_avx512(x, dim, b, scale, int4, out);
    else if (level == SIMD_AVX2) done = dequantize_avx2(x, dim, b, scale, int4, out);
#endif
    dequantize_plain(x, done, dim, b, scale, int4, out);
}
