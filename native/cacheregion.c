/* What both halves of the shared chunk cache hold from Python (see cacheregion.h). */
#include "cacheregion.h"

int dlfs_region_hold(struct dlfs_region *r, PyObject *ctl, PyObject *arena, int writable)
{
    if (PyObject_GetBuffer(ctl, &r->ctl, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    r->held_ctl = 1;
    if (PyObject_GetBuffer(arena, &r->arena, PyBUF_SIMPLE) < 0)
        return -1;
    r->held_arena = 1;
    return 0;
}

int dlfs_region_create(struct dlfs_region *r, uint64_t slab_size, uint64_t nslabs, uint64_t n_extents,
                       uint64_t n_rows)
{
    char why[DLFS_SHM_WHY];
    if (dlfs_shm_create(&r->shm, r->ctl.buf, (uint64_t)r->ctl.len, r->arena.buf, (uint64_t)r->arena.len, slab_size,
                        nslabs, n_extents, n_rows, why) < 0) {
        PyErr_SetString(PyExc_ValueError, why);
        return -1;
    }
    return 0;
}

int dlfs_region_attach(struct dlfs_region *r)
{
    char why[DLFS_SHM_WHY];
    if (dlfs_shm_attach(&r->shm, r->ctl.buf, (uint64_t)r->ctl.len, r->arena.buf, (uint64_t)r->arena.len, why) < 0) {
        PyErr_SetString(PyExc_ValueError, why);
        return -1;
    }
    return 0;
}

void dlfs_region_release(struct dlfs_region *r)
{
    if (r->held_ctl)
        PyBuffer_Release(&r->ctl);
    if (r->held_arena)
        PyBuffer_Release(&r->arena);
    r->held_ctl = r->held_arena = 0;
}

int dlfs_in_range(unsigned long long v, uint64_t limit, const char *what)
{
    if (v >= limit) {
        PyErr_Format(PyExc_IndexError, "%s %llu out of range (0..%llu)", what, v, (unsigned long long)limit - 1);
        return -1;
    }
    return 0;
}

int dlfs_index_arg(PyObject *arg, uint64_t limit, const char *what, unsigned long long *out)
{
    *out = PyLong_AsUnsignedLongLong(arg);
    if (*out == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return dlfs_in_range(*out, limit, what);
}

static const struct dlfs_shm_header *header(PyObject *self)
{
    return &((DlfsRegionObject *)self)->r.shm.h;
}

PyObject *dlfs_region_slab_size(PyObject *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(header(self)->slab_size);
}

PyObject *dlfs_region_nslabs(PyObject *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(header(self)->nslabs);
}

PyObject *dlfs_region_n_extents(PyObject *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(header(self)->n_extents);
}

PyObject *dlfs_region_n_rows(PyObject *self, void *unused)
{
    return PyLong_FromUnsignedLong(header(self)->n_rows);
}

PyObject *dlfs_region_row_pins(PyObject *self, PyObject *arg)
{
    const struct dlfs_shm *shm = &((DlfsRegionObject *)self)->r.shm;
    unsigned long long row;
    if (dlfs_index_arg(arg, shm->h.n_rows, "row", &row) < 0)
        return NULL;
    uint64_t n = 0;
    uint32_t *pins = dlfs_shm_row(shm, row);
    for (uint64_t i = 0; i < shm->h.nslabs; i++)
        n += __atomic_load_n(&pins[i], __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(n);
}
