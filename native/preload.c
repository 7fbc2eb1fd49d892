/* `dlfs run`'s LD_PRELOAD library: CPython <= 3.13 calls isatty() after every open(p, "rb"), on a FUSE file
 * a TCGETS round trip to the daemon; a regular file is never a terminal (as CPython 3.14 says, gh-90102). */
#define _GNU_SOURCE /* RTLD_NEXT */
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

typedef int (*isatty_fn)(int);

/* Found on first use: another library's constructor may call isatty before ours could run. */
static _Atomic(isatty_fn) next_isatty;

/* glibc's own test, should no next isatty be found. */
static int isatty_by_tcgetattr(int fd)
{
    struct termios t;
    return tcgetattr(fd, &t) == 0;
}

__attribute__((visibility("default"))) int isatty(int fd)
{
    int saved = errno;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
        errno = ENOTTY; /* as the ioctl would have said */
        return 0;
    }
    errno = saved; /* the next isatty sets its own (EBADF for a closed fd) */
    isatty_fn next = atomic_load_explicit(&next_isatty, memory_order_acquire);
    if (!next) {
        next = (isatty_fn)dlsym(RTLD_NEXT, "isatty");
        if (!next || next == isatty)
            next = isatty_by_tcgetattr;
        atomic_store_explicit(&next_isatty, next, memory_order_release);
    }
    return next(fd);
}
