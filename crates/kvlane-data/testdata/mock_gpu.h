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
 * "Device" allocations are memfds mapped shared, so that IPC works between
 * two processes as it does on one GPU: an IPC handle (64 bytes, opaque to
 * kvlane) carries {magic, pid, fd, length}; opening it in another process
 * maps /proc/<pid>/fd/<fd> (which needs the right to ptrace-read the
 * exporter: the same user). The mapping covers the WHOLE allocation, as
 * the real drivers' does. Opening a handle again in one process returns
 * the same address and counts a reference (as CUDA documents); closing
 * drops one, the last unmaps. A handle made in this process is refused
 * (unless KVLANE_MOCK_IPC_SAME_PROCESS is set, for unit tests).
 *
 * Not a header of any library: included once by each mock, which defines
 * MOCK_NAME (for messages) before including it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_ALLOCS 4096
#define MAX_STREAMS 1024

struct alloc {
    uintptr_t base;
    size_t len;
    int device; /* -1: pinned host */
    int fd;     /* device memory made here: its memfd; else -1 */
    int ipc_refs; /* > 0: another process's allocation, opened by IPC */
    int src_pid, src_fd; /* for those: the exporter's pid and memfd */
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
            allocs[i] = (struct alloc){(uintptr_t)p, len, device, -1, 0, 0, -1};
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

/* ---- Device memory as memfds, and IPC between processes ---- */

/* Allocates `len` bytes of "device" memory for `device`: a memfd mapped
 * shared, filled with `garbage`, tracked. NULL when out of memory. */
static void *device_alloc(size_t len, int device, int garbage) {
    int fd = memfd_create("kvlane-mock-gpu", MFD_CLOEXEC);
    if (fd < 0) return NULL;
    if (ftruncate(fd, (off_t)len) != 0) { close(fd); return NULL; }
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { close(fd); return NULL; }
    /* Garbage, as fresh device memory is: tests must not rely on zeros. */
    memset(m, garbage, len);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].base == 0) {
            allocs[i] = (struct alloc){(uintptr_t)m, len, device, fd, 0, 0, -1};
            pthread_mutex_unlock(&lock);
            return m;
        }
    }
    pthread_mutex_unlock(&lock);
    munmap(m, len);
    close(fd);
    return NULL;
}

/* Frees device memory device_alloc made (not an IPC mapping); 0 when `p`
 * is no such allocation. */
static int device_free(uintptr_t p) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc a = allocs[i];
        if (a.base == p && a.device >= 0 && a.ipc_refs == 0) {
            allocs[i].base = 0;
            for (int j = 0; j < MAX_ALLOCS; j++) {
                if (copied_out[j].base == p) copied_out[j] = (struct copied_out){0, 0};
            }
            pthread_mutex_unlock(&lock);
            munmap((void *)a.base, a.len);
            close(a.fd);
            return 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

#define IPC_MAGIC 0x4b564c49u /* "KVLI" */

/* The mock's IPC handle: 64 bytes, as CUipcMemHandle and hipIpcMemHandle_t. */
struct ipc_handle {
    uint32_t magic;
    int32_t pid;
    int32_t fd;
    uint32_t pad;
    uint64_t len;
    char reserved[40];
};
_Static_assert(sizeof(struct ipc_handle) == 64, "IPC handles are 64 bytes");

enum { IPC_OK, IPC_INVALID, IPC_NO_MEMORY, IPC_SAME_PROCESS };

/* The allocation that contains p: its base and length; device memory
 * only. */
__attribute__((unused)) static int address_range(uintptr_t p, uintptr_t *base, size_t *len) {
    struct alloc a;
    if (!find(p, 1, &a) || a.device < 0) return IPC_INVALID;
    *base = a.base;
    *len = a.len;
    return IPC_OK;
}

/* A handle of the device allocation that starts at `base` (exactly: the
 * strictest reading of the drivers' documentation), made here. */
__attribute__((unused)) static int ipc_get(struct ipc_handle *h, uintptr_t base) {
    int rc = IPC_INVALID;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc a = allocs[i];
        if (a.base && a.base == base && a.device >= 0 && a.fd >= 0) {
            memset(h, 0, sizeof *h);
            h->magic = IPC_MAGIC;
            h->pid = (int32_t)getpid();
            h->fd = a.fd;
            h->len = a.len;
            rc = IPC_OK;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Maps the allocation `h` names on `device`; *out is its base here. */
__attribute__((unused)) static int ipc_open(uintptr_t *out, const struct ipc_handle *h, int device) {
    if (h->magic != IPC_MAGIC || h->len == 0 || h->fd < 0) return IPC_INVALID;
    /* KVLANE_MOCK_IPC_SAME_PROCESS: a test knob (unit tests of the
     * initiator's checks in one process); no driver has it. */
    if (h->pid == (int32_t)getpid() && !getenv("KVLANE_MOCK_IPC_SAME_PROCESS"))
        return IPC_SAME_PROCESS;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc a = allocs[i];
        if (a.base && a.ipc_refs > 0 && a.src_pid == h->pid && a.src_fd == h->fd &&
            a.device == device) {
            allocs[i].ipc_refs++;
            *out = a.base;
            pthread_mutex_unlock(&lock);
            return IPC_OK;
        }
    }
    pthread_mutex_unlock(&lock);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h->pid, (int)h->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return IPC_INVALID;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < h->len) { close(fd); return IPC_INVALID; }
    void *m = mmap(NULL, (size_t)h->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return IPC_NO_MEMORY;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].base == 0) {
            allocs[i] = (struct alloc){(uintptr_t)m, (size_t)h->len, device, -1, 1, h->pid, h->fd};
            pthread_mutex_unlock(&lock);
            *out = (uintptr_t)m;
            return IPC_OK;
        }
    }
    pthread_mutex_unlock(&lock);
    munmap(m, (size_t)h->len);
    return IPC_NO_MEMORY;
}

/* Drops one reference to an IPC mapping; the last unmaps it (after every
 * queued copy ran, as the drivers synchronize). */
__attribute__((unused)) static int ipc_close(uintptr_t base) {
    drain_all();
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc a = allocs[i];
        if (a.base && a.base == base && a.ipc_refs > 0) {
            if (--allocs[i].ipc_refs == 0) {
                allocs[i].base = 0;
                pthread_mutex_unlock(&lock);
                munmap((void *)a.base, a.len);
                return IPC_OK;
            }
            pthread_mutex_unlock(&lock);
            return IPC_OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return IPC_INVALID;
}

/* Test helper (not in any runtime): IPC mappings open in this process
 * (references counted once each). */
int kvlane_mock_ipc_open_count(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].base != 0 && allocs[i].ipc_refs > 0;
    pthread_mutex_unlock(&lock);
    return n;
}
