/* A mock ROCm HIP runtime for tests on machines without an AMD GPU.
 *
 * It implements, on host memory, the HIP functions kvlane's loader declares
 * (crates/kvlane-data/src/gpu/hip.rs), so the ROCm paths (loading, device
 * listing, pointer attributes, pinned staging with async copies on
 * streams, dma-buf export) run for real over loopback and tcp. It is NOT a
 * GPU: "device" memory is malloc'ed, copies are memcpy. Tests point
 * KVLANE_HIP_LIBRARY at the compiled library.
 *
 * What it takes from HIP's documented behaviour, so that tests can fail
 * where kvlane would fail on ROCm:
 *  - the current device is per thread and starts at 0 (hipSetDevice);
 *    hipMalloc allocates on it and a stream belongs to the device current
 *    when it was created;
 *  - async copies go through a live stream, their device side inside one
 *    hipMalloc'ed allocation of the stream's device, their host side
 *    inside one hipHostMalloc'ed buffer (hipErrorInvalidValue otherwise);
 *  - hipPointerGetAttribute(MEMORY_TYPE) answers in the encoding of the
 *    version it reports: ROCm 6 changed hipMemoryType (host 1, device 2;
 *    before: host 0, device 1); pointers it never allocated are
 *    hipErrorInvalidValue;
 *  - hipMalloc memory is page-aligned, a whole number of pages;
 *  - hipGetDeviceCount with no device is hipErrorNoDevice;
 *  - async copies run only when their stream is synchronized (mock_gpu.h),
 *    and hipFree synchronizes first;
 *  - IPC between processes (hipIpcGetMemHandle of an allocation's base,
 *    hipIpcOpenMemHandle, refused in the exporting process; mock_gpu.h);
 *  - hipMemGetHandleForAddressRange exists from ROCm 6.2 only. Here it
 *    returns a real file descriptor (a memfd of the range's size) for a
 *    page-aligned range inside one device allocation.
 *
 * Build-time: MOCK_HIP_VERSION (HIP_VERSION encoding, major * 10^7 +
 * minor * 10^5 + patch; default 60200000). Run-time:
 * KVLANE_MOCK_HIP_DEVICES (device count, default 1).
 */
#define _GNU_SOURCE
#define MOCK_NAME "mock HIP runtime"
#include "mock_gpu.h"
#include <sys/mman.h>
#include <unistd.h>

#ifndef MOCK_HIP_VERSION
#define MOCK_HIP_VERSION 60200000
#endif

typedef int hipError_t;
typedef void *hipStream_t;

#define hipSuccess 0
#define hipErrorInvalidValue 1
#define hipErrorOutOfMemory 2
#define hipErrorNotInitialized 3
#define hipErrorNoDevice 100
#define hipErrorInvalidDevice 101
#define hipErrorInvalidHandle 400
#define hipErrorNotSupported 801

#if MOCK_HIP_VERSION >= 60000000
#define TYPE_HOST 1
#define TYPE_DEVICE 2
#else
#define TYPE_HOST 0
#define TYPE_DEVICE 1
#endif

static int initialized;
static __thread int current; /* HIP: every thread starts on device 0 */
/* A stream is a slot: 0 free, else its device + 1. */
static int streams[MAX_STREAMS];

static int device_count(void) {
    const char *s = getenv("KVLANE_MOCK_HIP_DEVICES");
    int n = s ? atoi(s) : 1;
    return n < 0 ? 0 : (n > 16 ? 16 : n);
}

static int valid_device(int d) { return d >= 0 && d < device_count(); }

/* The device of a live stream, or -1. */
static int stream_device(hipStream_t s) {
    int *slot = (int *)s;
    if (slot < streams || slot >= streams + MAX_STREAMS) return -1;
    return *slot - 1;
}

hipError_t hipInit(unsigned flags) {
    if (flags != 0) return hipErrorInvalidValue;
    initialized = 1;
    return hipSuccess;
}

const char *hipGetErrorName(hipError_t rc) {
    switch (rc) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorNotInitialized: return "hipErrorNotInitialized";
    case hipErrorNoDevice: return "hipErrorNoDevice";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
    case hipErrorNotSupported: return "hipErrorNotSupported";
    default: return "hipErrorUnknown";
    }
}

hipError_t hipRuntimeGetVersion(int *v) {
    *v = MOCK_HIP_VERSION;
    return hipSuccess;
}

hipError_t hipGetDeviceCount(int *n) {
    if (!initialized) return hipErrorNotInitialized;
    *n = device_count();
    return *n ? hipSuccess : hipErrorNoDevice;
}

hipError_t hipDeviceGetName(char *name, int len, int d) {
    if (!valid_device(d)) return hipErrorInvalidDevice;
    snprintf(name, (size_t)len, "kvlane mock HIP device %d (host memory)", d);
    return hipSuccess;
}

hipError_t hipDeviceGetPCIBusId(char *id, int len, int d) {
    if (!valid_device(d)) return hipErrorInvalidDevice;
    snprintf(id, (size_t)len, "0000:%02X:00.0", 0xC3 + d);
    return hipSuccess;
}

hipError_t hipDeviceTotalMem(size_t *bytes, int d) {
    if (!valid_device(d)) return hipErrorInvalidDevice;
    *bytes = (size_t)192 << 30;
    return hipSuccess;
}

hipError_t hipSetDevice(int d) {
    if (!initialized) return hipErrorNotInitialized;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    current = d;
    return hipSuccess;
}

hipError_t hipPointerGetAttribute(void *data, int attr, void *p) {
    struct alloc a;
    if (!initialized) return hipErrorNotInitialized;
    if (!find((uintptr_t)p, 1, &a)) return hipErrorInvalidValue;
    switch (attr) {
    case 2: /* HIP_POINTER_ATTRIBUTE_MEMORY_TYPE */
        *(unsigned *)data = a.device >= 0 ? TYPE_DEVICE : TYPE_HOST;
        return hipSuccess;
    case 9: /* HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL */
        *(int *)data = a.device >= 0 ? a.device : current;
        return hipSuccess;
    default:
        return hipErrorInvalidValue;
    }
}

hipError_t hipMalloc(void **p, size_t len) {
    if (!initialized) return hipErrorNotInitialized;
    if (len == 0) return hipErrorInvalidValue;
    /* Page-aligned and a whole number of pages, as the runtime's
     * allocations are (what a page-rounded dma-buf export relies on). */
    size_t page = (size_t)sysconf(_SC_PAGESIZE), whole = (len + page - 1) / page * page;
    void *m = device_alloc(whole, current, 0x5A);
    if (!m) return hipErrorOutOfMemory;
    *p = m;
    return hipSuccess;
}

hipError_t hipFree(void *p) {
    if (!initialized) return hipErrorNotInitialized;
    drain_all(); /* as hipFree synchronizes */
    if (!device_free((uintptr_t)p)) return hipErrorInvalidValue;
    return hipSuccess;
}

hipError_t hipHostMalloc(void **p, size_t len, unsigned flags) {
    (void)flags;
    if (!initialized) return hipErrorNotInitialized;
    void *m = malloc(len);
    if (!m) return hipErrorOutOfMemory;
    if (!track(m, len, -1)) { free(m); return hipErrorOutOfMemory; }
    *p = m;
    return hipSuccess;
}

hipError_t hipHostFree(void *p) {
    struct alloc a;
    if (find((uintptr_t)p, 1, &a) && a.base == (uintptr_t)p && a.device == -1)
        no_queued_copy_uses(a.base, a.len, "hipHostFree");
    if (!untrack((uintptr_t)p, 0)) return hipErrorInvalidValue;
    free(p);
    return hipSuccess;
}

hipError_t hipStreamCreateWithFlags(hipStream_t *s, unsigned flags) {
    (void)flags;
    if (!initialized) return hipErrorNotInitialized;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (!streams[i]) {
            streams[i] = current + 1;
            pthread_mutex_unlock(&lock);
            *s = &streams[i];
            return hipSuccess;
        }
    }
    pthread_mutex_unlock(&lock);
    return hipErrorOutOfMemory;
}

hipError_t hipStreamDestroy(hipStream_t s) {
    if (stream_device(s) < 0) return hipErrorInvalidHandle;
    drain((int)((int *)s - streams)); /* queued work still completes */
    *(int *)s = 0;
    return hipSuccess;
}

hipError_t hipStreamSynchronize(hipStream_t s) {
    if (!initialized) return hipErrorNotInitialized;
    if (stream_device(s) < 0) return hipErrorInvalidHandle;
    drain((int)((int *)s - streams));
    return hipSuccess;
}

static hipError_t copy(uintptr_t dev, uintptr_t host, size_t len, hipStream_t s, int to_device) {
    struct alloc a;
    if (!initialized) return hipErrorNotInitialized;
    int sd = stream_device(s);
    if (sd < 0) return hipErrorInvalidHandle;
    if (!find(dev, len, &a) || a.device != sd) return hipErrorInvalidValue;
    if (!find(host, len, &a) || a.device != -1) return hipErrorInvalidValue;
    int i = (int)((int *)s - streams);
    int queued_ok = to_device ? enqueue(i, dev, host, len) : enqueue(i, host, dev, len);
    return queued_ok ? hipSuccess : hipErrorOutOfMemory;
}

hipError_t hipMemcpyHtoDAsync(void *dst, void *src, size_t len, hipStream_t s) {
    return copy((uintptr_t)dst, (uintptr_t)src, len, s, 1);
}

hipError_t hipMemcpyDtoHAsync(void *dst, void *src, size_t len, hipStream_t s) {
    return copy((uintptr_t)src, (uintptr_t)dst, len, s, 0);
}

hipError_t hipMemcpyDtoDAsync(void *dst, void *src, size_t len, hipStream_t s) {
    struct alloc a;
    if (!initialized) return hipErrorNotInitialized;
    if (stream_device(s) < 0) return hipErrorInvalidHandle;
    if (!find((uintptr_t)dst, len, &a) || a.device < 0) return hipErrorInvalidValue;
    if (!find((uintptr_t)src, len, &a) || a.device < 0) return hipErrorInvalidValue;
    int i = (int)((int *)s - streams);
    return enqueue(i, (uintptr_t)dst, (uintptr_t)src, len) ? hipSuccess : hipErrorOutOfMemory;
}

static hipError_t ipc_rc(int rc) {
    switch (rc) {
    case IPC_OK: return hipSuccess;
    case IPC_NO_MEMORY: return hipErrorOutOfMemory;
    default: return hipErrorInvalidValue;
    }
}

hipError_t hipMemGetAddressRange(void **base, size_t *len, void *p) {
    if (!initialized) return hipErrorNotInitialized;
    uintptr_t b;
    size_t n;
    hipError_t rc = ipc_rc(address_range((uintptr_t)p, &b, &n));
    if (rc) return rc;
    if (base) *base = (void *)b;
    if (len) *len = n;
    return hipSuccess;
}

typedef struct { char reserved[64]; } hipIpcMemHandle_t;

hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *h, void *p) {
    if (!initialized) return hipErrorNotInitialized;
    return ipc_rc(ipc_get((struct ipc_handle *)h, (uintptr_t)p));
}

hipError_t hipIpcOpenMemHandle(void **p, hipIpcMemHandle_t h, unsigned flags) {
    if (!initialized) return hipErrorNotInitialized;
    if (flags & ~1u) return hipErrorInvalidValue;
    struct ipc_handle ih;
    memcpy(&ih, &h, sizeof ih);
    uintptr_t m;
    hipError_t rc = ipc_rc(ipc_open(&m, &ih, current));
    if (rc == hipSuccess) *p = (void *)m;
    return rc;
}

hipError_t hipIpcCloseMemHandle(void *p) {
    if (!initialized) return hipErrorNotInitialized;
    return ipc_rc(ipc_close((uintptr_t)p));
}

#if MOCK_HIP_VERSION >= 60200000
hipError_t hipMemGetHandleForAddressRange(void *handle, void *p, size_t len, int type,
                                          unsigned long long flags) {
    struct alloc a;
    if (!initialized) return hipErrorNotInitialized;
    if (type != 1 /* hipMemRangeHandleTypeDmaBufFd */ || flags != 0) return hipErrorInvalidValue;
    long page = sysconf(_SC_PAGESIZE);
    if (len == 0 || (uintptr_t)p % (uintptr_t)page || len % (size_t)page) return hipErrorInvalidValue;
    if (!find((uintptr_t)p, len, &a) || a.device < 0) return hipErrorInvalidValue;
    int fd = memfd_create("kvlane-mock-hip-dmabuf", MFD_CLOEXEC);
    if (fd < 0) return hipErrorOutOfMemory;
    if (ftruncate(fd, (off_t)len) != 0) { close(fd); return hipErrorOutOfMemory; }
    *(int *)handle = fd;
    return hipSuccess;
}
#endif
