"""The virtual backend's device work: operations (``delay``, the simulator's own ``submit``),
copies, graphs (captured, and launched), and the controls of faults and stalls."""

from __future__ import annotations

from collections.abc import Callable

from . import graphs
from .clock import seconds_to_ns
from .memory import Memories
from .model import Fault, Memory, Op, Stream
from .simulation import Simulation

__all__ = ["Work"]


class Work:
    """The work part of :class:`.backend.VirtualBackend` (a mixin over its simulation and
    its memory). Work submitted to a capturing stream becomes a node of the capture's graph
    instead (``graphs.py``)."""

    _sim: Simulation
    _memory: Memories

    def delay(self, stream: Stream, seconds: float) -> None:
        self.submit(stream, seconds_to_ns(seconds, "seconds"), "compute", None, None, "delay")

    def submit(
        self,
        stream: Stream,
        duration_ns: int,
        engine: str,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> None:
        sim = self._sim
        with sim.lock:
            sim.check_device(stream.device)
            if stream.capture is not None:  # a node, submitted at each launch
                stream.capture.add(stream, Op(duration_ns, engine, fn, error, name))
                return
            sim.submit_locked(stream, duration_ns, engine, fn, error, name)

    def inject(
        self,
        index: int,
        stream: Stream | None,
        engine: str | None,
        count: int,
        *,
        message: str | None = None,
        factor: float | None = None,
    ) -> None:
        """Make the next ``count`` operations on ``stream``/``engine`` fail or run slower."""
        with self._sim.lock:
            device = self._sim.devices[index]
            self._sim.check_device(device)
            device.faults.append(Fault(stream, engine, count, message, factor))

    def stall(self, index: int, engine: str, stalled: bool) -> None:
        """Hold (or release) one stall of the engine: it starts no operation while any is
        held; running ones go on."""
        sim = self._sim
        with sim.lock:
            sim.check_open()
            sim.now_locked()
            sim.sched.set_stalled(sim.devices[index].engines[engine], stalled)
            sim.now_locked()
        sim.listeners()

    # ------------------------------------------------------------------ copies

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        memory = self._memory
        with self._sim.lock:
            self._sim.check_device(stream.device)
            if stream.capture is not None:  # a node, submitted at each launch
                stream.capture.add(stream, memory.copy_op(dst, src, nbytes, kind))
                return
        memory.copy(stream, dst, src, nbytes, kind)

    # ------------------------------------------------------------------ graphs

    def capture_begin(self, stream: Stream, mode: str) -> None:
        with self._sim.lock:
            self._sim.check_device(stream.device)
            graphs.check_capturable(stream)
            graphs.Capture(stream, mode)

    def capture_end(self, stream: Stream) -> graphs.Graph:
        with self._sim.lock:
            self._sim.check_open()
            return graphs.end(stream)

    def stream_capturing(self, stream: Stream) -> bool:
        return stream.capture is not None

    def graph_nodes(self, graph: graphs.Graph) -> int:
        return len(graph.nodes)

    def graph_launch(self, stream: Stream, graph: graphs.Graph) -> None:
        sim = self._sim
        with sim.lock:
            sim.check_device(stream.device)
            graphs.check_launch(graph, stream)  # a destroyed graph's included, as CUDA's
            sim.now_locked()
            graph.launch(stream, sim.sched)
            sim.submitted_locked()

    def graph_destroy(self, graph: graphs.Graph) -> None:
        """The nodes submitted by launches run on without the graph; a launch after this is
        refused, as the driver refuses a destroyed executable graph."""
        with self._sim.lock:
            graph.destroyed = True

    def graph_handles(self, graph: graphs.Graph) -> tuple[int, int]:
        """Opaque ids: the capture whose nodes the graph launches, and the graph's own."""
        with self._sim.lock:
            self._sim.check_open()
            return graph.source_id, graph.exec_id

    def graph_dump(self, graph: graphs.Graph, path: str, verbose: bool) -> None:
        with self._sim.lock:
            self._sim.check_open()
            text = graphs.dot(graph, verbose)
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)

    def graph_update(self, graph: graphs.Graph, source: graphs.Graph) -> str | None:
        sim = self._sim
        with sim.lock:
            sim.check_device(graph.device)  # a failed device's error, sticky as CUDA's
            graphs.check_updatable(graph, source)
            return graphs.update(graph, source)
