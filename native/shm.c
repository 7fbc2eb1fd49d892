/* The shared chunk cache's layout and pin protocol (see shm.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shm.h"

static uint64_t align_to(uint64_t n, uint64_t to)
{
    return (n + to - 1) / to * to;
}

uint64_t dlfs_shm_layout(struct dlfs_shm_header *h, uint64_t slab_size, uint64_t nslabs, uint64_t n_extents,
                         uint64_t n_rows)
{
    long page = sysconf(_SC_PAGESIZE);
    if (!slab_size || slab_size > UINT32_MAX || !nslabs || nslabs > DLFS_SHM_SLAB_LIMIT || n_rows < 1 ||
        n_rows > 65536 || n_extents > ((uint64_t)1 << 40) || page <= 0)
        return 0;
    memset(h, 0, sizeof *h);
    memcpy(h->magic, DLFS_SHM_MAGIC, 8);
    h->version = DLFS_SHM_VERSION;
    h->n_rows = (uint32_t)n_rows;
    h->slab_size = slab_size;
    h->nslabs = nslabs;
    h->n_extents = n_extents;
    h->gens = DLFS_SHM_HEADER_BYTES;
    h->entries = h->gens + 8 * nslabs;
    h->offsets = h->entries + 8 * n_extents;
    h->epochs = align_to(h->offsets + 4 * n_extents, 8);
    /* Each row on pages of its own: a client maps its row writable and the rest read-only. */
    h->rows = align_to(h->epochs + 8 * n_rows, (uint64_t)page);
    h->row_stride = align_to(sizeof(struct dlfs_shm_row_head) + 4 * nslabs, (uint64_t)page);
    h->total = h->rows + h->row_stride * n_rows;
    return h->total;
}

void dlfs_shm_map(struct dlfs_shm *s, char *ctl, const char *arena)
{
    s->gens = (uint64_t *)(ctl + s->h.gens);
    s->entries = (uint64_t *)(ctl + s->h.entries);
    s->offsets = (uint32_t *)(ctl + s->h.offsets);
    s->epochs = (uint64_t *)(ctl + s->h.epochs);
    s->rows = ctl + s->h.rows;
    s->mem = arena;
}

/* The arena must hold every slab the header names. */
static int arena_fits(const struct dlfs_shm *s, uint64_t arena_len, char *why)
{
    if (s->h.nslabs * s->h.slab_size > arena_len) {
        snprintf(why, DLFS_SHM_WHY, "cache arena smaller than its slabs");
        return 0;
    }
    return 1;
}

int dlfs_shm_create(struct dlfs_shm *s, char *ctl, uint64_t ctl_len, const char *arena, uint64_t arena_len,
                    uint64_t slab_size, uint64_t nslabs, uint64_t n_extents, uint64_t n_rows, char why[DLFS_SHM_WHY])
{
    if (!dlfs_shm_layout(&s->h, slab_size, nslabs, n_extents, n_rows)) {
        snprintf(why, DLFS_SHM_WHY, "shared cache sizes out of range");
        return -1;
    }
    if (s->h.total > ctl_len) {
        snprintf(why, DLFS_SHM_WHY, "control region of %llu bytes; the layout needs %llu",
                 (unsigned long long)ctl_len, (unsigned long long)s->h.total);
        return -1;
    }
    if (!arena_fits(s, arena_len, why))
        return -1;
    memcpy(ctl, &s->h, sizeof s->h);
    dlfs_shm_map(s, ctl, arena);
    return 0;
}

int dlfs_shm_attach(struct dlfs_shm *s, char *ctl, uint64_t ctl_len, const char *arena, uint64_t arena_len,
                    char why[DLFS_SHM_WHY])
{
    struct dlfs_shm_header h;
    if (ctl_len < DLFS_SHM_HEADER_BYTES) {
        snprintf(why, DLFS_SHM_WHY, "control region shorter than its header");
        return -1;
    }
    memcpy(&h, ctl, sizeof h);
    if (memcmp(h.magic, DLFS_SHM_MAGIC, 8) || h.version != DLFS_SHM_VERSION) {
        snprintf(why, DLFS_SHM_WHY, "not a dlfs shared cache (bad magic or layout version)");
        return -1;
    }
    /* Recomputed, not trusted: every section must be where these sizes put it. */
    if (!dlfs_shm_layout(&s->h, h.slab_size, h.nslabs, h.n_extents, h.n_rows) || memcmp(&s->h, &h, sizeof h) ||
        s->h.total > ctl_len) {
        snprintf(why, DLFS_SHM_WHY, "shared cache header is inconsistent with its region");
        return -1;
    }
    if (!arena_fits(s, arena_len, why))
        return -1;
    dlfs_shm_map(s, ctl, arena);
    return 0;
}

static void refuse(const struct dlfs_shm *s, uint64_t row)
{
    __atomic_fetch_add(&dlfs_shm_row_head(s, row)->refused, 1, __ATOMIC_RELAXED);
}

int dlfs_shm_pin(const struct dlfs_shm *s, struct dlfs_pinner p, uint64_t ext, uint32_t len, const char **buf,
                 uint32_t *slab_out)
{
    uint64_t e = __atomic_load_n(&s->entries[ext], __ATOMIC_ACQUIRE);
    if (!e)
        return 0;
    uint64_t slab = (e & DLFS_SHM_SLAB_LIMIT) - 1;
    if (slab >= s->h.nslabs) /* the entry is shared memory: never trust it */
        return 0;
    if (dlfs_shm_epoch(s, p.row) != p.epoch) { /* the row is no longer ours: not a count in it */
        refuse(s, p.row);
        return 0;
    }
    uint32_t *count = &dlfs_shm_row(s, p.row)[slab];
    __atomic_fetch_add(count, 1, __ATOMIC_SEQ_CST);
    /* The epoch again: the row handed out anew meanwhile may have been cleared after our count, and
     * taking it back could take the new owner's. It stays: a slab kept a while longer, never one freed. */
    if (dlfs_shm_epoch(s, p.row) != p.epoch) {
        refuse(s, p.row);
        return 0;
    }
    if (dlfs_shm_gen(s, slab) == e >> DLFS_SHM_SLAB_BITS) {
        uint32_t off = __atomic_load_n(&s->offsets[ext], __ATOMIC_ACQUIRE);
        /* The entry again: the offset read belongs to it only if it did not change meanwhile. */
        if (__atomic_load_n(&s->entries[ext], __ATOMIC_SEQ_CST) == e && off <= s->h.slab_size &&
            len <= s->h.slab_size - off) {
            *buf = s->mem + slab * s->h.slab_size + off;
            *slab_out = (uint32_t)slab;
            return 1;
        }
    }
    dlfs_shm_unpin(s, p, (uint32_t)slab);
    return 0;
}

int dlfs_shm_unpin(const struct dlfs_shm *s, struct dlfs_pinner p, uint32_t slab)
{
    uint32_t *count = &dlfs_shm_row(s, p.row)[slab];
    if (dlfs_shm_epoch(s, p.row) != p.epoch) {
        refuse(s, p.row);
        return 0;
    }
    uint32_t n = __atomic_load_n(count, __ATOMIC_SEQ_CST);
    do {
        if (n == 0) { /* never below zero: that would wrap to a pin of 4294967295 */
            refuse(s, p.row);
            return 0;
        }
    } while (!__atomic_compare_exchange_n(count, &n, n - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return 1;
}

void dlfs_shm_publish(const struct dlfs_shm *s, uint64_t ext, uint64_t slab, uint32_t off)
{
    /* The offset first: a reader that sees the entry sees where it points. */
    __atomic_store_n(&s->offsets[ext], off, __ATOMIC_RELEASE);
    __atomic_store_n(&s->entries[ext], (dlfs_shm_gen(s, slab) << DLFS_SHM_SLAB_BITS) | (slab + 1), __ATOMIC_SEQ_CST);
}

void dlfs_shm_unpublish(const struct dlfs_shm *s, uint64_t ext)
{
    __atomic_store_n(&s->entries[ext], 0, __ATOMIC_SEQ_CST);
}

uint64_t dlfs_shm_pins_on(const struct dlfs_shm *s, uint64_t slab, uint64_t rows)
{
    uint64_t n = 0;
    for (uint64_t r = 0; r < rows; r++)
        n += __atomic_load_n(&dlfs_shm_row(s, r)[slab], __ATOMIC_SEQ_CST);
    return n;
}

uint64_t dlfs_shm_hand_out(const struct dlfs_shm *s, uint64_t row)
{
    return __atomic_add_fetch(&s->epochs[row], 1, __ATOMIC_SEQ_CST);
}

int dlfs_shm_released(const struct dlfs_shm *s, uint64_t row)
{
    uint64_t epoch = dlfs_shm_epoch(s, row);
    return epoch && __atomic_load_n(&dlfs_shm_row_head(s, row)->released, __ATOMIC_SEQ_CST) == epoch;
}

uint64_t dlfs_shm_clear_row(const struct dlfs_shm *s, uint64_t row, uint64_t *refused)
{
    struct dlfs_shm_row_head *head = dlfs_shm_row_head(s, row);
    uint32_t *r = dlfs_shm_row(s, row);
    uint64_t freed = 0;
    for (uint64_t i = 0; i < s->h.nslabs; i++)
        freed += __atomic_exchange_n(&r[i], 0, __ATOMIC_SEQ_CST);
    *refused = __atomic_exchange_n(&head->refused, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&head->released, 0, __ATOMIC_SEQ_CST);
    return freed;
}

/* --- consumption ----------------------------------------------------------------------------- */

int dlfs_consume_init(struct dlfs_consume *c, uint64_t n_extents, uint32_t ring_cap)
{
    memset(c, 0, sizeof *c);
    c->wake_fd = -1;
    /* Anonymous and untouched until used: a 10M-extent index costs address space, not memory. */
    size_t bytes = (size_t)(n_extents ? n_extents : 1) * sizeof(uint32_t);
    void *served = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (served == MAP_FAILED)
        return -1;
    void *pending = mmap(NULL, bytes / sizeof(uint32_t), PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (pending == MAP_FAILED) {
        munmap(served, bytes);
        return -1;
    }
    c->ring = calloc(ring_cap, sizeof *c->ring);
    c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (!c->ring || c->wake_fd < 0) {
        int err = errno ? errno : ENOMEM;
        munmap(served, bytes);
        munmap(pending, bytes / sizeof(uint32_t));
        free(c->ring);
        if (c->wake_fd >= 0)
            close(c->wake_fd);
        errno = err;
        return -1;
    }
    c->served = served;
    c->pending = pending;
    c->n_extents = n_extents;
    c->cap = ring_cap;
    pthread_mutex_init(&c->lock, NULL);
    return 0;
}

void dlfs_consume_free(struct dlfs_consume *c)
{
    if (c->served)
        munmap(c->served, (size_t)(c->n_extents ? c->n_extents : 1) * sizeof(uint32_t));
    if (c->pending)
        munmap(c->pending, (size_t)(c->n_extents ? c->n_extents : 1));
    free(c->ring);
    if (c->wake_fd >= 0)
        close(c->wake_fd);
    if (c->served)
        pthread_mutex_destroy(&c->lock);
    memset(c, 0, sizeof *c);
    c->wake_fd = -1;
}

int dlfs_consume_add(struct dlfs_consume *c, uint64_t ext, uint32_t n, uint32_t len)
{
    if (ext >= c->n_extents || !n)
        return 0;
    uint32_t before = __atomic_fetch_add(&c->served[ext], n, __ATOMIC_RELAXED);
    return before < len && before + (uint64_t)n >= len;
}

/* Make the ring's eventfd readable. */
static void consume_signal(struct dlfs_consume *c)
{
    uint64_t one = 1;
    if (write(c->wake_fd, &one, sizeof one) < 0) {
        /* EAGAIN: the counter is saturated, so it is readable already */
    }
}

void dlfs_consume_push(struct dlfs_consume *c, uint32_t ext)
{
    int wake = 0;
    pthread_mutex_lock(&c->lock);
    if (c->len < c->cap) {
        wake = c->len == 0;
        c->ring[c->len++] = ext;
    } else {
        c->dropped++;
    }
    pthread_mutex_unlock(&c->lock);
    if (wake)
        consume_signal(c);
}

void dlfs_consume_hint(struct dlfs_consume *c, uint32_t ino, uint32_t ext)
{
    uint64_t h = (uint64_t)ino << 32 | ext;
    int wake = 0;
    pthread_mutex_lock(&c->lock);
    int known = 0;
    for (uint32_t i = 0; i < c->nhints && !known; i++)
        known = c->hints[i] == h;
    if (!known && c->nhints < DLFS_HINTS_MAX) {
        wake = c->nhints == 0;
        c->hints[c->nhints++] = h;
    }
    pthread_mutex_unlock(&c->lock);
    if (wake)
        consume_signal(c);
}

uint32_t dlfs_consume_take_hints(struct dlfs_consume *c, uint64_t *out)
{
    pthread_mutex_lock(&c->lock);
    uint32_t n = c->nhints;
    memcpy(out, c->hints, n * sizeof *out);
    c->nhints = 0;
    pthread_mutex_unlock(&c->lock);
    return n;
}

uint32_t dlfs_consume_take(struct dlfs_consume *c, uint32_t *out, uint32_t max)
{
    uint64_t drained;
    if (read(c->wake_fd, &drained, sizeof drained) < 0) {
        /* EAGAIN: nothing signalled since the last take; the ring may still hold a few */
    }
    pthread_mutex_lock(&c->lock);
    uint32_t n = c->len < max ? c->len : max;
    memcpy(out, c->ring, n * sizeof *out);
    memmove(c->ring, c->ring + n, (c->len - n) * sizeof *out);
    c->len -= n;
    int more = c->len > 0;
    pthread_mutex_unlock(&c->lock);
    if (more)
        consume_signal(c);
    return n;
}
