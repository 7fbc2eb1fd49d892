/* FUSE over io_uring: one queue per CPU, each served by a thread pinned to that CPU.
 *
 * Measured on the project's 2-vCPU VMs, a FUSE round trip costs 16-20 us when the serving thread runs
 * on the requester's CPU and 100-200 us when the kernel wakes a reader of /dev/fuse on another (idle)
 * vCPU; several readers of one device are woken in turn, so half their wake-ups cross CPUs. The
 * kernel's io_uring transport (Linux 6.14+, /sys/module/fuse/parameters/enable_uring) queues each
 * request on the ring of the CPU that made it, so the reply never leaves that CPU.
 *
 * Each entry of a queue is a pair of buffers registered with the kernel (FUSE_IO_URING_CMD_REGISTER);
 * the kernel copies a request into one and completes the command; the reply is written into the same
 * buffers and committed with FUSE_IO_URING_CMD_COMMIT_AND_FETCH, which also waits for the next one.
 * A request handed to Python keeps its entry until Python's reply is copied in by io_writev
 * (dlfs_uring_reply) and the queue's thread, woken by an eventfd, commits it. FORGET and INTERRUPT
 * still travel through /dev/fuse, as do all requests until every CPU's queue is registered. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "ahead.h"
#include "hugebuf.h"

/* The kernel's io_uring FUSE ABI (include/uapi/linux/fuse.h since 6.14; newer than this system's headers). */
struct uring_ent_in_out {
    uint64_t flags, commit_id;
    uint32_t payload_sz, padding;
    uint64_t reserved;
};
struct uring_req_header {
    char in_out[128]; /* fuse_in_header in, fuse_out_header out */
    char op_in[128];  /* the opcode's fixed argument struct */
    struct uring_ent_in_out ent;
};
struct uring_cmd_req {
    uint64_t flags, commit_id;
    uint16_t qid;
    uint8_t padding[6];
};
enum { CMD_REGISTER = 1, CMD_COMMIT_AND_FETCH = 2 };

#define ENTRIES DLFS_URING_ENTRIES
#define PAYLOAD DLFS_URING_PAYLOAD
#define SCRATCH DLFS_REPLY_SCRATCH
#define WAKE_TAG 0xffffffffu            /* user_data of the eventfd read */
#define RECORD_TAG 0x100000000ull       /* user_data of a record's read from the disk: RECORD_TAG | its slot */
#define RECORDS DLFS_URING_RECORDS       /* records a queue reads from chunk files at once (a power of two) */
#define RECORD_BUF DLFS_REPLY_SCRATCH   /* a slot's buffer: every record without block sums fits */
_Static_assert((RECORDS & (RECORDS - 1)) == 0, "a record's slot is the low bits of its read's user_data");
#define AHEAD_SLOTS 4                   /* slots that may wait for READs their LOOKUPs foretold */
#define REGISTER_TRIES 10000            /* 1 ms apart: INIT must be answered first */

struct ring {
    int fd;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    size_t sq_bytes, sqe_bytes;
    void *sq_map;
    unsigned pending; /* prepared, not yet submitted */
};

struct entry {
    struct uring_req_header *hdr;
    char *payload;
    struct iovec iov[2];
    uint64_t waiting; /* the unique of a request Python is answering; 0 if none */
    int ready;        /* Python's reply is in the buffers: commit it */
};

/* A whole small record being read from this machine's chunk file on the queue's ring (scan mode), for
 * a READ waiting in an entry or ahead of one: a LOOKUP of its file starts it, so the disk works while
 * the reader opens the file (a cold epoch: ~50 us between the LOOKUP's reply and the READ, against
 * ~100 us for the disk). */
struct record {
    int state;  /* FREE, READING, READ */
    int waiter; /* the entry whose READ it answers, or -1 */
    int ahead;  /* started by a LOOKUP, and no READ has claimed it yet */
    int res;    /* the read's result: bytes, or -errno */
    uint64_t ext, unique;
    const struct dlfs_serve *sv; /* what it was started from (still there if serving stops meanwhile) */
    struct dlfs_extent e;
    struct dlfs_chunk_ref f;
    uint64_t lo;
    uint32_t len;
    uint64_t age; /* when it was started, in the queue's count of starts (the oldest READ one is reused first) */
    char *into;   /* where it is read: its slot's buffer (record_buf), or (a record too big for it) its
                   * READ's entry's payload */
};
enum { FREE, READING, READ };

struct queue {
    int qid, wake_fd, alive, serving, has_ring;
    pthread_t thread;
    struct ring r;
    struct entry ent[ENTRIES];
    struct record rec[RECORDS];
    char *records; /* the records' buffers, RECORD_BUF bytes each: one huge page (hugebuf.h) */
    uint64_t starts;            /* records started: the next one's age */
    struct dlfs_ahead_score sc; /* how well LOOKUPs have foretold READs lately (ahead.h) */
    pthread_mutex_t lock; /* `waiting`/`ready` of its entries, against Python's thread */
    struct dlfs_reply reply;
    struct dlfs_counters counters;
    uint64_t wake_buf;
};

static struct {
    int devfd, nq, state;
    atomic_int stopping;
    struct queue *q;
    int serving; /* queues that have served a request */
} U = {.devfd = -1};

/* --- a minimal io_uring ---------------------------------------------------------------------- */

static int ring_setup(struct ring *r, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN;
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0)
        return -errno;
    size_t sq = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->sq_bytes = sq > cq ? sq : cq; /* one mapping for both rings (IORING_FEAT_SINGLE_MMAP) */
    r->sq_map = mmap(NULL, r->sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    r->sqe_bytes = p.sq_entries * 128;
    r->sqes = mmap(NULL, r->sqe_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sq_map == MAP_FAILED || r->sqes == MAP_FAILED || !(p.features & IORING_FEAT_SINGLE_MMAP)) {
        int err = r->sq_map == MAP_FAILED || r->sqes == MAP_FAILED ? errno : EOPNOTSUPP;
        close(r->fd);
        return -err;
    }
    char *b = r->sq_map;
    r->sq_tail = (unsigned *)(b + p.sq_off.tail);
    r->sq_mask = (unsigned *)(b + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(b + p.sq_off.array);
    r->cq_head = (unsigned *)(b + p.cq_off.head);
    r->cq_tail = (unsigned *)(b + p.cq_off.tail);
    r->cq_mask = (unsigned *)(b + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(b + p.cq_off.cqes);
    r->pending = 0;
    return 0;
}

static void ring_close(struct ring *r)
{
    munmap(r->sqes, r->sqe_bytes);
    munmap(r->sq_map, r->sq_bytes);
    close(r->fd);
}

static struct io_uring_sqe *ring_sqe(struct ring *r)
{
    unsigned tail = *r->sq_tail, i = tail & *r->sq_mask;
    struct io_uring_sqe *s = (struct io_uring_sqe *)((char *)r->sqes + (size_t)i * 128);
    memset(s, 0, 128);
    r->sq_array[i] = i;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->pending++;
    return s;
}

/* Submit what is prepared and wait for at least one completion (unless stopping). */
static int ring_enter(struct ring *r, int wait)
{
    unsigned n = r->pending;
    r->pending = 0;
    int rc = (int)syscall(__NR_io_uring_enter, r->fd, n, wait ? 1 : 0, wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
    return rc < 0 ? -errno : rc;
}

/* --- one queue ------------------------------------------------------------------------------- */

static void prep_cmd(struct queue *q, int i, int op, uint64_t commit_id)
{
    struct io_uring_sqe *s = ring_sqe(&q->r);
    s->opcode = IORING_OP_URING_CMD;
    s->fd = U.devfd;
    s->cmd_op = op;
    s->addr = (uint64_t)(uintptr_t)q->ent[i].iov;
    s->len = 2;
    s->user_data = (uint64_t)i;
    struct uring_cmd_req *c = (struct uring_cmd_req *)s->cmd;
    c->qid = (uint16_t)q->qid;
    c->commit_id = commit_id;
}

static void prep_wake(struct queue *q)
{
    struct io_uring_sqe *s = ring_sqe(&q->r);
    s->opcode = IORING_OP_READ;
    s->fd = q->wake_fd;
    s->addr = (uint64_t)(uintptr_t)&q->wake_buf;
    s->len = sizeof q->wake_buf;
    s->user_data = WAKE_TAG;
}

/* Put a reply (header + body pieces) into entry i's buffers, to be committed. */
static int fill(struct entry *e, const struct iovec *iov, int count)
{
    if (count < 1 || iov[0].iov_len < sizeof(struct fuse_out_header))
        return -1;
    memcpy(e->hdr->in_out, iov[0].iov_base, sizeof(struct fuse_out_header));
    size_t used = 0;
    for (int k = 1; k < count; k++) {
        if (iov[k].iov_len > PAYLOAD - used)
            return -1;
        /* A record read from the disk into this payload (record_read) may already be in place, or start a
         * little into it (an unaligned record, read from its page's start): memmove. */
        if (iov[k].iov_base != e->payload + used)
            memmove(e->payload + used, iov[k].iov_base, iov[k].iov_len);
        used += iov[k].iov_len;
    }
    e->hdr->ent.payload_sz = (uint32_t)used;
    return 0;
}

static void commit(struct queue *q, int i)
{
    uint64_t unique = ((struct fuse_out_header *)q->ent[i].hdr->in_out)->unique;
    prep_cmd(q, i, CMD_COMMIT_AND_FETCH, unique);
}

static void commit_error(struct queue *q, int i, uint64_t unique, int err)
{
    struct fuse_out_header out = {.len = sizeof out, .error = -err, .unique = unique};
    struct iovec iov = {&out, sizeof out};
    fill(&q->ent[i], &iov, 1);
    commit(q, i);
}

/* The reply built in q->reply, into entry i and committed. */
static void answered(struct queue *q, const struct dlfs_serve *sv, int i, uint64_t unique)
{
    int bad = fill(&q->ent[i], q->reply.iov, q->reply.n);
    dlfs_reply_done(sv, &q->reply, !bad);
    if (bad)
        commit_error(q, i, unique, EIO);
    else
        commit(q, i);
}

static void to_python(struct queue *q, int i, int park);

/* --- records read from the disk on the ring -------------------------------------------------- */

static void rescore(struct queue *q, int by)
{
    dlfs_ahead_rescore(&q->sc, by, q->starts);
}

static struct record *record_of(struct queue *q, uint64_t ext)
{
    for (int k = 0; k < RECORDS; k++)
        if (q->rec[k].state != FREE && q->rec[k].ext == ext)
            return &q->rec[k];
    return NULL;
}

/* A slot to read into: a free one, else the oldest read one that no READ has claimed (a LOOKUP's that
 * foretold nothing: the score drops); NULL if every slot is being read or waited for. For a LOOKUP
 * (`ahead`), once AHEAD_SLOTS slots wait for READs, only one of those. */
static struct record *record_slot(struct queue *q, const struct dlfs_serve *sv, int ahead)
{
    struct record *best = NULL, *free_one = NULL;
    int waiting = 0;
    for (int k = 0; k < RECORDS; k++) {
        struct record *s = &q->rec[k];
        if (s->state == FREE) {
            free_one = free_one ? free_one : s;
            continue;
        }
        waiting += s->ahead;
        if (s->state == READ && s->waiter < 0 && (!best || s->age < best->age))
            best = s;
    }
    if (free_one && !(ahead && waiting >= AHEAD_SLOTS))
        best = free_one;
    if (!best)
        return NULL;
    if (best->state == READ) {
        dlfs_ahead_unused(&q->sc, best->age, q->starts);
        dlfs_chunk_put(&best->f, 0);
        best->state = FREE;
    }
    return best;
}

/* Slot s's own buffer, its part of the queue's records' huge page(s), mapped on the queue's first
 * record; NULL if it cannot be. */
static char *record_buf(struct queue *q, struct record *s)
{
    if (!q->records)
        q->records = dlfs_hugebuf_map(RECORDS * (size_t)RECORD_BUF);
    return q->records ? q->records + (size_t)(s - q->rec) * RECORD_BUF : NULL;
}

/* Start reading record `ext` (`e`) for slot s on the ring, into `into` (`room` bytes, page-aligned); 0 if
 * it cannot be read so. */
static int record_start(struct queue *q, const struct dlfs_serve *sv, struct record *s, uint64_t ext,
                        const struct dlfs_extent *e, char *into, uint32_t room)
{
    if (!into || dlfs_record_plan(sv, e, room, &s->f, &s->lo, &s->len) < 0)
        return 0;
    s->state = READING;
    s->sv = sv;
    s->ext = ext;
    s->e = *e;
    s->res = 0;
    s->into = into;
    s->age = q->starts++;
    struct io_uring_sqe *sqe = ring_sqe(&q->r);
    sqe->opcode = IORING_OP_READ;
    sqe->fd = s->f.direct;
    sqe->addr = (uint64_t)(uintptr_t)into;
    sqe->len = s->len;
    sqe->off = s->lo;
    sqe->user_data = RECORD_TAG | (uint64_t)(s - q->rec);
    return 1;
}

/* Slot s's bytes are in (or failed) and entry s->waiter waits for them: answer it, or hand it to Python. */
static void record_done(struct queue *q, const struct dlfs_serve *sv, struct record *s)
{
    int i = s->waiter;
    uint64_t need = s->e.offset - s->lo + s->e.stored_len;
    const char *data = s->res >= 0 && (uint64_t)s->res >= need ? s->into + (s->e.offset - s->lo) : NULL;
    if (s->res == -EINVAL) /* a file system that opens O_DIRECT but will not read so */
        dlfs_chunk_no_direct(&s->f);
    int r = dlfs_record_answer(&q->reply, s->unique, &s->e, data, &s->f, &q->counters);
    dlfs_chunk_put(&s->f, r != DLFS_ANSWERED && s->res != -EINVAL);
    s->state = FREE;
    s->waiter = -1;
    if (r == DLFS_ANSWERED)
        answered(q, sv, i, s->unique);
    else
        to_python(q, i, 0);
}

/* Entry i's READ (`unique`) wants record `ext` from the disk: joined to its read, or a read started for
 * it; 0 if neither (the caller reads it itself). */
static int record_read(struct queue *q, const struct dlfs_serve *sv, int i, uint64_t unique, uint64_t ext)
{
    struct record *s = record_of(q, ext);
    if (s && s->waiter >= 0)
        return 0; /* another READ of it waits already (two readers of one file) */
    if (!s) { /* its LOOKUP was long ago, on another CPU, or let pass (the score rises: READs come again) */
        rescore(q, 1);
        struct dlfs_extent e;
        if (dlfs_ix_extent(&sv->ix, ext, &e) < 0 || !(s = record_slot(q, sv, 0)))
            return 0;
        /* A record too big for a slot lands in the reply's own buffer: one with block sums, page-aligned in
         * its chunk, with no copy at all. */
        uint64_t at;
        int big = dlfs_record_span(&e, &at) > RECORD_BUF;
        if (!(big ? record_start(q, sv, s, ext, &e, q->ent[i].payload, PAYLOAD)
                  : record_start(q, sv, s, ext, &e, record_buf(q, s), RECORD_BUF)))
            return 0;
        s->ahead = 0;
    } else if (s->ahead) {
        s->ahead = 0;
        DLFS_COUNT(&q->counters, records_ahead_used, 1);
        rescore(q, 1);
    }
    s->waiter = i;
    s->unique = unique;
    if (s->state == READ)
        record_done(q, sv, s);
    return 1;
}

/* A LOOKUP of inode `ino` was answered: where a READ of the file would be read from the disk, start
 * reading it now. Only while LOOKUPs foretell READs (a walk that only stats files would read each of
 * them for nothing: the score, ahead.h). */
static void ahead(struct queue *q, const struct dlfs_serve *sv, uint64_t ino)
{
    uint64_t ext;
    struct dlfs_extent e;
    if (!ino || !dlfs_record_wanted(sv, ino, &ext, &e) || record_of(q, ext))
        return;
    if (dlfs_ahead_skip(&q->sc))
        return;
    uint64_t at;
    if (dlfs_record_span(&e, &at) > RECORD_BUF)
        return; /* read into its READ's buffer, once it comes */
    struct record *s = record_slot(q, sv, 1);
    if (s && record_start(q, sv, s, ext, &e, record_buf(q, s), RECORD_BUF)) {
        s->ahead = 1;
        s->waiter = -1;
        DLFS_COUNT(&q->counters, records_ahead, 1);
    }
}

/* A request arrived in entry i: answer it, or hand it to Python (as the bytes /dev/fuse would give). */
static void handle(struct queue *q, int i)
{
    struct entry *e = &q->ent[i];
    const struct fuse_in_header *in = (const void *)e->hdr->in_out;
    uint32_t payload_len = e->hdr->ent.payload_sz;
    DLFS_COUNT(&q->counters, requests, 1);
    if (in->len < sizeof *in + payload_len || in->len - sizeof *in - payload_len > sizeof e->hdr->op_in ||
        payload_len > PAYLOAD) {
        commit_error(q, i, in->unique, EIO);
        return;
    }
    uint32_t op_len = in->len - sizeof *in - payload_len;
    const struct dlfs_serve *sv = dlfs_engine_serve();
    int park = 0;
    if (sv) {
        struct dlfs_req rq = {in, e->hdr->op_in, op_len, e->payload, payload_len};
        uint32_t opcode = in->opcode; /* the reply overwrites the request's header */
        int r = dlfs_answer(sv, &rq, &q->reply, &q->counters);
        if (r == DLFS_ANSWERED) {
            /* A file's read from the disk goes out before its LOOKUP's reply: the reader woken by that
             * reply runs only once this thread sleeps, on this CPU, so the disk may as well start first. */
            if (opcode == FUSE_LOOKUP && !q->reply.out.error)
                ahead(q, sv, ((const struct fuse_entry_out *)q->reply.iov[1].iov_base)->nodeid);
            answered(q, sv, i, in->unique);
            return;
        }
        if (r == DLFS_NO_REPLY) { /* never through a ring; answer something so the entry comes back */
            commit_error(q, i, in->unique, ENOSYS);
            return;
        }
        if (r == DLFS_RECORD) {
            if (record_read(q, sv, i, in->unique, q->reply.record_ext))
                return; /* answered when its bytes are in (record_done) */
            /* Another machine's chunk: fetched into the entry's own payload, the reply's buffer (a record
             * of up to 1 MiB with block sums too, which a thread's scratch cannot hold). */
            r = dlfs_record_fetch(sv, &q->reply, in->unique, q->reply.record_ext, q->ent[i].payload, PAYLOAD,
                                  &q->counters);
            if (r == DLFS_ANSWERED) {
                answered(q, sv, i, in->unique);
                return;
            }
            if (r == DLFS_FORWARD) {
                to_python(q, i, 0);
                return;
            }
            q->reply.async_records = 0; /* no slot for it: read here and now */
            r = dlfs_answer(sv, &rq, &q->reply, &q->counters);
            q->reply.async_records = 1;
            if (r == DLFS_ANSWERED) {
                answered(q, sv, i, in->unique);
                return;
            }
        }
        park = r == DLFS_PARK;
    }
    to_python(q, i, park);
}

/* Entry i's request to Python (or parked): header, op struct and payload contiguous, as read(2) of the
 * device gives them. */
static void to_python(struct queue *q, int i, int park)
{
    struct entry *e = &q->ent[i];
    const struct fuse_in_header *in = (const void *)e->hdr->in_out;
    uint32_t payload_len = e->hdr->ent.payload_sz, op_len = in->len - sizeof *in - payload_len;
    char *buf = malloc(in->len);
    if (!buf) {
        commit_error(q, i, in->unique, ENOMEM);
        return;
    }
    memcpy(buf, in, sizeof *in);
    memcpy(buf + sizeof *in, e->hdr->op_in, op_len);
    memcpy(buf + sizeof *in + op_len, e->payload, payload_len);
    pthread_mutex_lock(&q->lock);
    e->waiting = in->unique;
    pthread_mutex_unlock(&q->lock);
    if (park) {
        dlfs_engine_park(buf, in->len, &q->counters); /* answered through dlfs_uring_reply, as Python's are */
    } else {
        DLFS_COUNT(&q->counters, forwarded, 1);
        dlfs_engine_forward(buf, in->len);
    }
    free(buf);
}

/* Commit every entry whose reply Python has filled. */
static void commit_ready(struct queue *q)
{
    pthread_mutex_lock(&q->lock);
    for (int i = 0; i < ENTRIES; i++) {
        if (q->ent[i].ready) {
            q->ent[i].ready = 0;
            q->ent[i].waiting = 0;
            commit(q, i);
        }
    }
    pthread_mutex_unlock(&q->lock);
}

static void *queue_main(void *arg)
{
    struct queue *q = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, NULL);
    cpu_set_t cpu;
    CPU_ZERO(&cpu);
    CPU_SET(q->qid, &cpu);
    pthread_setaffinity_np(pthread_self(), sizeof cpu, &cpu); /* may fail in a cpuset: it still serves */
    char name[16];
    snprintf(name, sizeof name, "dlfs-uring-%d", q->qid);
    pthread_setname_np(pthread_self(), name);
    /* Here, not in the starting thread: a SINGLE_ISSUER ring belongs to the task that made it. */
    int rc = ring_setup(&q->r, 4 * ENTRIES + 2 * RECORDS + 2); /* what one pass over the completions may prepare */
    if (rc < 0) {
        int expected = 1;
        __atomic_compare_exchange_n(&U.state, &expected, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        pthread_mutex_lock(&q->lock);
        q->alive = 0;
        pthread_mutex_unlock(&q->lock);
        return NULL;
    }
    q->has_ring = 1;
    q->reply.async_records = 1;
    q->reply.async_max = PAYLOAD;
    q->sc = (struct dlfs_ahead_score)DLFS_AHEAD_SCORE_INIT;
    for (int k = 0; k < RECORDS; k++) {
        q->rec[k].state = FREE;
        q->rec[k].waiter = -1;
    }
    int tries = 0;
    prep_wake(q);
    for (int i = 0; i < ENTRIES; i++)
        prep_cmd(q, i, CMD_REGISTER, 0);
    while (!atomic_load_explicit(&U.stopping, memory_order_relaxed)) {
        rc = ring_enter(&q->r, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            int expected = 1;
            __atomic_compare_exchange_n(&U.state, &expected, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            break;
        }
        unsigned head = *q->r.cq_head, tail = __atomic_load_n(q->r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &q->r.cqes[head & *q->r.cq_mask];
            uint64_t tag = cqe->user_data;
            int res = cqe->res;
            if (tag == WAKE_TAG) {
                commit_ready(q);
                if (!atomic_load_explicit(&U.stopping, memory_order_relaxed))
                    prep_wake(q);
                continue;
            }
            if (tag & RECORD_TAG) {
                struct record *s = &q->rec[tag & (RECORDS - 1)];
                s->res = res;
                s->state = READ;
                if (s->waiter >= 0)
                    record_done(q, s->sv, s);
                continue;
            }
            int i = (int)tag;
            /* A registered entry completes only when a request is in it; errors complete at once. */
            if (res == -EAGAIN && ++tries < REGISTER_TRIES) {
                usleep(1000); /* INIT not answered yet */
                prep_cmd(q, i, CMD_REGISTER, 0);
                continue;
            }
            if (res < 0) { /* unmounted (ENOTCONN, ECANCELED), or this kernel will not */
                int expected = 1;
                __atomic_compare_exchange_n(&U.state, &expected, res, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                __atomic_store_n(q->r.cq_head, head + 1, __ATOMIC_RELEASE);
                goto out;
            }
            if (!q->serving) {
                q->serving = 1;
                __atomic_add_fetch(&U.serving, 1, __ATOMIC_RELAXED);
                __atomic_store_n(&U.state, 2, __ATOMIC_RELAXED);
            }
            handle(q, i);
        }
        __atomic_store_n(q->r.cq_head, head, __ATOMIC_RELEASE);
    }
out:
    for (int k = 0; k < RECORDS; k++) /* a read still in flight keeps its file (io_uring holds it) and buffer (freed after the ring) */
        if (q->rec[k].state != FREE)
            dlfs_chunk_put(&q->rec[k].f, 0);
    pthread_mutex_lock(&q->lock);
    q->alive = 0; /* replies for its entries are dropped from now on */
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* --- the transport --------------------------------------------------------------------------- */

static int uring_enabled(void)
{
    int fd = open("/sys/module/fuse/parameters/enable_uring", O_RDONLY | O_CLOEXEC);
    char c = 'N';
    if (fd >= 0) {
        if (read(fd, &c, 1) != 1)
            c = 'N';
        close(fd);
    }
    return c == 'Y' || c == '1';
}

static void free_queue(struct queue *q)
{
    for (int i = 0; i < ENTRIES; i++) {
        if (q->ent[i].hdr)
            munmap(q->ent[i].hdr, 4096);
        if (q->ent[i].payload)
            munmap(q->ent[i].payload, PAYLOAD);
    }
    dlfs_hugebuf_unmap(q->records, RECORDS * (size_t)RECORD_BUF);
    free(q->reply.scratch);
    if (q->wake_fd >= 0)
        close(q->wake_fd);
}

int dlfs_uring_start(int devfd)
{
    if (!uring_enabled()) {
        U.state = -EOPNOTSUPP;
        return -1;
    }
    int nq = get_nprocs_conf(); /* the kernel wants a queue for every possible CPU */
    U.q = calloc((size_t)nq, sizeof *U.q);
    if (!U.q) {
        U.state = -ENOMEM;
        return -1;
    }
    U.devfd = devfd;
    U.nq = nq;
    U.state = 1;
    for (int k = 0; k < nq; k++) {
        struct queue *q = &U.q[k];
        q->qid = k;
        q->wake_fd = eventfd(0, EFD_CLOEXEC);
        pthread_mutex_init(&q->lock, NULL);
        q->reply.scratch = malloc(SCRATCH);
        q->reply.scratch_size = SCRATCH;
        int bad = q->wake_fd < 0 || !q->reply.scratch;
        for (int i = 0; i < ENTRIES && !bad; i++) {
            struct entry *e = &q->ent[i];
            /* Anonymous and lazily touched: an idle queue costs address space, not memory. */
            e->hdr = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            e->payload = mmap(NULL, PAYLOAD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (e->hdr == MAP_FAILED || e->payload == MAP_FAILED) {
                e->hdr = e->hdr == MAP_FAILED ? NULL : e->hdr;
                e->payload = e->payload == MAP_FAILED ? NULL : e->payload;
                bad = 1;
                break;
            }
            e->iov[0] = (struct iovec){e->hdr, sizeof(struct uring_req_header)};
            e->iov[1] = (struct iovec){e->payload, PAYLOAD};
        }
        if (bad) {
            U.state = -ENOMEM;
            free_queue(q);
            U.nq = k;
            dlfs_uring_stop(0);
            return -1;
        }
        q->alive = 1;
        if (pthread_create(&q->thread, NULL, queue_main, q) != 0) {
            q->alive = 0;
            free_queue(q);
            U.nq = k;
            U.state = -EAGAIN;
            dlfs_uring_stop(0);
            return -1;
        }
    }
    return 0;
}

/* Join `t` by CLOCK_MONOTONIC `deadline_ns` (one try at least); 0 if it ended. */
static int join_by(pthread_t t, uint64_t deadline_ns)
{
    struct timespec at;
    uint64_t n = dlfs_now_ns();
    uint64_t wait = deadline_ns > n ? deadline_ns - n : 20 * 1000 * 1000;
    clock_gettime(CLOCK_REALTIME, &at); /* pthread_timedjoin_np's deadline is on the real-time clock */
    at.tv_sec += (time_t)(wait / 1000000000u);
    at.tv_nsec += (long)(wait % 1000000000u);
    if (at.tv_nsec >= 1000000000) {
        at.tv_sec++;
        at.tv_nsec -= 1000000000;
    }
    return pthread_timedjoin_np(t, NULL, &at) == 0 ? 0 : -1;
}

int dlfs_uring_stop(uint64_t deadline_ns)
{
    if (!U.q)
        return 0;
    atomic_store(&U.stopping, 1);
    for (int k = 0; k < U.nq; k++) {
        uint64_t one = 1;
        if (write(U.q[k].wake_fd, &one, sizeof one) < 0) {
            /* full counter: readable */
        }
    }
    int left = 0;
    for (int k = 0; k < U.nq; k++) {
        if (deadline_ns ? join_by(U.q[k].thread, deadline_ns) < 0 : pthread_join(U.q[k].thread, NULL) != 0) {
            pthread_detach(U.q[k].thread);
            left++;
        }
    }
    if (left) {
        /* A queue thread still running (stuck in I/O) may wake up and use any queue's lock, ring or buffers,
         * and reads `stopping`: all kept, and stopping stays set. Python's late replies go to /dev/fuse. */
        U.q = NULL;
        U.nq = 0;
        return left;
    }
    for (int k = 0; k < U.nq; k++) {
        if (U.q[k].has_ring)
            ring_close(&U.q[k].r); /* cancels the commands the kernel still holds */
        free_queue(&U.q[k]);
    }
    free(U.q);
    U.q = NULL;
    U.nq = 0;
    U.serving = 0;
    atomic_store(&U.stopping, 0);
    return 0;
}

int dlfs_uring_state(void)
{
    return __atomic_load_n(&U.state, __ATOMIC_RELAXED);
}

uint64_t dlfs_uring_queues(void)
{
    return (uint64_t)__atomic_load_n(&U.serving, __ATOMIC_RELAXED);
}

void dlfs_uring_add_counters(struct dlfs_counters *sum)
{
    for (int k = 0; U.q && k < U.nq; k++) {
        const uint64_t *src = (const uint64_t *)&U.q[k].counters;
        uint64_t *dst = (uint64_t *)sum;
        for (size_t i = 0; i < sizeof *sum / sizeof(uint64_t); i++)
            dst[i] += __atomic_load_n(&src[i], __ATOMIC_RELAXED);
    }
}

int dlfs_uring_reply(const struct iovec *iov, int count)
{
    if (!U.q || count < 1 || iov[0].iov_len < sizeof(struct fuse_out_header))
        return 0;
    uint64_t unique = ((const struct fuse_out_header *)iov[0].iov_base)->unique;
    if (!unique)
        return 0; /* a notification: /dev/fuse */
    for (int k = 0; k < U.nq; k++) {
        struct queue *q = &U.q[k];
        pthread_mutex_lock(&q->lock);
        for (int i = 0; i < ENTRIES; i++) {
            struct entry *e = &q->ent[i];
            if (e->waiting != unique || e->ready)
                continue;
            if (q->alive) {
                if (fill(e, iov, count) < 0) { /* cannot happen for a reply the kernel accepts; say so */
                    struct fuse_out_header out = {.len = sizeof out, .error = -EIO, .unique = unique};
                    struct iovec err = {&out, sizeof out};
                    fill(e, &err, 1);
                }
                e->ready = 1;
                uint64_t one = 1;
                if (write(q->wake_fd, &one, sizeof one) < 0) {
                    /* full counter: readable */
                }
            } else {
                e->waiting = 0; /* its queue is gone (unmounted): nobody waits for this reply */
            }
            pthread_mutex_unlock(&q->lock);
            return 1;
        }
        pthread_mutex_unlock(&q->lock);
    }
    return 0;
}
