/*
 * A stand-in for the NVIDIA driver (libcuda.so.1), for testing aiostream's CUDA backend on
 * machines without a GPU. The tests build it with the machine's C compiler and run the backend
 * against it in a subprocess whose LD_LIBRARY_PATH points at it.
 *
 * It implements, in memory on the CPU, the driver entry points the backend uses, at the
 * versions cuda-python asks for through cuGetProcAddress_v2, and it keeps the driver API's
 * documented contract, strictly by default: where the documentation says a call is invalid,
 * this driver refuses it and counts a *violation*; a test may relax one rule where it needs to.
 *
 * The contract kept:
 * - Contexts. Each device has one primary context, retained and released by count. Every call
 *   that acts on a context's objects (streams, events, modules, memory, launches, copies, host
 *   functions) needs that context current on the calling thread (a per-thread stack, as
 *   cuCtxPushCurrent/PopCurrent/SetCurrent keep it); otherwise CUDA_ERROR_INVALID_CONTEXT.
 *   cuEventRecord needs the event and the stream in one context (CUDA_ERROR_INVALID_HANDLE).
 *   Releasing the last reference resets the context: its objects are destroyed (pinned memory
 *   unmapped), and handles still alive then are counted as leaked.
 * - Work. Each operation gets a due time when it is submitted (after the earlier work of its
 *   stream, the events the stream waits for, and the operation's own duration), and one driver
 *   thread of this library's own completes operations in (due time, submission) order: a
 *   kernel at its end, a copy moving its bytes then (never at the call), an event record, a
 *   host function called on that thread. Queries and synchronizations read what that thread
 *   has completed; synchronizations sleep on a condition variable, as blocking-sync waits do.
 *   Work behind a stream memory wait that is not over is *held* (no due time yet): everything
 *   submitted to that stream after the wait (kernels, copies, records, host functions, memory
 *   operations, allocations, frees, graph launches, further waits), a record among it, and the
 *   work of every stream that waits for such a record, transitively. Held work is pending
 *   work: cuStreamQuery and cuEventQuery answer CUDA_ERROR_NOT_READY, the synchronizations
 *   block, until the wait is over; it then gets its due times from that moment.
 * - Faults. A kernel made to fail sets its context's sticky error when it completes; every
 *   later call in that context returns it, and no later operation of the context takes effect:
 *   host functions enqueued before or after it never run, copies move nothing.
 * - Memory. Pinned host memory is mmap'd and unmapped when freed, so touching it afterwards
 *   crashes, as on a GPU. A stream-ordered allocation completes after its stream's earlier work
 *   plus FAKE_CUDA_ALLOC_NS (default 1 ms); an operation on another stream that runs before
 *   the allocation completed is a violation, as is any operation on freed memory and a free of
 *   memory that pending operations still use. Pinned memory used in another context's copy
 *   needs CU_MEMHOSTALLOC_PORTABLE. Pageable host memory is staged at the call (host to
 *   device) or copied before the call returns (device to host), as the driver does.
 * - Stream memory operations (cuStreamWriteValue32/64, cuStreamWaitValue32/64, the _v2 API of
 *   the reference's "Stream Memory Operations"), on a word of 4 or 8 bytes in device memory or
 *   in pinned memory allocated with CU_MEMHOSTALLOC_DEVICEMAP (its address from
 *   cuMemHostGetDevicePointer), live and aligned to its size; the device attributes say all
 *   of them are supported (CAN_USE_STREAM_MEM_OPS_V1, CAN_USE_64_BIT_STREAM_MEM_OPS and _V1,
 *   CAN_USE_STREAM_WAIT_VALUE_NOR and _V1, CAN_FLUSH_REMOTE_WRITES, and CAN_MAP_HOST_MEMORY
 *   and UNIFIED_ADDRESSING for the mapped words). An unaligned word, a word in no such live
 *   memory, or an unknown flag: a violation (CUDA_ERROR_INVALID_VALUE). A write stores its
 *   value when the stream reaches it, after the effects of the work before it; its only flag
 *   is CU_STREAM_WRITE_VALUE_DEFAULT (0): CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (1) "is not
 *   supported in the v2 API" (the reference), which cuda-python calls, and an H100 (driver
 *   580.159.04) refused it with CUDA_ERROR_INVALID_VALUE, as this driver does. A wait holds
 *   the stream's later work until the stream has reached it and its word satisfies its
 *   condition, which the driver's thread reads every 30 us while a wait is pending (a GPU
 *   polls too): CU_STREAM_WAIT_VALUE_GEQ (0, cyclic: (int32_t)(*addr - value) >= 0, int64_t
 *   for 64 bits), EQ (1), AND (2, (*addr & value) != 0), NOR (3, ~(*addr | value) != 0), with
 *   CU_STREAM_WAIT_VALUE_FLUSH (1 << 30) or not (this driver's writes are all visible at
 *   once). A wait of a failed or reset context is over (its work is dropped), and so is one
 *   on memory freed under it (the free is the violation). The memory stays in use until the
 *   operation completes: freeing it before is a violation, as for any pending work.
 * - cuStreamWaitEvent takes flags 0, and CU_EVENT_WAIT_EXTERNAL (1) from a capturing stream
 *   only (any other use is a violation, CUDA_ERROR_INVALID_VALUE). A wait for a record not yet
 *   completed is an operation of the stream ("all operations in the stream", cuStreamQuery):
 *   the stream is busy, and cuStreamQuery answers CUDA_ERROR_NOT_READY, until the record
 *   completes.
 * - Stream capture (cuStreamBeginCapture_v2, cuStreamEndCapture, cuStreamIsCapturing,
 *   cuStreamGetCaptureInfo _v2 and _v3, cuThreadExchangeStreamCaptureMode) and graphs
 *   (cuGraphInstantiateWithFlags, which cuda-python 13's cuGraphInstantiate is, cuGraphLaunch,
 *   cuGraphExecDestroy, cuGraphDestroy, cuGraphGetNodes, cuGraphExecUpdate_v2, which
 *   cuda-python 13's cuGraphExecUpdate is, and cuGraphDebugDotPrint: 11_graphs.c), as the
 *   reference and the programming guide's "CUDA Graphs" describe them; 05_capture.c says
 *   how, and where the documentation leaves a case open this driver takes the least forgiving
 *   reading, said at that spot. Work submitted to a capturing stream (kernels, async copies between pinned
 *   or device memory, host functions, stream memory writes and waits, cuMemAllocAsync and
 *   cuMemFreeAsync, an external event wait) does not run: it is a node of the capture's graph,
 *   which runs at each cuGraphLaunch as operations of the launch stream, each due after its
 *   dependencies, the stream's earlier work and the previous launch of its executable graph; a
 *   memory wait node holds, at each launch, the nodes after it and the launch's end (what
 *   comes after the launch on its stream, and the next launch of its executable graph). Event
 *   records
 *   and waits inside a capture are edges only: a launch records no event, and an event
 *   recorded in a capture stays a captured event (also after the capture ended) until it is
 *   recorded again outside any capture. A stream joins a capture by waiting for an event
 *   recorded in it; each must be joined back into the origin (the origin waits, directly or
 *   through other streams, for an event recorded on it after its last change) before
 *   cuStreamEndCapture, else CUDA_ERROR_STREAM_CAPTURE_UNJOINED (904) and no graph. Refused,
 *   each with its code and a violation (rule "capture"), invalidating the captures it
 *   conflicts with:
 *   . the potentially unsafe calls, where the calling thread's capture interaction mode
 *     (per thread, GLOBAL to begin with) prohibits them: in GLOBAL mode while its own capture
 *     not begun RELAXED, or another thread's begun GLOBAL, has not ended (an invalidated one
 *     included); in THREAD_LOCAL mode its own only; never in RELAXED mode. They are:
 *     cuEventQuery, cuEventSynchronize, cuStreamQuery, cuStreamSynchronize, cuCtxSynchronize,
 *     cuMemAlloc, cuMemFree, cuMemHostAlloc, cuMemAllocHost, cuMemFreeHost,
 *     cuIpcOpenMemHandle, cuIpcCloseMemHandle (they map and unmap memory as an allocation
 *     does), an async copy to pageable host memory (it returns once it completed), and any
 *     use of the legacy default stream (it synchronizes implicitly). This driver has no
 *     synchronous cuMemcpy or cuMemset, no cuMemsetAsync, no cuMemHostRegister: they would
 *     be too. CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900);
 *   . in any mode, what necessarily conflicts with a capture: querying, synchronizing or
 *     destroying a capturing stream, synchronizing its context, launching a graph into it,
 *     copying pageable memory into it (900); querying, synchronizing or timing a captured
 *     event, or waiting for one from a stream outside any capture once its capture ended
 *     (CUDA_ERROR_CAPTURED_EVENT, 907); a capturing stream waiting for an event recorded
 *     outside the capture (CUDA_ERROR_STREAM_CAPTURE_ISOLATION, 905) or captured in another
 *     capture (CUDA_ERROR_STREAM_CAPTURE_MERGE, 902); work on the legacy stream while a
 *     blocking stream (not CU_STREAM_NON_BLOCKING) of its context captures
 *     (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, 906; cuStreamIsCapturing on it answers 906 without
 *     harm, as documented);
 *   . cuStreamBeginCapture on the default stream (900) or on a stream already capturing
 *     (CUDA_ERROR_ILLEGAL_STATE, 401); cuStreamEndCapture on a stream not capturing (401), on
 *     one that joined and is not the origin (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, 903), from
 *     another thread than the one that began a capture not begun RELAXED
 *     (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, 908).
 *   Once a capture is invalidated, its streams and events answer
 *   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901, no new violation) until cuStreamEndCapture,
 *   which answers 901 with a NULL graph and takes its streams out of capture. A call that
 *   invalidates another thread's capture is a violation too, whether or not the caller
 *   handled its error: every test catches a library breaking a capture. Graph memory: an
 *   allocation node allocates at each launch, a launch while the previous one's allocation
 *   is unfreed fails (CUDA_ERROR_INVALID_VALUE, unless AUTO_FREE_ON_LAUNCH), a graph with
 *   memory nodes has one executable graph at a time. cuGraphExecDestroy of a launch in
 *   flight lets it complete; a graph destroyed leaves its executable graphs whole. An
 *   executable graph launches on a stream of its own context only (a violation,
 *   CUDA_ERROR_INVALID_VALUE). A captured kernel takes no fake_cuda_fail_next_launch; the
 *   first kernel node of the next graph launch does.
 * - IPC. Events and cuMemAlloc's memory are shared across processes through memfd mappings
 *   (the other process maps /proc/<pid>/fd/<fd>). cuIpcGetMemHandle takes the base of a
 *   cuMemAlloc allocation only (not a pool's); cuIpcOpenMemHandle takes
 *   CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, opens in another process only (in the exporting one it
 *   is a violation, CUDA_ERROR_INVALID_CONTEXT), counts a second open in one context, and its
 *   memory is closed with cuIpcCloseMemHandle, not cuMemFree; cuMemGetAddressRange says the
 *   exporter's whole allocation (as for any device memory). A stream waiting for an event
 *   of another process has the calling thread wait until that process completed the record
 *   (this driver's processes share no device).
 * - Host functions must be C functions: one that is not a named symbol of a loaded library
 *   (dladdr), such as a ctypes closure that would run Python on this driver thread, is a
 *   violation (rule "python-host-fn").
 * - At exit it reports live handles, leaked handles and every violation on stderr, and the
 *   process exits with status 70 if there is any (live handles are allowed under rule "exit",
 *   and in a context with work pending at exit, or pending at its last cuStreamQuery; memory
 *   is allowed: the program may still read it, and the exit frees it with its context). Held
 *   work is pending work, at exit as at a context reset (its memory is not leaked then).
 *
 * Environment: FAKE_CUDA_DEVICES (default 1; 0 makes cuInit fail with CUDA_ERROR_NO_DEVICE),
 * FAKE_CUDA_STUB=1 (cuInit fails as the toolkit's stub library does), FAKE_CUDA_NO_POOLS=1 (no
 * memory pools: cuMemAllocAsync returns CUDA_ERROR_NOT_SUPPORTED), FAKE_CUDA_ALLOC_NS,
 * FAKE_CUDA_RELAX (comma-separated rules to relax: context, portable, python-host-fn, exit,
 * capture: the refusals and invalidations of stream capture stay, uncounted),
 * FAKE_CUDA_TRACE=1 (print symbol lookups that fail, and violations as they happen).
 *
 * Test hooks (called through ctypes) are in 12_hooks.c, each with its comment; each section of
 * the driver is a file of its own, included at the end of this one.
 * Built with -DFAKE_CUDA_NO_HOOKS they are not exported, so that a process sees the driver API
 * only, as on a GPU (python -m tests.helpers.fake_cuda --no-hooks FOLDER); the exit report
 * stays. The hurry hooks bring non-held work forward; held work waits for its memory wait.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, STUB_LIBRARY = 34,
    NO_DEVICE = 100, INVALID_DEVICE = 101, INVALID_IMAGE = 200, INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600, CONTEXT_IS_DESTROYED = 709,
    LAUNCH_FAILED = 719, NOT_SUPPORTED = 801,
    ILLEGAL_STATE = 401, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901,
    CAPTURE_MERGE = 902, CAPTURE_UNMATCHED = 903, CAPTURE_UNJOINED = 904, CAPTURE_ISOLATION = 905,
    CAPTURE_IMPLICIT = 906, CAPTURED_EVENT = 907, CAPTURE_WRONG_THREAD = 908,
    OPERATING_SYSTEM = 304, GRAPH_EXEC_UPDATE_FAILURE = 910, UNKNOWN = 999,
};
enum { EV_BLOCKING = 1, EV_DISABLE_TIMING = 2, EV_INTERPROCESS = 4 };
enum { HOST_PORTABLE = 1, HOST_DEVICEMAP = 2 };
enum { ATTR_MEMORY_POOLS_SUPPORTED = 115 };
/* CUdevice_attribute: what this driver supports of the device attributes it is asked for */
enum { ATTR_CAN_MAP_HOST_MEMORY = 19, ATTR_UNIFIED_ADDRESSING = 41,
       ATTR_CAN_USE_STREAM_MEM_OPS_V1 = 92, ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS_V1 = 93,
       ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V1 = 94, ATTR_CAN_FLUSH_REMOTE_WRITES = 98,
       ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS = 122, ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR = 123 };
enum { KIND_STREAM = 0, KIND_EVENT = 1, KIND_CONTEXT = 2, KIND_HOST = 3, KIND_DEVICE = 4,
       KIND_MODULE = 5, KIND_FUNCTION = 6, KIND_GRAPH = 7, KIND_EXEC = 8, NKINDS = 9 };
enum { RELAX_CONTEXT = 1, RELAX_PORTABLE = 2, RELAX_PYTHON_HOST_FN = 4, RELAX_EXIT = 8,
       RELAX_CAPTURE = 16 };
#define MAXDEV 8
#define MAGIC 0xC0DA5EEDu
#define COPY_LATENCY_NS 5000u
#define COPY_BYTES_PER_NS 10u  /* 10 GB/s */

static const char *kind_names[] = {"stream", "event", "context", "pinned host buffer",
                                   "device buffer", "module", "function", "graph",
                                   "executable graph"};

/* The driver, by section (one translation unit: the parts share the statics above). */
#include "01_objects.c"
#include "02_failing.c"
#include "03_contexts.c"
#include "04_engine.c"
#include "05_capture.c"
#include "06_devices.c"
#include "07_streams.c"
#include "08_events.c"
#include "09_modules.c"
#include "10_memory.c"
#include "11_graphs.c"
#include "12_hooks.c"
#include "13_entry_points.c"
