/* The cache arena on 2 MiB pages: an unnamed file of a private tmpfs mounted with huge=always.
 *
 * Why: O_DIRECT reads of chunk windows into 4 KiB pages scattered in memory become requests of up to
 * 254 segments (1016 KiB), and a virtio disk without indirect descriptors takes one such request at
 * a time; into 2 MiB pages a 4 MiB window is one request of a few segments (1.7-2.2 GB/s -> 3.1-3.7
 * GB/s measured here), and copies out of the slabs take fewer TLB misses. A memfd gets huge pages only
 * where the admin let shared memory have them (transparent_hugepage/shmem_enabled: "never" by default);
 * a tmpfs mount's own huge= option holds whatever that says (short of "deny").
 *
 * How: a short-lived thread unshares its mount namespace (CLONE_NEWNS unshares the thread's fs state
 * alone, which a process with threads may do), makes every mount in it private so nothing propagates
 * back, mounts the tmpfs over `dir` there, and opens an O_TMPFILE in it. The thread's exit takes the
 * namespace and its mount with it; the open file keeps the tmpfs alive until its last descriptor and
 * mapping are gone. No other process ever sees the mount, and nothing is left behind on any exit. The
 * descriptor table is the process's, so the file is simply there for the caller. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>
#include <unistd.h>

#include "module.h"

#define HUGE_PAGE (2ULL << 20)

struct arena_job {
    const char *dir;
    char options[128];
    int fd;   /* the file, or -1 */
    int err;  /* errno of the step that failed */
    const char *step;
};

static void *make_arena(void *arg)
{
    struct arena_job *job = arg;
    job->fd = -1;
    if (unshare(CLONE_NEWNS) < 0) {
        job->step = "unshare(CLONE_NEWNS)";
    } else if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
        job->step = "making the thread's mounts private";
    } else if (mount("dlfs-cache", job->dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, job->options) < 0) {
        job->step = "mounting a tmpfs with huge=always";
    } else if ((job->fd = open(job->dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600)) < 0) {
        job->step = "opening an unnamed file in it";
    } else {
        return NULL;
    }
    job->err = errno;
    return NULL;
}

/* huge_arena(dir, size) -> fd: see the top of this file. OSError (naming the step) where this process
 * may not mount (not root) or the kernel has no huge pages for tmpfs; the caller then uses a memfd. */
static PyObject *huge_arena(PyObject *self, PyObject *args)
{
    const char *dir;
    unsigned long long size;
    if (!PyArg_ParseTuple(args, "sK", &dir, &size))
        return NULL;
    if (size == 0 || size > (1ULL << 46)) {
        PyErr_SetString(PyExc_ValueError, "huge_arena: size out of range");
        return NULL;
    }
    struct arena_job job = {.dir = dir, .fd = -1, .err = 0, .step = NULL};
    /* The file system's bound is the arena, rounded up to whole huge pages: nothing else lives in it. */
    unsigned long long bound = (size + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    snprintf(job.options, sizeof job.options, "huge=always,mode=0700,nr_inodes=4,size=%llu", bound);
    pthread_t t;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_create(&t, NULL, make_arena, &job);
    if (rc == 0)
        pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (job.fd < 0) {
        return PyErr_Format(PyExc_OSError, "no huge-page cache arena: %s: %s", job.step, strerror(job.err));
    }
    if (ftruncate(job.fd, (off_t)size) < 0) {
        int err = errno;
        close(job.fd);
        return PyErr_Format(PyExc_OSError, "no huge-page cache arena: sizing it: %s", strerror(err));
    }
    return PyLong_FromLong(job.fd);
}

static PyMethodDef functions[] = {
    {"huge_arena", huge_arena, METH_VARARGS,
     "huge_arena(dir, size) -> fd: an unnamed file of `size` bytes on 2 MiB pages (a tmpfs mounted over `dir` "
     "in a private mount namespace that is gone when this returns); OSError where that cannot be done."},
    {NULL},
};

int dlfs_arena_add_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, functions);
}
