/* The stand-in CUDA driver, part 11 of 13: capture and graphs (their update and DOT too).
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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

/* ------------------------------------------------------------------ update and description */

/* CUgraphNodeType's name of a node of ``kind``, as cuGraphDebugDotPrint writes it. */
static const char *node_type_name(int kind) {
    switch (kind) {
    case OP_KERNEL:
    case OP_TOUCH: return "KERNEL";
    case OP_COPY: return "MEMCPY";
    case OP_HOSTFN: return "HOST";
    case OP_WRITE:
    case OP_WAITVAL: return "BATCH_MEM_OP";
    case OP_ALLOC: return "MEM_ALLOC";
    case OP_FREE: return "MEM_FREE";
    default: return "WAIT_EVENT";  /* OP_WAIT: an external event wait */
    }
}

/* CUgraphExecUpdateResult */
enum { UPDATE_SUCCESS = 0, UPDATE_ERROR = 1, UPDATE_TOPOLOGY_CHANGED = 2,
       UPDATE_NODE_TYPE_CHANGED = 3, UPDATE_PARAMETERS_CHANGED = 5, UPDATE_NOT_SUPPORTED = 6 };

typedef struct { int result; void *errorNode; void *errorFromNode; } UpdateResultInfo;

static int host_side(const Block *b) { return b == NULL ? -1 : b->host; }

/* Why node ``mine`` of an executable graph cannot take the parameters of ``theirs``, its pair
 * in the graph given (UPDATE_SUCCESS if it can), checked after the topology. */
static int node_update(const Node *mine, const Node *theirs) {
    if (strcmp(node_type_name(mine->kind), node_type_name(theirs->kind)) != 0) {
        return UPDATE_NODE_TYPE_CHANGED;
    }
    switch (theirs->kind) {
    case OP_ALLOC:
    case OP_FREE:
        /* the reference lists no rule for memory nodes; the least forgiving reading: "something
         * about a node is unsupported, like the node's type" */
        return UPDATE_NOT_SUPPORTED;
    case OP_COPY:
        /* "Changing either the source or destination memory type ... is not supported", and
         * "the CUDA device(s) to which the operand(s) was allocated/mapped cannot change" */
        if (host_side(mine->bsrc) != host_side(theirs->bsrc) ||
            host_side(mine->bdst) != host_side(theirs->bdst)) {
            return UPDATE_PARAMETERS_CHANGED;
        }
        if ((mine->bsrc && theirs->bsrc && mine->bsrc->h.ctx != theirs->bsrc->h.ctx) ||
            (mine->bdst && theirs->bdst && mine->bdst->h.ctx != theirs->bdst->h.ctx)) {
            return UPDATE_PARAMETERS_CHANGED;
        }
        return UPDATE_SUCCESS;
    case OP_WRITE:
    case OP_WAITVAL:  /* a write cannot become a wait: the least forgiving reading */
        return mine->kind == theirs->kind && mine->width == theirs->width
                   ? UPDATE_SUCCESS : UPDATE_PARAMETERS_CHANGED;
    default:
        return UPDATE_SUCCESS;
    }
}

/* Updates the executable graph ``hx`` in place with the node parameters of ``hg``, a graph of
 * the same topology (cuGraphExecUpdate_v2; cuda-python 13's cuGraphExecUpdate). Nodes are
 * paired in capture order, their dependencies in edge order. Checked in turn, each failure
 * setting ``info`` as documented and answering CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE with the
 * executable graph unchanged: the count of nodes (TOPOLOGY_CHANGED, errorNode NULL), each
 * node's count of dependencies (TOPOLOGY_CHANGED, errorNode the node of ``hg``) and each
 * dependency (errorFromNode the dependency of ``hg``), then each node's type
 * (NODE_TYPE_CHANGED) and parameters (PARAMETERS_CHANGED, NOT_SUPPORTED). Launches already
 * enqueued run as they were: a launch takes its nodes' parameters when it is made. */
static CUresult cuGraphExecUpdate_v2(void *hx, void *hg, UpdateResultInfo *info) {
    ENTER();
    CUresult r;
    Exec *x = (Exec *)lookup(hx, KIND_EXEC, "cuGraphExecUpdate", &r);
    if (x == NULL) LEAVE(r);
    Graph *g = (Graph *)lookup(hg, KIND_GRAPH, "cuGraphExecUpdate", &r);
    if (g == NULL) LEAVE(r);
    /* the executable graph is of a context: that context must be current */
    if ((r = need_context("cuGraphExecUpdate", &x->h)) != OK) LEAVE(r);
    if (info == NULL) LEAVE(INVALID_VALUE);
    info->result = UPDATE_SUCCESS;
    info->errorNode = info->errorFromNode = NULL;
    if (g->capture && g->capture->status != CAP_ENDED) {
        violation("cuGraphExecUpdate from a graph still being captured into");
        info->result = UPDATE_ERROR;
        LEAVE(INVALID_VALUE);
    }
    if (g->h.ctx != x->h.ctx) {  /* "the owning context of the function cannot change" */
        info->result = UPDATE_ERROR;
        LEAVE(GRAPH_EXEC_UPDATE_FAILURE);
    }
    if (g->nnodes != x->nnodes) {
        info->result = UPDATE_TOPOLOGY_CHANGED;
        LEAVE(GRAPH_EXEC_UPDATE_FAILURE);
    }
    for (int i = 0; i < g->nnodes; i++) {
        Node *mine = x->nodes[i], *theirs = g->nodes[i];
        if (mine->ndeps != theirs->ndeps) {
            info->result = UPDATE_TOPOLOGY_CHANGED;
            info->errorNode = theirs;
            LEAVE(GRAPH_EXEC_UPDATE_FAILURE);
        }
        for (int d = 0; d < theirs->ndeps; d++) {
            if (mine->deps[d]->index != theirs->deps[d]->index) {
                info->result = UPDATE_TOPOLOGY_CHANGED;
                info->errorNode = theirs;
                info->errorFromNode = theirs->deps[d];
                LEAVE(GRAPH_EXEC_UPDATE_FAILURE);
            }
        }
    }
    for (int i = 0; i < g->nnodes; i++) {
        int result = node_update(x->nodes[i], g->nodes[i]);
        if (result != UPDATE_SUCCESS) {
            info->result = result;
            info->errorNode = g->nodes[i];
            LEAVE(GRAPH_EXEC_UPDATE_FAILURE);
        }
    }
    if (g->nnodes) memcpy(x->nodes, g->nodes, (size_t)g->nnodes * sizeof *x->nodes);
    LEAVE(OK);
}

enum { DOT_FLAGS_VERBOSE = 1, DOT_FLAGS_ALL = (1 << 16) - 1 };  /* CUgraphDebugDot_flags */

/* Writes a DOT description of ``hg`` to ``path``: a digraph with a cluster for the graph, a
 * node per graph node (its index and type, a copy's direction; VERBOSE: its duration and
 * handle too) and an edge per dependency. A graph is no context's object: no context is
 * needed. A file that cannot be written: CUDA_ERROR_OPERATING_SYSTEM. */
static CUresult cuGraphDebugDotPrint(void *hg, const char *path, unsigned flags) {
    ENTER();
    CUresult r;
    Graph *g = (Graph *)lookup(hg, KIND_GRAPH, "cuGraphDebugDotPrint", &r);
    if (g == NULL) LEAVE(r);
    if (path == NULL) LEAVE(INVALID_VALUE);
    if (flags & ~(unsigned)DOT_FLAGS_ALL) {
        violation("cuGraphDebugDotPrint with flags %#x: no CUgraphDebugDot_flags", flags);
        LEAVE(INVALID_VALUE);
    }
    FILE *f = fopen(path, "w");
    if (f == NULL) LEAVE(OPERATING_SYSTEM);
    void *id = g;
    fprintf(f, "digraph dot {\nsubgraph cluster_%p {\n", id);
    fprintf(f, "label=\"graph_%p\" graph[style=\"dashed\"];\n", id);
    for (int i = 0; i < g->nnodes; i++) {
        Node *node = g->nodes[i];
        fprintf(f, "\"graph_%p_node_%d\"[style=\"solid\" shape=\"rectangle\" ", id, i);
        fprintf(f, "label=\"%d\\n%s", i, node_type_name(node->kind));
        if (node->kind == OP_COPY) {
            fprintf(f, "\\n%cto%c", host_side(node->bsrc) == 1 ? 'H' : 'D',
                    host_side(node->bdst) == 1 ? 'H' : 'D');
        }
        if (flags & DOT_FLAGS_VERBOSE) {
            fprintf(f, "\\nduration %llu ns\\nnode %p", (unsigned long long)node->ns,
                    (void *)node);
        }
        fprintf(f, "\"];\n");
    }
    for (int i = 0; i < g->nnodes; i++) {
        for (int d = 0; d < g->nodes[i]->ndeps; d++) {
            fprintf(f, "\"graph_%p_node_%d\" -> \"graph_%p_node_%d\";\n", id,
                    g->nodes[i]->deps[d]->index, id, i);
        }
    }
    fprintf(f, "}\n}\n");
    LEAVE(fclose(f) == 0 ? OK : OPERATING_SYSTEM);
}
