#ifndef DLFS_HUGEBUF_H
#define DLFS_HUGEBUF_H
/* Buffers that O_DIRECT reads land in, on 2 MiB pages where the kernel gives them (transparent huge pages
 * asked for with MADV_HUGEPAGE; 4 KiB pages where it does not). A read into 4 KiB pages scattered in
 * memory is a disk request of one segment per page, into one huge page a request of one segment: 112 KiB
 * O_DIRECT reads of chunk files here took 108-121 us into 4 KiB pages, 82-88 us into a huge page
 * (median of 1,800 at random offsets). The cache's slabs have their own arena (hugearena.c). */
#include <stddef.h>

#define DLFS_HUGE_PAGE ((size_t)2 << 20)

/* `size` bytes (rounded up to whole huge pages), 2 MiB-aligned, anonymous and untouched; NULL if they
 * cannot be mapped. */
void *dlfs_hugebuf_map(size_t size);
/* Let go of what dlfs_hugebuf_map(size) gave (NULL: nothing). */
void dlfs_hugebuf_unmap(void *p, size_t size);

#endif
