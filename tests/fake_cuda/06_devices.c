/* The stand-in CUDA driver, part 6 of 13: init and devices.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

/* ------------------------------------------------------------------ init and devices */

static unsigned parse_relax(const char *s) {
    unsigned r = 0;
    if (s == NULL) return 0;
    if (strstr(s, "context")) r |= RELAX_CONTEXT;
    if (strstr(s, "portable")) r |= RELAX_PORTABLE;
    if (strstr(s, "python-host-fn")) r |= RELAX_PYTHON_HOST_FN;
    if (strstr(s, "exit")) r |= RELAX_EXIT;
    if (strstr(s, "capture")) r |= RELAX_CAPTURE;
    return r;
}

static CUresult cuInit(unsigned flags) {
    (void)flags;
    if (getenv("FAKE_CUDA_STUB") && atoi(getenv("FAKE_CUDA_STUB"))) return STUB_LIBRARY;
    pthread_mutex_lock(&lock);
    const char *n = getenv("FAKE_CUDA_DEVICES");
    ndevices = n ? atoi(n) : 1;
    if (ndevices > MAXDEV) ndevices = MAXDEV;
    no_pools = getenv("FAKE_CUDA_NO_POOLS") && atoi(getenv("FAKE_CUDA_NO_POOLS"));
    if (getenv("FAKE_CUDA_ALLOC_NS")) alloc_ns = strtoull(getenv("FAKE_CUDA_ALLOC_NS"), 0, 10);
    relaxed |= parse_relax(getenv("FAKE_CUDA_RELAX"));
    for (int i = 0; i < MAXDEV; i++) ctxs[i].dev = i;
    if (ndevices > 0) initialized = 1;
    pthread_mutex_unlock(&lock);
    return ndevices <= 0 ? NO_DEVICE : OK;
}

static CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }

static CUresult cuDeviceGetCount(int *count) {
    FAIL_IF_ASKED();
    if (!initialized) return NOT_INITIALIZED;
    *count = ndevices;
    return OK;
}

static CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    FAIL_IF_ASKED();
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= ndevices) return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

static CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    FAIL_IF_ASKED();
    if (dev < 0 || dev >= ndevices) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "aiostream fake GPU %d", dev);
    return OK;
}

static CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    FAIL_IF_ASKED();
    if (dev < 0 || dev >= ndevices) return INVALID_DEVICE;
    switch (attribute) {
    case ATTR_MEMORY_POOLS_SUPPORTED: *value = !no_pools; break;
    case ATTR_CAN_MAP_HOST_MEMORY:
    case ATTR_UNIFIED_ADDRESSING:  /* a mapped host pointer is its device pointer */
    case ATTR_CAN_USE_STREAM_MEM_OPS_V1:
    case ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS_V1:
    case ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V1:
    case ATTR_CAN_FLUSH_REMOTE_WRITES:
    case ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS:
    case ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR: *value = 1; break;
    default: *value = 0;
    }
    return OK;
}

static const char *error_name(CUresult r) {
    switch (r) {
    case OK: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
    case NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CONTEXT_IS_DESTROYED: return "CUDA_ERROR_CONTEXT_IS_DESTROYED";
    case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
    case CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CAPTURE_MERGE: return "CUDA_ERROR_STREAM_CAPTURE_MERGE";
    case CAPTURE_UNMATCHED: return "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED";
    case CAPTURE_UNJOINED: return "CUDA_ERROR_STREAM_CAPTURE_UNJOINED";
    case CAPTURE_ISOLATION: return "CUDA_ERROR_STREAM_CAPTURE_ISOLATION";
    case CAPTURE_IMPLICIT: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case CAPTURED_EVENT: return "CUDA_ERROR_CAPTURED_EVENT";
    case CAPTURE_WRONG_THREAD: return "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD";
    case OPERATING_SYSTEM: return "CUDA_ERROR_OPERATING_SYSTEM";
    case GRAPH_EXEC_UPDATE_FAILURE: return "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE";
    case UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
    }
}

static CUresult cuGetErrorName(CUresult r, const char **out) {
    *out = error_name(r);
    return *out ? OK : INVALID_VALUE;
}

static CUresult cuGetErrorString(CUresult r, const char **out) {
    switch (r) {
    case INVALID_HANDLE: *out = "invalid resource handle"; return OK;
    case LAUNCH_FAILED: *out = "unspecified launch failure"; return OK;
    case INVALID_VALUE: *out = "invalid argument"; return OK;
    case NOT_READY: *out = "device not ready"; return OK;
    case UNKNOWN: *out = "unknown error"; return OK;
    case INVALID_CONTEXT: *out = "invalid device context"; return OK;
    case NOT_SUPPORTED: *out = "operation not supported"; return OK;
    case ILLEGAL_STATE: *out = "the operation cannot be performed in the present state"; return OK;
    case CAPTURE_UNSUPPORTED: *out = "operation not permitted when stream is capturing"; return OK;
    case CAPTURE_INVALIDATED: *out = "operation failed due to a previous error during capture";
        return OK;
    case CAPTURE_MERGE: *out = "operation would result in a merge of separate capture sequences";
        return OK;
    case CAPTURE_UNMATCHED: *out = "capture was not ended in the same stream as it began";
        return OK;
    case CAPTURE_UNJOINED: *out = "capturing stream has unjoined work"; return OK;
    case CAPTURE_ISOLATION: *out = "dependency created on uncaptured work in another stream";
        return OK;
    case CAPTURE_IMPLICIT: *out = "operation would make the legacy stream depend on a capturing "
                                  "blocking stream"; return OK;
    case CAPTURED_EVENT: *out = "operation not permitted on an event last recorded in a "
                                "capturing stream"; return OK;
    case CAPTURE_WRONG_THREAD: *out = "attempt to terminate a thread-local capture sequence from "
                                      "another thread"; return OK;
    case OPERATING_SYSTEM: *out = "OS call failed or operation not supported on this OS";
        return OK;
    case GRAPH_EXEC_UPDATE_FAILURE: *out = "the graph update was not performed because it "
                                           "included changes which violated constraints "
                                           "specific to instantiated graph update"; return OK;
    default: *out = error_name(r); return *out ? OK : INVALID_VALUE;
    }
}
