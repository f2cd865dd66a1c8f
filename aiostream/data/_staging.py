"""The data loader's staging: the pool of slots (pinned staging buffers and device buffers,
each made when first needed and then reused) that a pass over the source fills and copies, the
order of their reuse after the consumer's work, and the :class:`Batch` each copy becomes. See
:mod:`aiostream.data.loader` for how a pass drives it."""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._errors import AiostreamError
from ..device import Device
from ..event import Event
from ..stream import Stream, current_stream, use_stream
from .buffers import DeviceBuffer, HostBuffer, copy_async

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Batch", "Plan", "Prepared", "Slot", "Staging", "flatten", "idle"]


class Batch:
    """One item on the device.

    Attributes:
        data: a :class:`DeviceBuffer` (typed like the source array), or a tuple or dict of them
            shaped like the item.
        ready: the :class:`Event` that completes when the batch's copy has landed. The
            consumer's current stream already waits for it on the device.
        index: the item's position in the source.

    A batch is valid until the consumer asks for the next one: then its buffers go back to
    the pool, reused once the work the consumer submitted with them on its current stream has
    completed. Work on other streams counts too once they are named with :meth:`record_stream`.
    """

    __slots__ = ("_slot", "data", "index", "ready")

    def __init__(self, index: int, data: Any, ready: Event, slot: Slot) -> None:
        if not isinstance(ready, Event) or not isinstance(slot, Slot):
            raise TypeError("a Batch is made by aiostream.DataLoader, not by hand")
        self.index = index
        self.data = data
        self.ready = ready
        self._slot = slot

    def record_stream(self, stream: Stream) -> None:
        """Mark ``stream`` as using this batch: its buffers are reused only after the work
        submitted to ``stream`` before the next batch is requested has completed too
        (as ``torch.Tensor.record_stream``). The stream must first wait for :attr:`ready`.
        """
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream, got {stream!r}")
        if stream.device != self.ready.device:
            raise ValueError(f"the batch is on {self.ready.device}, the stream on {stream.device}")
        if self._slot.batch is not self:
            raise RuntimeError(
                f"batch {self.index} was given back when the next batch was asked for (or the "
                "loader closed), and its buffers may hold another item already: call "
                "record_stream before asking for the next batch"
            )
        if stream not in self._slot.users:
            self._slot.users.append(stream)

    def __repr__(self) -> str:
        return f"<aiostream.Batch {self.index} ready={self.ready.query()}>"


class Slot:
    """Staging and device buffers for one item, and the events that order their reuse."""

    __slots__ = ("batch", "copied", "device", "mark", "released", "staging", "users")

    def __init__(self) -> None:
        self.batch: Batch | None = None  # the batch of the slot's item, until given back
        self.staging: list[HostBuffer] = []
        self.device: list[DeviceBuffer] = []
        self.copied: Event | None = None  # after the last copy out of the staging buffers
        self.released: list[Event] = []  # after the consumer's work with the last batch
        # the streams using the batch: the consumer's current stream when it was handed out
        # first, then those named by Batch.record_stream
        self.users: list[Stream] = []
        # Recorded again at each release on the consumer's current stream: only the copy
        # stream's next wait, which captures its latest record, and the stats read it.
        self.mark: Event | None = None


def idle(slot: Slot) -> bool:
    """Whether the device is done with ``slot`` (a free one): the consumer's work with its
    last batch, and so its copy too: the events were recorded on the consumer's streams, the
    one current at the hand-out among them, which waited for that copy first."""
    return all(e.query() for e in slot.released)


def flatten(item: Any) -> tuple[list[np.ndarray], Callable[[list[Any]], Any]]:
    """The item's arrays, and how to rebuild its shape around other leaves."""
    import numpy as np  # when a loader runs: ``import aiostream`` stays light

    if isinstance(item, np.ndarray):
        return [item], lambda leaves: leaves[0]
    if isinstance(item, tuple) and all(isinstance(x, np.ndarray) for x in item):
        return list(item), tuple
    if isinstance(item, dict) and all(isinstance(x, np.ndarray) for x in item.values()):
        keys = list(item)
        return [item[k] for k in keys], lambda leaves: dict(zip(keys, leaves, strict=True))
    raise TypeError(
        "the loader carries numpy arrays, or tuples or dicts of them; got "
        f"{type(item).__name__}"
        + (f" of {[type(x).__name__ for x in item]}" if isinstance(item, tuple) else "")
    )


class Prepared:
    """An item transformed and written into its slot's staging buffers (or, when its shapes
    are new to the slot, its arrays: the loop allocates buffers for them)."""

    __slots__ = ("arrays", "rebuild", "specs")

    def __init__(
        self,
        specs: list[tuple[np.dtype[Any], tuple[int, ...]]],
        rebuild: Callable[[list[Any]], Any],
        arrays: list[np.ndarray] | None,
    ) -> None:
        self.specs = specs
        self.rebuild = rebuild
        self.arrays = arrays


@dataclass(frozen=True)
class Plan:
    """What a DataLoader was asked to do: every pass reads it, none changes it."""

    source: Iterable[Any] | AsyncIterable[Any]
    transform: Callable[[Any], Any] | None
    in_threads: bool  # a sync transform (and the staging fill) runs in worker threads
    prefetch: int
    workers: int
    device: Device


class Staging:
    """One pass's pool of slots: staging and device buffers, filled and copied in turn."""

    def __init__(self, plan: Plan, limiter: anyio.CapacityLimiter) -> None:
        self.plan = plan
        self.device = plan.device
        self.limiter = limiter
        self.copy_stream = Stream(self.device, name="DataLoader h2d copies")
        self.pool = plan.prefetch + 2  # slots made as needed, up to this many
        self.slots: list[Slot] = []
        self.free: deque[Slot] = deque()
        self.held: Slot | None = None
        self.index = 0
        self.allocations = 0
        self.peak_in_use = 0

    async def take_slot(self) -> Slot:
        """A free slot whose staging buffers may be written: their last copy has completed.
        The oldest free one if the device is done with it; else a new one while fewer than
        ``pool`` exist (at most prefetch + 1 are ever out); else the oldest, which the copy
        stream waits for on the device."""
        free = self.free
        if not free or (len(self.slots) < self.pool and not idle(free[0])):
            assert len(self.slots) < self.pool
            slot = Slot()
            self.slots.append(slot)
            return slot
        slot = free.popleft()
        if slot.copied is not None and not slot.copied.query():  # no turn of the loop if done
            await slot.copied.synchronize()
        return slot

    async def prepare(self, item: Any, slot: Slot) -> Prepared:
        """Transform the item and write it into the slot's staging buffers: in a worker thread
        with ``to_thread`` (both steps, so the loop's thread does neither), else here."""
        plan = self.plan
        if plan.in_threads:
            return await anyio.to_thread.run_sync(
                self.transform_and_fill, item, slot, limiter=self.limiter
            )
        if plan.transform is not None:
            item = plan.transform(item)
            if inspect.isawaitable(item):
                item = await item
        return self.fill(item, slot)

    def transform_and_fill(self, item: Any, slot: Slot) -> Prepared:
        transform = self.plan.transform
        if transform is not None:
            item = transform(item)
            if inspect.isawaitable(item):
                if inspect.iscoroutine(item):
                    item.close()
                raise TypeError(
                    "transform returned an awaitable from a worker thread: make it an "
                    "'async def' (it then runs on the event loop), or pass to_thread=False"
                )
        return self.fill(item, slot)

    @staticmethod
    def fill(item: Any, slot: Slot) -> Prepared:
        import numpy as np

        arrays, rebuild = flatten(item)
        arrays = [np.ascontiguousarray(a) for a in arrays]
        specs = [(a.dtype, a.shape) for a in arrays]
        if [b.nbytes for b in slot.staging] != [a.nbytes for a in arrays]:
            return Prepared(specs, rebuild, arrays)  # new shapes: the loop allocates
        for array, host in zip(arrays, slot.staging, strict=True):
            np.copyto(host.numpy(array.dtype, array.shape), array)
        return Prepared(specs, rebuild, None)

    def enqueue(self, slot: Slot, prepared: Prepared) -> Batch:
        """Enqueue the copies of a prepared item to the slot's device buffers: its batch."""
        if prepared.arrays is not None:
            import numpy as np

            slot.staging = [HostBuffer(a.nbytes, device=self.device) for a in prepared.arrays]
            with use_stream(self.copy_stream):  # allocated in order with the copies into them
                slot.device = [DeviceBuffer(a.nbytes, self.device) for a in prepared.arrays]
            slot.released = []
            self.allocations += len(prepared.arrays)
            for array, host in zip(prepared.arrays, slot.staging, strict=True):
                np.copyto(host.numpy(array.dtype, array.shape), array)
        stream = self.copy_stream
        for released in slot.released:
            stream.wait_event(released)  # the consumer's work with it is done first
        views = []
        for (dtype, shape), host, dev in zip(
            prepared.specs, slot.staging, slot.device, strict=True
        ):
            copy_async(dev, host, stream=stream)
            views.append(dev.view(dtype, shape))
        slot.copied = stream.record_event()
        batch = slot.batch = Batch(self.index, prepared.rebuild(views), slot.copied, slot)
        self.index += 1
        return batch

    def release_held(self) -> None:
        """Give the held batch's slot back: its reuse waits for the consumer's streams. Raises
        where the device has failed (see :meth:`give_back`)."""
        slot, self.held = self.held, None
        if slot is not None:
            current = current_stream(self.device)
            if slot.mark is None:
                slot.mark = Event(self.device)
            released = [current.record_event(slot.mark)]
            users = [s for s in dict.fromkeys(slot.users) if s != current]
            released += [s.record_event() for s in users]
            for buf in slot.device:  # freeing them (at close, on a new shape) waits for these
                for stream in (current, *users):
                    buf.record_stream(stream)
            slot.released = released
            slot.users = []
            slot.batch = None
            self.free.append(slot)

    def give_back(self) -> None:
        """:meth:`release_held` for closing and stopping, which must go on where the device
        has failed (or its backend was reset): nothing more runs there to wait for."""
        try:
            self.release_held()
        except AiostreamError:
            pass

    def note_in_use(self) -> None:
        busy = sum(1 for slot in self.free if not all(e.query() for e in slot.released))
        in_use = len(self.slots) - len(self.free) + busy
        self.peak_in_use = max(self.peak_in_use, in_use)

    def hold(self, batch: Batch, consumer: Stream) -> None:
        """The consumer, whose current stream is ``consumer``, has ``batch``: its slot is in
        use until the next one is asked for, or the pass is closed or stopped (by any task:
        its current stream may be another, and both are waited for)."""
        slot = self.held = batch._slot  # noqa: SLF001 (Batch is this module's)
        slot.users = [consumer]
        self.note_in_use()

    async def settle(self) -> None:
        """Wait for the copies in flight; a cancelled caller does not wait (see ``drop``)."""
        await self.copy_stream.synchronize()

    def drop(self) -> None:
        """Drop every buffer. Those with copies still in flight are freed by their backend
        once that work completes (stream-ordered), never while it runs."""
        self.free.clear()
        self.slots.clear()
