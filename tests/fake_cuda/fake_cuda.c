/*
 * A stand-in for the NVIDIA driver (libcuda.so.1), for testing aiostream's CUDA backend on
 * machines without a GPU. The tests build it with the machine's C compiler and run the backend
 * against it in a subprocess whose LD_LIBRARY_PATH points at it.
 *
 * It implements, in memory on the CPU, exactly the driver entry points the backend uses, at the
 * versions cuda-python asks for through cuGetProcAddress_v2. Device work is a time model: each
 * stream has a tail (the monotonic time at which its work so far completes); a kernel adds its
 * duration, an event records the tail, waiting on an event raises the tail. Synchronize calls
 * sleep until the time comes (no CPU), as a blocking-sync wait does.
 *
 * Environment: FAKE_CUDA_DEVICES (default 1; 0 makes cuInit fail with CUDA_ERROR_NO_DEVICE),
 * FAKE_CUDA_STUB=1 (cuInit fails as the toolkit's stub library does), FAKE_CUDA_TRACE=1 (print
 * each symbol lookup to stderr).
 * Test hooks (called through ctypes): fake_cuda_fail_next_launch(code) makes the next kernel
 * fail when it completes, with a sticky error, and fake_cuda_clear_error() forgets it (a real
 * context stays failed); fake_cuda_live(kind) counts live handles (0 streams, 1 events,
 * 2 contexts, 3 pinned host buffers, 4 device buffers, 5 modules); fake_cuda_violations()
 * counts handles released twice or after their context; fake_cuda_host_calls() counts host
 * functions launched.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);
typedef struct { char reserved[64]; } CUipcEventHandle;

enum {
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, STUB_LIBRARY = 34,
    NO_DEVICE = 100, INVALID_DEVICE = 101, INVALID_IMAGE = 200, INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600, CONTEXT_IS_DESTROYED = 709,
    LAUNCH_FAILED = 719,
};
enum { EV_BLOCKING = 1, EV_DISABLE_TIMING = 2, EV_INTERPROCESS = 4 };
enum { KIND_STREAM = 0, KIND_EVENT = 1, KIND_CONTEXT = 2, KIND_HOST = 3, KIND_DEVICE = 4,
       KIND_MODULE = 5 };
#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x4556454eu
#define DEAD 0xdeadu

typedef struct { unsigned magic; int dev; int priority; uint64_t tail; } Stream;
typedef struct Event {
    unsigned magic; int dev; unsigned flags; int recorded; uint64_t time; struct Event *peer;
} Event;
typedef struct { int dev; } Module;
typedef struct { int dev; } Function;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, ndevices = 1;
static int ctx_refs[8];
static Stream default_streams[8];
static __thread int current_dev = -1;
static __thread int ctx_stack[16], ctx_stack_depth;
static CUresult sticky;
static uint64_t sticky_at;
static int fail_next_code;
static long live[6], violations, host_calls;
static const char ipc_magic[8] = "AIOSFAKE";

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t) {
    uint64_t n = now_ns();
    if (t <= n) return;
    struct timespec ts = {(time_t)((t - n) / 1000000000u), (long)((t - n) % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0) {}
}

static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* The sticky error, once the failing work's time has come; call with the lock held. */
static CUresult failed(void) {
    return (sticky && now_ns() >= sticky_at) ? sticky : OK;
}

static Stream *stream_of(void *h) {
    if (h == NULL || h == (void *)1 || h == (void *)2) {
        return &default_streams[current_dev < 0 ? 0 : current_dev];
    }
    Stream *s = h;
    return s->magic == STREAM_MAGIC ? s : NULL;
}

static Event *event_of(void *h) {
    Event *e = h;
    return (e != NULL && e->magic == EVENT_MAGIC) ? e : NULL;
}

#define LOCKED(body) do { pthread_mutex_lock(&lock); CUresult r_ = (body); \
    pthread_mutex_unlock(&lock); return r_; } while (0)
#define NEEDS_INIT() do { if (!initialized) { pthread_mutex_unlock(&lock); \
    return NOT_INITIALIZED; } } while (0)

/* ------------------------------------------------------------------ init and devices */

static CUresult cuInit(unsigned flags) {
    (void)flags;
    if (getenv("FAKE_CUDA_STUB") && atoi(getenv("FAKE_CUDA_STUB"))) return STUB_LIBRARY;
    const char *n = getenv("FAKE_CUDA_DEVICES");
    ndevices = n ? atoi(n) : 1;
    if (ndevices <= 0) return NO_DEVICE;
    if (ndevices > 8) ndevices = 8;
    initialized = 1;
    return OK;
}

static CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }

static CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return NOT_INITIALIZED;
    *count = ndevices;
    return OK;
}

static CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= ndevices) return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

static CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (dev < 0 || dev >= ndevices) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "aiostream fake GPU %d", dev);
    return OK;
}

static const char *error_name(CUresult r) {
    switch (r) {
    case OK: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
    case NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CONTEXT_IS_DESTROYED: return "CUDA_ERROR_CONTEXT_IS_DESTROYED";
    case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    default: return NULL;
    }
}

static CUresult cuGetErrorName(CUresult r, const char **out) {
    *out = error_name(r);
    return *out ? OK : INVALID_VALUE;
}

static CUresult cuGetErrorString(CUresult r, const char **out) {
    switch (r) {
    case INVALID_HANDLE: *out = "invalid resource handle"; return OK;
    case LAUNCH_FAILED: *out = "unspecified launch failure"; return OK;
    case INVALID_VALUE: *out = "invalid argument"; return OK;
    case NOT_READY: *out = "device not ready"; return OK;
    default: *out = error_name(r); return *out ? OK : INVALID_VALUE;
    }
}

/* ------------------------------------------------------------------ contexts */

static CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice dev) {
    pthread_mutex_lock(&lock);
    NEEDS_INIT();
    if (dev < 0 || dev >= ndevices) { pthread_mutex_unlock(&lock); return INVALID_DEVICE; }
    if (ctx_refs[dev]++ == 0) live[KIND_CONTEXT]++;
    *ctx = (void *)(uintptr_t)(0x1000 + dev);
    pthread_mutex_unlock(&lock);
    return OK;
}

static CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    pthread_mutex_lock(&lock);
    CUresult r = OK;
    if (dev < 0 || dev >= ndevices) r = INVALID_DEVICE;
    else if (ctx_refs[dev] == 0) { violations++; r = INVALID_CONTEXT; }
    else if (--ctx_refs[dev] == 0) live[KIND_CONTEXT]--;
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuCtxSetCurrent(void *ctx) {
    if (ctx == NULL) { current_dev = -1; return OK; }
    int dev = (int)((uintptr_t)ctx - 0x1000);
    if (dev < 0 || dev >= ndevices) return INVALID_CONTEXT;
    current_dev = dev;
    return OK;
}

static CUresult cuCtxPushCurrent(void *ctx) {
    if (ctx_stack_depth >= 16) return INVALID_VALUE;
    ctx_stack[ctx_stack_depth++] = current_dev;
    return cuCtxSetCurrent(ctx);
}

static CUresult cuCtxPopCurrent(void **out) {
    if (ctx_stack_depth == 0) return INVALID_CONTEXT;
    if (out) *out = current_dev < 0 ? NULL : (void *)(uintptr_t)(0x1000 + current_dev);
    current_dev = ctx_stack[--ctx_stack_depth];
    return OK;
}

/* Work needs a current, retained context; handles need theirs to be alive. */
static CUresult need_context(void) {
    if (current_dev < 0) return INVALID_CONTEXT;
    if (ctx_refs[current_dev] == 0) return CONTEXT_IS_DESTROYED;
    return failed();
}

static CUresult alive(int dev) {
    if (ctx_refs[dev] == 0) { violations++; return CONTEXT_IS_DESTROYED; }
    return OK;
}

static CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    *least = 0;
    *greatest = -5;
    return OK;
}

static CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    uint64_t t = 0;
    if (r == OK) t = default_streams[current_dev].tail;
    pthread_mutex_unlock(&lock);
    sleep_until(t);
    return r;
}

/* ------------------------------------------------------------------ streams */

static CUresult cuStreamCreateWithPriority(void **out, unsigned flags, int priority) {
    (void)flags;
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    if (r == OK) {
        Stream *s = calloc(1, sizeof *s);
        s->magic = STREAM_MAGIC;
        s->dev = current_dev;
        s->priority = priority < -5 ? -5 : (priority > 0 ? 0 : priority);
        *out = s;
        live[KIND_STREAM]++;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuStreamGetPriority(void *h, int *priority) {
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(h);
    CUresult r = s ? OK : INVALID_HANDLE;
    if (s) *priority = s->priority;
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuStreamDestroy(void *h) {
    pthread_mutex_lock(&lock);
    Stream *s = h;
    CUresult r = OK;
    if (s == NULL || s->magic != STREAM_MAGIC) { violations++; r = INVALID_HANDLE; }
    else if ((r = alive(s->dev)) == OK) { s->magic = DEAD; live[KIND_STREAM]--; }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuStreamQuery(void *h) {
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(h);
    CUresult r = s ? failed() : INVALID_HANDLE;
    if (r == OK && now_ns() < s->tail) r = NOT_READY;
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuStreamSynchronize(void *h) {
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(h);
    uint64_t t = s ? s->tail : 0;
    pthread_mutex_unlock(&lock);
    if (!s) return INVALID_HANDLE;
    sleep_until(t);
    LOCKED(failed());
}

static CUresult cuStreamWaitEvent(void *hs, void *he, unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(hs);
    Event *e = event_of(he);
    CUresult r = (s && e) ? failed() : INVALID_HANDLE;
    if (r == OK) {
        Event *src = e->peer ? e->peer : e;
        if (src->recorded) s->tail = max_u64(s->tail, src->time);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* ------------------------------------------------------------------ events */

static CUresult cuEventCreate(void **out, unsigned flags) {
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    if (r == OK && (flags & EV_INTERPROCESS) && !(flags & EV_DISABLE_TIMING)) r = INVALID_VALUE;
    if (r == OK) {
        Event *e = calloc(1, sizeof *e);
        e->magic = EVENT_MAGIC;
        e->dev = current_dev;
        e->flags = flags;
        *out = e;
        live[KIND_EVENT]++;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuEventDestroy(void *h) {
    pthread_mutex_lock(&lock);
    Event *e = h;
    CUresult r = OK;
    if (e == NULL || e->magic != EVENT_MAGIC) { violations++; r = INVALID_HANDLE; }
    else if ((r = alive(e->dev)) == OK) { e->magic = DEAD; live[KIND_EVENT]--; }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuEventRecord(void *he, void *hs) {
    pthread_mutex_lock(&lock);
    Event *e = event_of(he);
    Stream *s = stream_of(hs);
    CUresult r = (e && s) ? failed() : INVALID_HANDLE;
    if (r == OK) {
        e->recorded = 1;
        e->time = max_u64(s->tail, now_ns());
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuEventQuery(void *h) {
    pthread_mutex_lock(&lock);
    Event *e = event_of(h);
    CUresult r = e ? failed() : INVALID_HANDLE;
    if (r == OK) {
        Event *src = e->peer ? e->peer : e;
        if (src->recorded && now_ns() < src->time) r = NOT_READY;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuEventSynchronize(void *h) {
    pthread_mutex_lock(&lock);
    Event *e = event_of(h);
    uint64_t t = 0;
    if (e) {
        Event *src = e->peer ? e->peer : e;
        t = src->recorded ? src->time : 0;
    }
    pthread_mutex_unlock(&lock);
    if (!e) return INVALID_HANDLE;
    sleep_until(t);
    LOCKED(failed());
}

static CUresult cuEventElapsedTime(float *ms, void *hstart, void *hend) {
    pthread_mutex_lock(&lock);
    Event *a = event_of(hstart), *b = event_of(hend);
    CUresult r = (a && b) ? failed() : INVALID_HANDLE;
    if (r == OK && ((a->flags | b->flags) & EV_DISABLE_TIMING)) r = INVALID_HANDLE;
    if (r == OK && (!a->recorded || !b->recorded)) r = INVALID_HANDLE;
    if (r == OK && (now_ns() < a->time || now_ns() < b->time)) r = NOT_READY;
    if (r == OK) *ms = (float)((double)((int64_t)(b->time - a->time)) / 1e6);
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuIpcGetEventHandle(CUipcEventHandle *out, void *h) {
    pthread_mutex_lock(&lock);
    Event *e = event_of(h);
    CUresult r = e ? OK : INVALID_HANDLE;
    if (r == OK && !(e->flags & EV_INTERPROCESS)) r = INVALID_VALUE;
    if (r == OK) {
        memset(out, 0, sizeof *out);
        memcpy(out->reserved, ipc_magic, 8);
        pid_t pid = getpid();
        memcpy(out->reserved + 8, &pid, sizeof pid);
        memcpy(out->reserved + 16, &e, sizeof e);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuIpcOpenEventHandle(void **out, CUipcEventHandle handle) {
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    Event *src = NULL;
    pid_t pid;
    memcpy(&pid, handle.reserved + 8, sizeof pid);
    memcpy(&src, handle.reserved + 16, sizeof src);
    if (r == OK && (memcmp(handle.reserved, ipc_magic, 8) != 0 || pid != getpid() ||
                    event_of(src) == NULL)) {
        r = INVALID_VALUE;  /* this stand-in shares events within one process only */
    }
    if (r == OK) {
        Event *e = calloc(1, sizeof *e);
        e->magic = EVENT_MAGIC;
        e->dev = current_dev;
        e->flags = EV_INTERPROCESS | EV_DISABLE_TIMING;
        e->peer = src;
        *out = e;
        live[KIND_EVENT]++;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* ------------------------------------------------------------------ modules and kernels */

static CUresult cuModuleLoadData(void **out, const void *image) {
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    if (r == OK && strstr((const char *)image, ".entry aiostream_sleep") == NULL) r = INVALID_IMAGE;
    if (r == OK) {
        Module *m = calloc(1, sizeof *m);
        m->dev = current_dev;
        *out = m;
        live[KIND_MODULE]++;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuModuleUnload(void *m) {
    pthread_mutex_lock(&lock);
    CUresult r = alive(((Module *)m)->dev);
    if (r == OK) live[KIND_MODULE]--;
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuModuleGetFunction(void **out, void *m, const char *name) {
    if (strcmp(name, "aiostream_sleep") != 0) return NOT_FOUND;
    Function *f = calloc(1, sizeof *f);
    f->dev = ((Module *)m)->dev;
    *out = f;
    return OK;
}

/* Runs the sleep kernel: its one parameter is the duration in nanoseconds. */
static CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, void *hs, void **params,
                               void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)extra;
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(hs);
    CUresult r = s ? failed() : INVALID_HANDLE;
    if (r == OK && params == NULL) r = INVALID_VALUE;
    if (r == OK) {
        uint64_t ns = *(uint64_t *)params[0];
        s->tail = max_u64(s->tail, now_ns()) + ns;
        if (fail_next_code) {
            sticky = fail_next_code;
            sticky_at = s->tail;
            fail_next_code = 0;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

typedef struct { CUhostFn fn; void *data; uint64_t at; } HostCall;

static void *host_call(void *arg) {
    HostCall *c = arg;
    sleep_until(c->at);
    pthread_mutex_lock(&lock);
    int skip = failed() != OK;  /* host functions never run once the context has failed */
    pthread_mutex_unlock(&lock);
    if (!skip) c->fn(c->data);
    free(c);
    return NULL;
}

static CUresult cuLaunchHostFunc(void *hs, CUhostFn fn, void *data) {
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(hs);
    CUresult r = s ? failed() : INVALID_HANDLE;
    if (r == OK) {
        host_calls++;
        HostCall *c = malloc(sizeof *c);
        c->fn = fn;
        c->data = data;
        c->at = max_u64(s->tail, now_ns());
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, host_call, c) != 0) { free(c); r = OUT_OF_MEMORY; }
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* ------------------------------------------------------------------ memory */

static CUresult cuMemHostAlloc(void **out, size_t n, unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    if (r == OK) {
        *out = calloc(1, n ? n : 1);
        live[KIND_HOST]++;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuMemFreeHost(void *p) {
    pthread_mutex_lock(&lock);
    free(p);
    live[KIND_HOST]--;
    pthread_mutex_unlock(&lock);
    return OK;
}

static CUresult cuMemAllocAsync(CUdeviceptr *out, size_t n, void *hs) {
    pthread_mutex_lock(&lock);
    CUresult r = need_context();
    if (r == OK && !stream_of(hs)) r = INVALID_HANDLE;
    if (r == OK) {
        *out = (CUdeviceptr)(uintptr_t)calloc(1, n ? n : 1);
        live[KIND_DEVICE]++;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuMemFreeAsync(CUdeviceptr p, void *hs) {
    (void)hs;
    pthread_mutex_lock(&lock);
    free((void *)(uintptr_t)p);
    live[KIND_DEVICE]--;
    pthread_mutex_unlock(&lock);
    return OK;
}

/* Data moves in order with the stream's earlier work: the call waits for it (unlike a real
 * driver, which returns at once), then copies. */
static CUresult copy(void *dst, const void *src, size_t n, void *hs) {
    pthread_mutex_lock(&lock);
    Stream *s = stream_of(hs);
    uint64_t t = s ? s->tail : 0;
    pthread_mutex_unlock(&lock);
    if (!s) return INVALID_HANDLE;
    sleep_until(t);
    pthread_mutex_lock(&lock);
    CUresult r = failed();
    if (r == OK) memcpy(dst, src, n);
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, void *hs) {
    return copy((void *)(uintptr_t)dst, src, n, hs);
}

static CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, void *hs) {
    return copy(dst, (const void *)(uintptr_t)src, n, hs);
}

static CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *hs) {
    return copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, hs);
}

/* ------------------------------------------------------------------ test hooks */

void fake_cuda_fail_next_launch(int code) {
    pthread_mutex_lock(&lock);
    fail_next_code = code;
    pthread_mutex_unlock(&lock);
}

long fake_cuda_live(int kind) {
    pthread_mutex_lock(&lock);
    long n = (kind >= 0 && kind < 6) ? live[kind] : -1;
    pthread_mutex_unlock(&lock);
    return n;
}

void fake_cuda_clear_error(void) {
    pthread_mutex_lock(&lock);
    sticky = OK;
    fail_next_code = 0;
    pthread_mutex_unlock(&lock);
}

long fake_cuda_host_calls(void) {
    pthread_mutex_lock(&lock);
    long n = host_calls;
    pthread_mutex_unlock(&lock);
    return n;
}

long fake_cuda_violations(void) {
    pthread_mutex_lock(&lock);
    long n = violations;
    pthread_mutex_unlock(&lock);
    return n;
}

/* ------------------------------------------------------------------ entry point lookup */

typedef struct { const char *name; int version; void *fn; } Entry;

static const Entry entries[] = {
    {"cuInit", 2000, (void *)cuInit},
    {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion},
    {"cuGetErrorName", 6000, (void *)cuGetErrorName},
    {"cuGetErrorString", 6000, (void *)cuGetErrorString},
    {"cuDeviceGet", 2000, (void *)cuDeviceGet},
    {"cuDeviceGetCount", 2000, (void *)cuDeviceGetCount},
    {"cuDeviceGetName", 2000, (void *)cuDeviceGetName},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)cuDevicePrimaryCtxRelease},
    {"cuCtxSetCurrent", 4000, (void *)cuCtxSetCurrent},
    {"cuCtxPushCurrent", 4000, (void *)cuCtxPushCurrent},
    {"cuCtxPopCurrent", 4000, (void *)cuCtxPopCurrent},
    {"cuCtxGetStreamPriorityRange", 5050, (void *)cuCtxGetStreamPriorityRange},
    {"cuCtxSynchronize", 2000, (void *)cuCtxSynchronize},
    {"cuStreamCreateWithPriority", 5050, (void *)cuStreamCreateWithPriority},
    {"cuStreamGetPriority", 5050, (void *)cuStreamGetPriority},
    {"cuStreamDestroy", 4000, (void *)cuStreamDestroy},
    {"cuStreamQuery", 2000, (void *)cuStreamQuery},
    {"cuStreamSynchronize", 2000, (void *)cuStreamSynchronize},
    {"cuStreamWaitEvent", 3020, (void *)cuStreamWaitEvent},
    {"cuEventCreate", 2000, (void *)cuEventCreate},
    {"cuEventDestroy", 4000, (void *)cuEventDestroy},
    {"cuEventRecord", 2000, (void *)cuEventRecord},
    {"cuEventQuery", 2000, (void *)cuEventQuery},
    {"cuEventSynchronize", 2000, (void *)cuEventSynchronize},
    {"cuEventElapsedTime", 12080, (void *)cuEventElapsedTime},
    {"cuIpcGetEventHandle", 4010, (void *)cuIpcGetEventHandle},
    {"cuIpcOpenEventHandle", 4010, (void *)cuIpcOpenEventHandle},
    {"cuModuleLoadData", 2000, (void *)cuModuleLoadData},
    {"cuModuleUnload", 2000, (void *)cuModuleUnload},
    {"cuModuleGetFunction", 2000, (void *)cuModuleGetFunction},
    {"cuLaunchKernel", 4000, (void *)cuLaunchKernel},
    {"cuLaunchHostFunc", 10000, (void *)cuLaunchHostFunc},
    {"cuMemHostAlloc", 2020, (void *)cuMemHostAlloc},
    {"cuMemFreeHost", 2000, (void *)cuMemFreeHost},
    {"cuMemAllocAsync", 11020, (void *)cuMemAllocAsync},
    {"cuMemFreeAsync", 11020, (void *)cuMemFreeAsync},
    {"cuMemcpyHtoDAsync", 3020, (void *)cuMemcpyHtoDAsync},
    {"cuMemcpyDtoHAsync", 3020, (void *)cuMemcpyDtoHAsync},
    {"cuMemcpyDtoDAsync", 3020, (void *)cuMemcpyDtoDAsync},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status) {
    (void)flags;
    int found = 0;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        if (strcmp(entries[i].name, symbol) != 0) continue;
        found = 1;
        if (entries[i].version == version) {
            *pfn = entries[i].fn;
            if (status) *status = 0;
            return OK;
        }
    }
    if (getenv("FAKE_CUDA_TRACE")) fprintf(stderr, "fake_cuda: no %s v%d\n", symbol, version);
    *pfn = NULL;
    if (status) *status = found ? 2 : 1;  /* VERSION_NOT_SUFFICIENT or SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}

/* Exported under their own names too, for anything that looks them up with dlsym. */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
