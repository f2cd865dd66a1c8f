"""The profiler, trace export and the diagnostics of pending waits."""

from __future__ import annotations

import json
import logging
import os
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime, format_timeline
from tests.helpers import virtual_loops

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio

#: real time, every loop, for the tests that need no fake clock (uvloop cannot fake it)
EVERY_LOOP = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


async def pipeline(n: int = 3) -> ais.Profiler:
    """Host prep 2 ms, then 3 ms of device work, per step; the device overlaps the next prep."""
    s = ais.Stream()

    @ais.record_function("prep")
    async def prep() -> None:
        await anyio.sleep(0.002)

    with ais.profile() as prof:
        for i in range(n):
            await prep()
            with ais.record_function("submit", stream=s, step=i):
                ais.delay(0.003, stream=s)
        await s.synchronize()
    return prof


async def test_spans_match_the_virtual_timeline(virtual_time: VirtualTime) -> None:
    prof = await pipeline()
    device = [(s.name, s.start, s.end, s.engine) for s in prof.spans if s.kind == "device"]
    timeline = [(r.name, r.start, r.end, r.engine) for r in ais.virtual.timeline()]
    assert device == timeline
    ranges = [(s.start, s.end, s.args) for s in prof.spans if s.kind == "range"]
    assert ranges == [(r[1], r[2], {"step": i}) for i, r in enumerate(timeline)]
    host = [(s.start, s.end) for s in prof.spans if s.kind == "host" and s.name == "prep"]
    assert host == [pytest.approx(iv) for iv in [(0.0, 0.002), (0.002, 0.004), (0.004, 0.006)]]
    (wait,) = [s for s in prof.spans if s.kind == "await"]
    assert wait.name == f"await stream {ais.virtual.timeline()[0].stream}"
    assert (wait.start, wait.end) == pytest.approx((0.006, 0.011))


async def test_overlap_ratio_equals_the_hand_computed_value(virtual_time: VirtualTime) -> None:
    prof = await pipeline()
    summary = prof.summary()
    # host busy [0, 6] ms; device busy [2, 11] ms: both busy [2, 6] = 4 ms of 9 ms
    assert summary.host_busy == pytest.approx(0.006)
    assert summary.device_busy == pytest.approx(0.009)
    assert summary.engine_busy == {"virtual:0 compute": pytest.approx(0.009)}
    assert summary.overlap == pytest.approx(4 / 9)
    assert summary.wall == pytest.approx(0.011)
    assert summary.spans["prep"] == (3, pytest.approx(0.006))
    assert summary.spans["delay"] == (3, pytest.approx(0.009))
    table = str(prof)
    assert "host/device overlap: 0.444 (time both were busy / device busy time)" in table
    assert "device busy: virtual:0 compute" in table


async def test_host_busy_excludes_time_suspended_in_awaits(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    with ais.profile() as prof:
        with ais.record_function("step"):
            await anyio.sleep(0.001)  # busy: a sleep stands in for host work
            ais.delay(0.004, stream=s)
            await s.synchronize()  # suspended 4 ms: not busy
    summary = prof.summary()
    assert summary.host_busy == pytest.approx(0.001)
    assert summary.overlap == 0.0


async def test_spans_are_tagged_with_their_task(virtual_time: VirtualTime) -> None:
    async def worker(i: int) -> None:
        async with ais.record_function("work", worker=i):
            await anyio.sleep(0.001 * (i + 1))

    with ais.profile() as prof:
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(worker, i, name=f"worker-{i}")
    tracks = {s.track: (s.args, s.duration) for s in prof.spans if s.name == "work"}
    assert tracks == {
        "worker-0": ({"worker": 0}, pytest.approx(0.001)),
        "worker-1": ({"worker": 1}, pytest.approx(0.002)),
    }


async def test_one_instance_entered_by_several_tasks_records_a_span_each(
    virtual_time: VirtualTime,
) -> None:
    """One record_function entered by three tasks at once: each task's region is its own
    span, with its own device range, however their entries and exits interleave."""
    s = ais.Stream()
    shared = ais.record_function("shared", stream=s)

    async def worker(i: int) -> None:
        with shared:
            await anyio.sleep(0.001 * (3 - i))  # the last in leaves first
            ais.delay(0.001, stream=s)

    with ais.profile() as prof:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(worker, i, name=f"worker-{i}")
        await s.synchronize()
    spans = [sp for sp in prof.spans if sp.name == "shared"]
    host = {sp.track: sp.duration for sp in spans if sp.kind == "host"}
    assert [sp.kind for sp in spans].count("range") == 3  # a device range each
    assert host == {
        "worker-0": pytest.approx(0.003),
        "worker-1": pytest.approx(0.002),
        "worker-2": pytest.approx(0.001),
    }


def test_sync_code_and_decorators(virtual_device: ais.Device) -> None:
    @ais.record_function("sync-fn")
    def double(x: int) -> int:
        return 2 * x

    assert double(2) == 4  # no profiler: plain call
    with ais.profile() as prof:
        assert double(3) == 6
        with ais.record_function("block"):
            pass
    names = [(s.name, s.track) for s in prof.spans]
    assert names == [("sync-fn", "MainThread"), ("block", "MainThread")]
    assert double.__name__ == "double"


async def test_trace_follows_the_trace_event_format(
    virtual_time: VirtualTime, tmp_path: Path
) -> None:
    profiles: list[ais.Profiler] = []

    async def run() -> None:
        profiles.append(await pipeline())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, name="the pipeline")  # its host spans' track
    (prof,) = profiles
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    stacks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    names: dict[tuple[int, int], str] = {}
    for ev in events:
        assert {"name", "ph", "pid", "tid"} <= ev.keys()
        if ev["ph"] == "M":
            if ev["name"] == "thread_name":
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            continue
        assert ev["ph"] in ("B", "E") and isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        key = (ev["pid"], ev["tid"])
        if ev["ph"] == "B":
            stacks[key].append(ev)
        else:
            begin = stacks[key].pop()  # every end closes the latest begin of its track
            assert begin["name"] == ev["name"] and begin["ts"] <= ev["ts"]
    assert all(not stack for stack in stacks.values())
    # times are microseconds from the start: the last delay ends at 11 ms
    assert max(ev.get("ts", 0) for ev in events) == pytest.approx(11_000)
    stream = ais.virtual.timeline()[0].stream
    assert sorted(names.values()) == sorted(["the pipeline", f"virtual:0 stream {stream}"])


async def test_svg_has_one_track_per_task_and_stream(
    virtual_time: VirtualTime, tmp_path: Path
) -> None:
    other = ais.Stream()
    with ais.profile() as prof:
        ais.delay(0.001, stream=other)
        await (await pipeline_inside()).synchronize()
        await other.synchronize()
    path = tmp_path / "t.svg"
    prof.export_svg(path)
    root = ET.parse(path).getroot()
    ns = {"s": "http://www.w3.org/2000/svg"}
    tracks = root.findall("s:g[@class='track']", ns)
    kinds = sorted((g.get("data-kind"), g.get("data-track")) for g in tracks)
    streams = sorted({f"virtual:0 stream {r.stream}" for r in ais.virtual.timeline()})
    assert [k for k in kinds if k[0] == "stream"] == [("stream", t) for t in streams]
    assert len([k for k in kinds if k[0] == "task"]) == 1
    bars = root.findall(".//s:rect[@class='span device']", ns)
    assert len(bars) == len(ais.virtual.timeline())
    assert root.findall(".//s:rect[@class='span await']", ns)  # await gaps are drawn


async def pipeline_inside() -> ais.Stream:
    s = ais.Stream()
    with ais.record_function("step"):
        ais.delay(0.002, stream=s)
    return s


async def test_backends_without_a_timeline_use_timing_events(
    virtual_time: VirtualTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ais.Profiler, "native_timeline", lambda self, stream: False)
    s = ais.Stream()
    host, dev = ais.HostBuffer(1000), ais.DeviceBuffer(1000)
    with ais.profile() as prof:
        ais.delay(0.002, stream=s)
        ais.copy_async(dev, host, stream=s)
        await s.synchronize()
    ops = [s for s in prof.spans if s.kind == "device" and s.engine is None]
    timeline = ais.virtual.timeline()
    assert [o.name for o in ops] == [r.name for r in timeline] == ["delay", "copy h2d"]
    assert [(o.start, o.end) for o in ops] == [pytest.approx((r.start, r.end)) for r in timeline]


def test_profiles_do_not_nest_or_rerun(virtual_device: ais.Device) -> None:
    with ais.profile() as prof:
        with pytest.raises(ais.AiostreamError, match="already active"):
            with ais.profile():
                pass
    with pytest.raises(ais.AiostreamError, match="runs once"):
        with prof:
            pass
    with ais.profile() as again:  # neither failure left a profile active
        with ais.record_function("after"):
            pass
    assert [sp.name for sp in again.spans] == ["after"]


def test_record_function_bad_input(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        ais.record_function(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.record_function("x", stream="s")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- diagnostics


async def test_pending_waits_say_who_waits_on_what(virtual_time: VirtualTime) -> None:
    """A wait's age is wall-clock time (time.monotonic: any thread may ask for the listing),
    not the fake clock's: the test lets 0.05 s of it pass while the wait is pending."""
    ais.set_debug(True)
    try:
        s = ais.Stream()
        ais.delay(5.0, stream=s)
        e = s.record_event()  # recorded here
        async with anyio.create_task_group() as tg:
            before = time.monotonic()
            tg.start_soon(e.synchronize, name="the-waiter")
            await anyio.wait_all_tasks_blocked()
            time.sleep(0.05)  # wall-clock time, the fake clock stopped meanwhile
            (wait,) = ais.pending_waits()
            listed = time.monotonic()
            assert wait.task == "the-waiter"
            assert wait.subject == f"event {e.event_id} on stream {s.stream_id}"
            assert wait.device == "virtual:0"
            assert 0.05 <= wait.waited <= listed - before
            assert str(wait).startswith(
                f"task 'the-waiter' has waited {wait.waited:.3f} s on {wait.subject}"
            )
            assert "test_pending_waits_say_who_waits_on_what" in (wait.recorded_at or "")
            assert wait.started_at is not None
            assert "has waited" in str(wait) and "work recorded at" in str(wait)
            await anyio.sleep(5.0)
    finally:
        ais.set_debug(False)
    assert ais.pending_waits() == []


def _machinery_folders() -> list[str]:
    """The real folders of aiostream and of the loops' code, each ending with a separator."""
    import asyncio

    import trio

    return [
        os.path.join(os.path.dirname(m.__file__ or ""), "") for m in (ais, anyio, asyncio, trio)
    ]


def _listed_files(listing: str) -> list[str]:
    return [line.split('"')[1] for line in listing.splitlines()]


async def _wait_listed(stream: ais.Stream, waiter: Callable[[], Any]) -> ais.PendingWait:
    """The listing of the one wait ``waiter`` starts on ``stream``, whose work is held."""
    stall = ais.virtual.stall("compute")
    ais.delay(0.001, stream=stream)
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        try:
            await anyio.wait_all_tasks_blocked()
            (wait,) = ais.pending_waits()
        finally:
            stall.release()
    return wait


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
async def test_debug_listings_show_the_users_frames_only(anyio_backend: object) -> None:
    """Where a wait started and where its work was recorded, as the user's own frames: none of
    the loops' or aiostream's, judged by their real folders (the checkout may itself be in a
    folder named ``aiostream``). Real time, on every loop (the compute engine stalled holds
    the work until the listing is taken)."""
    ais.set_debug(True)
    try:
        s = ais.Stream()

        async def waiter() -> None:
            await s

        wait = await _wait_listed(s, waiter)
    finally:
        ais.set_debug(False)
    assert wait.started_at is not None and wait.recorded_at is not None
    machinery = tuple(_machinery_folders())
    for listing in (wait.started_at, wait.recorded_at):
        assert not [f for f in _listed_files(listing) if f.startswith(machinery)], listing
    assert wait.started_at.splitlines()[-1].endswith(", in waiter")
    assert wait.recorded_at.splitlines()[-1].endswith(", in _wait_listed")


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
async def test_a_users_file_named_like_the_package_is_listed(anyio_backend: object) -> None:
    """A user's script beside the package whose name starts with the package's
    (``aiostream_demo.py``) is the user's code: its frames are listed."""
    beside = os.path.join(os.path.dirname(os.path.dirname(ais.__file__)), "aiostream_demo.py")
    source = "async def user_waiter(s):\n    await s\n"
    scope: dict[str, Any] = {}
    exec(compile(source, beside, "exec"), scope)  # a frame of that file, nothing written
    ais.set_debug(True)
    try:
        s = ais.Stream()
        wait = await _wait_listed(s, lambda: scope["user_waiter"](s))
    finally:
        ais.set_debug(False)
    assert wait.started_at is not None
    assert _listed_files(wait.started_at)[-1] == beside, wait.started_at
    assert wait.started_at.splitlines()[-1].endswith(", in user_waiter")


async def test_tasks_without_a_name_are_told_apart(virtual_time: VirtualTime) -> None:
    """A task named "" is listed by its identity: two such tasks waiting are two names."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize, name="")
        tg.start_soon(s.synchronize, name="")
        await anyio.wait_all_tasks_blocked()
        names = sorted(wait.task for wait in ais.pending_waits())
        assert len(set(names)) == 2, names
        assert all(name.startswith("task ") and name[5:].isdigit() for name in names), names
        assert f"task {id(None)}" not in names


async def test_without_debug_no_tracebacks_are_taken(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize)
        await anyio.wait_all_tasks_blocked()
        (wait,) = ais.pending_waits()
        assert wait.started_at is None and wait.recorded_at is None
        assert "set_debug(True)" in str(wait)
        await anyio.sleep(1.0)


async def watched_wait(
    s: ais.Stream, seconds: float, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """Wait for ``seconds`` of work on ``s`` with the watchdog at 2 s; what it warned."""
    ais.set_watchdog(2.0)
    try:
        ais.delay(seconds, stream=s)
        with caplog.at_level(logging.WARNING, logger="aiostream"):
            await s.synchronize()
    finally:
        ais.set_watchdog(None)
    return [r.getMessage() for r in caplog.records if r.name == "aiostream"]


async def test_watchdog_warns_once_about_a_long_wait(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture
) -> None:
    s = ais.Stream()
    warnings = await watched_wait(s, 10.0, caplog)
    assert len(warnings) == 1
    assert "1 wait(s) pending for more than 2 s" in warnings[0]
    assert f"on stream {s.stream_id} (virtual:0)" in warnings[0]


async def test_watchdog_keeps_quiet_about_a_wait_shorter_than_its_threshold(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture
) -> None:
    """A wait counts from its own start: one of 1 s, begun at t=5 s, stays under 2 s."""
    await anyio.sleep(5.0)
    assert await watched_wait(ais.Stream(), 1.0, caplog) == []


def test_diagnostics_bad_input() -> None:
    with pytest.raises(ValueError, match="finite number > 0"):
        ais.set_watchdog(0)
    with pytest.raises(TypeError, match="number or None"):
        ais.set_watchdog("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True or False"):
        ais.set_debug(1)  # type: ignore[arg-type]


def failing(name: str) -> Callable[..., Any]:
    """A hook that fails at every call."""

    def hook(*args: object, **kwargs: object) -> Any:
        raise RuntimeError(name)

    return hook


async def test_a_failing_profiler_never_changes_what_the_program_sees(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile whose observer hooks (public: aiostream's instrumentation calls them) all fail,
    and which asks for timing marks on every stream: the program sees what it would see
    unprofiled; the failures are logged."""
    with ais.profile() as prof:
        with monkeypatch.context() as hooks:  # undone before the profile ends
            for name in ("now", "on_await", "mark", "add_device_range"):
                hooks.setattr(prof, name, failing(name))
            hooks.setattr(prof, "native_timeline", lambda stream: False)
            s = ais.Stream()
            ais.delay(0.01, stream=s)  # a device range: mark() fails
            await s.synchronize()  # a real wait: now() and on_await() fail
            await s.synchronize()  # the fast path
            ais.virtual.fail_next(stream=s, message="boom")
            ais.delay(0.01, stream=s)
            with pytest.raises(ais.DeviceError, match="boom"):  # the user's own error goes on
                await s.synchronize()
            del s
    with ais.profile() as again:  # the failing one is no longer plugged in
        with ais.record_function("after"):
            pass
    assert [sp.name for sp in again.spans] == ["after"]
    failed = [r.getMessage() for r in caplog.records if "the program goes on" in r.getMessage()]
    assert any("on_await()" in m for m in failed) and any("mark()" in m for m in failed)
    caplog.clear()  # the records' tracebacks hold the stream


@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
)
async def test_profiling_on_uvloop_in_real_time(virtual_device: ais.Device, tmp_path: Path) -> None:
    """uvloop cannot fake time, so here the virtual device runs on the monotonic clock."""
    s = ais.Stream()
    with ais.profile() as prof:
        async with ais.record_function("submit"):
            ais.delay(0.005, stream=s)
        await s.synchronize()
    kinds = sorted({sp.kind for sp in prof.spans})
    assert kinds == ["await", "device", "host"]
    (op,) = [sp for sp in prof.spans if sp.kind == "device"]
    assert op.duration == pytest.approx(0.005)
    (wait,) = [sp for sp in prof.spans if sp.kind == "await"]
    assert wait.end >= op.end  # resumed no earlier than the work completed
    prof.export_chrome_trace(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


async def test_watchdog_ignores_waits_that_already_finished(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture
) -> None:
    ais.set_watchdog(2.0)
    try:
        slow, quick = ais.Stream(), ais.Stream()
        ais.delay(10.0, stream=slow)
        ais.virtual.submit(quick, 1.0, engine="h2d")  # another engine: done at t=1
        with caplog.at_level(logging.WARNING, logger="aiostream"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(slow.synchronize)  # the oldest wait: at the head
                tg.start_soon(quick.synchronize)  # finishes at t=1, behind it
    finally:
        ais.set_watchdog(None)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "aiostream"]
    assert warning.startswith("1 wait(s) pending for more than 2 s")
    assert (
        f"on stream {slow.stream_id} " in warning and f"on stream {quick.stream_id} " not in warning
    )


def test_a_failing_profiler_never_replaces_the_user_s_exception(
    virtual_device: ais.Device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("profiler bug")

    with ais.profile() as prof:
        monkeypatch.setattr(prof, "add_host", broken)
        with pytest.raises(KeyError, match="user"):
            with ais.record_function("step"):
                raise KeyError("user")
        with ais.record_function("step"):
            result = 42
    assert result == 42
    assert any("failed in record_function" in r.getMessage() for r in caplog.records)
    caplog.clear()


# ---------------------------------------------------------------------- argument and state errors


@pytest.fixture
def std_descriptors() -> Iterator[None]:
    """Descriptors 0, 1 and 2 put back after the test, should a call write to one and close it."""
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        yield
    finally:
        for fd, copy in enumerate(saved):
            os.dup2(copy, fd)
            os.close(copy)


EXPORTS = {
    "export_chrome_trace": lambda prof, path: prof.export_chrome_trace(path),
    "export_svg": lambda prof, path: prof.export_svg(path),
}


@pytest.mark.usefixtures("std_descriptors")
@pytest.mark.parametrize("export", sorted(EXPORTS))
@pytest.mark.parametrize(
    "path",
    [True, 0, 1, 2, np.int64(2), 2.0, None, b"trace.out", ["trace.out"]],
    ids=repr,
)
def test_export_takes_only_a_path(
    virtual_device: ais.Device,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    export: str,
    path: object,
) -> None:
    """An int is a file descriptor to open(): it would be written to and closed."""
    monkeypatch.chdir(tmp_path)  # a bytes path, taken, would land here
    with ais.profile() as prof:
        pass
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike"):
        EXPORTS[export](prof, path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_export_leaves_an_open_descriptor_alone(
    virtual_device: ais.Device, tmp_path: Path, export: str
) -> None:
    with ais.profile() as prof:
        pass
    fd = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(TypeError, match="path must be"):
            EXPORTS[export](prof, fd)
        os.fstat(fd)  # still open
        assert (tmp_path / "other").read_bytes() == b""
    finally:
        os.close(fd)


@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_export_takes_str_and_path_like(
    virtual_device: ais.Device, tmp_path: Path, export: str
) -> None:
    with ais.profile() as prof:
        with ais.record_function("step"):
            pass
    EXPORTS[export](prof, str(tmp_path / "a"))
    EXPORTS[export](prof, tmp_path / "b")
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() != ""


NOT_RUN: dict[str, Callable[[ais.Profiler, Path], Any]] = {
    "summary": lambda prof, tmp: prof.summary(),
    "to_svg": lambda prof, tmp: prof.to_svg(),
    "export_chrome_trace": lambda prof, tmp: prof.export_chrome_trace(tmp / "out"),
    "export_svg": lambda prof, tmp: prof.export_svg(tmp / "out"),
    "__exit__": lambda prof, tmp: prof.__exit__(None, None, None),
}


@pytest.mark.parametrize("call", sorted(NOT_RUN))
def test_results_before_the_profile_ran_say_how_to_run_it(
    virtual_device: ais.Device, tmp_path: Path, call: str
) -> None:
    prof = ais.profile()
    with pytest.raises(ais.AiostreamError, match=r"has not run.*with aiostream\.profile\(\)"):
        NOT_RUN[call](prof, tmp_path)
    assert not (tmp_path / "out").exists()  # no empty file left behind
    with prof:  # it can still run
        pass
    assert prof.summary().wall >= 0


def test_str_and_repr_of_a_profile_tell_its_state(virtual_device: ais.Device) -> None:
    prof = ais.profile()
    assert "not run" in str(prof)
    assert "not run" in repr(prof) and "virtual:0" in repr(prof)
    with prof:
        assert "running" in repr(prof)
    assert "ended" in repr(prof)
    assert str(prof) == str(prof.summary())


def test_a_profile_ends_once(virtual_device: ais.Device) -> None:
    with ais.profile() as prof:
        ais.delay(0.0)
    spans = prof.spans
    with pytest.raises(ais.AiostreamError, match="already ended"):
        prof.__exit__(None, None, None)
    assert prof.spans == spans  # the device work is not collected twice


async def test_failed_device_work_in_a_range_does_not_fail_the_profile(
    virtual_time: VirtualTime,
) -> None:
    s = ais.Stream()
    with ais.profile() as prof:
        with ais.record_function("step", stream=s):
            ais.virtual.fail_next(stream=s, message="boom")
            ais.delay(0.001, stream=s)
        with pytest.raises(ais.DeviceError, match="boom"):  # the user's own error, as it was
            await s.synchronize()
    assert prof.unfinished == 1  # the range is not shown
    assert [sp.name for sp in prof.spans if sp.kind == "host"] == ["step"]


async def test_an_await_of_complete_work_is_recorded_as_a_zero_wait(
    virtual_time: VirtualTime,
) -> None:
    """The fast path (work complete already: one checkpoint) is reported as an await too."""
    s = ais.Stream()
    with ais.profile() as prof:
        e = s.record_event()
        await anyio.sleep(1.0)
        await e.synchronize()
        await s.synchronize()
    waits = [(sp.name, sp.start, sp.end, sp.args) for sp in prof.spans if sp.kind == "await"]
    assert sorted(waits) == [
        (f"await event {e.event_id} on stream {s.stream_id}", 1.0, 1.0, {"device": "virtual:0"}),
        (f"await stream {s.stream_id}", 1.0, 1.0, {"device": "virtual:0"}),
    ]


async def test_work_still_running_when_the_profile_ends_is_counted_not_shown(
    virtual_time: VirtualTime,
) -> None:
    s, t = ais.Stream(), ais.Stream()
    with ais.profile() as prof:
        with ais.record_function("awaited", stream=s):
            ais.delay(0.001, stream=s)
        await s.synchronize()
        with ais.record_function("left running", stream=t):
            ais.delay(1.0, stream=t)
    assert prof.unfinished == 1
    # the range left running and its 1 s of device work are not shown; the host range is
    shown = sorted((sp.kind, sp.name, sp.track) for sp in prof.spans if sp.kind != "host")
    assert shown == [
        ("await", f"await stream {s.stream_id}", shown[0][2]),
        ("device", "delay", f"virtual:0 stream {s.stream_id}"),
        ("range", "awaited", f"virtual:0 stream {s.stream_id}"),
    ]
    assert sorted(sp.name for sp in prof.spans if sp.kind == "host") == ["awaited", "left running"]
    await t.synchronize()  # done now, but after the profile: still not shown
    assert prof.unfinished == 1 and len(prof.spans) == 5


@pytest.mark.aiostream(check_leaks=False)  # the reset leaves the delay on the old backend
def test_a_reset_inside_a_range_does_not_fail_the_profile(virtual_device: ais.Device) -> None:
    s = ais.Stream()
    with ais.profile() as prof:
        with ais.record_function("step", stream=s):
            ais.delay(0.001, stream=s)
        ais.virtual.reset()
    assert prof.unfinished == 1


def test_the_profiler_s_public_hooks_check_their_arguments(virtual_device: ais.Device) -> None:
    """They are public, for aiostream's instrumentation; a wrong value fails at the call."""
    prof = ais.profile()
    s = ais.Stream()
    for bad in (None, "s", 3, ais.Event()):
        with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
            prof.mark(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
            prof.native_timeline(bad)  # type: ignore[arg-type]
    assert prof.native_timeline(s) is True  # the simulator shows its own work
    with pytest.raises(TypeError, match="name must be a str"):
        prof.add_host(None, "task", 0.0, 1.0, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="args must be a dict"):
        prof.add_host("step", "task", 0.0, 1.0, [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="start must be a number"):
        prof.on_await("task", "stream 1", "virtual:0", "0", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="end must be a finite number"):
        prof.add_host("step", "task", 0.0, float("nan"), {})
    with pytest.raises(ValueError, match="ends before it starts"):
        prof.on_await("task", "stream 1", "virtual:0", 2.0, 1.0)
    with pytest.raises(TypeError, match="start must be an aiostream.Event"):
        prof.add_device_range("r", s, None, ais.Event(), {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from mark"):
        prof.add_device_range("r", s, ais.Event(), ais.Event(), {})
    with prof:
        start = prof.mark(s)
        prof.add_device_range("r", s, start, prof.mark(s), {"k": 1})
        prof.add_host("step", "task", prof.now(), prof.now(), {})
    assert {sp.name for sp in prof.spans} == {"r", "step"}


def test_record_function_decorates_only_callables(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="decorates a function"):
        ais.record_function("x")(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("records", ["x", b"x", None, 3, [1], [None], ("virtual:0",)], ids=repr)
def test_format_timeline_takes_a_sequence_of_op_records(records: Any) -> None:
    with pytest.raises(TypeError, match="records must be a sequence of aiostream.virtual.OpRecord"):
        format_timeline(records)


def test_format_timeline_takes_lists_and_tuples() -> None:
    record = ais.virtual.OpRecord("k", 0, 3, "compute", 0.0, 0.5, 1.25, None)
    assert format_timeline([record]) == format_timeline((record,)) != format_timeline([])


def test_trace_shows_any_range_args(virtual_device: ais.Device, tmp_path: Path) -> None:
    """record_function takes any values; the trace holds them as strict JSON has them."""
    with ais.profile() as prof:
        with ais.record_function(
            "step",
            batch=np.int64(3),
            loss=np.float32(0.5),
            what=object(),
            bad=float("nan"),
            nested={"a": [np.float64(1.5), (1, 2)], 3: "x"},
        ):
            pass
    path = tmp_path / "t.json"
    prof.export_chrome_trace(path)

    def no_constants(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")

    doc = json.loads(path.read_text(), parse_constant=no_constants)
    (begin,) = [ev for ev in doc["traceEvents"] if ev["ph"] == "B"]
    args = begin["args"]
    assert args["batch"] == 3 and args["loss"] == 0.5 and args["bad"] == "nan"
    assert args["what"].startswith("<object object at")
    assert args["nested"] == {"a": [1.5, [1, 2]], "3": "x"}
    assert "step" in prof.to_svg()


def test_summary_table_with_no_count(virtual_device: ais.Device) -> None:
    """A Summary made by hand may hold a span name seen no time."""
    table = str(ais.Summary(0.0, {"x": (0, 0.0)}, {}, 0.0, 0.0, 0.0))
    assert table.splitlines()[1].split() == ["x", "0", "0.000", "0.000"]


@pytest.mark.parametrize(
    "fields",
    [
        ([], {}, {}, 0.0, 0.0, 0.0),
        (0.0, [], {}, 0.0, 0.0, 0.0),
        (0.0, {"x": 3}, {}, 0.0, 0.0, 0.0),
        (0.0, {"x": (1, "s")}, {}, 0.0, 0.0, 0.0),
        (0.0, {}, {"virtual:0 compute": None}, 0.0, 0.0, 0.0),
        (0.0, {}, {}, "0", 0.0, 0.0),
    ],
    ids=repr,
)
def test_a_summary_checks_its_fields(fields: tuple[Any, ...]) -> None:
    """Made by hand with a wrong field, it fails when made, never later when printed."""
    with pytest.raises(TypeError, match="must be"):
        ais.Summary(*fields)
