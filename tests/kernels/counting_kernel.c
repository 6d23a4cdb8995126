/* A test kernel built apart from the kernels' library, on its work pool: each item adds one to
   its counter (atomically: a chunk run twice would show as a 2). */
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "work_pool.h"

struct counting {
    int32_t *counts;
};

static void count_chunk(void *arg, int64_t begin, int64_t end) {
    struct counting *c = arg;
    for (int64_t i = begin; i < end; i++) __atomic_fetch_add(&c->counts[i], 1, __ATOMIC_RELAXED);
}

void count_items(int32_t *counts, int64_t n, int64_t min_grain) {
    struct counting c = {counts};
    switchboard_parallel_for(n, min_grain, count_chunk, &c);
}

/* Two chunks that wait for each other: each chunk marks itself started, then waits (up to
   timeout_ns) for the other to start. Returns 1 when neither wait ran out, which needs a second
   thread in the loop (a thread waiting in one chunk cannot start the other); 0 otherwise. */
struct rendezvous {
    int started[2];
    int64_t timeout_ns;
    int timed_out;
};

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void meet_chunk(void *arg, int64_t begin, int64_t end) {
    struct rendezvous *r = arg;
    for (int64_t i = begin; i < end; i++) {
        __atomic_store_n(&r->started[i], 1, __ATOMIC_SEQ_CST);
        const int64_t deadline = monotonic_ns() + r->timeout_ns;
        while (!__atomic_load_n(&r->started[1 - i], __ATOMIC_SEQ_CST)) {
            if (monotonic_ns() > deadline) {
                __atomic_store_n(&r->timed_out, 1, __ATOMIC_SEQ_CST);
                break;
            }
            sched_yield();
        }
    }
}

int meet_two_threads(int64_t timeout_ms) {
    struct rendezvous r = {{0, 0}, timeout_ms * 1000000, 0};
    switchboard_parallel_for(2, 1, meet_chunk, &r);
    return !r.timed_out;
}
