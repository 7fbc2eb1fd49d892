#ifndef DLFS_ANSWER_H
#define DLFS_ANSWER_H
/* Answering FUSE requests from memory, whatever transport brought them (engine.c: /dev/fuse or
 * io_uring): metadata from the mmap'd index, trivial requests at once, and READ from records that sit
 * in the shared cache's slabs. What cannot be answered here goes to Python (pyfuse3), unchanged. */
#include <linux/fuse.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/uio.h>
#include <time.h>

#include "chunkfiles.h"
#include "indexview.h"
#include "shm.h"

/* CLOCK_MONOTONIC in nanoseconds: the serving threads' waits and bounds. */
static inline uint64_t dlfs_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

#define DLFS_REPLY_IOV 32 /* header + pieces of a READ spanning several records */
/* A serving thread's buffer for encoded replies and records read from chunk files: every record
 * without block sums (smaller than dlfs/format/chunk.py's BLOCK_SUMS_MIN) fits. */
#define DLFS_REPLY_SCRATCH (256 << 10)
#define DLFS_RANDOM_READ_MAX (64 << 10) /* READs this small are the kernel's random reads, not read-ahead */

/* One request: its header, the opcode's fixed argument struct, and what follows it (a name). */
struct dlfs_req {
    const struct fuse_in_header *in;
    const void *op;
    uint32_t op_len;
    const char *payload;
    uint32_t payload_len;
};

/* Counters of one serving thread (summed on demand: no cache line shared between threads). */
struct dlfs_counters {
    uint64_t requests, answered, forwarded, lookups, getattrs, readdirs, ioctls, opens;
    uint64_t reads, read_bytes, read_misses, corrupt;
    uint64_t block_reads, block_bytes, block_failures; /* random reads from this machine's chunk files */
    uint64_t record_reads, record_bytes, record_failures; /* whole small records read there, in scan mode */
    uint64_t remote_reads, remote_bytes, remote_failures; /* and fetched from a data daemon, in scan mode (remote.h) */
    uint64_t disk_cache_reads, disk_cache_bytes; /* and read from the disk cache's files, in scan mode (diskcache.h) */
    uint64_t parked, parked_answered, parked_forwarded; /* READs that waited in C for a window being fetched */
    uint64_t records_ahead, records_ahead_used; /* records read from the disk on their file's LOOKUP, and READ */
};

/* Add `n` to one counter. Each struct dlfs_counters has one writer at a time (its thread, or the holder of
 * the lock it lives under) and is read by others with __atomic loads (dlfs_engine_stats): a relaxed atomic
 * store, so a reader never sees a torn value, and no locked add on the hot path. */
#define DLFS_COUNT(c, field, n) __atomic_store_n(&(c)->field, (c)->field + (n), __ATOMIC_RELAXED)

#define DLFS_SUMS_KEPT 1024 /* records whose block sums the engine keeps: 8 KiB for a 4 MiB record */

/* The block sum tables of the records read at random lately, shared by the serving threads: a random
 * read then costs one read of the disk, not two (the data, and its sums at the record's end). */
struct dlfs_sums {
    pthread_mutex_t lock;
    int64_t ext[DLFS_SUMS_KEPT]; /* -1: empty */
    uint64_t *table[DLFS_SUMS_KEPT]; /* the record's whole table, as stored (little-endian) */
    uint32_t count[DLFS_SUMS_KEPT];
    unsigned char used[DLFS_SUMS_KEPT]; /* the clock's bit: looked at since it last passed */
    unsigned hand;
};

void dlfs_sums_init(struct dlfs_sums *s);
void dlfs_sums_free(struct dlfs_sums *s);
/* Close and free what a serve struct holds for reading this machine's chunk files (each may be -1/NULL). */
void dlfs_serve_local_free(int local_dir, struct dlfs_sums *sums, struct dlfs_chunk_files *files);

/* A reply being built: iov[0] is the header; the pins are released once it has been sent. */
struct dlfs_reply {
    struct fuse_out_header out;
    struct iovec iov[DLFS_REPLY_IOV];
    int n;
    uint32_t pin_slab[DLFS_REPLY_IOV];
    uint32_t piece_ext[DLFS_REPLY_IOV], piece_len[DLFS_REPLY_IOV], piece_raw[DLFS_REPLY_IOV];
    int npins;
    char *scratch; /* the thread's buffer for encoded replies and blocks read from chunk files */
    uint32_t scratch_size;
    int async_records;   /* the caller reads scan mode's whole records itself (DLFS_RECORD), not answer.c */
    uint32_t async_max;  /* and records with block sums whose span is up to this, into the reply's own buffer */
    uint64_t record_ext; /* with DLFS_RECORD: the record the READ wants */
    int big;             /* 1 + the shared buffer (DLFS_BIG_BUFFERS) the reply's bytes are in, until it is sent; 0 none */
    int ahead;           /* the slot of a record read at its LOOKUP (ahead.h) the bytes are in, until sent; 0 none */
};

/* Buffers shared by the /dev/fuse threads for whole records with block sums (256 KiB to 1 MiB) read from
 * chunk files or the disk cache, or fetched from data daemons, in scan mode: a thread's own buffer
 * (DLFS_REPLY_SCRATCH) holds only smaller ones. Mapped on first use, on huge pages, and kept: at most
 * DLFS_BIG_BUFFERS * DLFS_BIG_BUFFER of memory rounded up to 2 MiB pages, touched as used. None free:
 * the READ goes to Python. (FUSE over io_uring reads into the ring entry's own buffer.) */
#define DLFS_BIG_BUFFERS 4
#define DLFS_BIG_BUFFER ((1 << 20) + 4096)

/* --- the table: every metadata answer of the mount, as a function of the index alone ---------------
 * The serving threads reply with these, and pyfuse3's handlers (dlfs/mount/ops.py) answer with them
 * through dlfs._native (indexobj.c): each attribute, position, sum and errno is defined here once.
 * Errors are -errno: EIO where the index is damaged or an inode out of range. */
#define DLFS_BLKSIZE (128 << 10) /* st_blksize: what a reader should ask for at once */
#define DLFS_STATFS_BSIZE 4096

/* The attributes of inode `ino` (`n`, as dlfs_inode_of read it). */
void dlfs_attr_of(uint64_t ino, const struct dlfs_inode *n, struct fuse_attr *a);
/* Inode `ino` into `n`: 0, or -EIO if it is out of range. */
int dlfs_inode_of(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *n);
/* LOOKUP of `name` (`len` bytes) in `parent`, "." and ".." included: its inode (> 0) with `n` read,
 * 0 for a negative entry (absent: the kernel keeps the miss), or -ENOTDIR, -ENAMETOOLONG, -EIO. */
int64_t dlfs_entry_of(const struct dlfs_ix *ix, uint64_t parent, const char *name, size_t len, struct dlfs_inode *n);
/* Directory `ino` into `d`: 0, -ENOTDIR, or -EIO (out of range, or its entries lie outside the index). */
int dlfs_dir_of(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *d);
/* The listing's entry at position `pos` of directory `dir` (`d` from dlfs_dir_of): 0 is ".", 1 "..",
 * entry i of the directory is i + 2. Its name, inode and attributes (`n`), and the position after it
 * (the offset the kernel asks from next: > 0); 0 past the end; -EIO. */
int64_t dlfs_dirent_of(const struct dlfs_ix *ix, uint64_t dir, const struct dlfs_inode *d, uint64_t pos,
                       const uint8_t **name, uint32_t *len, uint64_t *ino, struct dlfs_inode *n);
/* A symlink's target, in the mapping: 0, -EINVAL (not a symlink), -EIO. */
int dlfs_link_of(const struct dlfs_ix *ix, uint64_t ino, const uint8_t **target, uint32_t *len);
/* ACCESS: 0, -EROFS (W_OK: nothing here can be written), -EIO. */
int dlfs_access_of(const struct dlfs_ix *ix, uint64_t ino, uint32_t mask);
/* STATFS: the version's bytes and inodes, nothing free, names up to DLFS_NAME_MAX. */
void dlfs_statfs_of(const struct dlfs_ix *ix, struct fuse_kstatfs *st);

/* What the mount serves from: set once before the serving threads start, read-only after. */
struct dlfs_serve {
    struct dlfs_ix ix;
    uint64_t timeout_s;
    uint32_t timeout_ns;
    const char *xattr_name, *xattr_value; /* on the root; NULL if none */
    uint32_t xattr_len;
    const struct dlfs_shm *shm; /* NULL: no shared cache (every READ goes to Python) */
    struct dlfs_consume *consume;
    struct dlfs_pinner pin; /* the serving threads' row of the pin table, and its epoch */
    int local_dir; /* this machine's chunk directory (read in place), or -1 */
    struct dlfs_sums *sums; /* with local_dir: the sums kept and the chunk files open (mutable, locked) */
    struct dlfs_chunk_files *files;
};

/* DLFS_PARK: a READ of a record the cache is fetching now: it waits in C (engine.c) and is answered
 * when the record lands, never sent to Python for that. */
/* DLFS_RECORD (only where rp->async_records): a READ of a whole small record to be read from this
 * machine's chunk file (or the disk cache's copy), which the caller reads without waiting for the disk (dlfs_record_plan, then
 * dlfs_record_answer once the bytes are in). */
enum { DLFS_FORWARD = 0, DLFS_ANSWERED = 1, DLFS_NO_REPLY = 2, DLFS_PARK = 3, DLFS_RECORD = 4 };

/* Python answered a READ of inode `ino`: the READs of that file parked behind it (answer.c's start_wait)
 * wait no more for it, and look again at the next dlfs_engine_wake. 1 if any did wait for it. */
int dlfs_read_answered(uint64_t ino);
/* Forget every READ sent to Python (the engine is released: the next mount's inodes are other files). */
void dlfs_read_starts_reset(void);

/* Whether a READ of inode `ino` would now be a DLFS_RECORD (scan mode; a file of one small record that
 * may be on this machine's disk, not in the cache and not being fetched into it): 1 with its extent in *ext and
 * *e. A LOOKUP of such a file starts its read before the READ comes (uring.c). */
int dlfs_record_wanted(const struct dlfs_serve *sv, uint64_t ino, uint64_t *ext, struct dlfs_extent *e);
/* The page-aligned range an O_DIRECT read of record `e` covers: from *lo, the length returned (the record
 * starts e->offset - *lo bytes into it). */
uint32_t dlfs_record_span(const struct dlfs_extent *e, uint64_t *lo);
/* Where to read record `e` from with O_DIRECT into a page-aligned buffer of `room` bytes: its chunk
 * file held in *f (dlfs_chunk_put it when done), the page-aligned offset *lo and length *len; the
 * record starts e->offset - *lo bytes into what is read. -1 if it cannot be read so. */
int dlfs_record_plan(const struct dlfs_serve *sv, const struct dlfs_extent *e, uint32_t room,
                     struct dlfs_chunk_ref *f, uint64_t *lo, uint32_t *len);
/* Record `e` of held chunk file `f` read with O_DIRECT into `into` (page-aligned, `room` bytes): where its
 * first byte landed, or NULL where it cannot be read so (too big, no O_DIRECT, short, a file system that
 * refuses O_DIRECT reads: remembered in f). */
const char *dlfs_record_direct(struct dlfs_chunk_ref *f, const struct dlfs_extent *e, char *into, size_t room);
/* The reply to READ `unique` of the whole record `e`, whose stored bytes are `data` (NULL: the read
 * failed), read from `f`: DLFS_ANSWERED once they pass their check, else DLFS_FORWARD (Python reads it
 * again from the replicas and says what is wrong). */
int dlfs_record_answer(struct dlfs_reply *rp, uint64_t unique, const struct dlfs_extent *e, const char *data,
                       const struct dlfs_chunk_ref *f, struct dlfs_counters *c);

/* READ `unique` of the whole record `ext` (DLFS_RECORD) of a chunk this machine does not hold, fetched
 * from a data daemon straight into `into` (`room` bytes: where the reply goes, so it is not copied
 * again) and checked: DLFS_ANSWERED, DLFS_FORWARD (Python's), or DLFS_RECORD (the record is on this
 * machine's disk, in its chunk file or the disk cache: read it from there). Blocks for the fetch, bounded (remote.h). */
int dlfs_record_fetch(const struct dlfs_serve *sv, struct dlfs_reply *rp, uint64_t unique, uint64_t ext, char *into,
                      uint32_t room, struct dlfs_counters *c);

/* Scan mode, set by the mount's cache when its read-ahead has no room (an epoch over more than the
 * cache holds): a READ of a whole small record of this machine's chunks that is not in the cache is
 * read from the chunk file and checked here, with no slab and no word to Python (which would fetch
 * it alone anyway). */
void dlfs_set_scan(int on);
int dlfs_scan_mode(void);

/* Direct mode (`dlfs mount --direct-io`), set before the engine starts: files of `min` bytes or more are
 * opened FOPEN_DIRECT_IO (the kernel keeps no page of them: every read comes here, answered from the
 * cache; each byte is in memory once), smaller ones FOPEN_KEEP_CACHE. 0, the default: OPEN is refused
 * once (no_open), and the kernel keeps the pages of every file. */
void dlfs_set_direct_io(uint64_t min);
uint64_t dlfs_direct_io_min(void);
/* Distinct processes behind the latest READs that went to Python (0: none yet). */
unsigned dlfs_miss_readers(void);
/* Kernels since 6.6 map a FOPEN_DIRECT_IO file MAP_SHARED only if INIT's reply says so; libfuse 3.14
 * cannot say it, so its INIT reply (`init_out`, `len` bytes) is amended in direct mode: 1 if it was. */
#ifndef FUSE_DIRECT_IO_ALLOW_MMAP
#define FUSE_DIRECT_IO_ALLOW_MMAP (1ULL << 36)
#endif
int dlfs_amend_init_reply(void *init_out, size_t len);

/* The size of `opcode`'s fixed argument struct, or -1 if it is not one answered here. */
int dlfs_op_len(uint32_t opcode);
/* Answer `rq` into `rp` (DLFS_ANSWERED: send rp->iov[0..n), then call dlfs_reply_done), or say it
 * goes to Python (DLFS_FORWARD), waits for a record being fetched (DLFS_PARK), or needs no reply
 * (DLFS_NO_REPLY: FORGET). */
int dlfs_answer(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                struct dlfs_counters *c);
/* After the reply was sent (or failed to be): let go of its pins and count what the kernel got. */
void dlfs_reply_done(const struct dlfs_serve *sv, struct dlfs_reply *rp, int sent);
#endif
