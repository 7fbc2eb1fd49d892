/* The disk cache's files read by the serving threads (diskcache.h). */
#define _GNU_SOURCE
#include "diskcache.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static struct {
    pthread_mutex_t lock; /* Python's side: opening, closing */
    uint32_t *tag;        /* per chunk: its file's tag, or 0; NULL while closed */
    uint8_t *used;        /* per chunk: read since Python last asked */
    uint64_t n;
    int dir;
    struct dlfs_chunk_files files;
} D = {.lock = PTHREAD_MUTEX_INITIALIZER, .dir = -1};

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
    D.dir = dir;
    D.n = n;
    D.used = used;
    __atomic_store_n(&D.tag, tag, __ATOMIC_RELEASE);
    rc = 0;
out:
    pthread_mutex_unlock(&D.lock);
    return rc;
}

int dlfs_dcache_set(uint64_t ci, uint32_t tag)
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

void dlfs_dcache_close(void)
{
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
