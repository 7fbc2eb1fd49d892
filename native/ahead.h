#ifndef DLFS_AHEAD_H
#define DLFS_AHEAD_H
/* Records the /dev/fuse serving threads read from the disk at their file's LOOKUP, for the READ that
 * follows (FUSE over io_uring does the same on its rings, uring.c). In scan mode a cold small file costs
 * a LOOKUP, an IOCTL (Python's isatty) and a READ, and the READ waited for the whole disk read (~100 us);
 * the thread that answers the LOOKUP now reads the record right after its reply, while the reader opens
 * the file, and the READ (on whichever thread) takes the bytes, or waits for the rest of that read.
 * While LOOKUPs stop foretelling READs (a walk that only stats files), few are read so (the score). */
#include <stdint.h>

#include "answer.h"

#define DLFS_AHEAD_SLOTS 8 /* records read so at once, each in DLFS_REPLY_SCRATCH bytes of one huge page */
#define DLFS_AHEAD_WAIT_MS 1000 /* the longest a READ waits for a read of its record under way */

/* How well LOOKUPs have foretold READs lately, here and on each ring (uring.c): each READ that found
 * its record read raises the score by 1, each read no READ took lowers it by DLFS_AHEAD_MISS; below
 * DLFS_AHEAD_SCORE_MIN one LOOKUP in DLFS_AHEAD_PROBE still reads. It starts halfway to the most. */
#define DLFS_AHEAD_SCORE_MIN 8
#define DLFS_AHEAD_SCORE_MAX 32
#define DLFS_AHEAD_MISS 4
#define DLFS_AHEAD_PROBE 16

struct dlfs_ahead_score {
    int score;
    unsigned probe; /* LOOKUPs let pass so far */
    uint64_t rose;  /* the age (its set's count of starts) of the first read since it last rose to the least */
};
#define DLFS_AHEAD_SCORE_INIT {.score = DLFS_AHEAD_SCORE_MAX / 2}

/* The score moved by `by` (within 0..DLFS_AHEAD_SCORE_MAX); `next` is the age the next read started gets. */
static inline void dlfs_ahead_rescore(struct dlfs_ahead_score *s, int by, uint64_t next)
{
    int was = s->score;
    s->score = was + by < 0 ? 0 : was + by > DLFS_AHEAD_SCORE_MAX ? DLFS_AHEAD_SCORE_MAX : was + by;
    if (was < DLFS_AHEAD_SCORE_MIN && s->score >= DLFS_AHEAD_SCORE_MIN)
        s->rose = next;
}

/* A read started at `age` that no READ took, let go: it lowers the score only while LOOKUPs read, and
 * if started since they last began to. Below the least only READs move the score: the reads a walk that
 * stats files left behind, and its probes', counted when reused after READs came back, kept LOOKUPs
 * from reading for ~4 READs each. */
static inline void dlfs_ahead_unused(struct dlfs_ahead_score *s, uint64_t age, uint64_t next)
{
    if (s->score >= DLFS_AHEAD_SCORE_MIN && age >= s->rose)
        dlfs_ahead_rescore(s, -DLFS_AHEAD_MISS, next);
}

/* Whether a LOOKUP starts no read at this score. */
static inline int dlfs_ahead_skip(struct dlfs_ahead_score *s)
{
    return s->score < DLFS_AHEAD_SCORE_MIN && s->probe++ % DLFS_AHEAD_PROBE;
}

/* After a LOOKUP of `ino` was answered: where a READ of the file would read its record from the disk
 * (dlfs_record_wanted), read it now into a slot (this thread, for the disk's time). */
void dlfs_ahead_lookup(const struct dlfs_serve *sv, uint64_t ino, struct dlfs_counters *c);
/* Record `ext`, if a slot has it or is reading it (waiting for that, bounded): the slot (> 0), with its
 * bytes at *data (unchecked) read from *f, held until dlfs_ahead_give; 0 if none (read it yourself). */
int dlfs_ahead_take(uint64_t ext, const char **data, const struct dlfs_chunk_ref **f, struct dlfs_counters *c);
/* Let go of slot `slot` taken so (`bad`: its bytes failed their check). */
void dlfs_ahead_give(int slot, int bad);
/* A READ read its record itself (no slot had it): LOOKUPs foretell READs, as far as the score goes. */
void dlfs_ahead_missed(void);
/* Free every slot (the engine stops; no thread uses them any more). */
void dlfs_ahead_reset(void);

#endif
