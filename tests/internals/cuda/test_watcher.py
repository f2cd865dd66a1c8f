"""The CUDA watcher's thread, white-box: its semaphore and ``sem_post`` as the host function,
the times it sleeps, when a new wait posts it, sweeps made off its thread, waits announced
ahead of their mark, slots left draining while it sleeps, and words that say nothing.

These read or tune the watcher's insides (``aiostream._backends.cuda.watcher``: ``HEALTH_S``,
``DRAIN_S``, ``_timeout``, ``_sweep``; its ``Semaphores``, in ``cuda.wakes``), so they live
here; what users see of waits is tested in ``tests/cuda/``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
import time
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _backends
from tests.helpers.cuda import DEV, held, host_function_launches, primary_context
from tests.helpers.deadlines import deadline, until
from tests.helpers.gate import gate, gated
from tests.helpers.process import run_python
from tests.helpers.stand_in import FAKE, hurry

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# --------------------------------------------------------- the semaphore


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX semaphores of glibc")
def test_the_watcher_sleeps_on_a_semaphore_that_sem_post_wakes() -> None:
    """The host function that announces a wait is libc's ``sem_post``, handed to the driver
    by its address; the watcher's thread sleeps in ``sem_timedwait`` until it is posted, and
    one wake takes every post made so far (the sweep after it sees all they announce)."""
    from aiostream._backends.cuda.wakes import Semaphores

    sems = Semaphores()
    libc = ctypes.CDLL(None)
    assert sems.post_address == ctypes.cast(libc.sem_post, ctypes.c_void_p).value != 0
    sem = sems.new()
    assert not sems.wait(sem, 0.01)  # nothing posted: the time limit
    sems.post(sem)
    sems.post(sem)
    assert sems.wait(sem, 0.01)
    assert not sems.wait(sem, 0.0)  # the second post woke nobody a second time
    sems.post(sem)
    assert sems.wait(sem, None)
    assert not sems.wait(sem, 0.0)


def test_a_semaphore_that_cannot_be_made_says_why() -> None:
    """The watcher's semaphore lives in memory from libc's malloc (size_t sizes): when there
    is none, the OSError carries the C library's errno."""
    import errno

    from aiostream._backends.cuda import wakes

    if wakes.semaphores is None:
        pytest.skip("no POSIX semaphores here: the watcher polls")
    sems = wakes.Semaphores()
    sems.SIZE = (1 << 62) + 64  # more than any machine has (64 bytes, if cut to 32 bits)
    with pytest.raises(OSError) as info:
        sems.new()
    assert info.value.errno == errno.ENOMEM and info.value.strerror == "sem_init failed"
    sems.SIZE = wakes.Semaphores.SIZE
    sem = sems.new()
    assert not sems.wait(sem, 0.001)  # not posted: the timeout ends it
    sems.post(sem)
    assert sems.wait(sem, 1.0)  # posted: returns at once
    # the host function the driver calls is sem_post itself, at that address
    assert sems.post_address
    ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(sems.post_address)(sem)
    assert sems.wait(sem, 1.0)


NO_SEMAPHORES = """
import sys

import anyio

import aiostream as ais
from aiostream._backends.cuda import watcher

watcher.semaphores = None  # as where libc has none: no host function, nothing to post


async def main() -> None:
    s = ais.Stream("cuda:0")
    for strategy in ("quiet", "hybrid", "thread", "poll", "callback"):
        ais.delay(0.01, stream=s)
        e = s.record_event()
        with anyio.fail_after(10):
            await e.synchronize(strategy=strategy)
        assert e.query()
        await anyio.sleep(0.02)  # the watcher, with nothing to watch, sleeps and looks again
    print("waited", flush=True)


loop = sys.argv[1]
options = {"use_uvloop": True} if loop == "uvloop" else {}
anyio.run(main, backend="trio" if loop == "trio" else "asyncio", backend_options=options)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_without_posix_semaphores_the_watcher_polls_and_every_wait_ends(loop: str) -> None:
    """Where libc has no POSIX semaphores, no host function announces a wait and nothing
    posts the watcher: its thread sleeps its polling intervals (and, with nothing to watch,
    its longest one) and looks again, and a wait of every strategy still ends with its work.
    In a program of its own, which has no semaphores from the start."""
    proc = run_python("-c", NO_SEMAPHORES, loop, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "waited\n"


def test_a_wait_the_watcher_will_look_at_soon_enough_does_not_wake_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new wait posts the watcher's semaphore only if the thread sleeps past when the wait
    needs a look: a second wait, once the thread sleeps toward its next health check
    (``HEALTH_S``) for the first, does not."""
    from aiostream._backends.cuda import watcher

    if watcher.semaphores is None:
        pytest.skip("no POSIX semaphores here: the watcher polls")
    backend = _backends.get("cuda")
    s = ais.Stream(DEV)
    thread = backend._devices[0].watcher
    release = gate(s)  # the work after it waits until the test releases it
    ais.delay(0.001, stream=s)
    first, second = s.record_event(), s.record_event()
    posts: list[int] = []
    post = watcher.semaphores.post
    monkeypatch.setattr(watcher.semaphores, "post", lambda sem: (posts.append(sem), post(sem)))
    targets = []
    try:
        targets.append(backend.event_target(first._handle, True))
        targets[0].watch(lambda: None)
        assert not targets[0].polled
        deadline = time.monotonic() + 5
        # until the thread, woken for the first wait, sleeps again toward its next look
        while not (now := time.monotonic()) < thread.sleeping_until <= now + watcher.HEALTH_S:
            assert time.monotonic() < deadline, "waited 5 s in vain for the thread to sleep"
            time.sleep(0.001)
        posts.clear()
        targets.append(backend.event_target(second._handle, True))
        targets[1].watch(lambda: None)
        assert not targets[1].polled and not posts, posts
    finally:
        for target in targets:
            target.release()
        release()
    s.synchronize_blocking()


def test_waits_watched_together_post_the_sleeping_watcher_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of waits handed to the watcher while its thread sleeps posts it once: the
    first post means it wakes now and plans for every wait watched by then (a burst of 1,000
    polled waits posted it 1,000 times, each post a wake and a sweep that found nothing)."""
    from aiostream._backends.cuda import watcher

    if watcher.semaphores is None:
        pytest.skip("no POSIX semaphores here: the watcher polls")
    backend = _backends.get("cuda")
    s = ais.Stream(DEV)
    thread = backend._devices[0].watcher
    posts: list[int] = []
    post = watcher.semaphores.post
    monkeypatch.setattr(watcher.semaphores, "post", lambda sem: (posts.append(sem), post(sem)))
    targets = []
    with gated(s):
        events = []
        for _ in range(20):  # not announced: the user's work follows each (polled waits)
            ais.delay(0.001, stream=s)
            events.append(s.record_event())
        ais.delay(0.001, stream=s)
        with thread.lock:  # the thread cannot plan again until all are watched
            thread.sleeping_until = float("inf")  # asleep until posted
            for event in events:
                target = backend.event_target(event._handle, True)
                target.watch(lambda: None)
                targets.append(target)
            assert all(t.polled for t in targets)
            assert len(posts) == 1, posts
        for target in targets:
            target.release()
    s.synchronize_blocking()


# ------------------------------------------------- its sleeps and sweeps


@pytest.mark.parametrize("strategy", ["thread", "callback"])
async def test_the_watcher_polls_from_50us_backing_off_to_2ms_then_1_percent(
    anyio_backend: object, strategy: str
) -> None:
    """While a wait no host function announces is watched, the watcher sleeps 50 us after
    progress, then a quarter of the quiet time, at most 2 ms, or 1 % of the quiet time where
    that is longer, at most 10 ms; where a wake-up is dear, past 0.1 s of quiet it sleeps long
    enough to spend half a percent of a core, at most 10 % of the quiet time; with only
    announced waits, it sleeps until the next health check (50 ms)."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    hurry()  # waits earlier tests left watched (cancelled ones linger) end and are dropped
    await until(lambda: not held()["watched"], "the waits earlier tests left watched to be dropped")
    s = ais.Stream(DEV)

    async def wait() -> None:
        await s.synchronize(strategy=strategy)

    with gated(s):  # the work after it waits until the block ends
        ais.delay(0.001, stream=s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: held()["watched"], "the watcher to have the wait")
            with watcher.lock:
                since = watcher.progress_at
                if strategy == "callback":  # past a chase: a post (an earlier test's host
                    since = max(since, watcher.chase_until)  # function, late) starts one
                quiets = (0.0, 0.004, 0.05, 0.2, 0.4, 1.0, 60.0)
                sleeps, measured = {}, watcher.wake_cpu
                for cost in (0.0, 10e-6, 200e-6):  # a wake-up's CPU: none, cheap, dear
                    watcher.wake_cpu = cost
                    sleeps[cost] = [watcher._timeout(since + quiet) for quiet in quiets]
                watcher.wake_cpu = measured
            tg.cancel_scope.cancel()
    if strategy == "thread":
        young = [50e-6, 1e-3, 2e-3]  # 2 ms at 50 ms of quiet, however dear
        assert sleeps[0.0] == pytest.approx([*young, 2e-3, 4e-3, 10e-3, 10e-3], rel=1e-6)
        assert sleeps[10e-6] == pytest.approx([*young, 2e-3, 4e-3, 10e-3, 10e-3], rel=1e-6)
        assert sleeps[200e-6] == pytest.approx([*young, 20e-3, 40e-3, 40e-3, 40e-3], rel=1e-6)
    else:
        assert all(s == [0.05] * 7 for s in sleeps.values())


async def test_the_watcher_learns_what_a_wake_up_costs(anyio_backend: object) -> None:
    """The CPU of the wake-ups that find nothing is what paces the polls of old waits."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    s = ais.Stream(DEV)
    with gated(s):
        ais.delay(0.001, stream=s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(s.synchronize, strategy="thread"))
            await until(lambda: held()["watched"], "the watcher to have the wait")
            with watcher.lock:
                watcher.wake_cpu = 0.0
            await until(lambda: watcher.wake_cpu > 0, "a wake-up's cost to be measured")
            tg.cancel_scope.cancel()


async def test_a_burst_of_completions_is_told_in_batches(anyio_backend: object) -> None:
    """After a sweep finds completed waits the next poll is 1 ms off, unless a new wait comes."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    hurry()  # waits earlier tests left watched (cancelled ones linger) end and are dropped
    await until(lambda: not held()["watched"], "the waits earlier tests left watched to be dropped")
    held_back, other, later = ais.Stream(DEV), ais.Stream(DEV), ais.Stream(DEV)
    with gated(held_back), gated(later):
        ais.delay(0.001, stream=held_back)
        ais.delay(0.001, stream=later)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(held_back.synchronize, strategy="thread"))
            await until(lambda: held()["watched"] == 1, "the watcher to have the wait")
            with gated(other) as release:  # watched before its work can complete
                ais.delay(0.0001, stream=other)
                done = anyio.Event()

                async def wait_other() -> None:
                    await other.synchronize(strategy="thread")
                    done.set()

                tg.start_soon(wait_other)
                await until(lambda: held()["watched"] == 2, "the watcher to have the other")
                release()
                await done.wait()  # a sweep found it: a batch began
            with watcher.lock:
                assert watcher.batch_until > 0.0
                soon = watcher.batch_until - 0.5e-3
                assert watcher._timeout(soon) >= 0.5e-3 - 1e-6
            tg.start_soon(functools.partial(later.synchronize, strategy="thread"))
            await until(lambda: held()["watched"] == 2, "the watcher to have the new wait")
            with watcher.lock:  # a new wait is looked at promptly
                assert watcher.batch_until == 0.0
                assert watcher._timeout(soon) < 0.25e-3
            tg.cancel_scope.cancel()


def idle(s: ais.Stream) -> bool:
    """Whether ``s`` has no work pending, as the driver says to a user's own call (none of
    aiostream's: the backend learns nothing of it)."""
    with primary_context() as cu:
        (err,) = cu.cuStreamQuery(cu.CUstream(s.stream_id))
    return int(err) == 0


@pytest.mark.parametrize("strategy", sorted(ais._waiting.WAKE))
async def test_host_functions_wake_the_watcher(
    anyio_backend: object, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback (or handed-over hybrid) wait is announced by its host function, which wakes
    the watcher: with the watcher's own 50 ms sweeps pushed out of reach, each wait still
    resumes once its work is done, not at the next sweep."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "HEALTH_S", 3600.0)  # its sweeps while waits are watched
    backend: Any = _backends.get("cuda")
    s = ais.Stream(DEV)
    launched = host_function_launches(backend._devices.get(0).watcher, monkeypatch)
    calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    for _ in range(5):
        release = gate(s)
        ais.delay(0.001, stream=s)  # ends when the test says
        finished: list[bool] = []

        async def wait(finished: list[bool] = finished) -> None:
            await s.synchronize(strategy=strategy)
            finished.append(True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(
                lambda finished=finished: backend.held(0)["watched"] or finished,
                "the watcher to have the wait (hybrid: after 1 ms)",
                seconds=10,
            )
            release()  # the work ends now
            await until(
                lambda finished=finished: finished,
                "the wait to end once its work did (left to the sweep, it would take an hour)",
                seconds=10,
            )
        assert s.query()
    assert len(launched) == 5  # each wait was announced by its host function
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls() - calls == 5


def _asleep_for_long(thread: Any, seen: list[float]) -> bool:
    """Whether the watcher thread sleeps on a timer of 10 s or more with no post pending in its
    semaphore, seen so in three looks in a row (it takes a post between its look at the clock
    and its sleep)."""
    value = ctypes.c_int()
    libc = watcher_module().semaphores.libc
    libc.sem_getvalue(ctypes.c_void_p(thread.sem), ctypes.byref(value))
    asleep = value.value == 0 and 10 < thread.sleeping_until - time.monotonic() < 1e9
    seen[:] = seen + [1] if asleep else []
    return len(seen) >= 3


def watcher_module() -> Any:
    from aiostream._backends.cuda import watcher

    return watcher


async def test_waits_a_sweep_off_the_thread_finds_complete_are_called_back_by_the_thread(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep made off the watcher's thread (for a full chunk of flags, or a count of what is
    held) may find watched waits complete: it leaves their callbacks to the thread and wakes
    it, and the waits end then, not at the thread's next look. Here the thread would look
    again only after 30 s, and the host function that announces the wait never runs (the
    watcher's launcher launches nothing: as a host function the driver runs late)."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "HEALTH_S", 30.0)
    done = []
    launched: list[tuple[int, int, int]] = []

    def launch_nothing(stream: int, fn: int, data: int) -> int:
        launched.append((stream, fn, data))
        return 0  # CUDA_SUCCESS: as if launched, and never run

    async def wait(s: ais.Stream) -> None:
        await s.synchronize(strategy="callback")
        done.append(time.monotonic())

    s = ais.Stream(DEV)
    thread = own_backend._devices.get(0).watcher
    monkeypatch.setattr(thread, "launch", launch_nothing)
    # work that ends when the test says: the watcher has the wait before its mark lands (a
    # short kernel may end first on a busy machine, and the wait then takes the fast path)
    with gated(s) as release:
        ais.delay(0.001, stream=s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, s)
            await until(lambda: own_backend.held(0)["watched"], "the watcher to have the wait")
            assert len(launched) == 1  # announced: the wait is not polled
            # the thread asleep on its 30 s timer, no wake-up of it pending (on a busy machine
            # it may take the post that watching the wait sent only now: it would then find
            # the mark landed on its own)
            await until(
                functools.partial(_asleep_for_long, thread, []),
                "the watcher thread asleep on its 30 s timer, no post pending",
            )
            # the kernel ends and the mark lands, and no one looks; no host function posts
            release()
            await until(lambda: idle(s), "the device to complete the kernel and the mark")
            assert not done
            own_backend.held(0)  # a sweep off the thread
            await until(lambda: done, "the wait to end, called back by the thread the sweep woke")


async def test_the_watcher_counts_the_watched_waits_announced_ahead_of_their_mark(
    anyio_backend: object,
) -> None:
    """On a stream handed out, a wait's host function comes right before its mark, which lands
    only after the host function returns: the watcher counts such waits while it watches them
    (it then polls for the mark after each post), each one, and none once they are gone."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    before = watcher.ahead
    with gated(s):  # the work after it waits until the block ends
        ais.delay(0.001, stream=s)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(functools.partial(s.synchronize, strategy="callback"))
            await until(
                lambda: watcher.ahead >= before + 2,
                "the watcher to count both waits announced ahead of their mark",
            )
            await anyio.sleep(0.01)
            assert watcher.ahead == before + 2
            tg.cancel_scope.cancel()
    assert watcher.ahead == before


async def test_a_slot_left_draining_while_the_watcher_sleeps_is_freed_once_it_lands(
    anyio_backend: object, own_backend: Any
) -> None:
    """An event dropped before its work ends leaves its mark's slot draining. The watcher,
    asleep until posted (nothing watched, no slot in use when it went to sleep), is posted,
    and looks every ``DRAIN_S`` until the value lands: the slot is then free, though nothing
    else wakes it. The first slot of a backend's flag memory is slot 0 (a slot freed is the
    next taken), so this holds for it."""
    from aiostream._backends.cuda.watcher import DRAIN_S

    watcher = own_backend._devices.get(0).watcher
    s = ais.Stream(DEV)
    release = gate(s)
    ais.delay(0.001, stream=s)  # outlasts the wait's start: held until the test releases it
    first = functools.partial(s.record_event().synchronize, strategy="thread")
    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await until(lambda: watcher.thread is not None, "the watcher thread to start")
        release()  # the kernel ends: the watcher runs; slot 0 is free
    gc.collect()
    if not watcher.memops:
        pytest.skip("this device writes no values (its marks are marker events): no slots")

    def used() -> int:
        with watcher.lock:  # read only: held() would sweep the flags itself
            return int(watcher.flags.used())

    with deadline(5, "the watcher to sleep for good, no slot in use"):
        while used() or watcher.sleeping_until != float("inf"):
            await anyio.sleep(0.001)
        await anyio.sleep(0.05)
        assert watcher.sleeping_until == float("inf")
    t = ais.Stream(DEV)  # waited on by nobody: a record on it launches no host function
    with gated(t) as release:
        ais.delay(0.001, stream=t)  # held until the test releases it
        e = t.record_event()  # held by the record only: nothing watched, nothing posted
        assert watcher.sleeping_until == float("inf")
        slot = e._handle.mark.slot
        assert slot == 0 and used() == 1
        del e
        gc.collect()  # the record's hold goes before the value landed: the slot drains
        assert used() == 1
        release()  # the kernel ends now
        with anyio.fail_after(4 * DRAIN_S):
            while used():
                await anyio.sleep(0.005)


# ------------------------------------------------ words that say nothing


@pytest.mark.parametrize("way", ["thread", "callback", "blocking"])
async def test_a_wait_told_to_look_too_early_waits_on(
    anyio_backend: object, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher tells every watched wait to look when the device may have failed; a wait
    that then finds its work neither done nor failed is watched again: it neither returns
    early nor hangs. (Here the watcher's first sweep with a wait tells every wait at once.)"""
    from aiostream._backends.cuda.watcher import Watcher

    sweep = Watcher._sweep
    told: list[int] = []

    def too_early(self: Watcher, few: bool = False) -> list[Any]:
        due = sweep(self, few)
        if not told and self.watched:
            told.append(len(self.watched))
            for target in list(self.watched):
                self._fire(target, due)  # noqa: SLF001 (what the failure path does)
        return due

    monkeypatch.setattr(Watcher, "_sweep", too_early)
    s = ais.Stream(DEV)
    ais.delay(0.3, stream=s)
    with anyio.fail_after(10):
        if way == "blocking":
            await anyio.to_thread.run_sync(s.synchronize_blocking)
        else:
            await s.synchronize(strategy=way)
    assert told == [1]
    assert s.query()  # it waited for the kernel
