"""The exceptions aiostream raises."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AiostreamError",
    "BackendUnavailableError",
    "CaptureError",
    "CompletionError",
    "CudaError",
    "DeviceError",
    "GraphUpdateError",
    "NotReadyError",
    "StaleHandleError",
]


class AiostreamError(Exception):
    """Base class of every error aiostream raises on its own account.

    Every one pickles with its attributes, so it crosses processes (multiprocessing, Ray)
    whole: the subclasses' keyword-only arguments would otherwise break unpickling.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[AiostreamError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class DeviceError(AiostreamError):
    """Device work failed, or the device refused a request (such as memory it does not have).

    Errors of device work are sticky: once a device has failed, every later query, wait or
    submission on it raises again, as CUDA's asynchronous errors do for their context. A refused
    request is not: the device goes on.

    Attributes:
        device: the device that failed, as ``"kind:index"``.
    """

    def __init__(self, message: str, *, device: str) -> None:
        super().__init__(message)
        self.device = device


class CudaError(DeviceError):
    """A CUDA driver call failed.

    The message names the call, the device and the driver's own description. Errors of
    asynchronous work (a kernel that faulted) are sticky: the driver reports them from every
    later call on that device's context.

    Attributes:
        code: the driver's ``CUresult`` value, such as 719.
        name: its name, such as ``"CUDA_ERROR_LAUNCH_FAILED"``; ``""`` for a code the
            installed ``cuda-python`` does not know (a newer driver's).
    """

    def __init__(self, message: str, *, device: str, code: int, name: str) -> None:
        super().__init__(message, device=device)
        self.code = code
        self.name = name


class BackendUnavailableError(AiostreamError):
    """A backend cannot be used on this machine; the message says why and what to do.

    Attributes:
        kind: the backend's name (``"cuda"``, ``"virtual"``).
        reason: why it is unavailable.
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"the {kind!r} backend is unavailable: {reason}")
        self.kind = kind
        self.reason = reason


class CompletionError(AiostreamError):
    """``aiostream.wait()`` could not learn whether a foreign handle's work is done: asking it
    (its adapter's ``done`` or ``call_back``) raised. The original error is the
    ``__cause__``. Work that failed raises its library's own exception instead.

    Attributes:
        kind: the handle's kind, as ``pending_waits()`` shows it (``"torch.distributed"``).
        subject: what was awaited.
    """

    def __init__(self, message: str, *, kind: str, subject: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.subject = subject


class NotReadyError(AiostreamError):
    """The work an operation needs has not completed yet (CUDA's ``CUDA_ERROR_NOT_READY``)."""


class StaleHandleError(AiostreamError):
    """The object belongs to a backend that was replaced (``aiostream.virtual.reset()``)."""


class CaptureError(AiostreamError):
    """What a stream capture does not allow, refused before it reached the driver: awaiting,
    synchronizing or querying a capturing stream or an event recorded in a capture, a wait
    that crosses the capture's boundary, memory allocated on the capturing thread, a capture
    that ends with forked work not joined back. The capture (another library's too) goes on
    unharmed, unless the message says it ended. The same error, word for word, on every
    backend: a test on a virtual device fails where a GPU would."""


class GraphUpdateError(CaptureError):
    """``Graph.update`` refused a capture whose work differs from the graph's in what an
    executable graph cannot take in place (CUDA's ``CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE``):
    another topology (another number of operations, or other dependencies between them), an
    operation of another kind, or parameters the driver cannot change. The graph is left as it
    was, and still replays its own work. The same error, word for word, on every backend.

    Attributes:
        reason: what differs: ``"topology"``, ``"node type"``, ``"parameters"`` or
            ``"unsupported"``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


#: what each reason of a refused update says (``GraphUpdateError.reason``)
UPDATE_REASONS = {
    "topology": "its topology differs (another number of operations, or other dependencies "
    "between them)",
    "node type": "an operation is of another kind (a kernel where a copy was, or the reverse)",
    "parameters": "an operation's parameters changed in a way an executable graph cannot take "
    "(a copy's direction, or its memory's device)",
    "unsupported": "the driver cannot update the graph in place from it",
}


def update_refused(graph: str, source: str, reason: str) -> GraphUpdateError:
    return GraphUpdateError(
        f"graph {graph!r} cannot be updated from graph {source!r}: {UPDATE_REASONS[reason]}. "
        f"Graph {graph!r} is unchanged and still replays its own work; to run the new work, "
        f"replay graph {source!r} itself (or capture it into a new Graph): an update takes a "
        "capture of the same operations, of the same kinds, with the same dependencies",
        reason=reason,
    )


# ---------------------------------------------------------------------- stream capture
# The messages of what a capture refuses, shared by the backends so that they say the same.


def capturing_stream(stream: str) -> CaptureError:
    return CaptureError(
        f"{stream} is capturing a graph: its work is recorded, not run, until the capture "
        "ends, so it cannot be awaited, synchronized or queried now; await an event recorded "
        "before the capture began, or the stream once the capture has ended"
    )


def captured_event(event: str) -> CaptureError:
    return CaptureError(
        f"{event} was recorded on a stream that was capturing a graph: it marks a point of "
        "the graph, not work that runs, so it cannot be awaited, synchronized, queried or "
        "timed; await the event Graph.replay() returns, or record this one again outside "
        "the capture"
    )


def isolated_wait(stream: str) -> CaptureError:
    return CaptureError(
        f"{stream} is capturing a graph and cannot wait for an event recorded outside the "
        "capture (the driver refuses it and breaks the capture): make the stream wait before "
        "the capture begins, or record the event inside it"
    )


def merged_wait(stream: str) -> CaptureError:
    return CaptureError(
        f"{stream} cannot wait for an event recorded in another graph capture than its own: "
        "one graph cannot depend on another's capture; wait for an event of the same capture"
    )


def already_capturing(stream: str) -> CaptureError:
    return CaptureError(
        f"{stream} is already capturing a graph: end that capture before beginning another on it"
    )


def default_stream_capture(device: str) -> CaptureError:
    return CaptureError(
        f"the default stream of {device} cannot be captured (CUDA refuses its legacy default "
        "stream): capture a stream of your own (Graph.capture() with no stream makes one)"
    )


def replay_on_capturing(stream: str) -> CaptureError:
    return CaptureError(
        f"{stream} is capturing a graph: replay a graph on a stream outside any capture"
    )


def not_capturing(stream: str) -> CaptureError:
    return CaptureError(
        f"{stream} has no capture of its own under way to end: end a capture on the stream "
        "it began on"
    )


def unjoined(stream: str) -> CaptureError:
    return CaptureError(
        f"the capture of {stream} ended with work forked to other streams and not joined "
        "back, so no graph was made: before the capture ends, make the capturing stream "
        "wait for each stream it forked to (capturing.wait_stream(other))"
    )


def capture_allocation(mode: str) -> CaptureError:
    return CaptureError(
        f"memory cannot be allocated on the thread of a graph capture in {mode!r} mode while "
        "the capture is under way (the driver prohibits it, and would break the capture): "
        "allocate buffers before the capture begins, or capture with "
        "capture_error_mode='relaxed'"
    )


def pageable_copy(stream: str) -> CaptureError:
    return CaptureError(
        f"a copy between pageable host memory and the device cannot be captured on {stream} "
        "(the driver runs it synchronously): use a pinned HostBuffer (pinned=True, the "
        "default)"
    )


# Tracebacks and reprs name them as users import them: aiostream.DeviceError, not
# aiostream._errors.DeviceError (pickling still finds them: aiostream exports each one).
for _error in (
    AiostreamError,
    CaptureError,
    GraphUpdateError,
    DeviceError,
    CudaError,
    BackendUnavailableError,
    NotReadyError,
    StaleHandleError,
):
    _error.__module__ = "aiostream"
del _error
