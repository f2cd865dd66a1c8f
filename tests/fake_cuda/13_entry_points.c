/* The stand-in CUDA driver, part 13 of 13: entry point lookup.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

/* ------------------------------------------------------------------ entry point lookup */

typedef struct { const char *name; int version; void *fn; } EntryPoint;

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status);

static const EntryPoint entries[] = {
    {"cuInit", 2000, (void *)cuInit},
    {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion},
    {"cuGetErrorName", 6000, (void *)cuGetErrorName},
    {"cuGetErrorString", 6000, (void *)cuGetErrorString},
    {"cuDeviceGet", 2000, (void *)cuDeviceGet},
    {"cuDeviceGetCount", 2000, (void *)cuDeviceGetCount},
    {"cuDeviceGetName", 2000, (void *)cuDeviceGetName},
    {"cuDeviceGetAttribute", 2000, (void *)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)cuDevicePrimaryCtxRelease},
    {"cuCtxSetCurrent", 4000, (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", 4000, (void *)cuCtxGetCurrent},
    {"cuCtxPushCurrent", 4000, (void *)cuCtxPushCurrent},
    {"cuCtxPopCurrent", 4000, (void *)cuCtxPopCurrent},
    {"cuCtxGetStreamPriorityRange", 5050, (void *)cuCtxGetStreamPriorityRange},
    {"cuCtxSynchronize", 2000, (void *)cuCtxSynchronize},
    {"cuStreamCreate", 2000, (void *)cuStreamCreate},
    {"cuStreamCreateWithPriority", 5050, (void *)cuStreamCreateWithPriority},
    {"cuStreamGetPriority", 5050, (void *)cuStreamGetPriority},
    {"cuStreamDestroy", 4000, (void *)cuStreamDestroy},
    {"cuStreamQuery", 2000, (void *)cuStreamQuery},
    {"cuStreamSynchronize", 2000, (void *)cuStreamSynchronize},
    {"cuStreamWaitEvent", 3020, (void *)cuStreamWaitEvent},
    {"cuEventCreate", 2000, (void *)cuEventCreate},
    {"cuEventDestroy", 4000, (void *)cuEventDestroy},
    {"cuEventRecord", 2000, (void *)cuEventRecord},
    {"cuEventQuery", 2000, (void *)cuEventQuery},
    {"cuEventSynchronize", 2000, (void *)cuEventSynchronize},
    {"cuEventElapsedTime", 12080, (void *)cuEventElapsedTime},
    {"cuIpcGetEventHandle", 4010, (void *)cuIpcGetEventHandle},
    {"cuIpcOpenEventHandle", 4010, (void *)cuIpcOpenEventHandle},
    {"cuIpcGetMemHandle", 4010, (void *)cuIpcGetMemHandle},
    {"cuIpcOpenMemHandle", 11000, (void *)cuIpcOpenMemHandle},
    {"cuIpcCloseMemHandle", 4010, (void *)cuIpcCloseMemHandle},
    {"cuMemGetAddressRange", 3020, (void *)cuMemGetAddressRange},
    {"cuModuleLoadData", 2000, (void *)cuModuleLoadData},
    {"cuModuleUnload", 2000, (void *)cuModuleUnload},
    {"cuModuleGetFunction", 2000, (void *)cuModuleGetFunction},
    {"cuLaunchKernel", 4000, (void *)cuLaunchKernel},
    {"cuLaunchHostFunc", 10000, (void *)cuLaunchHostFunc},
    {"cuMemHostAlloc", 2020, (void *)cuMemHostAlloc},
    {"cuMemFreeHost", 2000, (void *)cuMemFreeHost},
    {"cuMemAlloc", 3020, (void *)cuMemAlloc},
    {"cuMemFree", 3020, (void *)cuMemFree},
    {"cuMemAllocAsync", 11020, (void *)cuMemAllocAsync},
    {"cuMemFreeAsync", 11020, (void *)cuMemFreeAsync},
    {"cuMemcpyHtoDAsync", 3020, (void *)cuMemcpyHtoDAsync},
    {"cuMemcpyDtoHAsync", 3020, (void *)cuMemcpyDtoHAsync},
    {"cuMemcpyDtoDAsync", 3020, (void *)cuMemcpyDtoDAsync},
    {"cuMemHostGetDevicePointer", 3020, (void *)cuMemHostGetDevicePointer},
    {"cuStreamWriteValue32", 11070, (void *)cuStreamWriteValue32},
    {"cuStreamWriteValue64", 11070, (void *)cuStreamWriteValue64},
    {"cuStreamWaitValue32", 11070, (void *)cuStreamWaitValue32},
    {"cuStreamWaitValue64", 11070, (void *)cuStreamWaitValue64},
    {"cuMemAllocHost", 3020, (void *)cuMemAllocHost},
    {"cuStreamBeginCapture", 10010, (void *)cuStreamBeginCapture},
    {"cuStreamEndCapture", 10000, (void *)cuStreamEndCapture},
    {"cuStreamIsCapturing", 10000, (void *)cuStreamIsCapturing},
    {"cuStreamGetCaptureInfo", 11030, (void *)cuStreamGetCaptureInfo_v2},
    {"cuStreamGetCaptureInfo", 12030, (void *)cuStreamGetCaptureInfo},
    {"cuThreadExchangeStreamCaptureMode", 10010, (void *)cuThreadExchangeStreamCaptureMode},
    {"cuGraphInstantiateWithFlags", 11040, (void *)cuGraphInstantiateWithFlags},
    {"cuGraphLaunch", 10000, (void *)cuGraphLaunch},
    {"cuGraphExecDestroy", 10000, (void *)cuGraphExecDestroy},
    {"cuGraphDestroy", 10000, (void *)cuGraphDestroy},
    {"cuGraphGetNodes", 10000, (void *)cuGraphGetNodes},
    {"cuGraphExecUpdate", 12000, (void *)cuGraphExecUpdate_v2},
    {"cuGraphDebugDotPrint", 11030, (void *)cuGraphDebugDotPrint},
    {"cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status) {
    (void)flags;
    int found = 0;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        if (strcmp(entries[i].name, symbol) != 0) continue;
        found = 1;
        if (entries[i].version == version) {
            *pfn = entries[i].fn;
            if (status) *status = 0;
            return OK;
        }
    }
    if (getenv("FAKE_CUDA_TRACE")) fprintf(stderr, "fake_cuda: no %s v%d\n", symbol, version);
    *pfn = NULL;
    if (status) *status = found ? 2 : 1;  /* VERSION_NOT_SUFFICIENT or SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}

/* Exported under their own names too, for anything that looks them up with dlsym. */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

CUresult cuStreamWriteValue32_v2(void *hs, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return cuStreamWriteValue32(hs, addr, value, flags);
}

CUresult cuStreamWriteValue64_v2(void *hs, CUdeviceptr addr, uint64_t value, unsigned flags) {
    return cuStreamWriteValue64(hs, addr, value, flags);
}

CUresult cuStreamWaitValue32_v2(void *hs, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return cuStreamWaitValue32(hs, addr, value, flags);
}

CUresult cuStreamWaitValue64_v2(void *hs, CUdeviceptr addr, uint64_t value, unsigned flags) {
    return cuStreamWaitValue64(hs, addr, value, flags);
}
