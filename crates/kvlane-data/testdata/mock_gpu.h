/* What the mock CUDA driver (mock_cuda.c) and the mock HIP runtime
 * (mock_hip.c) share: the table of allocations ("device" memory is
 * malloc'ed host memory) and ASYNCHRONOUS copies on streams.
 *
 * A copy issued on a stream is only queued; it runs when its stream is
 * synchronized or destroyed (or when device memory is freed, which
 * synchronizes as the real runtimes do). That is the latest moment a real
 * GPU may run it, so code that reads a pinned buffer before synchronizing
 * the copy into it, refills one while the copy out of it is in flight, or
 * takes device memory to be written when the copy call returns, gets the
 * wrong bytes here, and its tests fail. Freeing a pinned buffer that a
 * queued copy still uses aborts the process (kvlane promises never to).
 *
 * Not a header of any library: included once by each mock, which defines
 * MOCK_NAME (for messages) before including it.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ALLOCS 4096
#define MAX_STREAMS 1024

struct alloc {
    uintptr_t base;
    size_t len;
    int device; /* -1: pinned host */
};

/* One queued copy. */
struct op {
    uintptr_t dst, src;
    size_t len;
    const void *issuer; /* &issuer_tag of the thread that queued it */
    struct op *next;
};

/* Per thread: an address that names it, and the most streams that held a
 * copy it queued at one time (kvlane_mock_in_flight_peak). Double-buffered
 * staging reaches 2; a copy synchronized before the next is issued, 1. */
static __thread char issuer_tag;
static __thread int in_flight_peak;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc allocs[MAX_ALLOCS];
static struct op *queued[MAX_STREAMS], *queued_last[MAX_STREAMS];
/* Bytes copied out of device memory, per source allocation base (test
 * helper kvlane_mock_copied_out); an entry is cleared when its
 * allocation is freed. */
struct copied_out { uintptr_t base; unsigned long long bytes; };
static struct copied_out copied_out[MAX_ALLOCS];

static int track(void *p, size_t len, int device) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].base == 0) {
            allocs[i] = (struct alloc){(uintptr_t)p, len, device};
            pthread_mutex_unlock(&lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

static int untrack(uintptr_t p, int device_side) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].base == p && (allocs[i].device >= 0) == device_side) {
            allocs[i].base = 0;
            for (int j = 0; device_side && j < MAX_ALLOCS; j++) {
                if (copied_out[j].base == p) copied_out[j] = (struct copied_out){0, 0};
            }
            pthread_mutex_unlock(&lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

/* The allocation containing p..p+len (len >= 1 excludes one past the end). */
static int find(uintptr_t p, size_t len, struct alloc *out) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc a = allocs[i];
        if (a.base && p >= a.base && p - a.base <= a.len && len <= a.len - (p - a.base)) {
            *out = a;
            pthread_mutex_unlock(&lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Queues a copy on stream `s` (0 <= s < MAX_STREAMS); 0 when out of memory. */
static int enqueue(int s, uintptr_t dst, uintptr_t src, size_t len) {
    struct op *o = malloc(sizeof *o);
    if (!o) return 0;
    *o = (struct op){dst, src, len, &issuer_tag, NULL};
    pthread_mutex_lock(&lock);
    if (queued_last[s]) queued_last[s]->next = o;
    else queued[s] = o;
    queued_last[s] = o;
    int streams_busy = 0;
    for (int i = 0; i < MAX_STREAMS; i++) {
        for (struct op *q = queued[i]; q; q = q->next) {
            if (q->issuer == &issuer_tag) { streams_busy++; break; }
        }
    }
    pthread_mutex_unlock(&lock);
    if (streams_busy > in_flight_peak) in_flight_peak = streams_busy;
    return 1;
}

/* Test helper (not in any runtime): the most streams that held a copy
 * queued by the calling thread at one time, since the last reset; resets
 * it when `reset` is nonzero. */
int kvlane_mock_in_flight_peak(int reset) {
    int peak = in_flight_peak;
    if (reset) in_flight_peak = 0;
    return peak;
}

/* Counts `len` bytes copied from device address `src` (lock held). */
static void count_copied_out(uintptr_t src, size_t len) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc a = allocs[i];
        if (a.base && a.device >= 0 && src >= a.base && src - a.base < a.len) {
            int slot = -1;
            for (int j = 0; j < MAX_ALLOCS; j++) {
                if (copied_out[j].base == a.base) { slot = j; break; }
                if (slot < 0 && copied_out[j].base == 0) slot = j;
            }
            if (slot >= 0) {
                copied_out[slot].base = a.base;
                copied_out[slot].bytes += len;
            }
            return;
        }
    }
}

/* Test helper (not in any runtime): bytes copied out of the device
 * allocation that starts at `base` so far. */
unsigned long long kvlane_mock_copied_out(uintptr_t base) {
    unsigned long long n = 0;
    pthread_mutex_lock(&lock);
    for (int j = 0; j < MAX_ALLOCS; j++) {
        if (copied_out[j].base == base) { n = copied_out[j].bytes; break; }
    }
    pthread_mutex_unlock(&lock);
    return n;
}

/* Runs the copies queued on stream `s`, in order (under the lock, so that
 * a free that drains every stream waits for copies another thread runs). */
static void drain(int s) {
    pthread_mutex_lock(&lock);
    struct op *o = queued[s];
    queued[s] = queued_last[s] = NULL;
    while (o) {
        struct op *next = o->next;
        count_copied_out(o->src, o->len);
        memcpy((void *)o->dst, (const void *)o->src, o->len);
        free(o);
        o = next;
    }
    pthread_mutex_unlock(&lock);
}

static void drain_all(void) {
    for (int s = 0; s < MAX_STREAMS; s++) drain(s);
}

/* Aborts when a queued copy reads or writes base..base+len. */
static void no_queued_copy_uses(uintptr_t base, size_t len, const char *call) {
    pthread_mutex_lock(&lock);
    for (int s = 0; s < MAX_STREAMS; s++) {
        for (struct op *o = queued[s]; o; o = o->next) {
            int hits = (o->dst < base + len && base < o->dst + o->len) ||
                       (o->src < base + len && base < o->src + o->len);
            if (hits) {
                fprintf(stderr,
                        "%s: %s(%#lx) while a copy on stream %d still uses it "
                        "(synchronize the stream first)\n",
                        MOCK_NAME, call, (unsigned long)base, s);
                abort();
            }
        }
    }
    pthread_mutex_unlock(&lock);
}
