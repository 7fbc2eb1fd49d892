#ifndef DLFS_FUSEHOOK_H
#define DLFS_FUSEHOOK_H
/* 1 once pyfuse3 created its session through the hook (READ then carries the inode as fh). */
int dlfs_fuse_hooked(void);
/* Called (with the GIL held, from pyfuse3.close) once the engine has let go of the session. */
void dlfs_fuse_on_release(void (*fn)(void));
#endif
