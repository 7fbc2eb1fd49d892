/* Answering FUSE requests from memory (see answer.h).
 *
 * The index format is dlfs/format/index.py's, read in place (indexview.c); every offset read from it
 * is bounds-checked and anything out of range is answered EIO and counted (the checksum proves
 * integrity, not sanity). Replies follow the kernel's ABI (linux/fuse.h); a dataset never changes
 * under a mount, so names, attributes, listings and misses are all cached by the kernel for the
 * mount's timeout. */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hash.h"

#include "answer.h"
#include "remote.h"
#include "ahead.h"
#include "hugebuf.h"
#include "chunkfiles.h"
#include "diskcache.h"

int dlfs_op_len(uint32_t opcode)
{
    switch (opcode) {
    case FUSE_LOOKUP:
    case FUSE_STATFS:
    case FUSE_READLINK:
        return 0;
    case FUSE_GETATTR:
        return sizeof(struct fuse_getattr_in);
    case FUSE_READ:
    case FUSE_READDIRPLUS:
        return sizeof(struct fuse_read_in);
    case FUSE_OPEN:
    case FUSE_OPENDIR:
        return sizeof(struct fuse_open_in);
    case FUSE_RELEASE:
    case FUSE_RELEASEDIR:
        return sizeof(struct fuse_release_in);
    case FUSE_FLUSH:
        return sizeof(struct fuse_flush_in);
    case FUSE_FSYNC:
    case FUSE_FSYNCDIR:
        return sizeof(struct fuse_fsync_in);
    case FUSE_IOCTL:
        return sizeof(struct fuse_ioctl_in);
    case FUSE_GETXATTR:
    case FUSE_LISTXATTR:
        return sizeof(struct fuse_getxattr_in);
    case FUSE_ACCESS:
        return sizeof(struct fuse_access_in);
    case FUSE_FORGET:
        return sizeof(struct fuse_forget_in);
    case FUSE_BATCH_FORGET:
        return sizeof(struct fuse_batch_forget_in);
    case FUSE_INTERRUPT:
        return sizeof(struct fuse_interrupt_in);
    default:
        return -1;
    }
}

/* --- building replies ------------------------------------------------------------------------ */

static int reply_err(struct dlfs_reply *rp, int err)
{
    rp->out.error = -err;
    return DLFS_ANSWERED;
}

static int corrupt(struct dlfs_reply *rp, struct dlfs_counters *c)
{
    DLFS_COUNT(c, corrupt, 1);
    return reply_err(rp, EIO);
}

static void add(struct dlfs_reply *rp, const void *p, size_t len)
{
    rp->iov[rp->n].iov_base = (void *)p;
    rp->iov[rp->n].iov_len = len;
    rp->n++;
}

/* A reply to request `unique`: its header first, no pins yet. */
static void reply_begin(struct dlfs_reply *rp, uint64_t unique)
{
    memset(&rp->out, 0, sizeof rp->out);
    rp->out.unique = unique;
    rp->n = 0;
    rp->npins = 0;
    add(rp, &rp->out, sizeof rp->out);
}

/* The reply complete: its length is that of its pieces; counted as answered. */
static int reply_end(struct dlfs_reply *rp, struct dlfs_counters *c)
{
    DLFS_COUNT(c, answered, 1);
    rp->out.len = 0;
    for (int i = 0; i < rp->n; i++)
        rp->out.len += (uint32_t)rp->iov[i].iov_len;
    return DLFS_ANSWERED;
}

/* Room for `len` bytes of the reply body in the thread's scratch buffer (always enough for a struct). */
static void *body(struct dlfs_reply *rp, size_t len)
{
    memset(rp->scratch, 0, len);
    add(rp, rp->scratch, len);
    return rp->scratch;
}

/* --- the table: each metadata answer as a function of the index alone ------------------------- */

void dlfs_attr_of(uint64_t ino, const struct dlfs_inode *n, struct fuse_attr *a)
{
    memset(a, 0, sizeof *a);
    a->ino = ino;
    a->mode = n->mode;
    a->nlink = n->nlink;
    a->uid = n->uid;
    a->gid = n->gid;
    a->size = (uint64_t)n->size;
    a->blocks = ((uint64_t)n->size + 511) / 512; /* st_blocks counts 512-byte units, whatever the block size */
    a->blksize = DLFS_BLKSIZE;
    int64_t sec = n->mtime_ns / 1000000000, nsec = n->mtime_ns % 1000000000;
    if (nsec < 0) {
        sec -= 1;
        nsec += 1000000000;
    }
    a->mtime = a->atime = a->ctime = (uint64_t)sec;
    a->mtimensec = a->atimensec = a->ctimensec = (uint32_t)nsec;
}

int dlfs_inode_of(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *n)
{
    return dlfs_ix_inode(ix, ino, n) < 0 ? -EIO : 0;
}

int64_t dlfs_entry_of(const struct dlfs_ix *ix, uint64_t parent, const char *name, size_t len, struct dlfs_inode *n)
{
    int64_t ino;
    if (!n || (!name && len))
        return -EINVAL;
    if (len == 1 && name[0] == '.') {
        ino = (int64_t)parent;
    } else if (len == 2 && name[0] == '.' && name[1] == '.') { /* only NFS export asks */
        struct dlfs_inode p;
        if (dlfs_ix_inode(ix, parent, &p) < 0)
            return -EIO;
        ino = p.parent ? (int64_t)p.parent : (int64_t)parent;
    } else {
        ino = dlfs_ix_lookup(ix, parent, name, len);
        if (ino == -ENOENT)
            return 0; /* a negative entry */
        if (ino < 0)
            return ino;
    }
    return dlfs_ix_inode(ix, (uint64_t)ino, n) < 0 ? -EIO : ino;
}

int dlfs_dir_of(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *d)
{
    if (dlfs_ix_inode(ix, ino, d) < 0)
        return -EIO;
    if (!S_ISDIR(d->mode))
        return -ENOTDIR;
    return dlfs_ix_dir_ok(ix, d) ? 0 : -EIO;
}

int64_t dlfs_dirent_of(const struct dlfs_ix *ix, uint64_t dir, const struct dlfs_inode *d, uint64_t pos,
                       const uint8_t **name, uint32_t *len, uint64_t *ino, struct dlfs_inode *n)
{
    if (!d || !name || !len || !ino)
        return -EINVAL;
    if (pos >= (uint64_t)d->count + 2)
        return 0;
    if (pos < 2) {
        *ino = pos == 0 ? dir : (d->parent ? d->parent : dir);
        *name = (const uint8_t *)"..";
        *len = pos == 0 ? 1 : 2;
    } else {
        uint32_t child;
        if (dlfs_ix_dirent(ix, d->ref + pos - 2, name, len, &child) < 0)
            return -EIO;
        *ino = child;
    }
    return dlfs_ix_inode(ix, *ino, n) < 0 ? -EIO : (int64_t)pos + 1;
}

int dlfs_link_of(const struct dlfs_ix *ix, uint64_t ino, const uint8_t **target, uint32_t *len)
{
    struct dlfs_inode n;
    if (!target || !len || dlfs_ix_inode(ix, ino, &n) < 0)
        return -EIO;
    if (!S_ISLNK(n.mode))
        return -EINVAL;
    if (n.ref > ix->names_size || n.count > ix->names_size - n.ref)
        return -EIO;
    *target = ix->names + n.ref; /* straight from the mapping */
    *len = n.count;
    return 0;
}

int dlfs_access_of(const struct dlfs_ix *ix, uint64_t ino, uint32_t mask)
{
    struct dlfs_inode n;
    if (mask & W_OK)
        return -EROFS;
    return dlfs_ix_inode(ix, ino, &n) < 0 ? -EIO : 0;
}

void dlfs_statfs_of(const struct dlfs_ix *ix, struct fuse_kstatfs *st)
{
    memset(st, 0, sizeof *st); /* nothing free: the version is complete and never grows */
    st->bsize = st->frsize = DLFS_STATFS_BSIZE;
    st->blocks = (ix->bytes + DLFS_STATFS_BSIZE - 1) / DLFS_STATFS_BSIZE;
    st->files = ix->n_inodes;
    st->namelen = DLFS_NAME_MAX;
}

/* --- metadata replies ------------------------------------------------------------------------ */

/* -errno from the table as the reply: EIO is damage in the index, counted. */
static int table_err(struct dlfs_reply *rp, struct dlfs_counters *c, int64_t err)
{
    return err == -EIO ? corrupt(rp, c) : reply_err(rp, (int)-err);
}

static void fill_entry(const struct dlfs_serve *sv, struct fuse_entry_out *e, uint64_t ino, const struct dlfs_inode *n)
{
    memset(e, 0, sizeof *e);
    e->entry_valid = sv->timeout_s; /* a miss (ino 0) is kept too */
    e->entry_valid_nsec = sv->timeout_ns;
    if (!ino)
        return;
    e->nodeid = ino;
    e->attr_valid = sv->timeout_s;
    e->attr_valid_nsec = sv->timeout_ns;
    dlfs_attr_of(ino, n, &e->attr);
}

static int lookup(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                  struct dlfs_counters *c)
{
    const char *name = rq->payload;
    size_t len = strnlen(name, rq->payload_len);
    if (len == rq->payload_len) /* no terminating NUL: not a name the kernel sends */
        return DLFS_FORWARD;
    struct dlfs_inode n;
    DLFS_COUNT(c, lookups, 1);
    int64_t ino = dlfs_entry_of(&sv->ix, rq->in->nodeid, name, len, &n);
    if (ino < 0)
        return table_err(rp, c, ino);
    /* 0, a negative entry: the mount's version never changes, so the kernel may keep the miss for the
     * timeout (in its dentry cache: bounded by its shrinker, gone with the mount). */
    fill_entry(sv, body(rp, sizeof(struct fuse_entry_out)), (uint64_t)ino, &n);
    return DLFS_ANSWERED;
}

static int getattr(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                   struct dlfs_counters *c)
{
    struct dlfs_inode n;
    DLFS_COUNT(c, getattrs, 1);
    int err = dlfs_inode_of(&sv->ix, rq->in->nodeid, &n);
    if (err)
        return table_err(rp, c, err);
    struct fuse_attr_out *a = body(rp, sizeof *a);
    a->attr_valid = sv->timeout_s;
    a->attr_valid_nsec = sv->timeout_ns;
    dlfs_attr_of(rq->in->nodeid, &n, &a->attr);
    return DLFS_ANSWERED;
}

static int opendir(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                   struct dlfs_counters *c)
{
    struct dlfs_inode d;
    int err = dlfs_dir_of(&sv->ix, rq->in->nodeid, &d);
    if (err)
        return table_err(rp, c, err);
    struct fuse_open_out *o = body(rp, sizeof *o);
    o->fh = rq->in->nodeid;
    /* The listing never changes: let the kernel keep it. */
    o->open_flags = FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR;
    return DLFS_ANSWERED;
}

/* One READDIRPLUS entry at `buf` if it fits in `room`; its size, or 0 if it does not fit. */
static size_t direntplus(const struct dlfs_serve *sv, char *buf, size_t room, const uint8_t *name, uint32_t len,
                         uint64_t ino, const struct dlfs_inode *n, uint64_t next)
{
    size_t size = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET_DIRENTPLUS + len);
    if (size > room)
        return 0;
    struct fuse_direntplus *d = (struct fuse_direntplus *)buf;
    memset(d, 0, size);
    fill_entry(sv, &d->entry_out, ino, n);
    d->dirent.ino = ino;
    d->dirent.off = next;
    d->dirent.namelen = len;
    d->dirent.type = (n->mode & S_IFMT) >> 12;
    memcpy(d->dirent.name, name, len);
    return size;
}

static int readdirplus(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                       struct dlfs_counters *c)
{
    const struct fuse_read_in *r = rq->op;
    struct dlfs_inode d, n;
    DLFS_COUNT(c, readdirs, 1);
    int err = dlfs_dir_of(&sv->ix, rq->in->nodeid, &d);
    if (err)
        return table_err(rp, c, err);
    size_t room = r->size < rp->scratch_size ? r->size : rp->scratch_size, used = 0, want;
    for (uint64_t pos = r->offset;; pos++) {
        const uint8_t *name;
        uint32_t len;
        uint64_t ino;
        int64_t next = dlfs_dirent_of(&sv->ix, rq->in->nodeid, &d, pos, &name, &len, &ino, &n);
        if (next < 0)
            return table_err(rp, c, next);
        if (next == 0 || !(want = direntplus(sv, rp->scratch + used, room - used, name, len, ino, &n, (uint64_t)next)))
            break; /* the end, or the kernel asks again from here */
        used += want;
    }
    add(rp, rp->scratch, used);
    return DLFS_ANSWERED;
}

static int readlink_(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                     struct dlfs_counters *c)
{
    const uint8_t *target;
    uint32_t len;
    int err = dlfs_link_of(&sv->ix, rq->in->nodeid, &target, &len);
    if (err)
        return table_err(rp, c, err);
    add(rp, target, len);
    return DLFS_ANSWERED;
}

static int statfs_(const struct dlfs_serve *sv, struct dlfs_reply *rp)
{
    struct fuse_statfs_out *s = body(rp, sizeof *s);
    dlfs_statfs_of(&sv->ix, &s->st);
    return DLFS_ANSWERED;
}

static int access_(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                   struct dlfs_counters *c)
{
    int err = dlfs_access_of(&sv->ix, rq->in->nodeid, ((const struct fuse_access_in *)rq->op)->mask);
    return err ? table_err(rp, c, err) : DLFS_ANSWERED;
}

/* A value of `len` bytes for GETXATTR's `size` (0: the size alone). */
static int xattr_value(struct dlfs_reply *rp, uint32_t size, const char *value, uint32_t len)
{
    if (size == 0) {
        struct fuse_getxattr_out *o = body(rp, sizeof *o);
        o->size = len;
        return DLFS_ANSWERED;
    }
    if (size < len)
        return reply_err(rp, ERANGE);
    add(rp, value, len);
    return DLFS_ANSWERED;
}

static int getxattr(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp)
{
    const struct fuse_getxattr_in *g = rq->op;
    size_t len = strnlen(rq->payload, rq->payload_len);
    /* Only the control socket's name, on the root, and not listed: a copy of the tree must not carry it. */
    if (rq->in->nodeid == 1 && sv->xattr_name && len < rq->payload_len && strcmp(rq->payload, sv->xattr_name) == 0)
        return xattr_value(rp, g->size, sv->xattr_value, sv->xattr_len);
    return reply_err(rp, ENODATA);
}

/* --- READ from the shared cache -------------------------------------------------------------- */

static struct {
    pthread_mutex_t lock;
    char *buf[DLFS_BIG_BUFFERS];
    int used[DLFS_BIG_BUFFERS];
    char *region; /* the buffers, back to back on huge pages (hugebuf.h): O_DIRECT reads land in them */
} big = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* A free shared buffer, taken: 1 + its index, or 0 if none (all in use, or no memory). */
static int big_take(void)
{
    int k = 0;
    pthread_mutex_lock(&big.lock);
    for (int i = 0; i < DLFS_BIG_BUFFERS && !k; i++) {
        if (big.used[i])
            continue;
        if (!big.region && !(big.region = dlfs_hugebuf_map(DLFS_BIG_BUFFERS * (size_t)DLFS_BIG_BUFFER)))
            break;
        big.buf[i] = big.region + (size_t)i * DLFS_BIG_BUFFER;
        big.used[i] = 1;
        k = i + 1;
    }
    pthread_mutex_unlock(&big.lock);
    return k;
}

static void big_give(int k)
{
    pthread_mutex_lock(&big.lock);
    big.used[k - 1] = 0;
    pthread_mutex_unlock(&big.lock);
}

/* Let go of everything the reply holds: its pins, its shared buffer. */
static void unpin_all(const struct dlfs_serve *sv, struct dlfs_reply *rp)
{
    for (int i = 0; i < rp->npins; i++)
        dlfs_shm_unpin(sv->shm, sv->pin, rp->pin_slab[i]);
    rp->npins = 0;
    if (rp->big) {
        big_give(rp->big);
        rp->big = 0;
    }
    if (rp->ahead) {
        dlfs_ahead_give(rp->ahead, 0);
        rp->ahead = 0;
    }
}

void dlfs_serve_local_free(int local_dir, struct dlfs_sums *sums, struct dlfs_chunk_files *files)
{
    if (local_dir >= 0)
        close(local_dir);
    if (sums) {
        dlfs_sums_free(sums);
        free(sums);
    }
    if (files) {
        dlfs_chunk_files_free(files);
        free(files);
    }
}

void dlfs_sums_init(struct dlfs_sums *s)
{
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->lock, NULL);
    for (int i = 0; i < DLFS_SUMS_KEPT; i++)
        s->ext[i] = -1;
}

void dlfs_sums_free(struct dlfs_sums *s)
{
    for (int i = 0; i < DLFS_SUMS_KEPT; i++)
        free(s->table[i]);
    pthread_mutex_destroy(&s->lock);
}

/* Copy sums [first, first + n) of extent `ext` to `out` if its table is kept; 1 if it was. */
static int sums_lookup(struct dlfs_sums *s, uint64_t ext, uint64_t first, uint64_t n, uint64_t *out)
{
    int found = 0;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < DLFS_SUMS_KEPT; i++) {
        if (s->ext[i] == (int64_t)ext) {
            if (first + n <= s->count[i]) {
                memcpy(out, s->table[i] + first, n * sizeof *out);
                s->used[i] = 1;
                found = 1;
            }
            break;
        }
    }
    pthread_mutex_unlock(&s->lock);
    return found;
}

/* Keep `table` (malloc'd, `count` sums; taken over) for extent `ext`, in place of a table not looked
 * at since the clock's hand last passed it. */
static void sums_keep(struct dlfs_sums *s, uint64_t ext, uint64_t *table, uint32_t count)
{
    pthread_mutex_lock(&s->lock);
    unsigned i;
    for (;;) {
        i = s->hand++ % DLFS_SUMS_KEPT;
        if (!s->used[i])
            break;
        s->used[i] = 0;
    }
    free(s->table[i]);
    s->table[i] = table;
    s->ext[i] = (int64_t)ext;
    s->count[i] = count;
    s->used[i] = 1;
    pthread_mutex_unlock(&s->lock);
}

/* Forget extent `ext`'s table (one of its blocks failed: the table may be what is bad). */
static void sums_forget(struct dlfs_sums *s, uint64_t ext)
{
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < DLFS_SUMS_KEPT; i++)
        if (s->ext[i] == (int64_t)ext)
            s->ext[i] = -1;
    pthread_mutex_unlock(&s->lock);
}

#ifndef RWF_DONTCACHE
#define RWF_DONTCACHE 0x00000080 /* Linux 6.14+: read through the page cache, dropping what it read */
#endif

#define DIRECT_ALIGN 4096 /* O_DIRECT's alignment of offset, length and memory (a page covers every device's) */

static int dontcache = RWF_DONTCACHE; /* 0 once the kernel or file system says it has no such flag */

/* Reads of chunk files leave no page cache behind (RWF_DONTCACHE where the kernel has it): the kernel
 * caches what it is sent for the FUSE file, and one copy of each byte in memory is enough. */
static int pread_all(int fd, char *buf, size_t len, off_t off)
{
    while (len) {
        struct iovec iov = {buf, len};
        int flags = __atomic_load_n(&dontcache, __ATOMIC_RELAXED);
        ssize_t n = preadv2(fd, &iov, 1, off, flags);
        if (n < 0 && flags && (errno == EOPNOTSUPP || errno == EINVAL)) {
            __atomic_store_n(&dontcache, 0, __ATOMIC_RELAXED);
            continue;
        }
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
        off += n;
    }
    return 0;
}

/* Sums [first, first + n) of extent `ext` (record `e`) into `out`: from the engine's kept tables, or
 * its whole table read once from the chunk file and kept; -1 if it cannot be read. */
static int record_sums(const struct dlfs_serve *sv, int fd, uint64_t ext, const struct dlfs_extent *e, uint64_t first,
                       uint64_t n, uint64_t *out, struct dlfs_counters *c)
{
    if (sums_lookup(sv->sums, ext, first, n, out))
        return 0;
    uint32_t count = (uint32_t)(((uint64_t)e->stored_len + DLFS_BLOCK_SIZE - 1) / DLFS_BLOCK_SIZE);
    uint64_t *table = malloc((size_t)count * sizeof *table);
    if (!table || first + n > count ||
        pread_all(fd, (char *)table, (size_t)count * sizeof *table, (off_t)e->offset + (off_t)e->stored_len) < 0) {
        free(table);
        return -1;
    }
    DLFS_COUNT(c, block_bytes, (uint64_t)count * sizeof *table);
    memcpy(out, table + first, n * sizeof *out);
    sums_keep(sv->sums, ext, table, count);
    return 0;
}

/* A random read inside one record with block sums, from this machine's chunk file: the 4 KiB blocks
 * covering [lo, hi), checked against the record's sums (as dlfs/format/chunk.py's block_range and
 * verify_blocks). */
static int read_blocks(const struct dlfs_serve *sv, struct dlfs_reply *rp, uint64_t ext, const struct dlfs_extent *e,
                       uint64_t lo, uint64_t hi, struct dlfs_counters *c)
{
    uint64_t first = lo / DLFS_BLOCK_SIZE, end = (hi - 1) / DLFS_BLOCK_SIZE + 1, n = end - first;
    uint64_t start = first * DLFS_BLOCK_SIZE, stop = end * DLFS_BLOCK_SIZE < e->raw_len ? end * DLFS_BLOCK_SIZE : e->raw_len;
    uint64_t sums[DLFS_RANDOM_READ_MAX / DLFS_BLOCK_SIZE + 2];
    if (stop - start > rp->scratch_size || n > sizeof sums / sizeof *sums)
        return -1;
    struct dlfs_chunk_ref f;
    if (dlfs_chunk_get(sv->files, sv->local_dir, e->chunk, dlfs_ix_chunk_id(&sv->ix, e->chunk), 0, 0, &f) < 0)
        return -1;
    char *data = rp->scratch;
    if (record_sums(sv, f.fd, ext, e, first, n, sums, c) < 0 ||
        pread_all(f.fd, data, stop - start, (off_t)e->offset + (off_t)start) < 0) {
        DLFS_COUNT(c, block_failures, 1);
        dlfs_chunk_put(&f, 1);
        return -1;
    }
    for (uint64_t b = 0; b < n; b++) {
        size_t len = b + 1 < n ? DLFS_BLOCK_SIZE : stop - start - b * DLFS_BLOCK_SIZE;
        if (dlfs_xxh3(data + b * DLFS_BLOCK_SIZE, len) != le64toh(sums[b])) {
            DLFS_COUNT(c, block_failures, 1); /* Python reads it again, from the replicas, and says which block */
            sums_forget(sv->sums, ext);
            dlfs_chunk_put(&f, 1);
            return -1;
        }
    }
    dlfs_chunk_put(&f, 0);
    DLFS_COUNT(c, block_reads, 1);
    DLFS_COUNT(c, block_bytes, stop - start);
    add(rp, data + (lo - start), hi - lo);
    return 0;
}

static int scan_mode;

void dlfs_set_scan(int on)
{
    __atomic_store_n(&scan_mode, on, __ATOMIC_RELAXED);
}

int dlfs_scan_mode(void)
{
    return __atomic_load_n(&scan_mode, __ATOMIC_RELAXED);
}

/* The processes (thread ids, as FUSE gives them) behind the latest READs that went to Python: how many
 * readers there are, which cache.py's random-order latch is judged against (a reader in order leaves one
 * or two windows partly read, a random order one per miss). A ring, written racily: a count, not a log. */
#define MISS_PIDS 32
static uint32_t miss_pids[MISS_PIDS];
static uint32_t miss_at;

static void note_miss(uint32_t pid)
{
    uint32_t at = __atomic_fetch_add(&miss_at, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&miss_pids[at % MISS_PIDS], pid, __ATOMIC_RELAXED);
}

unsigned dlfs_miss_readers(void)
{
    uint32_t seen[MISS_PIDS];
    unsigned n = 0;
    for (int i = 0; i < MISS_PIDS; i++) {
        uint32_t pid = __atomic_load_n(&miss_pids[i], __ATOMIC_RELAXED);
        unsigned j = 0;
        while (j < n && seen[j] != pid)
            j++;
        if (pid && j == n)
            seen[n++] = pid;
    }
    return n;
}

static uint64_t direct_io_min;

void dlfs_set_direct_io(uint64_t min)
{
    __atomic_store_n(&direct_io_min, min, __ATOMIC_RELAXED);
}

uint64_t dlfs_direct_io_min(void)
{
    return __atomic_load_n(&direct_io_min, __ATOMIC_RELAXED);
}

int dlfs_amend_init_reply(void *init_out, size_t len)
{
    struct fuse_init_out *o = init_out;
    if (!dlfs_direct_io_min() || len < offsetof(struct fuse_init_out, flags2) + sizeof o->flags2)
        return 0;
    o->flags |= FUSE_INIT_EXT; /* flags2 is read only with it */
    o->flags2 |= (uint32_t)(FUSE_DIRECT_IO_ALLOW_MMAP >> 32);
    return 1;
}

/* OPEN: refused once (no_open) unless in direct mode; then the handle is the inode, and the file is read
 * past the page cache if it is big (see dlfs_set_direct_io). */
static int open_(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                 struct dlfs_counters *c)
{
    uint64_t min = dlfs_direct_io_min();
    if (!min)
        return reply_err(rp, ENOSYS);
    struct dlfs_inode n;
    int err = dlfs_inode_of(&sv->ix, rq->in->nodeid, &n);
    if (err)
        return table_err(rp, c, err);
    if (S_ISDIR(n.mode))
        return reply_err(rp, EISDIR);
    const struct fuse_open_in *in = rq->op;
    if ((in->flags & O_ACCMODE) != O_RDONLY || (in->flags & (O_TRUNC | O_APPEND)))
        return reply_err(rp, EROFS);
    struct fuse_open_out *o = body(rp, sizeof *o);
    o->fh = rq->in->nodeid;
    o->open_flags = (uint64_t)n.size >= min ? FOPEN_DIRECT_IO : FOPEN_KEEP_CACHE;
    return DLFS_ANSWERED;
}

/* Whether `n` bytes at `p` are all zero: what a file holds where nothing was written. */
static int all_zero(const char *p, size_t n)
{
    return n == 0 || (p[0] == 0 && !memcmp(p, p + 1, n - 1));
}

/* Record `e`'s stored bytes `data` (NULL: they could not be read) from file `f` against its checksum,
 * counted as read from this machine's chunk files or from the disk cache: 0 if good; -1 if not (Python
 * reads it again, from the replicas, and says what is wrong). */
static int check_record(const struct dlfs_extent *e, const char *data, const struct dlfs_chunk_ref *f,
                        struct dlfs_counters *c)
{
    if (!data || dlfs_xxh3(data, e->stored_len) != e->checksum) {
        if (!(data && dlfs_dcache_ref(f) && all_zero(data, e->stored_len)))
            DLFS_COUNT(c, record_failures, 1); /* (zeros: a record the disk cache never had, beside kept ones) */
        return -1;
    }
    if (dlfs_dcache_ref(f)) {
        DLFS_COUNT(c, disk_cache_reads, 1);
        DLFS_COUNT(c, disk_cache_bytes, e->stored_len);
    } else {
        DLFS_COUNT(c, record_reads, 1);
        DLFS_COUNT(c, record_bytes, e->stored_len);
    }
    return 0;
}

/* Record `e`'s chunk (`id`) held for reading it whole: this machine's chunk file, else the disk cache's
 * copy where it has all of the record (diskcache.h). 0 (dlfs_chunk_put it), or -1: neither. */
static int record_file(const struct dlfs_serve *sv, const struct dlfs_extent *e, const uint8_t *id, int direct,
                       struct dlfs_chunk_ref *f)
{
    if (sv->local_dir >= 0 && dlfs_chunk_get(sv->files, sv->local_dir, e->chunk, id, 0, direct, f) == 0)
        return 0;
    return dlfs_dcache_get(e->chunk, id, e->offset, e->stored_len, direct, f);
}

/* Record `e`'s stored bytes fetched from the data daemon its route names into `buf` (`room` bytes) and
 * checked as check_record does, counted as fetched (remote.h): 0, or -1 (Python's). */
static int fetch_checked(const struct dlfs_extent *e, const uint8_t *id, char *buf, uint32_t room,
                         struct dlfs_counters *c)
{
    if (e->stored_len > DLFS_KEEP_MAX && dlfs_dcache_keeping())
        return -1; /* the disk cache could not be handed it: Python fetches it, and keeps it there */
    if (dlfs_remote_read(e, id, buf, room, c) < 0)
        return -1;
    if (dlfs_xxh3(buf, e->stored_len) != e->checksum) {
        DLFS_COUNT(c, remote_failures, 1);
        return -1;
    }
    DLFS_COUNT(c, remote_reads, 1);
    DLFS_COUNT(c, remote_bytes, e->stored_len);
    dlfs_dcache_offer(e, buf); /* a disk cache keeps it (where one is kept: diskcache.h) */
    return 0;
}

/* O_DIRECT, the range widened to whole pages, so no page cache is allocated and dropped again
 * (RWF_DONTCACHE's way: 0.61-0.62x local disk in a 1 GiB cgroup against 0.72-0.80x so). */
const char *dlfs_record_direct(struct dlfs_chunk_ref *f, const struct dlfs_extent *e, char *into, size_t room)
{
    uint64_t lo;
    uint32_t len = dlfs_record_span(e, &lo);
    if (len > room || f->direct < 0)
        return NULL;
    ssize_t n = pread(f->direct, into, len, (off_t)lo);
    if (n < 0 && errno == EINVAL) /* a file system that opens O_DIRECT but will not read so */
        dlfs_chunk_no_direct(f);
    if (n < (ssize_t)(e->offset + e->stored_len - lo))
        return NULL;
    return into + (e->offset - lo);
}

/* Record `e` of a held chunk file read from the disk straight into the scratch buffer (dlfs_record_direct):
 * where its bytes start there, or NULL: then a plain read. */
static const char *direct_record(struct dlfs_chunk_ref *f, struct dlfs_reply *rp, const struct dlfs_extent *e)
{
    char *base = (char *)(((uintptr_t)rp->scratch + DIRECT_ALIGN - 1) & ~(uintptr_t)(DIRECT_ALIGN - 1));
    return dlfs_record_direct(f, e, base, rp->scratch_size - (size_t)(base - rp->scratch));
}

/* Whether record `e` (of chunk `id`) is read from a file on this machine's disk (its chunk file, or the
 * disk cache's copy), not fetched. */
static int record_here(const struct dlfs_serve *sv, const struct dlfs_extent *e, const uint8_t *id)
{
    struct dlfs_chunk_ref f;
    if (record_file(sv, e, id, 0, &f) < 0)
        return 0;
    dlfs_chunk_put(&f, 0);
    return 1;
}

/* A whole uncompressed record (no block sums: small) of a chunk this machine does not hold, fetched from
 * the data daemon its route names into the scratch buffer and checked (remote.h): 0, or -1 (Python's). */
static int fetch_record(struct dlfs_reply *rp, const struct dlfs_extent *e, const uint8_t *id,
                        struct dlfs_counters *c)
{
    if (fetch_checked(e, id, rp->scratch, rp->scratch_size, c) < 0)
        return -1;
    add(rp, rp->scratch, e->raw_len);
    return 0;
}

/* A whole record with block sums, for a thread whose own buffer is too small (/dev/fuse): read from this
 * machine's chunk file (O_DIRECT where it is page-aligned, as in version 3 chunks) or the disk cache's,
 * or fetched, into a shared buffer, which the reply holds until it is sent. 0, or -1 (Python's: no buffer
 * free, the read or fetch failed or its check). FUSE over io_uring reads it into the ring's own buffer. */
static int whole_big(const struct dlfs_serve *sv, struct dlfs_reply *rp, const struct dlfs_extent *e,
                     struct dlfs_counters *c)
{
    if ((sv->local_dir < 0 && !dlfs_remote_on() && !dlfs_dcache_on()) || e->stored_len > DLFS_BIG_BUFFER || rp->big)
        return -1;
    const uint8_t *id = dlfs_ix_chunk_id(&sv->ix, e->chunk);
    struct dlfs_chunk_ref f;
    int cached = record_file(sv, e, id, 1, &f) == 0;
    if (!cached && !dlfs_remote_on())
        return -1;
    int k = big_take();
    if (!k) {
        if (cached)
            dlfs_chunk_put(&f, 0);
        return -1;
    }
    char *buf = big.buf[k - 1];
    const char *got = buf;
    int bad = 0;
    if (cached) { /* this machine's chunk file, or the disk cache's copy */
        got = dlfs_record_direct(&f, e, buf, DLFS_BIG_BUFFER);
        if (!got) /* not read so: through the page cache */
            got = pread_all(f.fd, buf, e->stored_len, (off_t)e->offset) < 0 ? NULL : buf;
        bad = check_record(e, got, &f, c) < 0;
        dlfs_chunk_put(&f, bad);
    } else {
        bad = fetch_checked(e, id, buf, DLFS_BIG_BUFFER, c) < 0;
    }
    if (bad) {
        big_give(k);
        return -1;
    }
    rp->big = k;
    add(rp, got, e->raw_len);
    return 0;
}

/* A whole uncompressed record (no block sums: small) of a local chunk, read into the scratch buffer
 * (or already read at its file's LOOKUP: ahead.h) and checked against its checksum (as
 * dlfs/format/chunk.py's decode_record). */
static int read_record(const struct dlfs_serve *sv, struct dlfs_reply *rp, uint64_t ext, const struct dlfs_extent *e,
                       struct dlfs_counters *c)
{
    const char *early;
    const struct dlfs_chunk_ref *held;
    int slot = dlfs_ahead_take(ext, &early, &held, c);
    if (slot) {
        if (check_record(e, early, held, c) < 0) {
            dlfs_ahead_give(slot, 1);
            return -1;
        }
        rp->ahead = slot; /* given back once the reply is sent */
        add(rp, early, e->raw_len);
        return 0;
    }
    struct dlfs_chunk_ref f;
    const uint8_t *id = dlfs_ix_chunk_id(&sv->ix, e->chunk);
    if (record_file(sv, e, id, 1, &f) < 0)
        return fetch_record(rp, e, id, c);
    dlfs_ahead_missed();
    const char *got = direct_record(&f, rp, e);
    if (!got)
        got = pread_all(f.fd, rp->scratch, e->stored_len, (off_t)e->offset) < 0 ? NULL : rp->scratch;
    int bad = check_record(e, got, &f, c) < 0;
    dlfs_chunk_put(&f, bad);
    if (bad)
        return -1;
    add(rp, got, e->raw_len);
    return 0;
}

/* A READ of [lo, hi) of one record not in the cache (`size` asked; `whole_file`: the record is all of
 * its file), read here from this machine's chunk file: inside a big record with block sums, a random
 * read (its blocks alone); in scan mode, the whole of a small record (1: the caller reads it, where
 * rp->async_records). -1: Python's to fetch (read-ahead, remote or compressed chunks, a failed check). */
static int read_local(const struct dlfs_serve *sv, struct dlfs_reply *rp, uint64_t ext, const struct dlfs_extent *e,
                      uint64_t lo, uint64_t hi, uint32_t size, int whole_file, struct dlfs_counters *c)
{
    if ((sv->local_dir < 0 && !dlfs_remote_on() && !dlfs_dcache_on()) || e->flags & DLFS_RECORD_LZ4 ||
        e->stored_len != e->raw_len)
        return -1;
    int scan = __atomic_load_n(&scan_mode, __ATOMIC_RELAXED);
    if (e->flags & DLFS_RECORD_BLOCK_SUMS) {
        /* A whole file of one such record (page-aligned in version 3 chunks) that the caller can read
         * straight into its reply (FUSE over io_uring: the entry's payload). */
        uint64_t at;
        if (scan && rp->async_records && whole_file && lo == 0 && hi == e->raw_len && !(e->offset & (DIRECT_ALIGN - 1)) &&
            dlfs_record_span(e, &at) <= rp->async_max) {
            rp->record_ext = ext;
            return 1;
        }
        if (scan && !rp->async_records && whole_file && lo == 0 && hi == e->raw_len && whole_big(sv, rp, e, c) == 0)
            return 0;
        return sv->sums && size <= DLFS_RANDOM_READ_MAX ? read_blocks(sv, rp, ext, e, lo, hi, c) : -1;
    }
    if (whole_file && lo == 0 && hi == e->raw_len && e->stored_len <= rp->scratch_size && scan) {
        if (rp->async_records) {
            rp->record_ext = ext;
            return 1;
        }
        return read_record(sv, rp, ext, e, c);
    }
    return -1;
}

int dlfs_record_wanted(const struct dlfs_serve *sv, uint64_t ino, uint64_t *ext, struct dlfs_extent *e)
{
    struct dlfs_inode n;
    if (!__atomic_load_n(&scan_mode, __ATOMIC_RELAXED) || (sv->local_dir < 0 && !dlfs_dcache_on()) || !sv->shm ||
        !sv->consume ||
        dlfs_ix_inode(&sv->ix, ino, &n) < 0 || !S_ISREG(n.mode) || n.count != 1 ||
        dlfs_ix_extent(&sv->ix, n.ref, e) < 0)
        return 0;
    if (e->flags & (DLFS_RECORD_LZ4 | DLFS_RECORD_BLOCK_SUMS) || e->stored_len != e->raw_len || !e->raw_len ||
        (uint64_t)n.size != e->raw_len || dlfs_consume_pending(sv->consume, n.ref))
        return 0;
    const char *buf;
    uint32_t slab;
    if (dlfs_shm_pin(sv->shm, sv->pin, n.ref, e->raw_len, &buf, &slab)) { /* in the cache: a READ pins it there */
        dlfs_shm_unpin(sv->shm, sv->pin, slab);
        return 0;
    }
    *ext = n.ref;
    return 1;
}

uint32_t dlfs_record_span(const struct dlfs_extent *e, uint64_t *lo)
{
    *lo = e->offset & ~(uint64_t)(DIRECT_ALIGN - 1);
    return (uint32_t)(((e->offset + e->stored_len + DIRECT_ALIGN - 1) & ~(uint64_t)(DIRECT_ALIGN - 1)) - *lo);
}

int dlfs_record_plan(const struct dlfs_serve *sv, const struct dlfs_extent *e, uint32_t room,
                     struct dlfs_chunk_ref *f, uint64_t *lo, uint32_t *len)
{
    *len = dlfs_record_span(e, lo);
    if (*len > room || record_file(sv, e, dlfs_ix_chunk_id(&sv->ix, e->chunk), 1, f) < 0)
        return -1;
    if (f->direct < 0) {
        dlfs_chunk_put(f, 0);
        return -1;
    }
    return 0;
}

/* The reply to READ `unique` of the whole record `e`, its checked bytes at `data`. */
static int record_reply(struct dlfs_reply *rp, uint64_t unique, const struct dlfs_extent *e, const char *data,
                        struct dlfs_counters *c)
{
    reply_begin(rp, unique);
    add(rp, data, e->raw_len);
    DLFS_COUNT(c, reads, 1);
    DLFS_COUNT(c, read_bytes, e->raw_len);
    return reply_end(rp, c);
}

int dlfs_record_answer(struct dlfs_reply *rp, uint64_t unique, const struct dlfs_extent *e, const char *data,
                       const struct dlfs_chunk_ref *f, struct dlfs_counters *c)
{
    if (check_record(e, data, f, c) < 0)
        return DLFS_FORWARD;
    return record_reply(rp, unique, e, data, c);
}

int dlfs_record_fetch(const struct dlfs_serve *sv, struct dlfs_reply *rp, uint64_t unique, uint64_t ext, char *into,
                      uint32_t room, struct dlfs_counters *c)
{
    struct dlfs_extent e;
    if (dlfs_ix_extent(&sv->ix, ext, &e) < 0)
        return DLFS_FORWARD;
    const uint8_t *id = dlfs_ix_chunk_id(&sv->ix, e.chunk);
    if (record_here(sv, &e, id))
        return DLFS_RECORD; /* on this machine's disk: read from there */
    if (fetch_checked(&e, id, into, room, c) < 0)
        return DLFS_FORWARD;
    return record_reply(rp, unique, &e, into, c);
}

/* Read-ahead READs (bigger than DLFS_RANDOM_READ_MAX) that nothing here could answer, sent to Python
 * lately: one a slot, by inode. The kernel sends a file's first READs together, and Python asks for their
 * windows (and the stream's next ones) on the first: the others wait here for that, as READs of a window
 * being fetched do, rather than reach Python each as a miss of its own and wait there (big files read
 * whole, cold, with a 4 MiB kernel read-ahead: 118 READs to Python a pass of 32 files, 32 so). They wait
 * until the first's record lands, Python has answered it (dlfs_read_answered), or START_WAIT_NS. Slots are
 * overwritten and read without a lock: a torn one only sends a READ to Python, or holds it until a wake-up. */
#define START_SLOTS 64
#define START_WAIT_NS (50 * 1000000ull)
static struct {
    uint64_t ino, ext, ns, waited;
} starts[START_SLOTS];

/* A read-ahead READ of inode `ino`, extent `ext`, that nothing here can answer: 1 if it waits for the READ
 * of the same file sent to Python before it; else it goes to Python, noted as the one the next ones wait for. */
static int start_wait(const struct dlfs_serve *sv, uint64_t ino, uint64_t ext)
{
    unsigned k = (unsigned)(ino % START_SLOTS);
    uint64_t now = dlfs_now_ns(), first = __atomic_load_n(&starts[k].ext, __ATOMIC_RELAXED);
    if (__atomic_load_n(&starts[k].ino, __ATOMIC_RELAXED) == ino &&
        now < __atomic_load_n(&starts[k].ns, __ATOMIC_RELAXED) + START_WAIT_NS && first < sv->shm->h.n_extents &&
        __atomic_load_n(&sv->shm->entries[first], __ATOMIC_ACQUIRE) == 0) {
        __atomic_store_n(&starts[k].waited, 1, __ATOMIC_RELAXED);
        return 1;
    }
    __atomic_store_n(&starts[k].ino, 0, __ATOMIC_RELAXED); /* no reader takes a half-written slot as this file's */
    __atomic_store_n(&starts[k].ns, now, __ATOMIC_RELAXED);
    __atomic_store_n(&starts[k].ext, ext, __ATOMIC_RELAXED);
    __atomic_store_n(&starts[k].waited, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&starts[k].ino, ino, __ATOMIC_RELEASE);
    return 0;
}

void dlfs_read_starts_reset(void)
{
    memset(starts, 0, sizeof starts);
}

int dlfs_read_answered(uint64_t ino)
{
    unsigned k = (unsigned)(ino % START_SLOTS);
    if (__atomic_load_n(&starts[k].ino, __ATOMIC_ACQUIRE) != ino)
        return 0;
    __atomic_store_n(&starts[k].ns, 0, __ATOMIC_RELAXED);
    return (int)__atomic_exchange_n(&starts[k].waited, 0, __ATOMIC_RELAXED);
}

/* A read-ahead READ of inode `ino` answered from the cache: if the file's next record (`next`, before
 * `file_end`) is neither here nor coming, the cache is told, so that its stream starts now and not at the
 * first READ that misses (a file whose first record came in a neighbour's window: its stream started at
 * the READ across that record's end, which then waited for the next window in Python). */
static void hint_next(const struct dlfs_serve *sv, uint64_t ino, uint64_t next, uint64_t file_end)
{
    if (!sv->consume || !sv->shm || next >= file_end || next >= sv->shm->h.n_extents || ino > UINT32_MAX ||
        next > UINT32_MAX || __atomic_load_n(&sv->shm->entries[next], __ATOMIC_ACQUIRE) != 0 ||
        dlfs_consume_pending(sv->consume, next))
        return;
    dlfs_consume_hint(sv->consume, (uint32_t)ino, (uint32_t)next);
}

static int read_(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                 struct dlfs_counters *c)
{
    const struct fuse_read_in *r = rq->op;
    struct dlfs_inode n;
    if (dlfs_ix_inode(&sv->ix, rq->in->nodeid, &n) < 0 || !S_ISREG(n.mode) || n.size < 0)
        return DLFS_FORWARD; /* Python says what is wrong, and logs it */
    if (r->offset >= (uint64_t)n.size || r->size == 0) {
        DLFS_COUNT(c, reads, 1);
        return DLFS_ANSWERED; /* end of file: no bytes */
    }
    uint64_t off = r->offset, end = off + r->size < (uint64_t)n.size ? off + r->size : (uint64_t)n.size;
    uint64_t pos = 0, got = 0, last = n.ref;
    for (uint64_t i = n.ref; i < (uint64_t)n.ref + n.count && pos < end; i++) {
        struct dlfs_extent e;
        if (dlfs_ix_extent(&sv->ix, i, &e) < 0)
            goto miss;
        uint64_t next = pos + e.raw_len;
        if (next > off) {
            const char *buf;
            uint32_t slab;
            if (e.flags & DLFS_RECORD_LZ4 || rp->n == DLFS_REPLY_IOV || !sv->shm ||
                !dlfs_shm_pin(sv->shm, sv->pin, i, e.raw_len, &buf, &slab)) {
                if (!(e.flags & DLFS_RECORD_LZ4) && rp->n < DLFS_REPLY_IOV && sv->consume &&
                    dlfs_consume_pending(sv->consume, i)) {
                    unpin_all(sv, rp); /* its window is on its way: wait for it here (engine.c) */
                    rp->n = 1;
                    return DLFS_PARK;
                }
                int got = rp->npins == 0 && off >= pos && end <= next
                              ? read_local(sv, rp, i, &e, off - pos, end - pos, r->size, n.count == 1, c) : -1;
                if (got == 1)
                    return DLFS_RECORD; /* the caller reads it (rp->async_records) */
                if (got == 0) {
                    DLFS_COUNT(c, reads, 1);
                    DLFS_COUNT(c, read_bytes, end - off);
                    return DLFS_ANSWERED;
                }
                if (got < 0 && r->size > DLFS_RANDOM_READ_MAX && rp->n < DLFS_REPLY_IOV &&
                    sv->consume && start_wait(sv, rq->in->nodeid, i)) {
                    unpin_all(sv, rp);
                    rp->n = 1;
                    return DLFS_PARK;
                }
                goto miss;
            }
            uint64_t lo = off > pos ? off - pos : 0, hi = (end < next ? end : next) - pos;
            rp->pin_slab[rp->npins] = slab;
            rp->piece_ext[rp->npins] = (uint32_t)i;
            rp->piece_len[rp->npins] = (uint32_t)(hi - lo);
            rp->piece_raw[rp->npins] = e.raw_len;
            rp->npins++;
            add(rp, buf + lo, hi - lo);
            got += hi - lo;
            last = i;
        }
        pos = next;
    }
    if (got != end - off) /* the extents end before the file does: Python reports it */
        goto miss;
    if (r->size > DLFS_RANDOM_READ_MAX)
        hint_next(sv, rq->in->nodeid, last + 1, (uint64_t)n.ref + n.count);
    DLFS_COUNT(c, reads, 1);
    DLFS_COUNT(c, read_bytes, got);
    return DLFS_ANSWERED;
miss:
    unpin_all(sv, rp);
    rp->n = 1;
    DLFS_COUNT(c, read_misses, 1);
    note_miss(rq->in->pid);
    return DLFS_FORWARD;
}

void dlfs_reply_done(const struct dlfs_serve *sv, struct dlfs_reply *rp, int sent)
{
    for (int i = 0; sent && sv->consume && i < rp->npins; i++)
        if (dlfs_consume_add(sv->consume, rp->piece_ext[i], rp->piece_len[i], rp->piece_raw[i]))
            dlfs_consume_push(sv->consume, rp->piece_ext[i]);
    unpin_all(sv, rp);
}

/* --- dispatch -------------------------------------------------------------------------------- */

int dlfs_answer(const struct dlfs_serve *sv, const struct dlfs_req *rq, struct dlfs_reply *rp,
                struct dlfs_counters *c)
{
    reply_begin(rp, rq->in->unique);
    int op_len = dlfs_op_len(rq->in->opcode);
    if (op_len < 0 || rq->op_len < (uint32_t)op_len)
        return DLFS_FORWARD;
    int r;
    switch (rq->in->opcode) {
    case FUSE_LOOKUP:
        r = lookup(sv, rq, rp, c);
        break;
    case FUSE_GETATTR:
        r = getattr(sv, rq, rp, c);
        break;
    case FUSE_OPENDIR:
        r = opendir(sv, rq, rp, c);
        break;
    case FUSE_READDIRPLUS:
        r = readdirplus(sv, rq, rp, c);
        break;
    case FUSE_READ:
        r = read_(sv, rq, rp, c);
        break;
    case FUSE_READLINK:
        r = readlink_(sv, rq, rp, c);
        break;
    case FUSE_OPEN:
        /* no_open (unless in direct mode): the kernel stops sending OPEN and RELEASE and keeps every
         * file's pages; READ names the file by its inode. The mount is ro: the VFS refuses writes. */
        DLFS_COUNT(c, opens, 1);
        r = open_(sv, rq, rp, c);
        break;
    case FUSE_FLUSH:
        r = reply_err(rp, ENOSYS); /* once: the kernel stops sending FLUSH, nothing is ever dirty */
        break;
    case FUSE_IOCTL:
        DLFS_COUNT(c, ioctls, 1); /* isatty() of every open(path, "rb"): not a terminal */
        r = reply_err(rp, ENOTTY);
        break;
    case FUSE_RELEASE:
    case FUSE_RELEASEDIR:
    case FUSE_FSYNC:
    case FUSE_FSYNCDIR:
        r = DLFS_ANSWERED; /* no state per handle, nothing dirty */
        break;
    case FUSE_STATFS:
        r = statfs_(sv, rp);
        break;
    case FUSE_ACCESS:
        r = access_(sv, rq, rp, c);
        break;
    case FUSE_GETXATTR:
        r = getxattr(sv, rq, rp);
        break;
    case FUSE_LISTXATTR:
        r = xattr_value(rp, ((const struct fuse_getxattr_in *)rq->op)->size, "", 0);
        break;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
        r = DLFS_NO_REPLY; /* inodes live in the index for the life of the mount */
        break;
    case FUSE_INTERRUPT:
        r = DLFS_NO_REPLY; /* nothing here waits long enough to be worth interrupting */
        break;
    default:
        r = DLFS_FORWARD;
    }
    return r == DLFS_ANSWERED ? reply_end(rp, c) : r;
}
