/* The mount's serving engine (see engine.h).
 *
 * pyfuse3 serves /dev/fuse from one trio loop: every request of every reader waits for one Python
 * thread. Here native threads read the device instead (several readers of one /dev/fuse fd is what
 * libfuse's own multi-threaded loop does), answer in C what memory can answer, and queue the rest for
 * pyfuse3. libfuse's custom I/O hooks (fuse_session_custom_io) make that invisible to pyfuse3: its
 * session fd becomes an eventfd that is readable while requests wait, libfuse "reads" a request from
 * the queue, and its replies are written to the device by the engine. A reply may come from any
 * thread; without cloned fds every request is answered on the one device fd it came from. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "ahead.h"
#include "diskcache.h"
#include "hugebuf.h"
#include "remote.h"

#define DEV_BUF ((1 << 20) + 4096) /* max_write (1 MiB) + headers: the kernel refuses smaller reads */
#define SCRATCH DLFS_REPLY_SCRATCH

struct worker {
    pthread_t thread;
    int started;   /* running, and to be joined */
    int abandoned; /* still running after the stop's deadline (stuck in I/O): what it uses is never freed */
    int cpu; /* the CPU it runs on, or -1 */
    struct dlfs_reply reply;
    struct dlfs_counters counters;
};

/* A request waiting for Python, as the device gave it. */
struct fwd {
    struct fwd *next;
    uint32_t len;
    char data[];
};

static struct {
    struct fuse_session *se;
    int devfd, wake_fd; /* the device; our copy of the eventfd libfuse waits on */
    int attached;
    /* Whether requests are answered here: started, and the kernel's protocol (from INIT) is one we speak:
     * -1 until INIT, then 0 or 1. Read by every serving thread; written by Python's and the starting thread. */
    atomic_int serving, proto_ok, started;
    atomic_int stopping;
    int abandoned; /* serving threads left running by a stop (see dlfs_engine_stop): the engine is not reused */
    struct sigaction old_stop; /* the stop signal's handler before ours, put back once every thread is joined */
    int stop_installed;
    int ended; /* the kernel ended the session (ENODEV) */
    pthread_mutex_t lock; /* the queue, `closed` and the counters below */
    struct fwd *head, *tail;
    uint64_t queued, queued_max, write_errors, python_replies;
    int closed;
    struct dlfs_serve serve;
    struct worker *workers;
    int nworkers;
    int bulk; /* a dataset of big files: its threads neither pinned nor preempting (reader_main) */
    char *scratch; /* the workers' reply buffers, SCRATCH bytes each, on huge pages (hugebuf.h) */
    size_t scratch_size;
    uint64_t init_unique; /* INIT's, until its reply (from pyfuse3's thread) is seen */
    int init_amended;     /* whether that reply said shared mmap of FOPEN_DIRECT_IO files is allowed */
} E = {.devfd = -1, .wake_fd = -1, .proto_ok = -1, .lock = PTHREAD_MUTEX_INITIALIZER};

/* A READ waiting for its record's window to land (dlfs_engine_park), as the device gave it. */
struct parked {
    uint64_t since_ns;
    uint32_t len;
    char data[];
};

/* The parked READs. Lock order: P.lock, then E.lock or a ring queue's lock (never the other way). */
static struct {
    pthread_mutex_t lock;
    struct parked *slot[DLFS_PARK_MAX];
    int n, closed;
    struct dlfs_reply reply; /* answers parked READs, under the lock */
    struct dlfs_counters counters;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int stop_signal(void)
{
    return SIGRTMIN + 3; /* interrupts a blocked read of the device; Python uses no real-time signal */
}

static void on_stop_signal(int sig)
{
    (void)sig;
}

/* Let go of the workers' reply buffers (once no thread of ours can use them). */
static void drop_scratch(void)
{
    dlfs_hugebuf_unmap(E.scratch, E.scratch_size);
    E.scratch = NULL;
    E.scratch_size = 0;
}

/* Put back the stop signal's handler from before dlfs_engine_start (once no thread of ours can get it). */
static void restore_stop_signal(void)
{
    if (E.stop_installed && sigaction(stop_signal(), &E.old_stop, NULL) == 0)
        E.stop_installed = 0;
}

/* --- replies --------------------------------------------------------------------------------- */

static void send_error(uint64_t unique, int err)
{
    struct fuse_out_header out = {.len = sizeof out, .error = -err, .unique = unique};
    if (write(E.devfd, &out, sizeof out) < 0)
        __atomic_fetch_add(&E.write_errors, 1, __ATOMIC_RELAXED);
}

static void send_reply(struct dlfs_reply *rp)
{
    ssize_t n = writev(E.devfd, rp->iov, rp->n);
    /* ENOENT: the request was interrupted or its caller is gone; nothing to do. */
    if (n < 0 && errno != ENOENT)
        __atomic_fetch_add(&E.write_errors, 1, __ATOMIC_RELAXED);
    dlfs_reply_done(&E.serve, rp, n >= 0);
}

/* --- the queue to Python --------------------------------------------------------------------- */

void dlfs_engine_forward(const void *buf, uint32_t len)
{
    const struct fuse_in_header *in = buf;
    struct fwd *f = malloc(sizeof *f + len);
    if (!f) {
        send_error(in->unique, ENOMEM);
        return;
    }
    f->next = NULL;
    f->len = len;
    memcpy(f->data, buf, len);
    pthread_mutex_lock(&E.lock);
    if (E.closed) {
        pthread_mutex_unlock(&E.lock);
        free(f);
        send_error(in->unique, ENOTCONN);
        return;
    }
    if (E.tail)
        E.tail->next = f;
    else
        E.head = f;
    E.tail = f;
    if (++E.queued > E.queued_max)
        E.queued_max = E.queued;
    uint64_t one = 1;
    if (write(E.wake_fd, &one, sizeof one) < 0) {
        /* EAGAIN: the counter is full, which means readable */
    }
    pthread_mutex_unlock(&E.lock);
}

const struct dlfs_serve *dlfs_engine_serve(void)
{
    return atomic_load_explicit(&E.serving, memory_order_acquire) ? &E.serve : NULL;
}

/* libfuse's read, in pyfuse3's thread: one queued request, without blocking. */
static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    uint64_t v;
    (void)userdata;
    if (read(fd, &v, sizeof v) < 0) {
        /* EAGAIN: woken for the end of the session, or spuriously */
    }
    pthread_mutex_lock(&E.lock);
    struct fwd *f = E.head;
    if (f) {
        E.head = f->next;
        if (!E.head)
            E.tail = NULL;
        E.queued--;
    }
    int ended = E.ended;
    pthread_mutex_unlock(&E.lock);
    if (!f) {
        errno = ended ? ENODEV : EINTR; /* ENODEV ends pyfuse3's loop; EINTR makes it wait again */
        return -1;
    }
    if (f->len > len) {
        send_error(((struct fuse_in_header *)f->data)->unique, EIO);
        free(f);
        errno = EINTR;
        return -1;
    }
    memcpy(buf, f->data, f->len);
    ssize_t n = f->len;
    const struct fuse_in_header *in = buf;
    if (in->opcode == FUSE_INIT) /* its reply may need amending (dlfs_amend_init_reply) */
        __atomic_store_n(&E.init_unique, in->unique, __ATOMIC_RELAXED);
    free(f);
    return n;
}

/* libfuse's replies (and notifications), from pyfuse3's thread. */
static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)fd;
    (void)userdata;
    __atomic_fetch_add(&E.python_replies, 1, __ATOMIC_RELAXED);
    uint64_t init = __atomic_load_n(&E.init_unique, __ATOMIC_RELAXED);
    if (init && count >= 2 && iov[0].iov_len >= sizeof(struct fuse_out_header) &&
        ((const struct fuse_out_header *)iov[0].iov_base)->unique == init) {
        __atomic_store_n(&E.init_unique, 0, __ATOMIC_RELAXED);
        if (((const struct fuse_out_header *)iov[0].iov_base)->error == 0)
            E.init_amended = dlfs_amend_init_reply(iov[1].iov_base, iov[1].iov_len);
    }
    if (dlfs_uring_reply(iov, count)) {
        size_t n = 0;
        for (int i = 0; i < count; i++)
            n += iov[i].iov_len;
        return (ssize_t)n;
    }
    return writev(E.devfd, iov, count);
}

/* --- READs parked until their window lands ---------------------------------------------------- */

/* A reply to a request that was not answered by the thread that read it: into its ring entry if it came
 * through io_uring, else to /dev/fuse (as Python's replies go). */
static void send_late(struct dlfs_reply *rp)
{
    int sent = 1;
    if (!dlfs_uring_reply(rp->iov, rp->n)) {
        ssize_t n = writev(E.devfd, rp->iov, rp->n);
        if (n < 0 && errno != ENOENT)
            __atomic_fetch_add(&E.write_errors, 1, __ATOMIC_RELAXED);
        sent = n >= 0;
    }
    dlfs_reply_done(&E.serve, rp, sent);
}

/* Under P.lock: answer `p` if its records are here, or pass it to Python if they are no longer coming (or
 * `give_up`); 1 if it is settled (the caller frees it), 0 if it still waits. */
static int settle(struct parked *p, int give_up)
{
    const struct fuse_in_header *in = (const void *)p->data;
    int op_len = dlfs_op_len(in->opcode), r = DLFS_FORWARD;
    if (atomic_load_explicit(&E.serving, memory_order_acquire) && op_len >= 0 && p->len >= sizeof *in + (uint32_t)op_len) {
        struct dlfs_req rq = {in, p->data + sizeof *in, (uint32_t)op_len, p->data + sizeof *in + op_len,
                              (uint32_t)(p->len - sizeof *in - op_len)};
        r = dlfs_answer(&E.serve, &rq, &P.reply, &P.counters);
    }
    if (r == DLFS_ANSWERED) {
        send_late(&P.reply);
        DLFS_COUNT(&P.counters, parked_answered, 1);
        return 1;
    }
    if (r == DLFS_PARK && !give_up)
        return 0;
    DLFS_COUNT(&P.counters, parked_forwarded, 1);
    dlfs_engine_forward(p->data, p->len);
    return 1;
}

void dlfs_engine_park(const void *buf, uint32_t len, struct dlfs_counters *c)
{
    struct parked *p = malloc(sizeof *p + len);
    if (!p) {
        DLFS_COUNT(c, forwarded, 1);
        dlfs_engine_forward(buf, len);
        return;
    }
    p->since_ns = dlfs_now_ns();
    p->len = len;
    memcpy(p->data, buf, len);
    pthread_mutex_lock(&P.lock);
    /* Counted before settle counts how it ended, so that parked >= parked_answered + parked_forwarded in
     * every snapshot (dlfs_engine_stats reads those first), even for one settled at once here. */
    DLFS_COUNT(c, parked, 1);
    /* Looked at again under the lock: the window may have landed (and its wake-up passed) meanwhile. */
    if (!settle(p, P.closed || P.n == DLFS_PARK_MAX)) {
        P.slot[P.n++] = p;
        p = NULL;
    }
    pthread_mutex_unlock(&P.lock);
    free(p);
}

int dlfs_engine_wake(void)
{
    int answered = 0;
    pthread_mutex_lock(&P.lock);
    /* Read under the lock, and compared without a difference that could wrap: a READ parked after a `now`
     * taken before it would have looked 584 years old, and gone to Python at once, behind its window. */
    uint64_t now = dlfs_now_ns(), before = P.counters.parked_answered;
    for (int i = 0; i < P.n;) {
        if (settle(P.slot[i], P.slot[i]->since_ns + (uint64_t)DLFS_PARK_SECONDS * 1000000000u < now)) {
            free(P.slot[i]);
            P.slot[i] = P.slot[--P.n];
        } else {
            i++;
        }
    }
    answered = (int)(P.counters.parked_answered - before);
    pthread_mutex_unlock(&P.lock);
    return answered;
}

/* Nobody will answer what is parked (the engine stops): tell the kernel so. */
static void unpark_all(int err)
{
    pthread_mutex_lock(&P.lock);
    P.closed = 1;
    for (int i = 0; i < P.n; i++) {
        struct fuse_out_header out = {.len = sizeof out, .error = -err,
                                      .unique = ((struct fuse_in_header *)P.slot[i]->data)->unique};
        struct iovec iov = {&out, sizeof out};
        if (!dlfs_uring_reply(&iov, 1) && write(E.devfd, &out, sizeof out) < 0)
            __atomic_fetch_add(&E.write_errors, 1, __ATOMIC_RELAXED);
        free(P.slot[i]);
    }
    P.n = 0;
    pthread_mutex_unlock(&P.lock);
}

/* --- the /dev/fuse readers ------------------------------------------------------------------- */

static void end_session(void)
{
    pthread_mutex_lock(&E.lock);
    int first = !E.ended;
    E.ended = 1;
    if (first && !E.closed) {
        uint64_t one = 1;
        if (write(E.wake_fd, &one, sizeof one) < 0) {
            /* readable already */
        }
    }
    pthread_mutex_unlock(&E.lock);
}

/* Answer or forward one request of `n` bytes. */
static void handle(struct worker *w, const char *buf, size_t n)
{
    const struct fuse_in_header *in = (const void *)buf;
    DLFS_COUNT(&w->counters, requests, 1);
    if (n < sizeof *in || in->len != n) {
        dlfs_engine_forward(buf, (uint32_t)n); /* libfuse reports it */
        DLFS_COUNT(&w->counters, forwarded, 1);
        return;
    }
    int r = DLFS_FORWARD, op_len = dlfs_op_len(in->opcode);
    if (atomic_load_explicit(&E.serving, memory_order_acquire) && op_len >= 0 && n - sizeof *in >= (size_t)op_len) {
        struct dlfs_req rq = {in, buf + sizeof *in, (uint32_t)op_len, buf + sizeof *in + op_len,
                              (uint32_t)(n - sizeof *in - op_len)};
        r = dlfs_answer(&E.serve, &rq, &w->reply, &w->counters);
    }
    if (r == DLFS_ANSWERED) {
        uint64_t looked_up = in->opcode == FUSE_LOOKUP && !w->reply.out.error && !dlfs_uring_queues()
                                 ? ((const struct fuse_entry_out *)w->reply.iov[1].iov_base)->nodeid : 0;
        send_reply(&w->reply);
        if (looked_up) /* its file's record from the disk, while the reader opens it (ahead.h) */
            dlfs_ahead_lookup(&E.serve, looked_up, &w->counters);
    } else if (r == DLFS_PARK) {
        dlfs_engine_park(buf, (uint32_t)n, &w->counters);
    } else if (r == DLFS_FORWARD) {
        DLFS_COUNT(&w->counters, forwarded, 1);
        dlfs_engine_forward(buf, (uint32_t)n);
    }
}

static void *reader_main(void *arg)
{
    struct worker *w = arg;
    sigset_t only_stop;
    sigfillset(&only_stop);
    sigdelset(&only_stop, stop_signal());
    pthread_sigmask(SIG_SETMASK, &only_stop, NULL); /* Python's signals go to Python's thread */
    char name[16];
    snprintf(name, sizeof name, "dlfs-serve-%d", (int)(w - E.workers));
    pthread_setname_np(pthread_self(), name); /* for top -H and the like */
    if (E.bulk) {
        /* The kernel sends a big file's read-ahead READs while its reader copies: a thread woken to answer
         * one must not stop that copy (SCHED_BATCH: no preemption on waking), and takes whichever CPU is
         * free, not the reader's (not pinned). Pinned on 2 vCPUs, the reader of a cold pass was preempted
         * 395 times (0.11 s of its 1.26), a thread on its CPU answering a READ each time. */
        struct sched_param none = {0};
        sched_setscheduler(0, SCHED_BATCH, &none);
    }
    if (w->cpu >= 0) {
        /* A thread that stays on its CPU answers that CPU's readers without migrating: measured on
         * 2 vCPUs, warm epochs of 2 readers went from 22k to 31-37k files/s. */
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(w->cpu, &one);
        pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    }
    char *buf = malloc(DEV_BUF);
    w->reply.scratch = E.scratch + (size_t)(w - E.workers) * SCRATCH; /* scan mode reads records into it */
    w->reply.scratch_size = SCRATCH;
    if (!buf)
        return NULL;
    while (!atomic_load_explicit(&E.stopping, memory_order_relaxed)) {
        ssize_t n = read(E.devfd, buf, DEV_BUF);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue;
            /* ENODEV: unmounted, or aborted through /sys/fs/fuse/connections; anything else is fatal too. */
            end_session();
            break;
        }
        handle(w, buf, (size_t)n);
    }
    free(buf);
    return NULL;
}

/* --- lifecycle ------------------------------------------------------------------------------- */

int dlfs_engine_attach(struct fuse_session *se)
{
    if (E.abandoned) { /* threads of an earlier session may still wake up and use E: pyfuse3 serves this one */
        errno = EBUSY;
        return -1;
    }
    int devfd = fuse_session_fd(se);
    int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    if (devfd < 0 || efd < 0) {
        if (efd >= 0)
            close(efd);
        return -1;
    }
    /* Our own copy: libfuse closes its fd at unmount, and a late wake-up must never reach a reused fd. */
    int wake = fcntl(efd, F_DUPFD_CLOEXEC, 0);
    const struct fuse_custom_io io = {.read = io_read, .writev = io_writev};
    if (wake < 0 || fuse_session_custom_io(se, &io, efd) != 0) {
        int err = errno;
        close(efd);
        if (wake >= 0)
            close(wake);
        errno = err ? err : EINVAL;
        return -1;
    }
    E.se = se;
    E.devfd = devfd;
    E.wake_fd = wake;
    E.attached = 1;
    E.closed = E.ended = 0;
    atomic_store(&E.stopping, 0);
    atomic_store(&E.proto_ok, -1);
    return 0;
}

int dlfs_engine_owns(struct fuse_session *se)
{
    return E.attached && E.se == se;
}

/* Requests are answered natively once the engine has started and INIT said the protocol is one answer.c
 * speaks; until then (the kernel sends nothing before INIT's reply) and otherwise, all go to Python. */
static void set_serving(void)
{
    atomic_store_explicit(&E.serving, atomic_load(&E.started) && atomic_load(&E.proto_ok) == 1, memory_order_release);
}

void dlfs_engine_protocol(unsigned major, unsigned minor)
{
    atomic_store(&E.proto_ok, major == 7 && minor >= 12);
    set_serving();
}

int dlfs_engine_running(void)
{
    return E.attached && E.nworkers > 0 && !atomic_load(&E.stopping);
}

int dlfs_engine_answering(void)
{
    return atomic_load_explicit(&E.serving, memory_order_acquire);
}

int dlfs_engine_start(const struct dlfs_serve *sv, int threads, int uring, int bulk)
{
    if (!E.attached || E.nworkers) {
        errno = E.attached ? EALREADY : ENOTCONN;
        return -1;
    }
    if (threads < 1 || threads > DLFS_ENGINE_MAX_THREADS) {
        errno = EINVAL;
        return -1;
    }
    E.workers = calloc((size_t)threads, sizeof *E.workers);
    P.reply.scratch = malloc(SCRATCH);
    E.scratch_size = (size_t)threads * SCRATCH;
    E.scratch = dlfs_hugebuf_map(E.scratch_size);
    int err = ENOMEM;
    if (!E.workers || !P.reply.scratch || !E.scratch)
        goto fail;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal; /* no SA_RESTART: a blocked read returns EINTR */
    sigemptyset(&sa.sa_mask);
    /* Process-wide: whatever was there before is kept and put back when the engine is released. */
    if (sigaction(stop_signal(), &sa, &E.old_stop) < 0) {
        err = errno;
        goto fail;
    }
    E.stop_installed = 1;
    E.serve = *sv;
    E.bulk = bulk;
    P.reply.scratch_size = SCRATCH;
    memset(&P.counters, 0, sizeof P.counters);
    P.closed = 0;
    atomic_store(&E.started, 1);
    set_serving();
    /* One thread per CPU the process may use (and more in turn): pinned only if every CPU gets one, and
     * not for a dataset of big files (reader_main). */
    cpu_set_t allowed;
    int cpus[CPU_SETSIZE], ncpu = 0;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &allowed))
                cpus[ncpu++] = c;
    for (int i = 0; i < threads; i++)
        E.workers[i].cpu = !bulk && ncpu && threads >= ncpu ? cpus[i % ncpu] : -1;
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&E.workers[i].thread, NULL, reader_main, &E.workers[i]) != 0)
            break;
        E.workers[i].started = 1;
        E.nworkers = i + 1;
    }
    if (!E.nworkers) {
        atomic_store(&E.started, 0);
        set_serving();
        free(E.workers);
        E.workers = NULL;
        drop_scratch();
        restore_stop_signal();
        errno = EAGAIN;
        return -1;
    }
    if (uring)
        dlfs_uring_start(E.devfd); /* best effort: its state says why not */
    return 0;
fail:
    free(E.workers);
    free(P.reply.scratch);
    E.workers = NULL;
    P.reply.scratch = NULL;
    drop_scratch();
    errno = err;
    return -1;
}

void dlfs_engine_close_python(void)
{
    pthread_mutex_lock(&E.lock);
    E.closed = 1;
    struct fwd *f = E.head;
    E.head = E.tail = NULL;
    E.queued = 0;
    pthread_mutex_unlock(&E.lock);
    while (f) { /* Python's loop is over: nobody will answer these */
        struct fwd *next = f->next;
        send_error(((struct fuse_in_header *)f->data)->unique, ENOTCONN);
        free(f);
        f = next;
    }
    unpark_all(ENOTCONN); /* nor wake these: their windows are Python's to fetch */
}

/* Join `t` by CLOCK_MONOTONIC `deadline_ns`, sending it the stop signal every 20 ms (one can land just
 * before its read blocks); at least one try however late. 0 if it ended, -1 if it is still running. */
static int join_by(pthread_t t, uint64_t deadline_ns)
{
    for (;;) {
        pthread_kill(t, stop_signal());
        uint64_t now = dlfs_now_ns(), wait = 20 * 1000 * 1000;
        if (deadline_ns > now && deadline_ns - now < wait)
            wait = deadline_ns - now;
        struct timespec at; /* pthread_timedjoin_np's deadline is on the real-time clock */
        clock_gettime(CLOCK_REALTIME, &at);
        at.tv_sec += (time_t)(wait / 1000000000u);
        at.tv_nsec += (long)(wait % 1000000000u);
        if (at.tv_nsec >= 1000000000) {
            at.tv_sec++;
            at.tv_nsec -= 1000000000;
        }
        if (pthread_timedjoin_np(t, NULL, &at) == 0)
            return 0;
        if (dlfs_now_ns() >= deadline_ns)
            return -1;
    }
}

int dlfs_engine_stop(void)
{
    if (!E.attached)
        return 0;
    dlfs_engine_close_python();
    atomic_store(&E.stopping, 1);
    /* Every worker told first: while a ring's thread stuck in I/O takes the whole wait below, they end
     * meanwhile, and are not abandoned for want of one (a CI run counted 2 for 1 so). */
    for (int i = 0; i < E.nworkers; i++)
        if (E.workers[i].started)
            pthread_kill(E.workers[i].thread, stop_signal());
    uint64_t deadline = dlfs_now_ns() + (uint64_t)DLFS_STOP_SECONDS * 1000000000u;
    int left = dlfs_uring_stop(deadline);
    for (int i = 0; i < E.nworkers; i++) {
        if (!E.workers[i].started)
            continue;
        E.workers[i].started = 0;
        if (join_by(E.workers[i].thread, deadline) < 0) {
            pthread_detach(E.workers[i].thread); /* it frees itself if it ever ends */
            E.workers[i].abandoned = 1;
            __atomic_add_fetch(&E.abandoned, 1, __ATOMIC_RELAXED);
        }
    }
    if (left > 0)
        __atomic_add_fetch(&E.abandoned, left, __ATOMIC_RELAXED);
    atomic_store(&E.started, 0);
    set_serving();
    return __atomic_load_n(&E.abandoned, __ATOMIC_RELAXED);
}

void dlfs_engine_stats(struct dlfs_engine_stats *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&P.lock); /* first: see dlfs_engine_park */
    const uint64_t *psrc = (const uint64_t *)&P.counters;
    for (size_t k = 0; k < sizeof P.counters / sizeof(uint64_t); k++)
        ((uint64_t *)&out->c)[k] += psrc[k];
    pthread_mutex_unlock(&P.lock);
    for (int i = 0; i < E.nworkers; i++) {
        const struct dlfs_counters *c = &E.workers[i].counters;
        const uint64_t *src = (const uint64_t *)c;
        uint64_t *dst = (uint64_t *)&out->c;
        for (size_t k = 0; k < sizeof *c / sizeof(uint64_t); k++)
            dst[k] += __atomic_load_n(&src[k], __ATOMIC_RELAXED);
    }
    dlfs_uring_add_counters(&out->c);
    out->threads = (uint64_t)E.nworkers;
    out->uring_queues = dlfs_uring_queues();
    out->uring_state = dlfs_uring_state();
    pthread_mutex_lock(&E.lock);
    out->queued_max = E.queued_max;
    out->write_errors = __atomic_load_n(&E.write_errors, __ATOMIC_RELAXED);
    out->python_replies = __atomic_load_n(&E.python_replies, __ATOMIC_RELAXED);
    out->ended = E.ended;
    out->direct_mmap = E.init_amended;
    out->abandoned = (uint64_t)__atomic_load_n(&E.abandoned, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&E.lock);
    out->chunk_files_opened = dlfs_chunk_files_opened();
}

int dlfs_engine_release(void)
{
    if (!E.attached)
        return 0;
    if (dlfs_engine_stop() > 0) {
        /* A thread still running may wake up and use any of it: the workers, the device fd (never a reused
         * number), the serve struct and its sums, the stop signal's handler. All kept for the process's life. */
        E.attached = 0;
        E.se = NULL;
        return E.abandoned;
    }
    drop_scratch();
    free(E.workers);
    free(P.reply.scratch);
    P.reply.scratch = NULL;
    E.workers = NULL;
    E.nworkers = 0;
    close(E.devfd);
    close(E.wake_fd);
    dlfs_ahead_reset(); /* its slots hold chunk files */
    dlfs_read_starts_reset();
    dlfs_serve_local_free(E.serve.local_dir, E.serve.sums, E.serve.files);
    dlfs_remote_close(); /* no thread fetches any more: the connections Python handed over end here */
    dlfs_dcache_close();
    E.devfd = E.wake_fd = -1;
    E.attached = 0;
    E.se = NULL;
    memset(&E.serve, 0, sizeof E.serve);
    E.serve.local_dir = -1;
    restore_stop_signal();
    return 0;
}
