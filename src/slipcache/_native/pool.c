/* The worker pool of the compiled loops (its interface: pool.h), and their per-thread scratch memory.

   Started once, on the first job that wants more than one thread, with slipcache_set_threads(n) - 1 workers
   (the calling thread works on every job too); no thread is started per call. A job is a function of
   (args, part, parts): the caller publishes it by bumping `generation` (the part count in its low bits),
   workers spin briefly on that word and then sleep on a condition variable. Parts are claimed, not
   assigned: the caller and every worker that is awake take the next unclaimed part (`claim`, tagged with the
   job's number so a late worker cannot take a part of a later job) until none is left, and the caller then
   waits (spinning briefly, then sleeping) only for parts that others took. On a busy machine a descheduled
   worker therefore costs nothing: the caller runs the parts it never took.

   One job at a time: a thread that finds the pool busy (another Python thread inside a loop: ctypes releases
   the GIL) runs every part of its job itself, in part order. The parts write disjoint memory, so the result
   is the same either way. fork: the child has no workers; the atfork handlers hold the job lock across the
   fork (no job in flight) and the child starts afresh, building its own workers on its first job (DataLoader
   workers and torchrun fork). Exit: a destructor stops and joins idle workers.

   Scratch: a loop that needs a buffer per call takes its calling thread's (thread_scratch), kept between
   calls and grown when a larger one is needed, so a backward does not malloc; a thread's buffers are freed
   when it exits, and slipcache_scratch_bytes() says what every thread holds. */
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "pool.h"

#define PARTS_BITS 16 /* generation = (job << PARTS_BITS) | parts; claim = (job << PARTS_BITS) | next part */
#define PARTS_MASK ((UINT64_C(1) << PARTS_BITS) - 1)
#define SPIN_NS 100000 /* polling before sleeping, in ns: catches the next loop of the same step, yet costs a
                          busy machine little (a pause instruction takes 1 to 150 cycles by CPU: timed, not counted) */

static struct {
    pthread_mutex_t job_lock;   /* one job at a time; held across fork */
    pthread_mutex_t lock;       /* guards sleeping and waking */
    pthread_cond_t wake, done;
    pthread_t threads[POOL_MAX];
    int started;                /* workers running (parts 1..started) */
    int wanted;                 /* slipcache_set_threads: threads per job, the caller included */
    int stop;
    uint64_t generation;        /* atomic */
    uint64_t born;              /* the generation when the workers were started: their first job is the next */
    uint64_t claim;             /* atomic: the current job's number and its next unclaimed part */
    int64_t finished;           /* atomic: parts of the current job done */
    int sleepers;               /* atomic: workers asleep or about to be */
    part_fn fn;                 /* atomic (relaxed): read by workers that may be late */
    void *args;
} pool = {.job_lock = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER, .wanted = 1};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Run parts of the job published as `generation` until none is left unclaimed: returns the parts run. A part
   is claimed only while `claim` still carries this job's number, so the job's fields are still valid. */
static int64_t pool_claim_parts(uint64_t generation) {
    uint64_t job = generation >> PARTS_BITS, parts = generation & PARTS_MASK;
    int64_t ran = 0;
    uint64_t claim = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
    while ((claim >> PARTS_BITS) == job && (claim & PARTS_MASK) < parts) {
        if (!__atomic_compare_exchange_n(&pool.claim, &claim, claim + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;  /* another thread took it (claim reloaded) */
        /* Read after the claim: the job cannot end, nor its fields change, before this part is finished. */
        part_fn fn = __atomic_load_n(&pool.fn, __ATOMIC_RELAXED);
        void *args = __atomic_load_n(&pool.args, __ATOMIC_RELAXED);
        fn(args, (int64_t)(claim & PARTS_MASK), (int64_t)parts);
        ran++;
        if (__atomic_add_fetch(&pool.finished, 1, __ATOMIC_ACQ_REL) == (int64_t)parts) {
            pthread_mutex_lock(&pool.lock);  /* the last part: the caller may be asleep */
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
        claim = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
    }
    return ran;
}

static inline uint64_t clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Whether to keep polling: false once SPIN_NS have passed since the first call with *until == 0. */
static inline int keep_spinning(uint64_t *until, int64_t k) {
    cpu_relax();
    if (k & 63) return 1;  /* the clock every 64 polls */
    uint64_t t = clock_ns();
    if (!*until) *until = t + SPIN_NS;
    return t < *until;
}

static void *pool_worker(void *arg) {
    (void)arg;
    uint64_t seen = pool.born;  /* not the generation now: the first job may be published before we run */
    for (;;) {
        uint64_t now = seen;
        uint64_t until = 0;
        for (int64_t k = 0; now == seen && keep_spinning(&until, k); k++)
            now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        if (now == seen) {  /* sleep: the caller wakes sleepers after publishing (both seq_cst: no lost wake) */
            pthread_mutex_lock(&pool.lock);
            __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
            while ((now = __atomic_load_n(&pool.generation, __ATOMIC_SEQ_CST)) == seen && !pool.stop)
                pthread_cond_wait(&pool.wake, &pool.lock);
            __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
            int stop = pool.stop;
            pthread_mutex_unlock(&pool.lock);
            if (stop) return 0;
        }
        seen = now;
        pool_claim_parts(now);
    }
}

/* Stop and join the workers (job_lock held, no job in flight). */
static void pool_stop(void) {
    if (!pool.started) return;
    pthread_mutex_lock(&pool.lock);
    pool.stop = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int k = 0; k < pool.started; k++) pthread_join(pool.threads[k], 0);
    __atomic_store_n(&pool.started, 0, __ATOMIC_RELAXED);
    pool.stop = 0;
}

/* Start workers until `wanted` - 1 run (job_lock held); fewer if the system refuses threads. Workers get
   every signal blocked: signals stay with the interpreter's threads. */
static void pool_start(void) {
    sigset_t all, previous;
    sigfillset(&all);
    pool.born = pool.generation;
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    while (pool.started < pool.wanted - 1) {
        if (pthread_create(&pool.threads[pool.started], 0, pool_worker, 0) != 0) break;
        __atomic_store_n(&pool.started, pool.started + 1, __ATOMIC_RELAXED);
    }
    pthread_sigmask(SIG_SETMASK, &previous, 0);
}

static void pool_before_fork(void) { pthread_mutex_lock(&pool.job_lock); }
static void pool_after_fork_parent(void) { pthread_mutex_unlock(&pool.job_lock); }
static void pool_after_fork_child(void) {
    /* Only the forking thread lives on: forget the parent's workers and take fresh locks. */
    pool.started = 0;
    pool.stop = 0;
    pool.sleepers = 0;
    pool.finished = 0;
    pthread_mutex_init(&pool.lock, 0);
    pthread_cond_init(&pool.wake, 0);
    pthread_cond_init(&pool.done, 0);
    pthread_mutex_init(&pool.job_lock, 0);
}

static void pool_register(void) {
    pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_after_fork_child);
}

__attribute__((destructor)) static void pool_at_exit(void) {
    if (pthread_mutex_trylock(&pool.job_lock) != 0) return;  /* a job in flight: leave it be */
    pool_stop();
    pthread_mutex_unlock(&pool.job_lock);
}

/* Threads per job from now on, the caller included (1: every loop on the calling thread). Returns the
   number set (clamped to [1, POOL_MAX]). Workers of a changed size are rebuilt on the next job. */
int64_t slipcache_set_threads(int64_t n) {
    n = n < 1 ? 1 : (n > POOL_MAX ? POOL_MAX : n);
    pthread_mutex_lock(&pool.job_lock);
    if (n != pool.wanted) {
        pool_stop();
        __atomic_store_n(&pool.wanted, (int)n, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&pool.job_lock);
    return n;
}

int64_t slipcache_threads(void) { return __atomic_load_n(&pool.wanted, __ATOMIC_RELAXED); }

/* Workers running now (0 until the first job that uses them, and in a fresh fork child). */
int64_t slipcache_pool_workers(void) { return __atomic_load_n(&pool.started, __ATOMIC_RELAXED); }

int64_t parts_for(int64_t n, int64_t grain) {
    int64_t parts = __atomic_load_n(&pool.wanted, __ATOMIC_RELAXED);
    if (grain > 0 && n / grain < parts) parts = n / grain;
    return parts < 1 ? 1 : parts;
}

/* Parts for a split by position, where more parts cost nothing: up to CHUNKS per thread, so that a worker
   that arrives late (or is preempted) holds back a small part, not a thread's whole share. */
#define CHUNKS 4
int64_t chunks_for(int64_t n, int64_t grain) {
    int64_t threads = __atomic_load_n(&pool.wanted, __ATOMIC_RELAXED);
    if (threads <= 1) return 1;
    int64_t parts = threads * CHUNKS > POOL_MAX ? POOL_MAX : threads * CHUNKS;
    if (grain > 0 && n / grain < parts) parts = n / grain;
    return parts < 1 ? 1 : parts;
}

typedef struct { range_fn fn; void *args; int64_t n; int64_t *results; } range_job;

static void range_part(void *job_, int64_t part, int64_t parts) {
    range_job *job = job_;
    int64_t lo, hi;
    part_range(job->n, part, parts, &lo, &hi);
    job->results[part] = job->fn(job->args, lo, hi, part);
}

int64_t run_ranges(range_fn fn, void *args, int64_t n, int64_t parts, int64_t *results) {
    int64_t own[POOL_MAX], sum = 0;
    range_job job = {fn, args, n, results ? results : own};
    run_parts(range_part, &job, parts);
    for (int64_t p = 0; p < parts; p++) sum += job.results[p];
    return sum;
}

/* run_parts: on the pool with however many workers run (none included). */
void run_parts(part_fn fn, void *args, int64_t parts) {
    if (parts <= 1 || pthread_mutex_trylock(&pool.job_lock) != 0) {
        for (int64_t p = 0; p < parts; p++) fn(args, p, parts);
        return;
    }
    pthread_once(&pool_once, pool_register);
    if (pool.started < pool.wanted - 1) pool_start();
    __atomic_store_n(&pool.fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.args, args, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELAXED);
    uint64_t job = (pool.generation >> PARTS_BITS) + 1, next = job << PARTS_BITS | (uint64_t)parts;
    __atomic_store_n(&pool.claim, job << PARTS_BITS, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.generation, next, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    pool_claim_parts(next);
    uint64_t until = 0;
    for (int64_t k = 0; __atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) < parts && keep_spinning(&until, k); k++) {
    }
    if (__atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) < parts) {
        pthread_mutex_lock(&pool.lock);
        while (__atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) < parts) pthread_cond_wait(&pool.done, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.job_lock);
}

/* ------------------------------------------------------------------ per-thread scratch */
typedef struct { void *buffer[SCRATCH_KINDS]; size_t bytes[SCRATCH_KINDS]; } scratch_set;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ready;
static int64_t scratch_total;  /* atomic: bytes held by every thread's scratch */

static void scratch_release(void *set_) {  /* the key's destructor: its thread exits */
    scratch_set *set = set_;
    for (int k = 0; k < SCRATCH_KINDS; k++) {
        free(set->buffer[k]);
        __atomic_sub_fetch(&scratch_total, (int64_t)set->bytes[k], __ATOMIC_RELAXED);
    }
    free(set);
}

static void scratch_init(void) { scratch_ready = pthread_key_create(&scratch_key, scratch_release) == 0; }

void *thread_scratch(int kind, size_t bytes) {
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_ready || kind < 0 || kind >= SCRATCH_KINDS) return 0;
    scratch_set *set = pthread_getspecific(scratch_key);
    if (!set) {
        set = calloc(1, sizeof *set);
        if (!set || pthread_setspecific(scratch_key, set) != 0) {
            free(set);
            return 0;
        }
    }
    if (set->bytes[kind] < bytes) {  /* grow by half at least: a batch a little larger does not reallocate */
        size_t grown = set->bytes[kind] + set->bytes[kind] / 2;
        grown = grown > bytes ? grown : bytes;
        void *buffer = calloc(grown, 1);
        if (!buffer) return 0;
        free(set->buffer[kind]);
        __atomic_add_fetch(&scratch_total, (int64_t)grown - (int64_t)set->bytes[kind], __ATOMIC_RELAXED);
        set->buffer[kind] = buffer;
        set->bytes[kind] = grown;
    }
    return set->buffer[kind];
}

/* Bytes of scratch that every thread holds now (the memory report counts them). */
int64_t slipcache_scratch_bytes(void) { return __atomic_load_n(&scratch_total, __ATOMIC_RELAXED); }
