/* The stand-in CUDA driver, part 8 of 13: events.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
