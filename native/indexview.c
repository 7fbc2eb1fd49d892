/* The index format read in place (see indexview.h). */
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "indexview.h"

int dlfs_ix_init(struct dlfs_ix *ix, const uint8_t *base, uint64_t len, uint64_t inodes, uint64_t dirents,
                 uint64_t names, uint64_t extents, uint64_t n_inodes, uint64_t n_dirents, uint64_t names_size,
                 uint64_t n_extents, uint64_t chunks, uint64_t n_chunks)
{
    struct dlfs_index_header h;
    if (!ix || !base || len < sizeof h)
        return -1;
    memcpy(&h, base, sizeof h);
    /* A layout this build does not know (a stale helper beside newer Python) is refused, not misread. */
    if (memcmp(h.magic, DLFS_INDEX_MAGIC, sizeof h.magic) || h.version != DLFS_INDEX_VERSION ||
        h.n_chunks != n_chunks || h.n_inodes != n_inodes || h.n_dirents != n_dirents || h.n_extents != n_extents ||
        h.names_size != names_size)
        return -1;
    if (inodes > len || n_inodes > (len - inodes) / sizeof(struct dlfs_inode) || dirents > len ||
        n_dirents > (len - dirents) / sizeof(struct dlfs_dirent) || names > len || names_size > len - names ||
        extents > len || n_extents > (len - extents) / sizeof(struct dlfs_extent) || chunks > len ||
        n_chunks > (len - chunks) / sizeof(struct dlfs_chunk))
        return -1;
    ix->chunks = base + chunks;
    ix->n_chunks = n_chunks;
    ix->inodes = base + inodes;
    ix->dirents = base + dirents;
    ix->names = base + names;
    ix->extents = base + extents;
    ix->n_inodes = n_inodes;
    ix->n_dirents = n_dirents;
    ix->names_size = names_size;
    ix->n_extents = n_extents;
    ix->bytes = h.bytes;
    return 0;
}

int dlfs_ix_inode(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *out)
{
    if (!ix || !out || ino < 1 || ino > ix->n_inodes)
        return -1;
    memcpy(out, ix->inodes + (ino - 1) * sizeof *out, sizeof *out);
    return 0;
}

int dlfs_ix_dir_ok(const struct dlfs_ix *ix, const struct dlfs_inode *d)
{
    return ix && d && d->ref <= ix->n_dirents && d->count <= ix->n_dirents - d->ref;
}

int dlfs_ix_dirent(const struct dlfs_ix *ix, uint64_t i, const uint8_t **name, uint32_t *len, uint32_t *ino)
{
    struct dlfs_dirent d;
    if (!ix || !name || !len || !ino || i >= ix->n_dirents)
        return -1;
    memcpy(&d, ix->dirents + i * sizeof d, sizeof d);
    if (d.name_off > ix->names_size || d.name_len > ix->names_size - d.name_off)
        return -1;
    *name = ix->names + d.name_off;
    *len = d.name_len;
    *ino = d.ino;
    return 0;
}

/* Python's bytes order: unsigned bytes, then length (the order the index is sorted in). */
static int name_cmp(const uint8_t *a, size_t alen, const char *b, size_t blen)
{
    int c = memcmp(a, b, alen < blen ? alen : blen);
    if (c)
        return c;
    return alen < blen ? -1 : alen > blen;
}

int64_t dlfs_ix_lookup(const struct dlfs_ix *ix, uint64_t dir, const char *name, size_t len)
{
    struct dlfs_inode d;
    if (!ix || (!name && len))
        return -EINVAL;
    if (dlfs_ix_inode(ix, dir, &d) < 0)
        return -EIO;
    if (!S_ISDIR(d.mode))
        return -ENOTDIR;
    /* Refused, never cut to a prefix: a name that long is in no index (ingest refuses it). */
    if (len > DLFS_NAME_MAX)
        return -ENAMETOOLONG;
    if (!dlfs_ix_dir_ok(ix, &d))
        return -EIO;
    uint64_t lo = d.ref, hi = d.ref + d.count;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const uint8_t *probe;
        uint32_t plen, ino;
        if (dlfs_ix_dirent(ix, mid, &probe, &plen, &ino) < 0)
            return -EIO;
        int c = name_cmp(probe, plen, name, len);
        if (c == 0)
            return ino >= 1 && ino <= ix->n_inodes ? (int64_t)ino : -EIO;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -ENOENT;
}

int dlfs_ix_extent(const struct dlfs_ix *ix, uint64_t i, struct dlfs_extent *out)
{
    if (!ix || !out || i >= ix->n_extents)
        return -1;
    memcpy(out, ix->extents + i * sizeof *out, sizeof *out);
    return 0;
}

const uint8_t *dlfs_ix_chunk_id(const struct dlfs_ix *ix, uint64_t i)
{
    return ix && i < ix->n_chunks ? ix->chunks + i * sizeof(struct dlfs_chunk) + offsetof(struct dlfs_chunk, id) : NULL;
}
