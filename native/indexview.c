/* The index format read in place (see indexview.h). */
#include <string.h>

#include "indexview.h"

int dlfs_ix_init(struct dlfs_ix *ix, const uint8_t *base, uint64_t len, uint64_t inodes, uint64_t dirents,
                 uint64_t names, uint64_t extents, uint64_t n_inodes, uint64_t n_dirents, uint64_t names_size,
                 uint64_t n_extents, uint64_t chunks, uint64_t n_chunks)
{
    if (inodes > len || n_inodes > (len - inodes) / DLFS_INODE_SIZE || dirents > len ||
        n_dirents > (len - dirents) / DLFS_DIRENT_SIZE || names > len || names_size > len - names ||
        extents > len || n_extents > (len - extents) / DLFS_EXTENT_SIZE || chunks > len ||
        n_chunks > (len - chunks) / DLFS_CHUNK_SIZE)
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
    return 0;
}

int dlfs_ix_inode(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *out)
{
    if (ino < 1 || ino > ix->n_inodes)
        return -1;
    const uint8_t *p = ix->inodes + (ino - 1) * DLFS_INODE_SIZE;
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

int dlfs_ix_dir_ok(const struct dlfs_ix *ix, const struct dlfs_inode *d)
{
    return d->ref <= ix->n_dirents && d->count <= ix->n_dirents - d->ref;
}

int dlfs_ix_dirent(const struct dlfs_ix *ix, uint64_t i, const uint8_t **name, uint32_t *len, uint32_t *ino)
{
    const uint8_t *p = ix->dirents + i * DLFS_DIRENT_SIZE;
    uint64_t off;
    memcpy(&off, p, 8);
    memcpy(len, p + 8, 4);
    memcpy(ino, p + 12, 4);
    if (off > ix->names_size || *len > ix->names_size - off)
        return -1;
    *name = ix->names + off;
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

int dlfs_ix_find(const struct dlfs_ix *ix, const struct dlfs_inode *dir, const char *name, size_t len,
                 uint32_t *ino)
{
    uint64_t lo = dir->ref, hi = dir->ref + dir->count;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const uint8_t *probe;
        uint32_t plen;
        if (dlfs_ix_dirent(ix, mid, &probe, &plen, ino) < 0)
            return -1;
        int c = name_cmp(probe, plen, name, len);
        if (c == 0)
            return 1;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

int dlfs_ix_extent(const struct dlfs_ix *ix, uint64_t i, struct dlfs_extent *out)
{
    if (i >= ix->n_extents)
        return -1;
    const uint8_t *p = ix->extents + i * DLFS_EXTENT_SIZE;
    memcpy(&out->chunk, p, 4);
    memcpy(&out->offset, p + 4, 4);
    memcpy(&out->stored_len, p + 8, 4);
    memcpy(&out->raw_len, p + 12, 4);
    memcpy(&out->checksum, p + 16, 8);
    memcpy(&out->flags, p + 24, 4);
    return 0;
}

const uint8_t *dlfs_ix_chunk_id(const struct dlfs_ix *ix, uint64_t i)
{
    return i < ix->n_chunks ? ix->chunks + i * DLFS_CHUNK_SIZE : NULL;
}
