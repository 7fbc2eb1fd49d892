#ifndef DLFS_WIRE_H
#define DLFS_WIRE_H
/* The frame header of dlfs/wire/protocol.py (HEADER, MAGIC, VERSION, Msg), as the native side speaks
 * it: a mount's serving threads (remote.c) and the data daemon's range lanes (rangeserve.c). A test
 * holds these against protocol.py. Little-endian on the wire, as on every machine dlfs runs on. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

#define DLFS_WIRE_MAGIC 0xD1F5
#define DLFS_WIRE_VERSION 1
#define DLFS_WIRE_HEADER 20 /* magic u16, version u8, kind u8, msg u16, status u16, req u32, meta u32, data u32 */
#define DLFS_WIRE_REQUEST 0
#define DLFS_WIRE_RESPONSE 1
#define DLFS_WIRE_READ_RANGE 51
#define DLFS_WIRE_NOT_FOUND 4 /* errors.py's status of NotFound */
#define DLFS_WIRE_PROTOCOL 8  /* and of ProtocolError */
#define DLFS_WIRE_MAX_DATA (320u << 20) /* protocol.MAX_DATA: a reply must fit one frame */

struct dlfs_wire_head {
    uint16_t magic;
    uint8_t version, kind;
    uint16_t msg, status;
    uint32_t req, meta_len, data_len;
};

static inline void dlfs_wire_pack(char *p, const struct dlfs_wire_head *h)
{
    memcpy(p, &h->magic, 2);
    p[2] = (char)h->version;
    p[3] = (char)h->kind;
    memcpy(p + 4, &h->msg, 2);
    memcpy(p + 6, &h->status, 2);
    memcpy(p + 8, &h->req, 4);
    memcpy(p + 12, &h->meta_len, 4);
    memcpy(p + 16, &h->data_len, 4);
}

/* The header in `p`; 0 if it is one of this version's (magic and version right), else -1. */
static inline int dlfs_wire_unpack(const char *p, struct dlfs_wire_head *h)
{
    memcpy(&h->magic, p, 2);
    h->version = (uint8_t)p[2];
    h->kind = (uint8_t)p[3];
    memcpy(&h->msg, p + 4, 2);
    memcpy(&h->status, p + 6, 2);
    memcpy(&h->req, p + 8, 4);
    memcpy(&h->meta_len, p + 12, 4);
    memcpy(&h->data_len, p + 16, 4);
    return h->magic == DLFS_WIRE_MAGIC && h->version == DLFS_WIRE_VERSION ? 0 : -1;
}

/* A READ_RANGE response's or request's header, all but what varies. */
static inline struct dlfs_wire_head dlfs_wire_read_range(uint8_t kind, uint16_t status, uint32_t req,
                                                        uint32_t meta_len, uint32_t data_len)
{
    struct dlfs_wire_head h = {DLFS_WIRE_MAGIC, DLFS_WIRE_VERSION, kind, DLFS_WIRE_READ_RANGE, status, req,
                               meta_len, data_len};
    return h;
}

/* A connection handed over from Python's event loop: blocking from here on, each send and receive
 * waiting at most `ms` (a native thread's every wait has a bound). 0, or -1 with errno set. */
static inline int dlfs_wire_blocking(int fd, unsigned ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000};
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
        return -1;
    return 0;
}
/* Seconds of CLOCK_MONOTONIC_COARSE (idle times), and milliseconds of CLOCK_MONOTONIC (bounds). */
static inline uint64_t dlfs_wire_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
    return (uint64_t)t.tv_sec;
}

static inline uint64_t dlfs_wire_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* All `n` bytes at `p` sent on a blocking socket (each send bounded by its SO_SNDTIMEO), and, where
 * `deadline` (dlfs_wire_now_ms) is not 0, none after it: 0, or -1. */
static inline int dlfs_wire_send_all(int fd, const char *p, size_t n, uint64_t deadline)
{
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0 || (deadline && dlfs_wire_now_ms() > deadline))
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

#endif
