/* The quantize and dequantize passes, and torch's CPU random stream (the stochastic rounding's noise). */
#include <math.h>
#include <stdint.h>
#include "pool.h"

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

static int64_t quantize_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    (void)part;
    quantize_args a = *(const quantize_args *)args;
    a.start = lo, a.stop = hi;
    quantize_all(&a);
    return a.bad_count;
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
    quantize_args a = {values, n, dim, kind, noise, scales, limit, max_span, rows, payload, bias, scale_code, bad,
                       0, n, 0, source};
    return run_ranges(quantize_range, &a, n, chunks_for(n, QUANTIZE_GRAIN), NULL);
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
    const int64_t *rows; int64_t dim; float *out;
} dequantize_args;

static int64_t dequantize_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    (void)part;
    const dequantize_args *j = args;
    return dequantize_span(j->payload, j->kind, j->bias, j->scale_code, j->scales, j->rows + lo, hi - lo, j->dim,
                           j->out + lo * j->dim);
}

int64_t dequantize_rows(const void *payload, int kind, const uint16_t *bias, const uint8_t *scale_code,
                        const float *scales, const int64_t *rows, int64_t n, int64_t dim, float *out) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    dequantize_args a = {payload, kind, bias, scale_code, scales, rows, dim, out};
    int64_t parts = chunks_for(n, DEQUANTIZE_GRAIN), status[POOL_MAX];
    run_ranges(dequantize_range, &a, n, parts, status);
    for (int64_t p = 0; p < parts; p++) {
        if (status[p] != 0) return status[p];
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
