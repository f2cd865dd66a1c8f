"""IPC handles of virtual events and device memory: 64 bytes naming one backend (a random token
and the process that made it) and one event or one buffer.

The virtual backend shares events and device memory within one process: a handle opens in the
backend that made it, and nowhere else. A virtual device is one process's simulation (one
clock, one scheduler, one timeline, deterministic because nothing else submits to it); a handle
opened in another process, or after ``aiostream.virtual.reset()``, is refused at once with the
reason.
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
_MEMORY_MAGIC = b"aiostream:vmem\x00\x01"
_SIZE = 64


class IpcTable:
    """The events shared through handles, held weakly: a handle outlives nothing. (Device
    memory shared is held by ``Memories.share`` until its buffer is freed.)"""

    def __init__(self) -> None:
        self._token = secrets.token_bytes(8)
        self._states: weakref.WeakValueDictionary[int, EventState] = weakref.WeakValueDictionary()

    def handle(self, event: Event) -> bytes:
        self._states[event.state.id] = event.state
        body = _MAGIC + self._token
        body += struct.pack("<IQI", event.device.index, event.state.id, os.getpid())
        return body.ljust(_SIZE, b"\x00")

    def open(self, index: int, data: bytes) -> EventState:
        """The shared state of the event behind ``data``, for device ``index``."""
        eid = self._check(data, _MAGIC, "event", index)
        state = self._states.get(eid)
        if state is None:
            raise ValueError("the event behind this IPC handle no longer exists")
        return state

    def memory_handle(self, key: int, index: int) -> bytes:
        """A handle of the device memory known as ``key`` (see ``Memories.share``)."""
        body = _MEMORY_MAGIC + self._token + struct.pack("<IQI", index, key, os.getpid())
        return body.ljust(_SIZE, b"\x00")

    def open_memory(self, index: int, data: bytes) -> tuple[int, int]:
        """The key of the device memory behind ``data`` and its device's index (checked as
        event handles are; it opens on any device of the backend, as CUDA maps a peer's)."""
        key = self._check(data, _MEMORY_MAGIC, "device buffer", index, same_device=False)
        return key, struct.unpack_from("<I", data, 24)[0]

    def _check(
        self, data: bytes, magic: bytes, what: str, index: int, *, same_device: bool = True
    ) -> int:
        """The id in a handle of a ``what``, once it is known to be this backend's."""
        if len(data) != _SIZE or data[:16] != magic:
            raise ValueError(
                f"handle is not an IPC handle of a virtual {what}: pass the bytes that its "
                "ipc_handle() returned"
            )
        dev_index, key, pid = struct.unpack("<IQI", data[24:40])
        here = os.getpid()  # not the backend's: a forked child holds a copy of it
        if pid != here:
            raise StaleHandleError(
                f"the IPC handle comes from a virtual device of process {pid}, and this is "
                f"process {here}: a virtual device is one process's simulation, so its "
                f"{what}s are shared within one process only. Share them across processes "
                f"on CUDA devices; on virtual devices, give each process its own {what}s"
            )
        if data[16:24] != self._token:
            raise StaleHandleError(
                "the IPC handle comes from a virtual backend that aiostream.virtual.reset() "
                f"replaced; its {what}s are gone with it"
            )
        if same_device and dev_index != index:
            raise ValueError(
                f"the IPC handle is of an {what} on virtual:{dev_index}, not virtual:{index}"
            )
        return int(key)
