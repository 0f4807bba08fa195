/*
 * sf_ring.c — the shared-memory primitives of superfluid.h: atomics, the
 * futex, SPSC slot queues and data rings. One implementation for every
 * language: Python compiles it through cffi, a Rust/Go/C planner links it.
 *
 * Ordering: a counter store that hands data to the other side is a release
 * (seq_cst where it pairs with a "sleeping" flag, Dekker style, so a wake-up
 * cannot be lost); the load that takes it is an acquire.
 */
#define _GNU_SOURCE
#include "superfluid.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define RELAXED __ATOMIC_RELAXED
#define ACQUIRE __ATOMIC_ACQUIRE
#define RELEASE __ATOMIC_RELEASE
#define SEQ_CST __ATOMIC_SEQ_CST

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

uint64_t sf_load_acquire_u64(const uint64_t *p) { return __atomic_load_n(p, ACQUIRE); }
void sf_store_release_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, RELEASE); }
uint32_t sf_load_acquire_u32(const uint32_t *p) { return __atomic_load_n(p, ACQUIRE); }
void sf_store_release_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, RELEASE); }
uint64_t sf_fetch_add_u64(uint64_t *p, uint64_t v) { return __atomic_fetch_add(p, v, SEQ_CST); }

uint64_t sf_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int sf_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts, *tp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        tp = &ts;
    }
    /* Not FUTEX_PRIVATE: the word lives in a mapping shared between processes. */
    long r = syscall(SYS_futex, addr, FUTEX_WAIT, expected, tp, NULL, 0);
    if (r == 0 || errno == EAGAIN || errno == EINTR)
        return 0;
    if (errno == ETIMEDOUT)
        return 1;
    return -errno;
}

int sf_futex_wake(uint32_t *addr, int32_t n) {
    long r = syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
    return r < 0 ? -errno : (int)r;
}

/* The low 32 bits of a counter, as a futex word (little-endian only). */
static inline uint32_t *low_word(uint64_t *counter) { return (uint32_t *)(void *)counter; }

static int peer_check(const SegmentHeader *seg, uint64_t epoch, int watch_stop) {
    if (seg == NULL)
        return SF_WAIT_READY;
    if (__atomic_load_n(&seg->worker_epoch, ACQUIRE) != epoch)
        return SF_WAIT_GONE;
    uint32_t state = __atomic_load_n(&seg->worker_state, ACQUIRE);
    if (state == SF_WORKER_STOPPED || state == SF_WORKER_DEAD || state == SF_WORKER_GAVE_UP)
        return SF_WAIT_GONE;
    /* A worker killed before the daemon could mark it (or with no daemon
     * left to) is gone all the same. */
    uint32_t pid = __atomic_load_n(&seg->worker_pid, ACQUIRE);
    if (state == SF_WORKER_READY && pid != 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return SF_WAIT_GONE;
    if (watch_stop && __atomic_load_n(&seg->stop_requested, ACQUIRE))
        return SF_WAIT_STOP;
    return SF_WAIT_READY;
}

/* ---------------------------------------------------------------- names */

const char *sf_status_name(uint32_t v) {
    switch (v) {
    case SF_STATUS_OK: return "OK";
    case SF_STATUS_RejectIllegalCombination: return "RejectIllegalCombination";
    case SF_STATUS_RejectBudget: return "RejectBudget";
    case SF_STATUS_RejectBounds: return "RejectBounds";
    case SF_STATUS_RejectUnknownLane: return "RejectUnknownLane";
    case SF_STATUS_RejectHostRules: return "RejectHostRules";
    case SF_STATUS_RejectStaleNonce: return "RejectStaleNonce";
    case SF_STATUS_RejectStaleSeed: return "RejectStaleSeed";
    case SF_STATUS_RejectBadRefGeneration: return "RejectBadRefGeneration";
    case SF_STATUS_NeedsReplan: return "NeedsReplan";
    case SF_STATUS_Fatal: return "Fatal";
    case SF_STATUS_StaleSession: return "StaleSession";
    default: return "unknown";
    }
}

const char *sf_opst_name(uint32_t v) {
    switch (v) {
    case SF_OPST_OK: return "OK";
    case SF_OPST_BadRequest: return "BadRequest";
    case SF_OPST_UnknownOp: return "UnknownOp";
    case SF_OPST_UnknownHandle: return "UnknownHandle";
    case SF_OPST_Refused: return "Refused";
    case SF_OPST_Unsupported: return "Unsupported";
    case SF_OPST_NoMatch: return "NoMatch";
    case SF_OPST_Capacity: return "Capacity";
    case SF_OPST_StaleSession: return "StaleSession";
    default: return "unknown";
    }
}

const char *sf_worker_state_name(uint32_t v) {
    switch (v) {
    case SF_WORKER_EMPTY: return "EMPTY";
    case SF_WORKER_STARTING: return "STARTING";
    case SF_WORKER_READY: return "READY";
    case SF_WORKER_STOPPING: return "STOPPING";
    case SF_WORKER_STOPPED: return "STOPPED";
    case SF_WORKER_DEAD: return "DEAD";
    case SF_WORKER_GAVE_UP: return "GAVE_UP";
    default: return "unknown";
    }
}

const char *sf_msg_kind_name(uint32_t v) {
    switch (v) {
    case SF_MSG_PLAN: return "PLAN";
    case SF_MSG_EVENTS: return "EVENTS";
    case SF_MSG_OP: return "OP";
    case SF_MSG_OP_EVENTS: return "OP_EVENTS";
    case SF_MSG_PARTIAL: return "PARTIAL";
    case SF_MSG_WORKER: return "WORKER";
    case SF_MSG_RESET: return "RESET";
    default: return "unknown";
    }
}

const char *sf_op_name(uint32_t v) {
    switch (v) {
    case SF_OP_DESCRIBE: return "DESCRIBE";
    case SF_OP_LEASE_SEED: return "LEASE_SEED";
    case SF_OP_RELEASE_SEED: return "RELEASE_SEED";
    case SF_OP_REGISTER_GRAMMAR: return "REGISTER_GRAMMAR";
    case SF_OP_RELEASE_GRAMMAR: return "RELEASE_GRAMMAR";
    case SF_OP_REGISTER_LOGIT_BIAS: return "REGISTER_LOGIT_BIAS";
    case SF_OP_RELEASE_LOGIT_BIAS: return "RELEASE_LOGIT_BIAS";
    case SF_OP_INSTALL_STRATEGY: return "INSTALL_STRATEGY";
    case SF_OP_EXPORT_ENTRY: return "EXPORT_ENTRY";
    case SF_OP_IMPORT_STATE: return "IMPORT_STATE";
    case SF_OP_INJECT_FAULT: return "INJECT_FAULT";
    case SF_OP_CACHE_CLEAR: return "CACHE_CLEAR";
    case SF_OP_LIST_LANES: return "LIST_LANES";
    case SF_OP_RETIRE_LANES: return "RETIRE_LANES";
    case SF_OP_INSTALL_FAULTS: return "INSTALL_FAULTS";
    case SF_OP_LIST_FAULTS: return "LIST_FAULTS";
    case SF_OP_CLEAR_FAULTS: return "CLEAR_FAULTS";
    default: return "unknown";
    }
}

/* -------------------------------------------------------------- sessions */

int sf_segment_check(const SegmentHeader *seg, uint64_t mapped_bytes) {
    if (mapped_bytes < sizeof(SegmentHeader))
        return SF_CONNECT_SHORT;
    if (__atomic_load_n(&seg->magic, ACQUIRE) != SF_MAGIC)
        return SF_CONNECT_MAGIC;
    if (seg->abi_version != SF_ABI_VERSION || seg->header_bytes != sizeof(SegmentHeader))
        return SF_CONNECT_ABI;
    if (seg->segment_bytes != mapped_bytes)
        return SF_CONNECT_SIZE;
    if (seg->owner_uid != (uint32_t)geteuid())
        return SF_CONNECT_OWNER;
    return SF_CONNECT_OK;
}

SF_STATIC_ASSERT(SF_EWOULDBLOCK == EWOULDBLOCK, "SF_EWOULDBLOCK is this platform's EWOULDBLOCK");

int sf_session_lock(int fd) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0)
        return 0;
    return errno == EWOULDBLOCK ? -SF_EWOULDBLOCK : -errno;
}

int sf_session_unlock(int fd) { return flock(fd, LOCK_UN) == 0 ? 0 : -errno; }

/* 1-31 of [A-Za-z0-9_.-], starting with a letter or digit (rings/naming.py's NAME_RE). */
static int name_ok(const char *name) {
    size_t n = strnlen(name, SF_NAME_BYTES);
    if (n == 0 || n >= SF_NAME_BYTES)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        int alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (!alnum && (i == 0 || (c != '_' && c != '.' && c != '-')))
            return 0;
    }
    return 1;
}

/* One try: SF_CONNECT_OK with *out filled, else nothing is left open. */
static int open_once(const char *path, const char *name, uint32_t index, SegmentMap *out) {
    int fd;
    do
        fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == ENOENT)
            return SF_CONNECT_MISSING;
        return errno == ELOOP ? SF_CONNECT_FILE : -errno; /* ELOOP: a symlink */
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    int r = SF_CONNECT_OK;
    if (!S_ISREG(st.st_mode))
        r = SF_CONNECT_FILE;
    else if (st.st_uid != geteuid())
        r = SF_CONNECT_OWNER;
    else if (st.st_mode & 077)
        r = SF_CONNECT_FILE;
    else if ((uint64_t)st.st_size < sizeof(SegmentHeader))
        r = SF_CONNECT_SHORT; /* made, not yet sized */
    if (r != SF_CONNECT_OK) {
        close(fd);
        return r;
    }
    size_t bytes = (size_t)st.st_size;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        return -e;
    }
    SegmentHeader *seg = (SegmentHeader *)p;
    r = sf_segment_check(seg, bytes);
    if (r == SF_CONNECT_OK) {
        /* The segment of this name and index, not one renamed over it. */
        size_t n = strlen(name);
        if (seg->worker_index != index || memcmp(seg->name, name, n) != 0 ||
            (n < SF_NAME_BYTES && seg->name[n] != 0))
            r = SF_CONNECT_NAME;
    }
    if (r != SF_CONNECT_OK) {
        munmap(p, bytes);
        close(fd);
        return r;
    }
    out->seg = seg;
    out->bytes = bytes;
    out->fd = fd;
    return SF_CONNECT_OK;
}

int sf_segment_open(const char *name, uint32_t index, int64_t timeout_ns, SegmentMap *out) {
    memset(out, 0, sizeof *out);
    out->fd = -1;
    if (name == NULL || !name_ok(name) || index > 0xFFFF)
        return SF_CONNECT_NAME;
    const char *dir = getenv("SUPERFLUID_SHM_DIR");
    if (dir == NULL || dir[0] == 0)
        dir = "/dev/shm";
    char path[PATH_MAX];
    int len = snprintf(path, sizeof path, "%s/superfluid.%s.%u", dir, name, index);
    if (len < 0 || (size_t)len >= sizeof path)
        return -ENAMETOOLONG;
    uint64_t deadline = timeout_ns < 0 ? UINT64_MAX : sf_monotonic_ns() + (uint64_t)timeout_ns;
    for (;;) {
        int r = open_once(path, name, index, out);
        /* Missing, short, no magic yet: a daemon may be making it (the magic goes last). */
        if (r != SF_CONNECT_MISSING && r != SF_CONNECT_SHORT && r != SF_CONNECT_MAGIC)
            return r;
        uint64_t now = sf_monotonic_ns();
        if (now >= deadline)
            return r;
        uint64_t nap = deadline - now < SF_WAIT_SLICE_NS ? deadline - now : SF_WAIT_SLICE_NS;
        struct timespec ts = {(time_t)(nap / 1000000000u), (long)(nap % 1000000000u)};
        nanosleep(&ts, NULL);
    }
}

void sf_segment_close(SegmentMap *m) {
    if (m->seg != NULL)
        munmap(m->seg, (size_t)m->bytes);
    if (m->fd >= 0)
        close(m->fd);
    m->seg = NULL;
    m->bytes = 0;
    m->fd = -1;
}

/* A process that is not there, or a zombie (dead, not yet reaped). */
static int pid_gone(uint32_t pid) {
    if (pid == 0)
        return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return 1;
    char path[32], buf[512];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0; /* no /proc: kill() alone */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close = strrchr(buf, ')');
    return close != NULL && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

int sf_wait_ready(const SegmentHeader *seg, uint64_t after_epoch, int64_t timeout_ns, uint64_t *epoch) {
    uint64_t deadline = timeout_ns < 0 ? UINT64_MAX : sf_monotonic_ns() + (uint64_t)timeout_ns;
    uint32_t *word = (uint32_t *)&seg->worker_state;
    for (;;) {
        uint32_t state = __atomic_load_n(word, ACQUIRE);
        uint64_t e = __atomic_load_n(&seg->worker_epoch, ACQUIRE);
        if (state == SF_WORKER_GAVE_UP || state == SF_WORKER_STOPPED)
            return SF_WAIT_GONE;
        if (pid_gone(__atomic_load_n(&seg->daemon_pid, ACQUIRE)))
            return SF_WAIT_GONE;
        if (state == SF_WORKER_READY && e > after_epoch &&
            !pid_gone(__atomic_load_n(&seg->worker_pid, ACQUIRE))) {
            *epoch = e;
            return SF_WAIT_READY;
        }
        uint64_t now = sf_monotonic_ns();
        if (now >= deadline)
            return SF_WAIT_TIMEOUT;
        /* In slices: a daemon that died cannot wake us. */
        uint64_t slice = deadline - now;
        if (slice > SF_WAIT_SLICE_NS)
            slice = SF_WAIT_SLICE_NS;
        sf_futex_wait(word, state, (int64_t)slice);
    }
}

uint64_t sf_session_begin(SegmentHeader *seg) {
    /* Above the header's count and the worker's own session (its report):
     * a count wound back, or scribbled far ahead to wrap, never hands out an
     * id already used. */
    uint64_t worker = __atomic_load_n(&seg->counters.session_id, ACQUIRE);
    uint64_t seen = __atomic_load_n(&seg->session_id, ACQUIRE);
    for (;;) {
        uint64_t base = seen;
        if (base < worker || base - worker > SF_SESSION_LEAD_MAX)
            base = worker;
        uint64_t id = base + 1 == 0 ? 1 : base + 1;
        if (__atomic_compare_exchange_n(&seg->session_id, &seen, id, 0, SEQ_CST, ACQUIRE))
            return id;
    }
}

void sf_set_worker_state(SegmentHeader *seg, uint32_t state) {
    __atomic_store_n(&seg->state_changed_ns, sf_monotonic_ns(), RELAXED);
    __atomic_store_n(&seg->worker_state, state, SEQ_CST);
    sf_futex_wake(&seg->worker_state, INT_MAX);
}

/* ---------------------------------------------------------------- queues */

uint64_t sf_queue_bytes(uint32_t n_slots, uint32_t slot_bytes) {
    return (uint64_t)sizeof(Queue) + (uint64_t)n_slots * slot_bytes;
}

static int geometry_ok(uint32_t n, uint32_t sb, uint64_t bytes) {
    if (bytes < sizeof(Queue))
        return 0;
    if (n == 0 || (n & (n - 1)) != 0 || sb < sizeof(MsgHeader) || sb % SF_CACHE_LINE != 0)
        return 0;
    return sf_queue_bytes(n, sb) <= bytes;
}

void sf_queue_init(void *queue, uint32_t n_slots, uint32_t slot_bytes) {
    Queue *q = (Queue *)queue;
    memset(q, 0, sizeof *q);
    q->n_slots = n_slots;
    q->slot_bytes = slot_bytes;
}

int sf_queue_attach(QueueView *v, void *queue, uint64_t bytes) {
    Queue *q = (Queue *)queue;
    if (bytes < sizeof(Queue))
        return -1;
    uint32_t n = q->n_slots, sb = q->slot_bytes;
    if (!geometry_ok(n, sb, bytes))
        return -1;
    v->q = q;
    v->slots = (uint8_t *)queue + sizeof(Queue);
    v->n_slots = n;
    v->slot_bytes = sb;
    return 0;
}

int sf_queue_attach_as(QueueView *v, void *queue, uint64_t bytes, uint32_t n_slots, uint32_t slot_bytes) {
    Queue *q = (Queue *)queue;
    if (!geometry_ok(n_slots, slot_bytes, bytes))
        return -1;
    if (q->n_slots != n_slots)
        q->n_slots = n_slots;
    if (q->slot_bytes != slot_bytes)
        q->slot_bytes = slot_bytes;
    v->q = q;
    v->slots = (uint8_t *)queue + sizeof(Queue);
    v->n_slots = n_slots;
    v->slot_bytes = slot_bytes;
    return 0;
}

int sf_queue_sane(const QueueView *v) {
    uint64_t tail = __atomic_load_n(&v->q->tail, ACQUIRE);
    uint64_t head = __atomic_load_n(&v->q->head, ACQUIRE);
    return head - tail <= v->n_slots;
}

uint64_t sf_queue_reset(QueueView *v) {
    uint64_t head = __atomic_load_n(&v->q->head, ACQUIRE);
    __atomic_store_n(&v->q->tail, head, SEQ_CST);
    sf_queue_wake_all(v);
    return head;
}

static inline uint8_t *slot_at(const QueueView *v, uint64_t i) {
    return v->slots + (size_t)(i & (v->n_slots - 1)) * v->slot_bytes;
}

uint8_t *sf_queue_try_reserve(QueueView *v) {
    uint64_t head = __atomic_load_n(&v->q->head, RELAXED);
    uint64_t tail = __atomic_load_n(&v->q->tail, ACQUIRE);
    if (head - tail >= v->n_slots)
        return NULL;
    return slot_at(v, head);
}

int sf_queue_publish(QueueView *v) {
    Queue *q = v->q;
    uint64_t head = __atomic_load_n(&q->head, RELAXED);
    if (head - __atomic_load_n(&q->tail, ACQUIRE) >= v->n_slots)
        return -1; /* nothing was reserved: publishing would overwrite an unread slot */
    __atomic_store_n(&q->head, head + 1, SEQ_CST);
    if (__atomic_load_n(&q->consumer_sleeping, SEQ_CST))
        sf_futex_wake(low_word(&q->head), INT_MAX);
    return 0;
}

uint8_t *sf_queue_try_peek(QueueView *v) {
    uint64_t tail = __atomic_load_n(&v->q->tail, RELAXED);
    if (__atomic_load_n(&v->q->head, ACQUIRE) == tail)
        return NULL;
    return slot_at(v, tail);
}

int sf_queue_release(QueueView *v) {
    Queue *q = v->q;
    uint64_t tail = __atomic_load_n(&q->tail, RELAXED);
    if (__atomic_load_n(&q->head, ACQUIRE) == tail)
        return -1; /* nothing was peeked: releasing would invent a message */
    __atomic_store_n(&q->tail, tail + 1, SEQ_CST);
    if (__atomic_load_n(&q->producer_sleeping, SEQ_CST))
        sf_futex_wake(low_word(&q->tail), INT_MAX);
    return 0;
}

uint64_t sf_queue_len(const QueueView *v) {
    uint64_t tail = __atomic_load_n(&v->q->tail, ACQUIRE);
    uint64_t head = __atomic_load_n(&v->q->head, ACQUIRE);
    return head - tail;
}

void sf_queue_wake_all(QueueView *v) {
    sf_futex_wake(low_word(&v->q->head), INT_MAX);
    sf_futex_wake(low_word(&v->q->tail), INT_MAX);
}

void sf_queue_heads_up(QueueView *v) {
    if (__atomic_load_n(&v->q->consumer_sleeping, SEQ_CST))
        sf_futex_wake(low_word(&v->q->head), INT_MAX);
}

/* The one wait loop behind both directions: `ready` tells whether the
 * queue has what is waited for; the futex word is the counter the peer
 * moves, and `seen` the value it had when the queue was not ready. */
typedef int (*ready_fn)(QueueView *v, uint64_t *seen);

static int readable(QueueView *v, uint64_t *seen) {
    uint64_t head = __atomic_load_n(&v->q->head, SEQ_CST);
    *seen = head;
    return head != __atomic_load_n(&v->q->tail, RELAXED);
}

static int writable(QueueView *v, uint64_t *seen) {
    uint64_t tail = __atomic_load_n(&v->q->tail, SEQ_CST);
    *seen = tail;
    return __atomic_load_n(&v->q->head, RELAXED) - tail < v->n_slots;
}

/* Spin until ready (1) or spin_end (0). */
static int spin_for(QueueView *v, ready_fn ready, uint64_t spin_end) {
    uint64_t seen;
    for (int rounds = 0;; rounds++) {
        for (int i = 0; i < 32; i++) {
            if (ready(v, &seen))
                return 1;
            cpu_relax();
        }
        if (sf_monotonic_ns() >= spin_end)
            return 0;
        /* Now and then let a peer that shares this CPU run. */
        if (rounds % 16 == 15)
            sched_yield();
    }
}

static int wait_for(QueueView *v, ready_fn ready, uint64_t *word, uint32_t *sleeping,
                    const SegmentHeader *seg, uint64_t epoch, int watch_stop, int64_t timeout_ns,
                    int64_t spin_ns) {
    uint64_t seen;
    if (ready(v, &seen))
        return SF_WAIT_READY;
    int peer = peer_check(seg, epoch, watch_stop);
    if (peer != SF_WAIT_READY)
        return peer;
    uint64_t start = sf_monotonic_ns();
    uint64_t deadline = timeout_ns < 0 ? UINT64_MAX : start + (uint64_t)timeout_ns;
    uint64_t spin_end = start + (uint64_t)(spin_ns > 0 ? spin_ns : 0);
    if (spin_end > deadline)
        spin_end = deadline;
    if (spin_for(v, ready, spin_end))
        return SF_WAIT_READY;
    for (;;) {
        uint64_t now = sf_monotonic_ns();
        if (now >= deadline)
            return ready(v, &seen) ? SF_WAIT_READY : SF_WAIT_TIMEOUT;
        peer = peer_check(seg, epoch, watch_stop);
        if (peer != SF_WAIT_READY)
            return peer;
        /* Slices only where there is a peer to re-check: without one, a lost
         * wake-up would show as a timeout instead of hiding in a slice. */
        uint64_t slice = deadline - now;
        if (seg != NULL && slice > SF_WAIT_SLICE_NS)
            slice = SF_WAIT_SLICE_NS;
        /* Announce the sleep, then look once more: the peer either sees the
         * flag and wakes us, or we see its move here. */
        __atomic_store_n(sleeping, 1, SEQ_CST);
        if (ready(v, &seen)) {
            __atomic_store_n(sleeping, 0, RELAXED);
            return SF_WAIT_READY;
        }
        int woke = sf_futex_wait(low_word(word), (uint32_t)seen, (int64_t)slice) == 0;
        __atomic_store_n(sleeping, 0, RELAXED);
        if (ready(v, &seen))
            return SF_WAIT_READY;
        if (woke) {
            /* Woken with nothing there: a heads-up (the message is on its way)
             * or a signal; either way spinning a while costs little. */
            uint64_t end = sf_monotonic_ns() + SF_HEADS_UP_SPIN_NS;
            if (spin_for(v, ready, end < deadline ? end : deadline))
                return SF_WAIT_READY;
        }
    }
}

int sf_queue_wait_readable(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                           int64_t timeout_ns, int64_t spin_ns) {
    return wait_for(v, readable, &v->q->head, &v->q->consumer_sleeping, seg, epoch, watch_stop,
                    timeout_ns, spin_ns);
}

int sf_queue_wait_writable(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                           int64_t timeout_ns, int64_t spin_ns) {
    return wait_for(v, writable, &v->q->tail, &v->q->producer_sleeping, seg, epoch, watch_stop,
                    timeout_ns, spin_ns);
}

/* ----------------------------------------------------------- data rings */

#define ELEM_BYTES 4u

uint64_t sf_ring_bytes(uint64_t capacity) { return (uint64_t)sizeof(DataRing) + capacity * ELEM_BYTES; }

void sf_ring_init(void *ring, uint32_t ring_id, uint64_t capacity) {
    DataRing *r = (DataRing *)ring;
    memset(r, 0, sizeof *r);
    r->ring_id = ring_id;
    r->elem_bytes = ELEM_BYTES;
    r->capacity = capacity;
}

int sf_ring_attach(RingView *v, void *ring, uint64_t bytes) {
    DataRing *r = (DataRing *)ring;
    if (bytes < sizeof(DataRing))
        return -1;
    uint64_t cap = r->capacity;
    if (cap == 0 || r->elem_bytes != ELEM_BYTES || r->ring_id == SF_RING_NONE)
        return -1;
    if (cap > (bytes - sizeof(DataRing)) / ELEM_BYTES)
        return -1;
    v->r = r;
    v->data = (uint8_t *)ring + sizeof(DataRing);
    v->capacity = cap;
    v->ring_id = r->ring_id;
    v->elem_bytes = ELEM_BYTES;
    return 0;
}

int sf_ring_attach_as(RingView *v, void *ring, uint64_t bytes, uint32_t ring_id, uint64_t capacity) {
    DataRing *r = (DataRing *)ring;
    if (bytes < sizeof(DataRing) || capacity == 0 || ring_id == SF_RING_NONE)
        return -1;
    if (capacity > (bytes - sizeof(DataRing)) / ELEM_BYTES)
        return -1;
    if (r->ring_id != ring_id)
        r->ring_id = ring_id;
    if (r->elem_bytes != ELEM_BYTES)
        r->elem_bytes = ELEM_BYTES;
    if (r->capacity != capacity)
        r->capacity = capacity;
    v->r = r;
    v->data = (uint8_t *)ring + sizeof(DataRing);
    v->capacity = capacity;
    v->ring_id = ring_id;
    v->elem_bytes = ELEM_BYTES;
    return 0;
}

void *sf_ring_begin(RingView *v, uint64_t n, RingRef *out) {
    uint64_t cap = v->capacity;
    if (n > cap)
        return NULL;
    /* From the reservation, not the head: a writer that died between begin and
     * commit left cells half-written past head that readers were told are being
     * overwritten; lowering the reservation would make refs to them valid again. */
    uint64_t pos = __atomic_load_n(&v->r->head, RELAXED);
    uint64_t reserved = __atomic_load_n(&v->r->reserve, RELAXED);
    if (reserved > pos)
        pos = reserved;
    uint64_t off = pos % cap;
    if (off + n > cap) {
        pos += cap - off;
        off = 0;
    }
    /* Readers of what is about to be overwritten must see the reservation
     * before they could see any new byte: store, then a full fence. */
    __atomic_store_n(&v->r->reserve, pos + n, RELAXED);
    __atomic_thread_fence(SEQ_CST);
    out->ring_id = v->ring_id;
    out->generation = (uint32_t)(pos / cap);
    out->offset = off;
    out->len = n;
    return v->data + off * ELEM_BYTES;
}

void sf_ring_commit(RingView *v) {
    __atomic_store_n(&v->r->head, __atomic_load_n(&v->r->reserve, RELAXED), RELEASE);
}

uint32_t sf_ring_write(RingView *v, const void *src, uint64_t n, RingRef *out) {
    void *dst = sf_ring_begin(v, n, out);
    if (dst == NULL)
        return SF_STATUS_RejectBounds;
    if (n)
        memcpy(dst, src, (size_t)(n * ELEM_BYTES));
    sf_ring_commit(v);
    return SF_STATUS_OK;
}

/* Where the reference starts, as an absolute element position, or a reject. */
static uint32_t locate(const RingView *v, const RingRef *ref, uint64_t *abs) {
    uint64_t cap = v->capacity;
    if (ref->ring_id != v->ring_id)
        return SF_STATUS_RejectBounds;
    if (ref->offset >= cap || ref->len > cap - ref->offset)
        return SF_STATUS_RejectBounds;
    uint64_t head = __atomic_load_n(&v->r->head, ACQUIRE);
    uint64_t head_gen = head / cap;
    /* The ring holds at most the current and the previous generation. */
    uint32_t behind = (uint32_t)head_gen - ref->generation;
    if (behind > 1 || behind > head_gen)
        return SF_STATUS_RejectBadRefGeneration;
    uint64_t start = (head_gen - behind) * cap + ref->offset;
    if (start + ref->len > head)
        return SF_STATUS_RejectBadRefGeneration;
    if (start + cap < __atomic_load_n(&v->r->reserve, ACQUIRE))
        return SF_STATUS_RejectBadRefGeneration;
    *abs = start;
    return SF_STATUS_OK;
}

uint32_t sf_ring_check(const RingView *v, const RingRef *ref) {
    uint64_t abs;
    return locate(v, ref, &abs);
}

uint32_t sf_ring_read(const RingView *v, const RingRef *ref, void *dst, uint64_t dst_elems) {
    uint64_t abs;
    uint32_t st = locate(v, ref, &abs);
    if (st != SF_STATUS_OK)
        return st;
    if (ref->len > dst_elems)
        return SF_STATUS_RejectBounds;
    if (ref->len)
        memcpy(dst, v->data + ref->offset * ELEM_BYTES, (size_t)(ref->len * ELEM_BYTES));
    /* Seqlock read side: the copy happens before the second look. */
    __atomic_thread_fence(ACQUIRE);
    if (abs + v->capacity < __atomic_load_n(&v->r->reserve, RELAXED))
        return SF_STATUS_RejectBadRefGeneration;
    return SF_STATUS_OK;
}

int64_t sf_queue_reserve_at(QueueView *v) {
    uint64_t head = __atomic_load_n(&v->q->head, RELAXED);
    uint64_t tail = __atomic_load_n(&v->q->tail, ACQUIRE);
    return head - tail >= v->n_slots ? -1 : (int64_t)(head & (v->n_slots - 1));
}

int64_t sf_queue_peek_at(QueueView *v) {
    uint64_t tail = __atomic_load_n(&v->q->tail, RELAXED);
    if (__atomic_load_n(&v->q->head, ACQUIRE) == tail)
        return -1;
    return (int64_t)(tail & (v->n_slots - 1));
}

int64_t sf_queue_wait_reserve(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                              int64_t timeout_ns, int64_t spin_ns) {
    int64_t i = sf_queue_reserve_at(v);
    if (i >= 0)
        return i;
    int r = sf_queue_wait_writable(v, seg, epoch, watch_stop, timeout_ns, spin_ns);
    return r == SF_WAIT_READY ? sf_queue_reserve_at(v) : -(int64_t)r;
}

int64_t sf_queue_wait_peek(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                           int64_t timeout_ns, int64_t spin_ns) {
    int64_t i = sf_queue_peek_at(v);
    if (i >= 0)
        return i;
    int r = sf_queue_wait_readable(v, seg, epoch, watch_stop, timeout_ns, spin_ns);
    return r == SF_WAIT_READY ? sf_queue_peek_at(v) : -(int64_t)r;
}
