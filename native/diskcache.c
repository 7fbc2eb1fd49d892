/* The disk cache's files read by the serving threads (diskcache.h). */
#define _GNU_SOURCE
#include "diskcache.h"

#include "indexview.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { FREE, FILLING, FULL };

struct keep_slot {
    int state; /* FREE -> FILLING (a serving thread) -> FULL -> FREE (the taker) */
    uint64_t chunk, offset;
    uint32_t len;
    char *data; /* DLFS_KEEP_MAX bytes */
};

static struct {
    pthread_mutex_t lock; /* Python's side: opening, closing */
    uint32_t *tag;        /* per chunk: its file's tag, or 0; NULL while closed */
    uint8_t *used;        /* per chunk: read since Python last asked */
    uint64_t n;
    int dir;
    struct dlfs_chunk_files files;
    /* Records offered to be kept: `keeping` once the slots exist; `full` counts FULL slots (under wake). */
    int keeping, closed, full;
    struct keep_slot slot[DLFS_KEEP_SLOTS];
    pthread_mutex_t wake;
    pthread_cond_t offered;
    uint64_t kept, dropped;
} D = {.lock = PTHREAD_MUTEX_INITIALIZER, .dir = -1, .wake = PTHREAD_MUTEX_INITIALIZER,
       .offered = PTHREAD_COND_INITIALIZER};

int dlfs_dcache_open(const char *chunk_dir, uint64_t n)
{
    pthread_mutex_lock(&D.lock);
    int rc = -1;
    if (D.tag) {
        errno = EBUSY;
        goto out;
    }
    int dir = open(chunk_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0)
        goto out;
    uint32_t *tag = calloc(n ? n : 1, sizeof *tag);
    uint8_t *used = calloc(n ? n : 1, 1);
    if (!tag || !used || dlfs_chunk_files_init(&D.files, dlfs_chunk_files_budget()) < 0) {
        free(tag); /* (the files' table fails last: nothing of it to free) */
        free(used);
        close(dir);
        errno = ENOMEM;
        goto out;
    }
    D.files.renamed = 1;
    pthread_mutex_lock(&D.wake); /* (a process may open it again after a close: tests do) */
    D.closed = D.full = 0;
    for (int k = 0; k < DLFS_KEEP_SLOTS; k++)
        D.slot[k].state = FREE;
    pthread_mutex_unlock(&D.wake);
    D.dir = dir;
    D.n = n;
    D.used = used;
    __atomic_store_n(&D.tag, tag, __ATOMIC_RELEASE);
    rc = 0;
out:
    pthread_mutex_unlock(&D.lock);
    return rc;
}

int dlfs_dcache_set(uint64_t ci, unsigned tag)
{
    pthread_mutex_lock(&D.lock); /* Python's writer thread and its event loop both set tags; a close may come */
    int rc = 0;
    if (!D.tag || ci >= D.n) {
        errno = EINVAL;
        rc = -1;
    } else { /* a serving thread reading it meanwhile opens the old name or the new */
        __atomic_store_n(&D.tag[ci], tag, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&D.lock);
    return rc;
}

int dlfs_dcache_on(void)
{
    return __atomic_load_n(&D.tag, __ATOMIC_ACQUIRE) != NULL;
}

int dlfs_dcache_get(uint64_t ci, const uint8_t *id, uint64_t off, uint64_t len, int direct, struct dlfs_chunk_ref *ref)
{
    uint32_t *t = __atomic_load_n(&D.tag, __ATOMIC_ACQUIRE);
    uint32_t tag = t && ci < D.n ? __atomic_load_n(&t[ci], __ATOMIC_RELAXED) : 0;
    if (!tag || dlfs_chunk_get(&D.files, D.dir, ci, id, tag, direct, ref) < 0)
        return -1;
    /* A hole inside the range: bytes never written there (a record not fetched yet), or punched. */
    off_t hole = lseek(ref->fd, (off_t)off, SEEK_HOLE);
    if (hole < 0 || (uint64_t)hole < off + len) {
        dlfs_chunk_put(ref, 0);
        return -1;
    }
    if (!__atomic_load_n(&D.used[ci], __ATOMIC_RELAXED))
        __atomic_store_n(&D.used[ci], 1, __ATOMIC_RELAXED);
    return 0;
}

int dlfs_dcache_ref(const struct dlfs_chunk_ref *ref)
{
    return ref->table == &D.files;
}

uint64_t dlfs_dcache_used(uint64_t *out, uint64_t max)
{
    uint64_t k = 0;
    pthread_mutex_lock(&D.lock);
    for (uint64_t i = 0; D.tag && i < D.n && k < max; i++)
        if (__atomic_load_n(&D.used[i], __ATOMIC_RELAXED)) {
            __atomic_store_n(&D.used[i], 0, __ATOMIC_RELAXED);
            out[k++] = i;
        }
    pthread_mutex_unlock(&D.lock);
    return k;
}

int dlfs_dcache_keep(void)
{
    pthread_mutex_lock(&D.lock);
    int rc = 0;
    if (!D.tag) {
        errno = EINVAL;
        rc = -1;
    }
    for (int k = 0; !rc && !D.keeping && k < DLFS_KEEP_SLOTS; k++)
        if (!D.slot[k].data && !(D.slot[k].data = malloc(DLFS_KEEP_MAX))) {
            errno = ENOMEM;
            rc = -1;
        }
    if (!rc)
        __atomic_store_n(&D.keeping, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&D.lock);
    return rc;
}

int dlfs_dcache_keeping(void)
{
    return __atomic_load_n(&D.keeping, __ATOMIC_ACQUIRE);
}

void dlfs_dcache_offer(const struct dlfs_extent *e, const char *data)
{
    if (!__atomic_load_n(&D.keeping, __ATOMIC_ACQUIRE) || e->stored_len > DLFS_KEEP_MAX)
        return;
    for (int k = 0; k < DLFS_KEEP_SLOTS; k++) {
        struct keep_slot *s = &D.slot[k];
        int want = FREE;
        if (!__atomic_compare_exchange_n(&s->state, &want, FILLING, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            continue;
        memcpy(s->data, data, e->stored_len);
        s->chunk = e->chunk;
        s->offset = e->offset;
        s->len = e->stored_len;
        __atomic_store_n(&s->state, FULL, __ATOMIC_RELEASE);
        __atomic_add_fetch(&D.kept, 1, __ATOMIC_RELAXED);
        pthread_mutex_lock(&D.wake);
        if (D.full++ == 0)
            pthread_cond_signal(&D.offered);
        pthread_mutex_unlock(&D.wake);
        return;
    }
    __atomic_add_fetch(&D.dropped, 1, __ATOMIC_RELAXED); /* the taker fell behind: this one is not kept */
}

int dlfs_dcache_take(unsigned ms, void (*take)(void *arg, uint64_t chunk, uint64_t offset, const char *data,
                                               uint32_t len), void *arg)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += ms / 1000;
    until.tv_nsec += (long)(ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&D.wake);
    while (!D.full && !D.closed && pthread_cond_timedwait(&D.offered, &D.wake, &until) == 0)
        ;
    int closed = D.closed;
    pthread_mutex_unlock(&D.wake);
    int n = 0;
    for (int k = 0; k < DLFS_KEEP_SLOTS; k++) {
        struct keep_slot *s = &D.slot[k];
        if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != FULL)
            continue;
        take(arg, s->chunk, s->offset, s->data, s->len);
        __atomic_store_n(&s->state, FREE, __ATOMIC_RELEASE);
        pthread_mutex_lock(&D.wake);
        D.full--;
        pthread_mutex_unlock(&D.wake);
        n++;
    }
    return closed && !n ? -1 : n; /* once ended, what was offered before is still handed over first */
}

void dlfs_dcache_keep_end(void)
{
    __atomic_store_n(&D.keeping, 0, __ATOMIC_RELEASE);
    pthread_mutex_lock(&D.wake);
    D.closed = 1;
    pthread_cond_broadcast(&D.offered);
    pthread_mutex_unlock(&D.wake);
}

void dlfs_dcache_keep_stats(uint64_t *kept, uint64_t *dropped)
{
    *kept = __atomic_load_n(&D.kept, __ATOMIC_RELAXED);
    *dropped = __atomic_load_n(&D.dropped, __ATOMIC_RELAXED);
}

void dlfs_dcache_close(void)
{
    dlfs_dcache_keep_end(); /* (the slots' memory stays for the process's life: a taker may copy out of one) */
    pthread_mutex_lock(&D.lock);
    uint32_t *t = D.tag;
    __atomic_store_n(&D.tag, NULL, __ATOMIC_RELEASE);
    if (t) {
        dlfs_chunk_files_free(&D.files);
        close(D.dir);
        free(D.used);
        free(t);
        D.dir = -1;
        D.used = NULL;
        D.n = 0;
    }
    pthread_mutex_unlock(&D.lock);
}
