/* The backward's loops: the SGD scatter (plain and fused with the finite check), Adagrad per unique row,
   the finite check, multi-hot pooling. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "pool.h"

/* Whether all n floats are finite (no exponent of all ones: inf or NaN). */
ROW_LOOPS static int all_finite(const float *values, int64_t n) {
    const uint32_t *bits = (const uint32_t *)values;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;
    return bad == 0;
}

typedef struct {
    float *weights; int64_t dim; const int64_t *slots; const float *grad; int64_t n; float lr;
    int64_t slot_lo, slot_hi;  /* the slots this thread owns: updates of other slots are skipped */
    const int64_t *order;      /* when given: the n positions to update, in batch order (else 0..n-1) */
    int sum;                   /* 1: weights[s] += grad (a sum of rows), and the flag checks the gradient */
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
        if (a->sum) {  /* the gradient is checked as it is read: no pass of its own */
            for (int64_t d = 0; d < a->dim; d++) w[d] += g[d];
            nonfinite |= any_nonfinite(g, a->dim);
            continue;
        }
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
                     int64_t n, float lr, int sum) {
    int64_t parts = parts_for(n, UPDATE_GRAIN), nonfinite = 0;
    if (parts > num_slots) parts = num_slots > 1 ? num_slots : 1;
    /* The position lists live in the calling thread's scratch (no malloc per backward); without memory for
       them each part tests every lookup instead (the same updates). One part owns every slot: no list, the
       updates run in batch order straight away (no pass over the positions first). */
    int64_t *order = parts > 1 && n >= UPDATE_GRAIN
                         ? thread_scratch(SCRATCH_ORDER, (size_t)(parts * n) * sizeof(int64_t)) : 0;
    sgd_job job = {{weights, dim, slots, grad, n, lr, 0, num_slots, 0, sum}, num_slots, order, {0}};
    run_parts(sgd_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) nonfinite |= job.nonfinite[p];
    return nonfinite != 0;
}

/* all_finite over contiguous ranges, one per part. */
#define FINITE_GRAIN 65536 /* values per part at least */

static int64_t nonfinite_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    (void)part;
    return !all_finite((const float *)args + lo, hi - lo);
}

static int all_finite_split(const float *values, int64_t n) {
    return run_ranges(nonfinite_range, (void *)values, n, chunks_for(n, FINITE_GRAIN), NULL) == 0;
}

/* weights[slots[i]] -= lr * grad[i] in batch order per slot. Returns -1, -3 when an updated value is inf or
   NaN (an overflow: the caller clamps), or the index of the first slot outside [0, num_slots) (then nothing
   is written). */
int64_t sgd_update(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, const float *grad,
                   int64_t n, float lr) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) return i;
    }
    return sgd_split(weights, num_slots, dim, slots, grad, n, lr, 0) ? -3 : -1;
}

/* The gradient of each distinct row, and the finite check of the whole gradient, in one pass: summed[index[i]]
   += grad[i] in batch order per row (`summed` [num_rows, dim] zeroed by the caller: bit for bit torch's
   index_put_ with accumulate, and `sgd_update` with lr -1). Returns -1, -2 when a value of grad is inf or
   NaN (then `summed` holds partial sums: the caller drops the step), or the index of the first index
   outside [0, num_rows) (then nothing is written). */
int64_t sum_rows_finite(float *summed, int64_t num_rows, int64_t dim, const int64_t *index, const float *grad,
                        int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (index[i] < 0 || index[i] >= num_rows) return i;
    }
    return sgd_split(summed, num_rows, dim, index, grad, n, -1.0f, 1) ? -2 : -1;
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
    return sgd_split(weights, num_slots, dim, slots, grad, n, lr, 0) ? -3 : -1;
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

static int64_t adagrad_range(void *args, int64_t lo, int64_t hi, int64_t part) {
    (void)part;
    adagrad_args a = *(const adagrad_args *)args;
    if (a.slots) a.slots += lo;
    else a.weights += lo * a.dim;  /* target row i */
    a.state_rows += lo, a.grad += lo * a.dim, a.n = hi - lo;
    return adagrad_all(&a);
}

/* Whether index[0..n) (each value in [0, bound)) holds a value twice (1), or not (0); -1 without scratch
   memory. The values seen are marked in the calling thread's scratch: a bit per possible value where that
   takes no more memory than a hash set of them (no probing then), else the set (open addressing, Fibonacci
   hash, at most half full). Either way the scratch is batch-sized: at most 16 bytes per index. */
static int64_t repeats(const int64_t *index, int64_t n, int64_t bound) {
    if (n < 2) return 0;
    int64_t bits = 4;
    while (bits < 62 && ((int64_t)1 << bits) < 2 * n) bits++;
    uint64_t capacity = (uint64_t)1 << bits, mask = capacity - 1, words = ((uint64_t)bound + 63) / 64;
    if (words <= capacity) {
        uint64_t *marks = thread_scratch(SCRATCH_MARKS, words * sizeof(uint64_t));
        if (!marks) return -1;
        memset(marks, 0, words * sizeof(uint64_t));
        for (int64_t i = 0; i < n; i++) {
            uint64_t v = (uint64_t)index[i], bit = (uint64_t)1 << (v & 63);
            if (marks[v >> 6] & bit) return 1;
            marks[v >> 6] |= bit;
        }
        return 0;
    }
    int64_t *seen = thread_scratch(SCRATCH_MARKS, capacity * sizeof(int64_t));
    if (!seen) return -1;
    for (uint64_t k = 0; k < capacity; k++) seen[k] = -1;
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = ((uint64_t)index[i] * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        while (seen[h] >= 0 && seen[h] != index[i]) h = (h + 1) & mask;
        if (seen[h] == index[i]) return 1;
        seen[h] = index[i];
    }
    return 0;
}

/* The Adagrad or row-wise Adagrad step of n unique rows. Returns -1, -3 when an updated weight is inf or NaN
   (an overflow: the caller fits the rows to fp32's range, as after SGD), or (nothing written then) the index
   of the first target slot outside [0, num_slots) or state row outside [0, num_state_rows), -4 when a
   target slot repeats, -5 when a state row repeats (the parts would race on it, and a row's step would be
   taken twice: the caller sums a row's gradients first), -6 without memory for that check. */
int64_t adagrad_update(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, float *state,
                       int64_t num_state_rows, const int64_t *state_rows, const float *grad, int64_t n,
                       int rowwise, float lr, float eps) {
    for (int64_t i = 0; i < n; i++) {
        int64_t t = slots ? slots[i] : i;
        if (t < 0 || t >= num_slots || state_rows[i] < 0 || state_rows[i] >= num_state_rows) return i;
    }
    int64_t repeated = slots ? repeats(slots, n, num_slots) : 0;  /* without slots the targets are 0..n-1 */
    if (repeated) return repeated < 0 ? -6 : -4;
    if ((repeated = repeats(state_rows, n, num_state_rows))) return repeated < 0 ? -6 : -5;
    adagrad_args a = {weights, dim, slots, state, state_rows, grad, n, rowwise, lr, eps};
    return run_ranges(adagrad_range, &a, n, chunks_for(n, ADAGRAD_GRAIN), NULL) ? -3 : -1;
}

/* Whether all n floats are finite (exported: the general update's check). */
int64_t finite_values(const float *values, int64_t n) {
    return all_finite_split(values, n);
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
