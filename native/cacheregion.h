#ifndef DLFS_CACHEREGION_H
#define DLFS_CACHEREGION_H
/* What both halves of the shared chunk cache hold from Python (the mount's CacheOwner, cacheowner.c; a
 * dlfs.direct client's CacheView, direct.c): the buffers of the control region and the arena, seen
 * through shm.h's layout, and the accessors that mean the same on either side. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "shm.h"

struct dlfs_region {
    Py_buffer ctl, arena;
    int held_ctl, held_arena;
    struct dlfs_shm shm;
};

/* Each half's object starts so: the shared getters and row_pins take either through it. */
typedef struct {
    PyObject_HEAD
    struct dlfs_region r;
} DlfsRegionObject;

/* Hold `ctl` (writable for the mount) and `arena` in `r`: 0, or -1 with an exception. */
int dlfs_region_hold(struct dlfs_region *r, PyObject *ctl, PyObject *arena, int writable);
/* Lay out (the mount) or attach to (a client) the held region: 0, or -1 with a ValueError. */
int dlfs_region_create(struct dlfs_region *r, uint64_t slab_size, uint64_t nslabs, uint64_t n_extents,
                       uint64_t n_rows);
int dlfs_region_attach(struct dlfs_region *r);
void dlfs_region_release(struct dlfs_region *r);

/* 0 if `v` is below `limit`; else -1 with an IndexError naming `what`. */
int dlfs_in_range(unsigned long long v, uint64_t limit, const char *what);
/* A method's single argument as an index below `limit`: 0 with *out set, or -1 with an exception. */
int dlfs_index_arg(PyObject *arg, uint64_t limit, const char *what, unsigned long long *out);

PyObject *dlfs_region_slab_size(PyObject *self, void *unused);
PyObject *dlfs_region_nslabs(PyObject *self, void *unused);
PyObject *dlfs_region_n_extents(PyObject *self, void *unused);
PyObject *dlfs_region_n_rows(PyObject *self, void *unused);
PyObject *dlfs_region_row_pins(PyObject *self, PyObject *arg);

/* The entries both halves' tables start with. */
#define DLFS_REGION_GETSET                                                                   \
    {"slab_size", dlfs_region_slab_size, NULL, "bytes per slab", NULL},                      \
    {"nslabs", dlfs_region_nslabs, NULL, "slabs in the arena", NULL},                        \
    {"n_extents", dlfs_region_n_extents, NULL, "extents of the index", NULL},                \
    {"n_rows", dlfs_region_n_rows, NULL, "rows of the pin table (the mount's own and its clients')", NULL}
#define DLFS_REGION_METHODS \
    {"row_pins", dlfs_region_row_pins, METH_O, "row_pins(row) -> pins that row holds."}
#endif
