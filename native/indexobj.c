/* dlfs._native.IndexView: the C lookup (indexview.c) for Python's Index.lookup, over the index's own
 * mapping, so that the FUSE handlers, dlfs.direct and the serving engine answer every name alike.
 * And the table of FUSE answers (answer.h) for pyfuse3's handlers (dlfs/mount/ops.py): each function
 * takes an index's Sections and fills pyfuse3's EntryAttributes or StatvfsData from the same C struct
 * the serving threads send, so the two paths cannot answer differently. */
#include "answer.h"
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

/* Half or more of the regular files' bytes are in files of at least this size, a power of two (0: no
 * bytes): what a reader of the dataset mostly reads, which the mean misses where a few small files
 * (a manifest beside big shards) outnumber the big ones. One pass over the inodes, in log2 buckets. */
static PyObject *view_bulk_file_size(IndexView *v, PyObject *unused)
{
    if (!v->held) {
        PyErr_SetString(PyExc_ValueError, "bulk_file_size on a closed IndexView");
        return NULL;
    }
    uint64_t in[64] = {0}, total = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t ino = 1; ino <= v->ix.n_inodes; ino++) {
        struct dlfs_inode n;
        if (dlfs_ix_inode(&v->ix, ino, &n) < 0) {
            bad = 1;
            break;
        }
        if (S_ISREG(n.mode) && n.size > 0) {
            in[63 - __builtin_clzll((uint64_t)n.size)] += (uint64_t)n.size;
            total += (uint64_t)n.size;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "an inode lies outside the index");
        return NULL;
    }
    uint64_t seen = 0;
    for (int b = 63; b >= 0 && total; b--)
        if ((seen += in[b]) * 2 >= total)
            return PyLong_FromUnsignedLongLong(1ULL << b);
    return PyLong_FromLong(0);
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
    {"bulk_file_size", (PyCFunction)view_bulk_file_size, METH_NOARGS,
     "bulk_file_size() -> half or more of the regular files' bytes are in files at least this big (a power "
     "of two; 0: no bytes)."},
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

/* --- the table of FUSE answers, for pyfuse3's handlers ------------------------------------------ */

/* pyfuse3's names of struct fuse_attr's fields and of fuse_kstatfs's, interned once. */
static const char *const attr_keys[] = {"st_ino",  "st_mode",    "st_nlink",    "st_uid",      "st_gid",     "st_rdev",
                                        "st_size", "st_blocks",  "st_blksize",  "st_atime_ns", "st_mtime_ns",
                                        "st_ctime_ns"};
static const char *const statfs_keys[] = {"f_bsize", "f_frsize", "f_blocks", "f_bfree",  "f_bavail",
                                          "f_files", "f_ffree",  "f_favail", "f_namemax"};
#define N_ATTR (sizeof attr_keys / sizeof *attr_keys)
#define N_STATFS (sizeof statfs_keys / sizeof *statfs_keys)
static PyObject *attr_names[N_ATTR], *statfs_names[N_STATFS];

static int set_fields(PyObject *out, PyObject **names, const long long *values, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(values[i]);
        int r = v ? PyObject_SetAttr(out, names[i], v) : -1;
        Py_XDECREF(v);
        if (r < 0)
            return -1;
    }
    return 0;
}

static long long ns(uint64_t sec, uint32_t nsec)
{
    return (long long)(int64_t)sec * 1000000000LL + nsec; /* sec is signed: before 1970 */
}

/* `out` (pyfuse3.EntryAttributes) set from `a`, field by field. */
static int set_attr(PyObject *out, const struct fuse_attr *a)
{
    long long v[N_ATTR] = {(long long)a->ino, a->mode, a->nlink, a->uid, a->gid, a->rdev, (long long)a->size,
                           (long long)a->blocks, a->blksize, ns(a->atime, a->atimensec), ns(a->mtime, a->mtimensec),
                           ns(a->ctime, a->ctimensec)};
    return set_fields(out, attr_names, v, N_ATTR);
}

/* The arguments of a table function: `n` of them, the first an index's Sections and the next `inos`
 * unsigned ints; the index is opened into `view` and `ix` (release `view`). -1 with an exception. */
static int table_args(const char *usage, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n, int inos,
                      unsigned long long *ino, Py_buffer *view, struct dlfs_ix *ix)
{
    if (nargs != n) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (int i = 0; i < inos; i++) {
        ino[i] = PyLong_AsUnsignedLongLong(args[1 + i]);
        if (ino[i] == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
    }
    return dlfs_index_from_sections(args[0], view, ix);
}

static PyObject *attr_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long ino;
    Py_buffer view;
    struct dlfs_ix ix;
    struct dlfs_inode n;
    struct fuse_attr a;
    if (table_args("attr_of(sections, ino, out)", args, nargs, 3, 1, &ino, &view, &ix) < 0)
        return NULL;
    int err = dlfs_inode_of(&ix, ino, &n);
    PyBuffer_Release(&view);
    if (err)
        return PyLong_FromLong(err);
    dlfs_attr_of(ino, &n, &a);
    return set_attr(args[2], &a) < 0 ? NULL : PyLong_FromLong(0);
}

static PyObject *entry_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long parent;
    Py_buffer view;
    struct dlfs_ix ix;
    struct dlfs_inode n;
    struct fuse_attr a;
    if (nargs == 4 && !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "entry_of: name must be bytes");
        return NULL;
    }
    if (table_args("entry_of(sections, parent, name, out)", args, nargs, 4, 1, &parent, &view, &ix) < 0)
        return NULL;
    int64_t ino = dlfs_entry_of(&ix, parent, PyBytes_AS_STRING(args[2]), (size_t)PyBytes_GET_SIZE(args[2]), &n);
    PyBuffer_Release(&view);
    if (ino < 0)
        return PyLong_FromLongLong(ino);
    memset(&a, 0, sizeof a); /* a negative entry: every field 0, as the serving threads send it */
    if (ino > 0)
        dlfs_attr_of((uint64_t)ino, &n, &a);
    return set_attr(args[3], &a) < 0 ? NULL : PyLong_FromLongLong(ino);
}

static PyObject *dirent_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[2]; /* dir, pos */
    Py_buffer view;
    struct dlfs_ix ix;
    struct dlfs_inode d, n;
    struct fuse_attr a;
    const uint8_t *name = (const uint8_t *)"";
    uint32_t len = 0;
    uint64_t ino = 0;
    if (table_args("dirent_of(sections, dir, pos, out)", args, nargs, 4, 2, v, &view, &ix) < 0)
        return NULL;
    int64_t next = dlfs_dir_of(&ix, v[0], &d);
    if (next == 0)
        next = dlfs_dirent_of(&ix, v[0], &d, v[1], &name, &len, &ino, &n);
    PyObject *out = Py_BuildValue("(y#L)", (const char *)name, (Py_ssize_t)(next > 0 ? len : 0), (long long)next);
    PyBuffer_Release(&view); /* after the name is copied out of the mapping */
    if (out && next > 0) {
        dlfs_attr_of(ino, &n, &a);
        if (set_attr(args[3], &a) < 0)
            Py_CLEAR(out);
    }
    return out;
}

static PyObject *dir_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long ino;
    Py_buffer view;
    struct dlfs_ix ix;
    struct dlfs_inode d;
    if (table_args("dir_of(sections, ino)", args, nargs, 2, 1, &ino, &view, &ix) < 0)
        return NULL;
    int err = dlfs_dir_of(&ix, ino, &d);
    PyBuffer_Release(&view);
    return PyLong_FromLong(err);
}

static PyObject *link_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long ino;
    Py_buffer view;
    struct dlfs_ix ix;
    const uint8_t *target;
    uint32_t len;
    if (table_args("link_of(sections, ino)", args, nargs, 2, 1, &ino, &view, &ix) < 0)
        return NULL;
    int err = dlfs_link_of(&ix, ino, &target, &len);
    PyObject *out = err ? PyLong_FromLong(err) : PyBytes_FromStringAndSize((const char *)target, len);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *access_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[2]; /* ino, mask */
    Py_buffer view;
    struct dlfs_ix ix;
    if (table_args("access_of(sections, ino, mask)", args, nargs, 3, 2, v, &view, &ix) < 0)
        return NULL;
    int err = dlfs_access_of(&ix, v[0], (uint32_t)v[1]);
    PyBuffer_Release(&view);
    return PyLong_FromLong(err);
}

static PyObject *statfs_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    struct dlfs_ix ix;
    struct fuse_kstatfs st;
    if (table_args("statfs_of(sections, out)", args, nargs, 2, 0, NULL, &view, &ix) < 0)
        return NULL;
    dlfs_statfs_of(&ix, &st);
    PyBuffer_Release(&view);
    long long v[N_STATFS] = {st.bsize, st.frsize, (long long)st.blocks, (long long)st.bfree, (long long)st.bavail,
                             (long long)st.files, (long long)st.ffree, (long long)st.ffree, st.namelen};
    if (set_fields(args[1], statfs_names, v, N_STATFS) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define TABLE_FN(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
static PyMethodDef table_methods[] = {
    TABLE_FN(attr_of, "attr_of(sections, ino, out) -> 0 or -errno: out (pyfuse3.EntryAttributes) set to the inode's "
                      "attributes, as GETATTR's reply carries them."),
    TABLE_FN(entry_of, "entry_of(sections, parent, name, out) -> LOOKUP's answer: the inode (> 0) with out set; 0, a "
                       "negative entry (out all 0); or -errno (ENOTDIR, ENAMETOOLONG, EIO)."),
    TABLE_FN(dirent_of, "dirent_of(sections, dir, pos, out) -> (name, next): the listing's entry at position pos (0 "
                        "'.', 1 '..', entry i at i + 2) with out set, and the position after it; next 0 past the end, "
                        "-errno on error."),
    TABLE_FN(dir_of, "dir_of(sections, ino) -> OPENDIR's answer: 0, or -errno (ENOTDIR, EIO)."),
    TABLE_FN(link_of, "link_of(sections, ino) -> READLINK's answer: the target (bytes), or -errno (EINVAL, EIO)."),
    TABLE_FN(access_of, "access_of(sections, ino, mask) -> ACCESS's answer: 0, or -errno (EROFS, EIO)."),
    TABLE_FN(statfs_of, "statfs_of(sections, out): out (pyfuse3.StatvfsData) set as STATFS's reply."),
    {NULL},
};

static int intern_all(PyObject **names, const char *const *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!names[i] && !(names[i] = PyUnicode_InternFromString(keys[i])))
            return -1;
    return 0;
}

int dlfs_index_add_types(PyObject *module)
{
    if (intern_all(attr_names, attr_keys, N_ATTR) < 0 || intern_all(statfs_names, statfs_keys, N_STATFS) < 0 ||
        PyModule_AddFunctions(module, table_methods) < 0)
        return -1;
    if (PyType_Ready(&IndexViewType) < 0)
        return -1;
    Py_INCREF(&IndexViewType);
    if (PyModule_AddObject(module, "IndexView", (PyObject *)&IndexViewType) < 0) {
        Py_DECREF(&IndexViewType);
        return -1;
    }
    return 0;
}
