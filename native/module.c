/* dlfs._native: the C helper of dlfs. Loaded with RTLD_GLOBAL before pyfuse3 (see dlfs/native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fusehook.h"

static PyObject *fuse_hooked(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlfs_fuse_hooked());
}

static PyMethodDef methods[] = {
    {"fuse_hooked", fuse_hooked, METH_NOARGS,
     "True once pyfuse3's session was created through the hook, so READ carries the inode as fh."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlfs._native", "The C helper of dlfs.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
