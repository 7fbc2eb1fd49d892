/* CacheOwner: the mount's half of its shared chunk cache (layout and pin protocol: shm.h).
 *
 * It lays the control region out, publishes records into slabs and retires slabs, hands the pin table's
 * rows out to dlfs.direct clients and takes them back, and pins for a client over the control socket. It
 * also counts what the kernel was sent of each record (shm.h's dlfs_consume), for the serving threads
 * and the Python handlers alike, and queues the records that count completed for the cache to drop.
 * A client's half is CacheView (direct.c); only the mount makes a CacheOwner. */
#include "cacheregion.h" /* Python.h, before any system header */

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine.h"
#include "hash.h"
#include "module.h"
#include "remote.h"

#define CONSUMED_RING 65536 /* extents consumed and not yet dropped by the cache */
#define TAKE_BATCH 4096
#define LAND_MAX 4096 /* records of one window landed in C at most (a 4 MiB window of 1-byte files: 4,096) */

typedef struct {
    PyObject_HEAD
    struct dlfs_region r; /* first, as every half's (cacheregion.h) */
    struct dlfs_consume consume;
    int has_consume;
    uint32_t max_row; /* rows ever pinned through, the ones a retire must sum */
    uint64_t refused; /* refused pins and releases of the rows it cleared */
} CacheOwner;

static PyTypeObject CacheOwnerType;

static void owner_dealloc(CacheOwner *o)
{
    dlfs_region_release(&o->r);
    if (o->has_consume)
        dlfs_consume_free(&o->consume);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

/* Made whole or not at all: no method ever sees a half-made owner. */
static PyObject *owner_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"ctl", "arena", "slab_size", "nslabs", "n_extents", "n_rows", NULL};
    PyObject *ctl, *arena;
    unsigned long long slab_size, nslabs, n_extents, n_rows;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKKKK", names, &ctl, &arena, &slab_size, &nslabs, &n_extents,
                                     &n_rows))
        return NULL;
    CacheOwner *o = (CacheOwner *)type->tp_alloc(type, 0);
    if (!o)
        return NULL;
    if (dlfs_region_hold(&o->r, ctl, arena, 1) < 0 ||
        dlfs_region_create(&o->r, slab_size, nslabs, n_extents, n_rows) < 0)
        goto fail;
    if (dlfs_consume_init(&o->consume, n_extents, CONSUMED_RING) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    o->has_consume = 1;
    return (PyObject *)o;
fail:
    Py_DECREF(o);
    return NULL;
}

/* Record `ext` is whole in `slab` at `off`: published, and (published anew) nothing of it sent yet. */
static void publish_record(CacheOwner *o, uint64_t ext, uint64_t slab, uint32_t off)
{
    __atomic_store_n(&o->consume.served[ext], 0, __ATOMIC_RELAXED);
    dlfs_shm_publish(&o->r.shm, ext, slab, off);
}

static PyObject *owner_publish(CacheOwner *o, PyObject *args)
{
    unsigned long long ext, slab, off;
    if (!PyArg_ParseTuple(args, "KKK", &ext, &slab, &off) ||
        dlfs_in_range(ext, o->r.shm.h.n_extents, "extent") < 0 || dlfs_in_range(slab, o->r.shm.h.nslabs, "slab") < 0)
        return NULL;
    if (off >= o->r.shm.h.slab_size) {
        PyErr_Format(PyExc_ValueError, "offset %llu outside a slab", off);
        return NULL;
    }
    publish_record(o, ext, slab, (uint32_t)off);
    Py_RETURN_NONE;
}

static PyObject *owner_unpublish(CacheOwner *o, PyObject *arg)
{
    unsigned long long ext;
    if (dlfs_index_arg(arg, o->r.shm.h.n_extents, "extent", &ext) < 0)
        return NULL;
    dlfs_shm_unpublish(&o->r.shm, ext);
    Py_RETURN_NONE;
}

static PyObject *owner_retire(CacheOwner *o, PyObject *arg)
{
    unsigned long long slab;
    if (dlfs_index_arg(arg, o->r.shm.h.nslabs, "slab", &slab) < 0)
        return NULL;
    __atomic_fetch_add(&o->r.shm.gens[slab], 1, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(dlfs_shm_pins_on(&o->r.shm, slab, o->max_row) == 0);
}

static PyObject *owner_pinned(CacheOwner *o, PyObject *arg)
{
    unsigned long long slab;
    if (dlfs_index_arg(arg, o->r.shm.h.nslabs, "slab", &slab) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(dlfs_shm_pins_on(&o->r.shm, slab, o->max_row));
}

/* Rows up to `row` may hold pins from now on: retires must sum them. */
static void row_in_use(CacheOwner *o, uint64_t row)
{
    if (row >= o->max_row)
        o->max_row = (uint32_t)row + 1;
}

/* A (row, slab) pair of arguments, in range: 0, or -1 with an exception. */
static int row_slab_args(CacheOwner *o, PyObject *args, unsigned long *row, unsigned long long *slab)
{
    if (!PyArg_ParseTuple(args, "kK", row, slab) || dlfs_in_range(*row, o->r.shm.h.n_rows, "row") < 0 ||
        dlfs_in_range(*slab, o->r.shm.h.nslabs, "slab") < 0)
        return -1;
    return 0;
}

static PyObject *owner_pin_for(CacheOwner *o, PyObject *args)
{
    unsigned long row;
    unsigned long long slab;
    if (row_slab_args(o, args, &row, &slab) < 0)
        return NULL;
    row_in_use(o, row);
    __atomic_fetch_add(&dlfs_shm_row(&o->r.shm, row)[slab], 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *owner_unpin_for(CacheOwner *o, PyObject *args)
{
    unsigned long row;
    unsigned long long slab;
    if (row_slab_args(o, args, &row, &slab) < 0)
        return NULL;
    struct dlfs_pinner p = {row, dlfs_shm_epoch(&o->r.shm, row)};
    return PyBool_FromLong(dlfs_shm_unpin(&o->r.shm, p, (uint32_t)slab));
}

static PyObject *owner_hand_out(CacheOwner *o, PyObject *arg)
{
    unsigned long long row;
    if (dlfs_index_arg(arg, o->r.shm.h.n_rows, "row", &row) < 0)
        return NULL;
    row_in_use(o, row);
    return PyLong_FromUnsignedLongLong(dlfs_shm_hand_out(&o->r.shm, row));
}

static PyObject *owner_released(CacheOwner *o, PyObject *arg)
{
    unsigned long long row;
    if (dlfs_index_arg(arg, o->r.shm.h.n_rows, "row", &row) < 0)
        return NULL;
    return PyBool_FromLong(dlfs_shm_released(&o->r.shm, row));
}

static PyObject *owner_clear_row(CacheOwner *o, PyObject *arg)
{
    unsigned long long row;
    uint64_t refused;
    if (dlfs_index_arg(arg, o->r.shm.h.n_rows, "row", &row) < 0)
        return NULL;
    row_in_use(o, row);
    uint64_t freed = dlfs_shm_clear_row(&o->r.shm, row, &refused);
    o->refused += refused;
    return PyLong_FromUnsignedLongLong(freed);
}

static PyObject *owner_where(CacheOwner *o, PyObject *arg)
{
    const struct dlfs_shm *shm = &o->r.shm;
    unsigned long long ext;
    if (dlfs_index_arg(arg, shm->h.n_extents, "extent", &ext) < 0)
        return NULL;
    uint64_t e = __atomic_load_n(&shm->entries[ext], __ATOMIC_SEQ_CST);
    uint64_t slab = (e & DLFS_SHM_SLAB_LIMIT) - 1;
    uint32_t off = __atomic_load_n(&shm->offsets[ext], __ATOMIC_SEQ_CST);
    /* Shared memory: a slab or offset out of range is no place to pin or read. */
    if (!e || slab >= shm->h.nslabs || off >= shm->h.slab_size)
        Py_RETURN_NONE;
    return Py_BuildValue("KI", (unsigned long long)slab, off);
}

static PyObject *owner_served(CacheOwner *o, PyObject *args)
{
    unsigned long long ext;
    unsigned int n, len;
    if (!PyArg_ParseTuple(args, "KII", &ext, &n, &len) || dlfs_in_range(ext, o->r.shm.h.n_extents, "extent") < 0)
        return NULL;
    return PyBool_FromLong(dlfs_consume_add(&o->consume, ext, n, len));
}

static PyObject *owner_reset_served(CacheOwner *o, PyObject *arg)
{
    unsigned long long ext;
    if (dlfs_index_arg(arg, o->r.shm.h.n_extents, "extent", &ext) < 0)
        return NULL;
    __atomic_store_n(&o->consume.served[ext], 0, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* set_pending(exts, on): the cache starts (or ends) fetching these records; READs of them wait in C meanwhile. */
static PyObject *owner_set_pending(CacheOwner *o, PyObject *args)
{
    PyObject *exts;
    int on;
    if (!PyArg_ParseTuple(args, "Op", &exts, &on))
        return NULL;
    PyObject *seq = PySequence_Fast(exts, "set_pending takes a sequence of extents");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long ext;
        if (dlfs_index_arg(items[i], o->r.shm.h.n_extents, "extent", &ext) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        dlfs_consume_set_pending(&o->consume, ext, on);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* One record of a window landing: where its stored bytes lie in the slab, and their checksum. */
struct landing {
    uint64_t ext, at, sum;
    uint32_t len;
};

/* The records of a window landing at `at` of `slab` (`nbytes`): (ext, its offset in the slab, stored length,
 * checksum) each, checked against the slab and the index; NULL with the exception set. */
static struct landing *landing_of(CacheOwner *o, PyObject *records, unsigned long long slab, unsigned long long at,
                                  unsigned long long nbytes, Py_ssize_t *count)
{
    if (dlfs_in_range(slab, o->r.shm.h.nslabs, "slab") < 0)
        return NULL;
    uint64_t slab_size = o->r.shm.h.slab_size;
    if (at > slab_size || nbytes > slab_size - at) {
        PyErr_Format(PyExc_ValueError, "%llu bytes at %llu outside a slab of %llu", nbytes, at,
                     (unsigned long long)slab_size);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(records, "land takes a sequence of records");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > LAND_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "a window of %zd records (1 to %d)", n, LAND_MAX);
        return NULL;
    }
    struct landing *recs = PyMem_Malloc((size_t)n * sizeof *recs);
    if (!recs) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long ext, rat, sum;
        unsigned int len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKIK;a record is (ext, at, length, checksum)", &ext,
                              &rat, &len, &sum) ||
            dlfs_in_range(ext, o->r.shm.h.n_extents, "extent") < 0) {
            PyMem_Free(recs);
            Py_DECREF(seq);
            return NULL;
        }
        if (rat > slab_size || len > slab_size - rat) {
            PyMem_Free(recs);
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "record %llu (%u bytes at %llu) outside a slab", ext, len, rat);
            return NULL;
        }
        recs[i] = (struct landing){.ext = ext, .at = rat, .sum = sum, .len = len};
    }
    Py_DECREF(seq);
    *count = n;
    return recs;
}

/* With no GIL: each record of a window whose bytes up to `end` of the slab at `base` are in, checked (xxh3
 * of its stored bytes) and, if every one is good, published and the READs parked for them answered at
 * once. The first record short or failing its check (nothing published then), else -1. */
static Py_ssize_t land_checked(CacheOwner *o, char *base, uint64_t slab, uint64_t end, const struct landing *recs,
                               Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (recs[i].at + recs[i].len > end || dlfs_xxh3(base + recs[i].at, recs[i].len) != recs[i].sum)
            return i;
    for (Py_ssize_t i = 0; i < n; i++)
        publish_record(o, recs[i].ext, slab, (uint32_t)recs[i].at);
    dlfs_engine_wake();
    return -1;
}

/* land(fd, offset, nbytes, slab, at, records) -> (read, bad): a window read from a chunk file straight
 * into its slab and, all with no GIL, its records checked and published and their parked READs answered
 * (land_checked: the disk's thread, not the event loop's turn). `records`: (ext, its offset in the slab,
 * stored length, checksum) each, uncompressed. `read`: bytes read (fewer than asked at the file's end);
 * `bad`: the first record short or failing its check (nothing is published then: the caller reads the
 * window its own way), else -1. OSError as pread. */
static PyObject *owner_land(CacheOwner *o, PyObject *args)
{
    int fd;
    unsigned long long off, nbytes, slab, at;
    PyObject *records;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKKKKO", &fd, &off, &nbytes, &slab, &at, &records))
        return NULL;
    struct landing *recs = landing_of(o, records, slab, at, nbytes, &n);
    if (!recs)
        return NULL;
    char *base = (char *)o->r.shm.mem + slab * o->r.shm.h.slab_size;
    uint64_t got = 0;
    Py_ssize_t bad = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < nbytes) {
        ssize_t r = pread(fd, base + at + got, nbytes - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            err = errno;
            break;
        }
        if (r == 0)
            break; /* the file's end: records past it are short */
        got += (uint64_t)r;
    }
    if (!err)
        bad = land_checked(o, base, slab, at + got, recs, n);
    Py_END_ALLOW_THREADS
    PyMem_Free(recs);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("Kn", (unsigned long long)got, bad);
}

/* land_remote(chunk, id, offset, nbytes, slab, at, records) -> bad, or None: land's window
 * fetched from the data daemon the serving threads' route names for chunk number `chunk` (`id`), on one of
 * their connections (remote.h), straight into the slab, then checked and published as land's. None where
 * it was not fetched so (no route or idle connection, an error, a bound passed): the caller fetches it
 * its own way, which says what went wrong. Blocks (no GIL) for the fetch, bounded. */
static PyObject *owner_land_remote(CacheOwner *o, PyObject *args)
{
    unsigned long long chunk, off, nbytes, slab, at;
    const uint8_t *id;
    Py_ssize_t id_len, n;
    PyObject *records;
    if (!PyArg_ParseTuple(args, "Ky#KKKKO", &chunk, &id, &id_len, &off, &nbytes, &slab, &at, &records))
        return NULL;
    if (id_len != DLFS_CHUNK_ID)
        return PyErr_Format(PyExc_ValueError, "a chunk id is %d bytes, not %zd", DLFS_CHUNK_ID, id_len);
    struct landing *recs = landing_of(o, records, slab, at, nbytes, &n); /* nbytes within a slab: a uint32_t */
    if (!recs)
        return NULL;
    char *base = (char *)o->r.shm.mem + slab * o->r.shm.h.slab_size;
    Py_ssize_t bad = -1;
    int got;
    Py_BEGIN_ALLOW_THREADS
    got = dlfs_remote_range(chunk, id, off, (uint32_t)nbytes, base + at, NULL);
    if (got == 0)
        bad = land_checked(o, base, slab, at + nbytes, recs, n);
    Py_END_ALLOW_THREADS
    PyMem_Free(recs);
    if (got < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(bad);
}

static PyObject *owner_take_consumed(CacheOwner *o, PyObject *unused)
{
    uint32_t got[TAKE_BATCH];
    uint32_t n = dlfs_consume_take(&o->consume, got, TAKE_BATCH);
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

static PyObject *owner_take_hints(CacheOwner *o, PyObject *unused)
{
    uint64_t got[DLFS_HINTS_MAX];
    uint32_t n = dlfs_consume_take_hints(&o->consume, got);
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out && i < n; i++) {
        PyObject *v = Py_BuildValue("(kk)", (unsigned long)(got[i] >> 32), (unsigned long)(got[i] & 0xffffffffu));
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *owner_consumed_fd(CacheOwner *o, void *unused)
{
    return PyLong_FromLong(o->consume.wake_fd);
}

static PyObject *owner_consumed_dropped(CacheOwner *o, void *unused)
{
    pthread_mutex_lock(&o->consume.lock); /* counted under it by the serving threads */
    uint64_t n = o->consume.dropped;
    pthread_mutex_unlock(&o->consume.lock);
    return PyLong_FromUnsignedLongLong(n);
}

/* Pins and releases refused (shm.h) in rows still in use, and in those cleared before. */
static PyObject *owner_refused_releases(CacheOwner *o, void *unused)
{
    uint64_t n = o->refused;
    for (uint64_t r = 0; r < o->max_row; r++)
        n += __atomic_load_n(&dlfs_shm_row_head(&o->r.shm, r)->refused, __ATOMIC_RELAXED);
    return PyLong_FromUnsignedLongLong(n);
}

static PyGetSetDef owner_getset[] = {
    DLFS_REGION_GETSET,
    {"consumed_fd", (getter)owner_consumed_fd, NULL, "an eventfd, readable while consumed extents wait", NULL},
    {"consumed_dropped", (getter)owner_consumed_dropped, NULL, "consumed extents the full queue could not hold",
     NULL},
    {"refused_releases", (getter)owner_refused_releases, NULL,
     "pins and releases refused (of an earlier attachment, or below zero)", NULL},
    {NULL},
};

static PyMethodDef owner_methods[] = {
    DLFS_REGION_METHODS,
    {"publish", (PyCFunction)owner_publish, METH_VARARGS, "publish(ext, slab, offset): the record is in this slab."},
    {"unpublish", (PyCFunction)owner_unpublish, METH_O, "unpublish(ext): the record is no longer to be pinned."},
    {"retire", (PyCFunction)owner_retire, METH_O,
     "retire(slab) -> bool: no new pins on it; True if none are held (it may be reused now)."},
    {"pinned", (PyCFunction)owner_pinned, METH_O, "pinned(slab) -> pins held on it by every client."},
    {"pin_for", (PyCFunction)owner_pin_for, METH_VARARGS, "pin_for(row, slab): pin a slab for a client."},
    {"unpin_for", (PyCFunction)owner_unpin_for, METH_VARARGS,
     "unpin_for(row, slab) -> bool: let go of a pin taken for a client that never received it."},
    {"hand_out", (PyCFunction)owner_hand_out, METH_O, "hand_out(row) -> epoch: the row belongs to a new attachment."},
    {"released", (PyCFunction)owner_released, METH_O,
     "released(row) -> bool: the row's owner holds no view of it and takes no more pins."},
    {"clear_row", (PyCFunction)owner_clear_row, METH_O,
     "clear_row(row) -> pins reclaimed: its owner released it or is gone."},
    {"where", (PyCFunction)owner_where, METH_O, "where(ext) -> (slab, offset) or None."},
    {"served", (PyCFunction)owner_served, METH_VARARGS,
     "served(ext, n, raw_len) -> bool: n more bytes of the record went to the kernel; True if that completed it."},
    {"reset_served", (PyCFunction)owner_reset_served, METH_O,
     "reset_served(ext): the record is kept anew (outside a slab): nothing of it has been sent."},
    {"set_pending", (PyCFunction)owner_set_pending, METH_VARARGS,
     "set_pending(exts, on): these records are (no longer) being fetched; the engine parks READs of them."},
    {"land", (PyCFunction)owner_land, METH_VARARGS,
     "land(fd, offset, nbytes, slab, at, records) -> (read, bad): a window read into its slab, its records "
     "(ext, at, length, checksum) checked and, all good, published and their parked READs answered, with no GIL."},
    {"land_remote", (PyCFunction)owner_land_remote, METH_VARARGS,
     "land_remote(chunk, id, offset, nbytes, slab, at, records) -> bad or None: land's window fetched "
     "from a data daemon on the serving threads' connections (None: not fetched so)"},
    {"take_consumed", (PyCFunction)owner_take_consumed, METH_NOARGS,
     "take_consumed() -> [ext]: records the serving threads completed, for the cache to drop."},
    {"take_hints", (PyCFunction)owner_take_hints, METH_NOARGS,
     "take_hints() -> [(ino, ext)]: files read in order whose next record is neither cached nor coming."},
    {NULL},
};

static PyTypeObject CacheOwnerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dlfs._native.CacheOwner",
    .tp_basicsize = sizeof(CacheOwner),
    .tp_dealloc = (destructor)owner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CacheOwner(ctl, arena, slab_size, nslabs, n_extents, n_rows): the mount's half of its shared chunk "
              "cache. Lays the control region `ctl` (a writable mapping) out for the arena's slabs, publishes "
              "records and retires slabs, hands pin rows out and takes them back, counts what the kernel was sent.",
    .tp_methods = owner_methods,
    .tp_getset = owner_getset,
    .tp_new = owner_new,
};

/* For the serving engine: the mount's cache, with a row of its own counted in every retire. */
int dlfs_shared_cache_of(PyObject *obj, uint64_t row, struct dlfs_shm **shm, struct dlfs_consume **consume)
{
    if (!PyObject_TypeCheck(obj, &CacheOwnerType)) {
        PyErr_SetString(PyExc_TypeError, "expected the mount's dlfs._native.CacheOwner");
        return -1;
    }
    CacheOwner *o = (CacheOwner *)obj;
    if (dlfs_in_range(row, o->r.shm.h.n_rows, "row") < 0)
        return -1;
    row_in_use(o, row);
    *shm = &o->r.shm;
    *consume = &o->consume;
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

/* Keep a mapping's pages in memory (mlock), with the GIL released: they are read in first. */
static PyObject *lock_pages(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = view.len ? mlock(view.buf, (size_t)view.len) : 0;
    if (rc)
        err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"lock_pages", lock_pages, METH_O,
     "lock_pages(buffer): keep the pages of a mapping in memory (mlock); OSError where the kernel refuses "
     "(RLIMIT_MEMLOCK, memory)."},
    {"populate", (PyCFunction)(void (*)(void))populate, METH_VARARGS | METH_KEYWORDS,
     "populate(buffer, offset, length, *, fallback=False): fault the range in now, without the GIL and without "
     "writing to it (MADV_POPULATE_WRITE; else, or with `fallback` (tests), a read of each page)."},
    {"shared_size", shared_size, METH_VARARGS,
     "shared_size(slab_size, nslabs, n_extents, n_rows) -> bytes of the control region."},
    {NULL},
};

int dlfs_owner_add_types(PyObject *module)
{
    if (PyType_Ready(&CacheOwnerType) < 0)
        return -1;
    Py_INCREF(&CacheOwnerType);
    if (PyModule_AddObject(module, "CacheOwner", (PyObject *)&CacheOwnerType) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "SLAB_LIMIT", DLFS_SHM_SLAB_LIMIT) < 0 ||
        PyModule_AddIntConstant(module, "LAND_MAX", LAND_MAX) < 0)
        return -1;
    return PyModule_AddFunctions(module, functions);
}
