"""The CUDA backend's marks, white-box: the values a device writes into completion-flag slots
(wrapping to one, never zero; a slot cleared as a mark takes it), the chunks of pinned memory
that hold the slots (taken first-free-first, given back from the end, taken back when full),
and which records take a mark.

These set the watcher's ``CHUNK`` or read its flags and slots, so they live here.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _backends
from tests.helpers.cuda import DEV, device_finishes
from tests.helpers.deadlines import until
from tests.helpers.faults import calls, succeeded
from tests.helpers.gate import gated, sweep
from tests.helpers.stand_in import FAKE, PINNED

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# ----------------------------------------------------------- mark values


async def test_mark_values_wrap_to_one_never_zero(anyio_backend: object) -> None:
    """The values marks write count up to 2**32 - 1, the largest a 32-bit write holds, then
    start again at 1, never 0, the value of fresh flag memory; waits across the wrap end with
    their work."""
    from aiostream._backends.cuda.watcher import Mark

    s = ais.Stream(DEV)
    s.record_event()
    dev = _backends.get("cuda")._devices.get(0)  # type: ignore[attr-defined]
    flags = dev.watcher.flags
    with dev.lock:
        flags.values = 0xFFFFFFFE
        marks = [Mark(), Mark()]
        for mark in marks:
            flags.take(mark)
        assert [m.value for m in marks] == [0xFFFFFFFF, 1]
        for mark in marks:
            flags.free(mark)
        flags.values = 0xFFFFFFFE
    for _ in range(3):
        ais.delay(0.001, stream=s)
        e = s.record_event()
        with anyio.fail_after(5):
            await e.synchronize(strategy="poll")
        assert e.query()
    assert 1 <= flags.values < 0xFFFFFFFE


async def test_a_value_left_in_a_free_slot_is_not_read_as_its_next_mark(
    anyio_backend: object,
) -> None:
    """Mark values repeat once they wrap (every 2**32 - 1 marks, about an hour at a million
    marks a second), and a free slot still holds the last value written to it: a slot is
    cleared as a mark takes it, so a value left there from a cycle before never reads as the
    new mark's, whose wait would end before its work."""
    s = ais.Stream(DEV)
    await s.record_event().synchronize()  # the device's flag memory exists
    with gated(s) as release:
        ais.delay(0.001, stream=s)  # work that does not end until the test releases it
        dev = _backends.get("cuda")._devices.get(0)  # type: ignore[attr-defined]
        flags = dev.watcher.flags
        with dev.lock:
            coming = flags.values % 0xFFFFFFFF + 1  # the value the next mark takes
            for chunk in flags.chunks:
                for j in chunk.free:
                    chunk.flags[j] = coming  # as if written there 2**32 - 1 marks ago
        e = s.record_event()
        for strategy in ("poll", "thread", "callback"):
            with anyio.move_on_after(0.02) as scope:
                await e.synchronize(strategy=strategy)
            assert scope.cancelled_caught, strategy  # still waiting: the work has not ended
        assert not e.query()
        release()
    with anyio.fail_after(5):
        await e.synchronize()


# ----------------------------------------------------------- flag memory


async def test_flag_memory_shrinks_only_from_its_last_chunk_and_only_once_that_is_idle(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completion flags live in chunks of pinned memory, taken first-free-first: a chunk is
    given back to the driver only from the end, once nothing uses it (the device may still
    write a slot of any chunk in use), and every chunk but the first goes when all are idle.
    Chunks of four slots here, so that a few waits span several."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "CHUNK", 4)  # this backend has no chunk yet
    pinned = FAKE.fake_cuda_live(PINNED) if FAKE is not None else 0
    quick, slow = ais.Stream(DEV), ais.Stream(DEV)
    with calls("cuMemHostAlloc", "cuMemFreeHost") as made:
        with gated(slow):  # a word of pinned memory of the test's own, while held
            ais.delay(0.05, stream=quick)
            first = [quick.record_event() for _ in range(4)]  # the first chunk's four slots
            ais.delay(0.001, stream=slow)  # held until the test releases it
            last = [slow.record_event() for _ in range(4)]  # the second chunk's
            with anyio.fail_after(5):
                for e in first:
                    await e.synchronize()
            del first
            gc.collect()
            held = own_backend.held(0)  # after a sweep: the first chunk is idle, the last not
            assert (held["chunks"], held["slots"]) == (2, 4), held
            assert succeeded(made["cuMemHostAlloc"]) == 2 and made["cuMemFreeHost"] == []
            if FAKE is not None:
                assert FAKE.fake_cuda_live(PINNED) == pinned + 2 + 1  # the chunks, the gate's
        with anyio.fail_after(5):
            for e in last:
                await e.synchronize()
                assert e.query()
        del last
        gc.collect()
        held = own_backend.held(0)
    assert (held["chunks"], held["slots"]) == (1, 0), held
    last_chunk = int(made["cuMemHostAlloc"][-1][1][1])  # the address the second call gave
    assert [int(args[0]) for args, _ in made["cuMemFreeHost"]] == [last_chunk]
    assert succeeded(made["cuMemFreeHost"]) == 1  # the second chunk went back to the driver
    if FAKE is not None:
        sweep()  # the gate's word is freed: the device has passed the gate
        assert FAKE.fake_cuda_live(PINNED) == pinned + 1


async def test_a_full_chunk_of_flags_takes_back_its_landed_slots_before_growing(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When every slot is taken, a new mark first frees the slots whose values have landed
    (held by events no one has asked since) and takes one of those: flag memory grows only
    when the slots are all still pending. Chunks of four slots here."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "CHUNK", 4)  # this backend has no chunk yet
    s = ais.Stream(DEV)
    ais.delay(0.001, stream=s)
    events = [s.record_event() for _ in range(4)]  # the chunk's four slots
    device_finishes()  # their values land; nothing of aiostream's looks
    with gated(s):  # the fifth mark's value does not land while the gate holds
        ais.delay(0.001, stream=s)
        fifth = s.record_event()
        held = own_backend.held(0)
        assert (held["chunks"], held["slots"]) == (1, 1), held
    with anyio.fail_after(5):
        for e in [*events, fifth]:
            await e.synchronize()  # the events whose slots were taken back are complete
            assert e.query()


async def test_a_new_backend_announces_callback_waits_with_a_host_function(
    anyio_backend: object, own_backend: Any
) -> None:
    """Each backend looks up the driver's ``cuLaunchHostFunc`` (``cuGetProcAddress``) when it
    first uses a device: a callback wait on it is announced by one host function, not left to
    polling; and the flags of its first wait are one chunk of pinned, portable, device-mapped
    memory of four bytes a slot."""
    from cuda.bindings import driver

    from aiostream._backends.cuda import watcher as watcher_module
    from aiostream._backends.cuda.watcher import CHUNK

    allocations = []
    alloc = driver.cuMemHostAlloc

    def spy(nbytes: int, flags: int) -> Any:
        allocations.append((nbytes, flags))
        return alloc(nbytes, flags)

    with calls("cuGetProcAddress") as looked_up:
        s = ais.Stream(DEV)  # the backend's first use of the device
    assert [args[0] for args, _ in looked_up["cuGetProcAddress"]] == [b"cuLaunchHostFunc"]
    watcher = own_backend._devices.get(0).watcher
    launched: list[tuple[int, int, int]] = []
    launch = watcher.launch

    def launching(stream: int, fn: int, data: int) -> int:
        launched.append((stream, fn, data))
        return int(launch(stream, fn, data))

    host_calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    with gated(s), pytest.MonkeyPatch.context() as patch:
        ais.delay(0.001, stream=s)  # held until the gate is released
        patch.setattr(driver, "cuMemHostAlloc", spy)
        patch.setattr(watcher, "launch", launching)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(s.synchronize, strategy="callback"))
            await until(lambda: own_backend.held(0)["watched"], "the watcher to have the wait")
            (launch_args,) = launched  # libc's sem_post, of the watcher's semaphore
            post = watcher_module.semaphores
            assert post is not None and launch_args[1:] == (post.post_address, watcher.sem)
            if FAKE is not None:
                assert FAKE.fake_cuda_host_calls() - host_calls == 1
            tg.cancel_scope.cancel()
    assert allocations == [(4 * CHUNK, 0x1 | 0x2)]  # PORTABLE | DEVICEMAP
    device_finishes()  # the cancelled wait's mark lands before the close


# --------------------------------------------- which records take a mark


def test_a_record_of_an_event_handed_out_takes_no_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits on an event whose handle is out query the event itself (others may record it
    unseen), so its records take no mark; an event of aiostream's own still takes one at each
    record where the device writes values."""
    from aiostream._backends.cuda.watcher import Watcher

    marked = []
    mark = Watcher.mark

    def spy(self: Watcher, *args: Any) -> Any:
        marked.append(args)
        return mark(self, *args)

    s = ais.Stream(DEV)
    handed = s.record_event()
    assert handed.event_id  # handed out now
    memops = _backends.get("cuda")._devices.get(0).watcher.memops  # type: ignore[attr-defined]
    monkeypatch.setattr(Watcher, "mark", spy)
    handed.record(s)
    handed.record(s)
    assert marked == []
    own = s.record_event()
    assert len(marked) == memops
    own.synchronize_blocking()
    # own's work (none but records) may read complete by the stream's earlier mark before
    # the driver has reached handed's records: handed is asked of the driver itself
    handed.synchronize_blocking()
    assert handed.query()


# ----------------------------------------------------------- the loop's look (peek)


class _Counting:
    """The driver's bindings, each call noted in ``calls``."""

    def __init__(self, cu: Any, calls: list[str]) -> None:
        self._cu, self._calls = cu, calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._cu, name)
        if not callable(value) or not name.startswith("cu"):
            return value

        def call(*args: Any) -> Any:
            self._calls.append(name)
            return value(*args)

        return call


async def test_a_peek_reads_the_mark_its_wait_captured(anyio_backend: object) -> None:
    """``Target.peek`` (the loop's look during a wait's check budget) reads the flag of the
    mark the wait took, with no driver call: an event recorded again after more work does
    not move it, and a wait on another library's event, which only ``cuEventQuery``
    answers, cannot be peeked at (None). (Gates hold each record's work.)"""
    backend = _backends.get("cuda")
    s = ais.Stream(DEV)
    e = ais.Event(DEV)
    calls: list[str] = []
    with gated(s) as release_first:
        ais.delay(0.001, stream=s)
        e.record(s)
        target = backend.event_target(ais._objects.handle(e), False)
        drv = backend._drv  # type: ignore[attr-defined]

        def peek() -> bool | None:
            """``target.peek()``, the driver calls made meanwhile noted."""
            cu = drv.cu
            drv.cu = _Counting(cu, calls)
            try:
                return target.peek()
            finally:
                drv.cu = cu

        try:
            assert peek() is False
            with gated(s):
                ais.delay(0.001, stream=s)
                e.record(s)  # recorded again behind work still held
                release_first()
                await until(lambda: peek() is True, "the first record's mark to land")
                assert not e.query()  # the event's latest record has not completed
                assert calls == []
                foreign = ais.as_event(e.event_id, DEV)
                other = backend.event_target(ais._objects.handle(foreign), False)
                assert other.peek() is None
                other.release()
        finally:
            target.release()
