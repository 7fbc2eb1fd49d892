/* dlfs._native: the C helper of dlfs. Loaded with RTLD_GLOBAL before pyfuse3 (see dlfs/native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fusehook.h"
#include "metaserve.h"
#include "module.h"

static PyObject *fuse_hooked(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlfs_fuse_hooked());
}

int dlfs_index_from_sections(PyObject *sections, Py_buffer *view, struct dlfs_ix *ix)
{
    PyObject *map;
    unsigned long long inodes, dirents, names, extents, n_inodes, n_dirents, names_size, n_extents;
    if (!PyArg_ParseTuple(sections, "OKKKKKKKK;sections must be dlfs.format.index.Sections", &map, &inodes,
                          &dirents, &names, &extents, &n_inodes, &n_dirents, &names_size, &n_extents))
        return -1;
    if (PyObject_GetBuffer(map, view, PyBUF_SIMPLE) < 0)
        return -1;
    /* Every section must lie inside the mapping, whatever the caller passed. */
    if (dlfs_ix_init(ix, view->buf, (uint64_t)view->len, inodes, dirents, names, extents, n_inodes, n_dirents,
                     names_size, n_extents) < 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "index sections lie outside the mapping");
        return -1;
    }
    return 0;
}

static Py_buffer index_view; /* held while registered: the mmap cannot be closed under C */
static int index_held;

static PyObject *serve_index(PyObject *self, PyObject *args)
{
    PyObject *sections;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!d", &PyTuple_Type, &sections, &timeout))
        return NULL;
    Py_buffer view;
    struct dlfs_ix ix;
    if (dlfs_index_from_sections(sections, &view, &ix) < 0)
        return NULL;
    dlfs_meta_unregister();
    if (index_held)
        PyBuffer_Release(&index_view);
    index_view = view;
    index_held = 1;
    dlfs_meta_register(&ix, timeout);
    Py_RETURN_NONE;
}

static PyObject *stop_index(PyObject *self, PyObject *unused)
{
    dlfs_meta_unregister();
    if (index_held) {
        PyBuffer_Release(&index_view);
        index_held = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *meta_stats(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:K,s:K}", "answered", dlfs_meta_answered(), "corrupt", dlfs_meta_corrupt());
}

static PyMethodDef methods[] = {
    {"serve_index", serve_index, METH_VARARGS,
     "serve_index(sections, timeout): "
     "answer LOOKUP, GETATTR, OPENDIR and READDIRPLUS from this index in C."},
    {"stop_index", stop_index, METH_NOARGS, "Stop answering from the index and release the mapping."},
    {"meta_stats", meta_stats, METH_NOARGS, "Metadata requests answered in C, and those answered EIO as corrupt."},
    {"fuse_hooked", fuse_hooked, METH_NOARGS,
     "True once pyfuse3's session was created through the hook, so READ carries the inode as fh."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlfs._native", "The C helper of dlfs.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && dlfs_direct_add_types(m) < 0)
        Py_CLEAR(m);
    return m;
}
