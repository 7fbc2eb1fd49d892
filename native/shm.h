#ifndef DLFS_SHM_H
#define DLFS_SHM_H
/* The shared chunk cache of a mount: the one C definition of its control region's layout and of the
 * pin protocol, used by dlfs.direct's Python types (direct.c) and by the mount's serving threads
 * (answer.c). The mount's cache arena (slabs of read-ahead) is a memfd that client processes map
 * read-only; a second memfd, the control region, says where each cached record is and who holds what:
 *
 *   header   128 B                   magic "DLFSSHM1", version, rows, slab size, slabs, extents,
 *                                    section offsets, total size
 *   gens     u64 per slab            bumped when the mount retires a slab (its records dropped)
 *   entries  u64 per extent          0: not in a slab; else (gen << 24) | (slab + 1)
 *   offsets  u32 per extent          where the record's bytes start in its slab
 *   rows     u32 per client per slab pins held by that client (process) on that slab
 *
 * A reader pins a slab by adding to its own row, then re-reading the slab's gen; the mount retires a
 * slab by clearing its entries, bumping its gen, then summing the rows (all sequentially consistent):
 * either the reader sees the new gen and lets go, or the mount sees the pin and keeps the slab's bytes
 * until the pin is released. The mount's own serving threads pin through a row of their own. */
#include <pthread.h>
#include <stdint.h>

#define DLFS_SHM_MAGIC "DLFSSHM1"
#define DLFS_SHM_VERSION 1
#define DLFS_SHM_HEADER_BYTES 128
#define DLFS_SHM_SLAB_BITS 24
#define DLFS_SHM_SLAB_LIMIT ((1u << DLFS_SHM_SLAB_BITS) - 1)

struct dlfs_shm_header {
    char magic[8];
    uint32_t version, n_rows;
    uint64_t slab_size, nslabs, n_extents;
    uint64_t gens, entries, offsets, rows, total;
};

struct dlfs_shm {
    struct dlfs_shm_header h;
    uint64_t *gens, *entries;
    uint32_t *offsets, *rows;
    const char *mem; /* the arena: slab i at mem + i * slab_size */
};

/* The layout for these sizes in `h`; its total bytes, or 0 if they cannot be laid out. */
uint64_t dlfs_shm_layout(struct dlfs_shm_header *h, uint64_t slab_size, uint64_t nslabs, uint64_t n_extents,
                         uint64_t n_rows);
/* Point `s` at the sections of a control region laid out as `s->h` says, and at the arena. */
void dlfs_shm_map(struct dlfs_shm *s, char *ctl, const char *arena);

static inline uint32_t *dlfs_shm_row(const struct dlfs_shm *s, uint64_t row)
{
    return s->rows + row * s->h.nslabs;
}

static inline uint64_t dlfs_shm_gen(const struct dlfs_shm *s, uint64_t slab)
{
    return __atomic_load_n(&s->gens[slab], __ATOMIC_SEQ_CST) & (((uint64_t)1 << (64 - DLFS_SHM_SLAB_BITS)) - 1);
}

/* Pin extent `ext` (raw bytes `len`) for `row` where it is now: 1 with *buf and *slab set, 0 if it
 * is not (or no longer) whole in a slab. */
int dlfs_shm_pin(const struct dlfs_shm *s, uint64_t row, uint64_t ext, uint32_t len, const char **buf,
                 uint32_t *slab);
static inline void dlfs_shm_unpin(const struct dlfs_shm *s, uint64_t row, uint32_t slab)
{
    __atomic_fetch_sub(&dlfs_shm_row(s, row)[slab], 1, __ATOMIC_SEQ_CST);
}

/* The mount's side. */
void dlfs_shm_publish(const struct dlfs_shm *s, uint64_t ext, uint64_t slab, uint32_t off);
void dlfs_shm_unpublish(const struct dlfs_shm *s, uint64_t ext);
/* Pins held on `slab` by rows 0..rows-1. */
uint64_t dlfs_shm_pins_on(const struct dlfs_shm *s, uint64_t slab, uint64_t rows);

/* What the kernel has been sent of each record (mount side only, never shared): once all of a record's
 * bytes have gone out, the record is *consumed* and its extent is queued for the cache to drop (the
 * kernel keeps the pages). Counted by whoever replies: the serving threads or the Python handlers. */
struct dlfs_consume {
    uint32_t *served;  /* bytes per extent, reset when the record is published again */
    uint64_t n_extents;
    pthread_mutex_t lock;
    uint32_t *ring;    /* extents consumed and not yet taken by the cache */
    uint32_t cap, len;
    int wake_fd;       /* an eventfd, readable while the ring is not empty */
    uint64_t dropped;  /* consumed extents the full ring could not hold (the cache evicts them in time) */
};

/* 0, or -1 with errno set. */
int dlfs_consume_init(struct dlfs_consume *c, uint64_t n_extents, uint32_t ring_cap);
void dlfs_consume_free(struct dlfs_consume *c);
/* `n` more bytes of extent `ext` (raw length `len`) went to the kernel; 1 if that completed it. */
int dlfs_consume_add(struct dlfs_consume *c, uint64_t ext, uint32_t n, uint32_t len);
/* Queue a completed extent for the cache. */
void dlfs_consume_push(struct dlfs_consume *c, uint32_t ext);
/* Move up to `max` queued extents to `out`; how many. */
uint32_t dlfs_consume_take(struct dlfs_consume *c, uint32_t *out, uint32_t max);
#endif
