/* dlfs._native: the C helper of dlfs. Loaded with RTLD_GLOBAL before pyfuse3 (see dlfs/native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fusehook.h"
#include "metaserve.h"

static PyObject *fuse_hooked(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlfs_fuse_hooked());
}

static Py_buffer index_view; /* held while registered: the mmap cannot be closed under C */
static int index_held;

static PyObject *serve_index(PyObject *self, PyObject *args)
{
    PyObject *map;
    unsigned long long inodes, dirents, names, n_inodes, n_dirents, names_size;
    double timeout;
    if (!PyArg_ParseTuple(args, "OKKKKKKd", &map, &inodes, &dirents, &names, &n_inodes, &n_dirents, &names_size,
                          &timeout))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(map, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    unsigned long long len = (unsigned long long)view.len;
    /* Every section must lie inside the mapping, whatever the caller passed. */
    if (inodes > len || n_inodes > (len - inodes) / 48 || dirents > len || n_dirents > (len - dirents) / 16 ||
        names > len || names_size > len - names) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "index sections lie outside the mapping");
        return NULL;
    }
    dlfs_meta_unregister();
    if (index_held)
        PyBuffer_Release(&index_view);
    index_view = view;
    index_held = 1;
    const char *base = view.buf;
    dlfs_meta_register(base + inodes, base + dirents, base + names, n_inodes, n_dirents, names_size, timeout);
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
     "serve_index(mmap, inodes_off, dirents_off, names_off, n_inodes, n_dirents, names_size, timeout): "
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
    return PyModule_Create(&module);
}
