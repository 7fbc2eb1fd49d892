/* dlfs._native: the C helper of dlfs. Loaded with RTLD_GLOBAL before pyfuse3 (see dlfs/native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "engine.h"
#include "fusehook.h"
#include "module.h"
#include "rangeserve.h"
#include "diskcache.h"
#include "remote.h"

static PyObject *fuse_hooked(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlfs_fuse_hooked());
}

int dlfs_index_from_sections(PyObject *sections, Py_buffer *view, struct dlfs_ix *ix)
{
    PyObject *map;
    unsigned long long inodes, dirents, names, extents, n_inodes, n_dirents, names_size, n_extents, chunks, n_chunks;
    if (!PyArg_ParseTuple(sections, "OKKKKKKKKKK;sections must be dlfs.format.index.Sections", &map, &inodes,
                          &dirents, &names, &extents, &n_inodes, &n_dirents, &names_size, &n_extents, &chunks,
                          &n_chunks))
        return -1;
    if (PyObject_GetBuffer(map, view, PyBUF_SIMPLE) < 0)
        return -1;
    /* Every section must lie inside the mapping, whatever the caller passed. */
    if (dlfs_ix_init(ix, view->buf, (uint64_t)view->len, inodes, dirents, names, extents, n_inodes, n_dirents,
                     names_size, n_extents, chunks, n_chunks) < 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "index sections do not match the mapping or its header");
        return -1;
    }
    return 0;
}

/* What the engine serves from, kept alive (the index mapping cannot be closed under C) until the
 * session is destroyed. */
static struct {
    Py_buffer index;
    int held;
    PyObject *shared;
    PyObject *xattr_name, *xattr_value; /* bytes; the engine points into them */
    int local_dir;
    struct dlfs_sums *sums;
    struct dlfs_chunk_files *files;
} kept = {.local_dir = -1};

static void release_kept(void)
{
    dlfs_serve_local_free(kept.local_dir, kept.sums, kept.files); /* not handed to the engine yet: ours to close */
    kept.local_dir = -1;
    kept.sums = NULL;
    kept.files = NULL;
    if (kept.held)
        PyBuffer_Release(&kept.index);
    kept.held = 0;
    Py_CLEAR(kept.shared);
    Py_CLEAR(kept.xattr_name);
    Py_CLEAR(kept.xattr_value);
}

/* The serve struct for `sections` and these settings (no shared cache); -1 with an exception. */
static int serve_from(PyObject *sections, double timeout, PyObject *xname, PyObject *xvalue, PyObject *local_dir,
                      Py_buffer *view, struct dlfs_serve *sv)
{
    memset(sv, 0, sizeof *sv);
    sv->local_dir = -1;
    if (local_dir != Py_None && !PyBytes_Check(local_dir)) {
        PyErr_SetString(PyExc_TypeError, "local_dir must be bytes (this machine's chunk directory) or None");
        return -1;
    }
    if (xname != Py_None && (!PyBytes_Check(xname) || !PyBytes_Check(xvalue) ||
                             memchr(PyBytes_AS_STRING(xname), 0, PyBytes_GET_SIZE(xname)))) {
        PyErr_SetString(PyExc_TypeError, "xattr_name and xattr_value must be bytes (the name without NUL)");
        return -1;
    }
    if (timeout < 0 || timeout > 1e9) {
        PyErr_SetString(PyExc_ValueError, "timeout must be 0..1e9 s");
        return -1;
    }
    if (dlfs_index_from_sections(sections, view, &sv->ix) < 0)
        return -1;
    if (xname != Py_None) {
        sv->xattr_name = PyBytes_AS_STRING(xname);
        sv->xattr_value = PyBytes_AS_STRING(xvalue);
        sv->xattr_len = (uint32_t)PyBytes_GET_SIZE(xvalue);
    }
    sv->timeout_s = (uint64_t)timeout;
    sv->timeout_ns = (uint32_t)((timeout - (double)sv->timeout_s) * 1e9);
    if (local_dir != Py_None) {
        sv->local_dir = open(PyBytes_AS_STRING(local_dir), O_PATH | O_DIRECTORY | O_CLOEXEC);
        sv->sums = sv->local_dir >= 0 ? malloc(sizeof *sv->sums) : NULL;
        sv->files = sv->sums ? malloc(sizeof *sv->files) : NULL;
        if (!sv->files || dlfs_chunk_files_init(sv->files, dlfs_chunk_files_budget()) < 0) {
            free(sv->files);
            free(sv->sums);
            if (sv->local_dir >= 0) {
                close(sv->local_dir);
                PyErr_NoMemory();
            } else {
                PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, local_dir);
            }
            PyBuffer_Release(view);
            return -1;
        }
        dlfs_sums_init(sv->sums);
    }
    return 0;
}

int dlfs_engine_halt(int release)
{
    static int reported;
    int held = Py_IsInitialized() && PyGILState_Check(), left;
    PyThreadState *ts = held ? PyEval_SaveThread() : NULL;
    left = release ? dlfs_engine_release() : dlfs_engine_stop();
    if (ts)
        PyEval_RestoreThread(ts);
    if (left > reported && held) {
        reported = left;
        /* Into the mount's log, through dlfs's logging: the process goes on to exit all the same. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *log = PyImport_ImportModule("logging");
        PyObject *r = log ? PyObject_CallMethod(log, "getLogger", "s", "dlfs.native") : NULL;
        PyObject *w = r ? PyObject_CallMethod(r, "error", "sii",
                                              "%d serving thread(s) still busy %d s after the unmount (stuck in I/O: "
                                              "a failing disk?) were abandoned; the mount's memory is kept until exit",
                                              left, DLFS_STOP_SECONDS)
                        : NULL;
        Py_XDECREF(w);
        Py_XDECREF(r);
        Py_XDECREF(log);
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    return left;
}

static PyObject *engine_start(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"sections", "shared", "row", "timeout", "threads", "io_uring", "xattr_name",
                            "xattr_value", "local_dir", "bulk", NULL};
    PyObject *sections, *shared = Py_None, *xname = Py_None, *xvalue = Py_None, *local_dir = Py_None;
    unsigned long long row = 0;
    double timeout = 0;
    int threads = 1, uring = 0, bulk = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O|$KdipOOOp", names, &PyTuple_Type, &sections, &shared, &row,
                                     &timeout, &threads, &uring, &xname, &xvalue, &local_dir, &bulk))
        return NULL;
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "threads must be at least 1");
        return NULL;
    }
    if (kept.held || kept.shared) {
        PyErr_SetString(PyExc_RuntimeError, "the serving engine is already running");
        return NULL;
    }
    struct dlfs_serve sv;
    if (serve_from(sections, timeout, xname, xvalue, local_dir, &kept.index, &sv) < 0)
        return NULL;
    kept.held = 1;
    kept.local_dir = sv.local_dir; /* ours until the engine has started, then the engine's */
    kept.sums = sv.sums;
    kept.files = sv.files;
    if (shared != Py_None) {
        struct dlfs_shm *shm;
        struct dlfs_consume *consume;
        if (dlfs_shared_cache_of(shared, row, &shm, &consume) < 0) {
            release_kept();
            return NULL;
        }
        if (shm->h.n_extents != sv.ix.n_extents) {
            release_kept();
            PyErr_SetString(PyExc_ValueError, "the shared cache was made for another index");
            return NULL;
        }
        sv.shm = shm;
        sv.consume = consume;
        sv.pin = (struct dlfs_pinner){row, dlfs_shm_epoch(shm, row)};
        Py_INCREF(shared);
        kept.shared = shared;
    }
    if (xname != Py_None) { /* the engine points into them */
        Py_INCREF(xname);
        Py_INCREF(xvalue);
        kept.xattr_name = xname;
        kept.xattr_value = xvalue;
    }
    if (dlfs_engine_start(&sv, threads, uring, bulk) < 0) {
        int err = errno;
        release_kept();
        if (err == ENOTCONN)
            Py_RETURN_FALSE; /* pyfuse3 kept the device: it serves everything */
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    kept.local_dir = -1;
    kept.sums = NULL;
    kept.files = NULL;
    Py_RETURN_TRUE;
}

/* One request through answer.c, as a serving thread would take it (for tests of the C side). */
static PyObject *answer(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"sections", "request", "timeout", "xattr_name", "xattr_value", "local_dir", "ring", NULL};
    PyObject *sections, *xname = Py_None, *xvalue = Py_None, *local_dir = Py_None;
    Py_buffer req;
    double timeout = 1.0;
    int ring = 0; /* as a FUSE-over-io_uring queue takes it: another machine's record fetched into the reply's buffer */
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!y*|$dOOOp", names, &PyTuple_Type, &sections, &req, &timeout, &xname,
                                     &xvalue, &local_dir, &ring))
        return NULL;
    Py_buffer view;
    struct dlfs_serve sv;
    if (serve_from(sections, timeout, xname, xvalue, local_dir, &view, &sv) < 0) {
        PyBuffer_Release(&req);
        return NULL;
    }
    static char scratch[DLFS_REPLY_SCRATCH];
    struct dlfs_reply rp;
    struct dlfs_counters c;
    memset(&rp, 0, sizeof rp);
    memset(&c, 0, sizeof c);
    rp.scratch = scratch;
    rp.scratch_size = sizeof scratch;
    const struct fuse_in_header *in = req.buf;
    int r = DLFS_FORWARD, op_len;
    size_t n = (size_t)req.len;
    if (n >= sizeof *in && in->len == n && (op_len = dlfs_op_len(in->opcode)) >= 0 && n - sizeof *in >= (size_t)op_len) {
        const char *body = (const char *)req.buf + sizeof *in;
        struct dlfs_req rq = {in, body, (uint32_t)op_len, body + op_len, (uint32_t)(n - sizeof *in - op_len)};
        static char payload[DLFS_URING_PAYLOAD];
        rp.async_records = ring;
        rp.async_max = sizeof payload;
        Py_BEGIN_ALLOW_THREADS /* a fetch from a data daemon (remote.h) may wait: that daemon may be this process's */
        r = dlfs_answer(&sv, &rq, &rp, &c);
        if (r == DLFS_RECORD) { /* uring.c: its own read from the disk first, else this */
            r = dlfs_record_fetch(&sv, &rp, in->unique, rp.record_ext, payload, sizeof payload, &c);
            if (r == DLFS_RECORD) { /* this machine's: read here and now */
                rp.async_records = 0;
                r = dlfs_answer(&sv, &rq, &rp, &c);
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyObject *out;
    if (r == DLFS_ANSWERED) {
        PyObject *reply = PyBytes_FromStringAndSize(NULL, rp.out.len);
        if (reply) {
            char *p = PyBytes_AS_STRING(reply);
            for (int i = 0; i < rp.n; i++) {
                memcpy(p, rp.iov[i].iov_base, rp.iov[i].iov_len);
                p += rp.iov[i].iov_len;
            }
        }
        dlfs_reply_done(&sv, &rp, 1);
        out = reply ? Py_BuildValue("(sN)", "answered", reply) : NULL;
    } else {
        out = Py_BuildValue("(sy)", r == DLFS_FORWARD ? "forward" : r == DLFS_PARK ? "park" : "no_reply", "");
    }
    dlfs_serve_local_free(sv.local_dir, sv.sums, sv.files);
    PyBuffer_Release(&view);
    PyBuffer_Release(&req);
    if (out) { /* what the request cost, for tests of the counters */
        PyObject *counts = Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "block_reads", c.block_reads,
                                         "block_bytes", c.block_bytes, "block_failures", c.block_failures,
                                         "record_reads", c.record_reads, "record_bytes", c.record_bytes,
                                         "record_failures", c.record_failures, "remote_reads", c.remote_reads,
                                         "remote_failures", c.remote_failures, "disk_cache_reads", c.disk_cache_reads);
        PyObject *both = counts ? PyTuple_Pack(3, PyTuple_GET_ITEM(out, 0), PyTuple_GET_ITEM(out, 1), counts) : NULL;
        Py_XDECREF(counts);
        Py_DECREF(out);
        out = both;
    }
    return out;
}

static PyObject *set_scan(PyObject *self, PyObject *on)
{
    int v = PyObject_IsTrue(on);
    if (v < 0)
        return NULL;
    dlfs_set_scan(v);
    Py_RETURN_NONE;
}

static PyObject *engine_stats(PyObject *self, PyObject *unused)
{
    struct dlfs_engine_stats s;
    dlfs_engine_stats(&s);
    static const char *uring[] = {"off", "registering", "serving"};
    const char *state = s.uring_state >= 0 && s.uring_state <= 2 ? uring[s.uring_state] : strerror(-s.uring_state);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:s,s:O,s:K,s:O,s:O,s:O,s:K}",
        "parked", s.c.parked, "parked_answered", s.c.parked_answered, "parked_forwarded", s.c.parked_forwarded,
        "records_ahead", s.c.records_ahead, "records_ahead_used", s.c.records_ahead_used,
        "requests", s.c.requests, "block_reads", s.c.block_reads, "block_bytes", s.c.block_bytes, "block_failures",
        s.c.block_failures, "record_reads", s.c.record_reads, "record_bytes", s.c.record_bytes, "record_failures",
        s.c.record_failures, "remote_reads", s.c.remote_reads, "remote_bytes", s.c.remote_bytes, "remote_failures",
        s.c.remote_failures, "disk_cache_reads", s.c.disk_cache_reads, "disk_cache_bytes", s.c.disk_cache_bytes,
        "answered", s.c.answered, "forwarded", s.c.forwarded, "lookups", s.c.lookups, "getattrs", s.c.getattrs,
        "readdirs", s.c.readdirs, "ioctls", s.c.ioctls, "opens", s.c.opens, "reads", s.c.reads, "read_bytes",
        s.c.read_bytes, "read_misses", s.c.read_misses, "corrupt", s.c.corrupt, "threads", s.threads, "uring_queues",
        s.uring_queues, "queued_max", s.queued_max, "write_errors", s.write_errors, "python_replies",
        s.python_replies, "chunk_files_opened", s.chunk_files_opened, "io_uring", state, "ended", s.ended ? Py_True : Py_False, "abandoned", s.abandoned,
        "answering", dlfs_engine_answering() ? Py_True : Py_False, "direct_mmap", s.direct_mmap ? Py_True : Py_False,
        "scan", dlfs_scan_mode() ? Py_True : Py_False, "miss_readers", (unsigned long long)dlfs_miss_readers());
}

static PyObject *remote_route(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = b.len % sizeof(uint16_t) ? (errno = EINVAL, -1) : dlfs_remote_route(b.buf, (uint64_t)b.len / sizeof(uint16_t));
    PyBuffer_Release(&b);
    return rc < 0 ? PyErr_SetFromErrno(PyExc_OSError) : (Py_INCREF(Py_None), Py_None);
}

/* (chunk, value) from `args` given to `set` (one chunk's entry of a per-chunk table): None, or OSError. */
static PyObject *set_chunk_entry(PyObject *args, int (*set)(uint64_t chunk, unsigned value))
{
    unsigned long long chunk;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "KI", &chunk, &value))
        return NULL;
    if (set(chunk, value) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *remote_route_set(PyObject *self, PyObject *args)
{
    return set_chunk_entry(args, dlfs_remote_route_set);
}

static PyObject *remote_add(PyObject *self, PyObject *args)
{
    unsigned slot;
    int fd;
    if (!PyArg_ParseTuple(args, "Ii", &slot, &fd))
        return NULL;
    if (dlfs_remote_add(slot, fd) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *remote_node_stats(PyObject *self, PyObject *arg)
{
    unsigned long slot = PyLong_AsUnsignedLong(arg);
    if (slot == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    struct dlfs_remote_node_stats s;
    dlfs_remote_node_stats((unsigned)slot, &s);
    return Py_BuildValue("{s:I,s:K,s:K,s:K,s:K,s:K,s:K}", "open", s.open, "wanted", s.wanted, "lost", s.lost, "reads",
                         s.reads, "bytes", s.bytes, "failures", s.failures, "timeouts", s.timeouts);
}

static PyObject *remote_wait(PyObject *self, PyObject *args)
{
    unsigned ms = 0;
    if (!PyArg_ParseTuple(args, "|I", &ms))
        return NULL;
    return PyLong_FromUnsignedLong(PyTuple_GET_SIZE(args) ? dlfs_remote_wait(ms) : dlfs_remote_wait_now());
}

static PyObject *remote_close(PyObject *self, PyObject *unused)
{
    if (dlfs_engine_running())
        return PyErr_Format(PyExc_RuntimeError, "the serving threads still fetch: stop the engine first");
    dlfs_remote_close();
    Py_RETURN_NONE;
}

static PyObject *dcache_open(PyObject *self, PyObject *args)
{
    PyObject *path;
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "O&K", PyUnicode_FSConverter, &path, &n))
        return NULL;
    int rc = dlfs_dcache_open(PyBytes_AS_STRING(path), n);
    PyObject *err = rc < 0 ? PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path) : NULL;
    Py_DECREF(path);
    return rc < 0 ? err : (Py_INCREF(Py_None), Py_None);
}

static PyObject *dcache_set(PyObject *self, PyObject *args)
{
    return set_chunk_entry(args, dlfs_dcache_set);
}

static PyObject *dcache_used(PyObject *self, PyObject *unused)
{
    enum { BATCH = 4096 };
    uint64_t got[BATCH];
    PyObject *out = PyList_New(0);
    for (uint64_t k = BATCH; out && k == BATCH;) {
        k = dlfs_dcache_used(got, BATCH);
        for (uint64_t i = 0; i < k && out; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(got[i]);
            if (!v || PyList_Append(out, v) < 0)
                Py_CLEAR(out);
            Py_XDECREF(v);
        }
    }
    return out;
}

static PyObject *dcache_keep(PyObject *self, PyObject *unused)
{
    if (dlfs_dcache_keep() < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* dcache_take's callback: each kept record appended to the list as (chunk, offset, bytearray). */
static void take_one(void *arg, uint64_t chunk, uint64_t offset, const char *data, uint32_t len)
{
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *list = *(PyObject **)arg;
    PyObject *item = list ? Py_BuildValue("(KKN)", (unsigned long long)chunk, (unsigned long long)offset,
                                          PyByteArray_FromStringAndSize(data, len)) : NULL;
    if (!item || PyList_Append(list, item) < 0)
        PyErr_Clear(); /* out of memory: that record is not kept, nothing else changes */
    Py_XDECREF(item);
    PyGILState_Release(g);
}

static PyObject *dcache_take(PyObject *self, PyObject *arg)
{
    unsigned long ms = PyLong_AsUnsignedLong(arg);
    if (ms == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    int n;
    Py_BEGIN_ALLOW_THREADS /* the wait, and the copies (each takes the GIL for its bytearray) */
    n = dlfs_dcache_take((unsigned)ms, take_one, &list);
    Py_END_ALLOW_THREADS
    if (n < 0) {
        Py_DECREF(list);
        Py_RETURN_NONE;
    }
    return list;
}

static PyObject *dcache_keep_end(PyObject *self, PyObject *unused)
{
    dlfs_dcache_keep_end();
    Py_RETURN_NONE;
}

static PyObject *dcache_keep_stats(PyObject *self, PyObject *unused)
{
    uint64_t kept, dropped;
    dlfs_dcache_keep_stats(&kept, &dropped);
    return Py_BuildValue("{s:K,s:K}", "kept", (unsigned long long)kept, "dropped", (unsigned long long)dropped);
}

static PyObject *dcache_close(PyObject *self, PyObject *unused)
{
    if (dlfs_engine_running())
        return PyErr_Format(PyExc_RuntimeError, "the serving threads still read: stop the engine first");
    dlfs_dcache_close();
    Py_RETURN_NONE;
}

static PyObject *lanes_start(PyObject *self, PyObject *arg)
{
    PyObject *path;
    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    int rc = dlfs_lanes_start(PyBytes_AS_STRING(path));
    Py_DECREF(path);
    return rc < 0 ? PyErr_SetFromErrno(PyExc_OSError) : (Py_INCREF(Py_None), Py_None);
}

static PyObject *lanes_add(PyObject *self, PyObject *arg)
{
    int fd;
    if (!PyArg_Parse(arg, "i", &fd))
        return NULL;
    if (dlfs_lanes_add(fd) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *lanes_room(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlfs_lanes_room());
}

static PyObject *lanes_stats(PyObject *self, PyObject *unused)
{
    struct dlfs_lanes_stats s;
    dlfs_lanes_stats(&s);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "open", s.open, "opened", s.opened, "closed_idle",
                         s.closed_idle, "closed_bad", s.closed_bad, "reads", s.reads, "bytes", s.bytes, "not_found",
                         s.not_found);
}

static PyObject *lanes_stop(PyObject *self, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    dlfs_lanes_stop();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *set_direct_io(PyObject *self, PyObject *arg)
{
    unsigned long long min = PyLong_AsUnsignedLongLong(arg);
    if (min == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    dlfs_set_direct_io(min);
    Py_RETURN_NONE;
}

static PyObject *miss_readers(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLong(dlfs_miss_readers());
}

static PyObject *wake_parked(PyObject *self, PyObject *unused)
{
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = dlfs_engine_wake();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *read_answered(PyObject *self, PyObject *arg)
{
    unsigned long long ino = PyLong_AsUnsignedLongLong(arg);
    if (ino == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(dlfs_read_answered(ino));
}

static PyObject *engine_running(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlfs_engine_running());
}

static PyMethodDef methods[] = {
    {"engine_start", (PyCFunction)(void (*)(void))engine_start, METH_VARARGS | METH_KEYWORDS,
     "engine_start(sections, shared=None, *, row, timeout, threads, io_uring, xattr_name, xattr_value, local_dir, "
     "bulk) -> bool: native threads take the mounted session's device over and answer "
     "from this index and shared cache (bulk: a dataset of big files, its threads neither pinned nor preempting "
     "readers); False if pyfuse3's session was not made through the hook."},
    {"answer", (PyCFunction)(void (*)(void))answer, METH_VARARGS | METH_KEYWORDS,
     "answer(sections, request, *, timeout, xattr_name, xattr_value, local_dir) -> "
     "(kind, reply): one FUSE request as the serving threads answer it (kind: answered, forward, no_reply)."},
    {"engine_stats", engine_stats, METH_NOARGS, "Counters of the serving engine (all threads)."},
    {"set_scan", set_scan, METH_O, "Scan mode on or off: serving threads read whole small local records themselves."},
    {"remote_route", remote_route, METH_O,
     "remote_route(uint16 per chunk): which node slot each chunk's records are fetched from in scan mode (0: Python's)."},
    {"remote_route_set", remote_route_set, METH_VARARGS,
     "remote_route_set(chunk, slot): one chunk's node slot (a route learned as chunks are read)."},
    {"remote_add", remote_add, METH_VARARGS,
     "remote_add(slot, fd): an authenticated data connection to that node, handed to the serving threads for good."},
    {"remote_node_stats", remote_node_stats, METH_O, "remote_node_stats(slot) -> the node's connections and fetches."},
    {"remote_wait", remote_wait, METH_VARARGS,
     "remote_wait([ms]) -> the bound of the threads' fetches, in ms (set first where given; clamped)."},
    {"dcache_open", dcache_open, METH_VARARGS,
     "dcache_open(chunk_dir, chunks): the serving threads may read the disk cache's files there (diskcache.h)."},
    {"dcache_set", dcache_set, METH_VARARGS, "dcache_set(chunk, tag): chunk's disk cache file is <id>.<tag> (0: none)."},
    {"dcache_used", dcache_used, METH_NOARGS, "dcache_used() -> the chunks the threads read from the disk cache since."},
    {"dcache_keep", dcache_keep, METH_NOARGS,
     "dcache_keep(): the serving threads offer the records they fetch from data daemons to the disk cache."},
    {"dcache_take", dcache_take, METH_O,
     "dcache_take(ms) -> [(chunk, offset, bytearray)] offered within ms (at least one if any came), None once closed."},
    {"dcache_keep_stats", dcache_keep_stats, METH_NOARGS, "dcache_keep_stats() -> records kept and dropped."},
    {"dcache_keep_end", dcache_keep_end, METH_NOARGS,
     "dcache_keep_end(): offer no more; a taker gets what was offered before, then None."},
    {"dcache_close", dcache_close, METH_NOARGS, "dcache_close(): forget the disk cache (the engine has stopped)."},
    {"remote_close", remote_close, METH_NOARGS, "Close the handed-over connections and forget the route (engine stopped)."},
    {"lanes_start", lanes_start, METH_O, "lanes_start(chunk_dir): the data daemon's native threads serve range lanes."},
    {"lanes_add", lanes_add, METH_O, "lanes_add(fd): an authenticated data connection given over to READ_RANGE alone."},
    {"lanes_room", lanes_room, METH_NOARGS, "Whether a range lane would be taken now."},
    {"lanes_stats", lanes_stats, METH_NOARGS, "The range lanes' counters."},
    {"lanes_stop", lanes_stop, METH_NOARGS, "Stop the range lanes' threads and close every lane."},
    {"miss_readers", miss_readers, METH_NOARGS,
     "miss_readers(): distinct processes behind the latest READs the engine sent to Python (0: none yet)."},
    {"set_direct_io", set_direct_io, METH_O,
     "set_direct_io(min): files of min bytes or more open FOPEN_DIRECT_IO, the rest keep their pages (0: no_open)."},
    {"engine_running", engine_running, METH_NOARGS, "True while the engine's threads serve the mount."},
    {"read_answered", read_answered, METH_O,
     "read_answered(ino): Python answered a READ of this inode; True if READs of it were parked behind it "
     "(they look again at the next wake_parked)."},
    {"wake_parked", wake_parked, METH_NOARGS,
     "Answer the READs parked for records that have landed (and pass on the rest that wait no more); how many."},
    {"fuse_hooked", fuse_hooked, METH_NOARGS,
     "True once pyfuse3's session was created through the hook, so READ carries the inode as fh."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlfs._native", "The C helper of dlfs.", -1, methods, NULL, NULL, NULL, NULL,
};

/* The index layout as C reads it, for a test to hold against dlfs/format/index.py and chunk.py. */
static int add_layout(PyObject *m)
{
    PyObject *layout = Py_BuildValue(
        "{s:y,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "magic", DLFS_INDEX_MAGIC, "version", DLFS_INDEX_VERSION,
        "name_max", DLFS_NAME_MAX, "header", (int)sizeof(struct dlfs_index_header), "chunk",
        (int)sizeof(struct dlfs_chunk), "chunk_id", DLFS_CHUNK_ID, "inode", (int)sizeof(struct dlfs_inode), "dirent",
        (int)sizeof(struct dlfs_dirent), "extent", (int)sizeof(struct dlfs_extent), "flag_lz4", DLFS_RECORD_LZ4,
        "flag_block_sums", DLFS_RECORD_BLOCK_SUMS, "block_size", DLFS_BLOCK_SIZE);
    return layout ? PyModule_AddObject(m, "INDEX_LAYOUT", layout) : -1;
}

/* The frames the serving threads speak (remote.h), for a test to hold against dlfs/wire/protocol.py. */
static int add_wire(PyObject *m)
{
    PyObject *wire = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:I,s:i,s:i,s:i}", "magic", DLFS_WIRE_MAGIC, "version",
        DLFS_WIRE_VERSION, "header", DLFS_WIRE_HEADER, "request", DLFS_WIRE_REQUEST, "response", DLFS_WIRE_RESPONSE,
        "read_range", DLFS_WIRE_READ_RANGE, "nodes", DLFS_REMOTE_NODES, "conns", DLFS_REMOTE_CONNS, "wait_ms",
        DLFS_REMOTE_WAIT_MS, "idle_s", DLFS_REMOTE_IDLE_S, "not_found", DLFS_WIRE_NOT_FOUND, "protocol_error",
        DLFS_WIRE_PROTOCOL, "max_data", DLFS_WIRE_MAX_DATA, "lane_stall_ms", DLFS_LANE_STALL_MS, "lane_idle_s",
        DLFS_LANE_IDLE_S, "lanes_max", DLFS_LANES_MAX);
    return wire ? PyModule_AddObject(m, "WIRE", wire) : -1;
}

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && (dlfs_owner_add_types(m) < 0 || dlfs_arena_add_functions(m) < 0 || dlfs_direct_add_types(m) < 0 || dlfs_index_add_types(m) < 0 ||
              add_layout(m) < 0 || add_wire(m) < 0 ||
              PyModule_AddIntConstant(m, "URING_BYTES_PER_CPU", (long)DLFS_URING_BYTES_PER_CPU) < 0 ||
              PyModule_AddIntConstant(m, "RANDOM_READ_MAX", DLFS_RANDOM_READ_MAX) < 0 ||
              PyModule_AddIntConstant(m, "ENGINE_MAX_THREADS", DLFS_ENGINE_MAX_THREADS) < 0 ||
              PyModule_AddIntConstant(m, "LOCAL_RECHECK_S", (long)(DLFS_LOCAL_RECHECK_NS / 1000000000ull)) < 0 ||
              PyModule_AddIntConstant(m, "KEEP_SLOTS", DLFS_KEEP_SLOTS) < 0))
        Py_CLEAR(m);
    dlfs_fuse_on_release(release_kept);
    return m;
}
