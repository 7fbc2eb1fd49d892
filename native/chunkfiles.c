/* This machine's chunk files, shared by the serving threads (see chunkfiles.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chunkfiles.h"
#include "indexview.h"

_Static_assert(sizeof(((struct dlfs_chunk_file *)0)->id) == DLFS_CHUNK_ID, "a slot holds a whole chunk id");

#define NO_DIRECT (-2)

static uint64_t opened; /* files opened by every table of the process (stats) */

uint64_t dlfs_chunk_files_opened(void)
{
    return __atomic_load_n(&opened, __ATOMIC_RELAXED);
}

static uint64_t coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

unsigned dlfs_chunk_files_budget(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) < 0 || r.rlim_cur == RLIM_INFINITY)
        return DLFS_CHUNK_FILES_MAX;
    rlim_t n = r.rlim_cur / 16;
    return n < DLFS_CHUNK_WAYS ? DLFS_CHUNK_WAYS : n > DLFS_CHUNK_FILES_MAX ? DLFS_CHUNK_FILES_MAX : (unsigned)n;
}

static void empty(struct dlfs_chunk_file *f)
{
    memset(f, 0, sizeof *f);
    f->chunk = -1;
    f->fd = f->direct = f->spare = -1;
}

int dlfs_chunk_files_init(struct dlfs_chunk_files *t, unsigned files)
{
    memset(t, 0, sizeof *t);
    unsigned sets = 1;
    while (sets * 2 * DLFS_CHUNK_WAYS <= files)
        sets *= 2;
    t->slot = malloc((size_t)sets * DLFS_CHUNK_WAYS * sizeof *t->slot);
    if (!t->slot)
        return -1;
    t->nsets = sets;
    for (unsigned i = 0; i < sets * DLFS_CHUNK_WAYS; i++)
        empty(&t->slot[i]);
    pthread_mutex_init(&t->lock, NULL);
    return 0;
}

/* Close slot f's files and empty it (nobody reads it). */
static void forget(struct dlfs_chunk_file *f)
{
    if (f->fd >= 0)
        close(f->fd);
    if (f->direct >= 0)
        close(f->direct);
    if (f->spare >= 0)
        close(f->spare);
    empty(f);
}

void dlfs_chunk_files_free(struct dlfs_chunk_files *t)
{
    if (!t->slot)
        return;
    for (unsigned i = 0; i < t->nsets * DLFS_CHUNK_WAYS; i++)
        forget(&t->slot[i]);
    free(t->slot);
    t->slot = NULL;
    pthread_mutex_destroy(&t->lock);
}

#define PATH_MAX_LEN (3 + 2 * DLFS_CHUNK_ID + 9 + 1) /* "ab/" + the id in hex + ".<tag>" + NUL */

/* "ab/abcd..." for chunk id `id`, and ".<tag>" (8 hex digits: a disk cache's name) after it unless 0. */
static void chunk_path(const uint8_t *id, uint32_t tag, char path[PATH_MAX_LEN])
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < DLFS_CHUNK_ID; i++) {
        path[3 + 2 * i] = hex[id[i] >> 4];
        path[4 + 2 * i] = hex[id[i] & 15];
    }
    char *end = path + 3 + 2 * DLFS_CHUNK_ID;
    if (tag) {
        *end++ = '.';
        for (int k = 7; k >= 0; k--)
            *end++ = hex[(tag >> (4 * k)) & 15];
    }
    *end = 0;
    path[0] = path[3];
    path[1] = path[4];
    path[2] = '/';
}

/* Open chunk `ci` into the empty slot f (a missing file is remembered as fd -1). */
static void open_into(struct dlfs_chunk_file *f, int dir, uint64_t ci, const uint8_t *id, uint32_t tag,
                      const char *path, uint64_t now)
{
    empty(f);
    memcpy(f->id, id, DLFS_CHUNK_ID);
    f->tag = tag;
    int fd = openat(dir, path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) < 0) {
        close(fd);
        fd = -1;
    }
    if (fd >= 0) { /* reads here are of one record or a few blocks: read-ahead through the chunk would be waste */
        posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
        __atomic_add_fetch(&opened, 1, __ATOMIC_RELAXED);
    }
    f->chunk = (int64_t)ci;
    f->fd = fd;
    f->ino = fd >= 0 ? (uint64_t)st.st_ino : 0;
    f->dev = fd >= 0 ? (uint64_t)st.st_dev : 0;
    f->checked = now;
    f->used = 1;
}

/* Whether slot f still names what its path does (the same inode, or still absent). */
static int still_there(int dir, const struct dlfs_chunk_file *f, const char *path)
{
    struct stat st;
    int here = fstatat(dir, path, &st, 0) == 0;
    return here ? f->fd >= 0 && (uint64_t)st.st_ino == f->ino && (uint64_t)st.st_dev == f->dev : f->fd < 0;
}

/* The O_DIRECT twin of slot f's file, opened through the kept descriptor (the inode checked, not the
 * path again). */
static void open_direct(struct dlfs_chunk_file *f)
{
    char proc[32];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", f->fd);
    int fd = open(proc, O_RDONLY | O_DIRECT | O_CLOEXEC);
    f->direct = fd >= 0 ? fd : NO_DIRECT;
    if (fd >= 0)
        __atomic_add_fetch(&opened, 1, __ATOMIC_RELAXED);
}

/* Chunk `ci` opened for one reader alone (every slot of its set is being read). */
static int open_alone(int dir, const char *path, int direct, struct dlfs_chunk_ref *ref)
{
    ref->slot = -1;
    ref->fd = openat(dir, path, O_RDONLY | O_CLOEXEC);
    ref->direct = -1;
    if (ref->fd < 0)
        return -1;
    if (direct)
        ref->direct = openat(dir, path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    __atomic_add_fetch(&opened, ref->direct >= 0 ? 2 : 1, __ATOMIC_RELAXED);
    return 0;
}

int dlfs_chunk_get(struct dlfs_chunk_files *t, int dir, uint64_t ci, const uint8_t *id, uint32_t tag, int direct,
                   struct dlfs_chunk_ref *ref)
{
    if (!id) /* out of the index's range */
        return -1;
    char path[PATH_MAX_LEN];
    chunk_path(id, tag, path);
    ref->table = t;
    uint64_t now = coarse_ns();
    unsigned set = (unsigned)((ci * 0x9E3779B97F4A7C15ull) >> 32) & (t->nsets - 1);
    struct dlfs_chunk_file *ways = &t->slot[set * DLFS_CHUNK_WAYS], *f = NULL;
    pthread_mutex_lock(&t->lock);
    for (int w = 0; w < DLFS_CHUNK_WAYS; w++)
        if (ways[w].chunk == (int64_t)ci && ways[w].tag == tag && !memcmp(ways[w].id, id, DLFS_CHUNK_ID)) {
            f = &ways[w];
            break;
        }
    if (f && !f->failed && now >= f->checked + DLFS_LOCAL_RECHECK_NS) {
        if (still_there(dir, f, path))
            f->checked = now;
        else
            f->failed = 1; /* gone, replaced or arrived: opened again below */
    }
    if (f && f->failed) {
        if (f->readers) {
            pthread_mutex_unlock(&t->lock);
            return open_alone(dir, path, direct, ref);
        }
        forget(f);
        open_into(f, dir, ci, id, tag, path, now);
    }
    if (!f) { /* an empty way, else one nobody reads and nobody used since the hand last passed */
        for (int w = 0; w < DLFS_CHUNK_WAYS && !f; w++)
            if (ways[w].chunk < 0)
                f = &ways[w];
        for (int pass = 0; pass < 2 && !f; pass++)
            for (int k = 0; k < DLFS_CHUNK_WAYS && !f; k++) {
                struct dlfs_chunk_file *v = &ways[(t->hand + (unsigned)k) % DLFS_CHUNK_WAYS];
                if (v->readers)
                    continue;
                if (v->used && pass == 0)
                    v->used = 0;
                else
                    f = v;
            }
        if (!f) {
            pthread_mutex_unlock(&t->lock);
            return open_alone(dir, path, direct, ref);
        }
        t->hand++;
        forget(f);
        open_into(f, dir, ci, id, tag, path, now);
    }
    if (f->fd < 0) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    f->used = 1;
    f->readers++;
    if (direct && f->direct == -1)
        open_direct(f);
    ref->slot = (int)(f - t->slot);
    ref->fd = f->fd;
    ref->direct = direct && f->direct >= 0 ? f->direct : -1;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

void dlfs_chunk_put(struct dlfs_chunk_ref *ref, int failed)
{
    struct dlfs_chunk_files *t = ref->table;
    if (ref->slot < 0) {
        if (ref->fd >= 0)
            close(ref->fd);
        if (ref->direct >= 0)
            close(ref->direct);
        ref->fd = ref->direct = -1;
        return;
    }
    pthread_mutex_lock(&t->lock);
    struct dlfs_chunk_file *f = &t->slot[ref->slot];
    f->readers--;
    if (failed && !t->renamed)
        f->failed = 1;
    if (f->failed && !f->readers)
        forget(f);
    pthread_mutex_unlock(&t->lock);
    ref->slot = -1;
    ref->fd = ref->direct = -1;
}

void dlfs_chunk_no_direct(struct dlfs_chunk_ref *ref)
{
    struct dlfs_chunk_files *t = ref->table;
    if (ref->slot < 0) {
        if (ref->direct >= 0)
            close(ref->direct);
        ref->direct = -1;
        return;
    }
    pthread_mutex_lock(&t->lock);
    struct dlfs_chunk_file *f = &t->slot[ref->slot];
    if (f->direct >= 0 && f->direct == ref->direct) { /* others may be reading through it: closed with the slot */
        int fd = f->direct;
        f->direct = NO_DIRECT;
        f->spare = fd;
    }
    pthread_mutex_unlock(&t->lock);
    ref->direct = -1;
}
