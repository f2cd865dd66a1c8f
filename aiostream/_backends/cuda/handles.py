"""The handles the CUDA backend gives out: streams, events and memory, each with its device's
index and whether the backend owns (and so destroys) it."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

__all__ = ["Event", "Memory", "Stream"]


class Stream:
    __slots__ = ("__weakref__", "alive", "default", "id", "index", "owned", "ptr", "seq")

    def __init__(self, ptr: Any, index: int, *, owned: bool, default: bool = False) -> None:
        self.ptr = ptr
        self.index = index
        self.id = int(ptr)
        self.owned = owned
        self.default = default  # the legacy default stream: work goes to the current context
        self.alive = True
        self.seq = itertools.count()  # the order of its captures


class Event:
    __slots__ = ("__weakref__", "alive", "id", "index", "lane", "owned", "ptr")

    def __init__(self, ptr: Any, index: int, *, owned: bool) -> None:
        self.ptr = ptr
        self.index = index
        self.id = int(ptr)
        self.owned = owned
        self.alive = True
        #: the lane of captures: the stream it was last recorded on (None: not known)
        self.lane: Hashable | None = None


class Memory:
    """Host (pinned or not) or device memory, and the markers of the copies that use it."""

    __slots__ = ("alive", "array", "device", "index", "nbytes", "ptr", "uses")

    def __init__(self, index: int, nbytes: int, ptr: int, *, device: bool, array: Any = None):
        self.index = index
        self.nbytes = nbytes
        self.ptr = ptr
        self.device = device
        self.array = array  # a bytearray for pageable host memory (ptr is then its address)
        self.alive = True
        self.uses: dict[int, Any] = {}  # stream id -> marker recorded after its last copy
