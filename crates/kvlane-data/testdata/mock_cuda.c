/* A mock CUDA driver for tests on machines without a GPU.
 *
 * It implements, on host memory, the handful of driver API functions
 * kvlane's loader declares (crates/kvlane-data/src/gpu/cuda.rs), so the
 * staging path (pinned buffers, async copies on streams, pointer
 * attributes) runs for real over loopback and tcp. It is NOT a GPU:
 * "device" memory is malloc'ed, copies are memcpy. Tests point
 * KVLANE_CUDA_LIBRARY at the compiled library.
 *
 * Checks it makes, so that tests can fail:
 *  - every memory call needs a current context (cuCtxSetCurrent) on the
 *    calling thread, as the real driver does (CUDA_ERROR_INVALID_CONTEXT);
 *  - device copies must stay inside one cuMemAlloc'ed allocation, host
 *    sides of async copies inside one cuMemHostAlloc'ed buffer
 *    (CUDA_ERROR_INVALID_VALUE otherwise);
 *  - streams must be live;
 *  - device-to-device copies (cuMemcpyDtoDAsync_v2) stay inside device
 *    allocations, of any device (unified addressing);
 *  - async copies run only when their stream is synchronized (mock_gpu.h);
 *  - IPC between processes (cuIpcGetMemHandle of an allocation's base,
 *    cuIpcOpenMemHandle_v2 with the lazy-peer-access flag, refused in the
 *    exporting process; see mock_gpu.h).
 *
 * KVLANE_MOCK_CUDA_DEVICES sets the device count (default 1).
 */
#define MOCK_NAME "mock CUDA driver"
#include "mock_gpu.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

#define OK 0
#define INVALID_VALUE 1
#define NOT_INITIALIZED 3
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define INVALID_HANDLE 400
#define NOT_SUPPORTED 801

static int initialized;
static __thread int current = -1;
static char contexts[16];
static char streams[MAX_STREAMS];

static int device_count(void) {
    const char *s = getenv("KVLANE_MOCK_CUDA_DEVICES");
    int n = s ? atoi(s) : 1;
    return n < 0 ? 0 : (n > 16 ? 16 : n);
}

static CUresult ready(void) {
    if (!initialized) return NOT_INITIALIZED;
    if (current < 0) return INVALID_CONTEXT;
    return OK;
}

static int live_stream(CUstream s) {
    char *c = (char *)s;
    return c >= streams && c < streams + sizeof streams && *c;
}

CUresult cuInit(unsigned flags) {
    (void)flags;
    initialized = 1;
    return OK;
}

CUresult cuGetErrorName(CUresult rc, const char **name) {
    switch (rc) {
    case OK: *name = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: return INVALID_VALUE;
    }
    return OK;
}

CUresult cuDeviceGetCount(int *n) {
    if (!initialized) return NOT_INITIALIZED;
    *n = device_count();
    return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (d < 0 || d >= device_count()) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "kvlane mock CUDA device %d (host memory)", d);
    return OK;
}

CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice d) {
    if (d < 0 || d >= device_count()) return INVALID_DEVICE;
    snprintf(id, (size_t)len, "0000:%02X:00.0", 0xC0 + d);
    return OK;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    if (d < 0 || d >= device_count()) return INVALID_DEVICE;
    *bytes = (size_t)1 << 30;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
    if (!initialized) return NOT_INITIALIZED;
    if (d < 0 || d >= device_count()) return INVALID_DEVICE;
    *ctx = &contexts[d];
    return OK;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    char *c = (char *)ctx;
    if (c == NULL) { current = -1; return OK; }
    if (c < contexts || c >= contexts + device_count()) return INVALID_CONTEXT;
    current = (int)(c - contexts);
    return OK;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    struct alloc a;
    if (!initialized) return NOT_INITIALIZED;
    if (!find((uintptr_t)p, 1, &a)) return INVALID_VALUE;
    switch (attr) {
    case 2: /* MEMORY_TYPE: HOST 1, DEVICE 2 */
        *(unsigned *)data = a.device >= 0 ? 2 : 1;
        return OK;
    case 9: /* DEVICE_ORDINAL */
        *(int *)data = a.device >= 0 ? a.device : current;
        return OK;
    default:
        return INVALID_VALUE;
    }
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t len) {
    CUresult rc = ready();
    if (rc) return rc;
    if (len == 0) return INVALID_VALUE;
    void *m = device_alloc(len, current, 0xA5);
    if (!m) return 2; /* OUT_OF_MEMORY */
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    CUresult rc = ready();
    if (rc) return rc;
    drain_all(); /* as cuMemFree synchronizes */
    if (!device_free((uintptr_t)p)) return INVALID_VALUE;
    return OK;
}

CUresult cuMemHostAlloc(void **p, size_t len, unsigned flags) {
    (void)flags;
    CUresult rc = ready();
    if (rc) return rc;
    void *m = malloc(len);
    if (!m) return 2;
    if (!track(m, len, -1)) { free(m); return 2; }
    *p = m;
    return OK;
}

CUresult cuMemFreeHost(void *p) {
    struct alloc a;
    if (find((uintptr_t)p, 1, &a) && a.base == (uintptr_t)p && a.device == -1)
        no_queued_copy_uses(a.base, a.len, "cuMemFreeHost");
    if (!untrack((uintptr_t)p, 0)) return INVALID_VALUE;
    free(p);
    return OK;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    (void)flags;
    CUresult rc = ready();
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < sizeof streams; i++) {
        if (!streams[i]) {
            streams[i] = 1;
            pthread_mutex_unlock(&lock);
            *s = &streams[i];
            return OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return 2;
}

CUresult cuStreamDestroy_v2(CUstream s) {
    if (!live_stream(s)) return INVALID_HANDLE;
    drain((int)((char *)s - streams)); /* queued work still completes */
    *(char *)s = 0;
    return OK;
}

CUresult cuStreamSynchronize(CUstream s) {
    CUresult rc = ready();
    if (rc) return rc;
    if (!live_stream(s)) return INVALID_HANDLE;
    drain((int)((char *)s - streams));
    return OK;
}

static CUresult copy(uintptr_t dev, uintptr_t host, size_t len, CUstream s, int to_device) {
    struct alloc a;
    CUresult rc = ready();
    if (rc) return rc;
    if (!live_stream(s)) return INVALID_HANDLE;
    if (!find(dev, len, &a) || a.device != current) return INVALID_VALUE;
    if (!find(host, len, &a) || a.device != -1) return INVALID_VALUE;
    int i = (int)((char *)s - streams);
    int queued_ok = to_device ? enqueue(i, dev, host, len) : enqueue(i, host, dev, len);
    return queued_ok ? OK : 2;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream s) {
    return copy((uintptr_t)dst, (uintptr_t)src, len, s, 1);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t len, CUstream s) {
    return copy((uintptr_t)src, (uintptr_t)dst, len, s, 0);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t len, CUstream s) {
    struct alloc a;
    CUresult rc = ready();
    if (rc) return rc;
    if (!live_stream(s)) return INVALID_HANDLE;
    /* Both sides inside one device allocation each (any device: unified
     * addressing). */
    if (!find((uintptr_t)dst, len, &a) || a.device < 0) return INVALID_VALUE;
    if (!find((uintptr_t)src, len, &a) || a.device < 0) return INVALID_VALUE;
    int i = (int)((char *)s - streams);
    return enqueue(i, (uintptr_t)dst, (uintptr_t)src, len) ? OK : 2;
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t len, int type,
                                       unsigned long long flags) {
    (void)handle; (void)p; (void)len; (void)type; (void)flags;
    return NOT_SUPPORTED;
}

#ifndef MOCK_CUDA_NO_IPC /* defined: a driver without IPC (build_mock_cuda_without_ipc) */
static CUresult ipc_rc(int rc) {
    switch (rc) {
    case IPC_OK: return OK;
    case IPC_NO_MEMORY: return 2;
    case IPC_SAME_PROCESS: return INVALID_CONTEXT;
    default: return INVALID_VALUE;
    }
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *len, CUdeviceptr p) {
    CUresult rc = ready();
    if (rc) return rc;
    uintptr_t b;
    size_t n;
    rc = ipc_rc(address_range((uintptr_t)p, &b, &n));
    if (rc) return rc;
    if (base) *base = (CUdeviceptr)b;
    if (len) *len = n;
    return OK;
}

typedef struct { char reserved[64]; } CUipcMemHandle;

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    CUresult rc = ready();
    if (rc) return rc;
    return ipc_rc(ipc_get((struct ipc_handle *)h, (uintptr_t)p));
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    CUresult rc = ready();
    if (rc) return rc;
    if (flags != 1 /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, the only flag */) return INVALID_VALUE;
    struct ipc_handle ih;
    memcpy(&ih, &h, sizeof ih);
    uintptr_t m;
    rc = ipc_rc(ipc_open(&m, &ih, current));
    if (rc == OK) *p = (CUdeviceptr)m;
    return rc;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    CUresult rc = ready();
    if (rc) return rc;
    return ipc_rc(ipc_close((uintptr_t)p));
}

#endif /* MOCK_CUDA_NO_IPC */

/* Test helpers (not CUDA): direct access to "device" memory. */
int kvlane_mock_cuda_allocations(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].base != 0 && allocs[i].device >= 0;
    pthread_mutex_unlock(&lock);
    return n;
}
