/* The ISA switch and the task pool of the CPU kernels. */
#include "sf_cpu.h"
#include "sf_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if SF_X86
#include <cpuid.h>
#endif

static int g_isa = -1; /* the best level this CPU and OS allow (SF_ISA_*) */
static int g_force = -1;
static unsigned g_features; /* SF_FEAT_* seen, whether or not a kernel uses them */

#if SF_X86
static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* CPUID and XCR0 (the OS saves the registers), not the compiler's view:
 * the AVX-512 and AMX states must be enabled by the kernel, and AMX's tile
 * data also needs this process's permission (arch_prctl), asked once. */
static void detect(void) {
    unsigned a, b, c, d, b7 = 0, c7 = 0, d7 = 0, a71 = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1;
    if (__get_cpuid_count(7, 0, &a, &b7, &c7, &d7) && a >= 1) __get_cpuid_count(7, 1, &a71, &b, &c, &d);
    uint64_t x = osxsave ? xcr0() : 0;
    int ymm = (x & 6) == 6, zmm = ymm && (x & 0xe0) == 0xe0, tiles = (x & 0x60000) == 0x60000;
    if (ymm && fma && ((b7 >> 5) & 1)) g_features |= SF_FEAT_AVX2;
    /* F, DQ, BW, VL: what the kernels' intrinsics need */
    if (zmm && (g_features & SF_FEAT_AVX2) && (b7 & 0xc0030000u) == 0xc0030000u) g_features |= SF_FEAT_AVX512;
    if ((g_features & SF_FEAT_AVX512) && ((a71 >> 5) & 1)) {
        g_features |= SF_FEAT_AVX512_BF16;
        if (!sf_dp_verify()) g_features = (g_features & ~(unsigned)SF_FEAT_AVX512_BF16) | SF_FEAT_BF16_DIFFERS;
    }
#ifdef SF_AMX_EMULATE
    /* a test build (sf_amx_emu.h): tiles in C, on top of the avx512-bf16 path, for a process that asks */
    (void)tiles;
    const char *ask = getenv("SUPERFLUID_AMX_EMULATED");
    if ((g_features & SF_FEAT_AVX512_BF16) && ask && strcmp(ask, "1") == 0) {
        g_features |= SF_FEAT_AMX_BF16 | SF_FEAT_AMX_PERMITTED | SF_FEAT_AMX_EMULATED;
        if (sf_amx_verify()) g_features |= SF_FEAT_AMX_VERIFIED;
    }
#else
    if (tiles && ((d7 >> 22) & 1) && ((d7 >> 24) & 1)) {
        g_features |= SF_FEAT_AMX_BF16;
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it a tile load faults */
        if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) g_features |= SF_FEAT_AMX_PERMITTED;
        if ((g_features & SF_FEAT_AMX_PERMITTED) && (g_features & SF_FEAT_AVX512_BF16) && sf_amx_verify())
            g_features |= SF_FEAT_AMX_VERIFIED;
    }
#endif
}
#endif

static void decide(void) {
#if SF_X86
    detect();
#endif
    g_isa = (g_features & SF_FEAT_AMX_VERIFIED)    ? SF_ISA_AMX_BF16
            : (g_features & SF_FEAT_AVX512_BF16) ? SF_ISA_AVX512_BF16
            : (g_features & SF_FEAT_AVX512)      ? SF_ISA_AVX512
            : (g_features & SF_FEAT_AVX2)        ? SF_ISA_AVX2
                                                 : SF_ISA_SCALAR;
}

static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

int sf_cpu_isa_max(void) {
    if (g_isa < 0) pthread_once(&isa_once, decide); /* once, even with two first callers (AMX's probe forks) */
    return g_isa;
}

unsigned sf_cpu_features(void) {
    sf_cpu_isa_max();
    return g_features;
}

int sf_cpu_isa(void) {
    int best = sf_cpu_isa_max();
    return g_force >= 0 && g_force < best ? g_force : best;
}

/* Run on a lower level (SF_ISA_*), one choice for the process (the Python
 * side reads SUPERFLUID_ISA) or for tests that the paths agree; -1 resets. */
void sf_cpu_force_isa(int isa) { g_force = isa; }

/* ------------------------------------------------------------ the pool
 *
 * Work is a job of numbered tasks that threads claim one at a time; a job
 * is over when its tasks are done, not when every thread has checked in. On
 * a shared box a helper thread that is not scheduled just misses the job
 * (an OpenMP barrier waits a timeslice for it: ~4 ms a region, seen here).
 * Which thread runs a task never changes a bit of its result.
 *
 * One 64-bit word says what can be claimed: job generation (16 bits), the
 * helpers let in (6), tasks (21) and the next task (21). A claim is a CAS on
 * it, so a helper that wakes late cannot take a task of a later job. */
#define MAX_HELPERS 63
#define SPIN_WAIT 20000

static struct {
    pthread_mutex_t lock, job; /* helper creation; the one job in flight */
    int helpers;
    _Atomic uint64_t word;
    _Atomic uint32_t gen; /* the futex helpers sleep on */
    _Atomic int sleepers;
    _Atomic int park; /* set by sf_pool_park: spinning helpers sleep now; the next job clears it */
    _Atomic long done;
    task_fn fn;
    const void *ctx;
    unsigned csr; /* the caller's MXCSR (rounding, FTZ/DAZ): helpers run under it too */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .job = PTHREAD_MUTEX_INITIALIZER};

#define W_GEN(w) ((uint32_t)((w) >> 48))
#define W_WANT(w) ((int)(((w) >> 42) & 63))
#define W_TASKS(w) ((long)(((w) >> 21) & 0x1fffff))
#define W_NEXT(w) ((long)((w) & 0x1fffff))

static inline void cpu_relax(void) {
#if SF_X86
    __builtin_ia32_pause();
#endif
}

/* Claim and run tasks of job `gen` until none is left. */
static void run_tasks(uint32_t gen, int helper) {
    for (;;) {
        uint64_t w = atomic_load_explicit(&P.word, memory_order_acquire);
        if ((W_GEN(w) != (gen & 0xffff)) || W_NEXT(w) >= W_TASKS(w) || helper > W_WANT(w)) return;
        if (!atomic_compare_exchange_weak_explicit(&P.word, &w, w + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        /* task W_NEXT(w) of a job that cannot end before it is done: fn/ctx are that job's */
#if SF_X86
        if (helper && _mm_getcsr() != P.csr) _mm_setcsr(P.csr);
#endif
        P.fn(P.ctx, W_NEXT(w));
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static void *helper_main(void *arg) {
    int me = (int)(long)arg; /* 1-based */
    uint32_t seen = atomic_load_explicit(&P.gen, memory_order_acquire);
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (++spins < SPIN_WAIT && !atomic_load_explicit(&P.park, memory_order_relaxed)) {
                cpu_relax();
                continue;
            }
            atomic_fetch_add(&P.sleepers, 1);
            syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&P.sleepers, 1);
            spins = 0;
        }
        seen = g;
        run_tasks(g, me);
    }
    return NULL;
}

/* A forked child has none of the helpers: it makes new ones when it needs them. */
static void pool_atfork_child(void) {
    pthread_mutex_init(&P.lock, NULL);
    pthread_mutex_init(&P.job, NULL);
    P.helpers = 0;
    atomic_store(&P.sleepers, 0);
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { pthread_atfork(NULL, NULL, pool_atfork_child); }

/* Run fn(ctx, 0..ntasks-1) on up to nthreads threads (the caller is one).
 * A second caller while a job runs (another Python thread: cffi drops the
 * GIL) runs its tasks itself. A helper parked after claiming a task
 * still holds its job up until it finishes that task: tasks are small. */
void sf_parallel(task_fn fn, const void *ctx, long ntasks, int nthreads) {
    if (ntasks <= 0) return;
    pthread_once(&pool_once, pool_init);
    if (nthreads > MAX_HELPERS + 1) nthreads = MAX_HELPERS + 1;
    if (nthreads <= 1 || ntasks == 1 || ntasks > MAX_TASKS || pthread_mutex_trylock(&P.job) != 0) {
        for (long i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    if (P.helpers < nthreads - 1) {
        pthread_mutex_lock(&P.lock);
        while (P.helpers < nthreads - 1) {
            pthread_t th;
            pthread_attr_t at;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            int rc = pthread_create(&th, &at, helper_main, (void *)(long)(P.helpers + 1));
            pthread_attr_destroy(&at);
            if (rc) break; /* fewer helpers: still correct */
            P.helpers++;
        }
        pthread_mutex_unlock(&P.lock);
    }
    uint32_t gen = atomic_load_explicit(&P.gen, memory_order_relaxed) + 1;
    P.fn = fn;
    P.ctx = ctx;
#if SF_X86
    P.csr = _mm_getcsr();
#endif
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.park, 0, memory_order_relaxed); /* (published by the gen store below) */
    uint64_t w = ((uint64_t)(gen & 0xffff) << 48) | ((uint64_t)(nthreads - 1) << 42) | ((uint64_t)ntasks << 21);
    atomic_store_explicit(&P.word, w, memory_order_release);
    atomic_store_explicit(&P.gen, gen, memory_order_seq_cst); /* ordered before the sleepers load */
    /* all: a helper numbered past this job's limit must not take a wanted one's wake-up */
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    run_tasks(gen, 0);
    int spins = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < ntasks) {
        if (++spins > SPIN_WAIT) {
            sched_yield();
            spins = 0;
        } else {
            cpu_relax();
        }
    }
    pthread_mutex_unlock(&P.job);
}

/* Nothing to run for a while (a worker between ticks, waiting for its next
 * plan): helpers spinning for a next job go to sleep now instead of after
 * SPIN_WAIT, so they do not take a core from the planner. The next job wakes
 * them (its caller runs tasks meanwhile), and spinning resumes from then. */
void sf_pool_park(void) { atomic_store_explicit(&P.park, 1, memory_order_relaxed); }
