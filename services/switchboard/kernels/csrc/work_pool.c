/* The threads the kernels split their loops over: a pool that never waits for a late thread.

   An OpenMP `parallel for` ends in a barrier that every thread of the team must reach. On a
   machine with more busy processes than cores (the serving case here: the gateway, the engine
   core and the clients share the two cores with the worker), the second thread is often not
   running when a loop starts, and the first then waits, spinning, for it to be scheduled, once
   per loop, and a decode step has dozens of loops. Measured serving tiny-llama at 32 requests on
   a 2-core EPYC, the worker spent 490-600 us of CPU per token in situ against 330 alone, and the
   time it spun was taken from the processes it waited for.

   Here a loop is cut into chunks, and the chunks into one run per thread, consecutive ones (the
   caller's first, then each helper's); a thread claims its own run's chunks from the front, one
   at a time (a compare and swap on the run's word), then the other runs' from their backs. The
   calling thread waits only for chunks another thread has claimed and is running. A helper
   thread that is not running when the loop starts claims nothing and is not waited for: the
   caller takes its run too. A run is one stretch of the loop's items, read in order: a matmul's
   weights stream through it, each chunk's last fetches ahead warming the next chunk's first
   lines. (Claimed from one shared cursor, the two threads' chunks alternated and each chunk
   began cold: the 120 matmuls of a one-row SmolLM2 step, 66 MB of 4-bit weights, took 1.79 ms
   against 1.68 as runs, 2.48 against 2.08 in a slower spell (the same bytes as four large
   matmuls: 1.42), and a one-row decode step in process 4.0 ms against 3.5, on the 2-vCPU AVX2
   EPYC.) Helpers spin SPIN_NS of
   their own running time after their last chunk (the next loop of a step follows at once),
   then sleep on a futex until woken, one wake-up call per sleep: idle, the pool takes no CPU.
   The number of threads is torch's (omp_get_max_threads() of the calling thread, which
   torch.set_num_threads sets); helpers start on first use. A call made while another runs (a
   second thread, or a chunk that loops again) runs on the calling thread alone.

   Each output is computed by one chunk whichever thread runs it, so the floats do not depend on
   the number of threads or on who ran what. The library is loaded with RTLD_GLOBAL, so a test
   kernel built apart from it shares the same helper threads.
   switchboard_work_pool_use_openmp(1) (SWITCHBOARD_WORK_POOL=openmp) runs every loop as an
   OpenMP `parallel for` instead (the behaviour before the pool, kept for comparison). */
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "work_pool.h"

#define MAX_HELPERS 255
#define CHUNKS_PER_THREAD 8 /* enough for a thread that starts late to leave work to others */
#define MAX_CHUNKS 4096     /* a run word's 16-bit front and back hold it */
/* a helper spins this long after its last chunk, then sleeps: the gaps between a step's loops
   are shorter, and a longer spin (50 us) took CPU the other processes on the cores needed (one
   stream of the default model on 2 cores: ITL p50 lower in 10 of 12 alternated rounds) */
#define SPIN_NS 15000
#define PREEMPTED_NS 20000  /* a gap this long between two looks at the clock: preempted */
/* ... and this long while a step on every thread is under way (switchboard_work_pool_hold):
   the gaps between its loops are shorter, and a longer one (torch's own OpenMP team at work, a
   prompt's attention) gets the core back after it */
#define HELD_SPIN_NS 1000000

/* the loop's generation: what helpers watch for the next loop, and the word they sleep on
   (futex) */
static _Atomic uint32_t generation;
/* Each thread's run of a loop's chunks, as generation << 32 | front << 16 | back (the run is
   chunks front .. back - 1): one word, so a claim (compare and swap) fails for a thread that
   read an earlier loop's generation. The caller's run is 0, helper i's run i + 1; each on a
   cache line of its own (claims of different runs do not contend). */
struct run_word {
    _Alignas(64) _Atomic uint64_t word;
};
static struct run_word runs[MAX_HELPERS + 1];
static _Atomic int task_runs;
static _Atomic int64_t finished;      /* chunks of this generation done */
static _Atomic int sleepers;
/* 1 after a wake-up call that no helper has answered by going to sleep again: while a woken
   helper is still waiting to be scheduled, `sleepers` still counts it, and the next loops'
   calls would wake nobody (each a system call, and in a VM often an exit) */
static _Atomic int wake_sent;
static _Atomic int running;           /* a loop is in progress: another call runs alone */
/* 1 while a step runs on every thread (switchboard_work_pool_hold): the helpers spin up to
   HELD_SPIN_NS between its loops instead of SPIN_NS */
static _Atomic int held;
static _Atomic int64_t sleeps; /* times a helper went to sleep (switchboard_work_pool_sleeps) */
static _Atomic(switchboard_chunk_fn) task_fn;
static _Atomic(void *) task_ctx;
static _Atomic int64_t task_n, task_grain;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int helpers_started; /* written under start_lock */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint32_t generation_of(uint64_t word) { return (uint32_t)(word >> 32); }

/* Claims chunk front (or, from the back, chunk back - 1) of run r in generation gen: 1 and
   the chunk in *chunk, or 0 when the run has none left (or is of another generation). */
static inline int claim(int r, uint32_t gen, int from_back, int64_t *chunk) {
    _Atomic uint64_t *at = &runs[r].word;
    uint64_t word = atomic_load_explicit(at, memory_order_acquire);
    for (;;) {
        const uint64_t front = (word >> 16) & 0xffff, back = word & 0xffff;
        if (generation_of(word) != gen || front >= back) return 0;
        const uint64_t next = from_back ? word - 1 : word + (1 << 16);
        if (atomic_compare_exchange_weak_explicit(at, &word, next, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *chunk = (int64_t)(from_back ? back - 1 : front);
            return 1;
        }
    }
}

/* Runs chunks of generation gen until none is left: its own run's from the front (one stretch
   of the loop, in order: each chunk's last fetches ahead warm the next), then the other runs'
   from their backs (a late or slow thread's, while it works from its front). */
static void run_chunks(uint32_t gen, int own, int nruns, switchboard_chunk_fn fn, void *ctx,
                       int64_t n, int64_t grain) {
    int64_t chunk;
    for (int k = 0; k < nruns; k++) {
        const int r = (own + k) % nruns;
        while (claim(r, gen, k > 0, &chunk)) {
            const int64_t begin = chunk * grain, end = begin + grain;
            fn(ctx, begin, end < n ? end : n);
            atomic_fetch_add_explicit(&finished, 1, memory_order_release);
        }
    }
}

static void *helper_main(void *arg) {
    const int index = (int)((intptr_t)arg >> 32);
    uint32_t last = (uint32_t)(intptr_t)arg; /* the generation current when it started */
    for (;;) {
        uint32_t seen = atomic_load_explicit(&generation, memory_order_acquire);
        int64_t looked = now_ns(), spun = 0;
        for (int spins = 1; seen == last; spins++) {
            cpu_relax();
            if (spins % 64 == 0) {
                const int64_t now = now_ns();
                /* a gap between two looks at the clock is time this thread was not running
                   (another process had the core): it does not count as spinning, or a helper
                   preempted while it spun would sleep as soon as it ran again, just before
                   the next loop */
                if (now - looked <= PREEMPTED_NS) spun += now - looked;
                looked = now;
                if (spun > (atomic_load_explicit(&held, memory_order_relaxed) ? HELD_SPIN_NS
                                                                              : SPIN_NS)) {
                    /* announced before the last look at the generation; the caller publishes
                       the generation before it looks at sleepers: one of the two sees the other. The
                       wake-up call the caller skips while wake_sent is 1 is reset here first,
                       for the same reason. */
                    atomic_fetch_add(&sleepers, 1);
                    atomic_store(&wake_sent, 0);
                    atomic_fetch_add_explicit(&sleeps, 1, memory_order_relaxed);
                    if (atomic_load(&generation) == last)
                        syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, last, NULL, NULL, 0);
                    atomic_fetch_sub(&sleepers, 1);
                    looked = now_ns();
                    spun = 0;
                }
            }
            seen = atomic_load_explicit(&generation, memory_order_acquire);
        }
        last = seen;
        const int nruns = atomic_load_explicit(&task_runs, memory_order_relaxed);
        if (index + 1 >= nruns) continue;
        /* read after the generation's acquire; a claim with them succeeds only while this
           generation is unfinished, and the caller writes the next loop's only after that */
        run_chunks(last, index + 1, nruns, atomic_load_explicit(&task_fn, memory_order_relaxed),
                   atomic_load_explicit(&task_ctx, memory_order_relaxed),
                   atomic_load_explicit(&task_n, memory_order_relaxed),
                   atomic_load_explicit(&task_grain, memory_order_relaxed));
    }
    return NULL;
}

static void forget_helpers(void) { /* in a forked child: the helpers did not come along */
    helpers_started = 0;
    atomic_store(&running, 0);
    atomic_store(&sleepers, 0);
    atomic_store(&wake_sent, 0);
    pthread_mutex_init(&start_lock, NULL);
}

static void start_helpers(int wanted) {
    if (wanted > MAX_HELPERS) wanted = MAX_HELPERS;
    pthread_mutex_lock(&start_lock);
    if (helpers_started == 0) pthread_atfork(NULL, NULL, forget_helpers);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* signals stay with the threads that handle them */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const uint32_t gen = atomic_load(&generation);
    while (helpers_started < wanted) {
        pthread_t thread;
        const intptr_t arg = ((intptr_t)helpers_started << 32) | gen;
        if (pthread_create(&thread, &attr, helper_main, (void *)arg) != 0) break;
        helpers_started++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_mutex_unlock(&start_lock);
}

int switchboard_work_pool_helpers(void) { return helpers_started; }

void switchboard_work_pool_hold(int on) { atomic_store(&held, on != 0); }

int64_t switchboard_work_pool_sleeps(void) { return atomic_load(&sleeps); }

/* The OpenMP variant: torch's thread team, with the barrier at the end of every loop. */
static int use_openmp; /* set once, before the first loop */

void switchboard_work_pool_use_openmp(int on) { use_openmp = on; }

static void openmp_parallel_for(int64_t n, int64_t min_grain, switchboard_chunk_fn fn,
                                void *ctx) {
    if (n <= 0) return;
    if (min_grain < 1) min_grain = 1;
    const int threads = omp_get_max_threads();
    if (threads < 2 || n <= min_grain || omp_in_parallel()) {
        fn(ctx, 0, n);
        return;
    }
    int64_t chunks = (n + min_grain - 1) / min_grain;
    if (chunks > threads) chunks = threads;
    const int64_t grain = (n + chunks - 1) / chunks;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t begin = c * grain, end = begin + grain;
        fn(ctx, begin, end < n ? end : n);
    }
}

void switchboard_parallel_for(int64_t n, int64_t min_grain, switchboard_chunk_fn fn, void *ctx) {
    if (use_openmp) {
        openmp_parallel_for(n, min_grain, fn, ctx);
        return;
    }
    if (n <= 0) return;
    if (min_grain < 1) min_grain = 1;
    int threads = omp_get_max_threads();
    int idle = 0;
    if (threads < 2 || n <= min_grain ||
        !atomic_compare_exchange_strong(&running, &idle, 1)) {
        fn(ctx, 0, n);
        return;
    }
    if (threads - 1 > helpers_started) start_helpers(threads - 1);
    if (helpers_started == 0) {
        fn(ctx, 0, n);
        atomic_store(&running, 0);
        return;
    }
    int64_t chunks = (int64_t)threads * CHUNKS_PER_THREAD;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
    int64_t grain = (n + chunks - 1) / chunks;
    if (grain < min_grain) grain = min_grain;
    chunks = (n + grain - 1) / grain;
    atomic_store_explicit(&task_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&task_ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&task_n, n, memory_order_relaxed);
    atomic_store_explicit(&task_grain, grain, memory_order_relaxed);
    const int nruns = 1 + (threads - 1 < helpers_started ? threads - 1 : helpers_started);
    atomic_store_explicit(&task_runs, nruns, memory_order_relaxed);
    atomic_store_explicit(&finished, 0, memory_order_relaxed);
    const uint32_t gen = atomic_load(&generation) + 1;
    for (int r = 0; r < nruns; r++) {
        const uint64_t front = (uint64_t)(chunks * r / nruns);
        const uint64_t back = (uint64_t)(chunks * (r + 1) / nruns);
        atomic_store_explicit(&runs[r].word, ((uint64_t)gen << 32) | front << 16 | back,
                              memory_order_relaxed);
    }
    atomic_store(&generation, gen);
    if (atomic_load(&sleepers) > 0 && atomic_exchange(&wake_sent, 1) == 0)
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_chunks(gen, 0, nruns, fn, ctx, n, grain);
    /* only chunks another thread claimed are left: it is running them, or it was preempted
       while it held one and waits for a core, perhaps this one: yield it every 64 looks (a few
       microseconds; every 4,096 served llama-100m and SmolLM2 in bfloat16 at 64 streams 3-4 %
       slower, the caller's wait 11 % of the worker's samples) */
    for (int spins = 1; atomic_load_explicit(&finished, memory_order_acquire) < chunks; spins++) {
        cpu_relax();
        if (spins % 64 == 0) sched_yield();
    }
    atomic_store(&running, 0);
}
