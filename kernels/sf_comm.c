/* A shared-memory collective for the ranks of one tensor-parallel group on
 * one node (kernels/comm.py wraps it): all_gather and a broadcast from rank
 * 0, in lockstep, through one file mapped MAP_SHARED by every rank.
 *
 * Layout (every part 64-byte aligned, so no two ranks write one line):
 *   header   magic, version, world, slot_bytes, ready       (HDR bytes)
 *   ctrl[r]  rank r's sequence number: one cache line each   (world * LINE)
 *   slot[r][b], b = seq & 1: a slot header (seq, kind, nbytes) and its data
 * Calls are numbered 1, 2, ... by every rank alike (the caller's counter).
 * A rank stores ctrl[r] = k (release) only once it has finished every read
 * of calls < k, and, where it sends at call k, after writing slot[r][k & 1];
 * a reader observes ctrl[w] >= k (acquire) before it reads slot[w][k & 1].
 *
 * Why double-buffered slots cannot race: rank w writes slot[w][k & 1] at
 * call k only after it has seen ctrl[p] >= k - 1 for every peer p, i.e.
 * after every peer has finished its reads of calls <= k - 2, the last call
 * that used that slot; call k - 1 uses the other one. And a reader of call
 * k cannot see call k + 2's data there: w writes it only after seeing the
 * reader's ctrl >= k + 1, which the reader stores after its reads of call k.
 *
 * Waits spin (pause) ~SPIN_NS, then sched_yield until YIELD_NS, then sleep
 * doubling from 10 us to MAX_SLEEP_NS: 4 single-thread ranks on 2 cores
 * still progress, and a follower idle until the next step costs ~no CPU.
 * Every wait has a CLOCK_MONOTONIC deadline. Nothing here takes a lock. */
#define _GNU_SOURCE
#include "sf_cpu.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define MAGIC 0x314d4d4f43465355ull /* "USFCOMM1" little-endian */
#define VERSION 1u
#define LINE 64
#define HDR 128
#define SLOT_HDR 64
#define MAX_WORLD 64
#define MAX_SLOT (1ll << 40)
#define SPIN_NS 20000ll
#define YIELD_NS 500000ll
#define MIN_SLEEP_NS 10000ll
#define MAX_SLEEP_NS 200000ll

enum { KIND_GATHER = 1, KIND_BCAST = 2 };

typedef struct {
    uint64_t magic;
    uint32_t version, world;
    uint64_t slot_bytes;
    uint32_t ready; /* 0 until the creator has sized the file and written the rest (release) */
} header;

typedef struct {
    uint64_t seq;
    uint32_t kind, pad;
    uint64_t nbytes;
} slot_header;

static int64_t slot_stride(int64_t slot_bytes) { return SLOT_HDR + (slot_bytes + LINE - 1) / LINE * LINE; }

int64_t sf_comm_segment_bytes(int world, int64_t slot_bytes) {
    if (world < 1 || world > MAX_WORLD || slot_bytes < 1 || slot_bytes > MAX_SLOT) return -1;
    return HDR + (int64_t)world * LINE + (int64_t)world * 2 * slot_stride(slot_bytes);
}

static uint64_t *ctrl(void *seg, int r) { return (uint64_t *)((char *)seg + HDR + (int64_t)r * LINE); }

static slot_header *slot(void *seg, int world, int64_t slot_bytes, int r, uint64_t seq) {
    int64_t off = HDR + (int64_t)world * LINE + ((int64_t)r * 2 + (int64_t)(seq & 1)) * slot_stride(slot_bytes);
    return (slot_header *)((char *)seg + off);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000ll + t.tv_nsec;
}

/* Nanoseconds from now to the deadline timeout_s away (capped at ~292 years). */
static int64_t deadline_after(double timeout_s) {
    double ns = timeout_s * 1e9;
    return now_ns() + (ns > 9e18 ? (int64_t)9e18 : (int64_t)ns);
}

typedef struct {
    int64_t start, deadline, sleep_ns;
    unsigned n, phase; /* 0 spin, 1 yield, 2 sleep */
} backoff;

static backoff backoff_init(int64_t deadline) { return (backoff){now_ns(), deadline, MIN_SLEEP_NS, 0, 0}; }

/* One step of waiting; 0 once past the deadline. Spinning reads the clock
 * every 32 pauses, yielding and sleeping at every step. */
static int backoff_step(backoff *b) {
    if (b->phase == 0 && (++b->n & 31)) {
        cpu_relax();
        return 1;
    }
    int64_t t = now_ns();
    if (t >= b->deadline) return 0;
    if (b->phase == 0 && t - b->start >= SPIN_NS) b->phase = 1;
    if (b->phase == 1 && t - b->start >= YIELD_NS) b->phase = 2;
    if (b->phase == 0) {
        cpu_relax();
    } else if (b->phase == 1) {
        sched_yield();
    } else {
        int64_t left = b->deadline - t;
        struct timespec d = {0, (long)(b->sleep_ns < left ? b->sleep_ns : left)};
        nanosleep(&d, NULL);
        b->sleep_ns = b->sleep_ns * 2 < MAX_SLEEP_NS ? b->sleep_ns * 2 : MAX_SLEEP_NS;
    }
    return 1;
}

static uint64_t load_acq(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* The peers in `want` whose ctrl is still below `target`. */
static uint64_t behind(void *seg, uint64_t want, uint64_t target) {
    uint64_t m = 0;
    for (int r = 0; r < MAX_WORLD; r++)
        if ((want >> r & 1) && load_acq(ctrl(seg, r)) < target) m |= 1ull << r;
    return m;
}

static uint64_t all_but(int world, int rank) {
    uint64_t all = world == 64 ? ~0ull : (1ull << world) - 1;
    return all & ~(1ull << rank);
}

/* Until every rank in `want` has ctrl >= target; else SF_COMM_TIMEOUT with
 * the laggards in *missing. */
static int wait_all(void *seg, uint64_t want, uint64_t target, int64_t deadline, uint64_t *missing) {
    backoff b = backoff_init(deadline);
    for (;;) {
        uint64_t m = behind(seg, want, target);
        if (!m) return 0;
        if (!backoff_step(&b)) {
            *missing = behind(seg, want, target);
            return *missing ? SF_COMM_TIMEOUT : 0;
        }
    }
}

int sf_comm_create(const char *path, int world, int64_t slot_bytes, void **seg) {
    int64_t size = sf_comm_segment_bytes(world, slot_bytes);
    if (size < 0) return SF_COMM_BAD_ARG;
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return SF_COMM_ERRNO;
    /* fallocate, not ftruncate: a full /dev/shm fails here rather than as
     * SIGBUS at some later first touch; tmpfs hands out zeroed pages. */
    int e = posix_fallocate(fd, 0, (off_t)size);
    void *p = MAP_FAILED;
    if (e == 0) {
        p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) e = errno;
    }
    close(fd);
    if (e) {
        unlink(path);
        errno = e;
        return SF_COMM_ERRNO;
    }
    header *h = p;
    h->magic = MAGIC;
    h->version = VERSION;
    h->world = (uint32_t)world;
    h->slot_bytes = (uint64_t)slot_bytes;
    __atomic_store_n(&h->ready, 1u, __ATOMIC_RELEASE);
    *seg = p;
    return 0;
}

/* Map the creator's file once its header is ready (waiting for the file,
 * its size and the flag until timeout_s). The mapping's size follows the
 * header; the caller compares world and slot_bytes with its own. */
int sf_comm_attach(const char *path, double timeout_s, void **seg, int64_t *seg_bytes) {
    int64_t deadline = deadline_after(timeout_s);
    backoff b = backoff_init(deadline);
    int fd;
    struct stat st;
    for (;;) { /* the file, at least a header long */
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            if (fstat(fd, &st) < 0) {
                int e = errno;
                close(fd);
                errno = e;
                return SF_COMM_ERRNO;
            }
            if (st.st_size >= HDR) break;
            close(fd);
        } else if (errno != ENOENT) {
            return SF_COMM_ERRNO;
        }
        if (!backoff_step(&b)) return SF_COMM_TIMEOUT;
    }
    header *h = mmap(NULL, HDR, PROT_READ, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
        int e = errno;
        close(fd);
        errno = e;
        return SF_COMM_ERRNO;
    }
    int rc = 0;
    while (!__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE))
        if (!backoff_step(&b)) {
            rc = SF_COMM_TIMEOUT;
            break;
        }
    int64_t size = 0;
    if (rc == 0 && (h->magic != MAGIC || h->version != VERSION)) rc = SF_COMM_BAD_HEADER;
    if (rc == 0) {
        size = sf_comm_segment_bytes((int)h->world, (int64_t)h->slot_bytes);
        if (size < 0 || fstat(fd, &st) < 0 || st.st_size < size) rc = SF_COMM_BAD_HEADER;
    }
    munmap(h, HDR);
    void *p = MAP_FAILED;
    if (rc == 0) {
        p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) rc = SF_COMM_ERRNO;
    }
    int e = errno;
    close(fd);
    errno = e;
    if (rc) return rc;
    *seg = p;
    *seg_bytes = size;
    return 0;
}

/* magic, version, world, slot_bytes of a mapped segment, into out[4]. */
void sf_comm_header(const void *seg, uint64_t *out) {
    const header *h = seg;
    out[0] = h->magic;
    out[1] = h->version;
    out[2] = h->world;
    out[3] = h->slot_bytes;
}

int sf_comm_unmap(void *seg, int64_t seg_bytes) { return munmap(seg, (size_t)seg_bytes) ? SF_COMM_ERRNO : 0; }

static int valid(void *seg, int world, int rank, uint64_t seq, int64_t nbytes) {
    if (!seg || sf_comm_segment_bytes(world, 1) < 0 || rank < 0 || rank >= world || seq < 1 || nbytes < 0) return 0;
    const header *h = seg;
    return (int)h->world == world && nbytes <= (int64_t)h->slot_bytes;
}

/* Call `seq`: out[r * nbytes ...] = rank r's src for every rank r. Peers'
 * sizes must be nbytes too (else SF_COMM_MISMATCH, them in *missing). src
 * may lie in out (e.g. out's row `rank`). SF_COMM_TIMEOUT: nothing was
 * published, the call may be made again; SF_COMM_TIMEOUT_SENT: this rank's
 * part was, so the call is spent. */
int sf_comm_all_gather(void *seg, int world, int rank, uint64_t seq, const void *src, int64_t nbytes, void *out,
                       double timeout_s, uint64_t *missing) {
    *missing = 0;
    if (!valid(seg, world, rank, seq, nbytes)) return SF_COMM_BAD_ARG;
    int64_t deadline = deadline_after(timeout_s), slot_bytes = (int64_t)((header *)seg)->slot_bytes;
    uint64_t peers = all_but(world, rank);
    int rc = wait_all(seg, peers, seq - 1, deadline, missing); /* every peer done with call seq - 2 */
    if (rc) return rc;
    slot_header *mine = slot(seg, world, slot_bytes, rank, seq);
    mine->seq = seq;
    mine->kind = KIND_GATHER;
    mine->nbytes = (uint64_t)nbytes;
    memcpy(mine + 1, src, (size_t)nbytes);
    __atomic_store_n(ctrl(seg, rank), seq, __ATOMIC_RELEASE);
    memmove((char *)out + (int64_t)rank * nbytes, src, (size_t)nbytes); /* before a peer's row covers src */
    /* Each peer's data as soon as it is there, in whatever order they come. */
    uint64_t todo = peers, bad = 0;
    backoff b = backoff_init(deadline);
    while (todo) {
        uint64_t got = 0;
        for (int r = 0; r < world; r++) {
            if (!(todo >> r & 1) || load_acq(ctrl(seg, r)) < seq) continue;
            got |= 1ull << r;
            const slot_header *s = slot(seg, world, slot_bytes, r, seq);
            if (s->seq != seq || s->kind != KIND_GATHER || s->nbytes != (uint64_t)nbytes)
                bad |= 1ull << r;
            else
                memcpy((char *)out + (int64_t)r * nbytes, s + 1, (size_t)nbytes);
        }
        todo &= ~got;
        if (todo && !got && !backoff_step(&b)) {
            *missing = behind(seg, todo, seq);
            if (*missing) return SF_COMM_TIMEOUT_SENT;
        }
    }
    if (bad) {
        *missing = bad;
        return SF_COMM_MISMATCH;
    }
    return 0;
}

/* Call `seq`: rank 0's nbytes of src; the others get them in out (capacity
 * cap) and their count in *got. Rank 0 returns once its data is published
 * (the others read it after); it first waits until every peer is done
 * reading the broadcast before last. A timeout here publishes nothing, on
 * any rank: the call may be made again (a follower idle between steps). */
int sf_comm_broadcast(void *seg, int world, int rank, uint64_t seq, const void *src, int64_t nbytes, void *out,
                      int64_t cap, int64_t *got, double timeout_s, uint64_t *missing) {
    *missing = 0;
    *got = 0;
    if (!valid(seg, world, rank, seq, rank == 0 ? nbytes : 0) || (rank != 0 && cap < 0)) return SF_COMM_BAD_ARG;
    int64_t deadline = deadline_after(timeout_s), slot_bytes = (int64_t)((header *)seg)->slot_bytes;
    if (rank == 0) {
        int rc = wait_all(seg, all_but(world, 0), seq - 1, deadline, missing);
        if (rc) return rc;
        slot_header *mine = slot(seg, world, slot_bytes, 0, seq);
        mine->seq = seq;
        mine->kind = KIND_BCAST;
        mine->nbytes = (uint64_t)nbytes;
        memcpy(mine + 1, src, (size_t)nbytes);
        __atomic_store_n(ctrl(seg, 0), seq, __ATOMIC_RELEASE);
        *got = nbytes;
        return 0;
    }
    int rc = wait_all(seg, 1, seq, deadline, missing);
    if (rc) return rc;
    const slot_header *s = slot(seg, world, slot_bytes, 0, seq);
    if (s->seq != seq || s->kind != KIND_BCAST || (int64_t)s->nbytes > cap) {
        *missing = 1;
        return SF_COMM_MISMATCH;
    }
    memcpy(out, s + 1, (size_t)s->nbytes);
    *got = (int64_t)s->nbytes;
    __atomic_store_n(ctrl(seg, rank), seq, __ATOMIC_RELEASE); /* done reading call seq */
    return 0;
}
