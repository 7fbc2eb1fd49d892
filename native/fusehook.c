/* The FUSE session hook: how the native engine (engine.c) takes pyfuse3's session over.
 *
 * This module is loaded with RTLD_GLOBAL before pyfuse3 (dlfs/native.py), so pyfuse3's calls of
 * libfuse's session functions bind here first; each calls libfuse's own.
 *
 * - fuse_session_new: READ carries the inode in fh. The mount answers OPEN with ENOSYS (no_open: the
 *   kernel sends neither OPEN nor RELEASE and keeps every file's pages), so READ arrives with fh 0;
 *   libfuse passes the inode beside it but pyfuse3 hands read() only fh, and dlfs's handles are inode
 *   numbers. INIT also asks the kernel to cache symlink targets.
 * - fuse_session_mount: once mounted, the engine takes the device over (libfuse's custom I/O).
 * - fuse_session_unmount / fuse_session_destroy: the engine stops first, so no thread of it outlives
 *   the session or touches the device after it is closed. */
#define _GNU_SOURCE /* dlvsym */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "fusehook.h"

static struct fuse_lowlevel_ops py; /* pyfuse3's own handlers, for what C does not answer */
static struct fuse_session *hooked_session;
static void (*on_release)(void);

static void *libfuse(const char *name)
{
    static void *lib;
    if (!lib)
        lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_LOCAL);
    void *fn = lib ? dlvsym(lib, name, "FUSE_3.0") : NULL;
    return fn ? fn : dlsym(RTLD_NEXT, name);
}

static void read_with_inode(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    if (fi && fi->fh == 0)
        fi->fh = ino;
    py.read(req, ino, size, off, fi);
}

static void init(void *userdata, struct fuse_conn_info *conn)
{
    if (py.init)
        py.init(userdata, conn);
    if (conn->capable & FUSE_CAP_CACHE_SYMLINKS)
        conn->want |= FUSE_CAP_CACHE_SYMLINKS; /* a mounted version never changes */
    dlfs_engine_protocol(conn->proto_major, conn->proto_minor);
}

__attribute__((visibility("default"))) struct fuse_session *
fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op, size_t op_size, void *userdata)
{
    typedef struct fuse_session *(*fn_t)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t, void *);
    static struct fuse_lowlevel_ops *ops; /* libfuse copies it; kept only for the process's life */
    fn_t real = (fn_t)libfuse("fuse_session_new");
    if (!real)
        return NULL;
    /* A caller built against a newer libfuse may pass a longer table: keep all of it. */
    size_t n = op_size > sizeof *ops ? op_size : sizeof *ops;
    free(ops);
    ops = calloc(1, n);
    if (!ops)
        return real(args, op, op_size, userdata);
    memcpy(ops, op, op_size);
    /* Only a table with the handlers we wrap: anything else is left exactly as it came. */
    int ours = op_size >= sizeof py && ops->read && ops->init;
    if (ours) {
        py = *ops;
        ops->read = read_with_inode;
        ops->init = init;
    }
    struct fuse_session *se = real(args, ops, op_size, userdata);
    if (ours)
        hooked_session = se;
    return se;
}

__attribute__((visibility("default"))) int fuse_session_mount(struct fuse_session *se, const char *mountpoint)
{
    int (*real)(struct fuse_session *, const char *) = libfuse("fuse_session_mount");
    if (!real)
        return -1;
    int rc = real(se, mountpoint);
    /* If the engine cannot attach, pyfuse3 keeps the device and serves everything itself. */
    if (rc == 0 && se && se == hooked_session)
        dlfs_engine_attach(se);
    return rc;
}

__attribute__((visibility("default"))) void fuse_session_unmount(struct fuse_session *se)
{
    void (*real)(struct fuse_session *) = libfuse("fuse_session_unmount");
    int ours = dlfs_engine_owns(se);
    if (ours)
        dlfs_engine_close_python(); /* libfuse closes the eventfd pyfuse3 waited on */
    if (real)
        real(se);
    if (ours)
        dlfs_engine_halt(0); /* after the unmount: a busy, lazily detached mount is still served until here */
}

__attribute__((visibility("default"))) void fuse_session_destroy(struct fuse_session *se)
{
    void (*real)(struct fuse_session *) = libfuse("fuse_session_destroy");
    /* What start kept is let go only if no abandoned thread can still read it. */
    if (dlfs_engine_owns(se) && dlfs_engine_halt(1) == 0 && on_release)
        on_release();
    if (se == hooked_session)
        hooked_session = NULL;
    if (real)
        real(se);
}

int dlfs_fuse_hooked(void)
{
    return hooked_session != NULL;
}

void dlfs_fuse_on_release(void (*fn)(void))
{
    on_release = fn;
}
