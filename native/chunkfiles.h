#ifndef DLFS_CHUNKFILES_H
#define DLFS_CHUNKFILES_H
/* This machine's chunk files, opened once for the mount and shared by its serving threads.
 *
 * A thread's own table of 16 thrashed once a dataset had more chunks than that: a random epoch over
 * 110 chunks opened 1.5 files per READ (the chunk by its path, then again O_DIRECT). Here a set-
 * associative table keyed by chunk number holds each file once, with a count of the threads reading
 * it now, so that none is closed under a read. Each file is checked against its path at most every
 * DLFS_LOCAL_RECHECK_NS: repair replaces a chunk file (a new inode under the same name) and an admin
 * may delete one, and neither must be read from its old inode for longer. */
#include <pthread.h>
#include <stdint.h>

#define DLFS_LOCAL_RECHECK_NS 1000000000ull /* a kept chunk file is checked against its path this often */
#define DLFS_CHUNK_WAYS 4                   /* slots a chunk may sit in */
#define DLFS_CHUNK_FILES_MAX 1024           /* chunk files kept open at most (two descriptors each) */

struct dlfs_chunk_file {
    int64_t chunk; /* -1: empty */
    uint32_t tag;  /* the file name's suffix (a disk cache's "<id>.<tag>"), 0 for none: part of what a slot matches */
    uint8_t id[16]; /* the chunk's id (DLFS_CHUNK_ID): a slot matches on both (the data daemon keys by part of it) */
    int fd;        /* -1: the chunk is not on this machine (remembered until the next check) */
    int direct;    /* the same file opened O_DIRECT: -1 not yet, -2 it cannot be */
    int spare;     /* an O_DIRECT descriptor found unreadable so while others held it: closed with the slot */
    uint64_t ino, dev, checked;
    uint32_t readers; /* threads holding it now: it is closed only once none does */
    unsigned char used, failed;
};

struct dlfs_chunk_files {
    pthread_mutex_t lock;
    struct dlfs_chunk_file *slot;
    unsigned nsets; /* a power of two; slots = nsets * DLFS_CHUNK_WAYS */
    unsigned hand;
    /* Files here are renamed whenever their bytes change (a disk cache's "<id>.<tag>"): bytes that failed a
     * check are not opened again under the same name, which holds the same bad bytes. */
    int renamed;
};

/* A chunk file held by one reader: its descriptors, its table, and its slot there (-1: opened for this
 * reader alone, every slot of its set being read; closed by dlfs_chunk_put). */
struct dlfs_chunk_ref {
    int fd, direct, slot;
    struct dlfs_chunk_files *table;
};

/* Files opened so far by every table of the process (by path, or O_DIRECT through a kept one). */
uint64_t dlfs_chunk_files_opened(void);
/* A table of up to `files` chunk files (rounded down to a power of two times the ways); -1 on ENOMEM. */
int dlfs_chunk_files_init(struct dlfs_chunk_files *t, unsigned files);
void dlfs_chunk_files_free(struct dlfs_chunk_files *t);
/* Chunk files a process may keep open: DLFS_CHUNK_FILES_MAX within a sixteenth of its descriptor
 * limit (two descriptors each: an eighth of them, beside the mount's own in Python). */
unsigned dlfs_chunk_files_budget(void);

/* Chunk `ci` (its id `id`, DLFS_CHUNK_ID bytes) in `dir` (data/chunks/ab/abcd..., or with `tag` a disk
 * cache's ab/abcd....<tag as 8 hex digits>), held for reading (O_DIRECT too where `direct`: ref->direct
 * is then >= 0, or -1 if the file cannot be read so); 0, or -1 if the chunk is not there or cannot be
 * opened. Every 0 is matched by a dlfs_chunk_put. */
int dlfs_chunk_get(struct dlfs_chunk_files *t, int dir, uint64_t ci, const uint8_t *id, uint32_t tag, int direct,
                   struct dlfs_chunk_ref *ref);
/* Done reading; `failed`: its bytes failed their check, so the next reader opens the path again (a
 * repaired chunk is a new file) once nobody reads this one. */
void dlfs_chunk_put(struct dlfs_chunk_ref *ref, int failed);
/* The O_DIRECT descriptor of a held file turned out unreadable so (EINVAL): never try it again. */
void dlfs_chunk_no_direct(struct dlfs_chunk_ref *ref);

#endif
