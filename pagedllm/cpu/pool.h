/* A small thread pool that tolerates preempted helpers.
 *
 * Why not OpenMP: a fork-join region ends at a barrier that waits for every thread. On a 2-core
 * machine that also runs the HTTP event loop and the benchmark client, a helper thread is often
 * descheduled; every region then waits a scheduler time slice for it, and a decode step (a few
 * hundred regions) went from 17 ms to 500+ ms when a process used 10% of one core.
 *
 * Here the caller publishes a job of `n` chunks and then claims chunks itself, like the helpers, from
 * one atomic counter. It only waits for chunks a helper has already started; a helper that never got
 * the CPU claims nothing, and the caller does its share. Worst case: one thread's speed, never a
 * stall per job. Helpers spin briefly between jobs (a decode step calls a kernel every few tens of
 * microseconds), then sleep on a condition variable, leaving the core to other threads.
 *
 * Jobs come from one thread at a time (the engine's); a second concurrent caller runs its job inline.
 */
#pragma once

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef void (*pool_task_fn)(void *ctx, long chunk, int worker);

#define POOL_MAX_WORKERS 256
#ifndef POOL_SPIN_NS
#define POOL_SPIN_NS 200000L /* helpers spin this long for the next job before sleeping */
#endif

struct pool_job {
    pool_task_fn fn;
    void *ctx;
    long n;
};

static struct {
    int n_workers; /* including the calling thread (worker 0) */
    pthread_t threads[POOL_MAX_WORKERS];
    struct pool_job jobs[2];     /* job of generation g lives in jobs[g & 1] */
    _Atomic uint64_t claim;      /* generation << 32 | next chunk to claim */
    _Atomic long done;           /* chunks finished in the current job */
    _Atomic uint32_t generation; /* bumped per job */
    _Atomic int sleepers;
    _Atomic int stop;
    pthread_mutex_t sleep_mu;
    pthread_cond_t sleep_cv;
    pthread_mutex_t caller_mu; /* one job at a time */
} POOL = {1, {0}, {{0}}, 0, 0, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_MUTEX_INITIALIZER};

static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline long pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run chunks of generation g until none is left. The claim CAS fails once the counter
 * moved to another generation, so a late thread never runs a chunk twice or of the wrong job: the
 * job slot of g is only rewritten for g + 2, after job g + 1 has ended. */
static void pool_work(uint32_t g, int worker) {
    const struct pool_job *job = &POOL.jobs[g & 1];
    for (;;) {
        uint64_t c = atomic_load_explicit(&POOL.claim, memory_order_acquire);
        if ((uint32_t)(c >> 32) != g) return;
        const long idx = (long)(c & 0xffffffffu);
        const pool_task_fn fn = job->fn;
        void *ctx = job->ctx;
        if (idx >= job->n) return;
        if (!atomic_compare_exchange_weak_explicit(&POOL.claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        fn(ctx, idx, worker);
        atomic_fetch_add_explicit(&POOL.done, 1, memory_order_release);
    }
}

static void *pool_helper(void *arg) {
    const int worker = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&POOL.generation);
    for (;;) {
        uint32_t g;
        long spin_start = pool_now_ns();
        int spins = 0;
        while ((g = atomic_load_explicit(&POOL.generation, memory_order_acquire)) == seen) {
            if (atomic_load_explicit(&POOL.stop, memory_order_relaxed)) return NULL;
            pool_pause();
            if (++spins % 64 || pool_now_ns() - spin_start < POOL_SPIN_NS) continue;
            /* sleepers is set back to 0 by the waker (pool_run), not here: until this thread runs again
             * (on a busy machine that can take a time slice) the jobs that follow find it 0 and do not
             * lock sleep_mu, which this thread may hold, nor broadcast again. Both sides are seq_cst:
             * either the waker sees the count or this thread sees the new generation. */
            pthread_mutex_lock(&POOL.sleep_mu);
            atomic_fetch_add(&POOL.sleepers, 1);
            while (atomic_load(&POOL.generation) == seen && !atomic_load(&POOL.stop))
                pthread_cond_wait(&POOL.sleep_cv, &POOL.sleep_mu);
            pthread_mutex_unlock(&POOL.sleep_mu);
            spin_start = pool_now_ns();
        }
        seen = g;
        pool_work(g, worker);
    }
}

static void pool_stop(void) {
    if (POOL.n_workers <= 1) return;
    pthread_mutex_lock(&POOL.sleep_mu);
    atomic_store(&POOL.stop, 1);
    pthread_cond_broadcast(&POOL.sleep_cv);
    pthread_mutex_unlock(&POOL.sleep_mu);
    for (int i = 1; i < POOL.n_workers; i++) pthread_join(POOL.threads[i], NULL);
    atomic_store(&POOL.stop, 0);
    POOL.n_workers = 1;
}

/* Run fn(ctx, chunk, worker) for chunk in [0, n), spread over the pool; returns when all are done. */
static void pool_run(pool_task_fn fn, void *ctx, long n) {
    if (n <= 0) return;
    if (POOL.n_workers <= 1 || n == 1 || pthread_mutex_trylock(&POOL.caller_mu) != 0) {
        for (long i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    const uint32_t g = atomic_load(&POOL.generation) + 1;
    struct pool_job *job = &POOL.jobs[g & 1];
    job->fn = fn;
    job->ctx = ctx;
    job->n = n;
    atomic_store_explicit(&POOL.done, 0, memory_order_relaxed);
    atomic_store_explicit(&POOL.claim, (uint64_t)g << 32, memory_order_release);
    atomic_store_explicit(&POOL.generation, g, memory_order_release);
    if (atomic_load(&POOL.sleepers) > 0 && atomic_exchange(&POOL.sleepers, 0) > 0) {
        pthread_mutex_lock(&POOL.sleep_mu);
        pthread_cond_broadcast(&POOL.sleep_cv);
        pthread_mutex_unlock(&POOL.sleep_mu);
    }
    pool_work(g, 0);
    /* Only chunks a helper already started are left: wait for them, yielding the core after a short
     * spin in case that helper was preempted onto this core. */
    int spins = 0;
    while (atomic_load_explicit(&POOL.done, memory_order_acquire) < n) {
        if (++spins < 2000) {
            pool_pause();
        } else {
            sched_yield();
        }
    }
    pthread_mutex_unlock(&POOL.caller_mu);
}

/* (Re)start the pool with n workers in all (the caller counts as one). Returns the count in use. */
int cpu_pool_init(int n) {
    if (n < 1) n = 1;
    if (n > POOL_MAX_WORKERS) n = POOL_MAX_WORKERS;
    pthread_mutex_lock(&POOL.caller_mu);
    if (n != POOL.n_workers) {
        pool_stop();
        int started = 1;
        for (int i = 1; i < n; i++) {
            if (pthread_create(&POOL.threads[i], NULL, pool_helper, (void *)(intptr_t)i) != 0) break;
            started++;
        }
        POOL.n_workers = started;
    }
    pthread_mutex_unlock(&POOL.caller_mu);
    return POOL.n_workers;
}

int cpu_pool_size(void) { return POOL.n_workers; }
