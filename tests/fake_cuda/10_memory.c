/* The stand-in CUDA driver, part 10 of 13: memory.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

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
    if (!b->pooled) {  /* it waits for the device's work, as a GPU's does (04_engine.c) */
        Ctx *c = b->h.ctx;
        unsigned gen = c->gen;
        implicit_sync(c);  /* a failed context's error aside: the memory is freed all the same */
        if (c->gen != gen) LEAVE(CONTEXT_IS_DESTROYED);  /* reset meanwhile: freed with it */
        if (b->freed || !is_live(&b->h)) {
            violation("cuMemFree of device memory %#llx freed meanwhile by another thread", p);
            LEAVE(INVALID_VALUE);
        }
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
 * ``width``. A write stores ``value`` when the stream reaches it, after the effects of the
 * work before it (its flags are 0: the v2 API has no NO_MEMORY_BARRIER); a wait holds the stream's later work until
 * its condition holds (see "the driver's thread"). In a capture either is a memory operation
 * node, acting at each launch. */
static CUresult memop(const char *call, void *hs, CUdeviceptr addr, uint64_t value, int width,
                      unsigned flags, int kind) {
    pthread_mutex_lock(&lock);
    CUresult r = failpoint(call);
    if (r != OK) LEAVE(r);
    /* the reference: CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (1) "is not supported in the
     * v2 API", the one cuda-python calls; an H100 (driver 580.159.04) answered it
     * CUDA_ERROR_INVALID_VALUE */
    if (kind == OP_WRITE && flags != 0) {
        violation("%s with flags %#x: the v2 API takes CU_STREAM_WRITE_VALUE_DEFAULT (0) only",
                  call, flags);
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
