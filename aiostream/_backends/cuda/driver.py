"""The driver itself: loading cuda-python's bindings, and the one place where a ``CUresult``
becomes an :class:`aiostream.CudaError`."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

from ..._errors import AiostreamError, BackendUnavailableError, CudaError

__all__ = [
    "CAPTURE_CODES",
    "NOT_READY",
    "NOT_SUPPORTED",
    "SUCCESS",
    "Driver",
    "check_library",
    "load_driver",
]

logger = logging.getLogger("aiostream")

SUCCESS = 0
NOT_READY = 600
INVALID_VALUE = 1
NOT_SUPPORTED = 801
_NO_DEVICE = 100
_STUB_LIBRARY = 34

STREAM_NON_BLOCKING = 0x1
EVENT_BLOCKING_SYNC = 0x1
EVENT_DISABLE_TIMING = 0x2
EVENT_INTERPROCESS = 0x4
#: pinned host memory that every context treats as pinned (a HostBuffer of one device may be
#: copied on another's streams)
MEMHOSTALLOC_PORTABLE = 0x1
ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115
#: the flags of the internal events that waits block on: a blocked thread sleeps in the driver
MARKER_FLAGS = EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING
#: CU_STREAM_CAPTURE_MODE_RELAXED: the capture interaction mode of aiostream's driver calls
CAPTURE_MODE_RELAXED = 2
#: the results that say a call met a stream capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
#: to CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD): never a device failure
CAPTURE_CODES = frozenset(range(900, 909))

#: per thread: how many relax() calls are open, and the capture mode to give back at the last
_here = threading.local()


def _no_driver_library() -> str | None:
    """Why the driver's library cannot be loaded, found without the bindings: a dlopen takes
    microseconds where importing the bindings takes tens of milliseconds, which a program
    without a GPU would pay on its first use of the default device. None if it loads (or
    where the bindings alone know where to look: not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return str(exc)
    return None


def check_library() -> None:
    """Raise :class:`BackendUnavailableError` where the driver's library cannot be loaded;
    nothing but this module is imported to find out (not the bindings, nor numpy)."""
    missing = _no_driver_library()
    if missing is not None:
        raise BackendUnavailableError(
            "cuda",
            f"no NVIDIA driver library (libcuda.so.1) could be loaded ({missing}); install the "
            "NVIDIA driver, or use a virtual device ('virtual:0')",
        )


def load_driver() -> Any:
    """Import the bindings and initialise the driver, or say why CUDA cannot be used here."""
    check_library()
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(
            "cuda",
            f"cuda-python is not installed ({exc}); run 'pip install cuda-python', or use a "
            "virtual device ('virtual:0')",
        ) from None
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError: no libcuda.so.1
        raise BackendUnavailableError(
            "cuda",
            f"no NVIDIA driver library (libcuda.so.1) could be loaded ({exc}); install the "
            "NVIDIA driver, or use a virtual device ('virtual:0')",
        ) from None
    code = int(err)
    if code == _NO_DEVICE:
        raise BackendUnavailableError("cuda", "the NVIDIA driver found no CUDA device")
    if code == _STUB_LIBRARY:
        raise BackendUnavailableError(
            "cuda",
            "libcuda.so.1 is the CUDA toolkit's stub library, not a driver: put the real "
            "driver's library first on the library path",
        )
    if code != SUCCESS:
        raise BackendUnavailableError("cuda", f"cuInit failed: {describe(driver, code)[1]}")
    err, count = driver.cuDeviceGetCount()
    if int(err) != SUCCESS or not count:
        raise BackendUnavailableError("cuda", "the NVIDIA driver found no CUDA device")
    return driver


def describe(driver: Any, code: int) -> tuple[str, str]:
    """A CUresult's name (``""`` where the bindings do not know the code) and its
    description, ``NAME (code): message``, as far as the driver can name it."""
    try:
        result = driver.CUresult(code)
    except ValueError:
        return "", f"CUresult {code}"
    name = result.name  # the bindings' names are the driver's (cuGetErrorName's)
    err, message = driver.cuGetErrorString(result)
    text = message.decode() if int(err) == SUCCESS and message else ""
    return name, f"{name} ({code}): {text}" if text and text != name else f"{name} ({code})"


class Driver:
    """The bindings module (``cu``), the checks every call's result goes through, and the
    count of handles that could not be released."""

    __slots__ = ("cu", "first_unreleased", "relaxed", "unreleased")

    def __init__(self, cu: Any) -> None:
        self.cu = cu
        self.unreleased = 0
        self.first_unreleased = ""
        self.relaxed = cu.CUstreamCaptureMode(CAPTURE_MODE_RELAXED)

    # Stream capture. While a thread has a capture under way in CU_STREAM_CAPTURE_MODE_GLOBAL
    # (torch.cuda.graph's default), every other thread whose own mode is GLOBAL (every thread
    # begins so) is prohibited from "potentially unsafe" calls (queries, synchronizations,
    # allocations, ...): such a call fails and invalidates that capture. aiostream's calls
    # never touch another library's capture, so they run RELAXED: on a caller's thread from
    # the first relax() to the matching restore(), its own mode given back then; on
    # aiostream's own threads for good (own_thread()).

    def relax(self) -> None:
        """Make this thread's capture interaction mode RELAXED, until the matching
        :meth:`restore` (nested calls nest)."""
        depth = getattr(_here, "depth", 0)
        if depth == 0:
            err, before = self.cu.cuThreadExchangeStreamCaptureMode(self.relaxed)
            if err != SUCCESS:
                raise self.error(err, None, "cuThreadExchangeStreamCaptureMode")
            _here.before = before
        _here.depth = depth + 1

    def restore(self) -> None:
        """Close the latest :meth:`relax`; the last one gives the thread its mode back."""
        _here.depth -= 1
        if _here.depth == 0:
            self.cu.cuThreadExchangeStreamCaptureMode(_here.before)

    def own_thread(self) -> None:
        """A thread of aiostream's own runs every call RELAXED, for good."""
        self.relax()

    def error(self, err: Any, index: int | None, call: str) -> CudaError:
        code = int(err)
        name, detail = describe(self.cu, code)
        where = f"cuda:{index}" if index is not None else "cuda"
        return CudaError(f"{call} failed on {where}: {detail}", device=where, code=code, name=name)

    def check(self, result: tuple[Any, ...], index: int | None, call: str) -> Any:
        """The value of a driver call's result tuple, or raise its CudaError."""
        if result[0] != SUCCESS:
            raise self.error(result[0], index, call)
        return result[1] if len(result) == 2 else None

    def ready(self, err: Any, index: int, call: str) -> bool:
        """A query's answer: True (``CUDA_SUCCESS``), False (``CUDA_ERROR_NOT_READY``), or
        raise the error (the work failed: sticky), or, for a stream capture's codes, an
        :class:`AiostreamError` that is no device failure."""
        if err == SUCCESS:
            return True
        if err == NOT_READY:
            return False
        if int(err) in CAPTURE_CODES:  # the object met a stream capture; the device is fine
            raise AiostreamError(
                f"{self.error(err, index, call)}: the event or stream is part of a CUDA graph "
                "capture (recorded or submitted while its stream was capturing), not work "
                "that completes; await what was recorded outside the capture"
            )
        raise self.error(err, index, call)

    def failure(self, err: Any, index: int, call: str) -> CudaError | None:
        """The device's failure that a query's result tells, or None: complete, not ready, or
        a stream capture's code (another library's capture met), which says nothing of it."""
        if err == SUCCESS or err == NOT_READY or int(err) in CAPTURE_CODES:
            return None
        return self.error(err, index, call)

    def released(self, result: tuple[Any, ...], index: int, call: str) -> bool:
        """For release calls, which never raise (they run in finalizers, on any thread): count
        what could not be released; :meth:`report` says it once, at close."""
        if result[0] == SUCCESS:
            return True
        self.failed_release(str(self.error(result[0], index, call)))
        return False

    def failed_release(self, what: str) -> None:
        self.unreleased += 1
        if not self.first_unreleased:
            self.first_unreleased = what

    def report(self) -> None:
        """One warning for every handle that could not be released, if any."""
        if self.unreleased:
            logger.warning(
                "aiostream could not release %d CUDA handle(s) (the first: %s); the driver "
                "reclaims them with the context",
                self.unreleased,
                self.first_unreleased,
            )
            self.unreleased = 0  # pragma: no mutate (equivalent: runs once; never read again)
