/* The stand-in CUDA driver, part 5 of 13: stream capture.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
