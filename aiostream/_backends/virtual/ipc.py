"""IPC handles of virtual events: 64 bytes naming one backend (a random token and the process
that made it) and one event.

The virtual backend shares events within one process: a handle opens in the backend that made
it, and nowhere else. A virtual device is one process's simulation (one clock, one scheduler,
one timeline, deterministic because nothing else submits to it); a handle opened in another
process, or after ``aiostream.virtual.reset()``, is refused at once with the reason.
"""

from __future__ import annotations

import os
import secrets
import struct
import weakref

from ..._errors import StaleHandleError
from .model import Event, EventState

__all__ = ["IpcTable"]

_MAGIC = b"aiostream:virt\x00\x01"  # 16 bytes
_SIZE = 64


class IpcTable:
    """The events shared through handles, held weakly: a handle outlives nothing."""

    def __init__(self) -> None:
        self._token = secrets.token_bytes(8)
        self._pid = os.getpid()
        self._states: weakref.WeakValueDictionary[int, EventState] = weakref.WeakValueDictionary()

    def handle(self, event: Event) -> bytes:
        self._states[event.state.id] = event.state
        body = _MAGIC + self._token
        body += struct.pack("<IQI", event.device.index, event.state.id, self._pid)
        return body.ljust(_SIZE, b"\x00")

    def open(self, index: int, data: bytes) -> EventState:
        """The shared state of the event behind ``data``, for device ``index``."""
        if data[:16] != _MAGIC:
            raise ValueError("handle is not an IPC handle of a virtual event")
        dev_index, eid, pid = struct.unpack("<IQI", data[24:40])
        if pid != self._pid:
            raise StaleHandleError(
                f"the IPC handle comes from a virtual device of process {pid}, and this is "
                f"process {self._pid}: a virtual device is one process's simulation, so its "
                "events are shared within one process only. Share events across processes "
                "on CUDA devices; on virtual devices, give each process its own events"
            )
        if data[16:24] != self._token:
            raise StaleHandleError(
                "the IPC handle comes from a virtual backend that aiostream.virtual.reset() "
                "replaced; its events are gone with it"
            )
        if dev_index != index:
            raise ValueError(
                f"the IPC handle is of an event on virtual:{dev_index}, not virtual:{index}"
            )
        state = self._states.get(eid)
        if state is None:
            raise ValueError("the event behind this IPC handle no longer exists")
        return state
