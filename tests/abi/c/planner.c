/* A planner in C: the same header and sf_ring.c a Rust or Go planner links.
 * Connects to a segment made by Python the way the header's "sessions"
 * comment says (check, lock, wait for READY, begin a session), writes a
 * prompt into the prompt ring, a TickPlan (one admit, one prefill, one
 * decode) into the plan queue, and waits for the TickEvents the Python side
 * answers with, skipping replies of other sessions.
 * usage: planner SEGMENT_PATH  -> prints "plan_seq status emits session"
 * exit 4: sf_segment_check refused it (prints the SF_CONNECT_* code);
 * exit 10: another planner holds the segment. */
#include "superfluid.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static size_t align8(size_t n) { return (n + 7) / 8 * 8; }

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    int fd = open(argv[1], O_RDWR);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        return 3;
    uint8_t *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return 3;
    SegmentHeader *h = (SegmentHeader *)base;
    int check = sf_segment_check(h, (uint64_t)st.st_size);
    if (check != SF_CONNECT_OK) {
        printf("connect %d\n", check);
        return 4;
    }
    if (sf_session_lock(fd) == -EWOULDBLOCK)
        return 10;
    uint64_t epoch;
    if (sf_wait_ready(h, 0, 10000000000LL, &epoch) != SF_WAIT_READY)
        return 11;
    uint64_t session = sf_session_begin(h);
    QueueView plans, events;
    RingView prompts;
    if (sf_queue_attach(&plans, base + h->layout.plan_queue, (uint64_t)st.st_size - h->layout.plan_queue) ||
        sf_queue_attach(&events, base + h->layout.event_queue, (uint64_t)st.st_size - h->layout.event_queue) ||
        sf_ring_attach(&prompts, base + h->layout.prompt_ring, (uint64_t)st.st_size - h->layout.prompt_ring))
        return 5;

    uint32_t tokens[4] = {3, 1, 4, 1};
    RingRef prompt;
    if (sf_ring_write(&prompts, tokens, 4, &prompt) != SF_STATUS_OK)
        return 6;

    uint8_t *slot = sf_queue_try_reserve(&plans);
    if (!slot)
        return 7;
    MsgHeader *m = (MsgHeader *)slot;
    TickPlan *p = (TickPlan *)(slot + sizeof(MsgHeader));
    uint8_t *arena = slot + sizeof(MsgHeader) + align8(sizeof(TickPlan));
    memset(p, 0, sizeof *p);
    p->struct_size = sizeof(TickPlan);
    p->plan_seq = 41;
    p->max_decode_lanes = 1;
    p->prefill_token_budget = 64;

    size_t at = 0;
    LaneAdmit *a = (LaneAdmit *)(arena + at);
    memset(a, 0, sizeof *a);
    a->lane_tag = 7;
    a->prompt = prompt;
    a->sampling = SF_SAMPLING_GPU_GREEDY;
    p->admits = (Span){(uint32_t)at, 1};
    at = align8(at + sizeof *a);
    LanePrefill *pf = (LanePrefill *)(arena + at);
    *pf = (LanePrefill){7, 0, 4};
    p->prefills = (Span){(uint32_t)at, 1};
    at = align8(at + sizeof *pf);
    LaneDecode *d = (LaneDecode *)(arena + at);
    *d = (LaneDecode){7, 8, 0, 0};
    p->decodes = (Span){(uint32_t)at, 1};
    at = align8(at + sizeof *d);
    *m = (MsgHeader){SF_MSG_PLAN, sizeof(TickPlan), at, session};
    sf_queue_publish(&plans);

    uint8_t *in;
    MsgHeader *em;
    for (;;) {
        if (sf_queue_wait_readable(&events, h, epoch, 0, 10000000000LL, 100000) != SF_WAIT_READY)
            return 8;
        in = sf_queue_try_peek(&events);
        em = (MsgHeader *)in;
        if (em->session == session || (em->session == 0 && (em->kind == SF_MSG_WORKER || em->kind == SF_MSG_RESET)))
            break;
        sf_queue_release(&events); /* an earlier session's reply */
    }
    if (em->kind != SF_MSG_EVENTS || em->record_bytes != sizeof(TickEvents))
        return 9;
    TickEvents *e = (TickEvents *)(in + sizeof(MsgHeader));
    printf("%llu %u %u %llu\n", (unsigned long long)e->plan_seq, e->status, e->emits.count,
           (unsigned long long)em->session);
    sf_queue_release(&events);
    munmap(base, (size_t)st.st_size);
    close(fd);
    return 0;
}
