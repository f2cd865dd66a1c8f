/*
 * A stand-in for the NVIDIA driver (libcuda.so.1), for testing aiostream's CUDA backend on
 * machines without a GPU. The tests build it with the machine's C compiler and run the backend
 * against it in a subprocess whose LD_LIBRARY_PATH points at it.
 *
 * It implements, in memory on the CPU, the driver entry points the backend uses, at the
 * versions cuda-python asks for through cuGetProcAddress_v2, and it keeps the driver API's
 * documented contract, strictly by default: where the documentation says a call is invalid,
 * this driver refuses it and counts a *violation*; a test may relax one rule where it needs to.
 *
 * The contract kept:
 * - Contexts. Each device has one primary context, retained and released by count. Every call
 *   that acts on a context's objects (streams, events, modules, memory, launches, copies, host
 *   functions) needs that context current on the calling thread (a per-thread stack, as
 *   cuCtxPushCurrent/PopCurrent/SetCurrent keep it); otherwise CUDA_ERROR_INVALID_CONTEXT.
 *   cuEventRecord needs the event and the stream in one context (CUDA_ERROR_INVALID_HANDLE).
 *   Releasing the last reference resets the context: its objects are destroyed (pinned memory
 *   unmapped), and handles still alive then are counted as leaked.
 * - Work. Each operation gets a due time when it is submitted (after the earlier work of its
 *   stream, the events the stream waits for, and the operation's own duration), and one driver
 *   thread of this library's own completes operations in (due time, submission) order: a
 *   kernel at its end, a copy moving its bytes then (never at the call), an event record, a
 *   host function called on that thread. Queries and synchronizations read what that thread
 *   has completed; synchronizations sleep on a condition variable, as blocking-sync waits do.
 * - Faults. A kernel made to fail sets its context's sticky error when it completes; every
 *   later call in that context returns it, and no later operation of the context takes effect:
 *   host functions enqueued before or after it never run, copies move nothing.
 * - Memory. Pinned host memory is mmap'd and unmapped when freed, so touching it afterwards
 *   crashes, as on a GPU. A stream-ordered allocation completes after its stream's earlier work
 *   plus FAKE_CUDA_ALLOC_NS (default 1 ms); an operation on another stream that runs before
 *   the allocation completed is a violation, as is any operation on freed memory and a free of
 *   memory that pending operations still use. Pinned memory used in another context's copy
 *   needs CU_MEMHOSTALLOC_PORTABLE. Pageable host memory is staged at the call (host to
 *   device) or copied before the call returns (device to host), as the driver does.
 * - Stream memory operations: cuStreamWriteValue32 writes its value when the stream reaches
 *   it, into device memory or pinned memory allocated with CU_MEMHOSTALLOC_DEVICEMAP. Its
 *   flags are CU_STREAM_WRITE_VALUE_DEFAULT (0) and CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
 *   (1), any other is a violation (CUDA_ERROR_INVALID_VALUE). Without the barrier the write
 *   "may be reordered with writes issued before it": behind pending work, its value lands
 *   as that work ends, 20 ms before the work's own effects (its bytes, its completion).
 * - cuStreamWaitEvent takes flags 0 only: CU_EVENT_WAIT_EXTERNAL is for stream capture,
 *   which this driver does not do (a violation, CUDA_ERROR_INVALID_VALUE). A wait for a
 *   record not yet completed is an operation of the stream ("all operations in the stream",
 *   cuStreamQuery): the stream is busy, and cuStreamQuery answers CUDA_ERROR_NOT_READY, until
 *   the record completes.
 * - IPC. Events and cuMemAlloc's memory are shared across processes through memfd mappings
 *   (the other process maps /proc/<pid>/fd/<fd>). cuIpcGetMemHandle takes the base of a
 *   cuMemAlloc allocation only (not a pool's); cuIpcOpenMemHandle takes
 *   CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, opens in another process only (in the exporting one it
 *   is a violation, CUDA_ERROR_INVALID_CONTEXT), counts a second open in one context, and its
 *   memory is closed with cuIpcCloseMemHandle, not cuMemFree. A stream waiting for an event
 *   of another process has the calling thread wait until that process completed the record
 *   (this driver's processes share no device).
 * - Host functions must be C functions: one that is not a named symbol of a loaded library
 *   (dladdr), such as a ctypes closure that would run Python on this driver thread, is a
 *   violation (rule "python-host-fn").
 * - At exit it reports live handles, leaked handles and every violation on stderr, and the
 *   process exits with status 70 if there is any (live handles are allowed under rule "exit",
 *   and in a context with work pending at exit, or pending at its last cuStreamQuery; memory
 *   is allowed: the program may still read it, and the exit frees it with its context).
 *
 * Environment: FAKE_CUDA_DEVICES (default 1; 0 makes cuInit fail with CUDA_ERROR_NO_DEVICE),
 * FAKE_CUDA_STUB=1 (cuInit fails as the toolkit's stub library does), FAKE_CUDA_NO_POOLS=1 (no
 * memory pools: cuMemAllocAsync returns CUDA_ERROR_NOT_SUPPORTED), FAKE_CUDA_ALLOC_NS,
 * FAKE_CUDA_RELAX (comma-separated rules to relax: context, portable, python-host-fn, exit),
 * FAKE_CUDA_TRACE=1 (print symbol lookups that fail, and violations as they happen).
 *
 * Test hooks (called through ctypes) are at the end of this file, each with its comment.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, STUB_LIBRARY = 34,
    NO_DEVICE = 100, INVALID_DEVICE = 101, INVALID_IMAGE = 200, INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600, CONTEXT_IS_DESTROYED = 709,
    LAUNCH_FAILED = 719, NOT_SUPPORTED = 801,
};
enum { EV_BLOCKING = 1, EV_DISABLE_TIMING = 2, EV_INTERPROCESS = 4 };
enum { HOST_PORTABLE = 1, HOST_DEVICEMAP = 2 };
enum { ATTR_MEMORY_POOLS_SUPPORTED = 115 };
enum { KIND_STREAM = 0, KIND_EVENT = 1, KIND_CONTEXT = 2, KIND_HOST = 3, KIND_DEVICE = 4,
       KIND_MODULE = 5, KIND_FUNCTION = 6 };
enum { RELAX_CONTEXT = 1, RELAX_PORTABLE = 2, RELAX_PYTHON_HOST_FN = 4, RELAX_EXIT = 8 };
#define MAXDEV 8
#define MAGIC 0xC0DA5EEDu
#define COPY_LATENCY_NS 5000u
#define COPY_BYTES_PER_NS 10u  /* 10 GB/s */

static const char *kind_names[] = {"stream", "event", "context", "pinned host buffer",
                                   "device buffer", "module", "function"};

/* ------------------------------------------------------------------ objects */

typedef struct Ctx {
    int dev;
    int refs;
    unsigned gen;          /* a reset starts a new generation; objects remember theirs */
    CUresult sticky;       /* the context's sticky error, once its failing work completed */
    int failed_once;       /* it had one in this generation (even if a test cleared it) */
    struct Stream *null_stream;
    uint64_t submitted, done;  /* operations of this generation */
    int last_busy;         /* the program saw work pending in it: a cuEventQuery answered
                            * CUDA_ERROR_NOT_READY, or its last cuStreamQuery did */
} Ctx;

typedef struct Obj {
    unsigned magic;
    int kind;
    Ctx *ctx;
    unsigned gen;
    int dead;              /* destroyed explicitly, or with its context */
} Obj;

typedef struct Stream {
    Obj h;
    int priority, is_null;
    uint64_t tail;         /* due time of its last operation */
    uint64_t submitted, done;
} Stream;

typedef struct Event {
    Obj h;
    unsigned flags;
    uint64_t recs, done;   /* records submitted, and the last one completed */
    uint64_t due;          /* due time of the latest record */
    uint64_t time;         /* completion time of the last completed record */
    int blockers;          /* threads inside cuEventSynchronize on it */
    struct Event *peer;    /* an IPC-opened event follows its source */
    struct IpcEventState *ipc;           /* an interprocess event's state, shared (memfd) */
    int ipc_fd;
    const struct IpcEventState *remote;  /* opened from another process: its state */
    pid_t remote_pid;
} Event;

typedef struct Module { Obj h; } Module;
typedef struct Function { Obj h; Module *module; } Function;

typedef struct Block {
    Obj h;
    char *base;
    size_t size, mapped;   /* mapped > 0: mmap'd (pinned host memory) */
    int host, portable, pooled, mapped_for_device;
    int ready;             /* a stream-ordered allocation has completed */
    int freed, free_submitted;
    long pending;          /* operations submitted and not completed that use it */
    Stream *alloc_stream;
    int shared, fd;        /* cuMemAlloc's memory: a memfd mapping other processes can map */
    int imported;          /* opened from another process (cuIpcOpenMemHandle) */
    long opens;            /* its cuIpcOpenMemHandle references */
    uint64_t serial;       /* which export: the handle of a new allocation differs */
    pid_t exporter;        /* imported: the process that exported it */
} Block;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER;      /* new operations */
static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;  /* operations completed */
static int initialized, ndevices = 1, no_pools, relaxed;
static uint64_t alloc_ns = 1000000;
static Ctx ctxs[MAXDEV];
static __thread Ctx *ctx_stack[32];
static __thread int ctx_depth;
static int fail_next_code;
static long violations, leaks, host_calls, host_calls_python;
static uint64_t host_fn_ns;  /* how late each host function runs after the work before it */
static uint64_t host_fn_return_ns;  /* how long after its host function returns the stream goes on */
static char vlog[16][240];
static const char ipc_magic[8] = "AIOSFAKE";
static const char ipc_mem_magic[8] = "AIOSFMEM";
static uint64_t ipc_serial;

/* Sharing across processes. This driver's processes share no device, so what they share
 * lives in memfd mappings the other process maps through /proc/<pid>/fd/<fd>: the memory of
 * cuMemAlloc (cuIpcGetMemHandle), and the progress of an interprocess event. */
typedef struct IpcEventState { uint64_t recs, done, due; } IpcEventState;

/* A new shared mapping of ``size`` bytes (zeroed), and its fd in ``*fd``; NULL on failure. */
static void *shared_map(size_t size, int *fd) {
    *fd = memfd_create("fake_cuda", MFD_CLOEXEC);
    if (*fd < 0) return NULL;
    void *p = MAP_FAILED;
    if (ftruncate(*fd, (off_t)size) == 0) {
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    }
    if (p == MAP_FAILED) {
        close(*fd);
        return NULL;
    }
    return p;
}

/* Map another process's shared fd (NULL if it is gone). */
static void *map_remote(pid_t pid, int fd, size_t size, int prot) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
    int local = open(path, (prot & PROT_WRITE) ? O_RDWR : O_RDONLY);
    if (local < 0) return NULL;
    void *p = mmap(NULL, size, prot, MAP_SHARED, local, 0);
    close(local);
    return p == MAP_FAILED ? NULL : p;
}

/* cuMemAlloc's memory in a memfd mapping, which another process can map; left as it is if
 * that fails (cuIpcGetMemHandle then says CUDA_ERROR_MAP_FAILED). */
static void share_block(Block *b) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t mapped = (b->size + page - 1) / page * page;
    int fd;
    void *p = shared_map(mapped, &fd);
    if (p == NULL) return;
    free(b->base);
    b->base = p;
    b->mapped = mapped;
    b->shared = 1;
    b->fd = fd;
}

/* An interprocess event's progress, published for the processes that opened it. */
static void ipc_publish(Event *e) {
    if (e->ipc == NULL) return;
    __atomic_store_n(&e->ipc->due, e->due, __ATOMIC_RELAXED);
    __atomic_store_n(&e->ipc->recs, e->recs, __ATOMIC_RELEASE);
    __atomic_store_n(&e->ipc->done, e->done, __ATOMIC_RELEASE);
}

/* Whether the record of a remote event captured by ``target`` has completed (or its process
 * is gone, with its work). */
static int remote_done(const Event *e, uint64_t target) {
    if (__atomic_load_n(&e->remote->done, __ATOMIC_ACQUIRE) >= target) return 1;
    return kill(e->remote_pid, 0) != 0 && errno == ESRCH;
}

/* A stream or thread that waits for an event of another process: this driver cannot order
 * its own device after another process's, so the calling thread waits (lock released) until
 * the other process's driver has completed the record captured now. The stream's later work
 * is then ordered after it, as a device-side wait orders it on a GPU. */
static void remote_wait(const Event *e) {
    uint64_t target = __atomic_load_n(&e->remote->recs, __ATOMIC_ACQUIRE);
    while (!remote_done(e, target)) {
        pthread_mutex_unlock(&lock);
        usleep(200);
        pthread_mutex_lock(&lock);
    }
}

/* Every object ever made (never freed, so a stale handle is always recognised), and the
 * memory blocks among them. */
static Obj **objects;
static size_t nobjects, capobjects;
static struct Block **blocks;
static size_t nblocks, capblocks;

/* A set of their addresses, so that a handle is checked without reading through it. */
#define BUCKETS 8192
typedef struct Entry { void *p; struct Entry *next; } Entry;
static Entry *buckets[BUCKETS];

static size_t bucket_of(const void *p) { return ((uintptr_t)p >> 4) % BUCKETS; }

static int known(const void *p) {
    for (Entry *e = buckets[bucket_of(p)]; e; e = e->next) if (e->p == p) return 1;
    return 0;
}

static void *new_object(size_t size, int kind, Ctx *ctx) {
    Obj *o = calloc(1, size);
    o->magic = MAGIC;
    o->kind = kind;
    o->ctx = ctx;
    o->gen = ctx ? ctx->gen : 0;
    Entry *e = malloc(sizeof *e);
    e->p = o;
    e->next = buckets[bucket_of(o)];
    buckets[bucket_of(o)] = e;
    if (nobjects == capobjects) {
        capobjects = capobjects ? 2 * capobjects : 1024;
        objects = realloc(objects, capobjects * sizeof *objects);
    }
    objects[nobjects++] = o;
    return o;
}

static int is_live(const Obj *o) {
    return !o->dead && o->ctx && o->gen == o->ctx->gen && o->ctx->refs > 0;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* Count a breach of the driver's contract (lock held). */
static void violation(const char *fmt, ...) {
    char *slot = vlog[violations % 16];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(slot, sizeof vlog[0], fmt, ap);
    va_end(ap);
    violations++;
    if (getenv("FAKE_CUDA_TRACE")) fprintf(stderr, "fake_cuda: violation: %s\n", slot);
}

/* ------------------------------------------------------------------ failing chosen calls */

typedef struct { char name[64]; long countdown; CUresult code; } FailPoint;
static FailPoint failpoints[8];

/* Whether this call of ``name`` is the one a test asked to fail (lock held). */
static CUresult failpoint(const char *name) {
    for (int i = 0; i < 8; i++) {
        FailPoint *f = &failpoints[i];
        if (f->countdown > 0 && strcmp(f->name, name) == 0 && --f->countdown == 0) return f->code;
    }
    return OK;
}

#define ENTER() pthread_mutex_lock(&lock); do { CUresult fp_ = failpoint(__func__); \
    if (fp_ != OK) { pthread_mutex_unlock(&lock); return fp_; } } while (0)
#define LEAVE(r) do { CUresult r_ = (r); pthread_mutex_unlock(&lock); return r_; } while (0)
/* The same failure point, for entry points that take the lock for nothing else. */
#define FAIL_IF_ASKED() do { pthread_mutex_lock(&lock); CUresult fp_ = failpoint(__func__); \
    pthread_mutex_unlock(&lock); if (fp_ != OK) return fp_; } while (0)

/* ------------------------------------------------------------------ contexts */

static Ctx *current(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }

static const char *ctx_name(const Ctx *c, char *buf) {
    if (c == NULL) return "no context";
    snprintf(buf, 32, "cuda:%d's context", c->dev);
    return buf;
}

/* The context a call on ``o`` (NULL: on the current context itself) runs in, checked. */
static CUresult need_context(const char *call, const Obj *o) {
    Ctx *cur = current();
    char a[32], b[32];
    if (relaxed & RELAX_CONTEXT) {
        if (o != NULL) cur = o->ctx;
        if (cur == NULL) return INVALID_CONTEXT;
    } else if (cur == NULL) {
        violation("%s with no current context%s", call,
                  o ? " (the object's context must be current)" : "");
        return INVALID_CONTEXT;
    } else if (o != NULL && cur != o->ctx) {
        violation("%s on an object of %s with %s current", call, ctx_name(o->ctx, a),
                  ctx_name(cur, b));
        return INVALID_CONTEXT;
    }
    if (cur->refs == 0) {
        violation("%s in %s, which was reset (its last reference released)", call,
                  ctx_name(cur, a));
        return CONTEXT_IS_DESTROYED;
    }
    return cur->sticky;
}

/* Look up a handle of ``kind`` without trusting it. */
static Obj *lookup(void *h, int kind, const char *call, CUresult *err) {
    if (h == NULL || !known(h)) {
        violation("%s: %p is not a handle this driver gave out", call, h);
        *err = INVALID_HANDLE;
        return NULL;
    }
    Obj *o = h;
    if (o->kind != kind) {
        violation("%s: %p is a %s, not a %s", call, h, kind_names[o->kind], kind_names[kind]);
        *err = INVALID_HANDLE;
        return NULL;
    }
    if (o->dead || o->gen != o->ctx->gen) {
        violation("%s: a %s used after it was destroyed%s", call, kind_names[kind],
                  o->gen != o->ctx->gen ? " with its context" : "");
        *err = INVALID_HANDLE;
        return NULL;
    }
    *err = OK;
    return o;
}

/* A stream handle: NULL and the legacy/per-thread constants mean the current context's
 * default stream. */
static Stream *stream_of(void *h, const char *call, CUresult *err) {
    if (h == NULL || h == (void *)1 || h == (void *)2) {
        Ctx *cur = current();
        if (cur == NULL || cur->refs == 0) {
            if (!(relaxed & RELAX_CONTEXT) || cur == NULL) {
                violation("%s on the default stream with no current context", call);
                *err = INVALID_CONTEXT;
                return NULL;
            }
        }
        *err = OK;
        return cur->null_stream;
    }
    return (Stream *)lookup(h, KIND_STREAM, call, err);
}

static void reset_context(Ctx *c);

static CUresult cuDevicePrimaryCtxRetain(void **out, CUdevice dev) {
    ENTER();
    if (!initialized) LEAVE(NOT_INITIALIZED);
    if (dev < 0 || dev >= ndevices) LEAVE(INVALID_DEVICE);
    Ctx *c = &ctxs[dev];
    if (c->refs++ == 0) {
        c->gen++;
        c->sticky = OK;
        c->failed_once = 0;
        c->null_stream = new_object(sizeof(Stream), KIND_STREAM, c);
        c->null_stream->is_null = 1;
    }
    *out = c;
    LEAVE(OK);
}

static CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    ENTER();
    if (dev < 0 || dev >= ndevices) LEAVE(INVALID_DEVICE);
    Ctx *c = &ctxs[dev];
    if (c->refs == 0) {
        violation("cuDevicePrimaryCtxRelease of cuda:%d, which holds no reference", dev);
        LEAVE(INVALID_CONTEXT);
    }
    if (--c->refs == 0) reset_context(c);
    LEAVE(OK);
}

static int valid_ctx(void *h) {
    for (int i = 0; i < ndevices; i++) if (h == &ctxs[i]) return 1;
    return 0;
}

static CUresult cuCtxSetCurrent(void *h) {
    FAIL_IF_ASKED();
    if (h != NULL && !valid_ctx(h)) return INVALID_CONTEXT;
    if (ctx_depth == 0) {
        if (h == NULL) return OK;
        ctx_stack[ctx_depth++] = h;
    } else {
        ctx_stack[ctx_depth - 1] = h;
    }
    return OK;
}

static CUresult cuCtxGetCurrent(void **out) {
    FAIL_IF_ASKED();
    *out = current();
    return OK;
}

static CUresult cuCtxPushCurrent(void *h) {
    FAIL_IF_ASKED();
    if (!valid_ctx(h)) return INVALID_CONTEXT;
    if (ctx_depth >= 32) return INVALID_VALUE;
    ctx_stack[ctx_depth++] = h;
    return OK;
}

static CUresult cuCtxPopCurrent(void **out) {
    FAIL_IF_ASKED();
    if (ctx_depth == 0) return INVALID_CONTEXT;
    Ctx *c = ctx_stack[--ctx_depth];
    if (out) *out = c;
    return OK;
}

static CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    ENTER();
    CUresult r = need_context("cuCtxGetStreamPriorityRange", NULL);
    if (r == OK) {
        *least = 0;
        *greatest = -5;
    }
    LEAVE(r);
}

/* ------------------------------------------------------------------ the driver's thread */

enum {
    OP_KERNEL, OP_RECORD, OP_COPY, OP_HOSTFN, OP_ALLOC, OP_FREE, OP_TOUCH, OP_WRITE32, OP_WAIT
};

typedef struct Op {
    uint64_t due, seq;
    int kind;
    Stream *s;
    unsigned gen;
    CUresult fail;               /* OP_KERNEL: the sticky error it sets */
    Event *e;                    /* OP_RECORD */
    uint64_t rec;
    char *dst, *src;             /* OP_COPY, OP_TOUCH (src) */
    size_t n;
    Block *bdst, *bsrc;
    char *staging;               /* a pageable source, staged at the call */
    CUhostFn fn;                 /* OP_HOSTFN */
    void *data;
    Block *block;                /* OP_ALLOC, OP_FREE */
    uint32_t value;              /* OP_WRITE32: written at dst */
    int early;                   /* OP_WRITE32 without a barrier: before the work it follows */
} Op;

static Op **heap;
static size_t nheap, capheap;
static uint64_t seq_counter;
static pthread_once_t engine_once = PTHREAD_ONCE_INIT;

static int before(const Op *a, const Op *b) {
    if (a->due != b->due) return a->due < b->due;
    return a->early != b->early ? a->early : a->seq < b->seq;
}

static void heap_push(Op *op) {
    if (nheap == capheap) {
        capheap = capheap ? 2 * capheap : 256;
        heap = realloc(heap, capheap * sizeof *heap);
    }
    size_t i = nheap++;
    while (i > 0 && before(op, heap[(i - 1) / 2])) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = op;
}

static Op *heap_pop(void) {
    Op *top = heap[0], *last = heap[--nheap];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= nheap) break;
        if (c + 1 < nheap && before(heap[c + 1], heap[c])) c++;
        if (!before(heap[c], last)) break;
        heap[i] = heap[c];
        i = c;
    }
    if (nheap) heap[i] = last;
    return top;
}

/* Check, when an operation runs, that the memory it uses may be used (lock held). */
static int usable(Block *b, Stream *s, const char *what) {
    if (b == NULL) return 1;
    if (b->freed) {
        violation("%s on cuda:%d used %s memory after it was freed", what, s->h.ctx->dev,
                  b->host ? "pinned host" : "device");
        return 0;
    }
    if (!b->ready && b->alloc_stream != s) {
        violation("%s used a stream-ordered allocation on another stream before the "
                  "allocation completed (nothing ordered it after the allocation)", what);
    }
    return 1;
}

static void release_block(Block *b) {
    if (b->freed) return;
    b->freed = 1;
    if (b->shared) close(b->fd);
    if (b->mapped) munmap(b->base, b->mapped);
    else free(b->base);
}

static void complete(Op *op) {
    Stream *s = op->s;
    Ctx *c = s->h.ctx;
    int dropped = op->gen != c->gen || c->sticky != OK;
    switch (op->kind) {
    case OP_KERNEL:
        if (!dropped && op->fail) c->sticky = op->fail, c->failed_once = 1;
        break;
    case OP_RECORD:
        if (!dropped) op->e->time = op->due;
        if (op->e->done < op->rec) op->e->done = op->rec;
        ipc_publish(op->e);
        break;
    case OP_COPY:
        if (!dropped && usable(op->bdst, s, "a copy") && usable(op->bsrc, s, "a copy")) {
            memcpy(op->dst, op->staging ? op->staging : op->src, op->n);
        }
        break;
    case OP_TOUCH:
        if (!dropped) usable(op->bsrc, s, "a kernel");
        break;
    case OP_WAIT:  /* nothing but its place in the stream */
        break;
    case OP_WRITE32:
        if (!dropped && usable(op->bdst, s, "cuStreamWriteValue32")) {
            __atomic_store_n((uint32_t *)op->dst, op->value, __ATOMIC_RELEASE);
        }
        break;
    case OP_HOSTFN:
        if (!dropped) {
            pthread_mutex_unlock(&lock);
            op->fn(op->data);
            if (host_fn_return_ns) {
                struct timespec ts = {(time_t)(host_fn_return_ns / 1000000000u),
                                      (long)(host_fn_return_ns % 1000000000u)};
                nanosleep(&ts, NULL);
            }
            pthread_mutex_lock(&lock);
        }
        break;
    case OP_ALLOC:
        op->block->ready = 1;
        break;
    case OP_FREE:
        if (op->block->pending > 0) {
            violation("cuMemFreeAsync freed device memory that %ld pending operation(s) still "
                      "use: they run after the free", op->block->pending);
        }
        release_block(op->block);
        break;
    }
    if (op->bdst) op->bdst->pending--;
    if (op->bsrc) op->bsrc->pending--;
    free(op->staging);
    s->done++;
    if (op->gen == c->gen) c->done++;
}

static void *engine(void *arg) {
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        if (nheap == 0) {
            pthread_cond_wait(&work, &lock);
            continue;
        }
        uint64_t due = heap[0]->due, n = now_ns();
        if (due > n) {
            struct timespec ts = {(time_t)(due / 1000000000u), (long)(due % 1000000000u)};
            pthread_cond_timedwait(&work, &lock, &ts);
            continue;
        }
        Op *op = heap_pop();
        int early = op->early;
        complete(op);
        free(op);
        pthread_cond_broadcast(&progress);
        if (early) {  /* the value is seen before the effects of the work it follows */
            struct timespec ts = {0, 20000000};
            pthread_mutex_unlock(&lock);
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&lock);
        }
    }
    return NULL;
}

static void start_engine(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&work, &attr);
    pthread_condattr_destroy(&attr);
    pthread_t t;
    pthread_create(&t, NULL, engine, NULL);
    pthread_detach(t);
}

/* A new operation on ``s``, due after its stream's earlier work and ``ns``, not yet queued
 * (lock held). */
static Op *prepare(Stream *s, int kind, uint64_t ns) {
    pthread_once(&engine_once, start_engine);
    Op *op = calloc(1, sizeof *op);
    op->kind = kind;
    op->s = s;
    op->gen = s->h.ctx->gen;
    op->seq = ++seq_counter;
    op->due = max_u64(now_ns(), s->tail) + ns;
    s->tail = op->due;
    s->submitted++;
    s->h.ctx->submitted++;
    return op;
}

static void enqueue(Op *op) {
    heap_push(op);
    pthread_cond_signal(&work);
}

/* A new operation on ``s``, queued (lock held). */
static Op *submit(Stream *s, int kind, uint64_t ns) {
    Op *op = prepare(s, kind, ns);
    enqueue(op);
    return op;
}

/* Wait (lock held) until ``*done`` reaches ``target``, or the context fails or is reset. */
static CUresult wait_for(const uint64_t *done, uint64_t target, Ctx *c, unsigned gen) {
    while (*done < target && c->sticky == OK && c->gen == gen) {
        pthread_cond_wait(&progress, &lock);
    }
    if (c->gen != gen) return CONTEXT_IS_DESTROYED;
    return c->sticky;
}

/* Releasing the last reference: every object of the context is destroyed. A handle still
 * alive then was leaked, except memory while the context still had work pending (memory
 * that work may use cannot be freed before it completes; the reset reclaims it). */
static void reset_context(Ctx *c) {
    long live_handles = 0;
    int busy = c->done < c->submitted;
    for (size_t i = 0; i < nobjects; i++) {
        Obj *o = objects[i];
        if (o->ctx != c || o->gen != c->gen || o->dead) continue;
        o->dead = 1;
        if (o->kind == KIND_EVENT && ((Event *)o)->blockers) {
            violation("cuda:%d's context was reset while %d thread(s) were blocked in "
                      "cuEventSynchronize on one of its events", c->dev,
                      ((Event *)o)->blockers);
        }
        if (o->kind == KIND_HOST || o->kind == KIND_DEVICE) {
            if (!busy && ((Block *)o)->pending) {  /* the pending work is another device's */
                violation("cuda:%d's context was reset while work pending on another device "
                          "uses a %s of it", c->dev, kind_names[o->kind]);
            }
            release_block((Block *)o);
            if (busy) continue;
        }
        if (o->kind == KIND_STREAM && ((Stream *)o)->is_null) continue;
        if (o->kind == KIND_FUNCTION) continue;
        live_handles++;
        if (getenv("FAKE_CUDA_TRACE")) {
            fprintf(stderr, "fake_cuda: cuda:%d reset: a live %s\n", c->dev, kind_names[o->kind]);
        }
    }
    if (busy && getenv("FAKE_CUDA_TRACE")) {
        fprintf(stderr, "fake_cuda: cuda:%d reset with work pending\n", c->dev);
    }
    if (!c->failed_once) leaks += live_handles;  /* a failed context can release nothing */
    if (live_handles && getenv("FAKE_CUDA_TRACE")) {
        fprintf(stderr, "fake_cuda: cuda:%d reset with %ld live handle(s)\n", c->dev,
                live_handles);
    }
    c->gen++;  /* pending operations of the old generation are dropped */
    c->last_busy = 0;
    c->null_stream = NULL;
    pthread_cond_broadcast(&progress);
}

/* ------------------------------------------------------------------ init and devices */

static unsigned parse_relax(const char *s) {
    unsigned r = 0;
    if (s == NULL) return 0;
    if (strstr(s, "context")) r |= RELAX_CONTEXT;
    if (strstr(s, "portable")) r |= RELAX_PORTABLE;
    if (strstr(s, "python-host-fn")) r |= RELAX_PYTHON_HOST_FN;
    if (strstr(s, "exit")) r |= RELAX_EXIT;
    return r;
}

static CUresult cuInit(unsigned flags) {
    (void)flags;
    if (getenv("FAKE_CUDA_STUB") && atoi(getenv("FAKE_CUDA_STUB"))) return STUB_LIBRARY;
    pthread_mutex_lock(&lock);
    const char *n = getenv("FAKE_CUDA_DEVICES");
    ndevices = n ? atoi(n) : 1;
    if (ndevices > MAXDEV) ndevices = MAXDEV;
    no_pools = getenv("FAKE_CUDA_NO_POOLS") && atoi(getenv("FAKE_CUDA_NO_POOLS"));
    if (getenv("FAKE_CUDA_ALLOC_NS")) alloc_ns = strtoull(getenv("FAKE_CUDA_ALLOC_NS"), 0, 10);
    relaxed |= parse_relax(getenv("FAKE_CUDA_RELAX"));
    for (int i = 0; i < MAXDEV; i++) ctxs[i].dev = i;
    if (ndevices > 0) initialized = 1;
    pthread_mutex_unlock(&lock);
    return ndevices <= 0 ? NO_DEVICE : OK;
}

static CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }

static CUresult cuDeviceGetCount(int *count) {
    FAIL_IF_ASKED();
    if (!initialized) return NOT_INITIALIZED;
    *count = ndevices;
    return OK;
}

static CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    FAIL_IF_ASKED();
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= ndevices) return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

static CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    FAIL_IF_ASKED();
    if (dev < 0 || dev >= ndevices) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "aiostream fake GPU %d", dev);
    return OK;
}

static CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    FAIL_IF_ASKED();
    if (dev < 0 || dev >= ndevices) return INVALID_DEVICE;
    *value = attribute == ATTR_MEMORY_POOLS_SUPPORTED ? !no_pools : 0;
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
    case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
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
    case INVALID_CONTEXT: *out = "invalid device context"; return OK;
    case NOT_SUPPORTED: *out = "operation not supported"; return OK;
    default: *out = error_name(r); return *out ? OK : INVALID_VALUE;
    }
}

/* ------------------------------------------------------------------ streams */

static CUresult cuStreamCreateWithPriority(void **out, unsigned flags, int priority) {
    (void)flags;
    ENTER();
    CUresult r = need_context("cuStreamCreateWithPriority", NULL);
    if (r != OK) LEAVE(r);
    Stream *s = new_object(sizeof *s, KIND_STREAM, current());
    s->priority = priority < -5 ? -5 : (priority > 0 ? 0 : priority);
    *out = s;
    LEAVE(OK);
}

static CUresult cuStreamCreate(void **out, unsigned flags) {
    return cuStreamCreateWithPriority(out, flags, 0);
}

static CUresult cuStreamGetPriority(void *h, int *priority) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(h, "cuStreamGetPriority", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamGetPriority", &s->h)) != OK) LEAVE(r);
    *priority = s->priority;
    LEAVE(OK);
}

static CUresult cuStreamDestroy(void *h) {
    ENTER();
    CUresult r;
    Stream *s = (Stream *)lookup(h, KIND_STREAM, "cuStreamDestroy", &r);
    if (s == NULL) LEAVE(r);
    r = need_context("cuStreamDestroy", &s->h);
    if (r == INVALID_CONTEXT || r == CONTEXT_IS_DESTROYED) LEAVE(r);
    s->h.dead = 1;  /* work already submitted still completes */
    LEAVE(r);
}

static CUresult cuStreamQuery(void *h) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(h, "cuStreamQuery", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamQuery", &s->h)) != OK) LEAVE(r);
    s->h.ctx->last_busy = s->done < s->submitted;
    LEAVE(s->done < s->submitted ? NOT_READY : OK);
}

static CUresult cuStreamSynchronize(void *h) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(h, "cuStreamSynchronize", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamSynchronize", &s->h)) != OK) LEAVE(r);
    LEAVE(wait_for(&s->done, s->submitted, s->h.ctx, s->h.gen));
}

static CUresult cuCtxSynchronize(void) {
    ENTER();
    CUresult r = need_context("cuCtxSynchronize", NULL);
    if (r != OK) LEAVE(r);
    Ctx *c = current();
    LEAVE(wait_for(&c->done, c->submitted, c, c->gen));
}

static Event *source_of(Event *e) { return e->peer ? e->peer : e; }

static CUresult cuStreamWaitEvent(void *hs, void *he, unsigned flags) {
    ENTER();
    CUresult r;
    if (flags != 0) {
        /* CU_EVENT_WAIT_EXTERNAL (1) is valid only during stream capture, which the stand-in
         * has none of; no other flag exists */
        violation("cuStreamWaitEvent with flags %#x: outside stream capture it takes "
                  "CU_EVENT_WAIT_DEFAULT (0)", flags);
        LEAVE(INVALID_VALUE);
    }
    Stream *s = stream_of(hs, "cuStreamWaitEvent", &r);
    if (s == NULL) LEAVE(r);
    Event *e = (Event *)lookup(he, KIND_EVENT, "cuStreamWaitEvent", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuStreamWaitEvent", &s->h)) != OK) LEAVE(r);
    if (e->remote) {
        remote_wait(e);
        LEAVE(OK);
    }
    Event *src = source_of(e);
    if (src->done < src->recs) {  /* the wait is work of the stream until the record ends */
        s->tail = max_u64(s->tail, src->due);
        submit(s, OP_WAIT, 0);
    }
    LEAVE(OK);
}

/* ------------------------------------------------------------------ events */

static CUresult cuEventCreate(void **out, unsigned flags) {
    ENTER();
    CUresult r = need_context("cuEventCreate", NULL);
    if (r != OK) LEAVE(r);
    if ((flags & EV_INTERPROCESS) && !(flags & EV_DISABLE_TIMING)) LEAVE(INVALID_VALUE);
    Event *e = new_object(sizeof *e, KIND_EVENT, current());
    e->flags = flags;
    if (flags & EV_INTERPROCESS) {
        e->ipc = shared_map(sizeof *e->ipc, &e->ipc_fd);
        if (e->ipc == NULL) {
            e->h.dead = 1;
            LEAVE(OUT_OF_MEMORY);
        }
    }
    *out = e;
    LEAVE(OK);
}

static CUresult cuEventDestroy(void *h) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(h, KIND_EVENT, "cuEventDestroy", &r);
    if (e == NULL) LEAVE(r);
    r = need_context("cuEventDestroy", &e->h);
    if (r == INVALID_CONTEXT || r == CONTEXT_IS_DESTROYED) LEAVE(r);
    if (e->blockers) {
        violation("cuEventDestroy of an event %d thread(s) are blocked on in "
                  "cuEventSynchronize", e->blockers);
    }
    e->h.dead = 1;
    if (e->ipc) close(e->ipc_fd);  /* no process opens it from now on; openers keep theirs */
    LEAVE(r);
}

static CUresult cuEventRecord(void *he, void *hs) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(he, KIND_EVENT, "cuEventRecord", &r);
    if (e == NULL) LEAVE(r);
    Stream *s = stream_of(hs, "cuEventRecord", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuEventRecord", &s->h)) != OK) LEAVE(r);
    if (e->remote) {
        violation("cuEventRecord of an event opened from another process: this stand-in "
                  "does not record them (the exporter records, the opener waits)");
        LEAVE(NOT_SUPPORTED);
    }
    if (e->h.ctx != s->h.ctx) {
        violation("cuEventRecord of an event of cuda:%d on a stream of cuda:%d",
                  e->h.ctx->dev, s->h.ctx->dev);
        LEAVE(INVALID_HANDLE);
    }
    e = source_of(e);  /* an event opened from this process's handle is that same event */
    Op *op = submit(s, OP_RECORD, 0);
    op->e = e;
    op->rec = ++e->recs;
    e->due = op->due;
    ipc_publish(e);
    LEAVE(OK);
}

static CUresult cuEventQuery(void *h) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(h, KIND_EVENT, "cuEventQuery", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuEventQuery", &e->h)) != OK) LEAVE(r);
    if (e->remote) LEAVE(remote_done(e, __atomic_load_n(&e->remote->recs, __ATOMIC_ACQUIRE))
                         ? OK : NOT_READY);
    Event *src = source_of(e);
    if (src->done < src->recs) src->h.ctx->last_busy = 1;  /* seen pending (a stream gone?) */
    LEAVE(src->done < src->recs ? NOT_READY : OK);
}

static CUresult cuEventSynchronize(void *h) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(h, KIND_EVENT, "cuEventSynchronize", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuEventSynchronize", &e->h)) != OK) LEAVE(r);
    if (e->remote) {
        remote_wait(e);
        LEAVE(OK);
    }
    Event *src = source_of(e);
    e->blockers++;
    r = wait_for(&src->done, src->recs, e->h.ctx, e->h.gen);
    e->blockers--;
    LEAVE(r);
}

static CUresult cuEventElapsedTime(float *ms, void *hstart, void *hend) {
    ENTER();
    CUresult r;
    Event *a = (Event *)lookup(hstart, KIND_EVENT, "cuEventElapsedTime", &r);
    if (a == NULL) LEAVE(r);
    Event *b = (Event *)lookup(hend, KIND_EVENT, "cuEventElapsedTime", &r);
    if (b == NULL) LEAVE(r);
    if ((r = need_context("cuEventElapsedTime", &a->h)) != OK) LEAVE(r);
    if ((a->flags | b->flags) & EV_DISABLE_TIMING) LEAVE(INVALID_HANDLE);
    if (!a->recs || !b->recs) LEAVE(INVALID_HANDLE);
    if (a->done < a->recs || b->done < b->recs) LEAVE(NOT_READY);
    *ms = (float)((double)((int64_t)(b->time - a->time)) / 1e6);
    LEAVE(OK);
}

static CUresult cuIpcGetEventHandle(CUipcEventHandle *out, void *h) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(h, KIND_EVENT, "cuIpcGetEventHandle", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuIpcGetEventHandle", &e->h)) != OK) LEAVE(r);
    if (!(e->flags & EV_INTERPROCESS)) LEAVE(INVALID_VALUE);
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, ipc_magic, 8);
    pid_t pid = getpid();
    memcpy(out->reserved + 8, &pid, sizeof pid);
    memcpy(out->reserved + 16, &e, sizeof e);
    memcpy(out->reserved + 24, &e->ipc_fd, sizeof e->ipc_fd);
    LEAVE(OK);
}

static CUresult cuIpcOpenEventHandle(void **out, CUipcEventHandle handle) {
    ENTER();
    CUresult r = need_context("cuIpcOpenEventHandle", NULL);
    if (r != OK) LEAVE(r);
    Event *src = NULL;
    pid_t pid;
    memcpy(&pid, handle.reserved + 8, sizeof pid);
    memcpy(&src, handle.reserved + 16, sizeof src);
    if (memcmp(handle.reserved, ipc_magic, 8) == 0 && pid != getpid()) {
        /* another process's event: follow its published progress */
        int fd;
        memcpy(&fd, handle.reserved + 24, sizeof fd);
        const IpcEventState *state = map_remote(pid, fd, sizeof *state, PROT_READ);
        if (state == NULL) LEAVE(INVALID_VALUE);  /* its process or the event is gone */
        Event *e = new_object(sizeof *e, KIND_EVENT, current());
        e->flags = EV_INTERPROCESS | EV_DISABLE_TIMING;
        e->remote = state;
        e->remote_pid = pid;
        *out = e;
        LEAVE(OK);
    }
    /* an event of this process: the opened one follows it */
    if (memcmp(handle.reserved, ipc_magic, 8) != 0 || pid != getpid() || !known(src) ||
        ((Obj *)src)->kind != KIND_EVENT || !is_live(&src->h)) {
        LEAVE(INVALID_VALUE);
    }
    Event *e = new_object(sizeof *e, KIND_EVENT, current());
    e->flags = EV_INTERPROCESS | EV_DISABLE_TIMING;
    e->peer = src;
    *out = e;
    LEAVE(OK);
}

/* ------------------------------------------------------------------ modules and kernels */

static CUresult cuModuleLoadData(void **out, const void *image) {
    ENTER();
    CUresult r = need_context("cuModuleLoadData", NULL);
    if (r != OK) LEAVE(r);
    if (strstr((const char *)image, ".entry aiostream_sleep") == NULL) LEAVE(INVALID_IMAGE);
    *out = new_object(sizeof(Module), KIND_MODULE, current());
    LEAVE(OK);
}

static CUresult cuModuleUnload(void *h) {
    ENTER();
    CUresult r;
    Module *m = (Module *)lookup(h, KIND_MODULE, "cuModuleUnload", &r);
    if (m == NULL) LEAVE(r);
    r = need_context("cuModuleUnload", &m->h);
    if (r == INVALID_CONTEXT || r == CONTEXT_IS_DESTROYED) LEAVE(r);
    m->h.dead = 1;
    LEAVE(r);
}

static CUresult cuModuleGetFunction(void **out, void *h, const char *name) {
    ENTER();
    CUresult r;
    Module *m = (Module *)lookup(h, KIND_MODULE, "cuModuleGetFunction", &r);
    if (m == NULL) LEAVE(r);
    if ((r = need_context("cuModuleGetFunction", &m->h)) != OK) LEAVE(r);
    if (strcmp(name, "aiostream_sleep") != 0) LEAVE(NOT_FOUND);
    Function *f = new_object(sizeof *f, KIND_FUNCTION, m->h.ctx);
    f->module = m;
    *out = f;
    LEAVE(OK);
}

static unsigned last_launch[7];  /* grid x, y, z, block x, y, z, shared bytes */

/* Runs the sleep kernel: its one parameter is the duration in nanoseconds. */
static CUresult cuLaunchKernel(void *hf, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, void *hs, void **params,
                               void **extra) {
    (void)extra;
    ENTER();
    CUresult r;
    /* the documented limits of every device: no dimension 0, at most 1024 threads a block,
     * at most 48 KiB of dynamic shared memory without opting in */
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024 ||
        shmem > 48 * 1024) {
        LEAVE(INVALID_VALUE);
    }
    unsigned launch[7] = {gx, gy, gz, bx, by, bz, shmem};
    memcpy(last_launch, launch, sizeof launch);
    Function *f = (Function *)lookup(hf, KIND_FUNCTION, "cuLaunchKernel", &r);
    if (f == NULL) LEAVE(r);
    Stream *s = stream_of(hs, "cuLaunchKernel", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuLaunchKernel", &s->h)) != OK) LEAVE(r);
    if (f->h.ctx != s->h.ctx) {
        violation("cuLaunchKernel of a function of cuda:%d on a stream of cuda:%d",
                  f->h.ctx->dev, s->h.ctx->dev);
        LEAVE(INVALID_HANDLE);
    }
    if (params == NULL) LEAVE(INVALID_VALUE);
    Op *op = submit(s, OP_KERNEL, *(uint64_t *)params[0]);
    op->fail = fail_next_code;
    fail_next_code = 0;
    LEAVE(OK);
}

static CUresult cuLaunchHostFunc(void *hs, CUhostFn fn, void *data) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(hs, "cuLaunchHostFunc", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuLaunchHostFunc", &s->h)) != OK) LEAVE(r);
    Dl_info info;
    host_calls++;
    if (!dladdr((void *)fn, &info) || info.dli_sname == NULL || info.dli_saddr != (void *)fn) {
        host_calls_python++;
        if (!(relaxed & RELAX_PYTHON_HOST_FN)) {
            violation("cuLaunchHostFunc of %p, which is no C function of a loaded library "
                      "(a ctypes closure runs Python on the driver's thread)", (void *)fn);
        }
    }
    Op *op = submit(s, OP_HOSTFN, host_fn_ns);
    op->fn = fn;
    op->data = data;
    LEAVE(OK);
}

/* ------------------------------------------------------------------ memory */

static Block *new_block(size_t n, int host, Ctx *c) {
    Block *b = new_object(sizeof *b, host ? KIND_HOST : KIND_DEVICE, c);
    if (nblocks == capblocks) {
        capblocks = capblocks ? 2 * capblocks : 256;
        blocks = realloc(blocks, capblocks * sizeof *blocks);
    }
    blocks[nblocks++] = b;
    b->size = n ? n : 1;
    b->host = host;
    if (host) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        b->mapped = (b->size + page - 1) / page * page;
        b->base = mmap(NULL, b->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
        if (b->base == MAP_FAILED) {
            b->h.dead = 1;
            b->freed = 1;
            return NULL;
        }
    } else {
        b->base = calloc(1, b->size);
        if (b->base == NULL) {
            b->h.dead = 1;
            b->freed = 1;
            return NULL;
        }
    }
    return b;
}

/* The block holding [p, p + n), the newest first; NULL if none. Host memory is looked up
 * among live blocks only: the range of a freed one may since hold pageable memory. */
static Block *block_at(const void *p, size_t n, int host) {
    for (size_t i = nblocks; i-- > 0;) {
        Block *b = blocks[i];
        if (b->host != host || (host && b->freed)) continue;
        size_t span = n ? n : 1;  /* the byte at p itself, for a bare pointer */
        if ((const char *)p >= b->base && (const char *)p + span <= b->base + b->size) return b;
    }
    return NULL;
}

static Block *block_of_ptr(CUdeviceptr p, const char *call, CUresult *err) {
    Block *b = block_at((void *)(uintptr_t)p, 0, 0);
    if (b == NULL || !known(b)) {
        violation("%s: %#llx is no device memory this driver gave out", call, p);
        *err = INVALID_VALUE;
        return NULL;
    }
    if (b->freed || b->free_submitted || !is_live(&b->h)) {
        violation("%s: device memory %#llx used after it was freed", call, p);
        *err = INVALID_VALUE;
        return NULL;
    }
    *err = OK;
    return b;
}

static CUresult cuMemHostAlloc(void **out, size_t n, unsigned flags) {
    ENTER();
    CUresult r = need_context("cuMemHostAlloc", NULL);
    if (r != OK) LEAVE(r);
    Block *b = new_block(n, 1, current());
    if (b == NULL) LEAVE(OUT_OF_MEMORY);
    b->portable = (flags & HOST_PORTABLE) != 0;
    b->mapped_for_device = (flags & HOST_DEVICEMAP) != 0;
    b->ready = 1;
    *out = b->base;
    LEAVE(OK);
}

static CUresult cuMemFreeHost(void *p) {
    ENTER();
    Block *b = block_at(p, 0, 1);
    if (b == NULL || b->base != p || b->freed || !is_live(&b->h)) {
        violation("cuMemFreeHost of %p, which is no live pinned allocation", p);
        LEAVE(INVALID_VALUE);
    }
    CUresult r = need_context("cuMemFreeHost", b->portable ? NULL : &b->h);
    if (r == INVALID_CONTEXT || r == CONTEXT_IS_DESTROYED) LEAVE(r);
    if (b->pending > 0) {
        violation("cuMemFreeHost of pinned memory that %ld pending copies still use",
                  b->pending);
    }
    b->h.dead = 1;
    release_block(b);
    LEAVE(r);
}

static CUresult cuMemAllocAsync(CUdeviceptr *out, size_t n, void *hs) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(hs, "cuMemAllocAsync", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuMemAllocAsync", &s->h)) != OK) LEAVE(r);
    if (no_pools) LEAVE(NOT_SUPPORTED);
    Block *b = new_block(n, 0, current());
    if (b == NULL) LEAVE(OUT_OF_MEMORY);
    b->pooled = 1;
    b->alloc_stream = s;
    Op *op = submit(s, OP_ALLOC, alloc_ns);
    op->block = b;
    *out = (CUdeviceptr)(uintptr_t)b->base;
    LEAVE(OK);
}

static CUresult cuMemFreeAsync(CUdeviceptr p, void *hs) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(hs, "cuMemFreeAsync", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuMemFreeAsync", &s->h)) != OK) LEAVE(r);
    Block *b = block_of_ptr(p, "cuMemFreeAsync", &r);
    if (b == NULL) LEAVE(r);
    if (b->h.ctx != s->h.ctx) {
        violation("cuMemFreeAsync of memory of cuda:%d on a stream of cuda:%d",
                  b->h.ctx->dev, s->h.ctx->dev);
    }
    b->free_submitted = 1;
    b->h.dead = 1;
    Op *op = submit(s, OP_FREE, 0);
    op->block = b;
    LEAVE(OK);
}

static CUresult cuMemAlloc(CUdeviceptr *out, size_t n) {
    ENTER();
    CUresult r = need_context("cuMemAlloc", NULL);
    if (r != OK) LEAVE(r);
    Block *b = new_block(n, 0, current());
    if (b == NULL) LEAVE(OUT_OF_MEMORY);
    b->ready = 1;
    share_block(b);
    *out = (CUdeviceptr)(uintptr_t)b->base;
    LEAVE(OK);
}

static CUresult cuMemFree(CUdeviceptr p) {
    ENTER();
    CUresult r;
    Block *b = block_of_ptr(p, "cuMemFree", &r);
    if (b == NULL) LEAVE(r);
    r = need_context("cuMemFree", &b->h);
    if (r == INVALID_CONTEXT || r == CONTEXT_IS_DESTROYED) LEAVE(r);
    if (b->pooled) violation("cuMemFree of memory from cuMemAllocAsync (use cuMemFreeAsync)");
    if (b->imported) {
        violation("cuMemFree of memory from cuIpcOpenMemHandle (use cuIpcCloseMemHandle)");
    }
    if (b->pending > 0) {
        violation("cuMemFree of device memory that %ld pending operations still use",
                  b->pending);
    }
    b->h.dead = 1;
    release_block(b);
    LEAVE(OK);
}

/* IPC of device memory. Only cuMemAlloc's memory is exported (its documentation names no
 * other; a stream-ordered pool's is shared through the pool's own IPC), from the base of the
 * allocation; a handle opens in another process only ("one context per device per other
 * process"), with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, the flag its documentation asks for;
 * opened again in one context it is the same mapping, counted; cuIpcCloseMemHandle closes it. */
enum { IPC_LAZY_ENABLE_PEER_ACCESS = 1, MAP_FAILED_ERR = 205 };

static CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr p) {
    ENTER();
    CUresult r;
    Block *b = block_of_ptr(p, "cuIpcGetMemHandle", &r);
    if (b == NULL) LEAVE(r);
    if ((r = need_context("cuIpcGetMemHandle", &b->h)) != OK) LEAVE(r);
    if (b->pooled || b->imported) {
        violation("cuIpcGetMemHandle of memory from %s: only cuMemAlloc's is exported",
                  b->pooled ? "cuMemAllocAsync" : "cuIpcOpenMemHandle");
        LEAVE(INVALID_VALUE);
    }
    if ((char *)(uintptr_t)p != b->base) {
        violation("cuIpcGetMemHandle of %#llx, inside an allocation: it takes the base", p);
        LEAVE(INVALID_VALUE);
    }
    if (!b->shared) LEAVE(MAP_FAILED_ERR);
    if (!b->serial) b->serial = ++ipc_serial;
    pid_t pid = getpid();
    uint64_t size = b->size;
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, ipc_mem_magic, 8);
    memcpy(out->reserved + 8, &pid, sizeof pid);
    memcpy(out->reserved + 12, &b->fd, sizeof b->fd);
    memcpy(out->reserved + 16, &size, sizeof size);
    memcpy(out->reserved + 24, &b->serial, sizeof b->serial);
    LEAVE(OK);
}

static CUresult cuIpcOpenMemHandle(CUdeviceptr *out, CUipcMemHandle handle, unsigned flags) {
    ENTER();
    CUresult r = need_context("cuIpcOpenMemHandle", NULL);
    if (r != OK) LEAVE(r);
    if (flags != IPC_LAZY_ENABLE_PEER_ACCESS) {
        violation("cuIpcOpenMemHandle with flags %#x: it takes "
                  "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS", flags);
        LEAVE(INVALID_VALUE);
    }
    if (memcmp(handle.reserved, ipc_mem_magic, 8) != 0) LEAVE(INVALID_VALUE);
    pid_t pid;
    int fd;
    uint64_t size, serial;
    memcpy(&pid, handle.reserved + 8, sizeof pid);
    memcpy(&fd, handle.reserved + 12, sizeof fd);
    memcpy(&size, handle.reserved + 16, sizeof size);
    memcpy(&serial, handle.reserved + 24, sizeof serial);
    if (pid == getpid()) {
        violation("cuIpcOpenMemHandle in the process that exported the memory: a handle "
                  "opens in other processes only");
        LEAVE(INVALID_CONTEXT);
    }
    Ctx *c = current();
    for (size_t i = nblocks; i-- > 0;) {  /* opened before in this context: one mapping */
        Block *b = blocks[i];
        if (b->imported && b->exporter == pid && b->serial == serial && b->h.ctx == c &&
            is_live(&b->h)) {
            b->opens++;
            *out = (CUdeviceptr)(uintptr_t)b->base;
            LEAVE(OK);
        }
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t mapped = ((size_t)size + page - 1) / page * page;
    void *p = map_remote(pid, fd, mapped, PROT_READ | PROT_WRITE);
    if (p == NULL) LEAVE(MAP_FAILED_ERR);  /* its process or the allocation is gone */
    Block *b = new_block((size_t)size, 0, c);
    if (b == NULL) {
        munmap(p, mapped);
        LEAVE(OUT_OF_MEMORY);
    }
    free(b->base);
    b->base = p;
    b->mapped = mapped;
    b->ready = 1;
    b->imported = 1;
    b->opens = 1;
    b->exporter = pid;
    b->serial = serial;
    *out = (CUdeviceptr)(uintptr_t)p;
    LEAVE(OK);
}

static CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    ENTER();
    CUresult r;
    Block *b = block_of_ptr(p, "cuIpcCloseMemHandle", &r);
    if (b == NULL) LEAVE(r);
    if ((r = need_context("cuIpcCloseMemHandle", &b->h)) != OK) LEAVE(r);
    if (!b->imported || (char *)(uintptr_t)p != b->base) {
        violation("cuIpcCloseMemHandle of %#llx, which cuIpcOpenMemHandle did not return", p);
        LEAVE(INVALID_VALUE);
    }
    if (--b->opens > 0) LEAVE(OK);
    if (b->pending > 0) {
        violation("cuIpcCloseMemHandle of memory that %ld pending operations still use",
                  b->pending);
    }
    b->h.dead = 1;
    release_block(b);
    LEAVE(OK);
}

/* A copy: ``hdst``/``hsrc`` say which ends are host memory (pinned or pageable). */
static CUresult copy(const char *call, void *dst, const void *src, size_t n, void *hs,
                     int hdst, int hsrc) {
    pthread_mutex_lock(&lock);
    CUresult r = failpoint(call);
    if (r != OK) LEAVE(r);
    Stream *s = stream_of(hs, call, &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context(call, &s->h)) != OK) LEAVE(r);
    Block *ends[2] = {NULL, NULL};
    const void *ptrs[2] = {dst, src};
    int host[2] = {hdst, hsrc}, pageable_src = 0, pageable_dst = 0;
    for (int i = 0; i < 2; i++) {
        if (!host[i]) {
            ends[i] = block_of_ptr((CUdeviceptr)(uintptr_t)ptrs[i], call, &r);
            if (ends[i] == NULL) LEAVE(r);
            if (ends[i]->h.ctx != s->h.ctx) {
                violation("%s of device memory of cuda:%d on a stream of cuda:%d", call,
                          ends[i]->h.ctx->dev, s->h.ctx->dev);
                LEAVE(INVALID_VALUE);
            }
            if (n > ends[i]->size - (size_t)((const char *)ptrs[i] - ends[i]->base)) {
                LEAVE(INVALID_VALUE);
            }
            continue;
        }
        Block *b = block_at(ptrs[i], n, 1);
        if (b == NULL) {
            if (i == 0) pageable_dst = 1; else pageable_src = 1;
            continue;
        }
        if (b->h.ctx != s->h.ctx && !b->portable && !(relaxed & RELAX_PORTABLE)) {
            violation("%s with pinned memory of cuda:%d on a stream of cuda:%d: it was "
                      "allocated without CU_MEMHOSTALLOC_PORTABLE, so this context treats it "
                      "as pageable", call, b->h.ctx->dev, s->h.ctx->dev);
        }
        ends[i] = b;
    }
    uint64_t ns = COPY_LATENCY_NS + n / COPY_BYTES_PER_NS;
    Op *op = submit(s, OP_COPY, ns);
    op->dst = (char *)dst;
    op->src = (char *)src;
    op->n = n;
    op->bdst = ends[0];
    op->bsrc = ends[1];
    for (int i = 0; i < 2; i++) {
        if (ends[i] == NULL) continue;
        ends[i]->pending++;
    }
    if (pageable_src) {  /* staged before the call returns */
        op->staging = malloc(n ? n : 1);
        memcpy(op->staging, src, n);
    }
    if (pageable_dst) {  /* the call returns once the copy has completed */
        uint64_t target = s->submitted;
        r = wait_for(&s->done, target, s->h.ctx, s->h.gen);
        LEAVE(r);
    }
    LEAVE(OK);
}

static CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, void *hs) {
    return copy("cuMemcpyHtoDAsync", (void *)(uintptr_t)dst, src, n, hs, 0, 1);
}

static CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, void *hs) {
    return copy("cuMemcpyDtoHAsync", dst, (const void *)(uintptr_t)src, n, hs, 1, 0);
}

static CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *hs) {
    return copy("cuMemcpyDtoDAsync", (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n,
                hs, 0, 0);
}

/* Pinned memory mapped for the device: under unified addressing its device pointer is the
 * host pointer, as the driver gives it. */
static CUresult cuMemHostGetDevicePointer(CUdeviceptr *out, void *p, unsigned flags) {
    ENTER();
    if (flags != 0) LEAVE(INVALID_VALUE);
    Block *b = block_at(p, 1, 1);
    if (b == NULL) {
        violation("cuMemHostGetDevicePointer of %p, which is no live pinned allocation", p);
        LEAVE(INVALID_VALUE);
    }
    CUresult r = need_context("cuMemHostGetDevicePointer", b->portable ? NULL : &b->h);
    if (r != OK) LEAVE(r);
    if (!b->mapped_for_device) {
        violation("cuMemHostGetDevicePointer of pinned memory allocated without "
                  "CU_MEMHOSTALLOC_DEVICEMAP");
        LEAVE(INVALID_VALUE);
    }
    *out = (CUdeviceptr)(uintptr_t)p;
    LEAVE(OK);
}

/* A stream memory operation: ``value`` written at ``addr`` (device memory, or pinned memory
 * mapped for the device) when the stream's earlier work has completed. */
enum { WRITE_VALUE_NO_MEMORY_BARRIER = 1 };

static CUresult cuStreamWriteValue32(void *hs, CUdeviceptr addr, uint32_t value,
                                     unsigned flags) {
    ENTER();
    CUresult r;
    if (flags & ~(unsigned)WRITE_VALUE_NO_MEMORY_BARRIER) {
        violation("cuStreamWriteValue32 with flags %#x: it takes CU_STREAM_WRITE_VALUE_DEFAULT "
                  "(0) or CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (1)", flags);
        LEAVE(INVALID_VALUE);
    }
    Stream *s = stream_of(hs, "cuStreamWriteValue32", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamWriteValue32", &s->h)) != OK) LEAVE(r);
    if (addr % 4) LEAVE(INVALID_VALUE);
    Block *b = block_at((void *)(uintptr_t)addr, 4, 1);
    if (b != NULL && !b->mapped_for_device) b = NULL;
    if (b == NULL) b = block_at((void *)(uintptr_t)addr, 4, 0);
    if (b == NULL || b->freed || b->free_submitted) {
        violation("cuStreamWriteValue32 to %#llx, which is no live device-accessible memory",
                  addr);
        LEAVE(INVALID_VALUE);
    }
    uint64_t behind = s->tail;  /* the due time of the stream's last operation */
    Op *op = prepare(s, OP_WRITE32, 0);
    op->dst = (char *)(uintptr_t)addr;
    op->value = value;
    op->bdst = b;
    op->early = (flags & WRITE_VALUE_NO_MEMORY_BARRIER) && behind > now_ns();
    b->pending++;
    enqueue(op);
    LEAVE(OK);
}

/* ------------------------------------------------------------------ test hooks */

/* The next kernel launched fails with ``code`` when it completes (a sticky error). */
void fake_cuda_fail_next_launch(int code) {
    pthread_mutex_lock(&lock);
    fail_next_code = code;
    pthread_mutex_unlock(&lock);
}

/* The ``nth`` next call of the entry point ``name``, from any thread, returns ``code`` and
 * does nothing else (at most 8 at once). Every entry point but cuInit, cuDriverGetVersion,
 * cuGetErrorName, cuGetErrorString and cuGetProcAddress can be made to fail. */
int fake_cuda_fail_call(const char *name, long nth, int code) {
    pthread_mutex_lock(&lock);
    int slot = -1;
    for (int i = 0; i < 8 && slot < 0; i++) if (failpoints[i].countdown <= 0) slot = i;
    if (slot >= 0) {
        snprintf(failpoints[slot].name, sizeof failpoints[slot].name, "%s", name);
        failpoints[slot].countdown = nth;
        failpoints[slot].code = code;
    }
    pthread_mutex_unlock(&lock);
    return slot >= 0;
}

/* Forget every context's sticky error, and the failures asked for (a real context stays
 * failed: this only lets one test process run several fault tests). */
void fake_cuda_clear_error(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAXDEV; i++) ctxs[i].sticky = OK;
    fail_next_code = 0;
    memset(failpoints, 0, sizeof failpoints);
    pthread_cond_broadcast(&progress);
    pthread_mutex_unlock(&lock);
}

/* Live handles of a kind: 0 streams, 1 events, 2 contexts, 3 pinned host buffers, 4 device
 * buffers, 5 modules. */
long fake_cuda_live(int kind) {
    pthread_mutex_lock(&lock);
    long n = 0;
    if (kind == KIND_CONTEXT) {
        for (int i = 0; i < ndevices; i++) n += ctxs[i].refs > 0;
    } else if (kind >= 0 && kind < 6) {
        for (size_t i = 0; i < nobjects; i++) {
            Obj *o = objects[i];
            if (o->kind == kind && is_live(o) && !(kind == KIND_STREAM && ((Stream *)o)->is_null))
                n++;
        }
    } else {
        n = -1;
    }
    pthread_mutex_unlock(&lock);
    return n;
}

/* Host functions launched, and how many of them were no C function (Python). */
long fake_cuda_host_calls(void) {
    pthread_mutex_lock(&lock);
    long n = host_calls;
    pthread_mutex_unlock(&lock);
    return n;
}

long fake_cuda_host_calls_python(void) {
    pthread_mutex_lock(&lock);
    long n = host_calls_python;
    pthread_mutex_unlock(&lock);
    return n;
}

long fake_cuda_violations(void) {
    pthread_mutex_lock(&lock);
    long n = violations;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The violations so far (the last 16 described in ``buf``), forgotten: for tests that
 * provoke one on purpose. Returns how many there were. */
long fake_cuda_take_violations(char *buf, size_t size) {
    pthread_mutex_lock(&lock);
    long n = violations;
    size_t used = 0;
    if (size) buf[0] = 0;
    for (long i = n > 16 ? n - 16 : 0; i < n && used + 1 < size; i++) {
        int w = snprintf(buf + used, size - used, "%s\n", vlog[i % 16]);
        if (w < 0) break;
        used += (size_t)w;
    }
    violations = 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* References held to a device's primary context. */
int fake_cuda_context_refs(int dev) {
    pthread_mutex_lock(&lock);
    int n = (dev >= 0 && dev < MAXDEV) ? ctxs[dev].refs : -1;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Handles leaked at context resets so far; the count starts again from zero. */
long fake_cuda_take_leaks(void) {
    pthread_mutex_lock(&lock);
    long n = leaks;
    leaks = 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Relax one rule (context, portable, python-host-fn, exit) or restore it. */
void fake_cuda_relax(const char *rule, int on) {
    pthread_mutex_lock(&lock);
    unsigned bit = parse_relax(rule);
    relaxed = on ? (relaxed | bit) : (relaxed & ~bit);
    pthread_mutex_unlock(&lock);
}

/* Another library takes (1) or gives back (0) a reference to a device's primary context. */
int fake_cuda_hold_primary(int dev, int hold) {
    void *ctx;
    return hold ? cuDevicePrimaryCtxRetain(&ctx, dev) : cuDevicePrimaryCtxRelease(dev);
}

/* A kernel that reads [p, p + n) on a stream when it runs, ``ns`` long: a user's kernel
 * using memory, for tests of when memory may be freed or reused. ``hs`` NULL: the default
 * stream of device ``dev``. */
int fake_cuda_touch(int dev, void *hs, CUdeviceptr p, size_t n, uint64_t ns) {
    pthread_mutex_lock(&lock);
    CUresult r;
    Stream *s = NULL;
    if (hs != NULL) s = (Stream *)lookup(hs, KIND_STREAM, "fake_cuda_touch", &r);
    else if (dev >= 0 && dev < ndevices && ctxs[dev].refs) s = ctxs[dev].null_stream;
    Block *b = s ? block_at((void *)(uintptr_t)p, n, 0) : NULL;
    if (s == NULL || b == NULL) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    if (b->freed || b->free_submitted) violation("a kernel launched on freed device memory");
    Op *op = submit(s, OP_TOUCH, ns);
    op->bsrc = b;
    b->pending++;
    pthread_mutex_unlock(&lock);
    return OK;
}

/* The grid (x, y, z), block (x, y, z) and dynamic shared memory of the last kernel launch
 * that passed the launch checks, into out[7]. */
void fake_cuda_last_launch(unsigned *out) {
    pthread_mutex_lock(&lock);
    memcpy(out, last_launch, sizeof last_launch);
    pthread_mutex_unlock(&lock);
}

/* The priority the driver recorded for a stream (-100 for a bad handle). */
int fake_cuda_stream_priority(void *hs) {
    pthread_mutex_lock(&lock);
    int p = -100;
    if (known(hs) && ((Obj *)hs)->kind == KIND_STREAM) p = ((Stream *)hs)->priority;
    pthread_mutex_unlock(&lock);
    return p;
}

/* The flags an event was created with (CU_EVENT_*; -1 for a bad handle). */
int fake_cuda_event_flags(void *he) {
    pthread_mutex_lock(&lock);
    int f = -1;
    if (known(he) && ((Obj *)he)->kind == KIND_EVENT) f = (int)((Event *)he)->flags;
    pthread_mutex_unlock(&lock);
    return f;
}

/* Operations submitted and not completed yet. */
long fake_cuda_pending(void) {
    pthread_mutex_lock(&lock);
    long n = (long)nheap;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Make each host function launched from now on run ``ns`` after the work before it (a driver
 * thread that is slow to get to it). */
void fake_cuda_host_fn_delay(uint64_t ns) {
    pthread_mutex_lock(&lock);
    host_fn_ns = ns;
    pthread_mutex_unlock(&lock);
}

/* Make the driver's thread take ``ns`` to return from each host function before the stream
 * goes on (what comes after a host function lands that much after the function ran). */
void fake_cuda_host_fn_return_delay(uint64_t ns) {
    pthread_mutex_lock(&lock);
    host_fn_return_ns = ns;
    pthread_mutex_unlock(&lock);
}

/* Bring every pending operation due later forward to now, in submission order: a test ends
 * the "kernel that never ends" it launched, so that later tests of the process (which share
 * the primary contexts) do not wait behind it. */
static int by_due(const void *a, const void *b) {
    const Op *x = *(Op *const *)a, *y = *(Op *const *)b;
    return before(x, y) ? -1 : before(y, x) ? 1 : 0;
}

void fake_cuda_hurry(void) {
    pthread_mutex_lock(&lock);
    uint64_t n = now_ns();
    for (size_t i = 0; i < nheap; i++) if (heap[i]->due > n) heap[i]->due = n;
    qsort(heap, nheap, sizeof *heap, by_due);  /* a sorted array is a heap */
    for (size_t i = 0; i < nobjects; i++) {
        Obj *o = objects[i];
        if (o->kind == KIND_STREAM && ((Stream *)o)->tail > n) ((Stream *)o)->tail = n;
        if (o->kind == KIND_EVENT && ((Event *)o)->due > n) ((Event *)o)->due = n;
    }
    pthread_cond_signal(&work);
    pthread_mutex_unlock(&lock);
}

/* The device whose context is current on the calling thread (-1: none). */
int fake_cuda_current_device(void) {
    Ctx *c = current();
    return c ? c->dev : -1;
}

/* Whether ``c`` may be left to the exit: the program saw work pending in it. */
static int left_busy(const Ctx *c) {
    return c->done < c->submitted || c->last_busy;
}

/* At exit: report, and fail the process on a violation, a leak or (unless relaxed) a live
 * handle. */
__attribute__((destructor)) static void fake_cuda_at_exit(void) {
    int locked = 0;
    for (int i = 0; i < 200 && !locked; i++) {
        locked = pthread_mutex_trylock(&lock) == 0;
        if (!locked) usleep(1000);
    }
    long live[7] = {0}, total = 0;
    for (size_t i = 0; i < nobjects; i++) {
        Obj *o = objects[i];
        if (!is_live(o) || o->kind == KIND_FUNCTION || o->ctx->failed_once) continue;
        /* a context with work still pending may be left to the exit (releasing it could
         * wait for that work): its handles go with it. So may one the program last saw busy
         * (a cuEventQuery, or its last cuStreamQuery, said work was pending): that work may
         * have completed only since. */
        if (left_busy(o->ctx)) continue;
        /* memory still allocated (its context is retained: a reset frees it) may still be
         * read by the program, through a host view or a tensor it was handed to, or by
         * another device's pending work: the exit frees it with the context */
        if (o->kind == KIND_HOST || o->kind == KIND_DEVICE) continue;
        if (o->kind == KIND_STREAM && ((Stream *)o)->is_null) continue;
        live[o->kind]++;
        total++;
    }
    int fail = violations || leaks || (total && !(relaxed & RELAX_EXIT));
    if (fail || getenv("FAKE_CUDA_TRACE")) {
        fprintf(stderr, "fake_cuda: at exit: %ld violation(s), %ld handle(s) leaked at a "
                "context reset, %ld live handle(s)", violations, leaks, total);
        for (int k = 0; k < 7; k++) if (live[k]) fprintf(stderr, ", %ld %s", live[k], kind_names[k]);
        fprintf(stderr, "\n");
        for (long i = violations > 16 ? violations - 16 : 0; i < violations; i++) {
            fprintf(stderr, "fake_cuda: violation: %s\n", vlog[i % 16]);
        }
        fflush(stderr);
    }
    if (fail) _exit(70);
    if (locked) pthread_mutex_unlock(&lock);
}

/* ------------------------------------------------------------------ entry point lookup */

typedef struct { const char *name; int version; void *fn; } EntryPoint;

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status);

static const EntryPoint entries[] = {
    {"cuInit", 2000, (void *)cuInit},
    {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion},
    {"cuGetErrorName", 6000, (void *)cuGetErrorName},
    {"cuGetErrorString", 6000, (void *)cuGetErrorString},
    {"cuDeviceGet", 2000, (void *)cuDeviceGet},
    {"cuDeviceGetCount", 2000, (void *)cuDeviceGetCount},
    {"cuDeviceGetName", 2000, (void *)cuDeviceGetName},
    {"cuDeviceGetAttribute", 2000, (void *)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)cuDevicePrimaryCtxRelease},
    {"cuCtxSetCurrent", 4000, (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", 4000, (void *)cuCtxGetCurrent},
    {"cuCtxPushCurrent", 4000, (void *)cuCtxPushCurrent},
    {"cuCtxPopCurrent", 4000, (void *)cuCtxPopCurrent},
    {"cuCtxGetStreamPriorityRange", 5050, (void *)cuCtxGetStreamPriorityRange},
    {"cuCtxSynchronize", 2000, (void *)cuCtxSynchronize},
    {"cuStreamCreate", 2000, (void *)cuStreamCreate},
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
    {"cuIpcGetMemHandle", 4010, (void *)cuIpcGetMemHandle},
    {"cuIpcOpenMemHandle", 11000, (void *)cuIpcOpenMemHandle},
    {"cuIpcCloseMemHandle", 4010, (void *)cuIpcCloseMemHandle},
    {"cuModuleLoadData", 2000, (void *)cuModuleLoadData},
    {"cuModuleUnload", 2000, (void *)cuModuleUnload},
    {"cuModuleGetFunction", 2000, (void *)cuModuleGetFunction},
    {"cuLaunchKernel", 4000, (void *)cuLaunchKernel},
    {"cuLaunchHostFunc", 10000, (void *)cuLaunchHostFunc},
    {"cuMemHostAlloc", 2020, (void *)cuMemHostAlloc},
    {"cuMemFreeHost", 2000, (void *)cuMemFreeHost},
    {"cuMemAlloc", 3020, (void *)cuMemAlloc},
    {"cuMemFree", 3020, (void *)cuMemFree},
    {"cuMemAllocAsync", 11020, (void *)cuMemAllocAsync},
    {"cuMemFreeAsync", 11020, (void *)cuMemFreeAsync},
    {"cuMemcpyHtoDAsync", 3020, (void *)cuMemcpyHtoDAsync},
    {"cuMemcpyDtoHAsync", 3020, (void *)cuMemcpyDtoHAsync},
    {"cuMemcpyDtoDAsync", 3020, (void *)cuMemcpyDtoDAsync},
    {"cuMemHostGetDevicePointer", 3020, (void *)cuMemHostGetDevicePointer},
    {"cuStreamWriteValue32", 11070, (void *)cuStreamWriteValue32},
    {"cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2},
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
