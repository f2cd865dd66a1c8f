"""The virtual backend's events and device memory handed to others within one process: IPC
handles, and what opens from them.

A buffer opened from an IPC handle is the same bytes, with no allocation of its own; the stream
that opens it waits for the exporter's event. (DLPack exports are the memory's own: a virtual
device's memory is host memory, exported as such, ``Memories.export``.)
"""

from __future__ import annotations

from .ipc import IpcTable
from .memory import Memories
from .model import Event, Memory, Stream
from .simulation import Simulation

__all__ = ["Sharing"]


class Sharing:
    """IPC of one backend's events and device memory: its table of handles, over its
    simulation and its memory."""

    def __init__(self, sim: Simulation, memory: Memories) -> None:
        self.sim = sim
        self.memory = memory
        self.ipc = IpcTable()

    def event_ipc_handle(self, event: Event) -> bytes:
        with self.sim.lock:
            self.sim.check_open()
            return self.ipc.handle(event)

    def event_from_ipc_handle(self, index: int, data: bytes) -> Event:
        """The event behind ``data`` on device ``index``: its state, shared."""
        with self.sim.lock:
            self.sim.check_open()
            return Event(self.sim.devices[index], self.ipc.open(index, data), True)

    def ipc_handle(self, mem: Memory) -> bytes:
        return self.ipc.memory_handle(self.memory.share(mem), mem.device.index)

    def ipc_open(
        self, index: int, data: bytes, event: bytes, nbytes: int, stream: Stream
    ) -> Memory:
        """The memory behind ``data`` on device ``index``, once ``stream`` has waited for the
        exporter's ``event``."""
        sim = self.sim
        with sim.lock:
            sim.check_device(stream.device)
            key, source = self.ipc.open_memory(index, data)
            state = self.ipc.open(source, event)  # recorded on the exporter's device
            mem = self.memory.opened(key, sim.devices[index], nbytes)
            sim.sched.wait_event(stream, state.item)
            return mem
