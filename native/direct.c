/* CacheView and Pin: a dlfs.direct client's half of a mount's shared chunk cache (layout and pin
 * protocol: shm.h; the mount's half is CacheOwner, cacheowner.c).
 *
 * A client's pins live only in its row (the one part of the control region it maps writable), counted
 * under the epoch its row was handed out with. Once its last view is gone after detach() (or with the
 * CacheView itself) it marks the row released, and the mount takes the row back; a row whose owner
 * never does is taken back when the process is gone (dlfs/mount/pinrows.py). A pin is a Python object
 * exporting the record's bytes as a read-only buffer: read_many() and take() hand out a memoryview of
 * it, and releasing the view (or dropping it) releases the pin. */
#include "cacheregion.h" /* Python.h, before any system header */

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "indexview.h"
#include "module.h"

/* Bumped in every forked child: a pin inherited across fork() belongs to the parent's row. */
static unsigned long fork_gen;

static void after_fork_child(void)
{
    fork_gen++;
}

typedef struct {
    PyObject_HEAD
    struct dlfs_region r; /* first, as every half's (cacheregion.h) */
    Py_buffer index;
    int held_index;
    struct dlfs_ix ix;
    struct dlfs_pinner pin; /* this client's row and the epoch it attached under (0 until attached) */
    Py_ssize_t live;        /* pins held by its views */
    int detached, released; /* no new pins; its row marked released */
    PyObject *keep;         /* what must live as long as any pin (the client's connection) */
    unsigned long fork_gen;
} CacheView;

typedef struct {
    PyObject_HEAD
    CacheView *view;
    uint32_t slab;
    const char *buf;
    Py_ssize_t len;
} Pin;

static PyTypeObject CacheViewType, PinType;
static PyObject *empty_bytes;

/* --- pins ----------------------------------------------------------------------------------- */

static int pin_getbuffer(Pin *p, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)p, (void *)p->buf, p->len, 1, flags);
}

/* A client that holds no view and will take no pin says so in its row: the mount may hand it on. */
static void mark_released(CacheView *v)
{
    if (!v->pin.epoch || v->released || v->fork_gen != fork_gen ||
        dlfs_shm_epoch(&v->r.shm, v->pin.row) != v->pin.epoch)
        return;
    v->released = 1;
    __atomic_store_n(&dlfs_shm_row_head(&v->r.shm, v->pin.row)->released, v->pin.epoch, __ATOMIC_SEQ_CST);
}

static void pin_dealloc(Pin *p)
{
    CacheView *v = p->view;
    if (v->fork_gen == fork_gen) {
        dlfs_shm_unpin(&v->r.shm, v->pin, p->slab);
        if (--v->live == 0 && v->detached)
            mark_released(v);
    }
    Py_DECREF(v);
    PyObject_Free(p);
}

static PyBufferProcs pin_as_buffer = {(getbufferproc)pin_getbuffer, NULL};

static PyTypeObject PinType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dlfs._native.Pin",
    .tp_basicsize = sizeof(Pin),
    .tp_dealloc = (destructor)pin_dealloc,
    .tp_as_buffer = &pin_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pinned record of the shared cache; its buffer is the record's bytes, read-only.",
};

/* A read-only memoryview of a pin already counted in this client's row (the pin's release undoes it). */
static PyObject *view_of(CacheView *v, uint32_t slab, const char *buf, Py_ssize_t len)
{
    Pin *p = PyObject_New(Pin, &PinType);
    if (!p) {
        dlfs_shm_unpin(&v->r.shm, v->pin, slab);
        return NULL;
    }
    v->live++;
    Py_INCREF(v);
    p->view = v;
    p->slab = slab;
    p->buf = buf;
    p->len = len;
    PyObject *view = PyMemoryView_FromObject((PyObject *)p);
    Py_DECREF(p); /* the view holds the pin now */
    return view;
}

/* --- the client's view of the cache ------------------------------------------------------------ */

static void view_dealloc(CacheView *v)
{
    mark_released(v); /* before the region and the connection go: the mount then hands the row on at once */
    dlfs_region_release(&v->r);
    if (v->held_index)
        PyBuffer_Release(&v->index);
    Py_CLEAR(v->keep);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

/* This client's row: made writable in its read-only mapping of the control region, and the epoch it was
 * handed out under taken (the mount keeps the row this attachment's while this process lives). */
static int own_row(CacheView *v, uint64_t row)
{
    long page = sysconf(_SC_PAGESIZE);
    char *span = v->r.shm.rows + row * v->r.shm.h.row_stride;
    if ((uintptr_t)v->r.ctl.buf % (uintptr_t)page) {
        PyErr_SetString(PyExc_ValueError, "the control region must be an mmap of the whole memfd");
        return -1;
    }
    if (mprotect(span, v->r.shm.h.row_stride, PROT_READ | PROT_WRITE) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    uint64_t epoch = dlfs_shm_epoch(&v->r.shm, row);
    if (!epoch) {
        PyErr_Format(PyExc_ValueError, "row %llu of the pin table was not handed out", (unsigned long long)row);
        return -1;
    }
    v->pin = (struct dlfs_pinner){row, epoch};
    return 0;
}

/* Made whole or not at all: no method ever sees a half-attached view. */
static PyObject *view_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"ctl", "arena", "row", "sections", "keep", NULL};
    PyObject *ctl, *arena, *sections, *keep = NULL;
    unsigned long long row;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKO!|O", names, &ctl, &arena, &row, &PyTuple_Type, &sections,
                                     &keep))
        return NULL;
    CacheView *v = (CacheView *)type->tp_alloc(type, 0);
    if (!v)
        return NULL;
    v->fork_gen = fork_gen;
    if (dlfs_region_hold(&v->r, ctl, arena, 0) < 0)
        goto fail;
    if (!v->r.ctl.readonly) {
        PyErr_SetString(PyExc_ValueError, "a client maps the control region read-only (its own row is made writable)");
        goto fail;
    }
    if (dlfs_region_attach(&v->r) < 0)
        goto fail;
    if (row >= v->r.shm.h.n_rows) {
        PyErr_Format(PyExc_ValueError, "row %llu outside 0..%u", row, v->r.shm.h.n_rows - 1);
        goto fail;
    }
    if (dlfs_index_from_sections(sections, &v->index, &v->ix) < 0)
        goto fail;
    v->held_index = 1;
    if (v->ix.n_extents != v->r.shm.h.n_extents) {
        PyErr_SetString(PyExc_ValueError, "the index is not the one the shared cache was made for");
        goto fail;
    }
    Py_XINCREF(keep);
    v->keep = keep;
    if (own_row(v, row) < 0)
        goto fail;
    return (PyObject *)v;
fail:
    Py_DECREF(v);
    return NULL;
}

static int view_ok(CacheView *v)
{
    if (v->fork_gen != fork_gen) {
        PyErr_SetString(PyExc_RuntimeError, "a shared cache connection cannot be used in a forked child");
        return 0;
    }
    if (v->detached) {
        PyErr_SetString(PyExc_RuntimeError, "this CacheView is detached: it takes no new pins");
        return 0;
    }
    return 1;
}

/* Resolve `path` (relative to the root, '/'-separated) to an inode: >0, or -errno. A symlink on the
 * way or at the end is returned as itself (the caller follows it through the kernel). */
static long resolve(CacheView *v, const char *path, Py_ssize_t n)
{
    struct dlfs_inode node;
    uint64_t ino = 1;
    Py_ssize_t i = 0;
    if (dlfs_ix_inode(&v->ix, ino, &node) < 0)
        return -EIO;
    while (i < n) {
        Py_ssize_t j = i;
        while (j < n && path[j] != '/')
            j++;
        Py_ssize_t len = j - i;
        const char *name = path + i;
        i = j + 1;
        if (len == 0 || (len == 1 && name[0] == '.'))
            continue;
        if (S_ISLNK(node.mode))
            return (long)ino;
        if (!S_ISDIR(node.mode))
            return -ENOTDIR;
        if (len == 2 && name[0] == '.' && name[1] == '.') {
            ino = node.parent ? node.parent : ino;
        } else {
            int64_t child = dlfs_ix_lookup(&v->ix, ino, name, (size_t)len);
            if (child < 0)
                return (long)child;
            ino = (uint64_t)child;
        }
        if (dlfs_ix_inode(&v->ix, ino, &node) < 0)
            return -EIO;
    }
    return (long)ino;
}

/* One path's answer: a pinned view (or b"" for an empty file), -errno, or the inode for Python to
 * finish (not in a slab yet, several extents, compressed, a symlink). */
static PyObject *read_one(CacheView *v, PyObject *path)
{
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(path, &p, &n) < 0)
        return NULL;
    long ino = resolve(v, p, n);
    if (ino < 0)
        return PyLong_FromLong(ino);
    struct dlfs_inode node;
    struct dlfs_extent ext;
    if (dlfs_ix_inode(&v->ix, (uint64_t)ino, &node) < 0)
        return PyLong_FromLong(-EIO);
    if (S_ISDIR(node.mode))
        return PyLong_FromLong(-EISDIR);
    if (S_ISREG(node.mode) && node.count == 0 && node.size == 0)
        return PyMemoryView_FromObject(empty_bytes);
    if (!S_ISREG(node.mode) || node.count != 1 || dlfs_ix_extent(&v->ix, node.ref, &ext) < 0 ||
        ext.flags & DLFS_RECORD_LZ4 || (int64_t)ext.raw_len != node.size)
        return PyLong_FromLong(ino);
    const char *buf;
    uint32_t slab;
    if (!dlfs_shm_pin(&v->r.shm, v->pin, node.ref, ext.raw_len, &buf, &slab))
        return PyLong_FromLong(ino);
    return view_of(v, slab, buf, ext.raw_len);
}

static PyObject *view_read_many(CacheView *v, PyObject *paths)
{
    if (!view_ok(v))
        return NULL;
    PyObject *seq = PySequence_Fast(paths, "paths must be a sequence of bytes");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *one = read_one(v, PySequence_Fast_GET_ITEM(seq, i));
        if (!one) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, one);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *view_take(CacheView *v, PyObject *args)
{
    unsigned long long slab, off, len;
    const struct dlfs_shm *shm = &v->r.shm;
    if (!view_ok(v) || !PyArg_ParseTuple(args, "KKK", &slab, &off, &len) ||
        dlfs_in_range(slab, shm->h.nslabs, "slab") < 0)
        return NULL;
    if (off > shm->h.slab_size || len > shm->h.slab_size - off) {
        /* The mount pinned it for us: a bad answer must still let go of the pin. */
        dlfs_shm_unpin(shm, v->pin, (uint32_t)slab);
        PyErr_Format(PyExc_ValueError, "record of %llu bytes at %llu lies outside its slab", len, off);
        return NULL;
    }
    return view_of(v, (uint32_t)slab, shm->mem + slab * shm->h.slab_size + off, (Py_ssize_t)len);
}

static PyObject *view_detach(CacheView *v, PyObject *unused)
{
    v->detached = 1;
    if (v->live == 0)
        mark_released(v);
    Py_RETURN_NONE;
}

static PyObject *view_row(CacheView *v, void *unused)
{
    return PyLong_FromUnsignedLongLong(v->pin.row);
}

static PyObject *view_epoch(CacheView *v, void *unused)
{
    return PyLong_FromUnsignedLongLong(v->pin.epoch);
}

static PyObject *view_live_pins(CacheView *v, void *unused)
{
    return PyLong_FromSsize_t(v->live);
}

static PyGetSetDef view_getset[] = {
    DLFS_REGION_GETSET,
    {"row", (getter)view_row, NULL, "this client's row of the pin table", NULL},
    {"epoch", (getter)view_epoch, NULL, "the epoch this client's row was handed out under", NULL},
    {"live_pins", (getter)view_live_pins, NULL, "pins this client's views hold", NULL},
    {NULL},
};

static PyMethodDef view_methods[] = {
    DLFS_REGION_METHODS,
    {"read_many", (PyCFunction)view_read_many, METH_O,
     "read_many(paths) -> [memoryview | -errno | inode]: pinned views of the files in slabs; the rest "
     "as the inode to ask the mount for, or an errno."},
    {"take", (PyCFunction)view_take, METH_VARARGS,
     "take(slab, offset, length) -> memoryview of a record the mount pinned for this client."},
    {"detach", (PyCFunction)view_detach, METH_NOARGS,
     "detach(): take no new pins; the row is marked released once no view holds one."},
    {NULL},
};

static PyTypeObject CacheViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dlfs._native.CacheView",
    .tp_basicsize = sizeof(CacheView),
    .tp_dealloc = (destructor)view_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CacheView(ctl, arena, row, sections, keep=None): a dlfs.direct client's half of a mount's shared "
              "chunk cache, on the pin row the mount handed it. `ctl` is mapped read-only (the row is made "
              "writable); records are pinned and handed out as read-only memoryviews; `keep` lives as long as any pin.",
    .tp_methods = view_methods,
    .tp_getset = view_getset,
    .tp_new = view_new,
};

int dlfs_direct_add_types(PyObject *module)
{
    static int at_fork;
    if (!at_fork) {
        if (pthread_atfork(NULL, NULL, after_fork_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return -1;
        }
        at_fork = 1;
    }
    if (!empty_bytes && !(empty_bytes = PyBytes_FromStringAndSize("", 0)))
        return -1;
    if (PyType_Ready(&CacheViewType) < 0 || PyType_Ready(&PinType) < 0)
        return -1;
    Py_INCREF(&CacheViewType);
    if (PyModule_AddObject(module, "CacheView", (PyObject *)&CacheViewType) < 0)
        return -1;
    Py_INCREF(&PinType);
    return PyModule_AddObject(module, "Pin", (PyObject *)&PinType);
}
