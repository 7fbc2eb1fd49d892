#ifndef DLFS_DISKCACHE_H
#define DLFS_DISKCACHE_H
/* The node's disk cache (dlfs/mount/diskcache.py) read by the serving threads: in scan mode a whole
 * record of a chunk this machine does not hold, whose bytes the disk cache has, is read from the disk
 * cache's file of that chunk (DIR/chunks/ab/<id>.<tag>: the chunk's bytes at their own offsets, a
 * sparse file) as a record of this machine's own chunk files is, checked here (xxh3), answered here.
 * Python keeps the catalogue and its policy: which file holds each chunk now (the tag per chunk, set
 * as windows are written and evicted, and from the catalogue, which other mounts and `dlfs warmup`
 * change too), what to fetch and keep, eviction. Nothing here is trusted: a range the file does not
 * have (a hole: never written, or evicted since) is not read, and bytes that fail their check go to
 * Python, which reads them again from the replicas and drops the disk cache's copy. */
#include <stdint.h>

#include "chunkfiles.h"

/* Open the disk cache's chunk directory for a mounted version of `n` chunks (tags all 0: nothing routed
 * yet). 0, or -1 with errno set (EBUSY: open already; ENOMEM; the directory's own errors). */
int dlfs_dcache_open(const char *chunk_dir, uint64_t n);
/* Chunk `ci`'s file in the disk cache is now "<id>.<tag>" (0: it has none). 0, or -1 (EINVAL: out of
 * range or not open). */
int dlfs_dcache_set(uint64_t ci, unsigned tag);
/* Whether the threads may read the disk cache. */
int dlfs_dcache_on(void);
/* Chunk `ci`'s (`id`) disk cache file, held for reading (O_DIRECT too where `direct`, as dlfs_chunk_get),
 * if it has every byte of [off, off + len): 0 (dlfs_chunk_put it), or -1. */
int dlfs_dcache_get(uint64_t ci, const uint8_t *id, uint64_t off, uint64_t len, int direct, struct dlfs_chunk_ref *ref);
/* Whether a held file is the disk cache's (its reads are counted apart from this machine's chunk files). */
int dlfs_dcache_ref(const struct dlfs_chunk_ref *ref);
/* Chunks read from the disk cache since the last call: up to `max` chunk numbers into `out`, each reported
 * once (Python notes them as recently used, for the catalogue's eviction order); how many. */
uint64_t dlfs_dcache_used(uint64_t *out, uint64_t max);
/* Records the serving threads fetched from the data daemons, offered to the disk cache: each copied into
 * one of DLFS_KEEP_SLOTS buffers (none free: not kept, counted), taken by a Python thread that writes
 * them there (dlfs/mount/diskreads.py), so a compute node's threads fetch its first epoch and its disk
 * cache still fills. Off until dlfs_dcache_keep(). */
#define DLFS_KEEP_SLOTS 64
#define DLFS_KEEP_MAX (256u << 10) /* the biggest record kept so: one without block sums */
struct dlfs_extent;
/* Keep from now on (the slots' memory, DLFS_KEEP_SLOTS * DLFS_KEEP_MAX = 16 MiB, allocated now and kept for
 * the process's life). 0, or -1 (ENOMEM; EINVAL: not open). */
int dlfs_dcache_keep(void);
/* Whether records are kept so: then one too big for a slot is left to Python, which fetches and keeps it. */
int dlfs_dcache_keeping(void);
/* A serving thread's record `e` (its stored bytes `data`, checked) fetched from a data daemon. */
void dlfs_dcache_offer(const struct dlfs_extent *e, const char *data);
/* Wait up to `ms` for offered records, then hand each to `take` (its chunk, offset in the chunk, bytes) and
 * free its slot: how many, or -1 once ended and every record offered before was handed over (the caller's
 * thread ends). */
int dlfs_dcache_take(unsigned ms, void (*take)(void *arg, uint64_t chunk, uint64_t offset, const char *data,
                                               uint32_t len), void *arg);
/* Keep no more (the mount ends, or the disk cache closes): records offered before are still taken. */
void dlfs_dcache_keep_end(void);
/* Records offered and kept in a slot, and those dropped for want of one. */
void dlfs_dcache_keep_stats(uint64_t *kept, uint64_t *dropped);
/* Close the files and forget the tags (the serving threads have stopped). */
void dlfs_dcache_close(void);
#endif
