/* Records fetched from the data daemons by the serving threads (remote.h). */
#define _GNU_SOURCE
#include "remote.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "answer.h"

enum { EMPTY, IDLE, BUSY };

struct conn {
    int fd;
    int state;    /* EMPTY: Python may fill it (under the lock); IDLE: a thread may take it; BUSY: taken */
    uint32_t req; /* the last request id sent on it */
    unsigned wait_ms; /* its sockets' timeouts, as last set (the taker sets the bound's when it moved) */
    uint64_t used; /* when it last answered, CLOCK_MONOTONIC_COARSE seconds */
};

struct node {
    struct conn conn[DLFS_REMOTE_CONNS];
    uint64_t wanted, lost, reads, bytes, failures, timeouts;
};

static struct {
    pthread_mutex_t lock; /* Python's side: filling EMPTY slots, the route's size, closing */
    uint16_t *route;      /* per chunk: node slot, or 0 */
    uint64_t n;
    uint64_t wanted, timeouts; /* every node's, summed: Python looks at the nodes only when one moved */
    unsigned wait_ms;          /* a fetch's bound (dlfs_remote_wait) */
    int fetching;              /* fetches begun and not ended: the close waits for them (Python's threads fetch too) */
    struct node node[DLFS_REMOTE_NODES];
} R = {.lock = PTHREAD_MUTEX_INITIALIZER, .wait_ms = DLFS_REMOTE_WAIT_MS};

#define ADD(p, n) __atomic_fetch_add((p), (n), __ATOMIC_RELAXED)

int dlfs_remote_route(const uint16_t *route, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        if (route[i] > DLFS_REMOTE_NODES) {
            errno = EINVAL;
            return -1;
        }
    }
    pthread_mutex_lock(&R.lock);
    int rc = 0;
    if (!R.route) {
        uint16_t *t = calloc(n ? n : 1, sizeof *t);
        if (!t) {
            errno = ENOMEM;
            rc = -1;
        } else {
            R.n = n;
            __atomic_store_n(&R.route, t, __ATOMIC_RELEASE);
        }
    } else if (R.n != n) {
        errno = EINVAL;
        rc = -1;
    }
    if (!rc) /* entry by entry: a thread reading one meanwhile sees the old slot or the new, both valid */
        for (uint64_t i = 0; i < n; i++)
            __atomic_store_n(&R.route[i], route[i], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&R.lock);
    return rc;
}

int dlfs_remote_route_set(uint64_t chunk, unsigned slot)
{
    pthread_mutex_lock(&R.lock);
    int rc = 0;
    if (!R.route || chunk >= R.n || slot > DLFS_REMOTE_NODES) {
        errno = EINVAL;
        rc = -1;
    } else {
        __atomic_store_n(&R.route[chunk], (uint16_t)slot, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&R.lock);
    return rc;
}

int dlfs_remote_add(unsigned slot, int fd)
{
    if (slot < 1 || slot > DLFS_REMOTE_NODES || fd < 0) {
        errno = EINVAL;
        return -1;
    }
    unsigned wait = dlfs_remote_wait_now();
    if (dlfs_wire_blocking(fd, wait) < 0)
        return -1;
    struct node *nd = &R.node[slot - 1];
    int rc = -1;
    errno = ENOSPC;
    pthread_mutex_lock(&R.lock);
    for (int k = 0; k < DLFS_REMOTE_CONNS; k++) {
        struct conn *c = &nd->conn[k];
        if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) == EMPTY) {
            c->fd = fd;
            c->wait_ms = wait;
            c->used = dlfs_wire_seconds();
            __atomic_store_n(&c->state, IDLE, __ATOMIC_RELEASE);
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&R.lock);
    return rc;
}

void dlfs_remote_node_stats(unsigned slot, struct dlfs_remote_node_stats *out)
{
    memset(out, 0, sizeof *out);
    if (slot == 0) {
        out->wanted = __atomic_load_n(&R.wanted, __ATOMIC_RELAXED);
        out->timeouts = __atomic_load_n(&R.timeouts, __ATOMIC_RELAXED);
    }
    if (slot < 1 || slot > DLFS_REMOTE_NODES)
        return;
    struct node *nd = &R.node[slot - 1];
    for (int k = 0; k < DLFS_REMOTE_CONNS; k++)
        out->open += __atomic_load_n(&nd->conn[k].state, __ATOMIC_RELAXED) != EMPTY;
    out->wanted = __atomic_load_n(&nd->wanted, __ATOMIC_RELAXED);
    out->lost = __atomic_load_n(&nd->lost, __ATOMIC_RELAXED);
    out->reads = __atomic_load_n(&nd->reads, __ATOMIC_RELAXED);
    out->bytes = __atomic_load_n(&nd->bytes, __ATOMIC_RELAXED);
    out->failures = __atomic_load_n(&nd->failures, __ATOMIC_RELAXED);
    out->timeouts = __atomic_load_n(&nd->timeouts, __ATOMIC_RELAXED);
}

unsigned dlfs_remote_wait(unsigned ms)
{
    ms = ms < DLFS_REMOTE_WAIT_MIN_MS ? DLFS_REMOTE_WAIT_MIN_MS : ms > DLFS_REMOTE_WAIT_MS ? DLFS_REMOTE_WAIT_MS : ms;
    __atomic_store_n(&R.wait_ms, ms, __ATOMIC_RELAXED);
    return ms;
}

unsigned dlfs_remote_wait_now(void)
{
    return __atomic_load_n(&R.wait_ms, __ATOMIC_RELAXED);
}

int dlfs_remote_on(void)
{
    return __atomic_load_n(&R.route, __ATOMIC_ACQUIRE) != NULL;
}

/* Close a taken connection: its slot is Python's to fill again. */
static void drop(struct node *nd, struct conn *c)
{
    close(c->fd);
    c->fd = -1;
    ADD(&nd->lost, 1);
    __atomic_store_n(&c->state, EMPTY, __ATOMIC_RELEASE);
}

/* An idle connection of the node, taken; NULL if none (counted as wanted where the node has room). */
static struct conn *take(struct node *nd)
{
    int empty = 0;
    uint64_t now = dlfs_wire_seconds();
    for (int k = 0; k < DLFS_REMOTE_CONNS; k++) {
        struct conn *c = &nd->conn[k];
        int idle = IDLE;
        if (__atomic_compare_exchange_n(&c->state, &idle, BUSY, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            if (now < c->used + DLFS_REMOTE_IDLE_S)
                return c;
            drop(nd, c); /* the daemon may be closing it: let Python open a fresh one */
            idle = EMPTY;
        }
        empty += idle == EMPTY;
    }
    if (empty) {
        ADD(&nd->wanted, 1);
        ADD(&R.wanted, 1);
    }
    return NULL;
}

/* `n` bytes into `p`: each wait bounded by the socket's timeout, all of them by `deadline`. -1 with errno
 * ETIMEDOUT where the bound passed first. */
static int recv_all(int fd, char *p, size_t n, uint64_t deadline)
{
    while (n) {
        ssize_t k = recv(fd, p, n, MSG_WAITALL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                errno = ETIMEDOUT; /* the socket's timeout: the bound */
            return -1;
        }
        if (k == 0) {
            errno = ECONNRESET; /* closed */
            return -1;
        }
        p += k;
        n -= (size_t)k;
        if (n && dlfs_wire_now_ms() > deadline) {
            errno = ETIMEDOUT; /* trickling past the bound */
            return -1;
        }
    }
    return 0;
}

/* A READ_RANGE request (msgpack meta {"id": bin, "offset": uint64, "length": uint32}, as
 * dlfs/wire/messages.py's ReadRange decodes it) into `f`; its length. */
static size_t encode_read_range(char *f, uint32_t req, const uint8_t *id, uint64_t offset, uint32_t length)
{
    char *m = f + DLFS_WIRE_HEADER;
    size_t k = 0;
    m[k++] = (char)0x83;
    memcpy(m + k, "\xa2id\xc4", 4);
    k += 4;
    m[k++] = DLFS_CHUNK_ID;
    memcpy(m + k, id, DLFS_CHUNK_ID);
    k += DLFS_CHUNK_ID;
    memcpy(m + k, "\xa6offset\xcf", 8);
    k += 8;
    for (int s = 56; s >= 0; s -= 8) /* msgpack integers are big-endian */
        m[k++] = (char)(offset >> s);
    memcpy(m + k, "\xa6length\xce", 8);
    k += 8;
    for (int s = 24; s >= 0; s -= 8)
        m[k++] = (char)(length >> s);
    struct dlfs_wire_head h = dlfs_wire_read_range(DLFS_WIRE_REQUEST, 0, req, (uint32_t)k, 0);
    dlfs_wire_pack(f, &h);
    return DLFS_WIRE_HEADER + k;
}

/* dlfs_remote_range, counted in R.fetching by the caller. */
static int range_fetch(uint64_t chunk, const uint8_t *id, uint64_t offset, uint32_t length, char *buf,
                       struct dlfs_counters *cnt)
{
    const uint16_t *route = __atomic_load_n(&R.route, __ATOMIC_SEQ_CST);
    if (!route || !id || chunk >= R.n)
        return -1;
    unsigned slot = __atomic_load_n(&route[chunk], __ATOMIC_RELAXED);
    if (!slot)
        return -1;
    struct node *nd = &R.node[slot - 1];
    struct conn *c = take(nd);
    if (!c)
        return -1;
    unsigned wait = dlfs_remote_wait_now();
    if (c->wait_ms != wait) { /* the bound moved since this connection's timeouts were set */
        if (dlfs_wire_blocking(c->fd, wait) < 0)
            goto broken;
        c->wait_ms = wait;
    }
    uint64_t deadline = dlfs_wire_now_ms() + wait;
    errno = 0;
    char f[128], meta[256];
    uint32_t req = ++c->req;
    size_t len = encode_read_range(f, req, id, offset, length);
    if (dlfs_wire_send_all(c->fd, f, len, deadline) < 0 || recv_all(c->fd, f, DLFS_WIRE_HEADER, deadline) < 0)
        goto broken;
    struct dlfs_wire_head h;
    if (dlfs_wire_unpack(f, &h) < 0 || h.kind != DLFS_WIRE_RESPONSE || h.msg != DLFS_WIRE_READ_RANGE || h.req != req ||
        h.meta_len > DLFS_WIRE_META_MAX)
        goto broken;
    uint32_t meta_len = h.meta_len, data_len = h.data_len;
    if (h.status) { /* an error answered (not found, say): read past it, and let Python fetch and say so */
        if (data_len)
            goto broken;
        for (uint32_t left = meta_len; left;) {
            uint32_t k = left < sizeof meta ? left : sizeof meta;
            if (recv_all(c->fd, meta, k, deadline) < 0)
                goto broken;
            left -= k;
        }
        c->used = dlfs_wire_seconds();
        __atomic_store_n(&c->state, IDLE, __ATOMIC_RELEASE);
        /* That node will say the same next time (a chunk it lost, say): the chunk is Python's until the
         * route is made again, so its reads do not ask twice (Python tries the other replicas). */
        __atomic_store_n((uint16_t *)&route[chunk], 0, __ATOMIC_RELAXED);
        goto failed;
    }
    if (data_len != length || meta_len > sizeof meta || recv_all(c->fd, meta, meta_len, deadline) < 0 ||
        recv_all(c->fd, buf, data_len, deadline) < 0)
        goto broken;
    c->used = dlfs_wire_seconds();
    __atomic_store_n(&c->state, IDLE, __ATOMIC_RELEASE);
    ADD(&nd->reads, 1);
    ADD(&nd->bytes, data_len);
    return 0;
broken:
    if (errno == ETIMEDOUT || errno == EAGAIN || errno == EWOULDBLOCK) { /* silent past the bound: Python's to tell */
        ADD(&nd->timeouts, 1);
        ADD(&R.timeouts, 1);
    }
    drop(nd, c);
failed:
    ADD(&nd->failures, 1);
    if (cnt)
        DLFS_COUNT(cnt, remote_failures, 1);
    return -1;
}

int dlfs_remote_range(uint64_t chunk, const uint8_t *id, uint64_t offset, uint32_t length, char *buf,
                      struct dlfs_counters *cnt)
{
    /* Counted before the route is looked at, and the close clears the route before it looks at the count
     * (both sequentially consistent): a fetch either sees no route or is waited for. */
    __atomic_fetch_add(&R.fetching, 1, __ATOMIC_SEQ_CST);
    int got = range_fetch(chunk, id, offset, length, buf, cnt);
    __atomic_fetch_sub(&R.fetching, 1, __ATOMIC_SEQ_CST);
    return got;
}

int dlfs_remote_read(const struct dlfs_extent *e, const uint8_t *id, char *buf, uint32_t room,
                     struct dlfs_counters *c)
{
    if (e->stored_len > room)
        return -1;
    return dlfs_remote_range(e->chunk, id, e->offset, e->stored_len, buf, c);
}

void dlfs_remote_close(void)
{
    pthread_mutex_lock(&R.lock);
    uint16_t *t = R.route;
    __atomic_store_n(&R.route, NULL, __ATOMIC_SEQ_CST); /* no fetch begins from now on */
    /* A fetch still running (a Python thread's window) ends within its bound: its connection is its own till then. */
    for (unsigned waited = 0; __atomic_load_n(&R.fetching, __ATOMIC_SEQ_CST) && waited < 2 * DLFS_REMOTE_WAIT_MS + 1000;
         waited++)
        usleep(1000);
    for (int s = 0; s < DLFS_REMOTE_NODES; s++) {
        for (int k = 0; k < DLFS_REMOTE_CONNS; k++) {
            struct conn *c = &R.node[s].conn[k];
            if (c->state != EMPTY)
                close(c->fd);
            c->fd = -1;
            c->state = EMPTY;
        }
    }
    R.n = 0;
    R.wanted = R.timeouts = 0;
    R.wait_ms = DLFS_REMOTE_WAIT_MS;
    memset(R.node, 0, sizeof R.node); /* every slot EMPTY, every count 0: the next mount's own */
    pthread_mutex_unlock(&R.lock);
    free(t);
}
