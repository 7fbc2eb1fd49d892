#ifndef DLFS_INDEXVIEW_H
#define DLFS_INDEXVIEW_H
/* Reading dlfs/format/index.py's format in place: the one C copy of its record layouts, used by
 * the FUSE metadata server (metaserve.c) and by dlfs.direct's path resolution (direct.c). Every
 * offset read from the file is bounds-checked: the checksum proves integrity, not sanity. */
#include <stddef.h>
#include <stdint.h>

#define DLFS_CHUNK_SIZE 32 /* chunk id (16 B) first */
#define DLFS_CHUNK_ID 16
#define DLFS_INODE_SIZE 48
#define DLFS_DIRENT_SIZE 16
#define DLFS_EXTENT_SIZE 32
#define DLFS_RECORD_LZ4 1u
#define DLFS_RECORD_BLOCK_SUMS 2u /* an xxh3-64 per 4 KiB block of the record follows it in the chunk */
#define DLFS_BLOCK_SIZE 4096

struct dlfs_ix {
    const uint8_t *inodes, *dirents, *names, *extents, *chunks;
    uint64_t n_inodes, n_dirents, names_size, n_extents, n_chunks;
};

struct dlfs_inode {
    uint32_t mode, uid, gid, nlink;
    int64_t size, mtime_ns;
    uint64_t ref;
    uint32_t count, parent;
};

struct dlfs_extent {
    uint32_t chunk, offset, stored_len, raw_len;
    uint64_t checksum;
    uint32_t flags;
};

/* Set `ix` from a mapping of `len` bytes and the sections' offsets and counts; -1 if any section
 * lies outside the mapping. */
int dlfs_ix_init(struct dlfs_ix *ix, const uint8_t *base, uint64_t len, uint64_t inodes, uint64_t dirents,
                 uint64_t names, uint64_t extents, uint64_t n_inodes, uint64_t n_dirents, uint64_t names_size,
                 uint64_t n_extents, uint64_t chunks, uint64_t n_chunks);
/* 0, or -1 if `ino` is out of range. */
int dlfs_ix_inode(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *out);
/* 1 if a directory's entries lie within the dirents section. */
int dlfs_ix_dir_ok(const struct dlfs_ix *ix, const struct dlfs_inode *dir);
/* Dirent i's name and inode; -1 if its name runs outside the names section. */
int dlfs_ix_dirent(const struct dlfs_ix *ix, uint64_t i, const uint8_t **name, uint32_t *len, uint32_t *ino);
/* Find `name` in directory `dir` (binary search): 1 found (*ino set), 0 absent, -1 corrupt. */
int dlfs_ix_find(const struct dlfs_ix *ix, const struct dlfs_inode *dir, const char *name, size_t len,
                 uint32_t *ino);
/* 0, or -1 if extent i is out of range. */
int dlfs_ix_extent(const struct dlfs_ix *ix, uint64_t i, struct dlfs_extent *out);
/* Chunk i's id (DLFS_CHUNK_ID bytes), or NULL if i is out of range. */
const uint8_t *dlfs_ix_chunk_id(const struct dlfs_ix *ix, uint64_t i);
#endif
