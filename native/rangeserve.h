#ifndef DLFS_RANGESERVE_H
#define DLFS_RANGESERVE_H
/* The data daemon's range lanes: connections given over to READ_RANGE alone (Msg.RANGE_LANE, once
 * authenticated by Python), served by native threads. A mount's serving threads fetch scan mode's
 * records one by one (remote.h); through the daemon's Python each cost ~250 us of its CPU (a frame
 * parsed, a task started, a thread for the disk), ~4,000 records/s for a whole node. Here a worker takes
 * a lane with a request waiting (epoll, one-shot), reads the frame, opens the chunk file (kept open,
 * shared: chunkfiles.h) and sends the header and the range (sendfile): the reply Python would send, byte
 * for byte. A frame out of shape closes that lane; an absent chunk is an error reply (NotFound); a
 * range past the file's end comes back shorter, as from Python. */
#include <stdint.h>

#define DLFS_LANES_MAX 4096      /* lanes open at once; more are refused (the client then reads through Python) */
#define DLFS_LANES_WORKERS 8     /* threads serving them: each holds one request at a time, disk reads included */
#define DLFS_LANE_STALL_MS 30000 /* a begun frame, or a reply's send, with no progress for this long closes the lane
                                  * (protocol.FRAME_STALL) */
#define DLFS_LANE_IDLE_S 300     /* a lane with no request for this long is closed (rpc.IDLE_TIMEOUT) */
#define DLFS_LANE_META_MAX 256   /* a READ_RANGE's meta is ~50 bytes */

struct dlfs_lanes_stats {
    uint64_t open, opened, closed_idle, closed_bad;
    uint64_t reads, bytes, not_found; /* replies begun (a send that fails then closes the lane: closed_bad) */
};

/* Serve lanes from the chunk directory `dir` (data/chunks) with DLFS_LANES_WORKERS threads: 0, or -1
 * with errno set. */
int dlfs_lanes_start(const char *dir);
/* An authenticated connection given over (blocking from here on, bounded as above): 0, or -1 (ENOSPC:
 * DLFS_LANES_MAX open; EINVAL: not started). The caller closes `fd` on -1. */
int dlfs_lanes_add(int fd);
/* Whether a lane would be taken now (serving, and fewer than DLFS_LANES_MAX open): asked before a
 * RANGE_LANE is answered yes. */
int dlfs_lanes_room(void);
void dlfs_lanes_stats(struct dlfs_lanes_stats *out);
/* Stop the workers (each by its next second) and close every lane. */
void dlfs_lanes_stop(void);
#endif
