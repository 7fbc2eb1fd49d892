/* The data daemon's range lanes (rangeserve.h). */
#define _GNU_SOURCE
#include "rangeserve.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "chunkfiles.h"
#include "indexview.h"
#include "wire.h"

enum { FREE, ARMED, SERVING };

struct lane {
    int fd;
    int state;    /* FREE; ARMED: in the epoll set, waiting for a request; SERVING: a worker has it */
    uint32_t gen; /* bumped when the slot is freed: an event for its last lane is then stale */
    uint64_t used; /* when it last had a request, CLOCK_MONOTONIC_COARSE seconds */
};

static struct {
    pthread_mutex_t lock; /* the lanes' states; the counters are atomic */
    int ep, dir, nworkers, wake; /* wake: an eventfd in the epoll set, written to stop every worker at once */
    atomic_int stopping;
    pthread_t worker[DLFS_LANES_WORKERS];
    struct dlfs_chunk_files files;
    uint64_t swept;
    struct dlfs_lanes_stats st;
    struct lane lane[DLFS_LANES_MAX];
} L = {.lock = PTHREAD_MUTEX_INITIALIZER, .ep = -1, .dir = -1, .wake = -1};

#define WAKE_TAG UINT64_MAX /* the eventfd's event (a lane's is gen << 32 | slot, never this) */

#define COUNT(field, n) __atomic_fetch_add(&L.st.field, (n), __ATOMIC_RELAXED)

static int watch(int op, int k)
{
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT,
                             .data.u64 = (uint64_t)L.lane[k].gen << 32 | (uint32_t)k};
    return epoll_ctl(L.ep, op, L.lane[k].fd, &ev);
}

/* Close lane k (under the lock): its slot is free, and any event still on its way is stale. */
static void shut(int k)
{
    epoll_ctl(L.ep, EPOLL_CTL_DEL, L.lane[k].fd, NULL);
    close(L.lane[k].fd);
    L.lane[k].fd = -1;
    L.lane[k].state = FREE;
    L.lane[k].gen++;
    COUNT(open, -1);
}

/* `n` bytes into `p`: 1, 0 if the peer left before the first, -1 if it failed or the frame begun at
 * `begun` (ms; 0: not yet) took longer than DLFS_LANE_STALL_MS (a peer trickling bytes holds no worker). */
static int recv_all(int fd, void *p, size_t n, uint64_t *begun)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, (char *)p + got, n - got, MSG_WAITALL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return got || *begun ? -1 : (int)k; /* 0: the peer left between frames */
        got += (size_t)k;
        if (!*begun)
            *begun = dlfs_wire_now_ms();
        else if (got < n && dlfs_wire_now_ms() - *begun > DLFS_LANE_STALL_MS)
            return -1;
    }
    return 1;
}

static void head(char *h, uint16_t status, uint32_t req, uint32_t meta_len, uint32_t data_len)
{
    struct dlfs_wire_head w = dlfs_wire_read_range(DLFS_WIRE_RESPONSE, status, req, meta_len, data_len);
    dlfs_wire_pack(h, &w);
}

/* An error reply, {"error": why}, as Python's handlers send one. */
static int reply_error(int fd, uint16_t status, uint32_t req, const char *why)
{
    char f[DLFS_WIRE_HEADER + 8 + 256];
    size_t n = strlen(why) < 255 ? strlen(why) : 255, k = DLFS_WIRE_HEADER;
    memcpy(f + k, "\x81\xa5" "error\xd9", 8);
    k += 8;
    f[k++] = (char)n;
    memcpy(f + k, why, n);
    k += n;
    head(f, status, req, (uint32_t)(k - DLFS_WIRE_HEADER), 0);
    return dlfs_wire_send_all(fd, f, k, 0);
}

/* A msgpack unsigned integer at *p (advanced past it): 0, or -1 if not one. */
static int get_uint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    if (*p >= end)
        return -1;
    uint8_t t = *(*p)++;
    int n = t < 0x80 ? 0 : t == 0xcc ? 1 : t == 0xcd ? 2 : t == 0xce ? 4 : t == 0xcf ? 8 : -1;
    if (n < 0 || end - *p < n)
        return -1;
    *v = n ? 0 : t;
    for (int i = 0; i < n; i++)
        *v = *v << 8 | *(*p)++;
    return 0;
}

/* ReadRange's meta, {"id": bin of DLFS_CHUNK_ID, "offset": uint, "length": uint} in any order: 0 or -1. */
static int parse_read_range(const uint8_t *p, size_t len, uint8_t *id, uint64_t *offset, uint64_t *length)
{
    const uint8_t *end = p + len;
    if (len < 1 || (*p & 0xf0) != 0x80)
        return -1;
    int n = *p++ & 0x0f, seen = 0;
    for (int i = 0; i < n; i++) {
        if (p >= end || (*p & 0xe0) != 0xa0 || end - p < 1 + (*p & 0x1f))
            return -1;
        size_t klen = *p & 0x1f;
        const char *key = (const char *)p + 1;
        p += 1 + klen;
        if (klen == 2 && !memcmp(key, "id", 2)) {
            if (end - p < 2 + DLFS_CHUNK_ID || p[0] != 0xc4 || p[1] != DLFS_CHUNK_ID)
                return -1;
            memcpy(id, p + 2, DLFS_CHUNK_ID);
            p += 2 + DLFS_CHUNK_ID;
            seen |= 1;
        } else if (klen == 6 && !memcmp(key, "offset", 6)) {
            if (get_uint(&p, end, offset) < 0)
                return -1;
            seen |= 2;
        } else if (klen == 6 && !memcmp(key, "length", 6)) {
            if (get_uint(&p, end, length) < 0)
                return -1;
            seen |= 4;
        } else {
            return -1;
        }
    }
    return seen == 7 && p == end ? 0 : -1;
}

/* One request on lane `fd`: 1 served (an error reply included), 0 the peer left, -1 close the lane. */
static int serve(int fd)
{
    char h[DLFS_WIRE_HEADER];
    uint8_t meta[DLFS_LANE_META_MAX];
    uint64_t begun = 0;
    int r = recv_all(fd, h, sizeof h, &begun);
    if (r <= 0)
        return r;
    struct dlfs_wire_head w;
    if (dlfs_wire_unpack(h, &w) < 0 || w.kind != DLFS_WIRE_REQUEST || w.msg != DLFS_WIRE_READ_RANGE || w.status ||
        w.data_len || w.meta_len > sizeof meta || recv_all(fd, meta, w.meta_len, &begun) <= 0)
        return -1; /* not a READ_RANGE (a lane carries nothing else), or cut short */
    uint32_t req = w.req, meta_len = w.meta_len;
    uint8_t id[DLFS_CHUNK_ID];
    uint64_t offset, length;
    if (parse_read_range(meta, meta_len, id, &offset, &length) < 0 || length > DLFS_WIRE_MAX_DATA ||
        offset > INT64_MAX)
        return reply_error(fd, DLFS_WIRE_PROTOCOL, req, "bad READ_RANGE request") < 0 ? -1 : 1;
    uint64_t key;
    memcpy(&key, id, sizeof key);
    struct dlfs_chunk_ref ref;
    if (dlfs_chunk_get(&L.files, L.dir, key >> 1, id, 0, 0, &ref) < 0) {
        char why[64 + 2 * DLFS_CHUNK_ID], *at = why + snprintf(why, 16, "chunk ");
        for (int i = 0; i < DLFS_CHUNK_ID; i++)
            at += snprintf(at, 3, "%02x", id[i]);
        snprintf(at, 32, " is not on this node");
        COUNT(not_found, 1);
        return reply_error(fd, DLFS_WIRE_NOT_FOUND, req, why) < 0 ? -1 : 1;
    }
    struct stat st;
    int ok = fstat(ref.fd, &st) == 0, bad_file = !ok; /* bad_file: open it again next time (not a peer's fault) */
    uint64_t size = ok ? (uint64_t)st.st_size : 0;
    uint32_t n = (uint32_t)(offset >= size ? 0 : size - offset < length ? size - offset : length); /* shorter at the end */
    /* The whole range asked of the disk at once: the file is open for random reads (no read-ahead), and
     * sendfile alone asks in pieces (20 cold records of 100 KB: 11 disk reads so, 21 without). */
    if (n)
        posix_fadvise(ref.fd, (off_t)offset, n, POSIX_FADV_WILLNEED);
    char f[DLFS_WIRE_HEADER + 1];
    head(f, 0, req, 1, n);
    f[DLFS_WIRE_HEADER] = (char)0x80; /* Empty(): {} */
    if (ok) { /* counted before it is sent: a peer that has the reply sees it counted */
        COUNT(reads, 1);
        COUNT(bytes, n);
    }
    ok = ok && dlfs_wire_send_all(fd, f, sizeof f, 0) == 0; /* not MSG_MORE: held back, it cost ~100 ms a cold range */
    off_t at = (off_t)offset;
    for (uint32_t left = n; ok && left;) {
        ssize_t k = sendfile(fd, ref.fd, &at, left);
        if (k < 0 && errno == EINTR)
            continue;
        ok = k > 0; /* 0: the file shrank under us, the frame cannot be finished */
        bad_file |= k == 0;
        left -= ok ? (uint32_t)k : 0;
    }
    dlfs_chunk_put(&ref, bad_file);
    return ok ? 1 : -1;
}

/* Close lanes idle for DLFS_LANE_IDLE_S; once a second at most, by whichever worker comes. */
static void sweep(void)
{
    uint64_t now = dlfs_wire_seconds();
    if (now == __atomic_load_n(&L.swept, __ATOMIC_RELAXED) || pthread_mutex_trylock(&L.lock))
        return;
    L.swept = now;
    for (int k = 0; k < DLFS_LANES_MAX; k++)
        if (L.lane[k].state == ARMED && now >= L.lane[k].used + DLFS_LANE_IDLE_S) {
            shut(k);
            COUNT(closed_idle, 1);
        }
    pthread_mutex_unlock(&L.lock);
}

static void *worker(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, NULL);
    pthread_setname_np(pthread_self(), "dlfs-lanes");
    while (!atomic_load(&L.stopping)) {
        struct epoll_event ev;
        int n = epoll_wait(L.ep, &ev, 1, 1000);
        sweep();
        if (n != 1 || ev.data.u64 == WAKE_TAG)
            continue; /* stopping: the flag says so */
        int k = (int)(uint32_t)ev.data.u64, fd = -1;
        pthread_mutex_lock(&L.lock);
        if (k < DLFS_LANES_MAX && L.lane[k].gen == (uint32_t)(ev.data.u64 >> 32) && L.lane[k].state == ARMED) {
            L.lane[k].state = SERVING;
            fd = L.lane[k].fd;
        }
        pthread_mutex_unlock(&L.lock);
        if (fd < 0)
            continue; /* closed as idle meanwhile */
        int r = serve(fd);
        pthread_mutex_lock(&L.lock);
        L.lane[k].used = dlfs_wire_seconds();
        if (r > 0 && !atomic_load(&L.stopping) && watch(EPOLL_CTL_MOD, k) == 0) {
            L.lane[k].state = ARMED;
        } else {
            if (r < 0)
                COUNT(closed_bad, 1);
            shut(k);
        }
        pthread_mutex_unlock(&L.lock);
    }
    return NULL;
}

int dlfs_lanes_start(const char *dir)
{
    pthread_mutex_lock(&L.lock);
    int rc = -1;
    if (L.ep >= 0) {
        errno = EBUSY;
        goto out;
    }
    L.dir = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (L.dir < 0)
        goto out;
    if (dlfs_chunk_files_init(&L.files, dlfs_chunk_files_budget()) < 0) {
        close(L.dir);
        errno = ENOMEM;
        goto out;
    }
    L.ep = epoll_create1(EPOLL_CLOEXEC);
    L.wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event wake = {.events = EPOLLIN, .data.u64 = WAKE_TAG};
    if (L.ep < 0 || L.wake < 0 || epoll_ctl(L.ep, EPOLL_CTL_ADD, L.wake, &wake) < 0) {
        int err = errno;
        if (L.ep >= 0)
            close(L.ep);
        if (L.wake >= 0)
            close(L.wake);
        L.ep = L.wake = -1;
        dlfs_chunk_files_free(&L.files);
        close(L.dir);
        errno = err;
        goto out;
    }
    for (int k = 0; k < DLFS_LANES_MAX; k++) {
        L.lane[k].fd = -1;
        L.lane[k].state = FREE;
    }
    atomic_store(&L.stopping, 0);
    memset(&L.st, 0, sizeof L.st); /* a node's counters start with it */
    for (L.nworkers = 0; L.nworkers < DLFS_LANES_WORKERS; L.nworkers++)
        if (pthread_create(&L.worker[L.nworkers], NULL, worker, NULL))
            break;
    rc = L.nworkers ? 0 : -1;
out:
    pthread_mutex_unlock(&L.lock);
    if (rc < 0 && L.ep >= 0 && !L.nworkers)
        dlfs_lanes_stop();
    return rc;
}

int dlfs_lanes_add(int fd)
{
    if (dlfs_wire_blocking(fd, DLFS_LANE_STALL_MS) < 0)
        return -1;
    pthread_mutex_lock(&L.lock);
    int rc = -1;
    errno = L.ep < 0 || atomic_load(&L.stopping) ? EINVAL : ENOSPC;
    for (int k = 0; L.ep >= 0 && !atomic_load(&L.stopping) && k < DLFS_LANES_MAX; k++) {
        if (L.lane[k].state != FREE)
            continue;
        L.lane[k].fd = fd;
        L.lane[k].used = dlfs_wire_seconds();
        L.lane[k].state = ARMED;
        if (watch(EPOLL_CTL_ADD, k) < 0) {
            L.lane[k].fd = -1;
            L.lane[k].state = FREE;
            break;
        }
        COUNT(open, 1);
        COUNT(opened, 1);
        rc = 0;
        break;
    }
    pthread_mutex_unlock(&L.lock);
    return rc;
}

int dlfs_lanes_room(void)
{
    pthread_mutex_lock(&L.lock);
    int room = L.ep >= 0 && !atomic_load(&L.stopping) && __atomic_load_n(&L.st.open, __ATOMIC_RELAXED) < DLFS_LANES_MAX;
    pthread_mutex_unlock(&L.lock);
    return room;
}

void dlfs_lanes_stats(struct dlfs_lanes_stats *out)
{
    const uint64_t *src = (const uint64_t *)&L.st;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

void dlfs_lanes_stop(void)
{
    atomic_store(&L.stopping, 1);
    pthread_mutex_lock(&L.lock);
    for (int k = 0; k < DLFS_LANES_MAX; k++)
        if (L.lane[k].state == SERVING)
            shutdown(L.lane[k].fd, SHUT_RDWR); /* a worker in a request's recv or send returns now */
    uint64_t one = 1;
    if (L.wake >= 0) /* every worker in epoll_wait returns now (a failed write: it was readable already) */
        (void)!write(L.wake, &one, sizeof one);
    pthread_mutex_unlock(&L.lock);
    for (int i = 0; i < L.nworkers; i++)
        pthread_join(L.worker[i], NULL); /* each sees the flag within its epoll wait, or its request's bound */
    L.nworkers = 0;
    pthread_mutex_lock(&L.lock);
    for (int k = 0; k < DLFS_LANES_MAX; k++)
        if (L.lane[k].state != FREE)
            shut(k);
    if (L.ep >= 0) {
        close(L.ep);
        close(L.wake);
        dlfs_chunk_files_free(&L.files);
        close(L.dir);
    }
    L.ep = L.dir = L.wake = -1;
    pthread_mutex_unlock(&L.lock);
}
