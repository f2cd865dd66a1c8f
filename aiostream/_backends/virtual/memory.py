"""Memory on virtual devices: host buffers, device memory of a stated size, copies that take
simulated time on the copy engines, and the race detector."""

from __future__ import annotations

import ctypes
import os
import traceback

from ..._check import MAX_SECONDS
from ..._errors import DeviceError
from .model import DONE, RUNNING, Device, Item, Memory, Op, Race, Stream
from .simulation import Simulation

__all__ = ["POISON", "Memories"]

#: The byte value that fills a copy's destination from the copy's start until it completes.
POISON = 0xA5
_COPY_ENGINES = {"h2d": "h2d", "d2h": "d2h", "d2d": "compute"}

#: this package's folder: a race report's stack ends where the user's code made the read
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _user_stack(frames: int) -> str:
    """The innermost ``frames`` frames of the calling stack above this package's own (the
    read, ``HostBuffer.numpy()``, and its way here): where the user's code made the read."""
    stack = traceback.extract_stack()
    while stack and stack[-1].filename.startswith(_PACKAGE):
        stack.pop()
    return "".join(traceback.format_list(stack[-frames:]))


class Memories:
    """The live buffers, the allocation accounting per device, copies and races."""

    def __init__(
        self, sim: Simulation, size: int, copies: dict[str, tuple[float, float]], profiled: bool
    ):
        self.sim = sim
        self.size = size  # bytes of memory per device
        #: (latency in seconds, bytes per second) by copy kind (profile.COPY_KINDS)
        self.copies = copies
        self.profiled = profiled  # the figures come from a device profile
        self.live: set[Memory] = set()
        self.races: list[Race] = []
        #: device memory shared through IPC handles, by key, until it is freed
        self.shared: dict[int, Memory] = {}

    def host_alloc(self, index: int, nbytes: int, pinned: bool) -> Memory:
        with self.sim.lock:
            self.sim.check_open()
            try:
                mem = Memory(nbytes, self.sim.devices[index], host=True, pinned=pinned)
            except (MemoryError, OverflowError):  # as the driver refuses pinned memory
                raise DeviceError(
                    f"{self.sim.devices[index].name}: cannot allocate {nbytes} bytes of host "
                    "memory (the machine does not have it)",
                    device=self.sim.devices[index].name,
                ) from None
            self.live.add(mem)
            return mem

    def host_access(self, host: Memory) -> None:
        if not host.writers:
            return
        with self.sim.lock:
            self.sim.now_locked()
            if not host.writers:
                return
            writer = next(iter(host.writers))
            copy = (
                f"{writer.name!r} on {writer.device.name} stream {writer.stream.id} "
                f"(submitted at t={writer.submit / 1e9:.9f}s)"
            )
            where = _user_stack(8)
            self.races.append(Race(len(host.data), copy, where))

    def take_races(self, clear: bool) -> list[Race]:
        with self.sim.lock:
            found = list(self.races)
            if clear:
                self.races.clear()
            return found

    def host_free(self, host: Memory) -> None:
        with self.sim.lock:
            self.live.discard(host)

    def device_alloc(self, index: int, nbytes: int) -> Memory:
        with self.sim.lock:
            device = self.sim.devices[index]
            self.sim.check_device(device)
            if nbytes > self.size - device.allocated:
                raise self._out_of_memory(device, nbytes, "")
            try:
                mem = Memory(nbytes, device, host=False)
            except (MemoryError, OverflowError):  # the host cannot hold the simulated bytes
                raise self._out_of_memory(device, nbytes, "; the host could not hold it") from None
            device.allocated += nbytes
            self.live.add(mem)
            return mem

    def _out_of_memory(self, device: Device, nbytes: int, why: str) -> DeviceError:
        size = self.size
        return DeviceError(
            f"{device.name} is out of memory: {nbytes} bytes asked, {size - device.allocated} "
            f"of {size} free{why} (aiostream.virtual.reset(memory=...) sets the size)",
            device=device.name,
        )

    def device_free(self, mem: Memory) -> None:
        # The bytes live on while a copy's closure holds them: freeing never races a copy.
        with self.sim.lock:
            if mem in self.live:
                mem.device.allocated -= len(mem.data)
            self.live.discard(mem)
            self.shared.pop(id(mem), None)

    # ------------------------------------------------------------------ sharing

    def export(self, mem: Memory) -> int:
        """The address of ``mem``'s bytes, handed to a DLPack consumer as host memory: a copy
        into it in flight is a race, as for a host view (the bytes hold POISON until it
        lands)."""
        self.sim.check_open()
        self.host_access(mem)
        if not mem.data:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(mem.data))

    def wait_for_writers(self, mem: Memory, stream: Stream) -> None:
        """Later work on ``stream`` waits for the copies into ``mem`` in flight."""
        with self.sim.lock:
            self.sim.check_device(stream.device)
            for item in list(mem.writers):
                self.sim.sched.wait_event(stream, item)

    def share(self, mem: Memory) -> int:
        """``mem``'s key for IPC handles; it stays openable until it is freed."""
        with self.sim.lock:
            self.sim.check_open()
            if mem not in self.live:
                raise ValueError("the buffer was freed: it can no longer be shared")
            self.shared[id(mem)] = mem
            return id(mem)

    def opened(self, key: int, device: Device, nbytes: int) -> Memory:
        """The memory shared as ``key``, seen from ``device``: the same bytes and copies in
        flight, without allocation of its own (freeing it frees nothing)."""
        source = self.shared.get(key)
        if source is None:
            raise ValueError(
                "the buffer behind this IPC handle no longer exists: keep the exported "
                "DeviceBuffer alive until the other side has opened it and is done with it"
            )
        if len(source.data) != nbytes:
            raise ValueError(
                f"the IPC handle says {nbytes} bytes, but the buffer behind it has "
                f"{len(source.data)}: pass the handle unchanged"
            )
        alias = Memory.__new__(Memory)
        alias.pinned = False
        alias.data, alias.device, alias.host, alias.writers = (
            source.data,
            device,
            False,
            source.writers,
        )
        return alias

    # ------------------------------------------------------------------ copies

    def check_copy(self, nbytes: int, kind: str) -> float:
        """The seconds a copy of ``kind`` (profile.COPY_KINDS) takes; raise if a device clock
        cannot hold them."""
        latency, bandwidth = self.copies[kind]
        seconds = latency + nbytes / bandwidth
        if seconds > MAX_SECONDS:
            fix = (
                "the profile's figures cannot simulate it: copy less at once"
                if self.profiled
                else "raise the bandwidth (aiostream.virtual.reset(bandwidth=..., "
                "d2d_bandwidth=...))"
            )
            raise ValueError(
                f"a {kind.split('_')[0]} copy of {nbytes} bytes at {bandwidth:g} bytes/s would "
                f"take {seconds:g} s, past the {MAX_SECONDS:g} s a device clock holds; {fix}"
            )
        return seconds

    def copy_op(self, dst: Memory, src: Memory, nbytes: int, kind: str) -> Op:
        """A copy, to submit (here, or at each launch of a graph that captured it)."""
        host = src if kind == "h2d" else dst
        model = kind if kind == "d2d" else f"{kind}_{'pinned' if host.pinned else 'pageable'}"
        seconds = self.check_copy(nbytes, model)

        # Both run on whichever thread advances the simulation, usually the host's own: in
        # place (a fill and a memcpy), never building a temporary of the copy's size, whose
        # fresh pages would cost the host more than the copy itself.
        def begin() -> None:  # the destination holds poison from the copy's start
            ctypes.memset((ctypes.c_char * nbytes).from_buffer(dst.data), POISON, nbytes)

        def land() -> None:  # data moves when the copy completes
            memoryview(dst.data)[:nbytes] = memoryview(src.data)[:nbytes]

        def attach(item: Item) -> None:  # in flight from its submission (lock held)
            if item.state == DONE:  # zero-length and already landed
                return

            def settle() -> None:  # completed or aborted: no longer in flight
                dst.writers.pop(item, None)

            dst.writers[item] = None
            item.on_start = begin
            if item.state == RUNNING:  # it started at once, before the hook was set
                begin()
            if item.watchers is None:
                item.watchers = [settle]
            else:
                item.watchers.append(settle)

        duration = round(seconds * 1e9)
        return Op(duration, _COPY_ENGINES[kind], land, None, f"copy {kind}", attach)

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        op = self.copy_op(dst, src, nbytes, kind)
        sim = self.sim
        with sim.lock:
            sim.check_device(stream.device)
            item = sim.submit_locked(stream, op.duration, op.engine, op.fn, op.error, op.name)
            assert op.attach is not None
            op.attach(item)
