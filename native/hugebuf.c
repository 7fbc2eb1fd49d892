/* Buffers on transparent huge pages: see hugebuf.h. */
#define _GNU_SOURCE
#include "hugebuf.h"

#include <stdint.h>
#include <sys/mman.h>

static size_t whole_pages(size_t size)
{
    return (size + DLFS_HUGE_PAGE - 1) & ~(DLFS_HUGE_PAGE - 1);
}

void *dlfs_hugebuf_map(size_t size)
{
    size_t want = whole_pages(size);
    if (!want)
        return NULL;
    /* Mapped one huge page over and trimmed to an aligned start: only an aligned 2 MiB range of a
     * mapping can be one huge page. */
    char *m = mmap(NULL, want + DLFS_HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    char *p = (char *)(((uintptr_t)m + DLFS_HUGE_PAGE - 1) & ~(uintptr_t)(DLFS_HUGE_PAGE - 1));
    if (p > m)
        munmap(m, (size_t)(p - m));
    size_t tail = (size_t)(m + want + DLFS_HUGE_PAGE - (p + want));
    if (tail)
        munmap(p + want, tail);
    madvise(p, want, MADV_HUGEPAGE); /* a kernel without THP leaves 4 KiB pages: slower, not wrong */
    return p;
}

void dlfs_hugebuf_unmap(void *p, size_t size)
{
    if (p)
        munmap(p, whole_pages(size));
}
