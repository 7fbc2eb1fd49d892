#ifndef DLFS_MODULE_H
#define DLFS_MODULE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "indexview.h"
#include "shm.h"

/* An index view from a dlfs.format.index.Sections tuple: holds a buffer of its mapping in `view`
 * (release it when done); -1 with a Python exception set if the tuple is bad or lies outside it. */
int dlfs_index_from_sections(PyObject *sections, Py_buffer *view, struct dlfs_ix *ix);

/* IndexView (indexobj.c), added to the module; -1 on failure. */
int dlfs_index_add_types(PyObject *module);

/* A dlfs.direct client's half of the shared cache, CacheView and Pin (direct.c), added to the module;
 * -1 on failure. */
int dlfs_direct_add_types(PyObject *module);

/* The mount's half, CacheOwner (cacheowner.c), and shared_size and populate, added to the module; -1 on
 * failure. */
int dlfs_owner_add_types(PyObject *module);

/* huge_arena (hugearena.c), added to the module; -1 on failure. */
int dlfs_arena_add_functions(PyObject *module);

/* The mount's CacheOwner `obj` for the serving engine, which pins through `row`: its layout and its
 * consumption counters; -1 with a Python exception if `obj` is not a CacheOwner. */
int dlfs_shared_cache_of(PyObject *obj, uint64_t row, struct dlfs_shm **shm, struct dlfs_consume **consume);
#endif
