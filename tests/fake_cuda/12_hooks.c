/* The stand-in CUDA driver, part 12 of 13: test hooks.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
