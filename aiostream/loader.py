"""An async data loader that overlaps host preparation, host-to-device copies and compute.

How it works, per item: the host takes it from the source and transforms it, writes it into a
pinned staging buffer, and enqueues its copy to device buffers on the loader's own copy stream;
an event recorded after the copies is the batch's ``ready``. Up to ``prefetch`` batches are in
flight ahead of the consumer. Buffers come from a pool of ``prefetch + 2`` slots that is reused,
never reallocated per batch (unless an item's shapes change).

Reuse is safe without blocking the host on the consumer's work (the ``record_stream`` problem):
when the consumer asks for the next batch, an event is recorded on its current stream, after all
the work it submitted with the previous batch. The slot goes back to the pool with that event,
and the copy stream waits for it *on the device* before the next copy into that slot. The host
waits only for the previous copy out of a slot's staging buffer before writing it again, which
also keeps the host from running ahead of the device.

A single task drives everything from ``__anext__``: there is no background task to leak, and
breaking out of ``async for`` stops production at once.
"""

from __future__ import annotations

import inspect
import weakref
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ._errors import AiostreamError
from .buffers import DeviceBuffer, HostBuffer, copy_async
from .device import Device
from .device import device as _resolve_device
from .event import Event
from .stream import Stream, current_stream

__all__ = ["Batch", "DataLoader", "LoaderStats"]

_END = object()


@dataclass(frozen=True)
class LoaderStats:
    """What a loader has done so far."""

    batches: int
    """Batches handed out."""
    allocations: int
    """Device buffers allocated (each once for items of constant shape)."""
    pool_size: int
    """Slots in the pool: ``prefetch + 2``."""
    peak_in_use: int
    """Most slots in use at once: in flight, held by the consumer, or still used on the device."""


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

    def __init__(self, index: int, data: Any, ready: Event, slot: _Slot) -> None:
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
        if stream not in self._slot.users:
            self._slot.users.append(stream)

    def __repr__(self) -> str:
        return f"<aiostream.Batch {self.index} ready={self.ready.query()}>"


class _Slot:
    """Staging and device buffers for one item, and the events that order their reuse."""

    __slots__ = ("copied", "device", "released", "staging", "users")

    def __init__(self) -> None:
        self.staging: list[HostBuffer] = []
        self.device: list[DeviceBuffer] = []
        self.copied: Event | None = None  # after the last copy out of the staging buffers
        self.released: list[Event] = []  # after the consumer's work with the last batch
        self.users: list[Stream] = []  # streams other than the current one using the batch


def _flatten(item: Any) -> tuple[list[np.ndarray], Callable[[list[Any]], Any]]:
    """The item's arrays, and how to rebuild its shape around other leaves."""
    if isinstance(item, np.ndarray):
        return [item], lambda leaves: leaves[0]
    if isinstance(item, tuple) and all(isinstance(x, np.ndarray) for x in item):
        return list(item), tuple
    if isinstance(item, dict) and all(isinstance(x, np.ndarray) for x in item.values()):
        keys = list(item)
        return [item[k] for k in keys], lambda leaves: dict(zip(keys, leaves))
    raise TypeError(
        "the loader carries numpy arrays, or tuples or dicts of them; got "
        f"{type(item).__name__}" + (f" of {[type(x).__name__ for x in item]}" if isinstance(item, tuple) else "")
    )


class _Iteration(AsyncIterator[Batch]):
    """One pass over the source."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._device = loader.device
        source = loader._source
        self._async = isinstance(source, AsyncIterable)
        self._source: Any = aiter(source) if self._async else iter(source)  # type: ignore[arg-type]
        self._copy_stream = Stream(self._device)
        self._free: deque[_Slot] = deque(_Slot() for _ in range(loader.prefetch + 2))
        self._inflight: deque[Batch] = deque()
        self._held: _Slot | None = None
        self._exhausted = False
        self._closed = False
        self._index = 0
        self.batches = 0
        self.allocations = 0
        self.peak_in_use = 0

    async def __anext__(self) -> Batch:
        if self._closed:
            raise StopAsyncIteration
        try:
            self._release_held()
            while len(self._inflight) < self._loader.prefetch and not self._exhausted:
                item = await self._next_item()
                if item is _END:
                    self._exhausted = True
                    break
                self._inflight.append(await self._stage(await self._transform(item)))
            self._note_in_use()
            if not self._inflight:
                raise StopAsyncIteration
            batch = self._inflight.popleft()
            current_stream(self._device).wait_event(batch.ready)  # the host does not wait
            self._held = batch._slot
            self.batches += 1
            return batch
        except BaseException:
            await self.aclose()
            raise

    async def _next_item(self) -> Any:
        if self._async:
            try:
                return await self._source.__anext__()
            except StopAsyncIteration:
                return _END
        await anyio.lowlevel.checkpoint()  # a long sync source still lets other tasks run
        return next(self._source, _END)

    async def _transform(self, item: Any) -> Any:
        transform = self._loader._transform
        if transform is None:
            return item
        if self._loader._to_thread:
            result = await anyio.to_thread.run_sync(transform, item)
        else:
            result = transform(item)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _stage(self, item: Any) -> Batch:
        arrays, rebuild = _flatten(item)
        slot = self._free.popleft()
        if slot.copied is not None:
            await slot.copied.synchronize()  # the staging buffers may be written again
        if [b.nbytes for b in slot.staging] != [a.nbytes for a in arrays]:
            slot.staging = [HostBuffer(a.nbytes, device=self._device) for a in arrays]
            slot.device = [DeviceBuffer(a.nbytes, self._device) for a in arrays]
            slot.released = []
            self.allocations += len(arrays)
        stream = self._copy_stream
        for released in slot.released:
            stream.wait_event(released)  # the consumer's work with it is done first
        views = []
        for array, host, dev in zip(arrays, slot.staging, slot.device):
            array = np.ascontiguousarray(array)
            np.copyto(host.numpy(array.dtype, array.shape), array)
            copy_async(dev, host, stream=stream)
            views.append(dev.view(array.dtype, array.shape))
        slot.copied = stream.record_event()
        batch = Batch(self._index, rebuild(views), slot.copied, slot)
        self._index += 1
        return batch

    def _release_held(self) -> None:
        slot, self._held = self._held, None
        if slot is not None:
            users = [current_stream(self._device), *slot.users]
            slot.released = [s.record_event() for s in dict.fromkeys(users)]
            slot.users = []
            self._free.append(slot)

    def _note_in_use(self) -> None:
        busy = sum(1 for slot in self._free if not all(e.query() for e in slot.released))
        in_use = len(self._inflight) + (self._held is not None) + busy
        self.peak_in_use = max(self.peak_in_use, in_use)

    async def aclose(self) -> None:
        """Stop: hand nothing more out, let the copies in flight land, return every buffer.

        The consumer's own work on the last batch is the consumer's to await.
        """
        if self._closed:
            return
        self._closed = True
        self._release_held()
        self._inflight.clear()
        with anyio.CancelScope(shield=True):
            try:
                await self._copy_stream.synchronize()
            except AiostreamError:
                pass  # a failed (or reset) device: its awaits report that; cleanup must not
            finally:
                self._free.clear()
                if self._async and hasattr(self._source, "aclose"):
                    await self._source.aclose()


class DataLoader(AsyncIterable[Batch]):
    """Feed a device from async Python: host preparation, copies and compute all at once.

    Args:
        source: a sync or async iterable of numpy arrays, or of tuples or dicts of them.
        transform: called on each item on the host, before its copy; sync or async. With
            ``to_thread=True`` a sync transform runs in a worker thread (for CPU-heavy work).
        device: where the batches go; None for the default device.
        prefetch: how many batches may be in flight ahead of the consumer (>= 1).
        to_thread: run ``transform`` in a worker thread.

    Example:
        >>> import anyio, numpy as np, aiostream as ais
        >>> async def main():
        ...     source = (np.full(4, i, np.float32) for i in range(3))
        ...     async with ais.DataLoader(source, device="virtual:0") as loader:
        ...         async for batch in loader:
        ...             ais.delay(0.001)  # your kernels, on the current stream
        ...     await ais.current_stream("virtual:0").synchronize()
        >>> anyio.run(main)

    Breaking out of ``async for``, an exception from ``transform`` or the source, or
    cancelling the consumer stops production at once. ``async with`` (or :meth:`aclose`) also
    waits for the copies already in flight and returns every buffer before it exits.
    """

    def __init__(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        *,
        transform: Callable[[Any], Any] | None = None,
        device: Device | str | None = None,
        prefetch: int = 2,
        to_thread: bool = False,
    ) -> None:
        if not isinstance(source, (Iterable, AsyncIterable)):
            raise TypeError(f"source must be an iterable or async iterable, got {source!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable or None, got {transform!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int):
            raise TypeError(f"prefetch must be an int, got {prefetch!r}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if not isinstance(to_thread, bool):
            raise TypeError(f"to_thread must be True or False, got {to_thread!r}")
        self._source = source
        self._transform = transform
        self._to_thread = to_thread
        self.prefetch = prefetch
        self.device = _resolve_device(device)
        self._iterations: weakref.WeakSet[_Iteration] = weakref.WeakSet()
        self._last: _Iteration | None = None

    def __aiter__(self) -> _Iteration:
        iteration = _Iteration(self)
        self._iterations.add(iteration)
        self._last = iteration
        return iteration

    @property
    def stats(self) -> LoaderStats:
        """Counters of the latest pass over the source."""
        it = self._last
        if it is None:
            return LoaderStats(0, 0, self.prefetch + 2, 0)
        return LoaderStats(it.batches, it.allocations, self.prefetch + 2, it.peak_in_use)

    async def aclose(self) -> None:
        """Close every pass still open (see :meth:`_Iteration.aclose`)."""
        for iteration in list(self._iterations):
            await iteration.aclose()

    async def __aenter__(self) -> DataLoader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<aiostream.DataLoader on {self.device} prefetch={self.prefetch}>"
