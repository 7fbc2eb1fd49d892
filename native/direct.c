/* dlfs.direct's Python types over a mount's shared chunk cache (layout and pin protocol: shm.h).
 *
 * A client's pins live only in its row (the one part of the control region it maps writable), counted
 * under the epoch its row was handed out with. Once its last view is gone after detach() (or with the
 * SharedCache itself) it marks the row released, and the mount takes the row back; a row whose owner
 * never does is taken back when the process is gone (dlfs/mount/pinrows.py). A pin is a Python object
 * exporting the record's bytes as a read-only buffer: read() hands out a memoryview of it, and releasing
 * the view (or dropping it) releases the pin. The mount's own SharedCache also counts what the kernel
 * was sent of each record (shm.h's dlfs_consume), for the serving threads and the Python handlers alike. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "indexview.h"
#include "module.h"
#include "shm.h"

#define CONSUMED_RING 65536 /* extents consumed and not yet dropped by the cache */
#define TAKE_BATCH 4096

/* Bumped in every forked child: a pin inherited across fork() belongs to the parent's row. */
static unsigned long fork_gen;

static void after_fork_child(void)
{
    fork_gen++;
}

typedef struct {
    PyObject_HEAD
    Py_buffer ctl, arena, index;
    int held_ctl, held_arena, held_index, has_consume;
    struct dlfs_shm shm;
    struct dlfs_consume consume; /* the mount's only */
    struct dlfs_ix ix;
    long row; /* this client's row; -1 for the mount */
    struct dlfs_pinner pin; /* a client's row and the epoch it attached under */
    Py_ssize_t live; /* a client's pins held by its views */
    int detached, released; /* a client's: no new pins; its row marked released */
    PyObject *keep; /* what must live as long as any pin (the client's connection) */
    uint32_t max_row; /* the mount: rows ever pinned through, the ones a retire must sum */
    uint64_t refused; /* the mount: refused pins and releases of the rows it cleared */
    unsigned long fork_gen;
} SharedCache;

typedef struct {
    PyObject_HEAD
    SharedCache *owner;
    uint32_t slab;
    const char *buf;
    Py_ssize_t len;
} Pin;

static PyTypeObject SharedCacheType, PinType;
static PyObject *empty_bytes;

/* --- pins ----------------------------------------------------------------------------------- */

static int pin_getbuffer(Pin *p, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)p, (void *)p->buf, p->len, 1, flags);
}

/* A client that holds no view and will take no pin says so in its row: the mount may hand it on. */
static void mark_released(SharedCache *s)
{
    if (s->row < 0 || !s->pin.epoch || s->released || s->fork_gen != fork_gen ||
        dlfs_shm_epoch(&s->shm, s->pin.row) != s->pin.epoch)
        return;
    s->released = 1;
    __atomic_store_n(&dlfs_shm_row_head(&s->shm, s->pin.row)->released, s->pin.epoch, __ATOMIC_SEQ_CST);
}

static void pin_dealloc(Pin *p)
{
    SharedCache *s = p->owner;
    if (s->fork_gen == fork_gen) {
        dlfs_shm_unpin(&s->shm, s->pin, p->slab);
        if (--s->live == 0 && s->detached)
            mark_released(s);
    }
    Py_DECREF(s);
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
static PyObject *view_of(SharedCache *s, uint32_t slab, const char *buf, Py_ssize_t len)
{
    Pin *p = PyObject_New(Pin, &PinType);
    if (!p) {
        dlfs_shm_unpin(&s->shm, s->pin, slab);
        return NULL;
    }
    s->live++;
    Py_INCREF(s);
    p->owner = s;
    p->slab = slab;
    p->buf = buf;
    p->len = len;
    PyObject *view = PyMemoryView_FromObject((PyObject *)p);
    Py_DECREF(p); /* the view holds the pin now */
    return view;
}

/* --- the shared cache ------------------------------------------------------------------------ */

static void shared_dealloc(SharedCache *s)
{
    mark_released(s); /* before the region and the connection go: the mount then hands the row on at once */
    if (s->held_ctl)
        PyBuffer_Release(&s->ctl);
    if (s->held_arena)
        PyBuffer_Release(&s->arena);
    if (s->held_index)
        PyBuffer_Release(&s->index);
    if (s->has_consume)
        dlfs_consume_free(&s->consume);
    Py_CLEAR(s->keep);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* A client's row: made writable in its read-only mapping of the control region, and the epoch it was
 * handed out under taken (the mount keeps the row this attachment's while this process lives). */
static int own_row(SharedCache *s)
{
    long page = sysconf(_SC_PAGESIZE);
    char *span = s->shm.rows + (uint64_t)s->row * s->shm.h.row_stride;
    if ((uintptr_t)s->ctl.buf % (uintptr_t)page) {
        PyErr_SetString(PyExc_ValueError, "the control region must be an mmap of the whole memfd");
        return -1;
    }
    if (mprotect(span, s->shm.h.row_stride, PROT_READ | PROT_WRITE) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    uint64_t epoch = dlfs_shm_epoch(&s->shm, (uint64_t)s->row);
    if (!epoch) {
        PyErr_Format(PyExc_ValueError, "row %ld of the pin table was not handed out", s->row);
        return -1;
    }
    s->pin = (struct dlfs_pinner){(uint64_t)s->row, epoch};
    return 0;
}

static int shared_init(SharedCache *s, PyObject *args, PyObject *kw)
{
    static char *names[] = {"ctl", "arena", "create", "slab_size", "nslabs", "n_extents", "n_rows", "row", "sections",
                            "keep", NULL};
    PyObject *ctl, *arena, *sections = Py_None, *keep = NULL;
    int create = 0;
    unsigned long long slab_size = 0, nslabs = 0, n_extents = 0, n_rows = 0;
    long row = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$pKKKKlOO", names, &ctl, &arena, &create, &slab_size, &nslabs,
                                     &n_extents, &n_rows, &row, &sections, &keep))
        return -1;
    if (s->held_ctl) {
        PyErr_SetString(PyExc_RuntimeError, "SharedCache is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(ctl, &s->ctl, create ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    s->held_ctl = 1;
    if (!create && row >= 0 && !s->ctl.readonly) {
        PyErr_SetString(PyExc_ValueError, "a client maps the control region read-only (its own row is made writable)");
        return -1;
    }
    if (PyObject_GetBuffer(arena, &s->arena, PyBUF_SIMPLE) < 0)
        return -1;
    s->held_arena = 1;
    struct dlfs_shm_header *shared = s->ctl.buf;
    if ((uint64_t)s->ctl.len < DLFS_SHM_HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "control region shorter than its header");
        return -1;
    }
    if (create) {
        if (!dlfs_shm_layout(&s->shm.h, slab_size, nslabs, n_extents, n_rows)) {
            PyErr_SetString(PyExc_ValueError, "shared cache sizes out of range");
            return -1;
        }
        if (s->shm.h.total > (uint64_t)s->ctl.len) {
            PyErr_Format(PyExc_ValueError, "control region of %zd bytes; the layout needs %llu", s->ctl.len,
                         (unsigned long long)s->shm.h.total);
            return -1;
        }
        memcpy(shared, &s->shm.h, sizeof s->shm.h);
        if (dlfs_consume_init(&s->consume, n_extents, CONSUMED_RING) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        s->has_consume = 1;
    } else {
        struct dlfs_shm_header h = *shared;
        if (memcmp(h.magic, DLFS_SHM_MAGIC, 8) || h.version != DLFS_SHM_VERSION) {
            PyErr_SetString(PyExc_ValueError, "not a dlfs shared cache (bad magic or layout version)");
            return -1;
        }
        /* Recomputed, not trusted: every section must be where these sizes put it. */
        if (!dlfs_shm_layout(&s->shm.h, h.slab_size, h.nslabs, h.n_extents, h.n_rows) ||
            memcmp(&s->shm.h, &h, sizeof h) || s->shm.h.total > (uint64_t)s->ctl.len) {
            PyErr_SetString(PyExc_ValueError, "shared cache header is inconsistent with its region");
            return -1;
        }
    }
    if (s->shm.h.nslabs * s->shm.h.slab_size > (uint64_t)s->arena.len) {
        PyErr_SetString(PyExc_ValueError, "cache arena smaller than its slabs");
        return -1;
    }
    if (row >= (long)s->shm.h.n_rows) {
        PyErr_Format(PyExc_ValueError, "row %ld outside 0..%u", row, s->shm.h.n_rows - 1);
        return -1;
    }
    dlfs_shm_map(&s->shm, s->ctl.buf, s->arena.buf);
    s->row = row < 0 ? -1 : row;
    s->fork_gen = fork_gen;
    Py_XINCREF(keep);
    s->keep = keep;
    if (sections != Py_None) {
        if (!PyTuple_Check(sections)) {
            PyErr_SetString(PyExc_TypeError, "sections must be dlfs.format.index.Sections");
            return -1;
        }
        if (dlfs_index_from_sections(sections, &s->index, &s->ix) < 0)
            return -1;
        s->held_index = 1;
        if (s->ix.n_extents != s->shm.h.n_extents) {
            PyErr_SetString(PyExc_ValueError, "the index is not the one the shared cache was made for");
            return -1;
        }
    }
    return row >= 0 ? own_row(s) : 0;
}

/* 0 if `v` is below `limit`; else -1 with an IndexError naming `what`. */
static int in_range(unsigned long long v, uint64_t limit, const char *what)
{
    if (v >= limit) {
        PyErr_Format(PyExc_IndexError, "%s %llu out of range (0..%llu)", what, v, (unsigned long long)limit - 1);
        return -1;
    }
    return 0;
}

/* A method's single argument as an index below `limit`: 0 with *out set, or -1 with an exception. */
static int index_arg(PyObject *arg, uint64_t limit, const char *what, unsigned long long *out)
{
    *out = PyLong_AsUnsignedLongLong(arg);
    if (*out == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return in_range(*out, limit, what);
}

/* The mount's side. */

static int mount_ok(SharedCache *s)
{
    if (!s->has_consume) {
        PyErr_SetString(PyExc_RuntimeError, "this SharedCache is a client's, not the mount's");
        return 0;
    }
    return 1;
}

static PyObject *shared_publish(SharedCache *s, PyObject *args)
{
    unsigned long long ext, slab, off;
    if (!mount_ok(s) || !PyArg_ParseTuple(args, "KKK", &ext, &slab, &off) ||
        in_range(ext, s->shm.h.n_extents, "extent") < 0 || in_range(slab, s->shm.h.nslabs, "slab") < 0)
        return NULL;
    if (off >= s->shm.h.slab_size) {
        PyErr_Format(PyExc_ValueError, "offset %llu outside a slab", off);
        return NULL;
    }
    /* A record published anew has sent the kernel nothing yet. */
    __atomic_store_n(&s->consume.served[ext], 0, __ATOMIC_RELAXED);
    dlfs_shm_publish(&s->shm, ext, slab, (uint32_t)off);
    Py_RETURN_NONE;
}

static PyObject *shared_unpublish(SharedCache *s, PyObject *arg)
{
    unsigned long long ext;
    if (!mount_ok(s) || index_arg(arg, s->shm.h.n_extents, "extent", &ext) < 0)
        return NULL;
    dlfs_shm_unpublish(&s->shm, ext);
    Py_RETURN_NONE;
}

static PyObject *shared_retire(SharedCache *s, PyObject *arg)
{
    unsigned long long slab;
    if (!mount_ok(s) || index_arg(arg, s->shm.h.nslabs, "slab", &slab) < 0)
        return NULL;
    __atomic_fetch_add(&s->shm.gens[slab], 1, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(dlfs_shm_pins_on(&s->shm, slab, s->max_row) == 0);
}

static PyObject *shared_pinned(SharedCache *s, PyObject *arg)
{
    unsigned long long slab;
    if (index_arg(arg, s->shm.h.nslabs, "slab", &slab) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(dlfs_shm_pins_on(&s->shm, slab, s->max_row));
}

/* Rows up to `row` may hold pins from now on: retires must sum them. */
static void row_in_use(SharedCache *s, uint64_t row)
{
    if (row >= s->max_row)
        s->max_row = (uint32_t)row + 1;
}

/* A mount's method's (row, slab) arguments, in range: 0, or -1 with an exception. */
static int row_slab_args(SharedCache *s, PyObject *args, unsigned long *row, unsigned long long *slab)
{
    if (!mount_ok(s) || !PyArg_ParseTuple(args, "kK", row, slab) || in_range(*row, s->shm.h.n_rows, "row") < 0 ||
        in_range(*slab, s->shm.h.nslabs, "slab") < 0)
        return -1;
    return 0;
}

static PyObject *shared_pin_for(SharedCache *s, PyObject *args)
{
    unsigned long row;
    unsigned long long slab;
    if (row_slab_args(s, args, &row, &slab) < 0)
        return NULL;
    row_in_use(s, row);
    __atomic_fetch_add(&dlfs_shm_row(&s->shm, row)[slab], 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *shared_unpin_for(SharedCache *s, PyObject *args)
{
    unsigned long row;
    unsigned long long slab;
    if (row_slab_args(s, args, &row, &slab) < 0)
        return NULL;
    struct dlfs_pinner p = {row, dlfs_shm_epoch(&s->shm, row)};
    return PyBool_FromLong(dlfs_shm_unpin(&s->shm, p, (uint32_t)slab));
}

static PyObject *shared_hand_out(SharedCache *s, PyObject *arg)
{
    unsigned long long row;
    if (!mount_ok(s) || index_arg(arg, s->shm.h.n_rows, "row", &row) < 0)
        return NULL;
    row_in_use(s, row);
    return PyLong_FromUnsignedLongLong(dlfs_shm_hand_out(&s->shm, row));
}

static PyObject *shared_released(SharedCache *s, PyObject *arg)
{
    unsigned long long row;
    if (index_arg(arg, s->shm.h.n_rows, "row", &row) < 0)
        return NULL;
    return PyBool_FromLong(dlfs_shm_released(&s->shm, row));
}

static PyObject *shared_clear_row(SharedCache *s, PyObject *arg)
{
    unsigned long long row;
    uint64_t refused;
    if (!mount_ok(s) || index_arg(arg, s->shm.h.n_rows, "row", &row) < 0)
        return NULL;
    row_in_use(s, row);
    uint64_t freed = dlfs_shm_clear_row(&s->shm, row, &refused);
    s->refused += refused;
    return PyLong_FromUnsignedLongLong(freed);
}

/* Pins and releases refused (native/shm.h) in rows still in use, and in those cleared before. */
static uint64_t refused_releases(SharedCache *s)
{
    uint64_t n = s->refused;
    for (uint64_t r = 0; r < s->max_row; r++)
        n += __atomic_load_n(&dlfs_shm_row_head(&s->shm, r)->refused, __ATOMIC_RELAXED);
    return n;
}

static PyObject *shared_where(SharedCache *s, PyObject *arg)
{
    unsigned long long ext;
    if (index_arg(arg, s->shm.h.n_extents, "extent", &ext) < 0)
        return NULL;
    uint64_t e = __atomic_load_n(&s->shm.entries[ext], __ATOMIC_SEQ_CST);
    uint64_t slab = (e & DLFS_SHM_SLAB_LIMIT) - 1;
    uint32_t off = __atomic_load_n(&s->shm.offsets[ext], __ATOMIC_SEQ_CST);
    /* Shared memory: a slab or offset out of range is no place to pin or read. */
    if (!e || slab >= s->shm.h.nslabs || off >= s->shm.h.slab_size)
        Py_RETURN_NONE;
    return Py_BuildValue("KI", (unsigned long long)slab, off);
}

static PyObject *shared_served(SharedCache *s, PyObject *args)
{
    unsigned long long ext;
    unsigned int n, len;
    if (!mount_ok(s) || !PyArg_ParseTuple(args, "KII", &ext, &n, &len) ||
        in_range(ext, s->shm.h.n_extents, "extent") < 0)
        return NULL;
    return PyBool_FromLong(dlfs_consume_add(&s->consume, ext, n, len));
}

static PyObject *shared_reset_served(SharedCache *s, PyObject *arg)
{
    unsigned long long ext;
    if (!mount_ok(s) || index_arg(arg, s->shm.h.n_extents, "extent", &ext) < 0)
        return NULL;
    __atomic_store_n(&s->consume.served[ext], 0, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* set_pending(exts, on): the cache starts (or ends) fetching these records; READs of them wait in C meanwhile. */
static PyObject *shared_set_pending(SharedCache *s, PyObject *args)
{
    PyObject *exts;
    int on;
    if (!mount_ok(s) || !PyArg_ParseTuple(args, "Op", &exts, &on))
        return NULL;
    PyObject *seq = PySequence_Fast(exts, "set_pending takes a sequence of extents");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long ext;
        if (index_arg(items[i], s->shm.h.n_extents, "extent", &ext) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        dlfs_consume_set_pending(&s->consume, ext, on);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *shared_take_consumed(SharedCache *s, PyObject *unused)
{
    uint32_t got[TAKE_BATCH];
    if (!mount_ok(s))
        return NULL;
    uint32_t n = dlfs_consume_take(&s->consume, got, TAKE_BATCH);
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(got[i]);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* The client's side. */

static int client_ok(SharedCache *s)
{
    if (s->row < 0 || !s->held_index) {
        PyErr_SetString(PyExc_RuntimeError, "this SharedCache is the mount's, not a client's");
        return 0;
    }
    if (s->fork_gen != fork_gen) {
        PyErr_SetString(PyExc_RuntimeError, "a shared cache connection cannot be used in a forked child");
        return 0;
    }
    if (s->detached) {
        PyErr_SetString(PyExc_RuntimeError, "this SharedCache is detached: it takes no new pins");
        return 0;
    }
    return 1;
}

/* Resolve `path` (relative to the root, '/'-separated) to an inode: >0, or -errno. A symlink on the
 * way or at the end is returned as itself (the caller follows it through the kernel). */
static long resolve(SharedCache *s, const char *path, Py_ssize_t n)
{
    struct dlfs_inode node;
    uint64_t ino = 1;
    Py_ssize_t i = 0;
    if (dlfs_ix_inode(&s->ix, ino, &node) < 0)
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
            int64_t child = dlfs_ix_lookup(&s->ix, ino, name, (size_t)len);
            if (child < 0)
                return (long)child;
            ino = (uint64_t)child;
        }
        if (dlfs_ix_inode(&s->ix, ino, &node) < 0)
            return -EIO;
    }
    return (long)ino;
}

/* One path's answer: a pinned view (or b"" for an empty file), -errno, or the inode for Python to
 * finish (not in a slab yet, several extents, compressed, a symlink). */
static PyObject *read_one(SharedCache *s, PyObject *path)
{
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(path, &p, &n) < 0)
        return NULL;
    long ino = resolve(s, p, n);
    if (ino < 0)
        return PyLong_FromLong(ino);
    struct dlfs_inode node;
    struct dlfs_extent ext;
    if (dlfs_ix_inode(&s->ix, (uint64_t)ino, &node) < 0)
        return PyLong_FromLong(-EIO);
    if (S_ISDIR(node.mode))
        return PyLong_FromLong(-EISDIR);
    if (S_ISREG(node.mode) && node.count == 0 && node.size == 0)
        return PyMemoryView_FromObject(empty_bytes);
    if (!S_ISREG(node.mode) || node.count != 1 || dlfs_ix_extent(&s->ix, node.ref, &ext) < 0 ||
        ext.flags & DLFS_RECORD_LZ4 || (int64_t)ext.raw_len != node.size)
        return PyLong_FromLong(ino);
    const char *buf;
    uint32_t slab;
    if (!dlfs_shm_pin(&s->shm, s->pin, node.ref, ext.raw_len, &buf, &slab))
        return PyLong_FromLong(ino);
    return view_of(s, slab, buf, ext.raw_len);
}

static PyObject *shared_read_many(SharedCache *s, PyObject *paths)
{
    if (!client_ok(s))
        return NULL;
    PyObject *seq = PySequence_Fast(paths, "paths must be a sequence of bytes");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *one = read_one(s, PySequence_Fast_GET_ITEM(seq, i));
        if (!one) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, one);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *shared_take(SharedCache *s, PyObject *args)
{
    unsigned long long slab, off, len;
    if (!client_ok(s) || !PyArg_ParseTuple(args, "KKK", &slab, &off, &len) ||
        in_range(slab, s->shm.h.nslabs, "slab") < 0)
        return NULL;
    if (off > s->shm.h.slab_size || len > s->shm.h.slab_size - off) {
        /* The mount pinned it for us: a bad answer must still let go of the pin. */
        dlfs_shm_unpin(&s->shm, s->pin, (uint32_t)slab);
        PyErr_Format(PyExc_ValueError, "record of %llu bytes at %llu lies outside its slab", len, off);
        return NULL;
    }
    return view_of(s, (uint32_t)slab, s->shm.mem + slab * s->shm.h.slab_size + off, (Py_ssize_t)len);
}

static PyObject *shared_detach(SharedCache *s, PyObject *unused)
{
    if (s->row < 0) {
        PyErr_SetString(PyExc_RuntimeError, "this SharedCache is the mount's, not a client's");
        return NULL;
    }
    s->detached = 1;
    if (s->live == 0)
        mark_released(s);
    Py_RETURN_NONE;
}

static PyObject *shared_row_pins(SharedCache *s, PyObject *arg)
{
    unsigned long long row;
    if (index_arg(arg, s->shm.h.n_rows, "row", &row) < 0)
        return NULL;
    uint64_t n = 0;
    uint32_t *r = dlfs_shm_row(&s->shm, row);
    for (uint64_t i = 0; i < s->shm.h.nslabs; i++)
        n += __atomic_load_n(&r[i], __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *shared_get(SharedCache *s, void *which)
{
    switch ((intptr_t)which) {
    case 0:
        return PyLong_FromUnsignedLongLong(s->shm.h.slab_size);
    case 1:
        return PyLong_FromUnsignedLongLong(s->shm.h.nslabs);
    case 2:
        return PyLong_FromUnsignedLongLong(s->shm.h.n_extents);
    case 3:
        return PyLong_FromUnsignedLong(s->shm.h.n_rows);
    case 4:
        return PyLong_FromLong(s->has_consume ? s->consume.wake_fd : -1);
    case 5:
        return PyLong_FromUnsignedLongLong(s->has_consume ? s->consume.dropped : 0);
    case 7:
        return PyLong_FromUnsignedLongLong(s->pin.epoch);
    case 8:
        return PyLong_FromSsize_t(s->live);
    case 9:
        return PyLong_FromUnsignedLongLong(s->has_consume ? refused_releases(s) : 0);
    default:
        return PyLong_FromLong(s->row);
    }
}

static PyGetSetDef shared_getset[] = {
    {"slab_size", (getter)shared_get, NULL, "bytes per slab", (void *)0},
    {"nslabs", (getter)shared_get, NULL, "slabs in the arena", (void *)1},
    {"n_extents", (getter)shared_get, NULL, "extents of the index", (void *)2},
    {"n_rows", (getter)shared_get, NULL, "client rows of the pin table", (void *)3},
    {"consumed_fd", (getter)shared_get, NULL, "the mount's: an eventfd readable while consumed extents wait",
     (void *)4},
    {"consumed_dropped", (getter)shared_get, NULL, "consumed extents the full queue could not hold", (void *)5},
    {"row", (getter)shared_get, NULL, "this client's row (-1: the mount)", (void *)6},
    {"epoch", (getter)shared_get, NULL, "the epoch this client's row was handed out under (0: the mount)", (void *)7},
    {"live_pins", (getter)shared_get, NULL, "pins this client's views hold", (void *)8},
    {"refused_releases", (getter)shared_get, NULL,
     "the mount's: pins and releases refused (of an earlier attachment, or below zero)", (void *)9},
    {NULL},
};

static PyMethodDef shared_methods[] = {
    {"publish", (PyCFunction)shared_publish, METH_VARARGS, "publish(ext, slab, offset): the record is in this slab."},
    {"unpublish", (PyCFunction)shared_unpublish, METH_O, "unpublish(ext): the record is no longer to be pinned."},
    {"retire", (PyCFunction)shared_retire, METH_O,
     "retire(slab) -> bool: no new pins on it; True if none are held (it may be reused now)."},
    {"pinned", (PyCFunction)shared_pinned, METH_O, "pinned(slab) -> pins held on it by every client."},
    {"pin_for", (PyCFunction)shared_pin_for, METH_VARARGS, "pin_for(row, slab): pin a slab for a client."},
    {"unpin_for", (PyCFunction)shared_unpin_for, METH_VARARGS,
     "unpin_for(row, slab) -> bool: let go of a pin taken for a client that never received it."},
    {"hand_out", (PyCFunction)shared_hand_out, METH_O, "hand_out(row) -> epoch: the row belongs to a new attachment."},
    {"released", (PyCFunction)shared_released, METH_O,
     "released(row) -> bool: the row's owner holds no view of it and takes no more pins."},
    {"clear_row", (PyCFunction)shared_clear_row, METH_O,
     "clear_row(row) -> pins reclaimed: its owner released it or is gone."},
    {"where", (PyCFunction)shared_where, METH_O, "where(ext) -> (slab, offset) or None."},
    {"served", (PyCFunction)shared_served, METH_VARARGS,
     "served(ext, n, raw_len) -> bool: n more bytes of the record went to the kernel; True if that completed it."},
    {"reset_served", (PyCFunction)shared_reset_served, METH_O,
     "reset_served(ext): the record is kept anew (outside a slab): nothing of it has been sent."},
    {"set_pending", (PyCFunction)shared_set_pending, METH_VARARGS,
     "set_pending(exts, on): these records are (no longer) being fetched; the engine parks READs of them."},
    {"take_consumed", (PyCFunction)shared_take_consumed, METH_NOARGS,
     "take_consumed() -> [ext]: records the serving threads completed, for the cache to drop."},
    {"read_many", (PyCFunction)shared_read_many, METH_O,
     "read_many(paths) -> [memoryview | -errno | inode]: pinned views of the files in slabs; the rest "
     "as the inode to ask the mount for, or an errno."},
    {"take", (PyCFunction)shared_take, METH_VARARGS,
     "take(slab, offset, length) -> memoryview of a record the mount pinned for this client."},
    {"row_pins", (PyCFunction)shared_row_pins, METH_O, "row_pins(row) -> pins that row holds."},
    {"detach", (PyCFunction)shared_detach, METH_NOARGS,
     "detach(): a client's: take no new pins; the row is marked released once no view holds one."},
    {NULL},
};

static PyTypeObject SharedCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dlfs._native.SharedCache",
    .tp_basicsize = sizeof(SharedCache),
    .tp_dealloc = (destructor)shared_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mount's shared chunk cache: its control region and arena (native/shm.h).",
    .tp_methods = shared_methods,
    .tp_getset = shared_getset,
    .tp_init = (initproc)shared_init,
    .tp_new = PyType_GenericNew,
};

/* For the serving engine: the mount's cache, with a row of its own counted in every retire. */
int dlfs_shared_cache_of(PyObject *obj, uint64_t row, struct dlfs_shm **shm, struct dlfs_consume **consume)
{
    if (!PyObject_TypeCheck(obj, &SharedCacheType)) {
        PyErr_SetString(PyExc_TypeError, "expected a dlfs._native.SharedCache");
        return -1;
    }
    SharedCache *s = (SharedCache *)obj;
    if (!mount_ok(s) || in_range(row, s->shm.h.n_rows, "row") < 0)
        return -1;
    row_in_use(s, row);
    *shm = &s->shm;
    *consume = &s->consume;
    return 0;
}

static PyObject *shared_size(PyObject *self, PyObject *args)
{
    unsigned long long slab_size, nslabs, n_extents, n_rows;
    struct dlfs_shm_header h;
    if (!PyArg_ParseTuple(args, "KKKK", &slab_size, &nslabs, &n_extents, &n_rows))
        return NULL;
    if (!dlfs_shm_layout(&h, slab_size, nslabs, n_extents, n_rows)) {
        PyErr_SetString(PyExc_ValueError, "shared cache sizes out of range");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(h.total);
}

/* Fault fresh memory in with the GIL released: this VM's first touch costs about 1 s per GB, which the
 * mount's event loop should not pay inside a read. The range may hold slabs being filled meanwhile, so
 * nothing here writes a byte: before Linux 5.14 (no MADV_POPULATE_WRITE) a read of each page allocates
 * it in the memfd just the same, and the first write costs a minor fault only. */
static PyObject *populate(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"buffer", "offset", "length", "fallback", NULL};
    Py_buffer view;
    unsigned long long off, len;
    int fallback = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "w*KK|$p", names, &view, &off, &len, &fallback))
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (off > (unsigned long long)view.len || len > (unsigned long long)view.len - off || off % page) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "populate: range outside the buffer, or not page-aligned");
        return NULL;
    }
    int rc = -1, err = EINVAL;
    Py_BEGIN_ALLOW_THREADS
    if (!fallback) {
        rc = madvise((char *)view.buf + off, len, MADV_POPULATE_WRITE);
        err = rc ? errno : 0;
    }
    if (rc != 0 && err == EINVAL) { /* before Linux 5.14, or `fallback` (tests) */
        const volatile char *p = (const char *)view.buf + off;
        for (unsigned long long i = 0; i < len; i += (unsigned long long)page)
            (void)p[i];
        rc = err = 0;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"populate", (PyCFunction)(void (*)(void))populate, METH_VARARGS | METH_KEYWORDS,
     "populate(buffer, offset, length, *, fallback=False): fault the range in now, without the GIL and without "
     "writing to it (MADV_POPULATE_WRITE; else, or with `fallback` (tests), a read of each page)."},
    {"shared_size", shared_size, METH_VARARGS,
     "shared_size(slab_size, nslabs, n_extents, n_rows) -> bytes of the control region."},
    {NULL},
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
    if (PyType_Ready(&SharedCacheType) < 0 || PyType_Ready(&PinType) < 0)
        return -1;
    Py_INCREF(&SharedCacheType);
    if (PyModule_AddObject(module, "SharedCache", (PyObject *)&SharedCacheType) < 0)
        return -1;
    Py_INCREF(&PinType);
    if (PyModule_AddObject(module, "Pin", (PyObject *)&PinType) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "SLAB_LIMIT", DLFS_SHM_SLAB_LIMIT) < 0)
        return -1;
    return PyModule_AddFunctions(module, functions);
}
