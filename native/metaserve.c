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

#include "indexview.h"
#include "metaserve.h"

#define BLKSIZE (128 << 10)
#define NAME_BUF 4096

static struct dlfs_ix ix;
static double timeout;
static int active;
static unsigned long long corrupt_replies, answered;

void dlfs_meta_register(const struct dlfs_ix *index, double entry_timeout)
{
    ix = *index;
    timeout = entry_timeout;
    active = 1;
}

void dlfs_meta_unregister(void)
{
    active = 0;
}

unsigned long long dlfs_meta_corrupt(void)
{
    return corrupt_replies;
}

unsigned long long dlfs_meta_answered(void)
{
    return answered;
}

static void fill_stat(struct stat *st, fuse_ino_t ino, const struct dlfs_inode *n)
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

static void fill_entry(struct fuse_entry_param *e, fuse_ino_t ino, const struct dlfs_inode *n)
{
    memset(e, 0, sizeof *e);
    e->ino = ino;
    e->attr_timeout = timeout;
    e->entry_timeout = timeout;
    fill_stat(&e->attr, ino, n);
}

static void corrupt(fuse_req_t req)
{
    corrupt_replies++;
    fuse_reply_err(req, EIO);
}

int dlfs_meta_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct dlfs_inode d, n;
    if (!active || (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))))
        return 0;
    answered++;
    if (dlfs_ix_inode(&ix, parent, &d) < 0 || !dlfs_ix_dir_ok(&ix, &d)) {
        corrupt(req);
        return 1;
    }
    if (!S_ISDIR(d.mode)) {
        fuse_reply_err(req, ENOTDIR);
        return 1;
    }
    uint32_t ino;
    struct fuse_entry_param e;
    switch (dlfs_ix_find(&ix, &d, name, strlen(name), &ino)) {
    case 1:
        if (dlfs_ix_inode(&ix, ino, &n) < 0) {
            corrupt(req);
            return 1;
        }
        fill_entry(&e, ino, &n);
        fuse_reply_entry(req, &e);
        return 1;
    case 0:
        /* A negative entry: the namespace never changes, so the kernel may remember the miss. */
        memset(&e, 0, sizeof e);
        e.entry_timeout = timeout;
        fuse_reply_entry(req, &e);
        return 1;
    default:
        corrupt(req);
        return 1;
    }
}

/* The start of every handler: 0 to go on with `n` filled; 1 if the request is answered (EIO);
 * -1 if no index is registered (Python answers). */
static int begin(fuse_req_t req, fuse_ino_t ino, struct dlfs_inode *n)
{
    if (!active)
        return -1;
    answered++;
    if (dlfs_ix_inode(&ix, ino, n) < 0) {
        corrupt(req);
        return 1;
    }
    return 0;
}

int dlfs_meta_getattr(fuse_req_t req, fuse_ino_t ino)
{
    struct dlfs_inode n;
    struct stat st;
    int r = begin(req, ino, &n);
    if (r)
        return r > 0;
    fill_stat(&st, ino, &n);
    fuse_reply_attr(req, &st, timeout);
    return 1;
}

int dlfs_meta_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct dlfs_inode n;
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
                        fuse_ino_t ino, const struct dlfs_inode *n, off_t next)
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
    struct dlfs_inode d, n;
    if (!active)
        return 0;
    answered++;
    if (dlfs_ix_inode(&ix, ino, &d) < 0 || !dlfs_ix_dir_ok(&ix, &d) || !S_ISDIR(d.mode)) {
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
            if (dlfs_ix_inode(&ix, target, &n) < 0)
                goto bad;
            want = add_entry(req, buf + used, size - used, (const uint8_t *)"..", pos == 0 ? 1 : 2, target, &n,
                             (off_t)pos + 1);
        } else {
            const uint8_t *name;
            uint32_t len, child;
            if (dlfs_ix_dirent(&ix, d.ref + pos - 2, &name, &len, &child) < 0 || dlfs_ix_inode(&ix, child, &n) < 0)
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
