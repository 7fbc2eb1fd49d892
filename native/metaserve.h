#ifndef DLFS_METASERVE_H
#define DLFS_METASERVE_H
#define FUSE_USE_VERSION 31
#include <fuse_lowlevel.h>
#include <stdint.h>

#include "indexview.h"

/* Serve metadata from an mmap'd index (pointers to its sections) until unregistered. */
void dlfs_meta_register(const struct dlfs_ix *index, double timeout);
void dlfs_meta_unregister(void);
unsigned long long dlfs_meta_corrupt(void);
unsigned long long dlfs_meta_answered(void);

/* Each answers the request and returns 1, or returns 0 for the Python handler to answer it. */
int dlfs_meta_lookup(fuse_req_t req, fuse_ino_t parent, const char *name);
int dlfs_meta_getattr(fuse_req_t req, fuse_ino_t ino);
int dlfs_meta_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
int dlfs_meta_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off);
#endif
