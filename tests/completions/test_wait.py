"""``aiostream.wait()`` of foreign handles: handles that can only be asked share one poller
per loop, futures call back and are never asked, and every wait keeps the GPU waits' contract
(cancellation at once, timeouts, errors, ``pending_waits()``, the watchdog, the listeners),
on asyncio, uvloop and trio."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import aiostream as ais
import aiostream.tracing
from tests.helpers.deadlines import deadline, until

pytestmark = pytest.mark.anyio


class Handle:
    """Done once ``finish()`` is called, or once the monotonic clock passes ``at``; counts the
    times it was asked."""

    def __init__(self, at: float = float("inf")) -> None:
        self.at = at
        self.asked = 0
        self.finished = False

    def finish(self) -> None:
        self.finished = True

    def done(self) -> bool:
        self.asked += 1
        return self.finished or time.monotonic() >= self.at


class Completed(Handle):
    """Says it is done with another method's name (torch.distributed's)."""

    def is_completed(self) -> bool:
        return self.done()


class Ready:
    """JAX's way of saying it."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


def gate() -> tuple[threading.Event, Callable[[], int]]:
    opened = threading.Event()

    def work() -> int:
        opened.wait(30)
        return 7

    return opened, work


async def test_handles_that_can_only_be_asked_complete_when_they_say_so() -> None:
    start = time.monotonic()
    handles = [Handle(start + 0.002 * i) for i in range(50)]
    handles += [Completed(start + 0.05), Completed(start + 0.06)]
    finished = []

    async def one(h: Handle) -> None:
        await ais.wait(h)
        finished.append(time.monotonic() - h.at)

    with deadline(10, "50 polled handles"):
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(one, h)
    assert len(finished) == len(handles)
    assert min(finished) >= 0  # never before it said so
    with deadline(10, "a ready array"):
        await ais.wait(Ready(True))
    assert ais.pending_waits() == []


async def test_a_done_handle_returns_after_one_look() -> None:
    h = Handle(0.0)
    await ais.wait(h)
    assert h.asked == 1


async def test_a_future_calls_back_and_is_never_polled(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    opened, work = gate()
    future = pool.submit(work)
    asked = 0
    done = future.done

    def counting_done() -> bool:
        nonlocal asked
        asked += 1
        return done()

    future.done = counting_done  # type: ignore[method-assign]

    async def open_later() -> None:
        await anyio.sleep(0.05)
        opened.set()

    with deadline(10, "a future completed by a worker thread"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_later)
            await ais.wait(future)
    assert asked == 1  # the first look only: the rest came by the callback
    assert future.result() == 7
    [only] = [future]
    assert only.done()


async def test_a_future_resolved_in_the_loop_thread_wakes_its_waiter() -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def resolve() -> None:
        await anyio.sleep(0.01)
        future.set_result(3)  # the callback runs here, inline, in the loop's thread

    with deadline(10, "a future resolved by another task"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(resolve)
            await ais.wait(future)


async def test_a_failed_future_raises_its_own_exception(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    def fail() -> None:
        time.sleep(0.02)
        raise KeyError("the work's own")

    with pytest.raises(KeyError, match="the work's own"), deadline(10, "a failing future"):
        await ais.wait(pool.submit(fail))


async def test_a_future_s_value_is_never_awaited_even_if_it_could_be() -> None:
    ran = []

    async def work() -> None:
        ran.append(True)

    value = work()
    try:
        for resolved_at_once in (True, False):
            future: concurrent.futures.Future[object] = concurrent.futures.Future()
            if resolved_at_once:
                future.set_result(value)
                await ais.wait(future)
            else:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ais.wait, future)
                    await anyio.sleep(0.01)
                    future.set_result(value)
        assert ran == []  # the value is the program's, to run or not
    finally:
        value.close()


def test_an_adapter_s_hooks_must_be_plain_functions() -> None:
    async def result(handle: object) -> None:
        pass

    with pytest.raises(TypeError, match="result must be a plain function"):
        ais.Adapter("mine", done="done", result=result)


async def test_asking_a_handle_that_raises_is_a_completion_error_with_the_cause() -> None:
    class Broken(Handle):
        def done(self) -> bool:
            super().done()
            if self.asked > 1:  # the first look says "not yet", the poller's raises
                raise OSError("the status call broke")
            return False

    with pytest.raises(ais.CompletionError) as caught, deadline(10, "a broken handle"):
        await ais.wait(Broken(), what="a transfer")
    assert isinstance(caught.value.__cause__, OSError)
    assert "a transfer" in str(caught.value)
    assert caught.value.kind == "tests.Broken"
    with pytest.raises(ais.CompletionError):  # raised by the first look too
        await ais.wait(AtOnce())


async def test_each_handle_is_asked_once_per_sweep_so_a_consumed_yes_is_never_lost() -> None:
    """An answer may be consumed (a notification popped): the yes of one handle is acted on
    although another, asked after it in the same sweep, raises; and each is asked once."""
    ready = threading.Event()

    class Once(Handle):
        def done(self) -> bool:  # yes once, when ready; then no again
            super().done()
            if ready.is_set() and not self.finished:
                self.finished = True
                return True
            return False

    class Breaks(Handle):
        def done(self) -> bool:
            super().done()
            if ready.is_set():
                raise OSError("the status call broke")
            return False

    once, breaks, later = Once(), Breaks(), Handle()
    results: dict[str, object] = {}

    async def one(name: str, h: Handle) -> None:
        try:
            await ais.wait(h)
            results[name] = "done"
        except ais.CompletionError as exc:
            results[name] = exc.__cause__

    with deadline(10, "a consumed yes beside a broken handle"):
        async with anyio.create_task_group() as tg:
            for name, h in (("once", once), ("breaks", breaks), ("later", later)):
                tg.start_soon(one, name, h)
            await until(lambda: later.asked >= 2, "a sweep of the three handles")
            ready.set()
            await until(lambda: len(results) == 2, "the yes and the error")
            assert results["once"] == "done"
            assert isinstance(results["breaks"], OSError)
            asked = later.asked
            later.finish()
    assert once.asked == breaks.asked  # once each per sweep, in the same sweeps
    assert later.asked >= asked


IDLE_AFTER_S, IDLE_CAP_S = 1.0, 0.1  # docs/completions.md: every 100 ms once idle a second


@pytest.mark.slow  # 1.8 s: the idle pace begins after a second with nothing completed
async def test_the_poller_slows_to_its_idle_pace_but_keeps_asking() -> None:
    """Nothing completed or begun for a second: the handles are asked every 100 ms, no faster
    (1,000 pending handles cost little), and still asked (asking drives some libraries'
    progress): a completion is seen within that pace."""
    h = Handle()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ais.wait, h)
        await anyio.sleep(IDLE_AFTER_S + 0.2)
        asked = h.asked
        await anyio.sleep(0.5)
        asked = h.asked - asked
        assert 1 <= asked <= 0.5 / IDLE_CAP_S + 2
        h.finish()
        finished = anyio.current_time()
    assert anyio.current_time() - finished < 1.0  # within the pace (wide: a busy machine)


class AtOnce(Handle):
    def done(self) -> bool:
        raise OSError("at once")


async def test_cancellation_stops_the_wait_at_once_and_leaves_the_work_alone(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    opened, work = gate()
    future = pool.submit(work)
    polled = Handle()
    for h in (future, polled):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await ais.wait(h)
        assert scope.cancelled_caught
        with anyio.move_on_after(0.02):
            await ais.wait(h)
    assert ais.pending_waits() == []
    assert not future.cancelled()
    opened.set()
    assert future.result(10) == 7


async def test_a_timeout_fires_on_time_and_names_what_was_late() -> None:
    h = Handle()
    started = anyio.current_time()
    with pytest.raises(TimeoutError, match="the weights' transfer"):
        await ais.wait(h, timeout=0.1, what="the weights' transfer")
    late = anyio.current_time() - started - 0.1
    assert -1e-3 < late < 1.0  # on time (uvloop rounds to 1 ms); the benchmark says how close
    started = anyio.current_time()
    with pytest.raises(TimeoutError), anyio.fail_after(0.1):
        await ais.wait(h)
    assert anyio.current_time() - started < 1.1
    assert ais.pending_waits() == []


async def test_a_cancelled_polled_handle_is_kept_alive_until_its_work_is_done() -> None:
    class Gated:
        def __init__(self, gate: threading.Event) -> None:
            self.gate = gate

        def done(self) -> bool:
            return self.gate.is_set()

    opened = threading.Event()
    h = Gated(opened)
    gone = weakref.ref(h)
    with anyio.move_on_after(0.01):
        await ais.wait(h)
    del h
    gc.collect()
    assert gone() is not None  # the work may still use it: kept
    opened.set()
    await until(lambda: (gc.collect(), gone())[1] is None, "the finished handle let go")


async def test_on_cancel_is_called_when_the_adapter_says_how_to_cancel() -> None:
    cancelled = []
    adapter = ais.Adapter("cancellable", done="done", on_cancel=cancelled.append)
    h = Handle()
    with pytest.raises(TimeoutError, match="cancelled by its adapter"):
        await ais.wait(h, timeout=0.01, adapter=adapter)
    assert cancelled == [h]


async def test_pending_waits_list_foreign_waits_with_kind_age_and_origin(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    opened, work = gate()
    future = pool.submit(work)

    async def load_shard() -> None:
        await ais.wait(Handle(), what="shard 3 of the weights")

    ais.set_debug(True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(load_shard)
            tg.start_soon(lambda: ais.wait(future, what="a read"))
            await until(lambda: len(ais.pending_waits()) == 2, "two waits listed")
            await anyio.sleep(0.05)
            by_kind = {w.device: w for w in ais.pending_waits()}
            tg.cancel_scope.cancel()
    finally:
        ais.set_debug(False)
        opened.set()
    polled, called = by_kind["tests.Handle"], by_kind["concurrent.futures"]
    assert polled.strategy == "poll" and called.strategy == "callback"
    assert polled.subject.startswith("shard 3 of the weights: ")
    assert called.subject.startswith("a read: ")
    assert polled.waited >= 0.05
    assert polled.started_at is not None and "in load_shard" in polled.started_at
    assert ais.pending_waits() == []


async def test_the_watchdog_warns_of_a_late_foreign_wait(caplog: pytest.LogCaptureFixture) -> None:
    ais.set_watchdog(0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="aiostream"):
            with anyio.move_on_after(0.3):
                await ais.wait(Handle(), what="a stuck all_reduce")
    finally:
        ais.set_watchdog(None)
    [warning] = [r for r in caplog.records if "pending for more than" in r.getMessage()]
    assert "a stuck all_reduce" in warning.getMessage()


async def test_listeners_see_foreign_waits_as_spans(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with aiostream.tracing.instrument(provider):
        await ais.wait(pool.submit(time.sleep, 0.02), what="a read")
        with anyio.move_on_after(0.02):
            await ais.wait(Handle(), what="a stall")
    spans = {
        s.attributes["aiostream.subject"].split(":")[0]: s for s in exporter.get_finished_spans()
    }  # type: ignore[index,union-attr]
    read, stall = spans["a read"], spans["a stall"]
    assert read.attributes["aiostream.device"] == "concurrent.futures"  # type: ignore[index]
    assert read.attributes["aiostream.outcome"] == "completed"  # type: ignore[index]
    assert stall.attributes["aiostream.strategy"] == "poll"  # type: ignore[index]
    assert stall.attributes["aiostream.outcome"] == "cancelled"  # type: ignore[index]


async def test_events_and_streams_are_awaited_as_synchronize_does() -> None:
    s = ais.Stream()
    ais.delay(0.02, stream=s)
    e = s.record_event()
    with deadline(10, "an event and a stream"):
        await ais.wait(e)
        await ais.wait(s)
    assert e.query()
    ais.delay(5.0, stream=s)
    with pytest.raises(TimeoutError):
        await ais.wait(s, timeout=0.01)


async def test_a_registered_adapter_asks_a_status_call() -> None:
    class Xfer:
        def __init__(self) -> None:
            self.state = "PROC"

        def check(self) -> str:
            return self.state

    adapter = ais.Adapter(
        "xfer",
        done=lambda x: x.check() == "DONE",
        accepts=lambda x: isinstance(x, Xfer),
        describe=lambda x: "xfer",
    )
    unregister = ais.register_adapter(adapter)
    x = Xfer()

    async def later() -> None:
        await anyio.sleep(0.02)
        x.state = "DONE"

    with deadline(10, "a status call"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            try:
                await ais.wait(x)
            finally:
                unregister()


async def test_what_nothing_says_is_done_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot tell when builtins.object is done"):
        await ais.wait(object())
    with pytest.raises(TypeError, match="timeout"):
        await ais.wait(Handle(0.0), timeout="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="what"):
        await ais.wait(Handle(0.0), what=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="done= or call_back="):
        ais.Adapter("nothing")
