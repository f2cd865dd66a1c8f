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
 *   Work behind a stream memory wait that is not over is *held* (no due time yet): everything
 *   submitted to that stream after the wait (kernels, copies, records, host functions, memory
 *   operations, allocations, frees, graph launches, further waits), a record among it, and the
 *   work of every stream that waits for such a record, transitively. Held work is pending
 *   work: cuStreamQuery and cuEventQuery answer CUDA_ERROR_NOT_READY, the synchronizations
 *   block, until the wait is over; it then gets its due times from that moment.
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
 * - Stream memory operations (cuStreamWriteValue32/64, cuStreamWaitValue32/64, the _v2 API of
 *   the reference's "Stream Memory Operations"), on a word of 4 or 8 bytes in device memory or
 *   in pinned memory allocated with CU_MEMHOSTALLOC_DEVICEMAP (its address from
 *   cuMemHostGetDevicePointer), live and aligned to its size; the device attributes say all
 *   of them are supported (CAN_USE_STREAM_MEM_OPS_V1, CAN_USE_64_BIT_STREAM_MEM_OPS and _V1,
 *   CAN_USE_STREAM_WAIT_VALUE_NOR and _V1, CAN_FLUSH_REMOTE_WRITES, and CAN_MAP_HOST_MEMORY
 *   and UNIFIED_ADDRESSING for the mapped words). An unaligned word, a word in no such live
 *   memory, or an unknown flag: a violation (CUDA_ERROR_INVALID_VALUE). A write stores its
 *   value when the stream reaches it; its flags are CU_STREAM_WRITE_VALUE_DEFAULT (0) and
 *   CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (1). Without the barrier the write "may be
 *   reordered with writes issued before it": behind pending work, its value lands as that
 *   work ends, 20 ms before the work's own effects (its bytes, its completion). A wait holds
 *   the stream's later work until the stream has reached it and its word satisfies its
 *   condition, which the driver's thread reads every 30 us while a wait is pending (a GPU
 *   polls too): CU_STREAM_WAIT_VALUE_GEQ (0, cyclic: (int32_t)(*addr - value) >= 0, int64_t
 *   for 64 bits), EQ (1), AND (2, (*addr & value) != 0), NOR (3, ~(*addr | value) != 0), with
 *   CU_STREAM_WAIT_VALUE_FLUSH (1 << 30) or not (this driver's writes are all visible at
 *   once). A wait of a failed or reset context is over (its work is dropped), and so is one
 *   on memory freed under it (the free is the violation). The memory stays in use until the
 *   operation completes: freeing it before is a violation, as for any pending work.
 * - cuStreamWaitEvent takes flags 0, and CU_EVENT_WAIT_EXTERNAL (1) from a capturing stream
 *   only (any other use is a violation, CUDA_ERROR_INVALID_VALUE). A wait for a record not yet
 *   completed is an operation of the stream ("all operations in the stream", cuStreamQuery):
 *   the stream is busy, and cuStreamQuery answers CUDA_ERROR_NOT_READY, until the record
 *   completes.
 * - Stream capture (cuStreamBeginCapture_v2, cuStreamEndCapture, cuStreamIsCapturing,
 *   cuStreamGetCaptureInfo _v2 and _v3, cuThreadExchangeStreamCaptureMode) and graphs
 *   (cuGraphInstantiateWithFlags, which cuda-python 13's cuGraphInstantiate is, cuGraphLaunch,
 *   cuGraphExecDestroy, cuGraphDestroy, cuGraphGetNodes), as the reference and the programming
 *   guide's "CUDA Graphs" describe them; the section "stream capture" below says how, and where
 *   the documentation leaves a case open this driver takes the least forgiving reading, said
 *   at that spot. Work submitted to a capturing stream (kernels, async copies between pinned
 *   or device memory, host functions, stream memory writes and waits, cuMemAllocAsync and
 *   cuMemFreeAsync, an external event wait) does not run: it is a node of the capture's graph,
 *   which runs at each cuGraphLaunch as operations of the launch stream, each due after its
 *   dependencies, the stream's earlier work and the previous launch of its executable graph; a
 *   memory wait node holds, at each launch, the nodes after it and the launch's end (what
 *   comes after the launch on its stream, and the next launch of its executable graph). Event
 *   records
 *   and waits inside a capture are edges only: a launch records no event, and an event
 *   recorded in a capture stays a captured event (also after the capture ended) until it is
 *   recorded again outside any capture. A stream joins a capture by waiting for an event
 *   recorded in it; each must be joined back into the origin (the origin waits, directly or
 *   through other streams, for an event recorded on it after its last change) before
 *   cuStreamEndCapture, else CUDA_ERROR_STREAM_CAPTURE_UNJOINED (904) and no graph. Refused,
 *   each with its code and a violation (rule "capture"), invalidating the captures it
 *   conflicts with:
 *   . the potentially unsafe calls, where the calling thread's capture interaction mode
 *     (per thread, GLOBAL to begin with) prohibits them: in GLOBAL mode while its own capture
 *     not begun RELAXED, or another thread's begun GLOBAL, has not ended (an invalidated one
 *     included); in THREAD_LOCAL mode its own only; never in RELAXED mode. They are:
 *     cuEventQuery, cuEventSynchronize, cuStreamQuery, cuStreamSynchronize, cuCtxSynchronize,
 *     cuMemAlloc, cuMemFree, cuMemHostAlloc, cuMemAllocHost, cuMemFreeHost,
 *     cuIpcOpenMemHandle, cuIpcCloseMemHandle (they map and unmap memory as an allocation
 *     does), an async copy to pageable host memory (it returns once it completed), and any
 *     use of the legacy default stream (it synchronizes implicitly). This driver has no
 *     synchronous cuMemcpy or cuMemset, no cuMemsetAsync, no cuMemHostRegister: they would
 *     be too. CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900);
 *   . in any mode, what necessarily conflicts with a capture: querying, synchronizing or
 *     destroying a capturing stream, synchronizing its context, launching a graph into it,
 *     copying pageable memory into it (900); querying, synchronizing or timing a captured
 *     event, or waiting for one from a stream outside any capture once its capture ended
 *     (CUDA_ERROR_CAPTURED_EVENT, 907); a capturing stream waiting for an event recorded
 *     outside the capture (CUDA_ERROR_STREAM_CAPTURE_ISOLATION, 905) or captured in another
 *     capture (CUDA_ERROR_STREAM_CAPTURE_MERGE, 902); work on the legacy stream while a
 *     blocking stream (not CU_STREAM_NON_BLOCKING) of its context captures
 *     (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, 906; cuStreamIsCapturing on it answers 906 without
 *     harm, as documented);
 *   . cuStreamBeginCapture on the default stream (900) or on a stream already capturing
 *     (CUDA_ERROR_ILLEGAL_STATE, 401); cuStreamEndCapture on a stream not capturing (401), on
 *     one that joined and is not the origin (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, 903), from
 *     another thread than the one that began a capture not begun RELAXED
 *     (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, 908).
 *   Once a capture is invalidated, its streams and events answer
 *   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901, no new violation) until cuStreamEndCapture,
 *   which answers 901 with a NULL graph and takes its streams out of capture. A call that
 *   invalidates another thread's capture is a violation too, whether or not the caller
 *   handled its error: every test catches a library breaking a capture. Graph memory: an
 *   allocation node allocates at each launch, a launch while the previous one's allocation
 *   is unfreed fails (CUDA_ERROR_INVALID_VALUE, unless AUTO_FREE_ON_LAUNCH), a graph with
 *   memory nodes has one executable graph at a time. cuGraphExecDestroy of a launch in
 *   flight lets it complete; a graph destroyed leaves its executable graphs whole. An
 *   executable graph launches on a stream of its own context only (a violation,
 *   CUDA_ERROR_INVALID_VALUE). A captured kernel takes no fake_cuda_fail_next_launch; the
 *   first kernel node of the next graph launch does.
 * - IPC. Events and cuMemAlloc's memory are shared across processes through memfd mappings
 *   (the other process maps /proc/<pid>/fd/<fd>). cuIpcGetMemHandle takes the base of a
 *   cuMemAlloc allocation only (not a pool's); cuIpcOpenMemHandle takes
 *   CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, opens in another process only (in the exporting one it
 *   is a violation, CUDA_ERROR_INVALID_CONTEXT), counts a second open in one context, and its
 *   memory is closed with cuIpcCloseMemHandle, not cuMemFree; cuMemGetAddressRange says the
 *   exporter's whole allocation (as for any device memory). A stream waiting for an event
 *   of another process has the calling thread wait until that process completed the record
 *   (this driver's processes share no device).
 * - Host functions must be C functions: one that is not a named symbol of a loaded library
 *   (dladdr), such as a ctypes closure that would run Python on this driver thread, is a
 *   violation (rule "python-host-fn").
 * - At exit it reports live handles, leaked handles and every violation on stderr, and the
 *   process exits with status 70 if there is any (live handles are allowed under rule "exit",
 *   and in a context with work pending at exit, or pending at its last cuStreamQuery; memory
 *   is allowed: the program may still read it, and the exit frees it with its context). Held
 *   work is pending work, at exit as at a context reset (its memory is not leaked then).
 *
 * Environment: FAKE_CUDA_DEVICES (default 1; 0 makes cuInit fail with CUDA_ERROR_NO_DEVICE),
 * FAKE_CUDA_STUB=1 (cuInit fails as the toolkit's stub library does), FAKE_CUDA_NO_POOLS=1 (no
 * memory pools: cuMemAllocAsync returns CUDA_ERROR_NOT_SUPPORTED), FAKE_CUDA_ALLOC_NS,
 * FAKE_CUDA_RELAX (comma-separated rules to relax: context, portable, python-host-fn, exit,
 * capture: the refusals and invalidations of stream capture stay, uncounted),
 * FAKE_CUDA_TRACE=1 (print symbol lookups that fail, and violations as they happen).
 *
 * Test hooks (called through ctypes) are at the end of this file, each with its comment.
 * Built with -DFAKE_CUDA_NO_HOOKS they are not exported, so that a process sees the driver API
 * only, as on a GPU (python -m tests.helpers.fake_cuda --no-hooks FOLDER); the exit report
 * stays. The hurry hooks bring non-held work forward; held work waits for its memory wait.
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
    ILLEGAL_STATE = 401, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901,
    CAPTURE_MERGE = 902, CAPTURE_UNMATCHED = 903, CAPTURE_UNJOINED = 904, CAPTURE_ISOLATION = 905,
    CAPTURE_IMPLICIT = 906, CAPTURED_EVENT = 907, CAPTURE_WRONG_THREAD = 908,
};
enum { EV_BLOCKING = 1, EV_DISABLE_TIMING = 2, EV_INTERPROCESS = 4 };
enum { HOST_PORTABLE = 1, HOST_DEVICEMAP = 2 };
enum { ATTR_MEMORY_POOLS_SUPPORTED = 115 };
/* CUdevice_attribute: what this driver supports of the device attributes it is asked for */
enum { ATTR_CAN_MAP_HOST_MEMORY = 19, ATTR_UNIFIED_ADDRESSING = 41,
       ATTR_CAN_USE_STREAM_MEM_OPS_V1 = 92, ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS_V1 = 93,
       ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V1 = 94, ATTR_CAN_FLUSH_REMOTE_WRITES = 98,
       ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS = 122, ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR = 123 };
enum { KIND_STREAM = 0, KIND_EVENT = 1, KIND_CONTEXT = 2, KIND_HOST = 3, KIND_DEVICE = 4,
       KIND_MODULE = 5, KIND_FUNCTION = 6, KIND_GRAPH = 7, KIND_EXEC = 8, NKINDS = 9 };
enum { RELAX_CONTEXT = 1, RELAX_PORTABLE = 2, RELAX_PYTHON_HOST_FN = 4, RELAX_EXIT = 8,
       RELAX_CAPTURE = 16 };
#define MAXDEV 8
#define MAGIC 0xC0DA5EEDu
#define COPY_LATENCY_NS 5000u
#define COPY_BYTES_PER_NS 10u  /* 10 GB/s */

static const char *kind_names[] = {"stream", "event", "context", "pinned host buffer",
                                   "device buffer", "module", "function", "graph",
                                   "executable graph"};

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
    unsigned flags;        /* CU_STREAM_NON_BLOCKING (1) or not: a blocking stream */
    /* stream capture (see "stream capture" below) */
    struct Capture *cap;   /* the capture sequence it is part of, or NULL */
    int member;            /* its index among the capture's streams */
    struct Node **deps;    /* the nodes its next captured node depends on */
    int ndeps, capdeps;
    uint64_t version;      /* bumped by every change of ``deps``: the state a join must see */
    uint64_t *seen;        /* the latest version of each stream of the capture it has waited */
    int nseen;             /* for, directly or through other streams (for the join check) */
    unsigned char *edges;  /* zeroed edge data for cuStreamGetCaptureInfo */
    int nedges;
    struct Op *held_tail;  /* its last operation while that has no due time yet (held work,
                            * see "the driver's thread"); ``tail`` is then a lower bound */
} Stream;

typedef struct Event {
    Obj h;
    unsigned flags;
    uint64_t recs, done;   /* records submitted, and the last one completed */
    uint64_t due;          /* due time of the latest record */
    struct Op *held_rec;   /* the latest record while it has no due time yet (held work) */
    uint64_t time;         /* completion time of the last completed record */
    int blockers;          /* threads inside cuEventSynchronize on it */
    struct IpcEventState *ipc;           /* an interprocess event's state, shared (memfd) */
    int ipc_fd;
    const struct IpcEventState *remote;  /* opened from another process: its state */
    pid_t remote_pid;
    struct Capture *cap;   /* last recorded in a capturing stream of this capture (a "captured
                            * event", until recorded again outside any capture); else NULL */
    struct Node **cap_deps;              /* what its record captured: the stream's nodes */
    int cap_ndeps;
    uint64_t *seen;                      /* and the stream versions it had seen */
    int nseen;
} Event;

typedef struct Module {
    Obj h;
    long running;  /* its kernels launched and not yet complete */
} Module;
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
    struct Graph *graph_owner;  /* made by an allocation node captured into this graph */
    int graph_live;        /* such memory, allocated by a launch and not freed since */
    uint64_t epoch;        /* such memory's allocations by launches: ``pending`` counts the
                            * operations of the latest only (0 for all other memory) */
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
static long captures_invalidated, graph_nodes_run;  /* for the test hooks */
static uint64_t host_fn_ns;  /* how late each host function runs after the work before it */
static uint64_t write_ns;    /* how late each stream memory write lands after the work before */
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

/* Operations, and when they run. An operation submitted behind work whose due time is known
 * gets its own due time at once (after its stream's earlier work, the records its stream
 * waits for, and its duration) and is queued in a heap the driver's thread completes in (due
 * time, submission) order. A stream memory wait (cuStreamWaitValue32/64) has no due time: it
 * is *held* until the stream reaches it and its word satisfies its condition, which the
 * driver's thread checks every POLL_NS while such a wait is pending (a GPU polls too); its due
 * time is then the time it was seen satisfied. What comes after a held operation is held too:
 * the later work of its stream, a record on it and the waits of other streams for that
 * record, the later nodes of a graph launch and the launch's end (a join, an operation of no
 * stream's). A held operation waits for its predecessors (``waiting`` of them) and knows a
 * lower bound of its start; when the last gets its due time it gets its own, and so on down
 * the chain: each release costs the work it releases, never a look at every object. */

enum {
    OP_KERNEL, OP_RECORD, OP_COPY, OP_HOSTFN, OP_ALLOC, OP_FREE, OP_TOUCH, OP_WRITE, OP_WAIT,
    OP_WAITVAL, OP_JOIN
};

/* CUstreamWriteValue_flags, CUstreamWaitValue_flags */
enum { WRITE_VALUE_NO_MEMORY_BARRIER = 1 };
enum { WAIT_VALUE_GEQ = 0, WAIT_VALUE_EQ = 1, WAIT_VALUE_AND = 2, WAIT_VALUE_NOR = 3,
       WAIT_VALUE_FLUSH = 1 << 30 };
#define POLL_NS 30000u  /* how often a held wait's word is read */

typedef struct Op {
    uint64_t due, seq;
    int kind;
    Stream *s;
    unsigned gen;
    CUresult fail;               /* OP_KERNEL: the sticky error it sets */
    Event *e;                    /* OP_RECORD */
    uint64_t rec;
    char *dst, *src;             /* OP_COPY, OP_TOUCH (src), OP_WRITE and OP_WAITVAL (dst) */
    size_t n;
    Block *bdst, *bsrc;
    char *staging;               /* a pageable source, staged at the call */
    CUhostFn fn;                 /* OP_HOSTFN */
    void *data;
    Block *block;                /* OP_ALLOC, OP_FREE */
    uint64_t value;              /* OP_WRITE: written at dst; OP_WAITVAL: compared with it */
    int width;                   /* OP_WRITE, OP_WAITVAL: 4 or 8 bytes */
    unsigned flags;              /* OP_WRITE, OP_WAITVAL: the call's flags */
    int early;                   /* OP_WRITE without a barrier: before the work it follows */
    int graph;                   /* a node of a graph launch */
    Module *module;              /* OP_KERNEL: the module whose code it runs */
    uint64_t epoch_dst, epoch_src;  /* the allocation of bdst, bsrc it uses (Block.epoch) */
    /* held work */
    uint64_t ns;                 /* how long it runs once started */
    uint64_t start;              /* it starts no earlier (its predecessors' known due times) */
    int waiting;                 /* its predecessors without a due time yet */
    int held, armed;             /* no due time yet; a wait the driver's thread polls */
    size_t held_at, armed_at;    /* its place in held_ops, armed */
    struct Op **after;           /* the held operations waiting for its due time */
    int nafter, capafter;
    struct Op **exec_held;       /* OP_JOIN: the held_tail and tail of the executable graph */
    uint64_t *exec_tail;         /* whose launch ends with it */
} Op;

static Op **heap;
static size_t nheap, capheap;
static uint64_t seq_counter;
static pthread_once_t engine_once = PTHREAD_ONCE_INIT;
static Op **held_ops, **armed;   /* every operation without a due time; the waits among them
                                  * whose stream has reached them */
static size_t nheld, capheld, narmed, caparmed;
static long held_real;           /* held operations of a stream (not joins) */
static uint64_t next_poll;       /* when the driver's thread reads the armed waits' words */

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

/* A set of operations (held_ops, armed), each knowing its place in it. */
static void set_add(Op ***set, size_t *n, size_t *cap, Op *op, size_t *at) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        *set = realloc(*set, *cap * sizeof **set);
    }
    *at = *n;
    (*set)[(*n)++] = op;
}

static void held_add(Op *op) {
    if (op->held) return;
    op->held = 1;
    set_add(&held_ops, &nheld, &capheld, op, &op->held_at);
    if (op->kind != OP_JOIN) held_real++;
}

static void held_remove(Op *op) {
    Op *last = held_ops[--nheld];
    held_ops[op->held_at] = last;
    last->held_at = op->held_at;
    op->held = 0;
    if (op->kind != OP_JOIN) held_real--;
}

static void armed_remove(Op *op) {
    Op *last = armed[--narmed];
    armed[op->armed_at] = last;
    last->armed_at = op->armed_at;
    op->armed = 0;
}

/* ``op`` waits for ``pred`` to get its due time, if it has none yet (lock held). */
static void hold_after(Op *op, Op *pred) {
    if (pred == NULL || !pred->held) return;
    if (pred->nafter == pred->capafter) {
        pred->capafter = pred->capafter ? 2 * pred->capafter : 4;
        pred->after = realloc(pred->after, (size_t)pred->capafter * sizeof *pred->after);
    }
    pred->after[pred->nafter++] = op;
    op->waiting++;
}

/* Whether a stream memory wait's condition holds on its word now. */
static int condition_holds(const Op *op) {
    uint64_t v = op->width == 8 ? __atomic_load_n((const uint64_t *)op->dst, __ATOMIC_ACQUIRE)
                                : __atomic_load_n((const uint32_t *)op->dst, __ATOMIC_ACQUIRE);
    uint64_t want = op->value, mask = op->width == 8 ? UINT64_MAX : UINT32_MAX;
    switch (op->flags & ~(unsigned)WAIT_VALUE_FLUSH) {
    case WAIT_VALUE_GEQ:  /* cyclic: (int32_t)(*addr - value) >= 0, int64_t for 64 bits */
        return op->width == 8 ? (int64_t)(v - want) >= 0 : (int32_t)(uint32_t)(v - want) >= 0;
    case WAIT_VALUE_EQ: return v == want;
    case WAIT_VALUE_AND: return (v & want) != 0;
    default: return (~(v | want) & mask) != 0;  /* NOR */
    }
}

/* Whether a wait whose predecessors have their due times is over at ``n``: its stream has
 * reached it and its condition holds. Work of a failed or reset context is dropped, its wait
 * included; a wait on memory freed under it (a violation when it was freed) reads nothing. */
static int wait_over(const Op *op, uint64_t n) {
    if (op->start > n) return 0;
    const Ctx *c = op->s->h.ctx;
    if (op->gen != c->gen || c->sticky != OK) return 1;
    if (op->bdst->freed) return 1;
    return condition_holds(op);
}

/* ``op``, whose predecessors all have their due times, gets its own: 1. A wait not over yet
 * is armed instead (0), for the driver's thread to poll (lock held). */
static int give_due(Op *op, uint64_t n) {
    if (op->kind == OP_WAITVAL) {
        if (!wait_over(op, n)) {
            held_add(op);
            set_add(&armed, &narmed, &caparmed, op, &op->armed_at);
            op->armed = 1;
            next_poll = 0;
            pthread_cond_signal(&work);
            return 0;
        }
        op->due = max_u64(op->start, n);
        return 1;
    }
    op->due = op->start + op->ns;
    /* without a barrier, a write behind pending work lands before that work's effects */
    if (op->kind == OP_WRITE) {
        op->early = (op->flags & WRITE_VALUE_NO_MEMORY_BARRIER) && op->start > n;
    }
    return 1;
}

/* ``first`` has its due time: it is queued (a join is done with), its stream's tail, its
 * event's due time and its executable graph's tail are known from it, and what waited for it
 * gets its due time in turn, transitively (lock held). */
static void settle(Op *first) {
    Op *local[16], **todo = local;  /* a chain longer than that is rare */
    size_t n = 0, cap = 16;
    uint64_t now = now_ns();
    todo[n++] = first;
    while (n) {
        Op *op = todo[--n];
        if (op->held) held_remove(op);
        Stream *s = op->s;
        if (s->held_tail == op) s->held_tail = NULL;
        s->tail = max_u64(s->tail, op->due);
        if (op->kind == OP_RECORD && op->e->held_rec == op) {
            op->e->held_rec = NULL;
            op->e->due = op->due;
            ipc_publish(op->e);
        }
        if (op->kind == OP_JOIN && *op->exec_held == op) {
            *op->exec_held = NULL;
            *op->exec_tail = max_u64(*op->exec_tail, op->due);
        }
        for (int i = 0; i < op->nafter; i++) {
            Op *next = op->after[i];
            next->start = max_u64(next->start, op->due);
            if (--next->waiting > 0 || !give_due(next, now)) continue;
            if (n == cap) {
                Op **more = malloc(2 * cap * sizeof *more);
                memcpy(more, todo, cap * sizeof *todo);
                if (todo != local) free(todo);
                todo = more;
                cap *= 2;
            }
            todo[n++] = next;
        }
        free(op->after);
        op->after = NULL;
        op->nafter = op->capafter = 0;
        if (op->kind == OP_JOIN) free(op);
        else heap_push(op);
    }
    if (todo != local) free(todo);
    pthread_cond_signal(&work);
}

/* ``op``, its fields set: queued with its due time, or held (lock held). */
static void place(Op *op) {
    if (op->waiting) {
        held_add(op);
        return;
    }
    if (give_due(op, now_ns())) settle(op);
}

/* The driver's thread reads the armed waits' words (lock held): each one over gets its due
 * time, and what it held its own. When none is over, the next read is due at the earliest
 * time a stream reaches one, or POLL_NS from now. */
static void poll_waits(uint64_t n) {
    uint64_t earliest = UINT64_MAX;
    for (size_t i = 0; i < narmed;) {
        Op *op = armed[i];
        if (!wait_over(op, n)) {
            earliest = earliest < op->start ? earliest : op->start;
            i++;
            continue;
        }
        armed_remove(op);
        op->due = max_u64(op->start, n);
        settle(op);  /* (may arm later waits, at the end of the set) */
    }
    next_poll = max_u64(n + POLL_NS, earliest == UINT64_MAX ? 0 : earliest);
}

/* The operation uses its memory until it completes (lock held). */
static void use_blocks(Op *op) {
    if (op->bdst) op->bdst->pending++, op->epoch_dst = op->bdst->epoch;
    if (op->bsrc) op->bsrc->pending++, op->epoch_src = op->bsrc->epoch;
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
    case OP_WAITVAL:
        break;
    case OP_WRITE:
        if (!dropped && usable(op->bdst, s, "a stream memory write")) {
            if (op->width == 8) __atomic_store_n((uint64_t *)op->dst, op->value, __ATOMIC_RELEASE);
            else __atomic_store_n((uint32_t *)op->dst, (uint32_t)op->value, __ATOMIC_RELEASE);
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
    case OP_FREE:  /* (op->rec: the allocation it frees; a later launch's is not its own) */
        if (op->block->pending > 0 && op->rec == op->block->epoch) {
            violation("cuMemFreeAsync freed device memory that %ld pending operation(s) still "
                      "use: they run after the free", op->block->pending);
        }
        if (op->block->graph_owner) op->block->ready = 0;  /* its graph allocates it again */
        else release_block(op->block);
        break;
    }
    if (op->graph) graph_nodes_run++;
    if (op->bdst && op->epoch_dst == op->bdst->epoch) op->bdst->pending--;
    if (op->bsrc && op->epoch_src == op->bsrc->epoch) op->bsrc->pending--;
    if (op->module) op->module->running--;
    free(op->staging);
    s->done++;
    if (op->gen == c->gen) c->done++;
}

static void *engine(void *arg) {
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        uint64_t n = now_ns(), wake = UINT64_MAX;
        if (narmed) {
            if (n >= next_poll) poll_waits(n);
            wake = next_poll;
        }
        if (nheap && heap[0]->due <= n) {
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
            continue;
        }
        if (nheap && heap[0]->due < wake) wake = heap[0]->due;
        if (wake == UINT64_MAX) {
            pthread_cond_wait(&work, &lock);
        } else {
            struct timespec ts = {(time_t)(wake / 1000000000u), (long)(wake % 1000000000u)};
            pthread_cond_timedwait(&work, &lock, &ts);
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

/* A new operation on ``s``, after its stream's earlier work, ``also`` (a held record it
 * waits for, or NULL) and ``ns`` long; its fields are set before ``enqueue`` (lock held). */
static Op *prepare_after(Stream *s, int kind, uint64_t ns, Op *also) {
    pthread_once(&engine_once, start_engine);
    Op *op = calloc(1, sizeof *op);
    op->kind = kind;
    op->s = s;
    op->gen = s->h.ctx->gen;
    op->seq = ++seq_counter;
    op->ns = ns;
    op->start = max_u64(now_ns(), s->tail);
    hold_after(op, s->held_tail);
    hold_after(op, also);
    s->submitted++;
    s->h.ctx->submitted++;
    return op;
}

static Op *prepare(Stream *s, int kind, uint64_t ns) { return prepare_after(s, kind, ns, NULL); }

/* Queued with its due time, or held: then the last operation of its stream, which later
 * work waits for (lock held). */
static void enqueue(Op *op) {
    place(op);
    if (op->held) op->s->held_tail = op;
}

/* A new operation on ``s``, queued or held; its fields are set after this, which is fine for
 * every kind but OP_RECORD and OP_WAITVAL (settling reads theirs) (lock held). */
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
static void drop_captures(Ctx *c);

static void reset_context(Ctx *c) {
    long live_handles = 0;
    drop_captures(c);  /* its streams are destroyed: their captures are over */
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

/* ------------------------------------------------------------------ stream capture */

/* Stream capture, as the driver API reference (cuStreamBeginCapture, cuStreamEndCapture,
 * cuThreadExchangeStreamCaptureMode, cuStreamWaitEvent's CU_EVENT_WAIT_EXTERNAL) and the
 * programming guide ("CUDA Graphs": stream capture, cross-stream dependencies and events,
 * prohibited and unhandled operations, invalidation) describe it. A capture sequence is begun
 * on an origin stream by a thread, in a mode; a stream joins it by waiting for an event
 * recorded in it (a fork), and must be joined back into the origin stream (the origin waits
 * for an event recorded on it after its last work) before cuStreamEndCapture. Work submitted
 * to a capturing stream does not run: it becomes a node of the capture's graph, depending on
 * the nodes before it in its stream and on those of the events the stream waited for. Event
 * records and waits inside one capture are edges, not nodes (a launch of the graph records
 * no event); a wait with CU_EVENT_WAIT_EXTERNAL is a node. */

enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
/* CUstreamCaptureStatus (NONE 0, ACTIVE 1, INVALIDATED 2), and this driver's "ended" */
enum { CAP_NONE = 0, CAP_ACTIVE = 1, CAP_INVALIDATED = 2, CAP_ENDED = 3 };

typedef struct Node {
    int kind;                    /* OP_KERNEL, OP_COPY, OP_HOSTFN, OP_WRITE, OP_WAITVAL,
                                  * OP_ALLOC, OP_FREE, OP_TOUCH, or OP_WAIT (an external event
                                  * wait) */
    int index;                   /* its place in its graph (the graph is in capture order,
                                  * so a node's dependencies come before it) */
    struct Node **deps;
    int ndeps;
    uint64_t ns;                 /* how long it runs */
    char *dst, *src;             /* OP_COPY, OP_WRITE and OP_WAITVAL (dst), OP_TOUCH (src) */
    size_t n;
    Block *bdst, *bsrc;
    CUhostFn fn;                 /* OP_HOSTFN */
    void *data;
    Block *block;                /* OP_ALLOC, OP_FREE */
    uint64_t value;              /* OP_WRITE, OP_WAITVAL */
    int width;                   /* OP_WRITE, OP_WAITVAL: 4 or 8 bytes */
    unsigned flags;
    Event *event;                /* OP_WAIT */
} Node;

typedef struct Graph {
    Obj h;
    Node **nodes;
    int nnodes, capnodes;
    int mem_nodes;               /* allocation or free nodes */
    int execs;                   /* live executable graphs made from it */
    struct Capture *capture;     /* the capture that builds it */
} Graph;

typedef struct Exec {
    Obj h;
    Graph *graph;
    Node **nodes;                /* its own copy: the graph may be destroyed */
    int nnodes;
    unsigned long long flags;
    uint64_t tail;               /* due time of its last launch's last node */
    struct Op *held_tail;        /* its last launch's end while that has no due time yet */
} Exec;

typedef struct Capture {
    uint64_t id;
    int mode, status;
    pthread_t thread;            /* the thread that began it */
    Ctx *ctx;
    Stream *origin;
    Stream **members;            /* the origin and the streams that joined it */
    int nmembers, capmembers;
    Graph *graph;
} Capture;

static Capture **captures;       /* every capture begun (never freed: events remember theirs) */
static size_t ncaptures, capcaptures;
static long open_captures;       /* not ended */
static uint64_t capture_ids;
static __thread int capture_mode = MODE_GLOBAL;  /* cuThreadExchangeStreamCaptureMode */

static const char *mode_name(int mode) {
    return mode == MODE_GLOBAL ? "GLOBAL" : mode == MODE_THREAD_LOCAL ? "THREAD_LOCAL"
                                                                      : "RELAXED";
}

static int is_own(const Capture *c) { return pthread_equal(c->thread, pthread_self()); }

/* A breach of the rules of stream capture (rule "capture"): counted unless relaxed. */
static void capture_violation(const char *fmt, ...) {
    char buf[240];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!(relaxed & RELAX_CAPTURE)) violation("%s", buf);
}

/* Invalidate ``c`` if it is active; whether it was. */
static int invalidate(Capture *c) {
    if (c == NULL || c->status != CAP_ACTIVE) return 0;
    c->status = CAP_INVALIDATED;
    captures_invalidated++;
    return 1;
}

/* The end of a violation's description: which capture the call invalidated, and whose. */
static const char *invalidated_note(const Capture *c, int newly) {
    if (!newly) return "";
    return is_own(c) ? ", and its capture is invalidated"
                     : ", and it invalidated the capture of another thread";
}

static void seen_raise(uint64_t **seen, int *n, int i, uint64_t v) {
    if (i >= *n) {
        *seen = realloc(*seen, (size_t)(i + 1) * sizeof **seen);
        memset(*seen + *n, 0, (size_t)(i + 1 - *n) * sizeof **seen);
        *n = i + 1;
    }
    if ((*seen)[i] < v) (*seen)[i] = v;
}

static uint64_t seen_get(const uint64_t *seen, int n, int i) { return i < n ? seen[i] : 0; }

static void deps_add(Node ***deps, int *n, int *cap, Node *node) {
    for (int i = 0; i < *n; i++) if ((*deps)[i] == node) return;
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 4;
        *deps = realloc(*deps, (size_t)*cap * sizeof **deps);
    }
    (*deps)[(*n)++] = node;
}

/* The stream's dependency set changed: its new state. */
static void bump(Stream *s) {
    s->version++;
    seen_raise(&s->seen, &s->nseen, s->member, s->version);
}

static void add_member(Capture *c, Stream *s) {
    if (c->nmembers == c->capmembers) {
        c->capmembers = c->capmembers ? 2 * c->capmembers : 4;
        c->members = realloc(c->members, (size_t)c->capmembers * sizeof *c->members);
    }
    s->member = c->nmembers;
    c->members[c->nmembers++] = s;
    s->cap = c;
    s->ndeps = 0;
    s->version = 0;
    s->nseen = 0;
    bump(s);
}

/* End ``c``: its streams leave capture. */
static void end_capture(Capture *c) {
    for (int i = 0; i < c->nmembers; i++) {
        Stream *s = c->members[i];
        s->cap = NULL;
        free(s->deps);
        free(s->seen);
        s->deps = NULL;
        s->seen = NULL;
        s->ndeps = s->capdeps = s->nseen = 0;
        s->version = 0;
    }
    c->status = CAP_ENDED;
    open_captures--;
}

static void drop_captures(Ctx *ctx) {
    for (size_t i = 0; i < ncaptures; i++) {
        if (captures[i]->ctx == ctx && captures[i]->status != CAP_ENDED) end_capture(captures[i]);
    }
}

/* A new node of the capture of ``s``, depending on the stream's dependency set, which it
 * then replaces (lock held). */
static Node *add_node(Stream *s, int kind, uint64_t ns) {
    Graph *g = s->cap->graph;
    Node *node = calloc(1, sizeof *node);
    node->kind = kind;
    node->ns = ns;
    node->index = g->nnodes;
    node->ndeps = s->ndeps;
    if (s->ndeps) {
        node->deps = malloc((size_t)s->ndeps * sizeof *node->deps);
        memcpy(node->deps, s->deps, (size_t)s->ndeps * sizeof *node->deps);
    }
    if (g->nnodes == g->capnodes) {
        g->capnodes = g->capnodes ? 2 * g->capnodes : 16;
        g->nodes = realloc(g->nodes, (size_t)g->capnodes * sizeof *g->nodes);
    }
    g->nodes[g->nnodes++] = node;
    if (kind == OP_ALLOC || kind == OP_FREE) g->mem_nodes++;
    s->ndeps = 0;
    deps_add(&s->deps, &s->ndeps, &s->capdeps, node);
    bump(s);
    return node;
}

/* ``e`` recorded in the capture of ``s``: it captures the stream's dependencies. */
static void capture_record(Event *e, Stream *s) {
    e->cap = s->cap;
    free(e->cap_deps);
    e->cap_deps = NULL;
    e->cap_ndeps = 0;
    if (s->ndeps) {
        e->cap_deps = malloc((size_t)s->ndeps * sizeof *e->cap_deps);
        memcpy(e->cap_deps, s->deps, (size_t)s->ndeps * sizeof *e->cap_deps);
        e->cap_ndeps = s->ndeps;
    }
    free(e->seen);
    e->seen = NULL;
    e->nseen = 0;
    for (int i = 0; i < s->nseen; i++) seen_raise(&e->seen, &e->nseen, i, s->seen[i]);
}

/* ``e`` recorded outside any capture: no longer a captured event. */
static void uncapture(Event *e) {
    e->cap = NULL;
    free(e->cap_deps);
    free(e->seen);
    e->cap_deps = NULL;
    e->seen = NULL;
    e->cap_ndeps = e->nseen = 0;
}

/* A capturing ``s`` waits for ``e``, captured in the same capture: its next node depends on
 * what the record captured too. */
static void capture_merge(Stream *s, const Event *e) {
    for (int i = 0; i < e->cap_ndeps; i++) deps_add(&s->deps, &s->ndeps, &s->capdeps, e->cap_deps[i]);
    for (int i = 0; i < e->nseen; i++) seen_raise(&s->seen, &s->nseen, i, e->seen[i]);
    bump(s);
}

/* Whether a blocking stream (not CU_STREAM_NON_BLOCKING) of ``ctx`` is in a capture that has
 * not ended; invalidating those captures when ``inval``. How many were newly invalidated
 * in ``*newly``, and one of them in ``*which``. */
static int blocking_capture(Ctx *ctx, int inval, int *newly, Capture **which) {
    int found = 0;
    for (size_t i = 0; i < ncaptures; i++) {
        Capture *c = captures[i];
        if (c->status == CAP_ENDED || c->ctx != ctx) continue;
        for (int j = 0; j < c->nmembers; j++) {
            if (c->members[j]->flags & 1) continue;
            found = 1;
            if (inval && invalidate(c)) {
                if (newly) (*newly)++;
                if (which) *which = c;
            }
            break;
        }
    }
    return found;
}

/* A potentially unsafe call by the calling thread (lock held): refused with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED where the thread's mode prohibits it, and the
 * captures it conflicts with are invalidated. GLOBAL: while the thread's own capture begun in
 * a mode other than RELAXED is under way, or another thread's begun in GLOBAL mode;
 * THREAD_LOCAL: its own only; RELAXED: never. A capture that was invalidated and not yet ended
 * is still under way (the least forgiving reading: its streams are still in capture mode,
 * cuStreamIsCapturing says CU_STREAM_CAPTURE_STATUS_INVALIDATED). */
static CUresult unsafe_call(const char *call) {
    if (open_captures == 0 || capture_mode == MODE_RELAXED) return OK;
    int own = 0, others = 0, newly_own = 0, newly_others = 0;
    for (size_t i = 0; i < ncaptures; i++) {
        Capture *c = captures[i];
        if (c->status == CAP_ENDED) continue;
        if (is_own(c)) {
            if (c->mode == MODE_RELAXED) continue;
            own++;
            newly_own += invalidate(c);
        } else {
            if (capture_mode != MODE_GLOBAL || c->mode != MODE_GLOBAL) continue;
            others++;
            newly_others += invalidate(c);
        }
    }
    if (!own && !others) return OK;
    capture_violation("%s (a potentially unsafe call) in %s mode while %s is under way: "
                      "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED%s%s", call, mode_name(capture_mode),
                      own ? "the thread's own capture" : "another thread's GLOBAL capture",
                      newly_own ? ", and its capture is invalidated" : "",
                      newly_others ? ", and it invalidated the capture of another thread" : "");
    return CAPTURE_UNSUPPORTED;
}

/* A use of the legacy default stream (lock held): while a blocking stream of its context
 * captures, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (the legacy stream would depend on it) and
 * those captures invalidated, whatever the mode; else a potentially unsafe call (the legacy
 * stream synchronizes implicitly). */
static CUresult legacy_use(const char *call, Stream *s) {
    if (!s->is_null || open_captures == 0) return OK;
    int newly = 0;
    Capture *which = NULL;
    if (blocking_capture(s->h.ctx, 1, &newly, &which)) {
        capture_violation("%s on the legacy default stream while a blocking stream of cuda:%d "
                          "captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT%s", call,
                          s->h.ctx->dev, which ? invalidated_note(which, 1) : "");
        return CAPTURE_IMPLICIT;
    }
    return unsafe_call(call);
}

/* Work submitted to ``s`` (lock held): the legacy stream's rules; a stream of an invalidated
 * capture answers CUDA_ERROR_STREAM_CAPTURE_INVALIDATED until cuStreamEndCapture. */
static CUresult stream_use(const char *call, Stream *s) {
    CUresult r = legacy_use(call, s);
    if (r != OK) return r;
    if (s->cap && s->cap->status == CAP_INVALIDATED) return CAPTURE_INVALIDATED;
    return OK;
}

/* ``s`` queried, synchronized or destroyed (lock held): a capturing stream cannot be, in any
 * mode (it "necessarily conflicts"): CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and its capture
 * invalidated. ``unsafe``: the call is potentially unsafe besides. */
static CUresult stream_sync_use(const char *call, Stream *s, int unsafe) {
    CUresult r = legacy_use(call, s);
    if (r != OK) return r;
    if (s->cap && s->cap->status == CAP_INVALIDATED) return CAPTURE_INVALIDATED;
    if (s->cap) {
        int newly = invalidate(s->cap);
        capture_violation("%s of a capturing stream: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED%s",
                          call, invalidated_note(s->cap, newly));
        return CAPTURE_UNSUPPORTED;
    }
    return unsafe && !s->is_null ? unsafe_call(call) : OK;
}

/* ``e`` queried, synchronized or timed (lock held): not while it is a captured event,
 * whatever the mode: CUDA_ERROR_CAPTURED_EVENT, also once its capture ended (until it is
 * recorded again outside a capture); its capture, if under way, is invalidated (the
 * programming guide: "any associated capture graphs are invalidated"). An event of an
 * invalidated capture answers CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. */
static CUresult event_use(const char *call, Event *e) {
    Capture *c = e->cap;
    if (c == NULL) return OK;
    if (c->status == CAP_INVALIDATED) return CAPTURE_INVALIDATED;
    int newly = invalidate(c);
    capture_violation("%s of an event last recorded in a capturing stream%s: "
                      "CUDA_ERROR_CAPTURED_EVENT%s", call,
                      c->status == CAP_ENDED ? " (its capture has ended)" : "",
                      invalidated_note(c, newly));
    return CAPTURED_EVENT;
}

/* ------------------------------------------------------------------ init and devices */

static unsigned parse_relax(const char *s) {
    unsigned r = 0;
    if (s == NULL) return 0;
    if (strstr(s, "context")) r |= RELAX_CONTEXT;
    if (strstr(s, "portable")) r |= RELAX_PORTABLE;
    if (strstr(s, "python-host-fn")) r |= RELAX_PYTHON_HOST_FN;
    if (strstr(s, "exit")) r |= RELAX_EXIT;
    if (strstr(s, "capture")) r |= RELAX_CAPTURE;
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
    switch (attribute) {
    case ATTR_MEMORY_POOLS_SUPPORTED: *value = !no_pools; break;
    case ATTR_CAN_MAP_HOST_MEMORY:
    case ATTR_UNIFIED_ADDRESSING:  /* a mapped host pointer is its device pointer */
    case ATTR_CAN_USE_STREAM_MEM_OPS_V1:
    case ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS_V1:
    case ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V1:
    case ATTR_CAN_FLUSH_REMOTE_WRITES:
    case ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS:
    case ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR: *value = 1; break;
    default: *value = 0;
    }
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
    case ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
    case CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CAPTURE_MERGE: return "CUDA_ERROR_STREAM_CAPTURE_MERGE";
    case CAPTURE_UNMATCHED: return "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED";
    case CAPTURE_UNJOINED: return "CUDA_ERROR_STREAM_CAPTURE_UNJOINED";
    case CAPTURE_ISOLATION: return "CUDA_ERROR_STREAM_CAPTURE_ISOLATION";
    case CAPTURE_IMPLICIT: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case CAPTURED_EVENT: return "CUDA_ERROR_CAPTURED_EVENT";
    case CAPTURE_WRONG_THREAD: return "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD";
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
    case ILLEGAL_STATE: *out = "the operation cannot be performed in the present state"; return OK;
    case CAPTURE_UNSUPPORTED: *out = "operation not permitted when stream is capturing"; return OK;
    case CAPTURE_INVALIDATED: *out = "operation failed due to a previous error during capture";
        return OK;
    case CAPTURE_MERGE: *out = "operation would result in a merge of separate capture sequences";
        return OK;
    case CAPTURE_UNMATCHED: *out = "capture was not ended in the same stream as it began";
        return OK;
    case CAPTURE_UNJOINED: *out = "capturing stream has unjoined work"; return OK;
    case CAPTURE_ISOLATION: *out = "dependency created on uncaptured work in another stream";
        return OK;
    case CAPTURE_IMPLICIT: *out = "operation would make the legacy stream depend on a capturing "
                                  "blocking stream"; return OK;
    case CAPTURED_EVENT: *out = "operation not permitted on an event last recorded in a "
                                "capturing stream"; return OK;
    case CAPTURE_WRONG_THREAD: *out = "attempt to terminate a thread-local capture sequence from "
                                      "another thread"; return OK;
    default: *out = error_name(r); return *out ? OK : INVALID_VALUE;
    }
}

/* ------------------------------------------------------------------ streams */

static CUresult cuStreamCreateWithPriority(void **out, unsigned flags, int priority) {
    ENTER();
    CUresult r = need_context("cuStreamCreateWithPriority", NULL);
    if (r != OK) LEAVE(r);
    Stream *s = new_object(sizeof *s, KIND_STREAM, current());
    s->priority = priority < -5 ? -5 : (priority > 0 ? 0 : priority);
    s->flags = flags;
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
    if (s->cap) {
        /* the reference says nothing of a capturing stream; the least forgiving reading: it
         * cannot be destroyed (its capture could not be joined or ended), as it cannot be
         * synchronized */
        CUresult rc = stream_sync_use("cuStreamDestroy", s, 0);
        LEAVE(rc);
    }
    s->h.dead = 1;  /* work already submitted still completes */
    LEAVE(r);
}

static CUresult cuStreamQuery(void *h) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(h, "cuStreamQuery", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamQuery", &s->h)) != OK) LEAVE(r);
    if ((r = stream_sync_use("cuStreamQuery", s, 1)) != OK) LEAVE(r);
    s->h.ctx->last_busy = s->done < s->submitted;
    LEAVE(s->done < s->submitted ? NOT_READY : OK);
}

static CUresult cuStreamSynchronize(void *h) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(h, "cuStreamSynchronize", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamSynchronize", &s->h)) != OK) LEAVE(r);
    if ((r = stream_sync_use("cuStreamSynchronize", s, 1)) != OK) LEAVE(r);
    LEAVE(wait_for(&s->done, s->submitted, s->h.ctx, s->h.gen));
}

static CUresult cuCtxSynchronize(void) {
    ENTER();
    CUresult r = need_context("cuCtxSynchronize", NULL);
    if (r != OK) LEAVE(r);
    Ctx *c = current();
    if (open_captures) {
        /* it waits for every stream of the context: with one capturing, it necessarily
         * conflicts with that capture, in any mode (the least forgiving reading; its
         * reference lists CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) */
        int found = 0, invalidated_only = 1, newly = 0;
        Capture *which = NULL;
        for (size_t i = 0; i < ncaptures; i++) {
            Capture *k = captures[i];
            if (k->status == CAP_ENDED || k->ctx != c) continue;
            found = 1;
            if (k->status == CAP_ACTIVE) invalidated_only = 0;
            if (invalidate(k)) newly++, which = k;
        }
        if (found && invalidated_only) LEAVE(CAPTURE_INVALIDATED);
        if (found) {
            capture_violation("cuCtxSynchronize while a stream of cuda:%d captures: "
                              "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED%s", c->dev,
                              which ? invalidated_note(which, newly) : "");
            LEAVE(CAPTURE_UNSUPPORTED);
        }
        if ((r = unsafe_call("cuCtxSynchronize")) != OK) LEAVE(r);
    }
    LEAVE(wait_for(&c->done, c->submitted, c, c->gen));
}

enum { EVENT_WAIT_EXTERNAL = 1 };

/* cuStreamWaitEvent from a capturing stream on ``src`` (lock held). */
static CUresult capture_wait(Stream *s, Event *src, unsigned flags) {
    Capture *c = s->cap;
    if (flags == EVENT_WAIT_EXTERNAL) {
        /* an external event node waits, at each launch, for the event's latest record then.
         * The least forgiving reading: only for an event recorded outside any capture (an
         * event captured is no record a launch could wait for) */
        if (src->cap) {
            int newly = invalidate(c);
            capture_violation("cuStreamWaitEvent with CU_EVENT_WAIT_EXTERNAL on an event last "
                              "recorded in a capturing stream: CUDA_ERROR_CAPTURED_EVENT%s",
                              invalidated_note(c, newly));
            return CAPTURED_EVENT;
        }
        if (src->remote) {
            violation("cuStreamWaitEvent with CU_EVENT_WAIT_EXTERNAL on an event of another "
                      "process: this stand-in does not capture such waits");
            return NOT_SUPPORTED;
        }
        add_node(s, OP_WAIT, 0)->event = src;
        return OK;
    }
    if (src->cap == c) {  /* an edge inside the capture (a join, where s is the origin) */
        capture_merge(s, src);
        return OK;
    }
    if (src->cap) {
        /* another capture's event, under way or ended (an ended capture's event still
         * belongs to its graph): both captures are invalidated */
        Capture *other = src->cap;
        int newly = invalidate(c), newly_other = invalidate(other);
        capture_violation("cuStreamWaitEvent from a capturing stream on an event of another "
                          "capture sequence: CUDA_ERROR_STREAM_CAPTURE_MERGE%s%s",
                          invalidated_note(c, newly), invalidated_note(other, newly_other));
        return CAPTURE_MERGE;
    }
    /* recorded outside any capture (or never recorded: the least forgiving reading counts
     * that too): a dependency across the capture's boundary */
    int newly = invalidate(c);
    capture_violation("cuStreamWaitEvent from a capturing stream on an event recorded outside "
                      "the capture: CUDA_ERROR_STREAM_CAPTURE_ISOLATION%s",
                      invalidated_note(c, newly));
    return CAPTURE_ISOLATION;
}

/* cuStreamWaitEvent from a stream outside any capture on a captured event (lock held): while
 * its capture is under way, the stream joins it (a fork); once it ended,
 * CUDA_ERROR_CAPTURED_EVENT. */
static CUresult wait_captured(Stream *s, Event *src) {
    Capture *c = src->cap;
    if (c->status == CAP_ENDED) {
        capture_violation("cuStreamWaitEvent from a stream outside any capture on an event last "
                          "recorded in a capture (that has ended): CUDA_ERROR_CAPTURED_EVENT");
        return CAPTURED_EVENT;
    }
    if (s->is_null || s->h.ctx != c->ctx) {
        /* the legacy stream cannot capture; a stream of another context joining: this
         * stand-in captures within one context (the least forgiving reading) */
        int newly = invalidate(c);
        capture_violation("cuStreamWaitEvent: %s cannot join a capture sequence%s: "
                          "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED%s",
                          s->is_null ? "the default stream" : "a stream of another context",
                          s->is_null ? "" : " of this stand-in", invalidated_note(c, newly));
        return CAPTURE_UNSUPPORTED;
    }
    add_member(c, s);
    capture_merge(s, src);
    return OK;
}

static CUresult cuStreamWaitEvent(void *hs, void *he, unsigned flags) {
    ENTER();
    CUresult r;
    if (flags & ~(unsigned)EVENT_WAIT_EXTERNAL) {
        /* no flag but CU_EVENT_WAIT_EXTERNAL (1) exists */
        violation("cuStreamWaitEvent with flags %#x: outside stream capture it takes "
                  "CU_EVENT_WAIT_DEFAULT (0)", flags);
        LEAVE(INVALID_VALUE);
    }
    Stream *s = stream_of(hs, "cuStreamWaitEvent", &r);
    if (s == NULL) LEAVE(r);
    Event *e = (Event *)lookup(he, KIND_EVENT, "cuStreamWaitEvent", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuStreamWaitEvent", &s->h)) != OK) LEAVE(r);
    if (flags && s->cap == NULL) {
        /* CU_EVENT_WAIT_EXTERNAL is valid only during stream capture */
        violation("cuStreamWaitEvent with flags %#x: outside stream capture it takes "
                  "CU_EVENT_WAIT_DEFAULT (0)", flags);
        LEAVE(INVALID_VALUE);
    }
    if ((r = stream_use("cuStreamWaitEvent", s)) != OK) LEAVE(r);
    if (e->cap && e->cap->status == CAP_INVALIDATED) LEAVE(CAPTURE_INVALIDATED);
    if (s->cap) LEAVE(capture_wait(s, e, flags));
    if (e->cap) LEAVE(wait_captured(s, e));
    if (e->remote) {
        remote_wait(e);
        LEAVE(OK);
    }
    if (e->done < e->recs) {  /* the wait is work of the stream until the record ends */
        if (e->held_rec == NULL) s->tail = max_u64(s->tail, e->due);
        enqueue(prepare_after(s, OP_WAIT, 0, e->held_rec));  /* held with a held record */
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
    if ((r = stream_use("cuEventRecord", s)) != OK) LEAVE(r);
    if (e->cap && e->cap->status == CAP_INVALIDATED) LEAVE(CAPTURE_INVALIDATED);
    if (s->cap) {  /* no operation: the event captures the stream's nodes */
        capture_record(e, s);
        LEAVE(OK);
    }
    uncapture(e);
    Op *op = prepare(s, OP_RECORD, 0);
    op->e = e;
    op->rec = ++e->recs;
    e->held_rec = op;  /* until it has its due time: at once, unless its stream is held */
    enqueue(op);
    ipc_publish(e);
    LEAVE(OK);
}

static CUresult cuEventQuery(void *h) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(h, KIND_EVENT, "cuEventQuery", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuEventQuery", &e->h)) != OK) LEAVE(r);
    if (!e->remote && (r = event_use("cuEventQuery", e)) != OK) LEAVE(r);
    if ((r = unsafe_call("cuEventQuery")) != OK) LEAVE(r);
    if (e->remote) LEAVE(remote_done(e, __atomic_load_n(&e->remote->recs, __ATOMIC_ACQUIRE))
                         ? OK : NOT_READY);
    if (e->done < e->recs) e->h.ctx->last_busy = 1;  /* seen pending (a stream gone?) */
    LEAVE(e->done < e->recs ? NOT_READY : OK);
}

static CUresult cuEventSynchronize(void *h) {
    ENTER();
    CUresult r;
    Event *e = (Event *)lookup(h, KIND_EVENT, "cuEventSynchronize", &r);
    if (e == NULL) LEAVE(r);
    if ((r = need_context("cuEventSynchronize", &e->h)) != OK) LEAVE(r);
    if (!e->remote && (r = event_use("cuEventSynchronize", e)) != OK) LEAVE(r);
    if ((r = unsafe_call("cuEventSynchronize")) != OK) LEAVE(r);
    if (e->remote) {
        remote_wait(e);
        LEAVE(OK);
    }
    e->blockers++;
    r = wait_for(&e->done, e->recs, e->h.ctx, e->h.gen);
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
    if ((r = event_use("cuEventElapsedTime", a)) != OK) LEAVE(r);
    if ((r = event_use("cuEventElapsedTime", b)) != OK) LEAVE(r);
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
    pid_t pid;
    memcpy(&pid, handle.reserved + 8, sizeof pid);
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
    if (memcmp(handle.reserved, ipc_magic, 8) != 0) LEAVE(INVALID_VALUE);
    /* an event of this process: the documentation promises nothing (HIP documents an error) */
    violation("cuIpcOpenEventHandle in the process that exported the event: a handle opens "
              "in other processes only");
    LEAVE(INVALID_CONTEXT);
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
    if (m->running) {
        /* its code is in use: a GPU's driver waits for those kernels (seen on an H200: a
         * process's exit held by a 30 s kernel), so a kernel that hangs holds the caller */
        violation("cuModuleUnload of a module with %ld kernel(s) still pending or running: "
                  "the driver waits for them", m->running);
    }
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
    if ((r = stream_use("cuLaunchKernel", s)) != OK) LEAVE(r);
    if (s->cap) {  /* a kernel node: its parameters are read now */
        add_node(s, OP_KERNEL, *(uint64_t *)params[0]);
        LEAVE(OK);
    }
    Op *op = submit(s, OP_KERNEL, *(uint64_t *)params[0]);
    op->module = f->module;
    f->module->running++;
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
    if ((r = stream_use("cuLaunchHostFunc", s)) != OK) LEAVE(r);
    Dl_info info;
    host_calls++;
    if (!dladdr((void *)fn, &info) || info.dli_sname == NULL || info.dli_saddr != (void *)fn) {
        host_calls_python++;
        if (!(relaxed & RELAX_PYTHON_HOST_FN)) {
            violation("cuLaunchHostFunc of %p, which is no C function of a loaded library "
                      "(a ctypes closure runs Python on the driver's thread)", (void *)fn);
        }
    }
    if (s->cap) {  /* a host node: the function runs at each launch */
        Node *node = add_node(s, OP_HOSTFN, host_fn_ns);
        node->fn = fn;
        node->data = data;
        LEAVE(OK);
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

/* Pinned host memory: cuMemHostAlloc, and cuMemAllocHost (flags 0). */
static CUresult host_alloc(const char *call, void **out, size_t n, unsigned flags) {
    pthread_mutex_lock(&lock);
    CUresult r = failpoint(call);
    if (r != OK) LEAVE(r);
    if ((r = need_context(call, NULL)) != OK) LEAVE(r);
    if ((r = unsafe_call(call)) != OK) LEAVE(r);
    Block *b = new_block(n, 1, current());
    if (b == NULL) LEAVE(OUT_OF_MEMORY);
    b->portable = (flags & HOST_PORTABLE) != 0;
    b->mapped_for_device = (flags & HOST_DEVICEMAP) != 0;
    b->ready = 1;
    *out = b->base;
    LEAVE(OK);
}

static CUresult cuMemHostAlloc(void **out, size_t n, unsigned flags) {
    return host_alloc("cuMemHostAlloc", out, n, flags);
}

static CUresult cuMemAllocHost(void **out, size_t n) {
    return host_alloc("cuMemAllocHost", out, n, 0);
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
    CUresult unsafe = unsafe_call("cuMemFreeHost");
    if (unsafe != OK) LEAVE(unsafe);
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
    if ((r = stream_use("cuMemAllocAsync", s)) != OK) LEAVE(r);
    Block *b = new_block(n, 0, current());
    if (b == NULL) LEAVE(OUT_OF_MEMORY);
    b->pooled = 1;
    if (s->cap) {
        /* an allocation node: the graph's memory, allocated at each launch (it completes
         * alloc_ns after the nodes it depends on); a launch while a previous launch's
         * allocation is unfreed fails, as cuGraphLaunch documents */
        b->graph_owner = s->cap->graph;
        add_node(s, OP_ALLOC, alloc_ns)->block = b;
        *out = (CUdeviceptr)(uintptr_t)b->base;
        LEAVE(OK);
    }
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
    if ((r = stream_use("cuMemFreeAsync", s)) != OK) LEAVE(r);
    if (s->cap) {
        /* a free node: the memory is freed at each launch. Memory this graph allocates is
         * freed for what the capture does after it; other memory stays usable until a launch
         * frees it */
        add_node(s, OP_FREE, 0)->block = b;
        if (b->graph_owner == s->cap->graph) b->free_submitted = 1, b->h.dead = 1;
        LEAVE(OK);
    }
    b->free_submitted = 1;
    b->h.dead = 1;
    b->graph_live = 0;
    Op *op = submit(s, OP_FREE, 0);
    op->block = b;
    op->rec = b->epoch;
    LEAVE(OK);
}

static CUresult cuMemAlloc(CUdeviceptr *out, size_t n) {
    ENTER();
    CUresult r = need_context("cuMemAlloc", NULL);
    if (r != OK) LEAVE(r);
    if ((r = unsafe_call("cuMemAlloc")) != OK) LEAVE(r);
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
    CUresult unsafe = unsafe_call("cuMemFree");
    if (unsafe != OK) LEAVE(unsafe);
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
    if ((r = unsafe_call("cuIpcOpenMemHandle")) != OK) LEAVE(r);
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

/* cuMemGetAddressRange: the base and size of the allocation that holds ``p`` (memory opened
 * from another process's handle is the exporter's whole allocation). */
static CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    ENTER();
    CUresult r = need_context("cuMemGetAddressRange", NULL);
    if (r != OK) LEAVE(r);
    Block *b = block_at((void *)(uintptr_t)p, 0, 0);
    if (b == NULL || !known(b) || b->freed || !is_live(&b->h)) LEAVE(NOT_FOUND);
    if (base) *base = (CUdeviceptr)(uintptr_t)b->base;
    if (size) *size = b->size;
    LEAVE(OK);
}

static CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    ENTER();
    CUresult r;
    Block *b = block_of_ptr(p, "cuIpcCloseMemHandle", &r);
    if (b == NULL) LEAVE(r);
    if ((r = need_context("cuIpcCloseMemHandle", &b->h)) != OK) LEAVE(r);
    if ((r = unsafe_call("cuIpcCloseMemHandle")) != OK) LEAVE(r);
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
    if ((r = stream_use(call, s)) != OK) LEAVE(r);
    if (s->cap) {
        if (pageable_src || pageable_dst) {
            /* pageable memory is staged or waited for at the call: nothing a graph can replay
             * (the least forgiving reading) */
            int newly = invalidate(s->cap);
            capture_violation("%s with pageable host memory into a capturing stream: "
                              "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED%s", call,
                              invalidated_note(s->cap, newly));
            LEAVE(CAPTURE_UNSUPPORTED);
        }
        Node *node = add_node(s, OP_COPY, ns);  /* a copy node: it copies at each launch */
        node->dst = (char *)dst;
        node->src = (char *)src;
        node->n = n;
        node->bdst = ends[0];
        node->bsrc = ends[1];
        LEAVE(OK);
    }
    /* a copy to pageable memory returns once it completed: a synchronous, potentially
     * unsafe call */
    if (pageable_dst && !s->is_null && (r = unsafe_call(call)) != OK) LEAVE(r);
    Op *op = submit(s, OP_COPY, ns);
    op->dst = (char *)dst;
    op->src = (char *)src;
    op->n = n;
    op->bdst = ends[0];
    op->bsrc = ends[1];
    use_blocks(op);
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

/* Stream memory operations (cuStreamWriteValue32/64, cuStreamWaitValue32/64), on ``width``
 * bytes at ``addr``: device memory, or pinned memory mapped for the device, live, aligned to
 * ``width``. A write stores ``value`` when the stream reaches it (without a barrier it may
 * land before the effects of the work before it); a wait holds the stream's later work until
 * its condition holds (see "the driver's thread"). In a capture either is a memory operation
 * node, acting at each launch. */
static CUresult memop(const char *call, void *hs, CUdeviceptr addr, uint64_t value, int width,
                      unsigned flags, int kind) {
    pthread_mutex_lock(&lock);
    CUresult r = failpoint(call);
    if (r != OK) LEAVE(r);
    if (kind == OP_WRITE && (flags & ~(unsigned)WRITE_VALUE_NO_MEMORY_BARRIER)) {
        violation("%s with flags %#x: it takes CU_STREAM_WRITE_VALUE_DEFAULT (0) or "
                  "CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (1)", call, flags);
        LEAVE(INVALID_VALUE);
    }
    if (kind == OP_WAITVAL && (flags & ~(unsigned)WAIT_VALUE_FLUSH) > WAIT_VALUE_NOR) {
        violation("%s with flags %#x: it takes CU_STREAM_WAIT_VALUE_GEQ (0), EQ (1), AND (2) "
                  "or NOR (3), with CU_STREAM_WAIT_VALUE_FLUSH (1 << 30) or not", call, flags);
        LEAVE(INVALID_VALUE);
    }
    Stream *s = stream_of(hs, call, &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context(call, &s->h)) != OK) LEAVE(r);
    if (addr % (unsigned)width) {
        violation("%s at %#llx, which is not aligned to %d bytes", call, addr, width);
        LEAVE(INVALID_VALUE);
    }
    Block *b = block_at((void *)(uintptr_t)addr, (size_t)width, 1);
    if (b != NULL && !b->mapped_for_device) b = NULL;
    if (b == NULL) b = block_at((void *)(uintptr_t)addr, (size_t)width, 0);
    if (b == NULL || b->freed || b->free_submitted) {
        violation("%s %s %#llx, which is no live device-accessible memory", call,
                  kind == OP_WRITE ? "to" : "on", addr);
        LEAVE(INVALID_VALUE);
    }
    if ((r = stream_use(call, s)) != OK) LEAVE(r);
    if (s->cap) {  /* a memory operation node: it acts at each launch */
        Node *node = add_node(s, kind, 0);
        node->dst = (char *)(uintptr_t)addr;
        node->value = value;
        node->width = width;
        node->bdst = b;
        node->flags = flags;
        LEAVE(OK);
    }
    Op *op = prepare(s, kind, kind == OP_WRITE ? write_ns : 0);
    op->dst = (char *)(uintptr_t)addr;
    op->value = value;
    op->width = width;
    op->flags = flags;
    op->bdst = b;
    use_blocks(op);
    enqueue(op);
    LEAVE(OK);
}

static CUresult cuStreamWriteValue32(void *hs, CUdeviceptr addr, uint32_t value,
                                     unsigned flags) {
    return memop("cuStreamWriteValue32", hs, addr, value, 4, flags, OP_WRITE);
}

static CUresult cuStreamWriteValue64(void *hs, CUdeviceptr addr, uint64_t value,
                                     unsigned flags) {
    return memop("cuStreamWriteValue64", hs, addr, value, 8, flags, OP_WRITE);
}

static CUresult cuStreamWaitValue32(void *hs, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return memop("cuStreamWaitValue32", hs, addr, value, 4, flags, OP_WAITVAL);
}

static CUresult cuStreamWaitValue64(void *hs, CUdeviceptr addr, uint64_t value, unsigned flags) {
    return memop("cuStreamWaitValue64", hs, addr, value, 8, flags, OP_WAITVAL);
}

/* ------------------------------------------------------------------ capture and graphs */

/* Begins a capture on ``hs`` in ``mode`` (cuStreamBeginCapture_v2). */
static CUresult cuStreamBeginCapture(void *hs, int mode) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(hs, "cuStreamBeginCapture", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamBeginCapture", &s->h)) != OK) LEAVE(r);
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) {
        violation("cuStreamBeginCapture with mode %d: no CUstreamCaptureMode", mode);
        LEAVE(INVALID_VALUE);
    }
    if (s->is_null) {
        /* "Capture may not be initiated if hStream is CU_STREAM_LEGACY". This stand-in has
         * one default stream for the legacy and the per-thread handles, so neither begins a
         * capture (the least forgiving reading for CU_STREAM_PER_THREAD). The code is the
         * driver's for an operation the stream cannot do under capture */
        capture_violation("cuStreamBeginCapture on the default stream: "
                          "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED");
        LEAVE(CAPTURE_UNSUPPORTED);
    }
    if (s->cap) {  /* "it may only be initiated if the stream is not already in capture mode" */
        capture_violation("cuStreamBeginCapture on a stream already capturing (%s): "
                          "CUDA_ERROR_ILLEGAL_STATE", s == s->cap->origin ? "its origin"
                                                                           : "joined by a fork");
        LEAVE(ILLEGAL_STATE);
    }
    Capture *c = calloc(1, sizeof *c);
    c->id = ++capture_ids;
    c->mode = mode;
    c->status = CAP_ACTIVE;
    c->thread = pthread_self();
    c->ctx = s->h.ctx;
    c->origin = s;
    c->graph = new_object(sizeof(Graph), KIND_GRAPH, s->h.ctx);
    c->graph->capture = c;
    if (ncaptures == capcaptures) {
        capcaptures = capcaptures ? 2 * capcaptures : 16;
        captures = realloc(captures, capcaptures * sizeof *captures);
    }
    captures[ncaptures++] = c;
    open_captures++;
    add_member(c, s);
    LEAVE(OK);
}

/* The memory of ``g``'s allocation nodes that no launch holds allocated is no live buffer of the
 * program's (an executable graph still made from ``g`` allocates it again at its launch). */
static void retire_graph_memory(Graph *g) {
    for (int i = 0; i < g->nnodes; i++) {
        Block *b = g->nodes[i]->block;
        if (g->nodes[i]->kind == OP_ALLOC && !b->graph_live) b->h.dead = 1;
    }
}

/* Ends the capture begun on ``hs``: its graph in ``*out`` (NULL where it failed), and every
 * stream of the capture leaves it. */
static CUresult cuStreamEndCapture(void *hs, void **out) {
    ENTER();
    CUresult r;
    Stream *s = stream_of(hs, "cuStreamEndCapture", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuStreamEndCapture", &s->h)) != OK) LEAVE(r);
    if (out == NULL) LEAVE(INVALID_VALUE);
    *out = NULL;
    Capture *c = s->cap;
    if (c == NULL) {
        /* the reference lists no code for a stream not capturing: this one says the stream's
         * state does not allow it */
        capture_violation("cuStreamEndCapture on a stream not capturing: "
                          "CUDA_ERROR_ILLEGAL_STATE");
        LEAVE(ILLEGAL_STATE);
    }
    if (s != c->origin) {
        /* "Capture must be ended on the same stream in which it was initiated"; the least
         * forgiving reading invalidates the capture, as other breaches of its rules do */
        int newly = invalidate(c);
        capture_violation("cuStreamEndCapture on a stream that joined a capture, not its "
                          "origin: CUDA_ERROR_STREAM_CAPTURE_UNMATCHED%s",
                          invalidated_note(c, newly));
        LEAVE(CAPTURE_UNMATCHED);
    }
    if (c->mode != MODE_RELAXED && !is_own(c)) {
        /* the capture stays in capture mode for its own thread to end; the least forgiving
         * reading invalidates it */
        int newly = invalidate(c);
        capture_violation("cuStreamEndCapture of a capture begun in %s mode by another thread: "
                          "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD%s", mode_name(c->mode),
                          newly ? ", and the capture is invalidated" : "");
        LEAVE(CAPTURE_WRONG_THREAD);
    }
    r = OK;
    if (c->status == CAP_INVALIDATED) {
        r = CAPTURE_INVALIDATED;
    } else {
        /* every stream that joined must be joined back: the origin has waited (directly or
         * through other streams) for an event recorded on it after its last change. The least
         * forgiving reading: also a fork that submitted nothing */
        int unjoined = 0;
        for (int i = 0; i < c->nmembers; i++) {
            Stream *m = c->members[i];
            if (m != s && seen_get(s->seen, s->nseen, m->member) < m->version) unjoined++;
        }
        if (unjoined) {
            invalidate(c);
            capture_violation("cuStreamEndCapture with %d stream(s) of the capture not joined "
                              "back into its origin: CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
                              unjoined);
            r = CAPTURE_UNJOINED;
        }
    }
    end_capture(c);  /* "all streams being captured to the same graph" leave capture */
    if (r == OK) {
        *out = c->graph;
    } else {
        c->graph->h.dead = 1;
        retire_graph_memory(c->graph);
    }
    LEAVE(r);
}

/* Whether ``hs`` is capturing: CUstreamCaptureStatus in ``*status``. */
static CUresult capture_status(const char *call, void *hs, int *status, Stream **stream) {
    CUresult r;
    Stream *s = stream_of(hs, call, &r);
    if (s == NULL) return r;
    if ((r = need_context(call, &s->h)) != OK) return r;
    if (status == NULL) return INVALID_VALUE;
    /* the legacy stream while a blocking stream of its context captures: documented, and the
     * capture is not invalidated (and no violation: it is an answer) */
    if (s->is_null && open_captures && blocking_capture(s->h.ctx, 0, NULL, NULL)) {
        return CAPTURE_IMPLICIT;
    }
    *status = s->cap ? s->cap->status : CAP_NONE;
    *stream = s;
    return OK;
}

static CUresult cuStreamIsCapturing(void *hs, int *status) {
    ENTER();
    Stream *s;
    LEAVE(capture_status("cuStreamIsCapturing", hs, status, &s));
}

/* cuStreamGetCaptureInfo: _v2 (11030) without edge data, and the one CUDA 13 names so (v3,
 * 12030) with it: this stand-in's edges are all default ones (zeroed). */
static CUresult capture_info(const char *call, void *hs, int *status, uint64_t *id,
                             void **graph, void *const **deps, const void **edges,
                             size_t *ndeps) {
    Stream *s;
    CUresult r = capture_status(call, hs, status, &s);
    if (r != OK) return r;
    if (edges && !deps) return INVALID_VALUE;  /* documented */
    int active = s->cap && s->cap->status == CAP_ACTIVE;
    if (id) *id = s->cap ? s->cap->id : 0;
    if (graph) *graph = active ? s->cap->graph : NULL;
    if (deps) *deps = active ? (void *const *)s->deps : NULL;
    if (ndeps) *ndeps = active ? (size_t)s->ndeps : 0;
    if (edges) {
        if (active && s->ndeps > s->nedges) {
            free(s->edges);
            s->edges = calloc((size_t)s->ndeps, 8);  /* sizeof(CUgraphEdgeData) */
            s->nedges = s->ndeps;
        }
        *edges = active && s->ndeps ? s->edges : NULL;
    }
    return OK;
}

static CUresult cuStreamGetCaptureInfo_v2(void *hs, int *status, uint64_t *id, void **graph,
                                          void *const **deps, size_t *ndeps) {
    ENTER();
    LEAVE(capture_info("cuStreamGetCaptureInfo_v2", hs, status, id, graph, deps, NULL, ndeps));
}

static CUresult cuStreamGetCaptureInfo(void *hs, int *status, uint64_t *id, void **graph,
                                       void *const **deps, const void **edges, size_t *ndeps) {
    ENTER();
    LEAVE(capture_info("cuStreamGetCaptureInfo", hs, status, id, graph, deps, edges, ndeps));
}

/* Swaps the calling thread's capture interaction mode (GLOBAL to begin with). */
static CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    FAIL_IF_ASKED();
    if (mode == NULL || *mode < MODE_GLOBAL || *mode > MODE_RELAXED) return INVALID_VALUE;
    int previous = capture_mode;
    capture_mode = *mode;
    *mode = previous;
    return OK;
}

enum { INSTANTIATE_AUTO_FREE_ON_LAUNCH = 1, INSTANTIATE_UPLOAD = 2,
       INSTANTIATE_DEVICE_LAUNCH = 4, INSTANTIATE_USE_NODE_PRIORITY = 8 };

/* An executable graph of ``hg`` in its context (cuda-python 13's cuGraphInstantiate). */
static CUresult cuGraphInstantiateWithFlags(void **out, void *hg, unsigned long long flags) {
    ENTER();
    CUresult r;
    Graph *g = (Graph *)lookup(hg, KIND_GRAPH, "cuGraphInstantiateWithFlags", &r);
    if (g == NULL) LEAVE(r);
    /* its nodes are of the context it was captured in: that context must be current */
    if ((r = need_context("cuGraphInstantiateWithFlags", &g->h)) != OK) LEAVE(r);
    if (out == NULL) LEAVE(INVALID_VALUE);
    if (g->capture && g->capture->status != CAP_ENDED) {
        violation("cuGraphInstantiateWithFlags of a graph still being captured into");
        LEAVE(INVALID_VALUE);
    }
    if (flags & INSTANTIATE_DEVICE_LAUNCH) LEAVE(NOT_SUPPORTED);  /* not modelled */
    if (flags & ~(unsigned long long)(INSTANTIATE_AUTO_FREE_ON_LAUNCH |
                                      INSTANTIATE_USE_NODE_PRIORITY)) {
        /* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD is cuGraphInstantiateWithParams's only */
        violation("cuGraphInstantiateWithFlags with flags %#llx: it takes "
                  "AUTO_FREE_ON_LAUNCH (1), DEVICE_LAUNCH (4) and USE_NODE_PRIORITY (8)", flags);
        LEAVE(INVALID_VALUE);
    }
    if (g->mem_nodes && g->execs > 0) {
        violation("cuGraphInstantiateWithFlags of a graph with allocation or free nodes that "
                  "has an executable graph already (at most one at a time)");
        LEAVE(INVALID_VALUE);
    }
    Exec *x = new_object(sizeof *x, KIND_EXEC, g->h.ctx);
    x->graph = g;
    x->flags = flags;
    x->nnodes = g->nnodes;
    if (g->nnodes) {
        x->nodes = malloc((size_t)g->nnodes * sizeof *x->nodes);
        memcpy(x->nodes, g->nodes, (size_t)g->nnodes * sizeof *x->nodes);
    }
    g->execs++;
    *out = x;
    LEAVE(OK);
}

/* The graph's nodes as operations of ``s``, each due after its dependencies, the stream's
 * earlier work and the executable graph's previous launch; a node after a held one (a memory
 * wait node not yet over, or held work before the launch) is held, and so is the launch's end,
 * a join of its held nodes that the stream's later work and the next launch wait for (lock
 * held). */
static void launch_nodes(Exec *x, Stream *s) {
    pthread_once(&engine_once, start_engine);
    uint64_t n = now_ns(), base = max_u64(max_u64(n, s->tail), x->tail);
    Op *stream_held = s->held_tail, *exec_held = x->held_tail;
    Op **ops = calloc((size_t)(x->nnodes ? x->nnodes : 1), sizeof *ops);
    for (int i = 0; i < x->nnodes; i++) {
        Node *node = x->nodes[i];
        Op *op = calloc(1, sizeof *op);
        op->kind = node->kind;
        op->s = s;
        op->gen = s->h.ctx->gen;
        op->seq = ++seq_counter;
        op->ns = node->ns;
        op->start = base;
        op->graph = 1;
        hold_after(op, stream_held);
        hold_after(op, exec_held);
        for (int d = 0; d < node->ndeps; d++) {
            Op *dep = ops[node->deps[d]->index];
            if (dep->held) hold_after(op, dep);
            else op->start = max_u64(op->start, dep->due);
        }
        if (node->kind == OP_WAIT && node->event->done < node->event->recs) {
            /* the record pending at the launch */
            if (node->event->held_rec) hold_after(op, node->event->held_rec);
            else op->start = max_u64(op->start, node->event->due);
        }
        switch (node->kind) {
        case OP_KERNEL:  /* the next kernel launched fails, if a test asked */
            op->fail = fail_next_code;
            fail_next_code = 0;
            break;
        case OP_COPY:
        case OP_TOUCH:
        case OP_WRITE:
        case OP_WAITVAL:
            op->dst = node->dst;
            op->src = node->src;
            op->n = node->n;
            op->bdst = node->bdst;
            op->bsrc = node->bsrc;
            op->value = node->value;
            op->width = node->width;
            op->flags = node->flags;
            break;
        case OP_HOSTFN:
            op->fn = node->fn;
            op->data = node->data;
            break;
        case OP_ALLOC:  /* allocated again: usable in program order from now */
            op->block = node->block;
            op->block->epoch++;
            op->block->pending = 0;  /* what is pending uses the previous allocation */
            op->block->graph_live = 1;
            op->block->free_submitted = 0;
            op->block->h.dead = 0;
            break;
        case OP_FREE:
            op->block = node->block;
            op->rec = op->block->epoch;
            op->block->graph_live = 0;
            op->block->free_submitted = 1;
            op->block->h.dead = 1;
            break;
        }
        use_blocks(op);
        s->submitted++;
        s->h.ctx->submitted++;
        ops[i] = op;
        place(op);
    }
    /* the launch completes when all its nodes have */
    Op *join = NULL;
    uint64_t end = base;
    for (int i = 0; i < x->nnodes; i++) {
        if (!ops[i]->held) {
            end = max_u64(end, ops[i]->due);
            continue;
        }
        if (join == NULL) {
            join = calloc(1, sizeof *join);
            join->kind = OP_JOIN;
            join->s = s;
            join->gen = s->h.ctx->gen;
            join->seq = ++seq_counter;
            join->exec_held = &x->held_tail;
            join->exec_tail = &x->tail;
        }
        hold_after(join, ops[i]);
    }
    free(ops);
    if (join) {
        join->start = end;
        held_add(join);
        s->held_tail = join;
        x->held_tail = join;
    } else {
        s->tail = max_u64(s->tail, end);
        x->tail = end;
    }
    pthread_cond_signal(&work);
}

static CUresult cuGraphLaunch(void *hx, void *hs) {
    ENTER();
    CUresult r;
    Exec *x = (Exec *)lookup(hx, KIND_EXEC, "cuGraphLaunch", &r);
    if (x == NULL) LEAVE(r);
    Stream *s = stream_of(hs, "cuGraphLaunch", &r);
    if (s == NULL) LEAVE(r);
    if ((r = need_context("cuGraphLaunch", &s->h)) != OK) LEAVE(r);
    if (x->h.ctx != s->h.ctx) {  /* the only error its reference lists: INVALID_VALUE */
        char a[32], b[32];
        violation("cuGraphLaunch of an executable graph of %s on a stream of %s",
                  ctx_name(x->h.ctx, a), ctx_name(s->h.ctx, b));
        LEAVE(INVALID_VALUE);
    }
    if ((r = stream_use("cuGraphLaunch", s)) != OK) LEAVE(r);
    if (s->cap) {
        /* the reference does not say a launch is captured: the least forgiving reading
         * refuses it, with the code the reference gives operations "not permitted when the
         * stream is capturing" */
        int newly = invalidate(s->cap);
        capture_violation("cuGraphLaunch into a capturing stream: "
                          "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED%s",
                          invalidated_note(s->cap, newly));
        LEAVE(CAPTURE_UNSUPPORTED);
    }
    for (int i = 0; i < x->nnodes; i++) {
        Block *b = x->nodes[i]->block;
        if (x->nodes[i]->kind == OP_ALLOC && b->graph_live) {
            if (x->flags & INSTANTIATE_AUTO_FREE_ON_LAUNCH) continue;
            violation("cuGraphLaunch while memory its previous launch allocated is unfreed "
                      "(instantiated without AUTO_FREE_ON_LAUNCH)");
            LEAVE(INVALID_VALUE);
        }
        /* a free node frees memory the launch allocates first (its graph's), or memory
         * allocated now: not freed already */
        if (x->nodes[i]->kind == OP_FREE &&
            (b->graph_owner ? b->graph_owner != x->graph && !b->graph_live
                            : b->free_submitted || b->freed)) {
            violation("cuGraphLaunch of a graph that frees memory already freed");
            LEAVE(INVALID_VALUE);
        }
    }
    launch_nodes(x, s);
    LEAVE(OK);
}

/* Destroys an executable graph; launches in flight complete ("freed asynchronously on
 * completion": its nodes' operations are queued already). */
static CUresult cuGraphExecDestroy(void *hx) {
    ENTER();
    CUresult r;
    Exec *x = (Exec *)lookup(hx, KIND_EXEC, "cuGraphExecDestroy", &r);
    if (x == NULL) LEAVE(r);
    r = need_context("cuGraphExecDestroy", &x->h);
    if (r == INVALID_CONTEXT || r == CONTEXT_IS_DESTROYED) LEAVE(r);
    x->h.dead = 1;
    x->graph->execs--;
    LEAVE(r);
}

/* Destroys a graph (no context needed: a graph is no context's object); its executable
 * graphs keep their nodes. */
static CUresult cuGraphDestroy(void *hg) {
    ENTER();
    CUresult r;
    Graph *g = (Graph *)lookup(hg, KIND_GRAPH, "cuGraphDestroy", &r);
    if (g == NULL) LEAVE(r);
    if (g->capture && g->capture->status != CAP_ENDED) {
        /* "All operations other than destroy and node removal are permitted on the graph
         * while the capture sequence is in progress" */
        violation("cuGraphDestroy of a graph still being captured into");
        LEAVE(INVALID_VALUE);
    }
    g->h.dead = 1;
    retire_graph_memory(g);
    LEAVE(OK);
}

/* A graph's nodes: their count in ``*count`` when ``nodes`` is NULL; else up to ``*count``
 * of them (the rest NULL), and how many in ``*count``. */
static CUresult cuGraphGetNodes(void *hg, void **nodes, size_t *count) {
    ENTER();
    CUresult r;
    Graph *g = (Graph *)lookup(hg, KIND_GRAPH, "cuGraphGetNodes", &r);
    if (g == NULL) LEAVE(r);
    if (count == NULL) LEAVE(INVALID_VALUE);
    if (nodes == NULL) {
        *count = (size_t)g->nnodes;
        LEAVE(OK);
    }
    size_t got = 0;
    for (size_t i = 0; i < *count; i++) {
        nodes[i] = i < (size_t)g->nnodes ? g->nodes[i] : NULL;
        if (i < (size_t)g->nnodes) got++;
    }
    *count = got;
    LEAVE(OK);
}

/* ------------------------------------------------------------------ test hooks */

/* Built with -DFAKE_CUDA_NO_HOOKS, the hooks are not exported: a process sees the driver API
 * only, as on a GPU (the exit report stays: it is no hook). */
#ifdef FAKE_CUDA_NO_HOOKS
#define HOOK static __attribute__((unused))
#else
#define HOOK
#endif

/* The next kernel launched fails with ``code`` when it completes (a sticky error). */
HOOK void fake_cuda_fail_next_launch(int code) {
    pthread_mutex_lock(&lock);
    fail_next_code = code;
    pthread_mutex_unlock(&lock);
}

/* The ``nth`` next call of the entry point ``name``, from any thread, returns ``code`` and
 * does nothing else (at most 8 at once). Every entry point but cuInit, cuDriverGetVersion,
 * cuGetErrorName, cuGetErrorString and cuGetProcAddress can be made to fail. */
HOOK int fake_cuda_fail_call(const char *name, long nth, int code) {
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
HOOK void fake_cuda_clear_error(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAXDEV; i++) ctxs[i].sticky = OK;
    fail_next_code = 0;
    memset(failpoints, 0, sizeof failpoints);
    pthread_cond_broadcast(&progress);
    pthread_mutex_unlock(&lock);
}

/* Live handles of a kind: 0 streams, 1 events, 2 contexts, 3 pinned host buffers, 4 device
 * buffers, 5 modules. */
HOOK long fake_cuda_live(int kind) {
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
HOOK long fake_cuda_host_calls(void) {
    pthread_mutex_lock(&lock);
    long n = host_calls;
    pthread_mutex_unlock(&lock);
    return n;
}

HOOK long fake_cuda_host_calls_python(void) {
    pthread_mutex_lock(&lock);
    long n = host_calls_python;
    pthread_mutex_unlock(&lock);
    return n;
}

HOOK long fake_cuda_violations(void) {
    pthread_mutex_lock(&lock);
    long n = violations;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The violations so far (the last 16 described in ``buf``), forgotten: for tests that
 * provoke one on purpose. Returns how many there were. */
HOOK long fake_cuda_take_violations(char *buf, size_t size) {
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
HOOK int fake_cuda_context_refs(int dev) {
    pthread_mutex_lock(&lock);
    int n = (dev >= 0 && dev < MAXDEV) ? ctxs[dev].refs : -1;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Handles leaked at context resets so far; the count starts again from zero. */
HOOK long fake_cuda_take_leaks(void) {
    pthread_mutex_lock(&lock);
    long n = leaks;
    leaks = 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Relax one rule (context, portable, python-host-fn, exit) or restore it. */
HOOK void fake_cuda_relax(const char *rule, int on) {
    pthread_mutex_lock(&lock);
    unsigned bit = parse_relax(rule);
    relaxed = on ? (relaxed | bit) : (relaxed & ~bit);
    pthread_mutex_unlock(&lock);
}

/* Another library takes (1) or gives back (0) a reference to a device's primary context. */
HOOK int fake_cuda_hold_primary(int dev, int hold) {
    void *ctx;
    return hold ? cuDevicePrimaryCtxRetain(&ctx, dev) : cuDevicePrimaryCtxRelease(dev);
}

/* A kernel that reads [p, p + n) on a stream when it runs, ``ns`` long: a user's kernel
 * using memory, for tests of when memory may be freed or reused. ``hs`` NULL: the default
 * stream of device ``dev``. On a capturing stream it is a kernel node, as cuLaunchKernel's. */
HOOK int fake_cuda_touch(int dev, void *hs, CUdeviceptr p, size_t n, uint64_t ns) {
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
    if ((r = stream_use("fake_cuda_touch", s)) != OK) {
        pthread_mutex_unlock(&lock);
        return r;
    }
    if (s->cap) {  /* a kernel node */
        add_node(s, OP_TOUCH, ns)->bsrc = b;
        pthread_mutex_unlock(&lock);
        return OK;
    }
    Op *op = submit(s, OP_TOUCH, ns);
    op->bsrc = b;
    use_blocks(op);
    pthread_mutex_unlock(&lock);
    return OK;
}

/* The grid (x, y, z), block (x, y, z) and dynamic shared memory of the last kernel launch
 * that passed the launch checks, into out[7]. */
HOOK void fake_cuda_last_launch(unsigned *out) {
    pthread_mutex_lock(&lock);
    memcpy(out, last_launch, sizeof last_launch);
    pthread_mutex_unlock(&lock);
}

/* The priority the driver recorded for a stream (-100 for a bad handle). */
HOOK int fake_cuda_stream_priority(void *hs) {
    pthread_mutex_lock(&lock);
    int p = -100;
    if (known(hs) && ((Obj *)hs)->kind == KIND_STREAM) p = ((Stream *)hs)->priority;
    pthread_mutex_unlock(&lock);
    return p;
}

/* The flags an event was created with (CU_EVENT_*; -1 for a bad handle). */
HOOK int fake_cuda_event_flags(void *he) {
    pthread_mutex_lock(&lock);
    int f = -1;
    if (known(he) && ((Obj *)he)->kind == KIND_EVENT) f = (int)((Event *)he)->flags;
    pthread_mutex_unlock(&lock);
    return f;
}

/* Operations submitted and not completed yet (held ones included). */
HOOK long fake_cuda_pending(void) {
    pthread_mutex_lock(&lock);
    long n = (long)nheap + held_real;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Make each host function launched from now on run ``ns`` after the work before it (a driver
 * thread that is slow to get to it). */
HOOK void fake_cuda_host_fn_delay(uint64_t ns) {
    pthread_mutex_lock(&lock);
    host_fn_ns = ns;
    pthread_mutex_unlock(&lock);
}

/* Make each stream memory write (cuStreamWriteValue32) submitted from now on land ``ns`` after
 * the work before it (a device slow to get to it): the stream stays busy that long. */
HOOK void fake_cuda_write_delay(uint64_t ns) {
    pthread_mutex_lock(&lock);
    write_ns = ns;
    pthread_mutex_unlock(&lock);
}

/* Make the driver's thread take ``ns`` to return from each host function before the stream
 * goes on (what comes after a host function lands that much after the function ran). */
HOOK void fake_cuda_host_fn_return_delay(uint64_t ns) {
    pthread_mutex_lock(&lock);
    host_fn_return_ns = ns;
    pthread_mutex_unlock(&lock);
}

/* Bring forward to now every pending operation due later but no later than ``limit``, in
 * submission order, with the streams' tails and the events' completion times; held work may
 * start as early, but still waits for the memory wait that holds it. */
static int by_due(const void *a, const void *b) {
    const Op *x = *(Op *const *)a, *y = *(Op *const *)b;
    return before(x, y) ? -1 : before(y, x) ? 1 : 0;
}

static void hurry_until(uint64_t n, uint64_t limit) {
    for (size_t i = 0; i < nheap; i++) {
        if (heap[i]->due > n && heap[i]->due <= limit) heap[i]->due = n;
    }
    qsort(heap, nheap, sizeof *heap, by_due);  /* a sorted array is a heap */
    for (size_t i = 0; i < nheld; i++) {  /* held work starts no later than it now may */
        if (held_ops[i]->start > n && held_ops[i]->start <= limit) held_ops[i]->start = n;
    }
    next_poll = 0;
    for (size_t i = 0; i < nobjects; i++) {
        Obj *o = objects[i];
        if (o->kind == KIND_STREAM) {
            Stream *s = (Stream *)o;
            if (s->tail > n && s->tail <= limit) s->tail = n;
        }
        if (o->kind == KIND_EVENT) {
            Event *e = (Event *)o;
            if (e->due > n && e->due <= limit) e->due = n;
        }
        if (o->kind == KIND_EXEC) {  /* its next launch is ordered after the last */
            Exec *x = (Exec *)o;
            if (x->tail > n && x->tail <= limit) x->tail = n;
        }
    }
    pthread_cond_signal(&work);
}

/* Bring every pending operation due later forward to now: a test ends the "kernel that never
 * ends" it launched, so that later tests of the process (which share the primary contexts) do
 * not wait behind it. */
HOOK void fake_cuda_hurry(void) {
    pthread_mutex_lock(&lock);
    hurry_until(now_ns(), UINT64_MAX);
    pthread_mutex_unlock(&lock);
}

/* The same for the operations due within ``ns`` from now only: a test ends a long kernel it
 * launched when it chooses, while what it made later (a host function run late with
 * fake_cuda_host_fn_delay) stays late. */
HOOK void fake_cuda_hurry_within(uint64_t ns) {
    pthread_mutex_lock(&lock);
    uint64_t n = now_ns();
    hurry_until(n, n + ns);
    pthread_mutex_unlock(&lock);
}

/* The device whose context is current on the calling thread (-1: none). */
HOOK int fake_cuda_current_device(void) {
    Ctx *c = current();
    return c ? c->dev : -1;
}

/* Capture sequences invalidated so far (by a prohibited call, a breach of the capture rules, or
 * an unjoined end); the count starts again from zero. */
HOOK long fake_cuda_captures_invalidated(void) {
    pthread_mutex_lock(&lock);
    long n = captures_invalidated;
    captures_invalidated = 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Nodes of graph launches completed so far (each launch runs each node once); the count
 * starts again from zero. */
HOOK long fake_cuda_graph_nodes_run(void) {
    pthread_mutex_lock(&lock);
    long n = graph_nodes_run;
    graph_nodes_run = 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Capture sequences begun and not ended yet (active or invalidated), in every thread. */
HOOK long fake_cuda_open_captures(void) {
    pthread_mutex_lock(&lock);
    long n = open_captures;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Live graphs (``execs`` 0) or executable graphs (1): not destroyed, in a live context. */
HOOK long fake_cuda_graphs_live(int execs) {
    pthread_mutex_lock(&lock);
    long n = 0;
    int kind = execs ? KIND_EXEC : KIND_GRAPH;
    for (size_t i = 0; i < nobjects; i++) n += objects[i]->kind == kind && is_live(objects[i]);
    pthread_mutex_unlock(&lock);
    return n;
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
    long live[NKINDS] = {0}, total = 0;
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
        for (int k = 0; k < NKINDS; k++) if (live[k]) fprintf(stderr, ", %ld %s", live[k], kind_names[k]);
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
    {"cuMemGetAddressRange", 3020, (void *)cuMemGetAddressRange},
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
    {"cuStreamWriteValue64", 11070, (void *)cuStreamWriteValue64},
    {"cuStreamWaitValue32", 11070, (void *)cuStreamWaitValue32},
    {"cuStreamWaitValue64", 11070, (void *)cuStreamWaitValue64},
    {"cuMemAllocHost", 3020, (void *)cuMemAllocHost},
    {"cuStreamBeginCapture", 10010, (void *)cuStreamBeginCapture},
    {"cuStreamEndCapture", 10000, (void *)cuStreamEndCapture},
    {"cuStreamIsCapturing", 10000, (void *)cuStreamIsCapturing},
    {"cuStreamGetCaptureInfo", 11030, (void *)cuStreamGetCaptureInfo_v2},
    {"cuStreamGetCaptureInfo", 12030, (void *)cuStreamGetCaptureInfo},
    {"cuThreadExchangeStreamCaptureMode", 10010, (void *)cuThreadExchangeStreamCaptureMode},
    {"cuGraphInstantiateWithFlags", 11040, (void *)cuGraphInstantiateWithFlags},
    {"cuGraphLaunch", 10000, (void *)cuGraphLaunch},
    {"cuGraphExecDestroy", 10000, (void *)cuGraphExecDestroy},
    {"cuGraphDestroy", 10000, (void *)cuGraphDestroy},
    {"cuGraphGetNodes", 10000, (void *)cuGraphGetNodes},
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

CUresult cuStreamWriteValue32_v2(void *hs, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return cuStreamWriteValue32(hs, addr, value, flags);
}

CUresult cuStreamWriteValue64_v2(void *hs, CUdeviceptr addr, uint64_t value, unsigned flags) {
    return cuStreamWriteValue64(hs, addr, value, flags);
}

CUresult cuStreamWaitValue32_v2(void *hs, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return cuStreamWaitValue32(hs, addr, value, flags);
}

CUresult cuStreamWaitValue64_v2(void *hs, CUdeviceptr addr, uint64_t value, unsigned flags) {
    return cuStreamWaitValue64(hs, addr, value, flags);
}
