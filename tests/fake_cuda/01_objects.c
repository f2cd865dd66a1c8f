/* The stand-in CUDA driver, part 1 of 13: objects.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
    int sleep, trap;  /* the entries its image has: aiostream_sleep, aiostream_trap */
} Module;
typedef struct Function { Obj h; Module *module; int trap; } Function;

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
