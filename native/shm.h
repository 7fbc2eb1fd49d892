#ifndef DLFS_SHM_H
#define DLFS_SHM_H
/* The shared chunk cache of a mount: the one C definition of its control region's layout and of the
 * pin protocol, used by the Python types of its two halves (the mount's CacheOwner, cacheowner.c; a
 * dlfs.direct client's CacheView, direct.c) and by the mount's serving threads (answer.c). The mount's
 * cache arena (slabs of read-ahead) is a memfd that client processes map read-only; a second memfd, the
 * control region, says where each cached record is and who holds what:
 *
 *   header   128 B                   magic "DLFSSHM2", version, rows, slab size, slabs, extents,
 *                                    section offsets, row stride, total size
 *   gens     u64 per slab            bumped when the mount retires a slab (its records dropped)
 *   entries  u64 per extent          0: not in a slab; else (gen << 24) | (slab + 1)
 *   offsets  u32 per extent          where the record's bytes start in its slab
 *   epochs   u64 per row             the attachment a row belongs to: bumped each time the mount hands it out
 *   rows     one page-aligned span per client (process): its head (struct dlfs_shm_row_head), then
 *            u32 per slab: pins held by that client on that slab
 *
 * A reader pins a slab by adding to its own row, then re-reading the slab's gen; the mount retires a
 * slab by clearing its entries, bumping its gen, then summing the rows (all sequentially consistent):
 * either the reader sees the new gen and lets go, or the mount sees the pin and keeps the slab's bytes
 * until the pin is released. The mount's own serving threads pin through a row of their own.
 *
 * Rows: a client maps the region read-only but for its own row's span (so a stray write faults instead
 * of unpinning someone else's slab). Its pins and releases carry the epoch it attached under: one of an
 * earlier attachment of the row is refused, as is a release below zero (both counted in the row's head).
 * The mount frees a row only once its owner marked it released (no view of it left) or is gone. */
#include <pthread.h>
#include <stdint.h>

#define DLFS_SHM_MAGIC "DLFSSHM2"
#define DLFS_SHM_VERSION 2
#define DLFS_SHM_HEADER_BYTES 128
#define DLFS_SHM_SLAB_BITS 24
#define DLFS_SHM_SLAB_LIMIT ((1u << DLFS_SHM_SLAB_BITS) - 1)

struct dlfs_shm_header {
    char magic[8];
    uint32_t version, n_rows;
    uint64_t slab_size, nslabs, n_extents;
    uint64_t gens, entries, offsets, epochs, rows, row_stride, total;
};
_Static_assert(sizeof(struct dlfs_shm_header) <= DLFS_SHM_HEADER_BYTES, "the header outgrew its bytes");

/* The head of a row's span, written by the row's owner only. */
struct dlfs_shm_row_head {
    uint64_t released; /* the epoch its owner let go of: none of its views is left, no pin will be taken */
    uint64_t refused;  /* pins and releases refused: below zero, or of an earlier attachment */
};

/* Who pins: a row of the pin table, and the epoch it was handed out under. */
struct dlfs_pinner {
    uint64_t row, epoch;
};

struct dlfs_shm {
    struct dlfs_shm_header h;
    uint64_t *gens, *entries, *epochs;
    uint32_t *offsets;
    char *rows;
    const char *mem; /* the arena: slab i at mem + i * slab_size */
};

/* The layout for these sizes in `h`; its total bytes, or 0 if they cannot be laid out. */
uint64_t dlfs_shm_layout(struct dlfs_shm_header *h, uint64_t slab_size, uint64_t nslabs, uint64_t n_extents,
                         uint64_t n_rows);
/* Point `s` at the sections of a control region laid out as `s->h` says, and at the arena. */
void dlfs_shm_map(struct dlfs_shm *s, char *ctl, const char *arena);

#define DLFS_SHM_WHY 96 /* bytes of the reason create/attach give for a refusal */
/* The mount's: lay a new control region out for these sizes, write its header and map it with the
 * arena: 0, or -1 with the reason in `why` (sizes out of range, a region or arena too small). */
int dlfs_shm_create(struct dlfs_shm *s, char *ctl, uint64_t ctl_len, const char *arena, uint64_t arena_len,
                    uint64_t slab_size, uint64_t nslabs, uint64_t n_extents, uint64_t n_rows, char why[DLFS_SHM_WHY]);
/* A client's: map a region the mount made, its header held against the layout recomputed from its sizes
 * (shared memory is never trusted): 0, or -1 with the reason in `why`. */
int dlfs_shm_attach(struct dlfs_shm *s, char *ctl, uint64_t ctl_len, const char *arena, uint64_t arena_len,
                    char why[DLFS_SHM_WHY]);

static inline struct dlfs_shm_row_head *dlfs_shm_row_head(const struct dlfs_shm *s, uint64_t row)
{
    return (struct dlfs_shm_row_head *)(s->rows + row * s->h.row_stride);
}

/* A row's pin counts, one per slab. */
static inline uint32_t *dlfs_shm_row(const struct dlfs_shm *s, uint64_t row)
{
    return (uint32_t *)(dlfs_shm_row_head(s, row) + 1);
}

static inline uint64_t dlfs_shm_epoch(const struct dlfs_shm *s, uint64_t row)
{
    return __atomic_load_n(&s->epochs[row], __ATOMIC_SEQ_CST);
}

static inline uint64_t dlfs_shm_gen(const struct dlfs_shm *s, uint64_t slab)
{
    return __atomic_load_n(&s->gens[slab], __ATOMIC_SEQ_CST) & (((uint64_t)1 << (64 - DLFS_SHM_SLAB_BITS)) - 1);
}

/* Pin extent `ext` (raw bytes `len`) for `p` where it is now: 1 with *buf and *slab set, 0 if it is
 * not (or no longer) whole in a slab, or `p`'s row was handed out anew. */
int dlfs_shm_pin(const struct dlfs_shm *s, struct dlfs_pinner p, uint64_t ext, uint32_t len, const char **buf,
                 uint32_t *slab);
/* Release one pin of `p` on `slab` (below nslabs): 1, or 0 if refused (and counted): the row was handed
 * out anew, or holds no pin on it. */
int dlfs_shm_unpin(const struct dlfs_shm *s, struct dlfs_pinner p, uint32_t slab);

/* The mount's side. */
void dlfs_shm_publish(const struct dlfs_shm *s, uint64_t ext, uint64_t slab, uint32_t off);
void dlfs_shm_unpublish(const struct dlfs_shm *s, uint64_t ext);
/* Pins held on `slab` by rows 0..rows-1. */
uint64_t dlfs_shm_pins_on(const struct dlfs_shm *s, uint64_t slab, uint64_t rows);
/* Hand `row` to a new attachment: its new epoch. */
uint64_t dlfs_shm_hand_out(const struct dlfs_shm *s, uint64_t row);
/* Whether the owner of `row`'s current attachment marked it released. */
int dlfs_shm_released(const struct dlfs_shm *s, uint64_t row);
/* Zero `row` (its owner is gone or released it): the pins it still counted; *refused gets its count. */
uint64_t dlfs_shm_clear_row(const struct dlfs_shm *s, uint64_t row, uint64_t *refused);

/* What the kernel has been sent of each record (mount side only, never shared): once all of a record's
 * bytes have gone out, the record is *consumed* and its extent is queued for the cache to drop (the
 * kernel keeps the pages). Counted by whoever replies: the serving threads or the Python handlers. */
#define DLFS_HINTS_MAX 64 /* stream hints waiting for the cache at most (more are dropped: the next READ hints again) */
struct dlfs_consume {
    uint32_t *served;  /* bytes per extent, reset when the record is published again */
    uint8_t *pending;  /* 1 per extent while the cache fetches it: a READ of it waits in C (engine.c) */
    uint64_t n_extents;
    pthread_mutex_t lock;
    uint32_t *ring;    /* extents consumed and not yet taken by the cache */
    uint32_t cap, len;
    int wake_fd;       /* an eventfd, readable while the ring or the hints are not empty */
    uint64_t dropped;  /* consumed extents the full ring could not hold (the cache evicts them in time) */
    /* Files read in order whose next record is neither here nor coming: (inode << 32 | extent) each, for
     * the cache to start the file's stream (a file whose first records a neighbour's window brought). */
    uint64_t hints[DLFS_HINTS_MAX];
    uint32_t nhints;
};

/* 0, or -1 with errno set. */
int dlfs_consume_init(struct dlfs_consume *c, uint64_t n_extents, uint32_t ring_cap);
void dlfs_consume_free(struct dlfs_consume *c);
/* `n` more bytes of extent `ext` (raw length `len`) went to the kernel; 1 if that completed it. */
int dlfs_consume_add(struct dlfs_consume *c, uint64_t ext, uint32_t n, uint32_t len);
/* Queue a completed extent for the cache. */
void dlfs_consume_push(struct dlfs_consume *c, uint32_t ext);
/* Whether extent `ext` is being fetched into the cache (set and cleared by the cache, one owner). */
static inline int dlfs_consume_pending(const struct dlfs_consume *c, uint64_t ext)
{
    return ext < c->n_extents && __atomic_load_n(&c->pending[ext], __ATOMIC_ACQUIRE);
}
static inline void dlfs_consume_set_pending(struct dlfs_consume *c, uint64_t ext, int on)
{
    if (ext < c->n_extents)
        __atomic_store_n(&c->pending[ext], (uint8_t)!!on, __ATOMIC_RELEASE);
}
/* Move up to `max` queued extents to `out`; how many. */
uint32_t dlfs_consume_take(struct dlfs_consume *c, uint32_t *out, uint32_t max);
/* Tell the cache that inode `ino` is read in order and wants extent `ext`, which is neither here nor coming. */
void dlfs_consume_hint(struct dlfs_consume *c, uint32_t ino, uint32_t ext);
/* Move the waiting hints to `out` (DLFS_HINTS_MAX of room); how many. */
uint32_t dlfs_consume_take_hints(struct dlfs_consume *c, uint64_t *out);
#endif
