#ifndef DLFS_ENGINE_H
#define DLFS_ENGINE_H
/* The mount's serving engine: native threads own /dev/fuse (and, where the kernel allows it, one
 * io_uring queue per CPU), answer what memory can answer (answer.c), and pass the rest to pyfuse3's
 * loop through libfuse's custom I/O hooks, so Python handles misses exactly as before. */
#define FUSE_USE_VERSION 31
#include <fuse_lowlevel.h>
#include <stdint.h>

#include "answer.h"

struct dlfs_engine_stats {
    struct dlfs_counters c;
    uint64_t threads, uring_queues, queued_max, write_errors, python_replies;
    uint64_t abandoned; /* serving threads a stop left running past DLFS_STOP_SECONDS (stuck in I/O) */
    uint64_t chunk_files_opened; /* this machine's chunk files opened to be read in place (chunkfiles.h) */
    int uring_state; /* 0 off, 1 registering, 2 serving, -errno: could not */
    int ended;
    int direct_mmap; /* INIT's reply let FOPEN_DIRECT_IO files be mapped shared (direct mode) */
};

/* Called by the session hook once pyfuse3's session is mounted: take /dev/fuse over (libfuse then
 * reads and writes through the engine). 0, or -1 with errno set (the session is then left as it was). */
int dlfs_engine_attach(struct fuse_session *se);
/* 1 if the engine owns `se`'s device. */
int dlfs_engine_owns(struct fuse_session *se);
/* The protocol version the kernel and libfuse agreed on (from INIT): older than 7.12, nothing is
 * answered natively. */
void dlfs_engine_protocol(unsigned major, unsigned minor);
/* Start `threads` readers of /dev/fuse (and io_uring queues if `uring`), answering from `sv`
 * (copied; what it points to must stay valid until dlfs_engine_release). `bulk`: a dataset of big files,
 * whose readers are neither pinned nor preempt a reader as they wake (engine.c). 0, or -1 with errno set. */
int dlfs_engine_start(const struct dlfs_serve *sv, int threads, int uring, int bulk);
/* The most threads `dlfs_engine_start` takes (EINVAL past it); `native.ENGINE_MAX_THREADS` to Python. */
#define DLFS_ENGINE_MAX_THREADS 256
/* Before the real unmount: stop handing requests to Python (its loop has ended). */
void dlfs_engine_close_python(void);
/* How long a stop waits for the serving threads, all of them together (they may still be answering a
 * lazily unmounted mount, or be stuck in a read of a failing disk). */
#define DLFS_STOP_SECONDS 2
/* Stop and join every thread, waiting DLFS_STOP_SECONDS at most: a thread still running then is abandoned
 * (left to end on its own, with everything it may touch kept for the process's life) so that the process
 * can exit. How many threads have been abandoned in all. Blocks: call it without the GIL. */
int dlfs_engine_stop(void);
/* After stop: close the device, forget the session and put back the stop signal's handler. 0, or (nothing
 * released: a thread may still use it) the number of abandoned threads; what start kept must then be kept too. */
int dlfs_engine_release(void);
void dlfs_engine_stats(struct dlfs_engine_stats *out);
int dlfs_engine_running(void);
/* 1 while requests are answered natively (started, and INIT agreed a protocol of 7.12 or later). */
int dlfs_engine_answering(void);

/* For the io_uring transport: what requests are answered from (NULL until serving), and the queue to Python. */
const struct dlfs_serve *dlfs_engine_serve(void);
void dlfs_engine_forward(const void *request, uint32_t len);
/* A READ that dlfs_answer said to park (DLFS_PARK): it waits here, copied, until dlfs_engine_wake finds its
 * record landed (or no longer coming: then it goes to Python); at most DLFS_PARK_MAX wait at once, and none
 * longer than DLFS_PARK_SECONDS. Its reply goes out as Python's do (the ring entry it came in, or /dev/fuse). */
#define DLFS_PARK_MAX 1024
#define DLFS_PARK_SECONDS 30
void dlfs_engine_park(const void *request, uint32_t len, struct dlfs_counters *c);
/* Answer the parked READs whose records have landed, pass on those whose records are no longer coming or
 * that waited too long; how many were answered. Called by the cache after each fetch ends. */
int dlfs_engine_wake(void);

/* io_uring transport (uring.c): per-CPU queues beside the /dev/fuse readers. Each queue holds
 * DLFS_URING_ENTRIES requests at once, each with a payload buffer the kernel requires to fit its
 * largest payload (max_write, max_pages): memory the mount holds per CPU, touched as replies use it. */
#define DLFS_URING_ENTRIES 4
#define DLFS_URING_PAYLOAD ((1 << 20) + 4096)
/* And buffers for the whole small records it reads from chunk files at once (scan mode): every record
 * without block sums fits one. */
#define DLFS_URING_RECORDS 8
#define DLFS_URING_BYTES_PER_CPU (DLFS_URING_ENTRIES * DLFS_URING_PAYLOAD + DLFS_URING_RECORDS * DLFS_REPLY_SCRATCH)
int dlfs_uring_start(int devfd);
/* Stop the queues, joining their threads by CLOCK_MONOTONIC `deadline_ns` (0: no wait); how many were
 * left running (their queues are then never freed). */
int dlfs_uring_stop(uint64_t deadline_ns);
int dlfs_uring_state(void);
uint64_t dlfs_uring_queues(void);
void dlfs_uring_add_counters(struct dlfs_counters *sum);
/* A reply from Python for a request that came through a ring: 1 if taken (sent or dropped), 0 if the
 * unique is not a ring request. */
int dlfs_uring_reply(const struct iovec *iov, int count);
#endif
