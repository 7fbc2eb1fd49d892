/* Metadata requests answered in C, straight from the mount's mmap'd index.
 *
 * A dataset walk or a cold epoch is mostly LOOKUP, GETATTR and READDIRPLUS; in Python each costs
 * tens of microseconds, here a few. The index format is dlfs/format/index.py's (inodes 48 B,
 * dirents 16 B sorted by name bytes, names blob); every offset read from it is bounds-checked, and
 * anything out of range is answered EIO and counted (the checksum proves integrity, not sanity).
 * Until an index is registered, and for anything unusual, the Python handlers answer instead. */
#define FUSE_USE_VERSION 31
#include <fuse_lowlevel.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "metaserve.h"

#define INODE_SIZE 48
#define DIRENT_SIZE 16
#define BLKSIZE (128 << 10)
#define NAME_BUF 4096

static struct {
    const uint8_t *inodes, *dirents, *names;
    uint64_t n_inodes, n_dirents, names_size;
    double timeout;
    int active;
} ix;

static unsigned long long corrupt_replies, answered;

struct inode {
    uint32_t mode, uid, gid, nlink;
    int64_t size, mtime_ns;
    uint64_t ref;
    uint32_t count, parent;
};

void dlfs_meta_register(const void *inodes, const void *dirents, const void *names, uint64_t n_inodes,
                        uint64_t n_dirents, uint64_t names_size, double timeout)
{
    ix.inodes = inodes;
    ix.dirents = dirents;
    ix.names = names;
    ix.n_inodes = n_inodes;
    ix.n_dirents = n_dirents;
    ix.names_size = names_size;
    ix.timeout = timeout;
    ix.active = 1;
}

void dlfs_meta_unregister(void)
{
    ix.active = 0;
}

unsigned long long dlfs_meta_corrupt(void)
{
    return corrupt_replies;
}

unsigned long long dlfs_meta_answered(void)
{
    return answered;
}

static int get_inode(fuse_ino_t ino, struct inode *out)
{
    if (ino < 1 || ino > ix.n_inodes)
        return -1;
    const uint8_t *p = ix.inodes + (ino - 1) * INODE_SIZE;
    memcpy(&out->mode, p, 4);
    memcpy(&out->uid, p + 4, 4);
    memcpy(&out->gid, p + 8, 4);
    memcpy(&out->nlink, p + 12, 4);
    memcpy(&out->size, p + 16, 8);
    memcpy(&out->mtime_ns, p + 24, 8);
    memcpy(&out->ref, p + 32, 8);
    memcpy(&out->count, p + 40, 4);
    memcpy(&out->parent, p + 44, 4);
    return 0;
}

/* A directory's dirents lie within the section: checked once per request, not per entry. */
static int dir_ok(const struct inode *d)
{
    return d->ref <= ix.n_dirents && d->count <= ix.n_dirents - d->ref;
}

static int dirent_at(uint64_t i, const uint8_t **name, uint32_t *len, uint32_t *ino)
{
    const uint8_t *p = ix.dirents + i * DIRENT_SIZE;
    uint64_t off;
    memcpy(&off, p, 8);
    memcpy(len, p + 8, 4);
    memcpy(ino, p + 12, 4);
    if (off > ix.names_size || *len > ix.names_size - off)
        return -1;
    *name = ix.names + off;
    return 0;
}

static void fill_stat(struct stat *st, fuse_ino_t ino, const struct inode *n)
{
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_mode = n->mode;
    st->st_nlink = n->nlink;
    st->st_uid = n->uid;
    st->st_gid = n->gid;
    st->st_size = n->size;
    st->st_blocks = (n->size + 511) / 512;
    st->st_blksize = BLKSIZE;
    st->st_mtim.tv_sec = n->mtime_ns / 1000000000;
    st->st_mtim.tv_nsec = n->mtime_ns % 1000000000;
    if (st->st_mtim.tv_nsec < 0) {
        st->st_mtim.tv_sec -= 1;
        st->st_mtim.tv_nsec += 1000000000;
    }
    st->st_atim = st->st_ctim = st->st_mtim;
}

static void fill_entry(struct fuse_entry_param *e, fuse_ino_t ino, const struct inode *n)
{
    memset(e, 0, sizeof *e);
    e->ino = ino;
    e->attr_timeout = ix.timeout;
    e->entry_timeout = ix.timeout;
    fill_stat(&e->attr, ino, n);
}

static void corrupt(fuse_req_t req)
{
    corrupt_replies++;
    fuse_reply_err(req, EIO);
}

/* Python's bytes order: unsigned bytes, then length. */
static int name_cmp(const uint8_t *a, size_t alen, const char *b, size_t blen)
{
    int c = memcmp(a, b, alen < blen ? alen : blen);
    if (c)
        return c;
    return alen < blen ? -1 : alen > blen;
}

int dlfs_meta_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct inode d, n;
    if (!ix.active || (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))))
        return 0;
    answered++;
    if (get_inode(parent, &d) < 0 || !dir_ok(&d)) {
        corrupt(req);
        return 1;
    }
    if (!S_ISDIR(d.mode)) {
        fuse_reply_err(req, ENOTDIR);
        return 1;
    }
    size_t len = strlen(name);
    uint64_t lo = d.ref, hi = d.ref + d.count;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const uint8_t *probe;
        uint32_t plen, ino;
        if (dirent_at(mid, &probe, &plen, &ino) < 0) {
            corrupt(req);
            return 1;
        }
        int c = name_cmp(probe, plen, name, len);
        if (c == 0) {
            struct fuse_entry_param e;
            if (get_inode(ino, &n) < 0) {
                corrupt(req);
                return 1;
            }
            fill_entry(&e, ino, &n);
            fuse_reply_entry(req, &e);
            return 1;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    /* A negative entry: the namespace never changes, so the kernel may remember the miss. */
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    e.entry_timeout = ix.timeout;
    fuse_reply_entry(req, &e);
    return 1;
}

/* The start of every handler: 0 to go on with `n` filled; 1 if the request is answered (EIO);
 * -1 if no index is registered (Python answers). */
static int begin(fuse_req_t req, fuse_ino_t ino, struct inode *n)
{
    if (!ix.active)
        return -1;
    answered++;
    if (get_inode(ino, n) < 0) {
        corrupt(req);
        return 1;
    }
    return 0;
}

int dlfs_meta_getattr(fuse_req_t req, fuse_ino_t ino)
{
    struct inode n;
    struct stat st;
    int r = begin(req, ino, &n);
    if (r)
        return r > 0;
    fill_stat(&st, ino, &n);
    fuse_reply_attr(req, &st, ix.timeout);
    return 1;
}

int dlfs_meta_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct inode n;
    int r = begin(req, ino, &n);
    if (r)
        return r > 0;
    if (!S_ISDIR(n.mode)) {
        fuse_reply_err(req, ENOTDIR);
        return 1;
    }
    fi->fh = ino;
    /* The listing never changes: let the kernel keep it. */
    fi->cache_readdir = 1;
    fi->keep_cache = 1;
    fuse_reply_open(req, fi);
    return 1;
}

/* Positions as in Python's readdir: 0 ".", 1 "..", entry i at i + 2; an entry's next is its
 * position + 1. */
static size_t add_entry(fuse_req_t req, char *buf, size_t left, const uint8_t *name, uint32_t len,
                        fuse_ino_t ino, const struct inode *n, off_t next)
{
    char cname[NAME_BUF];
    struct fuse_entry_param e;
    if (len >= NAME_BUF)
        len = NAME_BUF - 1;
    memcpy(cname, name, len);
    cname[len] = 0;
    fill_entry(&e, ino, n);
    return fuse_add_direntry_plus(req, buf, left, cname, &e, next);
}

int dlfs_meta_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
{
    struct inode d, n;
    if (!ix.active)
        return 0;
    answered++;
    if (get_inode(ino, &d) < 0 || !dir_ok(&d) || !S_ISDIR(d.mode)) {
        corrupt(req);
        return 1;
    }
    char *buf = malloc(size ? size : 1);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return 1;
    }
    size_t used = 0, want;
    if (off < 0)
        off = 0;
    for (uint64_t pos = (uint64_t)off; pos < (uint64_t)d.count + 2; pos++) {
        if (pos < 2) {
            fuse_ino_t target = pos == 0 ? ino : (d.parent ? d.parent : ino);
            if (get_inode(target, &n) < 0)
                goto bad;
            want = add_entry(req, buf + used, size - used, (const uint8_t *)"..", pos == 0 ? 1 : 2, target, &n,
                             (off_t)pos + 1);
        } else {
            const uint8_t *name;
            uint32_t len, child;
            if (dirent_at(d.ref + pos - 2, &name, &len, &child) < 0 || get_inode(child, &n) < 0)
                goto bad;
            want = add_entry(req, buf + used, size - used, name, len, child, &n, (off_t)pos + 1);
        }
        if (want > size - used)
            break; /* the kernel asks again from here */
        used += want;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
    return 1;
bad:
    free(buf);
    corrupt(req);
    return 1;
}
