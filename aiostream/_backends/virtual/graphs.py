"""Stream capture and graphs on the virtual device, by the rules CUDA keeps.

A capture begins on one stream (its origin). Work submitted to a stream in the capture does not
run: it becomes a node of the capture's graph, depending on the stream's previous node and on
the points it was made to wait for. An event recorded on a capturing stream is a *captured
event*: it marks a point of the graph (the nodes before it), nothing that completes. A stream
outside any capture that waits for a captured event joins the capture (a fork); the capture
may end only once every stream it forked to is joined back (the origin waited for an event
recorded on it after its last node), else no graph is made. A capturing stream cannot wait for
an event recorded outside the capture, nor for one of another capture.

A graph's replay (``launch``) submits its nodes again, each time the same way: the nodes of
each captured stream on a stream of the replay's own (the origin's on the replay stream's id,
a forked stream's on its own), each after the nodes it depends on, the roots after the work
submitted to the replay stream so far and after the graph's previous launch (CUDA orders the
launches of one executable graph so); the replay stream's next work waits for every node. A
node becomes a scheduler item only when it is ready (``Scheduler.launch``): a launch costs
the host what one submission does, whatever the graph's size.
The scheduler then runs them as any work, so a replay's timeline is exact and the same on
every replay, run and loop, and faults injected into its engines fail it as any work.

A graph is updated in place (``update``, CUDA's ``cuGraphExecUpdate``) from another of the
same topology: as many nodes, each of the same kind (a kernel, or a copy in the same
direction) with the same dependencies, in capture order; its later launches then submit the
other's operations. ``dot`` describes a graph as ``cuGraphDebugDotPrint`` does a CUDA graph.
"""

from __future__ import annotations

import itertools

from ..._errors import (
    AiostreamError,
    already_capturing,
    captured_event,
    capturing_stream,
    default_stream_capture,
    isolated_wait,
    merged_wait,
    not_capturing,
    replay_on_capturing,
    unjoined,
)
from .model import Event, Item, Op, Stream
from .scheduler import Scheduler, Shape

__all__ = ["Capture", "Graph", "Point", "dot", "end", "update"]

#: A point of a capture: the nodes (indices) that work after it depends on.
Point = tuple[int, ...]

#: A node: the index of the captured stream it was submitted to, the nodes it depends on, and
#: the operation it submits at each launch.
Node = tuple[int, Point, Op]

#: ids of captures and of graphs (one count: no graph's id is a capture's)
_ids = itertools.count(1)


def describe_stream(stream: Stream) -> str:
    return f"stream {stream.id} on virtual:{stream.device.index}"


def describe_event(event: Event) -> str:
    return f"event {event.state.id} on virtual:{event.device.index}"


class Capture:
    """One capture under way: its streams (the origin first) and the nodes made so far."""

    def __init__(self, origin: Stream, mode: str) -> None:
        self.id = next(_ids)
        self.mode = mode
        self.ended = False
        self.members: list[Stream] = [origin]
        #: per member: the point its next node depends on
        self.points: list[Point] = [()]
        #: per member: the point right after its own last node (what joining it waits for)
        self.tails: list[Point] = [()]
        self.nodes: list[Node] = []
        origin.capture = self

    @property
    def origin(self) -> Stream:
        return self.members[0]

    def member(self, stream: Stream) -> int:
        return self.members.index(stream)

    def add(self, stream: Stream, op: Op) -> None:
        """A node of ``op``, submitted to ``stream`` (capturing here)."""
        m = self.member(stream)
        index = len(self.nodes)
        self.nodes.append((m, self.points[m], op))
        self.points[m] = self.tails[m] = (index,)

    def record(self, event: Event, stream: Stream) -> None:
        """``event`` recorded on ``stream``: a captured event, at the stream's point."""
        event.state.item = None
        event.state.captured = (self, self.points[self.member(stream)])

    def join(self, stream: Stream, point: Point) -> None:
        """``stream`` waits for ``point`` of this capture: its next node depends on it too
        (a stream outside any capture joins it, a fork)."""
        if stream.capture is None:
            stream.capture = self
            self.members.append(stream)
            self.points.append(point)
            self.tails.append(())
            return
        m = self.member(stream)
        self.points[m] = tuple(sorted(set(self.points[m]) | set(point)))

    def end(self) -> Graph:
        """End the capture (its streams leave it, whatever the outcome): the graph, or raise
        if a forked stream was not joined back into the origin."""
        self.ended = True
        for stream in self.members:
            stream.capture = None
        reached = self._ancestors(self.points[0])
        for m in range(1, len(self.members)):
            if any(n not in reached for n in self.tails[m]):
                raise unjoined(describe_stream(self.origin))
        return Graph(self)

    def _ancestors(self, point: Point) -> set[int]:
        seen: set[int] = set()
        todo = list(point)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(self.nodes[n][1])
        return seen


class Graph:
    """A capture's nodes, replayed as a whole."""

    __slots__ = (
        "capture_id",
        "destroyed",
        "device",
        "exec_id",
        "ids",
        "last",
        "nodes",
        "priorities",
        "shape",
        "source_id",
    )

    def __init__(self, capture: Capture) -> None:
        self.capture_id = capture.id
        #: the capture whose nodes it launches (another's once updated), and its own id as an
        #: executable graph: the opaque ids ``graph_handles`` hands out
        self.source_id = capture.id
        self.exec_id = next(_ids)
        self.device = capture.origin.device
        self.nodes = capture.nodes
        self.shape = Shape(capture.nodes)
        # the stream ids and priorities of the members' replays (the origin's: the replay
        # stream's, set at each launch)
        self.ids = [s.id for s in capture.members]
        self.priorities = [s.priority for s in capture.members]
        #: the marker of its last launch: a launch runs after the previous one (as CUDA
        #: orders the launches of one executable graph)
        self.last: Item | None = None
        #: destroyed (``graph_destroy``): launching it is refused, as CUDA refuses it
        self.destroyed = False

    def launch(self, stream: Stream, sched: Scheduler) -> None:
        """Submit every node again, after the work on ``stream`` so far and the previous
        launch; the stream's next work waits for all of them."""
        device = stream.device
        replays = [Stream(device, stream.id, stream.priority)]
        members = zip(self.ids[1:], self.priorities[1:], strict=True)
        replays += [Stream(device, i, p) for i, p in members]
        sched.wait_event(stream, self.last)
        self.last = sched.launch(stream, self.shape, replays)


def _kind(op: Op) -> str:
    """A node's kind, as CUDA's DOT names it: a copy (``Memories.copy_op``'s, which alone
    has ``attach``), or a kernel."""
    return "MEMCPY" if op.attach is not None else "KERNEL"


def update(graph: Graph, source: Graph) -> str | None:
    """Make ``graph``'s later launches submit ``source``'s operations (lock held), where the
    two have the same topology, node kinds and copy directions, checked in that order, as
    ``cuGraphExecUpdate`` checks them; else why not, ``graph`` left as it was. Launches made
    before keep their own nodes (a launch holds its shape)."""
    if len(graph.nodes) != len(source.nodes):
        return "topology"
    pairs = list(zip(graph.nodes, source.nodes, strict=True))
    if any(mine[1] != theirs[1] for mine, theirs in pairs):
        return "topology"
    if any(_kind(mine[2]) != _kind(theirs[2]) for mine, theirs in pairs):
        return "node type"
    for (_, _, mine), (_, _, theirs) in pairs:
        if mine.engine != theirs.engine or (mine.attach is not None and mine.name != theirs.name):
            return "parameters"
    graph.nodes = source.nodes
    graph.shape = source.shape
    graph.ids = source.ids
    graph.priorities = source.priorities
    graph.source_id = source.source_id
    return None


def dot(graph: Graph, verbose: bool) -> str:
    """The graph as DOT (lock held): one node per operation, labelled with its index, kind
    and name (``verbose``: its engine, duration and captured stream too), and an edge from
    each node to each that depends on it."""
    name = f"graph_{graph.source_id}"
    lines = [
        "digraph dot {",
        f"subgraph cluster_{graph.source_id} {{",
        f'label="{name}" graph[style="dashed"];',
    ]
    for i, (member, _, op) in enumerate(graph.nodes):
        label = f"{i}\\n{_kind(op)}\\n{_quoted(op.name)}"
        if verbose:
            label += (
                f"\\nengine {op.engine}\\nduration {op.duration} ns"
                f"\\ncaptured stream {graph.ids[member]}"
            )
        lines.append(f'"{name}_node_{i}"[style="solid" shape="rectangle" label="{label}"];')
    for i, (_, deps, _) in enumerate(graph.nodes):
        lines += [f'"{name}_node_{d}" -> "{name}_node_{i}";' for d in deps]
    lines += ["}", "}", ""]
    return "\n".join(lines)


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def check_wait(stream: Stream, event: Event) -> None:
    """Raise if ``stream`` may not wait for ``event`` (lock held)."""
    captured = event.state.captured
    if captured is not None and captured[0].ended:  # a point of a graph, not of work
        raise captured_event(describe_event(event))
    if stream.capture is not None:
        if captured is None:
            raise isolated_wait(describe_stream(stream))
        if captured[0] is not stream.capture:
            raise merged_wait(describe_stream(stream))


def check_awaitable_stream(stream: Stream) -> None:
    if stream.capture is not None:
        raise capturing_stream(describe_stream(stream))


def check_awaitable_event(event: Event) -> None:
    if event.state.captured is not None:
        raise captured_event(describe_event(event))


def check_capturable(stream: Stream) -> None:
    """Raise if a capture cannot begin on ``stream`` (lock held)."""
    if stream.capture is not None:
        raise already_capturing(describe_stream(stream))
    if stream is stream.device.default:
        raise default_stream_capture(f"virtual:{stream.device.index}")


def end(stream: Stream) -> Graph:
    """End the capture begun on ``stream`` (lock held)."""
    capture: Capture | None = stream.capture
    if capture is None or capture.origin is not stream:
        raise not_capturing(describe_stream(stream))
    return capture.end()


def check_updatable(graph: Graph, source: Graph) -> None:
    """Raise if ``graph`` may not be updated from ``source`` (lock held)."""
    for g in (graph, source):
        if g.destroyed:  # the driver's INVALID_VALUE for a destroyed graph
            raise AiostreamError(
                f"graph {g.capture_id} on virtual:{g.device.index} was destroyed: it cannot "
                "be updated, nor update another"
            )
    if source.device is not graph.device:
        raise ValueError(
            f"a graph captured on virtual:{graph.device.index} cannot be updated from one "
            f"captured on virtual:{source.device.index}"
        )


def check_launch(graph: Graph, stream: Stream) -> None:
    """Raise if ``graph`` may not be launched on ``stream`` (lock held)."""
    if graph.destroyed:  # the driver's INVALID_VALUE for a destroyed executable graph
        raise AiostreamError(
            f"graph {graph.capture_id} on virtual:{graph.device.index} was destroyed: it "
            "cannot be launched"
        )
    if stream.device is not graph.device:
        raise ValueError(
            f"a graph captured on virtual:{graph.device.index} cannot be replayed on "
            f"{describe_stream(stream)}: replay it on a stream of its own device"
        )
    if stream.capture is not None:
        raise replay_on_capturing(describe_stream(stream))
