"""The profiler, trace export and the diagnostics of pending waits."""

from __future__ import annotations

import json
import logging
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import anyio
import pytest

import aiostream as ais
from aiostream import _hooks, profiler
from aiostream.testing import VirtualTime

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Virtual time runs on asyncio's default loop and on trio (uvloop cannot fake time)."""
    return request.param


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
    assert "overlap (host and device busy / device busy): 0.444" in table
    assert "device busy, virtual:0 compute" in table


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
    prof = await pipeline()
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
    assert sorted(names.values()) == sorted(
        ["task " + prof.spans[0].track, f"virtual:0 stream {stream}"]
    )


async def test_svg_has_one_lane_per_task_and_stream(
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
    lanes = root.findall("s:g[@class='lane']", ns)
    kinds = sorted((g.get("data-kind"), g.get("data-track")) for g in lanes)
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
    monkeypatch.setattr(profiler.Profiler, "native_timeline", lambda self, stream: False)
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
    assert _hooks.observer is None


def test_record_function_bad_input(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        ais.record_function(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.record_function("x", stream="s")  # type: ignore[arg-type]


def test_nvtx_ranges_when_available(
    virtual_device: ais.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, ...]] = []

    class FakeNvtx:
        def push_range(self, name: str) -> None:
            calls.append(("push", name))

        def pop_range(self) -> None:
            calls.append(("pop",))

    monkeypatch.setattr(_hooks, "nvtx", FakeNvtx())
    with ais.record_function("outer"):  # no profiler: NVTX only
        with ais.record_function("inner"):
            pass
    assert calls == [("push", "outer"), ("push", "inner"), ("pop",), ("pop",)]


# ---------------------------------------------------------------------- diagnostics


async def test_pending_waits_say_who_waits_on_what(virtual_time: VirtualTime) -> None:
    ais.set_debug(True)
    try:
        s = ais.Stream()
        ais.delay(5.0, stream=s)
        e = s.record_event()  # recorded here
        async with anyio.create_task_group() as tg:
            tg.start_soon(e.synchronize, name="the-waiter")
            await anyio.wait_all_tasks_blocked()
            (wait,) = ais.pending_waits()
            assert wait.task == "the-waiter"
            assert wait.subject == f"event {e.event_id} on stream {s.stream_id}"
            assert wait.device == "virtual:0"
            assert wait.waited >= 0
            assert "test_pending_waits_say_who_waits_on_what" in (wait.recorded_at or "")
            assert wait.started_at is not None
            assert "has waited" in str(wait) and "work recorded at" in str(wait)
            await anyio.sleep(5.0)
    finally:
        ais.set_debug(False)
    assert ais.pending_waits() == []


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


async def test_watchdog_warns_once_about_a_long_wait(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture
) -> None:
    ais.set_watchdog(2.0)
    try:
        s = ais.Stream()
        ais.delay(10.0, stream=s)
        with caplog.at_level(logging.WARNING, logger="aiostream"):
            await s.synchronize()
    finally:
        ais.set_watchdog(None)
    warnings = [r for r in caplog.records if r.name == "aiostream"]
    assert len(warnings) == 1
    assert "1 wait(s) pending for more than 2 s" in warnings[0].getMessage()
    assert f"on stream {s.stream_id} (virtual:0)" in warnings[0].getMessage()


def test_diagnostics_bad_input() -> None:
    with pytest.raises(ValueError, match="finite number > 0"):
        ais.set_watchdog(0)
    with pytest.raises(TypeError, match="number or None"):
        ais.set_watchdog("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True or False"):
        ais.set_debug(1)  # type: ignore[arg-type]


def test_nvtx_is_turned_on_only_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend calls enable_nvtx() when it starts (test_fake_driver.py shows it)."""
    import sys
    import types

    fake_nvtx = types.ModuleType("nvtx")
    monkeypatch.setattr(_hooks, "nvtx", None)
    monkeypatch.setitem(sys.modules, "nvtx", None)  # not installed: the import fails
    _hooks.enable_nvtx()
    assert _hooks.nvtx is None
    monkeypatch.setitem(sys.modules, "nvtx", fake_nvtx)
    _hooks.enable_nvtx()
    assert _hooks.nvtx is fake_nvtx


class Failing:
    """An observer that fails at every call."""

    def now(self) -> float:
        raise RuntimeError("now")

    def on_await(self, *args: object) -> None:
        raise RuntimeError("on_await")

    def native_timeline(self, stream: object) -> bool:
        return False

    def mark(self, stream: object) -> object:
        raise RuntimeError("mark")

    def add_device_range(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("add_device_range")


async def test_a_failing_observer_never_changes_what_the_program_sees(
    virtual_time: VirtualTime, caplog: pytest.LogCaptureFixture
) -> None:
    obs = Failing()
    _hooks.install(obs)  # type: ignore[arg-type]
    try:
        s = ais.Stream()
        ais.delay(0.01, stream=s)  # a device range: mark() fails
        await s.synchronize()  # a real wait: now() and on_await() fail
        await s.synchronize()  # the fast path
        ais.virtual.fail_next(stream=s, message="boom")
        ais.delay(0.01, stream=s)
        with pytest.raises(ais.DeviceError, match="boom"):  # the user's own error goes on
            await s.synchronize()
        del s
    finally:
        _hooks.uninstall(obs)  # type: ignore[arg-type]
    assert _hooks.observer is None
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
