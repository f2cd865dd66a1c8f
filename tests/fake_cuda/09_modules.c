/* The stand-in CUDA driver, part 9 of 13: modules and kernels.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

/* ------------------------------------------------------------------ modules and kernels */

static CUresult cuModuleLoadData(void **out, const void *image) {
    ENTER();
    CUresult r = need_context("cuModuleLoadData", NULL);
    if (r != OK) LEAVE(r);
    if ((r = implicit_sync(current())) != OK) LEAVE(r);  /* as an H100 does (04_engine.c) */
    /* the kernels it runs: the sleep kernel, and a kernel that traps (`trap;`), which fails
     * on the device as a GPU's does: CUDA_ERROR_LAUNCH_FAILED, sticky, when it runs */
    int sleep = strstr((const char *)image, ".entry aiostream_sleep") != NULL;
    int trap = strstr((const char *)image, ".entry aiostream_trap") != NULL;
    if (!sleep && !trap) LEAVE(INVALID_IMAGE);
    Module *m = new_object(sizeof(Module), KIND_MODULE, current());
    m->sleep = sleep;
    m->trap = trap;
    *out = m;
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
    int trap = m->trap && strcmp(name, "aiostream_trap") == 0;
    if (!trap && !(m->sleep && strcmp(name, "aiostream_sleep") == 0)) LEAVE(NOT_FOUND);
    Function *f = new_object(sizeof *f, KIND_FUNCTION, m->h.ctx);
    f->module = m;
    f->trap = trap;
    *out = f;
    LEAVE(OK);
}

static unsigned last_launch[7];  /* grid x, y, z, block x, y, z, shared bytes */

/* Runs the sleep kernel (its one parameter is the duration in nanoseconds) or the trap
 * kernel (no parameter: it fails at once, as `trap;` does). */
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
    if (params == NULL && !f->trap) LEAVE(INVALID_VALUE);
    if ((r = stream_use("cuLaunchKernel", s)) != OK) LEAVE(r);
    uint64_t ns = f->trap ? 0 : *(uint64_t *)params[0];
    if (s->cap) {  /* a kernel node: its parameters are read now (a trap node never fails) */
        add_node(s, OP_KERNEL, ns);
        LEAVE(OK);
    }
    Op *op = submit(s, OP_KERNEL, ns);
    op->module = f->module;
    f->module->running++;
    op->fail = f->trap ? LAUNCH_FAILED : fail_next_code;
    if (!f->trap) fail_next_code = 0;
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
