/* The threads the kernels split their loops over (work_pool.c). */
#ifndef SWITCHBOARD_WORK_POOL_H
#define SWITCHBOARD_WORK_POOL_H
#include <stdint.h>

/* fn(ctx, begin, end) computes items [begin, end) of a loop */
typedef void (*switchboard_chunk_fn)(void *ctx, int64_t begin, int64_t end);

/* Runs fn over items [0, n) in chunks of at least min_grain items, on the pool's threads;
   returns when every item is done. n <= min_grain runs on the calling thread alone. */
void switchboard_parallel_for(int64_t n, int64_t min_grain, switchboard_chunk_fn fn, void *ctx);

/* Helper threads started so far (0 before the first parallel loop, and with OpenMP). */
int switchboard_work_pool_helpers(void);

/* on != 0: a step that splits its loops over the pool's threads is under way; until it is 0
   again, its helpers spin up to a millisecond between loops instead of 15 us before they
   sleep (a wake-up per loop). */
void switchboard_work_pool_hold(int on);

/* Times a helper has gone to sleep so far. */
int64_t switchboard_work_pool_sleeps(void);

/* on != 0: every loop from now on is an OpenMP `parallel for` instead (set before the first). */
void switchboard_work_pool_use_openmp(int on);
#endif
