/* CPU kernels of the torch backend: batch invariant by construction.
 *
 * Every output element is one fixed sequence of float operations that
 * depends only on its own inputs, never on how many rows share the call,
 * where the row sits, how the work is split across threads, or which ISA
 * runs it:
 *   - a GEMM output is one fma chain over k = 0..K-1 in order, started
 *     from 0, then + bias, then + residual. Tiles only decide which chains
 *     run side by side; threads take whole output panels, never a share of
 *     a reduction; K blocking stores and reloads the chain exactly;
 *   - a dot product or sum of squares is 8 lane chains (element i in lane
 *     i % 8, zero-padded) and one fixed tree over the lanes;
 *   - exp is our own polynomial, the same ops in the vector body and for
 *     padding-filled tails;
 *   - attention takes a row's keys 0..pos in order (scores, max, exp, an
 *     ordered 8-lane sum, then a value fma chain over the keys in order).
 * The scalar path does the same operations one lane at a time (fmaf for
 * fma), so it gives the same bits as the AVX2 path; tests check both.
 * Threads share work as numbered tasks (`parallel`, below): which thread
 * runs a task never changes what the task computes.
 */
#include "sf_cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SF_X86 1
#else
#define SF_X86 0
#endif

#define PANEL 16 /* output features per packed panel */
#define TILE_T 6 /* tokens per micro tile */
#define BLOCK_T 96 /* tokens per cache block (a multiple of TILE_T) */
#define BLOCK_K 256 /* reduction steps per cache block */

static int g_isa = -1; /* 0 scalar, 1 avx2+fma */
static int g_force = -1;

int sf_cpu_isa(void) {
    if (g_isa < 0) {
#if SF_X86
        __builtin_cpu_init();
        g_isa = (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
#else
        g_isa = 0;
#endif
    }
    return g_force >= 0 && g_force < g_isa ? g_force : g_isa;
}

/* Run on a lower ISA (0: scalar), for tests that the paths agree; -1 resets. */
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

typedef void (*task_fn)(const void *ctx, long task);

static struct {
    pthread_mutex_t lock, job; /* helper creation; the one job in flight */
    int helpers;
    _Atomic uint64_t word;
    _Atomic uint32_t gen; /* the futex helpers sleep on */
    _Atomic int sleepers;
    _Atomic long done;
    task_fn fn;
    const void *ctx;
    unsigned csr; /* the caller's MXCSR (rounding, FTZ/DAZ): helpers run under it too */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .job = PTHREAD_MUTEX_INITIALIZER};

#define W_GEN(w) ((uint32_t)((w) >> 48))
#define W_WANT(w) ((int)(((w) >> 42) & 63))
#define W_TASKS(w) ((long)(((w) >> 21) & 0x1fffff))
#define W_NEXT(w) ((long)((w) & 0x1fffff))
#define MAX_TASKS 0x1fffff

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
            if (++spins < SPIN_WAIT) {
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
static void parallel(task_fn fn, const void *ctx, long ntasks, int nthreads) {
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

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ------------------------------------------------------------------ exp */

#define EXP_HI 88.0f
#define EXP_LO -87.3f
static const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
static const float EP0 = 1.9875691500E-4f, EP1 = 1.3981999507E-3f, EP2 = 8.3334519073E-3f,
                   EP3 = 4.1665795894E-2f, EP4 = 1.6666665459E-1f, EP5 = 5.0000001201E-1f;

static inline float exp_scalar(float x) {
    if (!(x >= EXP_LO)) return 0.0f; /* also -inf */
    if (x > EXP_HI) x = EXP_HI;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EP0;
    p = fmaf(p, r, EP1);
    p = fmaf(p, r, EP2);
    p = fmaf(p, r, EP3);
    p = fmaf(p, r, EP4);
    p = fmaf(p, r, EP5);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t b = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &b, 4);
    return y * s;
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline __m256 exp_avx2(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(EP0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i b = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(b)), keep);
}
#endif

/* ------------------------------------------------------- lane reductions */

/* Lanes l, l+4 then l, l+2 then 0, 1: the tree both paths use. */
static inline float tree8(const float a[8]) {
    float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline float tree8_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + (l+4) */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                  /* l + (l+2) */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

/* ---------------------------------------------------------------- GEMM */

/* y[t, o] = (sum_k x[t, k] * W[o, k]) (+ bias[o]) (+ y[t, o] when resid).
 * W is packed [ceil(out / PANEL)][K][PANEL] (rows past out are zeros). */
typedef struct {
    const float *x;
    long ldx;
    int n, K, out;
    const void *w;
    int bf16;
    const float *bias;
    float *y;
    long ldy;
    int resid;
} gemm_args;

static void epilogue(const gemm_args *a, const float *acc, int t0, int nt, int o0) {
    int m = a->out - o0 < PANEL ? a->out - o0 : PANEL;
    for (int t = 0; t < nt; t++) {
        float *y = a->y + (long)(t0 + t) * a->ldy + o0;
        for (int i = 0; i < m; i++) {
            float v = acc[t * PANEL + i];
            if (a->bias) v = v + a->bias[o0 + i];
            if (a->resid) v = y[i] + v;
            y[i] = v;
        }
    }
}

static void tile_scalar(const void *w, int bf16, const float *x, long ldx, int nt, int kn, float *acc) {
    for (int t = 0; t < nt; t++) {
        const float *xr = x + t * ldx;
        float *c = acc + t * PANEL;
        for (int k = 0; k < kn; k++) {
            float xv = xr[k];
            if (bf16) {
                const uint16_t *wk = (const uint16_t *)w + (long)k * PANEL;
                for (int i = 0; i < PANEL; i++) c[i] = fmaf(bf16_to_f32(wk[i]), xv, c[i]);
            } else {
                const float *wk = (const float *)w + (long)k * PANEL;
                for (int i = 0; i < PANEL; i++) c[i] = fmaf(wk[i], xv, c[i]);
            }
        }
    }
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline void load_w_f32(const void *w, __m256 *w0, __m256 *w1) {
    *w0 = _mm256_loadu_ps((const float *)w);
    *w1 = _mm256_loadu_ps((const float *)w + 8);
}

__attribute__((target("avx2,fma"))) static inline void load_w_bf16(const void *w, __m256 *w0, __m256 *w1) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
    *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

/* T tokens x PANEL outputs over k in [k0, k1): acc holds the chains. One
 * function per (T, weight type), with named accumulators (GCC spills an
 * array of vectors to the stack every iteration). */
#define TROW_LOAD(i)                                                                                          \
    __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = c##i##0;                                                 \
    const float *x##i = x;                                                                                    \
    if (T > i) {                                                                                              \
        c##i##0 = _mm256_loadu_ps(acc + i * PANEL);                                                           \
        c##i##1 = _mm256_loadu_ps(acc + i * PANEL + 8);                                                       \
        x##i = x + i * ldx;                                                                                   \
    }
#define TROW_FMA(i)                                                                                           \
    if (T > i) {                                                                                              \
        __m256 xb = _mm256_broadcast_ss(x##i + k);                                                            \
        c##i##0 = _mm256_fmadd_ps(w0, xb, c##i##0);                                                           \
        c##i##1 = _mm256_fmadd_ps(w1, xb, c##i##1);                                                           \
    }
#define TROW_STORE(i)                                                                                         \
    if (T > i) {                                                                                              \
        _mm256_storeu_ps(acc + i * PANEL, c##i##0);                                                           \
        _mm256_storeu_ps(acc + i * PANEL + 8, c##i##1);                                                       \
    }
#define DEF_TILE(TN, NAME, LOADW, WT)                                                                          \
    __attribute__((target("avx2,fma"))) static void NAME(const void *wv, const float *x, long ldx, int kn,   \
                                                         float *acc) {                                       \
        enum { T = TN };                                                                                      \
        TROW_LOAD(0) TROW_LOAD(1) TROW_LOAD(2) TROW_LOAD(3) TROW_LOAD(4) TROW_LOAD(5)                         \
        const WT *w = (const WT *)wv;                                                                         \
        for (int k = 0; k < kn; k++, w += PANEL) {                                                            \
            __m256 w0, w1;                                                                                    \
            if (T == 1) _mm_prefetch((const char *)(w + 128 * PANEL), _MM_HINT_T0); /* a lone token: memory-bound */ \
            LOADW(w, &w0, &w1);                                                                               \
            TROW_FMA(0) TROW_FMA(1) TROW_FMA(2) TROW_FMA(3) TROW_FMA(4) TROW_FMA(5)                           \
        }                                                                                                     \
        TROW_STORE(0) TROW_STORE(1) TROW_STORE(2) TROW_STORE(3) TROW_STORE(4) TROW_STORE(5)                   \
    }
DEF_TILE(1, tf1, load_w_f32, float)
DEF_TILE(2, tf2, load_w_f32, float)
DEF_TILE(3, tf3, load_w_f32, float)
DEF_TILE(4, tf4, load_w_f32, float)
DEF_TILE(5, tf5, load_w_f32, float)
DEF_TILE(6, tf6, load_w_f32, float)
DEF_TILE(1, tb1, load_w_bf16, uint16_t)
DEF_TILE(2, tb2, load_w_bf16, uint16_t)
DEF_TILE(3, tb3, load_w_bf16, uint16_t)
DEF_TILE(4, tb4, load_w_bf16, uint16_t)
DEF_TILE(5, tb5, load_w_bf16, uint16_t)
DEF_TILE(6, tb6, load_w_bf16, uint16_t)

typedef void (*tile_fn)(const void *, const float *, long, int, float *);
static const tile_fn TILES[2][TILE_T + 1] = {{0, tf1, tf2, tf3, tf4, tf5, tf6}, {0, tb1, tb2, tb3, tb4, tb5, tb6}};
#endif

#define PANELS_PER_TASK 4

typedef struct {
    gemm_args a;
    int panels, chunks, per, isa; /* per: panels a task */
} linear_job;

/* Task: a block of BLOCK_T tokens x `per` panels. */
static void linear_task(const void *ctx, long task) {
    const linear_job *j = (const linear_job *)ctx;
    const gemm_args *a = &j->a;
    float acc[BLOCK_T * PANEL];
    float wf[BLOCK_K * PANEL]; /* a bf16 slice widened once for all its tiles (exact) */
    int b0 = (int)(task / j->chunks) * BLOCK_T, p0 = (int)(task % j->chunks) * j->per;
    int bn = a->n - b0 < BLOCK_T ? a->n - b0 : BLOCK_T;
    int p1 = p0 + j->per < j->panels ? p0 + j->per : j->panels;
    int K = a->K, bf16 = a->bf16;
    for (int p = p0; p < p1; p++) {
        memset(acc, 0, sizeof(float) * bn * PANEL);
        for (int k0 = 0; k0 < K; k0 += BLOCK_K) {
            int kn = K - k0 < BLOCK_K ? K - k0 : BLOCK_K;
            long at = ((long)p * K + k0) * PANEL;
            const void *ws = bf16 ? (const void *)((const uint16_t *)a->w + at) : (const void *)((const float *)a->w + at);
            int wide = bf16 && bn > TILE_T;
            if (wide) {
                const uint16_t *src = (const uint16_t *)ws;
                for (int i = 0; i < kn * PANEL; i++) wf[i] = bf16_to_f32(src[i]);
                ws = wf;
            }
            for (int t0 = 0; t0 < bn; t0 += TILE_T) {
                int tn = bn - t0 < TILE_T ? bn - t0 : TILE_T;
                const float *xs = a->x + (long)(b0 + t0) * a->ldx + k0;
#if SF_X86
                if (j->isa >= 1) {
                    TILES[bf16 && !wide][tn](ws, xs, a->ldx, kn, acc + t0 * PANEL);
                    continue;
                }
#endif
                tile_scalar(ws, bf16 && !wide, xs, a->ldx, tn, kn, acc + t0 * PANEL);
            }
        }
        epilogue(a, acc, b0, bn, p * PANEL);
    }
}

int sf_linear(const float *x, long ldx, int n, int K, const void *w, int bf16, int out, const float *bias,
              float *y, long ldy, int resid, int nthreads) {
    if (n <= 0 || out <= 0) return 0;
    if (K <= 0 || nthreads < 1) return -1;
    linear_job j = {{x, ldx, n, K, out, w, bf16, bias, y, ldy, resid}, (out + PANEL - 1) / PANEL, 0, 0,
                    sf_cpu_isa()};
    long blocks = (n + BLOCK_T - 1) / BLOCK_T;
    j.per = PANELS_PER_TASK;
    while (blocks * ((j.panels + j.per - 1) / j.per) > MAX_TASKS) j.per *= 2; /* stay within the task field */
    j.chunks = (j.panels + j.per - 1) / j.per;
    parallel(linear_task, &j, blocks * j.chunks, nthreads);
    return 0;
}

/* ------------------------------------------------- dots and lane sums */

/* sum_i a[i] * b[i] (b as bf16 when bb), 8 lane chains and tree8. */
static float dot_scalar(const float *a, const void *b, int bb, int d) {
    float acc[8] = {0};
    for (int i = 0; i < d; i++) {
        float bv = bb ? bf16_to_f32(((const uint16_t *)b)[i]) : ((const float *)b)[i];
        acc[i % 8] = fmaf(a[i], bv, acc[i % 8]);
    }
    return tree8(acc);
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const void *b, int bb, int d) {
    __m256 acc = _mm256_setzero_ps();
    if (bb) {
        const uint16_t *p = (const uint16_t *)b;
        for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_bf16x8(p + i), acc);
    } else {
        const float *p = (const float *)b;
        for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(p + i), acc);
    }
    return tree8_avx2(acc);
}

/* sum of x[0..n) (n a multiple of 8), lane chains by plain adds. */
__attribute__((target("avx2,fma"))) static float sum_avx2(const float *x, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    return tree8_avx2(acc);
}
#endif

static inline float dot(const float *a, const void *b, int bb, int d, int isa) {
#if SF_X86
    if (isa >= 1 && d % 8 == 0) return dot_avx2(a, b, bb, d);
#endif
    (void)isa;
    return dot_scalar(a, b, bb, d);
}

static float sum_scalar(const float *x, int n) {
    float acc[8] = {0};
    for (int i = 0; i < n; i++) acc[i % 8] = acc[i % 8] + x[i];
    return tree8(acc);
}

#if SF_X86
__attribute__((target("avx2,fma"))) static void exp_shift_avx2(float *x, int n, float m) {
    __m256 mm = _mm256_set1_ps(m);
    for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mm)));
}
#endif

/* x[0..n) in place to exp(x - m); n a multiple of 8. */
static void exp_shift(float *x, int n, float m, int isa) {
#if SF_X86
    if (isa >= 1) {
        exp_shift_avx2(x, n, m);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < n; i++) x[i] = exp_scalar(x[i] - m);
}


/* ------------------------------------------------------------ RMSNorm */

/* y[t] = w * (x[t] * (1 / sqrt(mean(x[t]^2) + eps))), rows of d. */
/* Rows per task of a row-wise kernel: enough work to outweigh a claim. */
static inline int rows_per_task(int width) { return width >= 8192 ? 1 : 8192 / (width > 0 ? width : 1); }

typedef struct {
    const float *x, *w;
    long ldx, ldy;
    int n, d, isa, rows;
    float eps;
    float *y;
} norm_job;

static void rmsnorm_task(const void *ctx, long task) {
    const norm_job *j = (const norm_job *)ctx;
    for (long t = task * j->rows; t < j->n && t < (task + 1) * j->rows; t++) {
        const float *xr = j->x + t * j->ldx;
        float *yr = j->y + t * j->ldy;
        float inv = 1.0f / sqrtf(dot(xr, xr, 0, j->d, j->isa) / (float)j->d + j->eps);
        for (int i = 0; i < j->d; i++) yr[i] = j->w[i] * (xr[i] * inv);
    }
}

int sf_rmsnorm(const float *x, long ldx, int n, int d, const float *w, float eps, float *y, long ldy,
               int nthreads) {
    norm_job j = {x, w, ldx, ldy, n, d, sf_cpu_isa(), rows_per_task(d), eps, y};
    parallel(rmsnorm_task, &j, (n + j.rows - 1) / j.rows, nthreads);
    return 0;
}

/* ------------------------------------------------------------- SwiGLU */

#if SF_X86
__attribute__((target("avx2,fma"))) static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

__attribute__((target("avx2,fma"))) static void silu_mul_row_avx2(const float *g, const float *u, float *o, int inter) {
    int i = 0;
    for (; i + 8 <= inter; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < inter) { /* the tail through the same vector code, zero-padded */
        float gb[8] = {0}, ub[8] = {0}, ob[8];
        memcpy(gb, g + i, sizeof(float) * (inter - i));
        memcpy(ub, u + i, sizeof(float) * (inter - i));
        _mm256_storeu_ps(ob, silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
        memcpy(o + i, ob, sizeof(float) * (inter - i));
    }
}
#endif

/* out[t, i] = silu(g) * u, g = gu[t, i], u = gu[t, inter + i];
 * silu(g) = g / (1 + exp(-g)). */
typedef struct {
    const float *gu;
    long ldg, ldo;
    int n, inter, isa, rows;
    float *out;
} silu_job;

static void silu_task(const void *ctx, long task) {
    const silu_job *j = (const silu_job *)ctx;
    for (long t = task * j->rows; t < j->n && t < (task + 1) * j->rows; t++) {
        const float *g = j->gu + t * j->ldg, *u = g + j->inter;
        float *o = j->out + t * j->ldo;
#if SF_X86
        if (j->isa >= 1) {
            silu_mul_row_avx2(g, u, o, j->inter);
            continue;
        }
#endif
        for (int i = 0; i < j->inter; i++) o[i] = (g[i] / (1.0f + exp_scalar(0.0f - g[i]))) * u[i];
    }
}

int sf_silu_mul(const float *gu, long ldg, int n, int inter, float *out, long ldo, int nthreads) {
    silu_job j = {gu, ldg, ldo, n, inter, sf_cpu_isa(), rows_per_task(inter), out};
    parallel(silu_task, &j, (n + j.rows - 1) / j.rows, nthreads);
    return 0;
}

/* ---------------------------------------------------------- attention */

typedef struct {
    float *qkv; /* [n, (nh + 2 nkv) hd], q and k rotated in place */
    long ldqkv;
    int n, nh, nkv, hd;
    const int64_t *pos, *cells, *feed_of, *tables;
    int width; /* columns of tables */
    const float *cos, *sin; /* [max_len, hd / 2] */
    const float *qn, *kn; /* per-head RMSNorm weights [hd], or NULL */
    float eps;
    void *kp, *vp; /* one layer's pool, heads-major [nkv][cells][hd] */
    int kv_bf16;
    long head_stride; /* elements between kv heads */
    int page;
    float scale;
    float *out; /* [n, nh hd] */
    long ldo;
} attn_args;

static void norm_rope(const attn_args *a, float *v, int64_t p, const float *nw, int isa) {
    int hd = a->hd, half = hd / 2;
    if (nw) {
        float inv = 1.0f / sqrtf(dot(v, v, 0, hd, isa) / (float)hd + a->eps);
        for (int i = 0; i < hd; i++) v[i] = nw[i] * (v[i] * inv);
    }
    const float *c = a->cos + p * half, *s = a->sin + p * half;
    for (int i = 0; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static void store_cell(const attn_args *a, void *pool, int g, int64_t cell, const float *src) {
    long at = g * a->head_stride + cell * a->hd;
    if (a->kv_bf16) {
        uint16_t *d = (uint16_t *)pool + at;
        for (int i = 0; i < a->hd; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)pool + at, src, sizeof(float) * a->hd);
    }
}

static inline const void *cell_ptr(const attn_args *a, const void *pool, int g, int64_t cell) {
    long at = g * a->head_stride + cell * a->hd;
    return a->kv_bf16 ? (const void *)((const uint16_t *)pool + at) : (const void *)((const float *)pool + at);
}


#if SF_X86
/* Columns [c0, c0 + 8 NV) of o = sum_j e[j] v_j: NV accumulators kept in
 * registers across the keys (the same fma chain per element as below). */
#define VSUM_PASS(NV, NAME)                                                                                   \
    __attribute__((target("avx2,fma"))) static void NAME(const attn_args *a, int g, const int64_t *table,      \
                                                         int keys, const float *e, float *o, int c0) {        \
        __m256 r0 = _mm256_setzero_ps(), r1 = r0, r2 = r0, r3 = r0;                                           \
        for (int j = 0, b = 0, off = 0; j < keys; j++) {                                                      \
            int64_t cell = table[b] * a->page + off;                                                          \
            if (++off == a->page) off = 0, b++;                                                               \
            long at = g * a->head_stride + cell * a->hd + c0;                                                 \
            __m256 ev = _mm256_set1_ps(e[j]);                                                                 \
            if (a->kv_bf16) {                                                                                 \
                const uint16_t *v = (const uint16_t *)a->vp + at;                                             \
                r0 = _mm256_fmadd_ps(ev, load_bf16x8(v), r0);                                                 \
                if (NV > 1) r1 = _mm256_fmadd_ps(ev, load_bf16x8(v + 8), r1);                                 \
                if (NV > 2) r2 = _mm256_fmadd_ps(ev, load_bf16x8(v + 16), r2);                                \
                if (NV > 3) r3 = _mm256_fmadd_ps(ev, load_bf16x8(v + 24), r3);                                \
            } else {                                                                                          \
                const float *v = (const float *)a->vp + at;                                                   \
                r0 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v), r0);                                             \
                if (NV > 1) r1 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + 8), r1);                             \
                if (NV > 2) r2 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + 16), r2);                            \
                if (NV > 3) r3 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + 24), r3);                            \
            }                                                                                                 \
        }                                                                                                     \
        _mm256_storeu_ps(o + c0, r0);                                                                         \
        if (NV > 1) _mm256_storeu_ps(o + c0 + 8, r1);                                                         \
        if (NV > 2) _mm256_storeu_ps(o + c0 + 16, r2);                                                        \
        if (NV > 3) _mm256_storeu_ps(o + c0 + 24, r3);                                                        \
    }
VSUM_PASS(4, vsum4)
VSUM_PASS(1, vsum1)
#endif

/* o[0..d) = sum_j e[j] * v_j in key order, one fma chain per element from 0. */
static void value_sum(const attn_args *a, int g, const int64_t *table, int keys, const float *e, float *o,
                      int isa) {
    int hd = a->hd;
#if SF_X86
    if (isa >= 1 && hd % 8 == 0) {
        int c = 0;
        for (; c + 32 <= hd; c += 32) vsum4(a, g, table, keys, e, o, c);
        for (; c < hd; c += 8) vsum1(a, g, table, keys, e, o, c);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int j = 0, b = 0, off = 0; j < keys; j++) {
        int64_t cell = table[b] * a->page + off;
        if (++off == a->page) off = 0, b++;
        const void *vp = cell_ptr(a, a->vp, g, cell);
        float ej = e[j];
        if (a->kv_bf16) {
            const uint16_t *v = (const uint16_t *)vp;
            for (int i = 0; i < hd; i++) o[i] = fmaf(ej, bf16_to_f32(v[i]), o[i]);
        } else {
            const float *v = (const float *)vp;
            for (int i = 0; i < hd; i++) o[i] = fmaf(ej, v[i], o[i]);
        }
    }
}

static _Thread_local float *t_scores;
static _Thread_local long t_cap;

static float *scores_buf(long n) {
    if (n > t_cap) {
        free(t_scores);
        t_scores = (float *)malloc(sizeof(float) * n);
        t_cap = t_scores ? n : 0;
    }
    return t_scores;
}

/* One layer: q/k norm (Qwen3) and RoPE in place, this step's K/V written
 * to their cells, then each (token, kv head) attends over cells 0..pos of
 * its own sequence. Returns -1 when scratch memory cannot be had. */
typedef struct {
    attn_args a;
    int isa, chunk; /* tokens per phase-2 task */
    _Atomic int failed;
} attn_job;

#define STORE_CHUNK 16

static void store_token(const attn_job *j, long t);

/* Phase 1, STORE_CHUNK tokens: q/k norm and RoPE in place, K/V into their cells. */
static void attn_store_task(const void *ctx, long task) {
    const attn_job *j = (const attn_job *)ctx;
    for (long t = task * STORE_CHUNK; t < j->a.n && t < (task + 1) * STORE_CHUNK; t++) store_token(j, t);
}

static void store_token(const attn_job *j, long t) {
    const attn_args *a = &j->a;
    int hd = a->hd;
    float *q = a->qkv + t * a->ldqkv, *k = q + (long)a->nh * hd, *v = k + (long)a->nkv * hd;
    for (int h = 0; h < a->nh; h++) norm_rope(a, q + (long)h * hd, a->pos[t], a->qn, j->isa);
    for (int g = 0; g < a->nkv; g++) {
        norm_rope(a, k + (long)g * hd, a->pos[t], a->kn, j->isa);
        store_cell(a, a->kp, g, a->cells[t], k + (long)g * hd);
        store_cell(a, a->vp, g, a->cells[t], v + (long)g * hd);
    }
}

static void attend(attn_job *j, int t, int g);

/* Phase 2, (a chunk of tokens, a kv head): their query heads over cells 0..pos. */
static void attn_task(const void *ctx, long task) {
    attn_job *j = (attn_job *)ctx;
    long chunks = (j->a.n + j->chunk - 1) / j->chunk;
    int g = (int)(task / chunks);
    for (long t = (task % chunks) * j->chunk; t < j->a.n && t < (task % chunks + 1) * j->chunk; t++)
        attend(j, (int)t, g);
}

static void attend(attn_job *j, int t, int g) {
    const attn_args *a = &j->a;
    int isa = j->isa, hd = a->hd, page = a->page, g_per = a->nh / a->nkv;
    int keys = (int)a->pos[t] + 1, padded = (keys + 7) / 8 * 8;
    const int64_t *table = a->tables + a->feed_of[t] * (long)a->width;
    float *s = scores_buf(padded);
    if (!s) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int h = g * g_per; h < (g + 1) * g_per; h++) {
        const float *q = a->qkv + (long)t * a->ldqkv + (long)h * hd;
        float m = -INFINITY;
        for (int i = 0, b = 0, off = 0; i < keys; i++) {
            int64_t cell = table[b] * page + off;
            if (++off == page) off = 0, b++;
            float si = dot(q, cell_ptr(a, a->kp, g, cell), a->kv_bf16, hd, isa) * a->scale;
            s[i] = si;
            if (si > m) m = si;
        }
        for (int i = keys; i < padded; i++) s[i] = -INFINITY;
        exp_shift(s, padded, m, isa);
#if SF_X86
        float l = isa >= 1 ? sum_avx2(s, padded) : sum_scalar(s, padded);
#else
        float l = sum_scalar(s, padded);
#endif
        float *o = a->out + (long)t * a->ldo + (long)h * hd;
        value_sum(a, g, table, keys, s, o, isa);
        for (int i = 0; i < hd; i++) o[i] = o[i] / l;
    }
}

/* One layer: phase 1 for every token, then phase 2 (every cell of the step
 * is written before any is read). Returns -1 when scratch memory cannot be had. */
int sf_attention(float *qkv, long ldqkv, int n, int nh, int nkv, int hd, const int64_t *pos,
                 const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, const float *cos,
                 const float *sin, const float *qn, const float *kn, float eps, void *kp, void *vp, int kv_bf16,
                 long head_stride, int page, float scale, float *out, long ldo, int nthreads) {
    if (n <= 0) return 0;
    attn_job j = {{qkv, ldqkv, n, nh, nkv, hd, pos, cells, feed_of, tables, width, cos, sin, qn, kn, eps, kp, vp,
                   kv_bf16, head_stride, page, scale, out, ldo},
                  sf_cpu_isa(), 1, 0};
    double keys = 0;
    for (int t = 0; t < n; t++) keys += (double)pos[t] + 1;
    double work = keys / n * hd * (nh / nkv); /* per (token, kv head) */
    j.chunk = work >= 16384 ? 1 : (int)(16384 / work);
    if (j.chunk > n) j.chunk = n;
    parallel(attn_store_task, &j, (n + STORE_CHUNK - 1) / STORE_CHUNK, nthreads);
    parallel(attn_task, &j, (long)((n + j.chunk - 1) / j.chunk) * nkv, nthreads);
    return atomic_load(&j.failed) ? -1 : 0;
}

/* ---------------------------------------------------------- embedding */

/* out[t] = table[ids[t]] as float32 (table float32 or bf16), rows of d. */
int sf_embed(const void *table, int bf16, int d, const int64_t *ids, int n, float *out) {
    for (int t = 0; t < n; t++) {
        if (bf16) {
            const uint16_t *r = (const uint16_t *)table + ids[t] * (long)d;
            for (int i = 0; i < d; i++) out[(long)t * d + i] = bf16_to_f32(r[i]);
        } else {
            memcpy(out + (long)t * d, (const float *)table + ids[t] * (long)d, sizeof(float) * d);
        }
    }
    return 0;
}

/* ------------------------------------------------------ the whole stack */

/* Every decoder layer of a step in one call (one Python call a step instead
 * of seven a layer: at batch 1 those calls were a third of the step). The
 * same kernels, in the same order, as the layer-by-layer path. x [n, hidden]
 * is the residual stream, in and out; the rest is scratch. */
int sf_forward(const sf_model *m, float *x, int n, const int64_t *pos, const int64_t *cells,
               const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
               float *gu, float *act, int nthreads) {
    int H = m->hidden, q = m->nh * m->hd, qkvw = (m->nh + 2 * m->nkv) * m->hd;
    for (int l = 0; l < m->n_layers; l++) {
        const sf_layer *L = &m->layers[l];
        int rc = sf_rmsnorm(x, H, n, H, L->attn_norm, m->eps, h, H, nthreads);
        rc |= sf_linear(h, H, n, H, L->qkv, m->bf16, qkvw, L->qkv_b, qkv, qkvw, 0, nthreads);
        rc |= sf_attention(qkv, qkvw, n, m->nh, m->nkv, m->hd, pos, cells, feed_of, tables, width, m->cos, m->sin,
                           L->q_norm, L->k_norm, m->eps, L->k_pool, L->v_pool, m->kv_bf16, m->head_stride,
                           m->page, m->scale, att, q, nthreads);
        rc |= sf_linear(att, q, n, q, L->o, m->bf16, H, L->o_b, x, H, 1, nthreads);
        rc |= sf_rmsnorm(x, H, n, H, L->mlp_norm, m->eps, h, H, nthreads);
        rc |= sf_linear(h, H, n, H, L->gate_up, m->bf16, 2 * m->inter, L->gate_up_b, gu, 2 * m->inter, 0, nthreads);
        rc |= sf_silu_mul(gu, 2 * m->inter, n, m->inter, act, m->inter, nthreads);
        rc |= sf_linear(act, m->inter, n, m->inter, L->down, m->bf16, H, L->down_b, x, H, 1, nthreads);
        if (rc) return -1;
    }
    return 0;
}
