#ifndef DLFS_REMOTE_H
#define DLFS_REMOTE_H
/* Records fetched from the data daemons by the serving threads themselves: in scan mode (an epoch over
 * more than the cache holds, each miss a record alone), a whole small record of a chunk this machine
 * does not hold is one READ_RANGE, sent on a connection Python opened and authenticated
 * (dlfs/mount/remotereads.py) and received straight into the thread's buffer, checked here, answered
 * here: no word to Python. Python keeps the policy: which node each chunk is read from (the route, its
 * replica order), how many connections, failover and hedging. Anything unexpected (no route, no idle
 * connection, an error reply, a bound passed, a frame out of shape, a failed check) hands the READ to
 * Python, which fetches it as before; a connection that misbehaved is closed, and Python opens another. */
#include <stdint.h>

#include "indexview.h"
#include "wire.h"

#define DLFS_WIRE_META_MAX 4096 /* a reply's meta read past at most (an error's message); longer: closed */

#define DLFS_REMOTE_NODES 1024  /* data nodes a route may name (1..this; 0: Python fetches it) */
#define DLFS_REMOTE_CONNS 8     /* connections to one node at most */
/* A fetch's bound (sending, then receiving): past it, Python's (hedges, failover). Python sets it to its own
 * hedge bound (dlfs_remote_wait); this is the most it may be, and what it is until then. */
#define DLFS_REMOTE_WAIT_MS 2000
#define DLFS_REMOTE_WAIT_MIN_MS 10
/* A connection idle this long is closed rather than used: a daemon closes one idle for rpc.IDLE_TIMEOUT
 * (300 s), and a request must never meet that close. */
#define DLFS_REMOTE_IDLE_S 120

struct dlfs_counters;

/* Where each chunk of the mounted version is fetched from: `n` entries, one per chunk, each a node
 * slot (1..DLFS_REMOTE_NODES) or 0 (Python fetches it: this machine's, or no node to ask). The first
 * call sizes the table; later ones (a node failed, or answers again) must give the same `n`. 0, or -1
 * with errno set (EINVAL: another size, or a slot out of range; ENOMEM). */
int dlfs_remote_route(const uint16_t *route, uint64_t n);
/* One chunk's entry (a route learned as its chunk is first read: see remotereads.py). 0, or -1 (EINVAL:
 * no route yet, a chunk or a slot out of range). */
int dlfs_remote_route_set(uint64_t chunk, unsigned slot);
/* An authenticated connection to node `slot`'s data daemon, handed over for good (a blocking socket
 * from here on, bounded by DLFS_REMOTE_WAIT_MS): 0, or -1 (EINVAL: a bad slot; ENOSPC: the node has
 * DLFS_REMOTE_CONNS already). The caller closes `fd` on -1. */
int dlfs_remote_add(unsigned slot, int fd);
struct dlfs_remote_node_stats {
    uint32_t open;      /* connections held (idle or in use) */
    uint64_t wanted;    /* fetches that found no idle connection, while the node had room for another */
    uint64_t lost;      /* connections closed: broken, out of shape, or idle too long */
    uint64_t reads, bytes; /* records fetched (checked by the caller: counted here good or not) */
    uint64_t failures;     /* fetches that got no record: an error answered, a connection lost or out of shape */
    uint64_t timeouts;     /* of those, fetches the node did not answer within the bound (it is closed) */
};
/* Node `slot`'s; slot 0: `wanted` and `timeouts` summed over every node (the rest 0). */
void dlfs_remote_node_stats(unsigned slot, struct dlfs_remote_node_stats *out);
/* The bound of every fetch from now on, in ms (clamped to DLFS_REMOTE_WAIT_MIN_MS..DLFS_REMOTE_WAIT_MS); the
 * bound now. A silent node then costs a READ what a hedge would, not more (a frozen node held each reader 2.2 s
 * where Python's reads hedged past it in 0.2). */
unsigned dlfs_remote_wait(unsigned ms);
unsigned dlfs_remote_wait_now(void);
/* Whether any route is set (the serving threads may fetch). */
int dlfs_remote_on(void);
/* Record `e` of chunk e->chunk (`id`, DLFS_CHUNK_ID bytes), its stored bytes fetched into `buf` (`room`
 * bytes) from the node its route names: 0, or -1 (Python's to fetch). Blocks for the fetch, bounded.
 * An error answered for a chunk takes it off the route (Python's until the route is made again). */
int dlfs_remote_read(const struct dlfs_extent *e, const uint8_t *id, char *buf, uint32_t room,
                     struct dlfs_counters *c);
/* Bytes [offset, offset + length) of chunk `chunk` (`id`) fetched into `buf` from the node its route names
 * (a read-ahead window, landed in C by a Python thread: cacheowner.c): 0, or -1
 * (Python's to fetch: no route, no idle connection, an error, a bound passed, a reply of another length).
 * Blocks for the fetch, bounded; `c` (the thread's counters) may be NULL. */
int dlfs_remote_range(uint64_t chunk, const uint8_t *id, uint64_t offset, uint32_t length, char *buf,
                      struct dlfs_counters *c);
/* Close every connection and forget the route (the serving threads have stopped; a fetch still running is waited for, bounded). */
void dlfs_remote_close(void);
#endif
