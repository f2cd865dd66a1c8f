"""Stream capture and graphs on CUDA: ``cuStreamBeginCapture`` ... ``cuGraphLaunch``.

aiostream checks, before the driver is asked, what the driver would refuse by breaking the
capture (so that the capture survives the refusal, and the words are those of the virtual
device): a capture of the legacy stream or of a stream capturing already, a wait that crosses
the capture's boundary (:meth:`Capturing.check_wait`), awaiting or querying what is captured
(``waits.py``). Streams that wait for an event recorded in an aiostream capture join it, as
the driver makes them (a fork); the driver says at the end whether they were joined back.

Nothing of aiostream's own goes into a capture: no completion mark is recorded on a capturing
stream, and memory whose users include a capturing stream is freed once the capture ended
(``Capture.frees``), when a mark can be recorded on it again.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

from ..._errors import (
    AiostreamError,
    CaptureError,
    already_capturing,
    captured_event,
    default_stream_capture,
    isolated_wait,
    merged_wait,
    not_capturing,
    replay_on_capturing,
    unjoined,
)
from .devices import Device, Devices
from .driver import SUCCESS, Driver
from .handles import FOREIGN, Event, Memory, Stream, StreamKey, describe_event, describe_stream
from .waits import Waits

__all__ = ["Capture", "Capturing", "Graph", "Source"]

_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}  # CUstreamCaptureMode
_INVALIDATED = 901  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
_UNJOINED = 904  # CUDA_ERROR_STREAM_CAPTURE_UNJOINED
_UPDATE_FAILURE = 910  # CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE
_OPERATING_SYSTEM = 304  # CUDA_ERROR_OPERATING_SYSTEM: cuGraphDebugDotPrint's file
_DOT_VERBOSE = 1  # CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE
#: CUgraphExecUpdateResult, as GraphUpdateError.reason says it (others: "unsupported")
_UPDATE_REASONS = {
    2: "topology",  # TOPOLOGY_CHANGED
    3: "node type",  # NODE_TYPE_CHANGED
    4: "parameters",  # FUNCTION_CHANGED
    5: "parameters",  # PARAMETERS_CHANGED
    7: "parameters",  # UNSUPPORTED_FUNCTION_CHANGE
    8: "parameters",  # ATTRIBUTES_CHANGED
}


class Capture:
    """An aiostream capture under way: its streams (the origin first), the memory whose free
    waits for its end, and what each stream has waited for of the others' work.

    Joins are followed as vector clocks over the streams' ``ops`` (their count of work
    submitted): an event recorded on a member notes the member's count and what the member
    had seen of the others then; a member that waits for it sees as much. A forked stream is
    joined back once the origin has seen all its work since it joined (``joined``), which is
    what the driver requires of ``cuStreamEndCapture``.
    """

    __slots__ = (
        "allocs",
        "base",
        "dropped",
        "ended",
        "frees",
        "known",
        "members",
        "mode",
        "points",
    )

    def __init__(self, origin: Stream, mode: str) -> None:
        self.mode = mode
        self.ended = False
        #: member streams the program dropped during the capture: destroyed at its end
        self.dropped: list[Stream] = []
        self.members = [origin]
        self.frees: list[Memory] = []
        #: memory the capture uses whose stream-ordered allocation may not have completed:
        #: each launch waits for it (a wait inside the capture would cross its boundary)
        self.allocs: list[Memory] = []
        #: per member: the ops count of each stream whose work up to it the member waited for
        self.known: dict[StreamKey, dict[StreamKey, int]] = {origin.key: {}}
        #: per member: its ops count when it joined (nothing of it before is the capture's)
        self.base: dict[StreamKey, int] = {origin.key: origin.ops}
        #: per captured event (by id): what waiting for it makes a stream see
        self.points: dict[int, dict[StreamKey, int]] = {}

    @property
    def origin(self) -> Stream:
        return self.members[0]

    def recorded(self, event: Event, stream: Stream) -> None:
        self.points[event.id] = {**self.known[stream.key], stream.key: stream.ops}

    def waits(self, stream: Stream, event: Event) -> None:
        """``stream`` waits for ``event``, recorded in this capture (it joins, if outside)."""
        point = self.points.get(event.id, {})
        if stream.key not in self.known:  # a fork: the stream joins the capture
            stream.capture = self
            self.members.append(stream)
            self.known[stream.key] = {}
            self.base[stream.key] = stream.ops + 1  # after this wait, its next work is ours
        seen = self.known[stream.key]
        for key, ops in point.items():
            if ops > seen.get(key, -1):
                seen[key] = ops

    def unjoined(self) -> list[Stream]:
        """The forked streams whose work since they joined the origin has not waited for."""
        seen = self.known[self.origin.key]
        return [m for m in self.members[1:] if m.ops > max(seen.get(m.key, -1), self.base[m.key])]


class Source:
    """A graph (``CUgraph``) an executable graph was made from or updated from, kept for its
    description (``cuGraphDebugDotPrint``) and its handle, and as the source of updates; shared
    by the executable graphs that run its work, destroyed when the last lets it go."""

    __slots__ = ("ptr", "users")

    def __init__(self, ptr: Any) -> None:
        self.ptr = ptr
        self.users = 1


class Graph:
    """An executable graph (``CUgraphExec``), the graph whose work it runs, and what it
    holds."""

    __slots__ = ("allocs", "exec", "index", "nodes", "source")

    def __init__(
        self, exe: Any, source: Source, index: int, nodes: int, allocs: list[Memory]
    ) -> None:
        self.exec = exe
        self.source = source
        self.index = index
        self.nodes = nodes
        self.allocs = allocs


class Capturing:
    """Captures begun, ended and checked, and graphs launched and released, on every device
    of one backend (the waits say whether another library captures a stream aiostream handed
    out)."""

    def __init__(
        self,
        drv: Driver,
        devices: Devices,
        waits: Waits,
        free: Callable[[Device, Memory], None],
        destroy: Callable[[Stream], None],
    ) -> None:
        self.drv = drv
        self.devices = devices
        self.waits = waits
        self.free = free  # frees memory (Memories.release's rule), once no capture holds it
        self.destroy_stream = destroy  # destroys a stream dropped while it captured

    def capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is part of a capture, aiostream's or another library's."""
        return self.waits.capture_of(stream) is not None

    def begin(self, stream: Stream, mode: str) -> None:
        """Begin a capture on ``stream``."""
        capturing = self.capturing(stream)  # the driver may be asked, before any refusal
        if stream.id == 0:
            raise default_stream_capture(f"cuda:{stream.index}")
        if capturing:
            raise already_capturing(describe_stream(stream))
        dev = self.devices[stream.index]
        cu = self.drv.cu
        with dev.lock:
            with dev.pushed:
                result = cu.cuStreamBeginCapture(stream.ptr, cu.CUstreamCaptureMode(_MODES[mode]))
            self.drv.check(result, stream.index, "cuStreamBeginCapture")
            stream.capture = Capture(stream, mode)

    def end(self, stream: Stream) -> Graph:
        """End the capture begun on ``stream``; its streams leave it whatever the outcome, and
        the memory freed meanwhile is freed now. The executable graph, or raise."""
        capture = stream.capture
        if capture is None or capture.origin is not stream:
            raise not_capturing(describe_stream(stream))
        dev = self.devices[stream.index]
        cu = self.drv.cu
        with dev.lock:
            forked = capture.unjoined()
            err: Any = None
            graph: Any = None
            try:
                markers = []
                try:  # joined here, so that the driver ends the capture cleanly: no graph
                    markers = [dev.record_marker(m) for m in forked]
                    with dev.pushed:
                        for marker in markers:
                            self.drv.check(
                                cu.cuStreamWaitEvent(stream.ptr, marker, 0),
                                stream.index,
                                "cuStreamWaitEvent",
                            )
                finally:
                    for marker in markers:  # recorded again before any query: not captured
                        dev.give_back(marker)
                    with dev.pushed:  # ended whatever happened above
                        err, graph = cu.cuStreamEndCapture(stream.ptr)
            finally:
                capture.ended = True
                for member in capture.members:
                    member.capture = None
                for mem in capture.frees:
                    self.free(self.devices[mem.index], mem)
                for dropped in capture.dropped:
                    self.destroy_stream(dropped)
            code = int(err)
            if forked and code == SUCCESS:
                dev.release(cu.cuGraphDestroy, graph)
            if forked or code == _UNJOINED:
                raise unjoined(describe_stream(stream))
            if code == _INVALIDATED:
                raise CaptureError(
                    f"the capture of {describe_stream(stream)} was broken by a call the driver "
                    "prohibits during a capture (another library's, or one made outside "
                    "aiostream), so no graph was made: make that call before or after the "
                    "capture"
                )
            self.drv.check((err, graph), stream.index, "cuStreamEndCapture")
            try:
                with dev.pushed:
                    err, _, count = cu.cuGraphGetNodes(graph)
                    self.drv.check((err, None), stream.index, "cuGraphGetNodes")
                    exe = self.drv.check(
                        cu.cuGraphInstantiate(graph, 0), stream.index, "cuGraphInstantiate"
                    )
            except BaseException:
                dev.release(cu.cuGraphDestroy, graph)
                raise
            dev.internal[exe] = "graph"
            dev.internal[graph] = "cugraph"  # kept: described, handed out, updated from
        return Graph(exe, Source(graph), stream.index, int(count), capture.allocs)

    def launch(self, stream: Stream, graph: Graph) -> None:
        capturing = self.capturing(stream)
        if stream.index != graph.index:
            raise ValueError(
                f"a graph captured on cuda:{graph.index} cannot be replayed on "
                f"{describe_stream(stream)}: replay it on a stream of its own device"
            )
        if capturing:
            raise replay_on_capturing(describe_stream(stream))
        dev = self.devices[stream.index]
        cu = self.drv.cu
        with dev.lock:
            for mem in graph.allocs:  # ordered after their allocations, as a use would be
                marker = mem.alloc_marker
                if marker is not None and not dev.over(marker):
                    with dev.pushed:
                        result = cu.cuStreamWaitEvent(stream.ptr, marker, 0)
                    self.drv.check(result, stream.index, "cuStreamWaitEvent")
            graph.allocs = [m for m in graph.allocs if m.alloc_marker is not None]
        with dev.pushed:
            result = cu.cuGraphLaunch(graph.exec, stream.ptr)
        self.drv.check(result, stream.index, "cuGraphLaunch")
        stream.ops += 1

    def destroy(self, graph: Graph) -> None:
        """Release the executable graph (launches in flight complete), and its source if
        no other runs its work; never raises."""
        dev = self.devices.by_index.get(graph.index)
        if dev is None:
            return
        with dev.lock:
            if dev.internal.pop(graph.exec, None) is None:
                return  # released already (at close)
            dev.release(self.drv.cu.cuGraphExecDestroy, graph.exec)
            self._let_go(dev, graph.source)

    def _let_go(self, dev: Device, source: Source) -> None:
        """One executable graph less runs ``source``'s work: destroyed after the last (lock
        held)."""
        source.users -= 1
        if source.users == 0 and dev.internal.pop(source.ptr, None) is not None:
            dev.release(self.drv.cu.cuGraphDestroy, source.ptr)  # no context needed

    def _open(self, graph: Graph) -> Device:
        """The device of ``graph``, refusing a graph released at the backend's close."""
        dev = self.devices[graph.index]
        if graph.exec not in dev.internal:
            raise AiostreamError(
                f"the graph on cuda:{graph.index} was released when the CUDA backend closed"
            )
        return dev

    def handles(self, graph: Graph) -> tuple[int, int]:
        dev = self.devices[graph.index]
        with dev.lock:
            self._open(graph)
            return int(graph.source.ptr), int(graph.exec)

    def dump(self, graph: Graph, path: str, verbose: bool) -> None:
        dev = self.devices[graph.index]
        cu = self.drv.cu
        with dev.lock:
            self._open(graph)
            with dev.pushed:
                result = cu.cuGraphDebugDotPrint(
                    graph.source.ptr, os.fsencode(path), _DOT_VERBOSE if verbose else 0
                )
            if int(result[0]) == _OPERATING_SYSTEM:  # the file could not be written
                raise OSError(f"cuGraphDebugDotPrint could not write {path!r}")
            self.drv.check(result, graph.index, "cuGraphDebugDotPrint")

    def update(self, graph: Graph, source: Graph) -> str | None:
        """``cuGraphExecUpdate``: ``graph``'s executable graph takes ``source``'s parameters;
        it shares ``source``'s graph from then on, and orders its launches after the
        allocations of ``source``'s memory too. Else why not, the graph as it was."""
        if source.index != graph.index:
            raise ValueError(
                f"a graph captured on cuda:{graph.index} cannot be updated from one captured "
                f"on cuda:{source.index}"
            )
        cu = self.drv.cu
        dev = self.devices[graph.index]
        with dev.lock:
            self._open(graph)
            self._open(source)
            with dev.pushed:
                err, _ = cu.cuGraphExecUpdate(graph.exec, source.source.ptr)
                result = _why_not(cu, graph, source) if int(err) == _UPDATE_FAILURE else 0
            if result:
                return _UPDATE_REASONS.get(result, "unsupported")
            if int(err) != _UPDATE_FAILURE:  # else updated when asked why not: it could be
                self.drv.check((err, None), graph.index, "cuGraphExecUpdate")
            if source.source is not graph.source:
                source.source.users += 1
                self._let_go(dev, graph.source)
                graph.source = source.source
            graph.allocs = list(source.allocs)  # its launches now use source's memory
        return None

    @staticmethod
    def check_wait(stream: Stream, event: Event) -> None:
        """Raise if ``stream`` may not wait for ``event``, before the driver breaks the
        capture; a stream outside any capture that waits for an event of an aiostream capture
        joins it (the driver makes it a member)."""
        captured = event.captured
        capture = stream.capture
        if isinstance(captured, Capture) and captured.ended:  # a point of a graph, not work
            raise captured_event(describe_event(event))
        if captured is FOREIGN:  # it may join another library's capture: the driver is asked
            stream.private = False
        if capture is not None:
            if captured is None:
                raise isolated_wait(describe_stream(stream))
            if captured is not capture:
                raise merged_wait(describe_stream(stream))
        if isinstance(captured, Capture):
            captured.waits(stream, event)


class _UpdateResultInfo(ctypes.Structure):
    """``CUgraphExecUpdateResultInfo``."""

    _fields_ = (
        ("result", ctypes.c_int),
        ("errorNode", ctypes.c_void_p),
        ("errorFromNode", ctypes.c_void_p),
    )


_UpdateFunction = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_UpdateResultInfo)
)


def _why_not(cu: Any, graph: Graph, source: Graph) -> int:
    """Why ``cuGraphExecUpdate`` refused to update ``graph`` from ``source``: its
    ``CUgraphExecUpdateResult`` (context pushed). cuda-python hands out no result info with a
    failure, so the driver's own entry point (``cuGetProcAddress``'s, for CUDA 12.0:
    ``cuGraphExecUpdate_v2``) is asked again, with a struct of ours; a refused update changes
    nothing, so it answers the same. 0 if it updated the graph this time."""
    err, version = cu.cuDriverGetVersion()
    if int(err) != SUCCESS or version < 12000:  # before 12.0 the entry point takes 4 arguments
        return 1
    err, pfn, _ = cu.cuGetProcAddress(b"cuGraphExecUpdate", 12000, 0)
    if int(err) != SUCCESS or not pfn:
        return 1  # CU_GRAPH_EXEC_UPDATE_ERROR: the driver's generic reason
    info = _UpdateResultInfo()
    code = _UpdateFunction(int(pfn))(int(graph.exec), int(source.source.ptr), ctypes.byref(info))
    return 0 if code == SUCCESS else info.result or 1
