/* The stand-in CUDA driver, part 4 of 13: the driver's thread.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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

/* CUstreamWaitValue_flags (a write takes CU_STREAM_WRITE_VALUE_DEFAULT, 0, only) */
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
    return a->seq < b->seq;
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
            complete(op);
            free(op);
            pthread_cond_broadcast(&progress);
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

/* The implicit synchronization of a call that waits, as cuCtxSynchronize does, until all the
 * work submitted to the context's streams has completed (lock held), held work included: it
 * hangs where a GPU hangs, behind a stream memory wait nobody satisfies. Which calls:
 * - cuMemFree of memory not from a pool: the reference's cuMemFree_v2 "may perform implicit
 *   synchronization" (not for cuMemAllocAsync's memory), the programming guide's
 *   "Stream-Ordered Memory Allocator" (4.3.1) says cudaFree "causes the GPU to synchronize
 *   across all executing CUDA streams", and on an H100 (driver 580.159.04) a cuMemFree waited
 *   for the work another stream held behind a wait;
 * - cuModuleLoadData: documented nowhere, but on that H100 it blocked while a stream of its
 *   context was held by a cuStreamWaitValue32 on a word nobody had set.
 * Stream-ordered calls (cuMemAllocAsync, cuMemFreeAsync) never synchronize. */
static CUresult implicit_sync(Ctx *c) { return wait_for(&c->done, c->submitted, c, c->gen); }

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
