#ifndef DLFS_FUSEHOOK_H
#define DLFS_FUSEHOOK_H
/* 1 once pyfuse3 created its session through the hook (READ then carries the inode as fh). */
int dlfs_fuse_hooked(void);
/* Called (with the GIL held, from pyfuse3.close) once the engine has let go of the session. */
void dlfs_fuse_on_release(void (*fn)(void));
/* (module.c) Stop the engine, and release it if `release`, with the GIL let go while its threads are joined
 * (pyfuse3 calls the session functions holding it); threads abandoned at the deadline are logged once.
 * dlfs_engine_release's result: 0, or the number of abandoned threads (then nothing may be let go). */
int dlfs_engine_halt(int release);
#endif
