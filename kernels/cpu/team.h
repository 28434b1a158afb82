/* The threads of one OpenMP parallel region as a team that shares out work by hand, and the
   barrier they meet at between the steps of a computation.

   The barrier spins (with `pause`) and, after DI_SPINS_BEFORE_YIELD spins, yields the CPU
   between spins; it never sleeps in the kernel. OpenMP's own barriers sleep on a futex after a
   short spin (100 spins when the process holds more OpenMP threads than there are CPUs, as a
   server with two workers does): each of a decode step's hundreds of barriers could then cost a
   wake-up through the kernel. A whole decoder stack runs as one parallel region with these
   barriers between its ops (cpu/llama_layers.c), so its threads wait by spinning, as
   llama.cpp's do.

   A computation written as a function of a `di_team *` runs the same on a team of one (a plain
   call) or of many; each thread takes a contiguous share of the items (`di_team_range`, the
   same split as `schedule(static)`), so what every output element is computed from never
   depends on the thread count. */
#ifndef DEEPINFER_TEAM_H
#define DEEPINFER_TEAM_H

#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>

#define DI_SPINS_BEFORE_YIELD 4096

typedef struct {
    atomic_int arrived;
    atomic_int phase;
} di_barrier;

typedef struct {
    di_barrier *barrier;
    int ith; /* this thread's index in the team */
    int nth; /* the team's size */
    int phase; /* the barrier's phase this thread last passed */
} di_team;

static inline void di_barrier_init(di_barrier *b) {
    atomic_init(&b->arrived, 0);
    atomic_init(&b->phase, 0);
}

/* This thread's view of the team, inside the parallel region (`b` initialized before it). */
static inline di_team di_team_join(di_barrier *b) {
    const di_team t = {b, omp_get_thread_num(), omp_get_num_threads(), 0};
    return t;
}

/* Wait until every thread of the team has called this as many times. */
static inline void di_team_sync(di_team *t) {
    if (t->nth == 1) return;
    const int next = t->phase + 1;
    di_barrier *b = t->barrier;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == t->nth - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, next, memory_order_release);
    } else {
        int spins = 0;
        while (atomic_load_explicit(&b->phase, memory_order_acquire) != next) {
            _mm_pause();
            if (++spins >= DI_SPINS_BEFORE_YIELD) {
                sched_yield();
                spins = DI_SPINS_BEFORE_YIELD / 2;
            }
        }
    }
    t->phase = next;
}

/* This thread's contiguous share [*start, *end) of n items. */
static inline void di_team_range(const di_team *t, int n, int *start, int *end) {
    const int per = n / t->nth, extra = n % t->nth;
    *start = t->ith * per + (t->ith < extra ? t->ith : extra);
    *end = *start + per + (t->ith < extra ? 1 : 0);
}

#endif
