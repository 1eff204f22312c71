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

/* The smallest code whose scale covers `needed` (255 when none does): scales ascend, and code 192 + 8e
   decodes to 2^e exactly, so for needed in [2^e, 2^(e+1)) every code below 192 + 8e is too small and
   192 + 8e + 8 is large enough: the answer is 192 + 8e plus how many of the 8 codes from there fall short.
   Eight independent compares instead of a binary search's eight unpredictable branches. */
static inline uint8_t scale_code_for(float needed, const float *scales) {
    if (needed < 1.17549435e-38f) needed = 1.17549435e-38f;  /* quant: needed.clamp_min(tiny) */
    int first = 192 + 8 * ((int)((float_bits(needed) >> 23) & 0xffu) - 127);
    if (first >= 255) return 255;  /* needed >= 256: beyond the top of the grid */
    if (first < 0) first = 0;      /* below the grid's 2^-24: none of the first 8 falls short */
    int code = first;
    for (int k = 0; k < 8; k++) code += first + k < 255 && scales[first + k] < needed;
    return (uint8_t)code;
}

#define QUANTIZE_BLOCK 256  /* even: int4 blocks pack whole bytes; the noise drawn in the pass a block at a time */

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
    mt_stream *stream;  /* noise drawn here, row by row, instead of read from `noise` */
} quantize_args;

ROW_LOOPS static void quantize_all(quantize_args *a) {
    const int64_t dim = a->dim;
    const int64_t width = a->kind == Q_INT4 ? (dim + 1) / 2 : dim;
    const int levels = a->kind == Q_INT8 ? 255 : 15;
    const size_t payload_bytes = (size_t)(a->kind == Q_FP32 ? dim * 4 : a->kind >= Q_FP16 ? dim * 2 : width);
    float drawn[QUANTIZE_BLOCK];
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
        if (!fits) {  /* the row's draws are taken all the same: the stream stays where torch's would be */
            a->bad_count++;
            for (int64_t j0 = 0; a->stream && j0 < dim; j0 += QUANTIZE_BLOCK)
                mt_uniform(a->stream, drawn, dim - j0 < QUANTIZE_BLOCK ? dim - j0 : QUANTIZE_BLOCK);
            continue;
        }
        int64_t r = a->rows ? a->rows[i] : i;
        if (a->kind == Q_FP32) {
            float *out = (float *)a->payload + r * dim;
            for (int64_t j = 0; j < dim; j++) out[j] = x[j];
            continue;
        }
        uint16_t bias = 0;
        float biasf = 0.0f, scale = 0.0f, top = (float)levels;
        if (a->kind == Q_INT8 || a->kind == Q_INT4) {
            bias = half_round_down(lo);
            biasf = half_to_float(bias);
            uint8_t code = scale_code_for((hi - biasf) / (float)levels, a->scales);
            scale = a->scales[code];
            a->bias[r] = bias;
            a->scale_code[r] = code;
        }
        for (int64_t j0 = 0; j0 < dim; j0 += QUANTIZE_BLOCK) {  /* blocks: the drawn noise stays in L1 */
            int64_t m = dim - j0 < QUANTIZE_BLOCK ? dim - j0 : QUANTIZE_BLOCK;
            const float *ub = u ? u + j0 : 0;
            if (a->stream) {
                mt_uniform(a->stream, drawn, m);
                ub = drawn;
            }
            if (a->kind == Q_FP16 || a->kind == Q_BF16) {
                uint16_t *out = (uint16_t *)a->payload + r * dim + j0;
                for (int64_t j = 0; j < m; j++) out[j] = round16(x[j0 + j], ub ? ub + j : 0, a->kind == Q_BF16);
            } else {
                uint8_t *out = (uint8_t *)a->payload + r * width + (a->kind == Q_INT4 ? j0 / 2 : j0);
                quantize_codes(x + j0, ub, m, biasf, scale, top, a->kind == Q_INT4, out);
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
   slots, without a gathered copy). With `stream_state` (a CPU Generator's saved state, and `noise` NULL),
   the noise is drawn in the pass from that stream (the values torch.rand of [n, dim] would give, in the
   same order, the state advanced past them), on the calling thread alone: one stream is drawn in order.
   Rows are checked first (rows[i] in [0, num_rows), source[i] in [0, num_values)), in one pass.
   Returns the rows not written, -1 for a kind or dim it cannot store, -2 for a state it cannot read, -3 for a
   row and -4 for a source row out of range (nothing written then). */
int64_t quantize_rows(const float *values, int64_t n, int64_t dim, int kind, const float *noise,
                      const float *scales, float limit, float max_span, const int64_t *rows, void *payload,
                      uint16_t *bias, uint8_t *scale_code, uint8_t *bad, const int64_t *source,
                      uint8_t *stream_state, int64_t num_rows, int64_t num_values) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (rows && (uint64_t)rows[i] >= (uint64_t)num_rows) return -3;
        if (source && (uint64_t)source[i] >= (uint64_t)num_values) return -4;
    }
    quantize_args a = {values, n, dim, kind, noise, scales, limit, max_span, rows, payload, bias, scale_code, bad,
                       0, n, 0, source, 0};
    if (stream_state && !noise) {
        mt_stream stream;
        if (mt_load(&stream, stream_state) != 0) return -2;
        a.stream = &stream;
        quantize_all(&a);
        mt_store(&stream, stream_state);
        return a.bad_count;
    }
    return run_ranges(quantize_range, &a, n, chunks_for(n, QUANTIZE_GRAIN), NULL);
}

/* Storage rows -> fp32: out[i] (out[out_rows[i]] when out_rows is given) = row rows[i] decoded, as
   quant.dequantize_int does (bias + scale * code, each rounded to fp32, no contraction: bit-identical) or the
   float kinds' exact widening. One pass with the rows' payload and parameters prefetched AHEAD rows on
   (misses are scattered over the whole table), and the target row too when it is scattered (a cache slot). */
ROW_LOOPS static int64_t dequantize_span(const void *payload, int kind, const uint16_t *bias,
                                         const uint8_t *scale_code, const float *scales, const int64_t *rows,
                                         int64_t n, int64_t dim, float *out, const int64_t *out_rows) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    const int64_t width = kind == Q_INT4 ? (dim + 1) / 2 : dim;
    const size_t row_bytes = (size_t)(kind == Q_FP32 ? dim * 4 : kind >= Q_FP16 ? dim * 2 : width);
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t later = rows[i + AHEAD];
            prefetch_span((const char *)payload + later * (int64_t)row_bytes, row_bytes, 0);
            if (bias) __builtin_prefetch(bias + later, 0);
            if (scale_code) __builtin_prefetch(scale_code + later, 0);
            if (out_rows) prefetch_span(out + out_rows[i + AHEAD] * dim, (size_t)dim * sizeof(float), 1);
        }
        int64_t r = rows[i];
        float *o = out + (out_rows ? out_rows[i] : i) * dim;
        if (kind == Q_FP32) {
            const float *x = (const float *)payload + r * dim;
            for (int64_t j = 0; j < dim; j++) o[j] = x[j];
        } else if (kind == Q_FP16 || kind == Q_BF16) {
            const uint16_t *x = (const uint16_t *)payload + r * dim;
            for (int64_t j = 0; j < dim; j++) o[j] = kind == Q_FP16 ? half_to_float(x[j]) : bf16_to_float(x[j]);
        } else {
            float b = half_to_float(bias[r]), scale = scales[scale_code[r]];
            dequantize_codes((const uint8_t *)payload + r * width, dim, b, scale, kind == Q_INT4, o);
        }
    }
    return 0;
}

/* Split by position: part p decodes its range of the rows into its rows of `out` (reads only, elsewhere;
   distinct out_rows: parts write disjoint rows). */
#define DEQUANTIZE_GRAIN 512 /* rows per part at least */

typedef struct {
    const void *payload; int kind; const uint16_t *bias; const uint8_t *scale_code; const float *scales;
    const int64_t *rows; int64_t dim; float *out; const int64_t *out_rows;
} dequantize_args;

static int64_t dequantize_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    (void)part;
    const dequantize_args *j = args;
    return dequantize_span(j->payload, j->kind, j->bias, j->scale_code, j->scales, j->rows + lo, hi - lo, j->dim,
                           j->out_rows ? j->out : j->out + lo * j->dim, j->out_rows ? j->out_rows + lo : 0);
}

/* Decode storage rows[0..n) (each in [0, num_rows)) into out [n, dim], or, with out_rows (distinct, each in
   [0, out_count)), into row out_rows[i] of out [out_count, dim] (e.g. straight into the cache slots the rows
   were given). Returns 0, -1 for a kind or dim it cannot decode, -2 for a row out of range, -3 for an out
   row out of range (nothing written then). */
int64_t dequantize_rows(const void *payload, int kind, const uint16_t *bias, const uint8_t *scale_code,
                        const float *scales, const int64_t *rows, int64_t n, int64_t dim, float *out,
                        int64_t num_rows, const int64_t *out_rows, int64_t out_count) {
    if (dim < 1 || kind < Q_INT8 || kind > Q_FP32) return -1;
    for (int64_t i = 0; i < n; i++) {  /* the checks in one pass, without a branch per row */
        if ((uint64_t)rows[i] >= (uint64_t)num_rows) return -2;
        if (out_rows && (uint64_t)out_rows[i] >= (uint64_t)out_count) return -3;
    }
    dequantize_args a = {payload, kind, bias, scale_code, scales, rows, dim, out, out_rows};
    int64_t parts = chunks_for(n, DEQUANTIZE_GRAIN), status[POOL_MAX];
    run_ranges(dequantize_range, &a, n, parts, status);
    for (int64_t p = 0; p < parts; p++) {
        if (status[p] != 0) return status[p];
    }
    return 0;
}

/* ------------------------------------------------------------------ torch's CPU random stream
   torch.rand(..., generator=g) on CPU: n values of g's mt19937 stream (simd.c: mt_uniform). `state` is the
   generator's saved state (Generator.get_state()), advanced in place so that set_state continues the
   stream exactly where torch would. The loader checks the draws against torch.rand before using them.
   Returns 0, or -1 for a state it cannot read. */
int64_t torch_uniform(uint8_t *state, float *out, int64_t n) {
    mt_stream stream;
    if (mt_load(&stream, state) != 0) return -1;
    mt_uniform(&stream, out, n);
    mt_store(&stream, state);
    return 0;
}
