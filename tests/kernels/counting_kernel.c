/* A test kernel built apart from the kernels' library, on its work pool: each item adds one to
   its counter (atomically: a chunk run twice would show as a 2). */
#include <stdint.h>

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
