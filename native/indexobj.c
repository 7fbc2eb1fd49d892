/* dlfs._native.IndexView: the C lookup (indexview.c) for Python's Index.lookup, over the index's own
 * mapping, so that the FUSE handlers, dlfs.direct and the serving engine answer every name alike. */
#include "module.h"

typedef struct {
    PyObject_HEAD
    Py_buffer map;
    int held;
    struct dlfs_ix ix;
} IndexView;

static void view_release(IndexView *v)
{
    if (v->held)
        PyBuffer_Release(&v->map);
    v->held = 0;
}

static void view_dealloc(IndexView *v)
{
    view_release(v);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

static int view_init(IndexView *v, PyObject *args, PyObject *kw)
{
    static char *names[] = {"sections", NULL};
    PyObject *sections;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!", names, &PyTuple_Type, &sections))
        return -1;
    view_release(v);
    if (dlfs_index_from_sections(sections, &v->map, &v->ix) < 0)
        return -1;
    v->held = 1;
    return 0;
}

static PyObject *view_lookup(IndexView *v, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long dir;
    char *name;
    Py_ssize_t len;
    if (nargs != 2 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "lookup(dir_ino: int, name: bytes)");
        return NULL;
    }
    dir = PyLong_AsUnsignedLongLong(args[0]);
    if (dir == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!v->held) {
        PyErr_SetString(PyExc_ValueError, "lookup on a closed IndexView");
        return NULL;
    }
    PyBytes_AsStringAndSize(args[1], &name, &len);
    return PyLong_FromLongLong(dlfs_ix_lookup(&v->ix, dir, name, (size_t)len));
}

static PyObject *view_dirent(IndexView *v, PyObject *arg)
{
    unsigned long long i = PyLong_AsUnsignedLongLong(arg);
    if (i == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!v->held) {
        PyErr_SetString(PyExc_ValueError, "dirent on a closed IndexView");
        return NULL;
    }
    const uint8_t *name;
    uint32_t len, ino;
    if (dlfs_ix_dirent(&v->ix, i, &name, &len, &ino) < 0) {
        PyErr_Format(PyExc_IndexError, "dirent %llu is outside the index, or its name is", i);
        return NULL;
    }
    return Py_BuildValue("(y#I)", (const char *)name, (Py_ssize_t)len, ino);
}

static PyObject *view_close(IndexView *v, PyObject *unused)
{
    view_release(v);
    Py_RETURN_NONE;
}

static PyMethodDef view_methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))view_lookup, METH_FASTCALL,
     "lookup(dir_ino, name) -> the inode (> 0) or -errno: ENOENT, ENOTDIR, ENAMETOOLONG, EIO (corrupt)."},
    {"dirent", (PyCFunction)view_dirent, METH_O,
     "dirent(i) -> (name, ino): entry i of the dirents section as C reads it; IndexError if i or its name lies "
     "outside the index."},
    {"close", (PyCFunction)view_close, METH_NOARGS, "Let go of the mapping (it can then be closed)."},
    {NULL},
};

static PyTypeObject IndexViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dlfs._native.IndexView",
    .tp_basicsize = sizeof(IndexView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "IndexView(sections): an index's mapping read in place by C (dlfs.format.index.Sections).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)view_init,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_methods = view_methods,
};

int dlfs_index_add_types(PyObject *module)
{
    if (PyType_Ready(&IndexViewType) < 0)
        return -1;
    Py_INCREF(&IndexViewType);
    if (PyModule_AddObject(module, "IndexView", (PyObject *)&IndexViewType) < 0) {
        Py_DECREF(&IndexViewType);
        return -1;
    }
    return 0;
}
