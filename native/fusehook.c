/* The FUSE session hook: lets the mount answer OPEN with ENOSYS (no_open) and still know the file,
 * and answers metadata requests in C (metaserve.c) once the mount registers its index.
 *
 * With no_open the kernel sends neither OPEN nor RELEASE and keeps every file's pages cached, so a
 * warm read costs no request at all. It then sends READ with fh 0; libfuse passes the inode beside
 * it, but pyfuse3 hands read() only fh. dlfs's handles are inode numbers (never 0), so a wrapper
 * around libfuse's read callback puts the inode in fh before pyfuse3 sees the request.
 *
 * The wrapper is installed by interposing fuse_session_new: this module is loaded with RTLD_GLOBAL
 * before pyfuse3, so pyfuse3's call binds here; we copy its operations table, swap the read entry
 * and call libfuse's own fuse_session_new with the copy (libfuse copies it again). */
#define _GNU_SOURCE /* dlvsym, RTLD_NEXT */
#define FUSE_USE_VERSION 31
#include <fuse_lowlevel.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "fusehook.h"
#include "metaserve.h"

typedef struct fuse_session *(*session_new_fn)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t,
                                               void *);

static struct fuse_lowlevel_ops py; /* pyfuse3's own handlers, for what C does not answer */
static int hooked;

static void read_with_inode(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    if (fi && fi->fh == 0)
        fi->fh = ino;
    py.read(req, ino, size, off, fi);
}

static void lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    if (!dlfs_meta_lookup(req, parent, name))
        py.lookup(req, parent, name);
}

static void getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (!dlfs_meta_getattr(req, ino))
        py.getattr(req, ino, fi);
}

static void opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (!dlfs_meta_opendir(req, ino, fi))
        py.opendir(req, ino, fi);
}

static void readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    if (!dlfs_meta_readdirplus(req, ino, size, off))
        py.readdirplus(req, ino, size, off, fi);
}

static session_new_fn libfuse_session_new(void)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_LOCAL);
    void *fn = NULL;
    if (lib)
        fn = dlvsym(lib, "fuse_session_new", "FUSE_3.0");
    if (!fn)
        fn = dlsym(RTLD_NEXT, "fuse_session_new");
    return (session_new_fn)fn;
}

__attribute__((visibility("default"))) struct fuse_session *
fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op, size_t op_size, void *userdata)
{
    static struct fuse_lowlevel_ops *ops;  /* libfuse copies it; kept only for the process's life */
    session_new_fn real = libfuse_session_new();
    if (!real)
        return NULL;
    /* A caller built against a newer libfuse may pass a longer table: keep all of it. */
    size_t n = op_size > sizeof *ops ? op_size : sizeof *ops;
    free(ops);
    ops = calloc(1, n);
    if (!ops)
        return real(args, op, op_size, userdata);
    memcpy(ops, op, op_size);
    /* Only a table with every handler we wrap: anything else is left exactly as it came. */
    if (op_size >= sizeof py && ops->read && ops->lookup && ops->getattr && ops->opendir && ops->readdirplus) {
        py = *ops;
        ops->read = read_with_inode;
        ops->lookup = lookup;
        ops->getattr = getattr;
        ops->opendir = opendir;
        ops->readdirplus = readdirplus;
        hooked = 1;
    }
    return real(args, ops, op_size, userdata);
}

int dlfs_fuse_hooked(void)
{
    return hooked;
}
