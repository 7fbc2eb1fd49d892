#ifndef DLFS_MODULE_H
#define DLFS_MODULE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "indexview.h"

/* An index view from a dlfs.format.index.Sections tuple: holds a buffer of its mapping in `view`
 * (release it when done); -1 with a Python exception set if the tuple is bad or lies outside it. */
int dlfs_index_from_sections(PyObject *sections, Py_buffer *view, struct dlfs_ix *ix);

/* The types of dlfs.direct's shared cache (direct.c), added to the module; -1 on failure. */
int dlfs_direct_add_types(PyObject *module);
#endif
