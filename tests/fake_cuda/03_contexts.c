/* The stand-in CUDA driver, part 3 of 13: contexts.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
