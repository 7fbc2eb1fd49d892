#ifndef DLFS_INDEXVIEW_H
#define DLFS_INDEXVIEW_H
/* Reading dlfs/format/index.py's format in place: the one C copy of its layout and the one C name
 * lookup, used by the serving engine (answer.c), dlfs.direct's path resolution (direct.c) and
 * Index.lookup (indexobj.c). The structs restate index.py's LAYOUT field by field, in file order;
 * tests/test_index_layout.py parses this file and holds the two together. Every offset read from the
 * file is bounds-checked: the checksum proves integrity, not sanity. */
#include <stddef.h>
#include <stdint.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the index is little-endian and read in place"
#endif

#define DLFS_INDEX_MAGIC "DLFSINDX"
#define DLFS_INDEX_VERSION 1
#define DLFS_NAME_MAX 255 /* bytes of one name: ingest writes none longer, lookup refuses longer */
#define DLFS_CHUNK_ID 16
#define DLFS_RECORD_LZ4 1u
#define DLFS_RECORD_BLOCK_SUMS 2u /* an xxh3-64 per 4 KiB block of the record follows it in the chunk */
#define DLFS_BLOCK_SIZE 4096

/* The records as they lie in the file: every field at its natural alignment, so no padding (the
 * compiled sizes are held against Python's too: dlfs._native.INDEX_LAYOUT). */
struct dlfs_index_header {
    uint8_t magic[8];
    uint32_t version, flags;
    uint64_t n_chunks, n_inodes, n_dirents, n_extents, names_size, files, bytes, chunk_size;
    int64_t created_ns;
    uint64_t body_sum, head_sum;
};

struct dlfs_chunk {
    uint8_t id[DLFS_CHUNK_ID];
    uint64_t size;
    uint32_t first_extent, n_extents;
};

struct dlfs_inode {
    uint32_t mode, uid, gid, nlink;
    int64_t size, mtime_ns;
    uint64_t ref;
    uint32_t count, parent;
};

struct dlfs_dirent {
    uint64_t name_off;
    uint32_t name_len, ino;
};

struct dlfs_extent {
    uint32_t chunk, offset, stored_len, raw_len;
    uint64_t checksum;
    uint32_t flags, spare;
};

struct dlfs_ix {
    const uint8_t *inodes, *dirents, *names, *extents, *chunks;
    uint64_t n_inodes, n_dirents, names_size, n_extents, n_chunks;
    uint64_t bytes; /* the header's: all files' bytes (statfs) */
};

/* Set `ix` from a mapping of `len` bytes and the sections' offsets and counts; -1 if the mapping does
 * not start with a header of this version whose counts are these, or any section lies outside it. */
int dlfs_ix_init(struct dlfs_ix *ix, const uint8_t *base, uint64_t len, uint64_t inodes, uint64_t dirents,
                 uint64_t names, uint64_t extents, uint64_t n_inodes, uint64_t n_dirents, uint64_t names_size,
                 uint64_t n_extents, uint64_t chunks, uint64_t n_chunks);
/* Every function checks its own arguments: a NULL pointer or an index, inode or offset outside the mapped
 * index is an error return (-1, NULL, 0 or -errno as said), never a read outside the mapping. */
/* 0, or -1 if `ino` is out of range. */
int dlfs_ix_inode(const struct dlfs_ix *ix, uint64_t ino, struct dlfs_inode *out);
/* 1 if a directory's entries lie within the dirents section (0 if not, or an argument is NULL). */
int dlfs_ix_dir_ok(const struct dlfs_ix *ix, const struct dlfs_inode *dir);
/* Dirent i's name and inode; -1 if i is out of range or its name runs outside the names section. */
int dlfs_ix_dirent(const struct dlfs_ix *ix, uint64_t i, const uint8_t **name, uint32_t *len, uint32_t *ino);
/* `name` (`len` bytes) in directory `dir`, by binary search: its inode (> 0), or -ENOENT (absent),
 * -ENOTDIR (`dir` is not a directory), -ENAMETOOLONG (over DLFS_NAME_MAX), -EIO (corrupt there, or `dir` out
 * of range), -EINVAL (no `ix`, or no `name` for len > 0).
 * dlfs/format/index.py's lookup_in is the same function in Python. */
int64_t dlfs_ix_lookup(const struct dlfs_ix *ix, uint64_t dir, const char *name, size_t len);
/* 0, or -1 if extent i is out of range. */
int dlfs_ix_extent(const struct dlfs_ix *ix, uint64_t i, struct dlfs_extent *out);
/* Chunk i's id (DLFS_CHUNK_ID bytes), or NULL if i is out of range. */
const uint8_t *dlfs_ix_chunk_id(const struct dlfs_ix *ix, uint64_t i);
#endif
