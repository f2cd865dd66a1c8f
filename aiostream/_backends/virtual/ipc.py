"""IPC handles of virtual events: 64 bytes naming one backend (a random token) and one event.

The virtual backend shares events within one process: a handle opens in the backend that made
it, and nowhere else.
"""

from __future__ import annotations

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
        self._states: weakref.WeakValueDictionary[int, EventState] = weakref.WeakValueDictionary()

    def handle(self, event: Event) -> bytes:
        self._states[event.state.id] = event.state
        body = _MAGIC + self._token + struct.pack("<IQ", event.device.index, event.state.id)
        return body.ljust(_SIZE, b"\x00")

    def open(self, index: int, data: bytes) -> EventState:
        """The shared state of the event behind ``data``, for device ``index``."""
        if data[:16] != _MAGIC:
            raise ValueError("handle is not an IPC handle of a virtual event")
        if data[16:24] != self._token:
            raise StaleHandleError(
                "the IPC handle comes from another virtual backend (another process, or "
                "one that aiostream.virtual.reset() replaced); the virtual backend shares "
                "events within one process only"
            )
        dev_index, eid = struct.unpack("<IQ", data[24:36])
        if dev_index != index:
            raise ValueError(
                f"the IPC handle is of an event on virtual:{dev_index}, not virtual:{index}"
            )
        state = self._states.get(eid)
        if state is None:
            raise ValueError("the event behind this IPC handle no longer exists")
        return state
