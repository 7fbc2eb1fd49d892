#ifndef DLFS_FUSEHOOK_H
#define DLFS_FUSEHOOK_H
/* 1 once pyfuse3 created its session through the hook (READ then carries the inode as fh). */
int dlfs_fuse_hooked(void);
#endif
