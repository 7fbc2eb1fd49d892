/* The shared chunk cache of a mount, as dlfs.direct and the mount see it.
 *
 * The mount's cache arena (slabs of read-ahead) is a memfd that client processes map read-only; a
 * second memfd, the control region, says where each cached record is and who holds what:
 *
 *   header   128 B                   magic "DLFSSHM1", version, rows, slab size, slabs, extents,
 *                                    section offsets, total size
 *   gens     u64 per slab            bumped when the mount retires a slab (its records dropped)
 *   entries  u64 per extent          0: not in a slab; else (gen << 24) | (slab + 1)
 *   offsets  u32 per extent          where the record's bytes start in its slab
 *   rows     u32 per client per slab pins held by that client (process) on that slab
 *
 * A client pins a slab by adding to its own row, then re-reading the slab's gen; the mount retires a
 * slab by clearing its entries, bumping its gen, then summing the rows (all sequentially consistent):
 * either the client sees the new gen and lets go, or the mount sees the pin and keeps the slab's bytes
 * until the pin is released. A client's pins live only in its row, so when its connection ends (the
 * process died, say) the mount zeroes the row and every pin it held is reclaimed at once.
 *
 * A pin is a Python object exporting the record's bytes as a read-only buffer: read() hands out a
 * memoryview of it, and releasing the view (or dropping it) releases the pin. */
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

#define MAGIC "DLFSSHM1"
#define LAYOUT_VERSION 1
#define HEADER_BYTES 128
#define SLAB_BITS 24
#define SLAB_LIMIT ((1u << SLAB_BITS) - 1)
#define PATH_DEPTH 4096

struct header {
    char magic[8];
    uint32_t version, n_rows;
    uint64_t slab_size, nslabs, n_extents;
    uint64_t gens, entries, offsets, rows, total;
};

static uint64_t align8(uint64_t n)
{
    return (n + 7) & ~(uint64_t)7;
}

/* The layout for these sizes; 0 if they cannot be laid out. */
static uint64_t layout(struct header *h, uint64_t slab_size, uint64_t nslabs, uint64_t n_extents, uint64_t n_rows)
{
    if (!slab_size || slab_size > UINT32_MAX || !nslabs || nslabs > SLAB_LIMIT || n_rows < 1 || n_rows > 65536 ||
        n_extents > ((uint64_t)1 << 40))
        return 0;
    memset(h, 0, sizeof *h);
    memcpy(h->magic, MAGIC, 8);
    h->version = LAYOUT_VERSION;
    h->n_rows = (uint32_t)n_rows;
    h->slab_size = slab_size;
    h->nslabs = nslabs;
    h->n_extents = n_extents;
    h->gens = HEADER_BYTES;
    h->entries = h->gens + 8 * nslabs;
    h->offsets = h->entries + 8 * n_extents;
    h->rows = align8(h->offsets + 4 * n_extents);
    h->total = h->rows + 4 * n_rows * nslabs;
    return h->total;
}

/* Bumped in every forked child: a pin inherited across fork() belongs to the parent's row. */
static unsigned long fork_gen;

static void after_fork_child(void)
{
    fork_gen++;
}

typedef struct {
    PyObject_HEAD
    Py_buffer ctl, arena, index;
    int held_ctl, held_arena, held_index;
    struct header h;
    uint64_t *gens, *entries;
    uint32_t *offsets, *rows;
    const char *mem;
    struct dlfs_ix ix;
    long row; /* this client's row; -1 for the mount */
    PyObject *keep; /* what must live as long as any pin (the client's connection: its end frees the row) */
    uint32_t max_row; /* the mount: rows ever attached, the ones a retire must sum */
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

static uint32_t *row_of(SharedCache *s, uint64_t row)
{
    return s->rows + row * s->h.nslabs;
}

/* --- pins ----------------------------------------------------------------------------------- */

static int pin_getbuffer(Pin *p, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)p, (void *)p->buf, p->len, 1, flags);
}

static void pin_dealloc(Pin *p)
{
    SharedCache *s = p->owner;
    if (s->fork_gen == fork_gen)
        __atomic_fetch_sub(&row_of(s, (uint64_t)s->row)[p->slab], 1, __ATOMIC_SEQ_CST);
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
        __atomic_fetch_sub(&row_of(s, (uint64_t)s->row)[slab], 1, __ATOMIC_SEQ_CST);
        return NULL;
    }
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
    if (s->held_ctl)
        PyBuffer_Release(&s->ctl);
    if (s->held_arena)
        PyBuffer_Release(&s->arena);
    if (s->held_index)
        PyBuffer_Release(&s->index);
    Py_CLEAR(s->keep);
    Py_TYPE(s)->tp_free((PyObject *)s);
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
    if (s->ctl.readonly) {
        PyErr_SetString(PyExc_ValueError, "the control region must be mapped writable");
        return -1;
    }
    if (PyObject_GetBuffer(arena, &s->arena, PyBUF_SIMPLE) < 0)
        return -1;
    s->held_arena = 1;
    struct header *shared = s->ctl.buf;
    if ((uint64_t)s->ctl.len < HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "control region shorter than its header");
        return -1;
    }
    if (create) {
        if (!layout(&s->h, slab_size, nslabs, n_extents, n_rows)) {
            PyErr_SetString(PyExc_ValueError, "shared cache sizes out of range");
            return -1;
        }
        if (s->h.total > (uint64_t)s->ctl.len) {
            PyErr_Format(PyExc_ValueError, "control region of %zd bytes; the layout needs %llu", s->ctl.len,
                         (unsigned long long)s->h.total);
            return -1;
        }
        memcpy(shared, &s->h, sizeof s->h);
    } else {
        struct header h = *shared;
        if (memcmp(h.magic, MAGIC, 8) || h.version != LAYOUT_VERSION) {
            PyErr_SetString(PyExc_ValueError, "not a dlfs shared cache (bad magic or layout version)");
            return -1;
        }
        /* Recomputed, not trusted: every section must be where these sizes put it. */
        if (!layout(&s->h, h.slab_size, h.nslabs, h.n_extents, h.n_rows) || memcmp(&s->h, &h, sizeof h) ||
            s->h.total > (uint64_t)s->ctl.len) {
            PyErr_SetString(PyExc_ValueError, "shared cache header is inconsistent with its region");
            return -1;
        }
    }
    if (s->h.nslabs * s->h.slab_size > (uint64_t)s->arena.len) {
        PyErr_SetString(PyExc_ValueError, "cache arena smaller than its slabs");
        return -1;
    }
    if (row >= (long)s->h.n_rows) {
        PyErr_Format(PyExc_ValueError, "row %ld outside 0..%u", row, s->h.n_rows - 1);
        return -1;
    }
    char *base = s->ctl.buf;
    s->gens = (uint64_t *)(base + s->h.gens);
    s->entries = (uint64_t *)(base + s->h.entries);
    s->offsets = (uint32_t *)(base + s->h.offsets);
    s->rows = (uint32_t *)(base + s->h.rows);
    s->mem = s->arena.buf;
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
        if (s->ix.n_extents != s->h.n_extents) {
            PyErr_SetString(PyExc_ValueError, "the index is not the one the shared cache was made for");
            return -1;
        }
    }
    return 0;
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

static uint64_t gen_of(SharedCache *s, uint64_t slab)
{
    return __atomic_load_n(&s->gens[slab], __ATOMIC_SEQ_CST) & (((uint64_t)1 << (64 - SLAB_BITS)) - 1);
}

/* The mount's side. */

static PyObject *shared_publish(SharedCache *s, PyObject *args)
{
    unsigned long long ext, slab, off;
    if (!PyArg_ParseTuple(args, "KKK", &ext, &slab, &off) || in_range(ext, s->h.n_extents, "extent") < 0 || in_range(slab, s->h.nslabs, "slab") < 0)
        return NULL;
    if (off >= s->h.slab_size) {
        PyErr_Format(PyExc_ValueError, "offset %llu outside a slab", off);
        return NULL;
    }
    /* The offset first: a client that sees the entry sees where it points. */
    __atomic_store_n(&s->offsets[ext], (uint32_t)off, __ATOMIC_RELEASE);
    __atomic_store_n(&s->entries[ext], (gen_of(s, slab) << SLAB_BITS) | (slab + 1), __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *shared_unpublish(SharedCache *s, PyObject *arg)
{
    unsigned long long ext;
    if (index_arg(arg, s->h.n_extents, "extent", &ext) < 0)
        return NULL;
    __atomic_store_n(&s->entries[ext], 0, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static uint64_t pins_on(SharedCache *s, uint64_t slab)
{
    uint64_t n = 0;
    for (uint64_t r = 0; r < s->max_row; r++)
        n += __atomic_load_n(&row_of(s, r)[slab], __ATOMIC_SEQ_CST);
    return n;
}

static PyObject *shared_retire(SharedCache *s, PyObject *arg)
{
    unsigned long long slab;
    if (index_arg(arg, s->h.nslabs, "slab", &slab) < 0)
        return NULL;
    __atomic_fetch_add(&s->gens[slab], 1, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(pins_on(s, slab) == 0);
}

static PyObject *shared_pinned(SharedCache *s, PyObject *arg)
{
    unsigned long long slab;
    if (index_arg(arg, s->h.nslabs, "slab", &slab) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(pins_on(s, slab));
}

static PyObject *shared_pin_for(SharedCache *s, PyObject *args)
{
    unsigned long row;
    unsigned long long slab;
    if (!PyArg_ParseTuple(args, "kK", &row, &slab) || in_range(row, s->h.n_rows, "row") < 0 || in_range(slab, s->h.nslabs, "slab") < 0)
        return NULL;
    if (row >= s->max_row)
        s->max_row = (uint32_t)row + 1;
    __atomic_fetch_add(&row_of(s, row)[slab], 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *shared_clear_row(SharedCache *s, PyObject *arg)
{
    unsigned long long row;
    if (index_arg(arg, s->h.n_rows, "row", &row) < 0)
        return NULL;
    if (row >= s->max_row)
        s->max_row = (uint32_t)row + 1;
    uint32_t *r = row_of(s, row);
    uint64_t freed = 0;
    for (uint64_t i = 0; i < s->h.nslabs; i++)
        freed += __atomic_exchange_n(&r[i], 0, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(freed);
}

static PyObject *shared_where(SharedCache *s, PyObject *arg)
{
    unsigned long long ext;
    if (index_arg(arg, s->h.n_extents, "extent", &ext) < 0)
        return NULL;
    uint64_t e = __atomic_load_n(&s->entries[ext], __ATOMIC_SEQ_CST);
    if (!e)
        Py_RETURN_NONE;
    return Py_BuildValue("KI", (unsigned long long)((e & SLAB_LIMIT) - 1), s->offsets[ext]);
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
    return 1;
}

/* Pin extent `ext` (raw bytes `len`) where it is now; 1 with *buf and *slab_out set, 0 if it is not in a slab. */
static int try_pin(SharedCache *s, uint64_t ext, uint32_t len, const char **buf, uint32_t *slab_out)
{
    uint64_t e = __atomic_load_n(&s->entries[ext], __ATOMIC_ACQUIRE);
    if (!e)
        return 0;
    uint64_t slab = (e & SLAB_LIMIT) - 1;
    if (slab >= s->h.nslabs)
        return 0;
    uint32_t *count = &row_of(s, (uint64_t)s->row)[slab];
    __atomic_fetch_add(count, 1, __ATOMIC_SEQ_CST);
    if (gen_of(s, slab) == e >> SLAB_BITS) {
        uint32_t off = __atomic_load_n(&s->offsets[ext], __ATOMIC_ACQUIRE);
        /* The entry again: the offset read belongs to it only if it did not change meanwhile. */
        if (__atomic_load_n(&s->entries[ext], __ATOMIC_SEQ_CST) == e && off <= s->h.slab_size &&
            len <= s->h.slab_size - off) {
            *buf = s->mem + slab * s->h.slab_size + off;
            *slab_out = (uint32_t)slab;
            return 1;
        }
    }
    __atomic_fetch_sub(count, 1, __ATOMIC_SEQ_CST);
    return 0;
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
            uint32_t child;
            if (!dlfs_ix_dir_ok(&s->ix, &node))
                return -EIO;
            int found = dlfs_ix_find(&s->ix, &node, name, (size_t)len, &child);
            if (found < 0)
                return -EIO;
            if (!found)
                return -ENOENT;
            ino = child;
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
    if (!try_pin(s, node.ref, ext.raw_len, &buf, &slab))
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
    if (!client_ok(s) || !PyArg_ParseTuple(args, "KKK", &slab, &off, &len) || in_range(slab, s->h.nslabs, "slab") < 0)
        return NULL;
    if (off > s->h.slab_size || len > s->h.slab_size - off) {
        /* The mount pinned it for us: a bad answer must still let go of the pin. */
        __atomic_fetch_sub(&row_of(s, (uint64_t)s->row)[slab], 1, __ATOMIC_SEQ_CST);
        PyErr_Format(PyExc_ValueError, "record of %llu bytes at %llu lies outside its slab", len, off);
        return NULL;
    }
    return view_of(s, (uint32_t)slab, s->mem + slab * s->h.slab_size + off, (Py_ssize_t)len);
}

static PyObject *shared_row_pins(SharedCache *s, PyObject *arg)
{
    unsigned long long row;
    if (index_arg(arg, s->h.n_rows, "row", &row) < 0)
        return NULL;
    uint64_t n = 0;
    uint32_t *r = row_of(s, row);
    for (uint64_t i = 0; i < s->h.nslabs; i++)
        n += __atomic_load_n(&r[i], __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *shared_get(SharedCache *s, void *which)
{
    switch ((intptr_t)which) {
    case 0:
        return PyLong_FromUnsignedLongLong(s->h.slab_size);
    case 1:
        return PyLong_FromUnsignedLongLong(s->h.nslabs);
    case 2:
        return PyLong_FromUnsignedLongLong(s->h.n_extents);
    case 3:
        return PyLong_FromUnsignedLong(s->h.n_rows);
    default:
        return PyLong_FromLong(s->row);
    }
}

static PyGetSetDef shared_getset[] = {
    {"slab_size", (getter)shared_get, NULL, "bytes per slab", (void *)0},
    {"nslabs", (getter)shared_get, NULL, "slabs in the arena", (void *)1},
    {"n_extents", (getter)shared_get, NULL, "extents of the index", (void *)2},
    {"n_rows", (getter)shared_get, NULL, "client rows of the pin table", (void *)3},
    {"row", (getter)shared_get, NULL, "this client's row (-1: the mount)", (void *)4},
    {NULL},
};

static PyMethodDef shared_methods[] = {
    {"publish", (PyCFunction)shared_publish, METH_VARARGS, "publish(ext, slab, offset): the record is in this slab."},
    {"unpublish", (PyCFunction)shared_unpublish, METH_O, "unpublish(ext): the record is no longer to be pinned."},
    {"retire", (PyCFunction)shared_retire, METH_O,
     "retire(slab) -> bool: no new pins on it; True if none are held (it may be reused now)."},
    {"pinned", (PyCFunction)shared_pinned, METH_O, "pinned(slab) -> pins held on it by every client."},
    {"pin_for", (PyCFunction)shared_pin_for, METH_VARARGS, "pin_for(row, slab): pin a slab for a client."},
    {"clear_row", (PyCFunction)shared_clear_row, METH_O,
     "clear_row(row) -> pins reclaimed: the client is gone (or new)."},
    {"where", (PyCFunction)shared_where, METH_O, "where(ext) -> (slab, offset) or None."},
    {"read_many", (PyCFunction)shared_read_many, METH_O,
     "read_many(paths) -> [memoryview | -errno | inode]: pinned views of the files in slabs; the rest "
     "as the inode to ask the mount for, or an errno."},
    {"take", (PyCFunction)shared_take, METH_VARARGS,
     "take(slab, offset, length) -> memoryview of a record the mount pinned for this client."},
    {"row_pins", (PyCFunction)shared_row_pins, METH_O, "row_pins(row) -> pins that row holds."},
    {NULL},
};

static PyTypeObject SharedCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dlfs._native.SharedCache",
    .tp_basicsize = sizeof(SharedCache),
    .tp_dealloc = (destructor)shared_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mount's shared chunk cache: its control region and arena (native/direct.c).",
    .tp_methods = shared_methods,
    .tp_getset = shared_getset,
    .tp_init = (initproc)shared_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *shared_size(PyObject *self, PyObject *args)
{
    unsigned long long slab_size, nslabs, n_extents, n_rows;
    struct header h;
    if (!PyArg_ParseTuple(args, "KKKK", &slab_size, &nslabs, &n_extents, &n_rows))
        return NULL;
    if (!layout(&h, slab_size, nslabs, n_extents, n_rows)) {
        PyErr_SetString(PyExc_ValueError, "shared cache sizes out of range");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(h.total);
}

/* Fault fresh memory in with the GIL released: this VM's first touch costs about 1 s per GB, which the
 * mount's event loop should not pay inside a read. */
static PyObject *populate(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long off, len;
    if (!PyArg_ParseTuple(args, "w*KK", &view, &off, &len))
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (off > (unsigned long long)view.len || len > (unsigned long long)view.len - off || off % page) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "populate: range outside the buffer, or not page-aligned");
        return NULL;
    }
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = madvise((char *)view.buf + off, len, MADV_POPULATE_WRITE);
    if (rc != 0) {
        err = errno;
        /* Before Linux 5.14: one write per page does the same. */
        if (err == EINVAL) {
            volatile char *p = (char *)view.buf + off;
            for (unsigned long long i = 0; i < len; i += (unsigned long long)page)
                p[i] = p[i];
            rc = err = 0;
        }
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
    {"populate", populate, METH_VARARGS,
     "populate(buffer, offset, length): fault the range in now, without the GIL (MADV_POPULATE_WRITE)."},
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
    if (PyModule_AddIntConstant(module, "SLAB_LIMIT", SLAB_LIMIT) < 0)
        return -1;
    return PyModule_AddFunctions(module, functions);
}
