"""An async data loader that overlaps host preparation, host-to-device copies and compute.

How it works, per item: the host takes it from the source and transforms it, writes it into a
pinned staging buffer, and enqueues its copy to device buffers on the loader's own copy stream;
an event recorded after the copies is the batch's ``ready``. Buffers come from a pool of up
to ``prefetch + 2`` slots, each made when first needed and then reused, never reallocated per
batch (unless an item's shapes change): up to ``prefetch`` batches ahead of the consumer, the
one it holds, and one whose device work may still be running.

Inside ``async with loader:`` production runs ahead in the loader's own tasks, which live in a
task group that the block owns (structured concurrency: nothing outlives the block)::

    source -> producer -> workers -> (in source order) copies -> consumer

The producer takes items from the source in order, each with one of ``prefetch`` credits (so
at most ``prefetch`` items are between the source and the consumer) and a free slot, and queues
them for the ``workers``: threads for a sync transform with ``to_thread`` (each takes its next
item itself as soon as it is done with one, transforms it and writes it into the slot's staging
buffers), tasks on the loop otherwise. As items are done, the copies of those at the head of
the queue are enqueued in source order (from the worker's completion, on the loop's thread)
and their batches, or the first error in its turn, handed to the consumer; taking a batch
returns its credit, which wakes the producer.

A plain ``async for`` (no ``async with``) has no task group to run tasks in, so it produces
inside ``__anext__``: the same staging and reuse, without running ahead while the consumer
works.

Reuse is safe without blocking the host on the consumer's work (the ``record_stream`` problem):
when the consumer asks for the next batch, an event is recorded on its current stream, after all
the work it submitted with the previous batch. The slot goes back to the pool with that event,
and the copy stream waits for it *on the device* before the next copy into that slot. The host
waits only for the previous copy out of a slot's staging buffer before writing it again, which
also keeps the host from running ahead of the device.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
import weakref
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from queue import SimpleQueue
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from .. import _check, _hooks, _waiting
from .._errors import AiostreamError
from ..device import Device
from ..device import device as _resolve_device
from ..stream import current_stream
from ._staging import Batch, Plan, Prepared, Slot, Staging

if TYPE_CHECKING:
    pass

__all__ = ["Batch", "DataLoader", "LoaderStats"]

_END = object()
_NAME = "aiostream.DataLoader"


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
    run_ahead: bool = False
    """Whether production ran ahead in the loader's own tasks (iterated inside ``async with``)."""
    workers: int = 1
    """Transforms that may run at once."""


class _Job:
    """One item on its way through a worker: its slot, and the result or what was raised."""

    __slots__ = ("done", "error", "item", "result", "slot")

    def __init__(self, item: Any) -> None:
        self.item = item
        self.slot: Slot | None = None  # pragma: no mutate (equivalent: take_slot() sets it first)
        self.result: Prepared | None = None
        self.error: BaseException | None = None
        self.done = False  # set on the loop's thread when a worker is done with it


class _Failed:
    """What the consumer is handed in place of a batch that could not be made."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is the running loop's cancellation (which goes on as it is); anything
    else a source or transform raises, KeyboardInterrupt included, is handed to the consumer."""
    return isinstance(exc, anyio.get_cancelled_exc_class())


def _after(exc: BaseException, error: BaseException) -> None:
    """Give ``exc``, raised while ``error`` was on its way out, ``error`` as the end of its
    context chain, as Python does for an exception raised in an ``except`` or ``finally``
    block: where closing raised it inside a generator (``GeneratorExit`` first), the chain
    would otherwise lose ``error``."""
    seen = {id(error)}
    context = error.__context__
    while context is not None and id(context) not in seen:  # exc may be in error's chain
        seen.add(id(context))
        context = context.__context__
    last = exc
    while id(last) not in seen:
        seen.add(id(last))
        if last.__context__ is None:
            last.__context__ = error
            return
        last = last.__context__


class _Turn:
    """A pass's one consumer: the task taking its batches, and the step (``__anext__``) it
    is in, which :meth:`_Iteration.aclose` from another task cancels and waits for: the
    consumer's loop then ends as at the source's end, with no batch after the close."""

    __slots__ = ("over", "scope", "task")

    def __init__(self) -> None:
        self.task: tuple[int, str] | None = None  # id, name
        self.scope: anyio.CancelScope | None = None  # the step in progress
        self.over: anyio.Event | None = None  # set as that step ends, when one waits for it

    def claim(self, holding: bool) -> None:
        """Make the calling task the consumer, or refuse it while another task takes a batch
        or is ``holding`` one (the next batch asked for would give it back to the pool, its
        buffers reused under that task's work)."""
        task = anyio.get_current_task()
        other = self.task
        if other is not None and other[0] != task.id and (self.scope is not None or holding):
            who, whose = (
                (f"task {task.name!r}", f"task {other[1]!r}")
                if task.name != other[1]
                else (f"a task named {task.name!r}", "another task of that name")
            )
            raise RuntimeError(
                f"{who} asks for a batch of a DataLoader pass that {whose} is consuming: a "
                "batch is valid until its consumer asks for the "
                "next, so two consumers would reuse each other's buffers under their work. "
                "Iterate a pass in one task (hand work to others from there), or make a "
                "DataLoader per task"
            )
        self.task = (task.id, task.name or "")

    async def take(self, get: Callable[[], Awaitable[Batch]]) -> Batch | None:
        """``await get()`` in a scope that :meth:`end` cancels; None if it did."""
        self.scope = scope = anyio.CancelScope()
        try:
            with scope:
                return await get()
            return None
        finally:
            self.scope = None
            if self.over is not None:
                self.over.set()

    async def end(self) -> None:
        """Cancel the step in progress, if any, and wait until it ends (unless it is the
        calling task's own: an async transform closing its loader)."""
        if self.scope is not None:
            self.over = anyio.Event()
            self.scope.cancel()
            if self.task is None or self.task[0] != anyio.get_current_task().id:
                await self.over.wait()

    def stop(self) -> None:
        """Cancel the step in progress, if any (nothing is awaited)."""
        if self.scope is not None:
            self.scope.cancel()


class _Source:
    """The source's items, one at a time (``_END`` after the last)."""

    def __init__(self, source: Iterable[Any] | AsyncIterable[Any], checkpoint: bool) -> None:
        self._async = isinstance(source, AsyncIterable)
        self._items: Any = aiter(source) if self._async else iter(source)  # type: ignore[arg-type]
        # produced inside __anext__: a long sync source still lets others run between items
        # (running ahead, the credits bound what one turn takes)
        self._checkpoint = checkpoint

    async def next(self) -> Any:
        if self._async:
            try:
                return await self._items.__anext__()
            except StopAsyncIteration:
                return _END
        if self._checkpoint:
            await anyio.lowlevel.checkpoint()
        return next(self._items, _END)

    async def aclose(self) -> None:
        """Close an async source (an async generator's ``finally`` runs), shielded."""
        if self._async and hasattr(self._items, "aclose"):
            with anyio.CancelScope(shield=True):
                await self._items.aclose()


class _Here:
    """Production inside ``__anext__`` (a plain ``async for``, no task group to run ahead in):
    each step fills up to ``prefetch`` batches ahead, none while the consumer works."""

    def __init__(self, plan: Plan, staging: Staging, source: _Source) -> None:
        self._plan = plan
        self._staging = staging
        self._source = source
        self._inflight: deque[Batch] = deque()
        self._exhausted = False
        self._error: BaseException | None = None  # raised once the batches before it are out

    async def take(self) -> Batch:
        """Fill up to ``prefetch`` batches ahead; an error from the source or the transform
        comes out in its turn, after the batches before it (as when running ahead)."""
        staging = self._staging
        while len(self._inflight) < self._plan.prefetch and not self._exhausted:
            try:
                item = await self._source.next()
                if item is _END:
                    self._exhausted = True
                    break
                slot = await staging.take_slot()
                self._inflight.append(staging.enqueue(slot, await staging.prepare(item, slot)))
            except BaseException as exc:
                if _cancelled(exc) or not self._inflight:
                    raise
                self._error, self._exhausted = exc, True
        if not self._inflight:
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise StopAsyncIteration
        return self._inflight.popleft()

    async def end(self) -> None:
        """Drop the batches filled and not handed out (their slots go with the pool)."""
        self._inflight.clear()

    def stop(self) -> None:
        """Nothing runs between steps: nothing to stop."""


def _prepare_in_thread(
    me: weakref.ref[_Ahead], call_soon: Callable[[Callable[[], object]], object]
) -> None:
    """A worker thread's loop (``_Ahead._thread_worker``). It reaches the producer, and its
    queue of jobs, through a weak reference only: the pooled thread that ran it may hold it a
    moment after reporting that it returned, and the pass (its stream, events and buffers, and
    the jobs left queued when it stopped) must not outlive its last use on that account."""
    ahead = me()
    assert ahead is not None  # the task awaiting this thread holds it
    queue = ahead.jobs
    while (job := queue.get()) is not None and not ahead.stopping:
        try:
            assert job.slot is not None
            job.result = ahead.staging.transform_and_fill(job.item, job.slot)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            job.error = exc
        finally:
            job.item = None  # pragma: no mutate (equivalent: the field is not read again)
            call_soon(functools.partial(ahead.prepared, job))


class _Ahead:
    """Production run ahead in the ``async with`` block's tasks: the producer and its workers,
    and the batches (or the first error, in its turn) they hand the consumer in source order."""

    def __init__(
        self,
        plan: Plan,
        staging: Staging,
        source: _Source,
        limiter: anyio.CapacityLimiter,
        runner: anyio.abc.TaskGroup,
    ) -> None:
        self._plan = plan
        self.staging = staging
        self._source = source
        self._limiter = limiter
        #: the jobs for worker threads (None: no more), in source order
        self.jobs: SimpleQueue[_Job | None] = SimpleQueue()
        self._credits = plan.prefetch  # items the producer may take from the source
        self._wake = anyio.Event()  # set when the producer may go on
        self._pending: deque[_Job] = deque()  # taken from the source, in its order
        self._ready_send, self._ready = anyio.create_memory_object_stream[Batch | _Failed](
            math.inf  # bounded by the credits
        )
        self._scope = anyio.CancelScope()
        self.stopping = False  # read by worker threads: take no more items
        self._stopped = anyio.Event()
        runner.start_soon(self._run, name=f"{_NAME} producer on {plan.device}")

    async def take(self) -> Batch:
        try:
            got = await self._ready.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):  # ended, or closed meanwhile
            raise StopAsyncIteration from None
        if isinstance(got, _Failed):
            raise got.error
        self._credits += 1  # the producer may take one more item from the source
        self._wake.set()
        return got

    async def _run(self) -> None:
        """The producer: keep up to ``prefetch`` items between the source and the consumer,
        each with a slot, queued for the workers; enqueue the copies of the prepared ones in
        source order and hand their batches (or the first error, in its turn) to the consumer.
        One task does all of it, woken by the consumer taking a batch (which returns a credit);
        a worker done with an item hands out what is ready itself (:meth:`prepared`)."""
        plan = self._plan
        work_send, work = anyio.create_memory_object_stream[_Job](math.inf)  # to worker tasks
        in_threads = plan.in_threads
        queue = self.jobs
        pending = self._pending
        ended = False
        started = 0  # workers: one more with each item taken, up to plan.workers
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    call_soon = _waiting.threadsafe_caller()

                    def start_worker() -> None:
                        name = f"{_NAME} worker {started}"
                        if in_threads:
                            tg.start_soon(self._thread_worker, call_soon, name=name)
                        else:
                            tg.start_soon(self._task_worker, work, name=name)

                    try:
                        while True:
                            while self._credits and not ended:  # take what the credits allow
                                job = _Job(None)
                                try:
                                    job.item = await self._source.next()
                                except BaseException as exc:  # the source failed: in its turn
                                    if _cancelled(exc):
                                        raise
                                    job.error, job.done = exc, True
                                    ended = True
                                else:
                                    if job.item is _END:
                                        ended = True
                                        # the workers hand out the rest
                                        break  # pragma: no mutate (equivalent: see above)
                                    self._credits -= 1
                                    job.slot = await self.staging.take_slot()
                                    if started < plan.workers:  # no idle threads or tasks
                                        start_worker()
                                        started += 1
                                    if in_threads:
                                        queue.put(job)
                                    else:
                                        work_send.send_nowait(job)
                                pending.append(job)
                            if self._hand_out():
                                return
                            if ended and not pending:
                                return
                            await self._wake.wait()
                            self._wake = anyio.Event()
                    except BaseException:  # failure or cancellation: drop the items queued
                        self.stopping = True
                        raise
                    finally:  # the workers finish what they hold, and leave
                        work_send.close()
                        for _ in range(started):
                            queue.put(None)
        finally:
            for stream in (work_send, work, self._ready_send):
                stream.close()
            self._stopped.set()

    def prepared(self, job: _Job) -> None:
        """A worker is done with ``job`` (called on the loop's thread): hand out what is ready
        now, with no trip through the producer task."""
        job.done = True
        if self.stopping:  # stopped by a failure or a cancellation: nothing more goes out
            return
        if self._hand_out():
            return
        if not self._pending:
            self._wake.set()  # the producer may have been waiting for the last one

    def _hand_out(self) -> bool:
        """Enqueue the copies of the prepared items at the head of the queue, in source order,
        and hand their batches to the consumer; at an error, hand that out instead and stop
        everything (nothing after it is handed out). Return whether it stopped."""
        pending = self._pending
        while pending and pending[0].done:
            job = pending.popleft()
            if job.error is None:
                try:
                    assert job.slot is not None and job.result is not None
                    batch = self.staging.enqueue(job.slot, job.result)
                except Exception as exc:  # a failed device, memory refused: in its turn
                    job.error = exc
                else:
                    job.result = None
                    self._ready_send.send_nowait(batch)
                    continue
            self._ready_send.send_nowait(_Failed(job.error))
            self.stopping = True
            self._scope.cancel()
            return True
        return False

    async def _task_worker(self, work: anyio.abc.ObjectReceiveStream[_Job]) -> None:
        """Prepare items on the event loop: an async transform, or a sync one in place."""
        async for job in work:
            try:
                assert job.slot is not None
                job.result = await self.staging.prepare(job.item, job.slot)
            except BaseException as exc:
                if _cancelled(exc):
                    raise  # not handed out: nothing is, once cancelled
                job.error = exc
            finally:
                job.item = None  # pragma: no mutate (equivalent: the field is not read again)
            self.prepared(job)

    async def _thread_worker(self, call_soon: Callable[[Callable[[], object]], object]) -> None:
        """Prepare items in one worker thread, which takes the next as soon as it is done with
        one: it never waits for the event loop between items (the loop, busy with staging and
        the consumer, would otherwise hold it back on a machine with few cores)."""

        work = functools.partial(_prepare_in_thread, weakref.ref(self), call_soon)
        await anyio.to_thread.run_sync(work, limiter=self._limiter)

    async def end(self) -> None:
        """Stop the producer and its workers, wait until they have, and drop the batches
        staged and not handed out."""
        self._scope.cancel()
        await self._stopped.wait()
        self._ready.close()

    def stop(self) -> None:
        """Stop producing (nothing is awaited)."""
        self.stopping = True
        self._scope.cancel()
        self._ready.close()


def _handed_out(device: Device, began: float) -> None:
    """Tell the listeners a batch went out, and how long its consumer waited for it."""
    if _hooks.listeners:
        _hooks.loader_batch(str(device), time.monotonic() - began)


class _Iteration(AsyncIterator[Batch]):
    """One pass over the source, its consumer's side: it owns the staging and one of the two
    ways of producing, inside ``__anext__`` (:class:`_Here`) or ahead in ``runner``'s tasks
    (:class:`_Ahead`)."""

    def __init__(self, plan: Plan, runner: anyio.abc.TaskGroup | None) -> None:
        self._device = plan.device
        limiter = anyio.CapacityLimiter(plan.workers)  # worker threads, this pass's own
        self.staging = Staging(plan, limiter)
        self._source = _Source(plan.source, checkpoint=runner is None)
        # nothing more is handed out
        self._closed = False
        self._closing: anyio.Event | None = None  # aclose has begun; set once it has finished
        self._turn = _Turn()
        self.batches = 0
        self.run_ahead = runner is not None
        self._producer: _Here | _Ahead = (
            _Here(plan, self.staging, self._source)
            if runner is None
            else _Ahead(plan, self.staging, self._source, limiter, runner)
        )

    async def __anext__(self) -> Batch:
        if self._closed:
            raise StopAsyncIteration
        self._turn.claim(holding=self.staging.held is not None)
        began = time.monotonic()
        try:
            self.staging.release_held()
            batch = await self._turn.take(self._producer.take)
            if batch is None or self._closed:  # closed meanwhile: its slot goes with the pool
                raise StopAsyncIteration
            consumer = current_stream(self._device)
            consumer.wait_event(batch.ready)  # the host does not wait
            self.staging.hold(batch, consumer)
            self.batches += 1
            _handed_out(self._device, began)
            return batch
        except BaseException as exc:
            await self.close_after(exc)
            raise

    async def aclose(self) -> None:
        """Stop: hand nothing more out, let the copies in flight land, return every buffer.

        Stopping waits for a transform running in a worker thread to return (a thread cannot
        be interrupted). A cancelled caller does not wait for the copies: their buffers are
        freed by the device once the copies complete. The consumer's own work on the last
        batch is the consumer's to await.
        """
        if self._closing is not None:  # by another task too: return once it is closed
            await self._closing.wait()
            return
        self._closed = True
        self._closing = anyio.Event()
        self.staging.give_back()
        try:
            with anyio.CancelScope(shield=True):  # the producer and its workers stop at once
                await self._turn.end()  # the consumer's step, in another task, ends first
                await self._producer.end()
            await self.staging.settle()  # not shielded: leaving under cancellation is bounded
        except AiostreamError:
            pass  # a failed (or reset) device: its awaits report that; cleanup must not
        finally:
            self.staging.drop()
            try:
                await self._source.aclose()
            finally:
                self._closing.set()

    def stop(self) -> None:
        """Stop producing, from any task of the loop (nothing is awaited). The batch the
        consumer holds goes back to the pool (its buffers wait for the consumer's stream), so
        the device frees nothing still in use if the pass is dropped now; :meth:`aclose`
        still closes the source and waits for the copies."""
        self._closed = True
        self.staging.give_back()
        self._turn.stop()
        self._producer.stop()

    async def close_after(self, error: BaseException) -> None:
        """:meth:`aclose` while ``error`` is on its way out: a cancellation seen while
        closing does not replace an error of the consumer's, source's or transform's (the
        cancellation is delivered again at the caller's next checkpoint), but it does replace
        the source's end (``StopAsyncIteration``), which no checkpoint follows. Anything else
        closing raises is raised, with ``error`` in its context chain."""
        try:
            await self.aclose()
        except BaseException as exc:
            if isinstance(error, StopAsyncIteration):
                raise  # the end is no error: the loop's end needs no context
            if not (_cancelled(exc) and not _cancelled(error)):
                _after(exc, error)
                raise


class DataLoader(AsyncIterable[Batch]):
    """Feed a device from async Python: host preparation, copies and compute all at once.

    Args:
        source: a sync or async iterable of numpy arrays, or of tuples or dicts of them.
        transform: called on each item on the host, before its copy; sync or async.
        device: where the batches go; None for the default device.
        prefetch: how many items the loader works on ahead of the consumer: taken from the
            source and not yet handed out (>= 1, and >= ``workers``). None: ``2 * workers``,
            so that each worker has its next item waiting when it is done with one.
        workers: how many transforms may run at once (>= 1). Batches keep the source's order.
            More than one needs ``async with`` (the workers are tasks the block owns).
        to_thread: run a sync ``transform`` in worker threads (for CPU-heavy work that releases
            the GIL, as numpy does). None: True when ``workers > 1``.

    Example:
        >>> import anyio, numpy as np, aiostream as ais
        >>> async def main():
        ...     source = (np.full(4, i, np.float32) for i in range(3))
        ...     async with ais.DataLoader(source, device="virtual:0") as loader:
        ...         async for batch in loader:
        ...             ais.delay(0.001)  # your kernels, on the current stream
        ...     await ais.current_stream("virtual:0").synchronize()
        >>> anyio.run(main)

    Iterated inside ``async with``, the loader runs ahead in its own tasks: up to ``prefetch``
    items are taken from the source, transformed (``workers`` at once), staged and copied while
    the consumer works. A plain ``async for`` produces inside each step of the loop instead.

    Buffers: up to ``prefetch + 2`` slots of staging and device buffers, each allocated when
    first needed, then reused (again only when an item's shapes change);
    ``stats.peak_in_use`` never exceeds it. An item takes its slot when it leaves the source,
    so workers add no buffers to the pool, and a worker starts only when an item is there for
    it.

    An exception from ``transform`` or the source (``KeyboardInterrupt`` too) is raised by
    ``async for`` in its turn, after the batches before it, as itself. That, breaking out of
    ``async for`` with a plain loop, or cancelling the consumer stops production at once;
    inside ``async with``, production stops at the block's exit (a loop left early has at most
    ``prefetch`` items produced ahead until then). ``async with`` (or :meth:`aclose`) also
    waits for the copies already in flight and returns every buffer before it exits; under
    cancellation it does not wait, and the device frees those buffers once their copies
    complete. :meth:`aclose` from another task ends the consumer's ``async for`` as the end of
    the source does. In an async generator, close the generator where it runs
    (``contextlib.aclosing``).
    """

    def __init__(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        *,
        transform: Callable[[Any], Any] | None = None,
        device: Device | str | None = None,
        prefetch: int | None = None,
        workers: int = 1,
        to_thread: bool | None = None,
    ) -> None:
        if not isinstance(source, (Iterable, AsyncIterable)):
            raise TypeError(f"source must be an iterable or async iterable, got {source!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable or None, got {transform!r}")
        workers = _check.integer(workers, "workers", minimum=1)
        if prefetch is None:
            prefetch = 2 * workers
        prefetch = _check.integer(prefetch, "prefetch", minimum=1, what="an int or None")
        if prefetch < workers:
            raise ValueError(
                f"prefetch ({prefetch}) must be >= workers ({workers}): each worker transforms "
                "an item ahead of the consumer; raise prefetch or leave it None"
            )
        if to_thread is not None:
            _check.flag(to_thread, "to_thread")
        # An async transform runs on the loop (``workers`` of them at once), never in a thread.
        async_transform = inspect.iscoroutinefunction(transform) or (
            inspect.iscoroutinefunction(getattr(transform, "__call__", None))  # noqa: B004
        )
        in_threads = (workers > 1 if to_thread is None else to_thread) and not async_transform
        self.prefetch = prefetch
        self.workers = workers
        self.device = _resolve_device(device)
        self._plan = Plan(source, transform, in_threads, prefetch, workers, self.device)
        self._iterations: weakref.WeakSet[_Iteration] = weakref.WeakSet()
        self._last: _Iteration | None = None
        self._runner: anyio.abc.TaskGroup | None = None
        # the task that entered 'async with'
        self._owner: object = None  # pragma: no mutate (equivalent: __aenter__ sets it first)

    def __aiter__(self) -> _Iteration:
        if self._runner is None and self.workers > 1:
            raise RuntimeError(
                f"workers={self.workers} runs transforms in the loader's own tasks, which live "
                "in its 'async with' block: write 'async with DataLoader(...) as loader: "
                "async for batch in loader: ...' (or use workers=1)"
            )
        iteration = _Iteration(self._plan, self._runner)
        self._iterations.add(iteration)
        self._last = iteration
        return iteration

    @property
    def stats(self) -> LoaderStats:
        """Counters of the latest pass over the source."""
        it = self._last
        if it is None:
            return LoaderStats(0, 0, self.prefetch + 2, 0, False, self.workers)
        pool = self.prefetch + 2
        staging = it.staging
        return LoaderStats(
            it.batches, staging.allocations, pool, staging.peak_in_use, it.run_ahead, self.workers
        )

    async def aclose(self) -> None:
        """Close every pass still open (see :meth:`_Iteration.aclose`)."""
        await self._close_after(None)

    async def _close_after(self, error: BaseException | None) -> None:
        """Close every pass; with ``error`` on its way out, see :meth:`_Iteration.close_after`."""
        for iteration in list(self._iterations):
            if error is None:
                await iteration.aclose()
            else:
                await iteration.close_after(error)

    async def __aenter__(self) -> DataLoader:
        if self._runner is not None:
            raise RuntimeError(
                "this DataLoader is already open in an 'async with' block: iterate it there, "
                "or make another DataLoader for a second block"
            )
        runner = anyio.create_task_group()
        await runner.__aenter__()
        self._runner = runner
        self._owner = anyio.get_current_task().id
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        runner, self._runner = self._runner, None
        if runner is not None and anyio.get_current_task().id != self._owner:
            for iteration in list(self._iterations):  # the producers stop; the runner's
                iteration.stop()  # scope is the entering task's, left open by its generator
            raise RuntimeError(
                "this DataLoader's 'async with' block is being left from another task than "
                "the one that entered it: an async generator holding it was not closed where "
                "it ran. Wrap the generator in 'contextlib.aclosing(...)' (and iterate it in "
                "an 'async with' of that), or iterate the loader with a plain 'async for' "
                "(no 'async with') inside the generator"
            )
        try:
            await self._close_after(exc)
        finally:
            if runner is not None:
                await self._close_runner(runner, (exc_type, exc, tb))

    @staticmethod
    async def _close_runner(runner: anyio.abc.TaskGroup, exc_info: Any) -> None:
        exc = exc_info[1]
        if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
            await runner.__aexit__(*exc_info)  # a cancellation ends at its own scope
            return
        # The loader's tasks have stopped and hand their errors to the consumer, so the group
        # has nothing to add: close it clean, and the block's own exception goes on as it was
        # raised, never wrapped in an exception group.
        try:
            await runner.__aexit__(None, None, None)
        except BaseException:  # noqa: S110 - a cancellation seen while closing
            pass

    def __repr__(self) -> str:
        return (
            f"<aiostream.DataLoader on {self.device} prefetch={self.prefetch} "
            f"workers={self.workers}>"
        )
