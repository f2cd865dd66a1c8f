/* The stand-in CUDA driver, part 7 of 13: streams.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
