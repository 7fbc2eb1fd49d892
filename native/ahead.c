/* Records read at their file's LOOKUP by the /dev/fuse serving threads: see ahead.h. */
#define _GNU_SOURCE
#include "ahead.h"

#include <pthread.h>
#include <time.h>

#include "hugebuf.h"

#define SLOT_BYTES DLFS_REPLY_SCRATCH

enum { FREE, READING, READ, TAKEN };

struct slot {
    int state;
    uint64_t ext, age;
    struct dlfs_chunk_ref f; /* held while READ or TAKEN */
    const char *data;        /* the record's first byte in the slot's buffer */
};

static struct {
    pthread_mutex_t lock; /* everything here */
    pthread_cond_t done;  /* a read ended */
    struct slot s[DLFS_AHEAD_SLOTS];
    char *buf; /* the slots' buffers, mapped on the first read */
    int busy;  /* slots not FREE: read without the lock, so a READ with none to look at takes no lock */
    uint64_t starts; /* reads started: the next one's age */
    struct dlfs_ahead_score sc;
} A = {.lock = PTHREAD_MUTEX_INITIALIZER, .done = PTHREAD_COND_INITIALIZER, .sc = DLFS_AHEAD_SCORE_INIT};

static void rescore(int by)
{
    dlfs_ahead_rescore(&A.sc, by, A.starts);
}

static int find(uint64_t ext)
{
    for (int k = 0; k < DLFS_AHEAD_SLOTS; k++)
        if ((A.s[k].state == READING || A.s[k].state == READ) && A.s[k].ext == ext)
            return k;
    return -1;
}

static void set_free(struct slot *s)
{
    s->state = FREE;
    __atomic_store_n(&A.busy, A.busy - 1, __ATOMIC_RELAXED);
}

/* A slot to read into: a free one, else the oldest read that no READ has taken (its LOOKUP foretold
 * nothing: the score drops); -1 if every slot is busy. */
static int claim(void)
{
    int oldest = -1;
    for (int k = 0; k < DLFS_AHEAD_SLOTS; k++) {
        if (A.s[k].state == FREE)
            return k;
        if (A.s[k].state == READ && (oldest < 0 || A.s[k].age < A.s[oldest].age))
            oldest = k;
    }
    if (oldest >= 0) {
        dlfs_ahead_unused(&A.sc, A.s[oldest].age, A.starts);
        dlfs_chunk_put(&A.s[oldest].f, 0);
        set_free(&A.s[oldest]);
    }
    return oldest;
}

void dlfs_ahead_lookup(const struct dlfs_serve *sv, uint64_t ino, struct dlfs_counters *c)
{
    uint64_t ext, lo;
    struct dlfs_extent e;
    if (!ino || !dlfs_record_wanted(sv, ino, &ext, &e) || dlfs_record_span(&e, &lo) > SLOT_BYTES)
        return;
    pthread_mutex_lock(&A.lock);
    if (!A.buf)
        __atomic_store_n(&A.buf, dlfs_hugebuf_map(DLFS_AHEAD_SLOTS * (size_t)SLOT_BYTES), __ATOMIC_RELAXED);
    int k = -1;
    if (A.buf && !dlfs_ahead_skip(&A.sc) && find(ext) < 0 && (k = claim()) >= 0) {
        A.s[k] = (struct slot){.state = READING, .ext = ext, .age = A.starts++};
        __atomic_store_n(&A.busy, A.busy + 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&A.lock);
    if (k < 0)
        return;
    struct dlfs_chunk_ref f;
    uint32_t len;
    const char *data = NULL;
    if (dlfs_record_plan(sv, &e, SLOT_BYTES, &f, &lo, &len) == 0 &&
        !(data = dlfs_record_direct(&f, &e, A.buf + (size_t)k * SLOT_BYTES, SLOT_BYTES)))
        dlfs_chunk_put(&f, 0); /* the READ reads it itself, and says what is wrong */
    pthread_mutex_lock(&A.lock);
    if (data) {
        A.s[k].f = f;
        A.s[k].data = data;
        A.s[k].state = READ;
        DLFS_COUNT(c, records_ahead, 1);
    } else {
        set_free(&A.s[k]);
    }
    pthread_cond_broadcast(&A.done);
    pthread_mutex_unlock(&A.lock);
}

int dlfs_ahead_take(uint64_t ext, const char **data, const struct dlfs_chunk_ref **f, struct dlfs_counters *c)
{
    if (!__atomic_load_n(&A.busy, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&A.lock);
    int k = find(ext);
    if (k >= 0 && A.s[k].state == READING) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until); /* the condition's clock */
        until.tv_nsec += (DLFS_AHEAD_WAIT_MS % 1000) * 1000000L;
        until.tv_sec += DLFS_AHEAD_WAIT_MS / 1000 + until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        while (A.s[k].state == READING && A.s[k].ext == ext &&
               pthread_cond_timedwait(&A.done, &A.lock, &until) == 0)
            ;
        if (A.s[k].state != READ || A.s[k].ext != ext) /* failed, or freed and read again meanwhile */
            k = -1;
    }
    if (k >= 0) {
        A.s[k].state = TAKEN;
        *data = A.s[k].data;
        *f = &A.s[k].f;
        rescore(1);
        DLFS_COUNT(c, records_ahead_used, 1);
    }
    pthread_mutex_unlock(&A.lock);
    return k + 1;
}

void dlfs_ahead_give(int slot, int bad)
{
    pthread_mutex_lock(&A.lock);
    dlfs_chunk_put(&A.s[slot - 1].f, bad);
    set_free(&A.s[slot - 1]);
    pthread_mutex_unlock(&A.lock);
}

void dlfs_ahead_missed(void)
{
    if (!__atomic_load_n(&A.buf, __ATOMIC_RELAXED)) /* never read ahead: FUSE over io_uring, say */
        return;
    pthread_mutex_lock(&A.lock);
    rescore(1);
    pthread_mutex_unlock(&A.lock);
}

void dlfs_ahead_reset(void)
{
    pthread_mutex_lock(&A.lock);
    for (int k = 0; k < DLFS_AHEAD_SLOTS; k++) {
        if (A.s[k].state == READ || A.s[k].state == TAKEN)
            dlfs_chunk_put(&A.s[k].f, 0);
        A.s[k].state = FREE;
    }
    A.busy = 0;
    A.sc = (struct dlfs_ahead_score)DLFS_AHEAD_SCORE_INIT;
    pthread_mutex_unlock(&A.lock);
}
