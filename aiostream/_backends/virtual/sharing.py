"""The virtual backend's device memory handed to others: DLPack exports, as host memory, and
IPC handles, within one process (as its events).

A virtual device's memory is host memory, and it is exported as such (``kDLCPU``), so NumPy
and CPU PyTorch read device buffers in tests; reading one while a copy into it is in flight is
a race, recorded as for a host view. A buffer opened from an IPC handle is the same bytes,
with no allocation of its own; the stream that opens it waits for the exporter's event.
"""

from __future__ import annotations

from .ipc import IpcTable
from .memory import Memories
from .model import Memory, Stream
from .simulation import Simulation

__all__ = ["Sharing"]

_DLPACK_CPU = 1  # DLPack's kDLCPU


class Sharing:
    """The sharing part of :class:`.backend.VirtualBackend` (a mixin over its simulation, its
    memory and its IPC table)."""

    _sim: Simulation
    _memory: Memories
    _ipc: IpcTable

    def dlpack_device(self, index: int) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)  # the simulated device memory is host memory

    def memory_export(self, mem: Memory) -> int:
        return self._memory.export(mem)

    def memory_wait(self, mem: Memory, stream: Stream) -> None:
        self._memory.wait_for_writers(mem, stream)

    def device_alloc_interprocess(self, index: int, nbytes: int, stream: Stream) -> Memory:
        return self._memory.device_alloc(index, nbytes)

    def memory_ipc_handle(self, mem: Memory) -> bytes:
        return self._ipc.memory_handle(self._memory.share(mem), mem.device.index)

    def memory_from_ipc_handle(
        self, index: int, data: bytes, event: bytes, nbytes: int, stream: Stream
    ) -> Memory:
        with self._sim.lock:
            self._sim.check_device(stream.device)
            key, source = self._ipc.open_memory(index, data)
            state = self._ipc.open(source, event)  # recorded on the exporter's device
            mem = self._memory.opened(key, self._sim.devices[index], nbytes)
            self._sim.sched.wait_event(stream, state.item)
            return mem
