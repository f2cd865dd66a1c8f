"""Device ranges on backends without a timeline of their own (CUDA): each op is timed by
marks the profiler records on its stream as the op is submitted, right before and right after
it, so that the marks stay in submission order. The virtual backend stands in, told to have no
timeline (``native_timeline`` False); its events are timed exactly, in virtual time."""

from __future__ import annotations

import pytest

import aiostream as ais
from aiostream.testing import VirtualTime

pytestmark = pytest.mark.anyio


async def test_timing_marks_bracket_each_op_in_submission_order(
    virtual_time: VirtualTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the backend keeps no timeline, each op is timed by marks recorded on its stream
    as it is submitted, right before and right after it: ops back to back on one stream,
    interleaved with another stream's (on another engine: neither waits for the other), each
    get exactly their own device time, and a range on a stream ends with the last op
    submitted inside it."""
    monkeypatch.setattr(ais.Profiler, "native_timeline", lambda self, stream: False)
    a, b = ais.Stream(), ais.Stream()
    host, dev = ais.HostBuffer(4000), ais.DeviceBuffer(4000)
    with ais.profile() as prof:
        with ais.record_function("step", stream=a):
            for i in range(3):
                ais.delay(0.001 * (i + 1), stream=a)
                ais.copy_async(dev, host, stream=b)
        ais.delay(0.002, stream=a)  # after the range: outside it
        await a.synchronize()
        await b.synchronize()
    timeline = ais.virtual.timeline()
    assert sorted(r.name for r in timeline) == ["copy h2d"] * 3 + ["delay"] * 4
    timed = [s for s in prof.spans if s.kind == "device" and s.engine is None]
    ranges = sorted((s.track, s.start, s.end, s.name) for s in timed)
    ran = sorted((f"virtual:0 stream {r.stream}", r.start, r.end, r.name) for r in timeline)
    assert [(t, n) for t, _, _, n in ranges] == [(t, n) for t, _, _, n in ran]
    assert [x for _, a, b, _ in ranges for x in (a, b)] == pytest.approx(
        [x for _, a, b, _ in ran for x in (a, b)]
    )
    assert [r.end for r in timeline if r.stream == a.stream_id] == pytest.approx(
        [0.001, 0.003, 0.006, 0.008]
    )
    (step,) = [s for s in prof.spans if s.kind == "range"]
    assert (step.start, step.end) == (pytest.approx(0.0), pytest.approx(0.006))
