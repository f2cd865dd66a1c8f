"""The virtual backend's waits observed from outside, through the backend protocol
(:mod:`.protocol`; ``aiostream/_backends/base.py`` documents each method named here).

Each event loop has one waiter per device while waits are pending on it. The waiter asks the
backend ``wake_hint(index)`` each time it looks, checks a wait by asking its target (what
``stream_target`` or ``event_target`` handed out) ``done()``, and holds a ``subscribe``
for as long as it runs: :func:`spy_on_waits` counts those calls, so a test reads how often the
waiter looked, how many waits it checked, how many waiters run, and how many targets are
still held, without its insides.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import pytest

import aiostream as ais
from tests.helpers.protocol import backend, backend_of, handle_of


class Spy:
    """What the waiters asked of one virtual backend since :func:`spy_on_waits`."""

    def __init__(self, spied: Any) -> None:
        #: the backend spied on (the one in use when the spy began)
        self.backend = spied
        #: ``wake_hint`` calls: one each time a waiter looks
        self.wakes = 0
        #: ``done()`` calls on the targets handed out: one each time a wait is checked
        self.checks = 0
        #: ``stream_target`` and ``event_target`` calls: one per wait that must suspend
        self.targets = 0
        #: the targets handed out that were let go (``release()``, counted once each)
        self.releases = 0
        #: the device index of each ``subscribe``: one per waiter started
        self.subscriptions: list[int] = []
        #: the callbacks subscribed: each waiter's wake-up, which the backend may call from any
        #: thread, however late
        self.callbacks: list[Callable[[], None]] = []
        #: the asyncio task that subscribed (the waiter's own task), None on trio
        self.tasks: list[asyncio.Task[Any] | None] = []
        #: ``unsubscribe`` calls: one per waiter gone
        self.unsubscribed = 0

    @property
    def running(self) -> int:
        """How many waiters run now (subscribed, not yet gone)."""
        return len(self.subscriptions) - self.unsubscribed

    @property
    def outstanding(self) -> int:
        """How many targets handed out are still held (handed out, not let go): the waits the
        backend still counts (``stats().waits``)."""
        return self.targets - self.releases


class _Counted:
    """A target handed out by the backend, counting the checks made of it (the rest of the
    protocol passes through)."""

    __slots__ = ("released", "spy", "target")

    def __init__(self, spy: Spy, target: Any) -> None:
        self.spy = spy
        self.target = target
        self.released = False

    def done(self) -> bool:
        self.spy.checks += 1
        done: bool = self.target.done()
        return done

    def watch(self, callback: Callable[[], None], gone: Callable[[], bool] | None = None) -> None:
        self.target.watch(callback, gone)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.spy.releases += 1
        self.target.release()


def _running_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # trio
        return None


def spy_on_waits(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Count what waiters ask of the virtual backend in use (call it after any ``reset()``:
    a new backend is not spied on)."""
    spied = backend("virtual")
    spy = Spy(spied)
    wake_hint, subscribe = spied.wake_hint, spied.subscribe
    stream_target, event_target = spied.stream_target, spied.event_target

    def counted_wake_hint(index: int) -> float | None:
        spy.wakes += 1
        return wake_hint(index)

    def counted_subscribe(index: int, callback: Callable[[], None]) -> Callable[[], None]:
        spy.subscriptions.append(index)
        spy.callbacks.append(callback)
        spy.tasks.append(_running_task())
        unsubscribe = subscribe(index, callback)

        def counted_unsubscribe() -> None:
            spy.unsubscribed += 1
            unsubscribe()

        return counted_unsubscribe

    # counted once handed out: a call that raises (a failed device, a closed backend) hands
    # out nothing, and leaves nothing to let go
    def counted_stream_target(stream: Any, wake: bool) -> _Counted:
        target = _Counted(spy, stream_target(stream, wake))
        spy.targets += 1
        return target

    def counted_event_target(event: Any, wake: bool) -> _Counted:
        target = _Counted(spy, event_target(event, wake))
        spy.targets += 1
        return target

    monkeypatch.setattr(spied, "wake_hint", counted_wake_hint)
    monkeypatch.setattr(spied, "subscribe", counted_subscribe)
    monkeypatch.setattr(spied, "stream_target", counted_stream_target)
    monkeypatch.setattr(spied, "event_target", counted_event_target)
    return spy


def target_class(stream: ais.Stream) -> type:
    """The class of the wait targets the virtual backend hands out, read from a target of
    ``stream``'s work, let go at once. ``stream`` must have work submitted and no
    ``wait_event`` after it: the target of other streams' work adds a marker to them."""
    target = backend_of(stream).stream_target(handle_of(stream), False)
    target.release()
    return type(target)


def alive(cls: type) -> int:
    """How many objects of ``cls`` are alive in the process, after a collection."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls)
