"""One awaitable for every completion: ``await aiostream.wait(handle)`` for the handles of
other libraries (collectives, transfers, arrays, futures) as for aiostream's own events.

Each event loop has one :class:`_Poller`, made on the first foreign wait and gone once none is
left. Handles that can call back (futures) are never polled: the callback, inline or on any
thread, hops to the loop once (hops coalesced: one in flight at a time). Handles that can only
be asked are asked by the poller, all of them on each sweep, at a pace set by the completion
rate: every ``MIN_S`` right after a completion or a new wait, then half the time since the last
one, but no more than half the usual time between completions while the next is due (until
``OVERDUE`` times that), up to ``CAP_S``, and ``IDLE_CAP_S`` once nothing has completed or
begun for ``IDLE_AFTER_S``. ``MIN_S`` is 1 ms: asyncio's and trio's timers round up to it
anyway. A sweep of 1,000 handles costs 0.1-0.2 ms, about what the wake itself costs: the idle
pace is what keeps 1,000 pending handles under 1 % of a core. It stays capped, since asking
drives some libraries' progress (NIXL's). Each handle is asked once per sweep, never twice (an
answer may be consumed: a notification); deadlines are the waiting tasks' own timers.

Waits keep the GPU waits' contract: they are listed by ``pending_waits()`` (the handle's
kind as the device), watched by the watchdog and told to the listeners (the profiler,
metrics, spans); cancelling one removes it at once, and leaves the work alone
unless the adapter says how to cancel it (``on_cancel``); a polled handle whose wait was
cancelled is kept, and asked at the slowest pace, until its work is done.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import deque
from typing import Any

import anyio
import anyio.lowlevel

from .. import _check, _diagnostics, _hooks, _waiting
from .._errors import AiostreamError, CompletionError
from ..event import Event
from ..stream import Stream
from . import adapters
from .adapters import Adapter

__all__ = ["CAP_S", "IDLE_CAP_S", "MIN_S", "wait"]

logger = logging.getLogger("aiostream")

MIN_S = 1e-3  #: the fastest pace of the poller: right after a completion or a new wait
CAP_S = 50e-3  #: the slowest while handles complete now and then
BACKOFF = 0.5  #: between the two: this fraction of the time since the last completion,
OVERDUE = 8  #: ... or of the usual time between completions, until this many of it have passed
GAP_WEIGHT = 0.2  #: the usual time between completions: this weight to the newest
IDLE_AFTER_S = 1.0  #: nothing completed or begun for this long: the idle pace
IDLE_CAP_S = 0.1  #: the idle pace, and that of the handles of cancelled waits
_loop_time = anyio.current_time

_pollers: anyio.lowlevel.RunVar[_Poller] = anyio.lowlevel.RunVar("aiostream_completions")


class _Wait:
    """One pending wait on a foreign handle. Small: a program may have 10,000 of them."""

    __slots__ = (
        "adapter",
        "ask",
        "dead",
        "error",
        "finished",
        "handle",
        "parked",
        "poller",
        "record",
        "since",
    )

    def __init__(self, poller: _Poller, handle: Any, adapter: Adapter, record: Any) -> None:
        self.poller = poller
        self.handle = handle  # kept alive until its work is done, or the adapter cancels it
        self.adapter = adapter
        self.record = record
        self.ask = adapters.asker(adapter, handle)
        self.parked = poller.hooks.park()
        self.since = _loop_time()
        self.error: BaseException | None = None
        self.finished = False
        self.dead = False

    def __call__(self, *_: object) -> None:
        """The handle's callback: its work is done. Any thread, or at once."""
        self.poller.told(self)


class _Poller:
    """The foreign waits of one event loop: asks the polled handles, finishes the waits whose
    handles called back, and watches them all for the watchdog."""

    def __init__(self) -> None:
        self.hooks = _waiting.loop_calls()
        self._thread = threading.get_ident()
        self._live: dict[_Wait, None] = {}  # every pending wait, oldest first
        self._polled: list[_Wait] = []  # the waits asked on each sweep, and cancelled ones kept
        self._asks: list[Any] = []  # their ``ask``, in the same order: a sweep's one loop
        self._orphans = 0  # cancelled waits whose handles are kept until done
        self._timed = 0  # polled waits whose adapter says when they will be done (eta)
        self._stale = False  # a polled wait was cancelled and let go: drop it on the next sweep
        self._due: deque[_Wait] = deque()  # called back from another thread, not finished yet
        self._hop_sent = False
        self._last = _loop_time()  # the last completion or new wait
        self._found_at: float | None = None  # the last sweep that found completions
        self._gap: float | None = None  # the usual time between completions (an average)
        self._running = False
        self._scope: anyio.CancelScope | None = None
        self._wake_at = math.inf  # when the sleep under way ends
        self._task: object = None  # strongly held: asyncio keeps tasks weakly

    # ---------------------------------------------------------------- from the waiting tasks

    def add(self, wait: _Wait) -> None:
        self._live[wait] = None
        adapter = wait.adapter
        call_back = adapter.call_back
        polled = call_back is None
        if call_back is not None:
            try:
                polled = call_back(wait.handle, wait) is False
                if polled and wait.ask is None:
                    raise TypeError("call_back returned False, and the adapter has no done")
            except Exception as exc:
                self.finish(wait, _refused(wait, "call_back", exc))
                return
        if polled:
            self._polled.append(wait)
            self._asks.append(wait.ask)
            if adapter.eta is not None:
                self._timed += 1
            self._last = wait.since
            if self._scope is not None and self._wake_at > self._last + MIN_S:
                self._scope.cancel()  # sleeping long: come back at the fast pace
        elif _diagnostics.watchdog_threshold() is not None and self._scope is not None:
            self._scope.cancel()  # plan the watchdog's look at it
        if not self._running:
            self._running = True
            self._task = self.hooks.spawn(self._run)

    def cancel(self, wait: _Wait) -> None:
        """Forget a wait whose task was cancelled or timed out."""
        if wait.finished or wait.dead:
            return
        wait.dead = True
        self._live.pop(wait, None)
        on_cancel = wait.adapter.on_cancel
        if on_cancel is not None:
            try:
                on_cancel(wait.handle)
            except Exception:
                logger.exception("aiostream: on_cancel of %s failed", wait.adapter.kind)
        elif wait.ask is not None and wait.adapter.call_back is None:
            self._orphans += 1  # asked on, until done, to keep its handle alive that long
            return
        self._stale = True  # a polled one is dropped on the next sweep
        wait.handle = None  # a callback keeps its handle alive itself
        if not self._live and self._scope is not None:
            self._scope.cancel()  # nothing left: let the task end

    # ---------------------------------------------------------------- completions

    def told(self, wait: _Wait) -> None:
        """``wait``'s handle called back; any thread."""
        if threading.get_ident() == self._thread and self.hooks.running_here():
            self.finish(wait, None)
            return
        self._due.append(wait)
        if not self._hop_sent:
            self._hop_sent = True
            try:
                self.hooks.soon_threadsafe(self._hopped)
            except RuntimeError:  # the loop has closed: nothing will run its waits
                if self.hooks.gone():
                    self.forsake()

    def _hopped(self) -> None:
        self._hop_sent = False
        due = self._due
        while due:
            self.finish(due.popleft(), None)

    def finish(self, wait: _Wait, error: BaseException | None) -> None:
        if wait.finished or wait.dead:
            return
        wait.finished = True
        wait.error = error
        self._live.pop(wait, None)
        if not self._live and self._scope is not None:
            self._scope.cancel()  # nothing left: let the task end
        parked = wait.parked
        if self.hooks.on_trio:
            parked.set()
        elif not parked.done():  # else cancelled: its task is on its way out
            parked.set_result(None)

    # ---------------------------------------------------------------- the poller task

    def _sweep(self, now: float) -> float | None:
        """Ask every polled handle once; return how long to sleep (None: until told)."""
        if self._stale:  # waits let go by a cancellation: never ask their handles again
            self._polled = [w for w in self._polled if not (w.dead and w.handle is None)]
            self._asks = [w.ask for w in self._polled]
            self._timed = sum(1 for w in self._polled if w.adapter.eta is not None)
            self._stale = False
        if not self._polled:
            return None
        # The common case, in the cheapest loop: nothing raises, nothing completes. The first
        # handle that says yes (or raises) hands the rest of the sweep to _next, which goes on
        # from there in a loop as cheap.
        asks = self._asks
        ask: Any = None
        error: Exception | None = None
        try:
            for ask in asks:
                if ask():
                    break
            else:
                ask = None
        except Exception as exc:
            error = exc
        if ask is not None:
            found = [(_position(asks, ask), error)]
            while (hit := _next(asks, found[-1][0] + 1)) is not None:
                found.append(hit)
            completed = self._settle(found)
            if completed:
                self._completed(now, completed)
            found.clear()  # the first error's traceback holds this frame: no cycle kept
        ask = error = None  # (the same)
        if len(self._polled) == self._orphans:  # only cancelled waits' handles: no hurry
            return IDLE_CAP_S if self._polled else None
        since = paced = now - self._last
        gap = self._gap
        if gap is not None and since < OVERDUE * gap:  # the next one is due: keep its pace
            paced = min(since, gap)
        cap = CAP_S if since < IDLE_AFTER_S else IDLE_CAP_S
        delay = min(cap, max(MIN_S, paced * BACKOFF))
        if self._timed:
            for wait in self._polled:
                if wait.adapter.eta is not None and not wait.dead:
                    delay = min(delay, _eta(wait))
        return delay

    def _completed(self, now: float, count: int) -> None:
        """A sweep found ``count`` waits done: the pace starts again, and learns their rate."""
        self._last = now
        if self._found_at is not None:
            gap = (now - self._found_at) / count
            if self._gap is None:
                self._gap = gap
            else:  # a pause counts as OVERDUE gaps at most: it slows the pace, never resets it
                self._gap += GAP_WEIGHT * (min(gap, OVERDUE * self._gap) - self._gap)
        self._found_at = now

    def _settle(self, found: list[tuple[int, Exception | None]]) -> int:
        """Drop the polled waits at the indices ``found`` (ascending), whose handles said they
        are done or whose asks raised the error beside them, and finish them; return how many
        completed."""
        polled, asks = self._polled, self._asks
        settled = [(polled[i], error) for i, error in found]
        for i, _ in reversed(found):
            del polled[i], asks[i]
        completed = 0
        for wait, error in settled:
            if wait.adapter.eta is not None:
                self._timed -= 1
            if wait.finished:
                continue
            if wait.dead:  # a cancelled wait's handle, kept until now
                self._orphans -= 1
                wait.handle = None
            elif error is not None:
                self.finish(wait, _refused(wait, "done", error))
            else:
                self.finish(wait, None)
                completed += 1
        settled = []  # a kept error's frame must not hold it
        return completed

    def _watchdog(self, now: float) -> float | None:
        """Warn of waits past the threshold; return the seconds until the next one is due."""
        threshold = _diagnostics.watchdog_threshold()
        if threshold is None:
            return None
        watched = [w for w in self._live if not w.record.warned]
        _diagnostics.warn_late([w.record for w in watched if now - w.since >= threshold])
        pending = [w.since for w in watched if not w.record.warned]
        return min(pending) + threshold - now if pending else None

    async def _run(self) -> None:
        try:
            while self._live or self._orphans:
                now = _loop_time()
                delay = self._sweep(now)
                due = self._watchdog(now)
                if due is not None:
                    delay = due if delay is None else min(delay, due)
                if not (self._live or self._orphans):
                    break
                with anyio.CancelScope() as scope:
                    self._scope = scope
                    if delay is None:
                        self._wake_at = math.inf
                        await anyio.sleep_forever()
                    else:
                        self._wake_at = now + delay
                        await anyio.sleep(delay)
                self._scope = None
        except anyio.get_cancelled_exc_class():
            self._abandon("was cancelled (is the event loop shutting down?)")
            raise
        except Exception as exc:  # a bug: never crash the loop, never leave a wait hanging
            logger.exception("aiostream's poller failed; failing its pending waits")
            self._abandon(f"failed: {exc!r}")
        finally:
            self._scope = None
            self._running = False
            self._found_at = None  # the time until the next completion is no gap of theirs

    def _abandon(self, why: str) -> None:
        for wait in list(self._live):
            self.finish(wait, AiostreamError(f"aiostream's poller of foreign handles {why}"))
        self._polled.clear()
        self._asks.clear()
        self._orphans = self._timed = 0

    # ---------------------------------------------------------------- _diagnostics.Owner

    def gone(self) -> bool:
        return self.hooks.gone()

    def forsake(self) -> None:
        """The loop closed with waits pending: forget them, as a cancellation would."""
        for wait in list(self._live):
            wait.dead = True
            _diagnostics.unregister(wait.record)
        self._live.clear()
        self._polled.clear()
        self._asks.clear()
        self._orphans = self._timed = 0


def _position(asks: list[Any], ask: Any) -> int:
    """Where ``ask`` is in ``asks``, by identity: two waits on one handle have equal asks."""
    for i, other in enumerate(asks):
        if other is ask:
            return i
    raise AssertionError("an ask the sweep made is not in its list")  # pragma: no cover


def _next(asks: list[Any], start: int) -> tuple[int, Exception | None] | None:
    """The index of the first ask from ``start`` on that says yes or raises (and its error)."""
    i = start
    try:
        for i, ask in enumerate(itertools.islice(asks, start, None), start):
            if ask():
                return i, None
    except Exception as exc:
        return i, exc
    return None


def _eta(wait: _Wait) -> float:
    try:
        value = wait.adapter.eta(wait.handle)  # type: ignore[misc]
    except Exception:
        return math.inf
    return math.inf if value is None else max(0.0, float(value))


def _refused(wait: _Wait, what: str, exc: Exception) -> CompletionError:
    record = wait.record
    error = CompletionError(
        f"could not ask {record.subject} ({record.device}) whether it is done: its adapter's "
        f"{what} raised {type(exc).__name__}: {exc}",
        kind=record.device,
        subject=record.subject,
    )
    error.__cause__ = exc
    return error


def _poller() -> _Poller:
    try:
        poller = _pollers.get()
    except LookupError:
        poller = _Poller()
        _pollers.set(poller)
    return poller


def _subject(handle: Any, adapter: Adapter, what: str | None) -> str:
    describe = adapter.describe
    said = None
    if describe is not None:
        try:
            said = describe(handle)
        except Exception:  # a description is never worth a failed wait
            logger.exception("aiostream: describe() of %s failed", adapter.kind)
    if said is None:
        said = f"{type(handle).__qualname__} at 0x{id(handle):x}"
    return said if what is None else f"{what}: {said}"


async def wait(
    handle: object,
    *,
    timeout: float | None = None,
    what: str | None = None,
    adapter: Adapter | None = None,
) -> None:
    """Suspend the calling task until ``handle``'s work is done.

    ``handle`` is anything that says when it is done: an aiostream ``Event`` or ``Stream``
    (awaited as ``synchronize()`` does), another library's CUDA event (through
    :func:`aiostream.as_event`), a future that calls back (``concurrent.futures``,
    ``torch.futures``, Dask's; never polled), ``torch.distributed`` work, a JAX array, or any
    handle with ``done()``, ``is_completed()`` or ``is_ready()`` (asked by the loop's one
    poller, at a pace set by how often handles complete). See ``docs/completions.md``.

    Args:
        handle: what to wait for.
        timeout: seconds to wait at most, then ``TimeoutError`` naming what is late; None
            waits as long as it takes (``anyio.fail_after`` around the call works as well).
        what: what the work is, for ``pending_waits()`` and the watchdog (such as
            ``"all_reduce of grads float32[4096]"``); put before what the adapter says.
        adapter: how to learn that ``handle`` is done, instead of the one found for it.

    Raises:
        TimeoutError: ``timeout`` passed first. The work goes on (or is cancelled, where the
            adapter says how): so does it when the wait is cancelled.
        CompletionError: asking the handle raised; the original is its ``__cause__``.
        TypeError: nothing says when ``handle`` is done.
        Exception: the work failed: the library's own exception (a future's).
    """
    if timeout is not None:
        timeout = _check.seconds(timeout, "timeout", what="a number of seconds or None")
    if what is not None and not isinstance(what, str):
        raise TypeError(f"what must be a str or None, got {what!r}")
    if adapter is not None and not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an aiostream.Adapter or None, got {adapter!r}")
    if adapter is None:
        if isinstance(handle, (Event, Stream)):
            await _timed(handle, timeout)
            return
        if adapters.is_cuda_event(handle):
            from ..interop import as_event

            await _timed(as_event(handle), timeout)
            return
        adapter = adapters.find(handle)
    await _foreign(handle, adapter, timeout, _subject(handle, adapter, what))


async def _timed(awaited: Event | Stream, timeout: float | None) -> None:
    if timeout is None:
        await awaited.synchronize()
        return
    with anyio.move_on_after(timeout) as scope:
        await awaited.synchronize()
    if scope.cancelled_caught:
        raise TimeoutError(f"{awaited!r} was not done after {timeout:g} s; its work goes on")


def _result(adapter: Adapter, handle: Any) -> adapters.Deferred | None:
    """Ask the adapter about done work: it raises the work's error at once, or defers it."""
    if adapter.result is None:
        return None
    outcome = adapter.result(handle)
    return outcome if isinstance(outcome, adapters.Deferred) else None


async def _learn(deferred: adapters.Deferred, deadline: float, subject: str, kind: str) -> None:
    """Await what an adapter deferred (raising the work's error), until ``deadline`` at most."""
    left = None if deadline == math.inf else max(0.0, deadline - anyio.current_time())
    with anyio.CancelScope(deadline=deadline) as scope:
        await deferred.learn(left)
    if scope.cancelled_caught:
        raise TimeoutError(
            f"{subject} ({kind}) was done, but whether it failed was not known by the wait's "
            "deadline"
        )


async def _foreign(handle: Any, adapter: Adapter, timeout: float | None, subject: str) -> None:
    kind = adapter.kind
    deadline = math.inf if timeout is None else anyio.current_time() + timeout
    ask = adapters.asker(adapter, handle)
    deferred = None
    if ask is not None:
        try:
            done = ask()
        except Exception as exc:
            refused = CompletionError(
                f"could not ask {subject} ({kind}) whether it is done: {type(exc).__name__}: {exc}",
                kind=kind,
                subject=subject,
            )
            raise refused from exc
        if done:  # the fast path: one checkpoint, unless learning how it ended takes a wait
            try:
                deferred = _result(adapter, handle)
            except Exception as exc:
                await _waiting.observed(subject, kind, exc)
                raise
            if deferred is None:
                await _waiting.observed(subject, kind)
                return
    task = _waiting.task_name()
    poller = _poller()
    strategy = "poll" if adapter.call_back is None else "callback"
    if deferred is not None:
        strategy = "complete"  # listed while its outcome is learned
    record = _diagnostics.Record(
        task, str, subject, kind, _diagnostics.capture(2), None, poller, strategy
    )
    _diagnostics.register(record)
    told = _hooks.wait_began(subject, kind, strategy) if _hooks.listeners else None
    entry = _Wait(poller, handle, adapter, record)
    raised: BaseException | None = None
    try:
        if deferred is None:
            try:
                poller.add(entry)
                parked = entry.parked
                if deadline == math.inf:  # (no scope: a cancellation reaches the await alike)
                    await (parked.wait() if poller.hooks.on_trio else parked)
                else:
                    with anyio.CancelScope(deadline=deadline):
                        await (parked.wait() if poller.hooks.on_trio else parked)
                if not entry.finished:
                    raise TimeoutError(
                        f"{subject} ({kind}) was not done after {timeout:g} s; its work goes on"
                        + (" (cancelled by its adapter)" if adapter.on_cancel else "")
                    )
            except BaseException:
                poller.cancel(entry)
                raise
            if entry.error is None:
                deferred = _result(adapter, handle)  # the library's own exception, at once
        if deferred is not None:
            await _learn(deferred, deadline, subject, kind)  # ... or once learned
    except BaseException as exc:
        raised = exc
        raise
    finally:
        _diagnostics.unregister(record)
        if told is not None:
            ended = raised if raised is not None else entry.error
            _hooks.wait_ended(told, ended, _waiting.outcome(ended))
        told = raised = ended = None  # a kept error's frame must not hold these
    error = entry.error
    if error is not None:
        del entry, poller, record
        raise error
