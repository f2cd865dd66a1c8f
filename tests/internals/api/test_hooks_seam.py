"""The instrumentation seam (``aiostream._hooks``): one kind of plug, the ``Listener``, whose
hooks are no-ops until a listener overrides them. Only the hooks a listener overrides are
called; a submission is bracketed by its listeners' hooks synchronously, in submission order;
a listener's failure is logged once per hook and never changes what the program sees; a token
handed out is handed back, also once the listener is unplugged."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _hooks, _objects
from aiostream.testing import VirtualTime

pytestmark = pytest.mark.anyio


class Log(_hooks.Listener):
    """Notes every hook it overrides, in order, with the calling thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.threads: set[int] = set()

    def _note(self, *call: str) -> str:
        self.calls.append(call)
        self.threads.add(threading.get_ident())
        return call[0]

    def _submit_began(self, name: str, stream: Any) -> Any:
        return self._note(f"before {name}", str(stream.stream_id))

    def _submit_ended(self, token: Any) -> None:
        self._note(token.replace("before", "after"))

    def _wait_began(self, subject: str, device: str, strategy: str) -> Any:
        return self._note("wait", strategy)

    def _wait_ended(self, token: Any, error: BaseException | None, outcome: str) -> None:
        self._note(f"{token} ended", outcome)


@pytest.fixture
def log() -> Iterator[Log]:
    listener = Log()
    _hooks.add_listener(listener)
    try:
        yield listener
    finally:
        _hooks.remove_listener(listener)


def test_a_submission_is_bracketed_in_submission_order(
    virtual_device: ais.Device, log: Log
) -> None:
    """Each submission's hooks run right before and right after it, in the submitting
    thread: what the profiler records there (its marks) brackets that op on its stream."""
    a, b = ais.Stream(), ais.Stream()

    def op(name: str) -> Any:
        return lambda handle: log.calls.append((name,))

    for i in range(2):
        _objects.submit(a, f"a{i}", op(f"a{i}"))
        _objects.submit(b, f"b{i}", op(f"b{i}"))
    assert [c[0] for c in log.calls] == [
        x for n in ("a0", "b0", "a1", "b1") for x in (f"before {n}", n, f"after {n}")
    ]
    assert log.threads == {threading.get_ident()}


def test_a_refused_submission_is_bracketed_too(virtual_device: ais.Device, log: Log) -> None:
    def refused(handle: object) -> None:
        raise KeyError("refused")

    with pytest.raises(KeyError, match="refused"):
        _objects.submit(ais.Stream(), "x", refused)
    assert [c[0] for c in log.calls] == ["before x", "after x"]


async def test_only_the_hooks_a_listener_overrides_are_called(
    virtual_time: VirtualTime, log: Log
) -> None:
    """``Log`` overrides no region, copy or loader hook: none is called on it (the base's
    no-ops are never reached); its wait hooks see the wait."""
    assert log not in _hooks._told["region"] and log in _hooks._told["wait"]
    s = ais.Stream()
    with ais.record_function("step", stream=s):
        ais.delay(0.001, stream=s)
    await s.synchronize()
    assert [c[0] for c in log.calls] == ["before delay", "after delay", "wait", "wait ended"]
    assert log.calls[2:] == [("wait", ais.get_wait_strategy()), ("wait ended", "completed")]


async def test_a_token_is_handed_back_after_the_listener_is_unplugged(
    virtual_time: VirtualTime,
) -> None:
    listener = Log()
    _hooks.add_listener(listener)
    _hooks.add_listener(listener)  # once
    assert _hooks.listeners.count(listener) == 1
    s = ais.Stream()
    ais.delay(1.0, stream=s)

    async def unplug() -> None:
        _hooks.remove_listener(listener)

    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize)
        await anyio.sleep(0.5)
        tg.start_soon(unplug)
    assert listener not in _hooks.listeners
    assert [c[0] for c in listener.calls][-2:] == ["wait", "wait ended"]


class Broken(_hooks.Listener):
    def _wait_began(self, subject: str, device: str, strategy: str) -> Any:
        raise RuntimeError("began")

    def _copied(self, device: str, kind: str, nbytes: int) -> None:
        raise RuntimeError("copied")

    def _holds(self) -> list[Any]:
        raise RuntimeError("holds")


async def test_a_failing_listener_is_said_once_per_hook_and_changes_nothing(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture, log: Log
) -> None:
    broken = Broken()
    _hooks.add_listener(broken)
    try:
        with caplog.at_level(logging.ERROR, "aiostream"):
            s = ais.Stream()
            for _ in range(3):
                ais.delay(0.001, stream=s)
                await s.synchronize()
                _hooks.copied("virtual:0", "h2d", 1)
            assert _hooks.held() == []
    finally:
        _hooks.remove_listener(broken)
    said = sorted(r.getMessage().split(" failed in ")[1].split(" ")[0] for r in caplog.records)
    assert said == ["copied()", "holds()", "wait_began()"]
    assert [c[0] for c in log.calls].count("wait ended") == 3  # the others are told still
    caplog.clear()  # the records' tracebacks hold the stream


def test_a_submission_no_listener_wants_takes_the_fast_path(
    virtual_device: ais.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With only listeners that want no submissions plugged in (tracing, metrics), a
    submission asks nothing more than with none: not whether its stream is capturing."""

    class Waits(_hooks.Listener):
        def _wait_began(self, subject: str, device: str, strategy: str) -> Any:
            return None

    def asked(stream: Any) -> bool:
        raise AssertionError("a submission no listener wants asked whether it is captured")

    monkeypatch.setattr(_objects, "capturing", asked)
    monkeypatch.setattr(_objects._captures, "under_way", lambda where: True)
    listener = Waits()
    _hooks.add_listener(listener)
    s = ais.Stream(virtual_device)
    try:
        ais.delay(0.001, stream=s)
    finally:
        _hooks.remove_listener(listener)
    s.synchronize_blocking()
    assert _hooks.listeners == ()
