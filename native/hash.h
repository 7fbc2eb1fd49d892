#ifndef DLFS_HASH_H
#define DLFS_HASH_H
/* xxh3-64, the checksum of every record and block (dlfs/format/chunk.py), at the widest vector unit the
 * CPU has: libxxhash's XXH3_64bits is built for SSE2 (18 GB/s here), its x86 dispatcher picks AVX2 or
 * AVX-512 at run time (45 GB/s). The dispatcher is a weak reference: a libxxhash built without it
 * (or another architecture) leaves the plain function. */
#include <stddef.h>
#include <stdint.h>
#include <xxhash.h>

XXH64_hash_t XXH3_64bits_dispatch(const void *input, size_t len) __attribute__((weak));

static inline uint64_t dlfs_xxh3(const void *p, size_t len)
{
    return XXH3_64bits_dispatch ? XXH3_64bits_dispatch(p, len) : XXH3_64bits(p, len);
}

#endif
