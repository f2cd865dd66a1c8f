"""Graphs on the virtual device: a replay's timeline is exact and the same at every replay, on
every run and loop; faults injected into a replay fail it and the device; the profiler shows
captures and replays."""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais

pytestmark = pytest.mark.anyio

MS = 1e-3


def captured_pipeline(nbytes: int) -> tuple[ais.Graph, ais.HostBuffer]:
    """Copy in, two kernels on a forked stream and one on the origin, copy out."""
    src, dst = ais.HostBuffer(nbytes), ais.HostBuffer(nbytes)
    buf = ais.DeviceBuffer(nbytes)
    side = ais.Stream(priority=-1)
    g = ais.Graph(name="pipeline")
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        side.wait_stream(s)
        ais.delay(2 * MS, stream=side)
        ais.delay(1 * MS, stream=side)
        ais.delay(3 * MS, stream=s)
        s.wait_stream(side)
        ais.copy_async(dst, buf, stream=s)
    return g, dst


def relative(ops: list[ais.virtual.OpRecord], t0: float) -> list[tuple[str, str, float, float]]:
    return [(op.name, op.engine, round(op.start - t0, 9), round(op.end - t0, 9)) for op in ops]


# what one replay of captured_pipeline(1 MB) runs, from its launch (virtual's defaults: 10 us
# + bytes / 25 GB/s a copy, one compute slot, the forked stream's priority first)
COPY = 10e-6 + 2**20 / 25e9
ONE_REPLAY = [
    ("copy h2d", "h2d", 0.0, COPY),
    ("delay", "compute", COPY, COPY + 2 * MS),
    ("delay", "compute", COPY + 2 * MS, COPY + 3 * MS),
    ("delay", "compute", COPY + 3 * MS, COPY + 6 * MS),
    ("copy d2h", "d2h", COPY + 6 * MS, 2 * COPY + 6 * MS),
]


async def test_every_replay_has_the_same_exact_timeline(clock: ais.virtual.VirtualClock) -> None:
    """Three replays, each launched when the previous one ended, on every loop: the same
    operations at the same offsets from the launch, to the nanosecond."""
    g, _ = captured_pipeline(2**20)
    assert ais.virtual.timeline() == []  # the capture ran nothing
    r = ais.Stream()
    for _ in range(3):
        t0 = ais.virtual.now()
        done = g.replay(r)
        clock.advance(1.0)
        await done
        ops = [op for op in ais.virtual.timeline() if op.start >= t0]
        assert [(n, e) for n, e, _, _ in relative(ops, t0)] == [(n, e) for n, e, *_ in ONE_REPLAY]
        for (_, _, start, end), (_, _, s, e) in zip(relative(ops, t0), ONE_REPLAY, strict=True):
            assert (start, end) == pytest.approx((s, e), abs=1e-9)


async def test_back_to_back_replays_queue_behind_each_other(
    clock: ais.virtual.VirtualClock,
) -> None:
    """Replays launched at once on two streams run one after the other (the launches of one
    graph are ordered); the second starts the instant the first ends."""
    g, _ = captured_pipeline(2**20)
    a, b = ais.Stream(), ais.Stream()
    t0 = ais.virtual.now()
    first, second = g.replay(a), g.replay(b)
    clock.advance(1.0)
    await second
    assert first.query()
    ops = relative(ais.virtual.timeline(), t0)
    assert len(ops) == 10
    end_of_first = ops[4][3]
    assert ops[5][2] == pytest.approx(end_of_first, abs=1e-9)


async def test_a_fault_injected_into_a_replay_fails_it_and_the_device() -> None:
    ais.virtual.reset()
    g = ais.Graph()
    with g.capture() as s:
        ais.delay(MS, stream=s)
    r = ais.Stream()
    await g.replay(r)
    ais.virtual.fail_next(stream=r, message="ECC error in a replay")
    with pytest.raises(ais.DeviceError, match="ECC error in a replay"):
        await g.replay(r)
    with pytest.raises(ais.DeviceError, match="ECC error in a replay"):
        g.replay(r)  # the device failed: nothing more is enqueued
    ais.virtual.reset()


async def test_the_profiler_shows_the_capture_and_each_replay() -> None:
    g = ais.Graph(name="decode")
    with ais.profile() as prof:
        with g.capture() as s:
            ais.delay(MS, stream=s)
        r = ais.Stream()
        for _ in range(3):
            await g.replay(r)
    spans = prof.spans
    assert [sp.name for sp in spans if sp.kind == "host" and "decode" in sp.name] == [
        "capture decode",
        "replay decode",
        "replay decode",
        "replay decode",
    ]
    ranges = [sp for sp in spans if sp.kind == "range" and sp.name == "replay decode"]
    assert len(ranges) == 3 and all(sp.end - sp.start >= MS for sp in ranges)
    assert sum(1 for sp in spans if sp.kind == "device" and sp.name == "delay") == 3


@pytest.mark.parametrize("nodes", [1, 10, 100])
async def test_a_replay_of_n_nodes_runs_n_operations(nodes: int) -> None:
    g = ais.Graph()
    with g.capture() as s:
        for _ in range(nodes):
            ais.delay(0.0, stream=s)
    assert g.nodes == nodes
    await g.replay()
    assert len(ais.virtual.timeline()) == nodes
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(g.replay().synchronize)
    assert len(ais.virtual.timeline()) == 4 * nodes


async def test_a_replay_aborted_by_a_fault_leaves_nothing_pending() -> None:
    """A fault in a replay's first node fails the device: what was running is aborted, and
    so is the node its failure made ready at that instant; the nodes after it are never made
    (not run, not shown, not counted as pending)."""
    ais.virtual.reset(compute_slots=2)
    g = ais.Graph()
    side = ais.Stream()
    with g.capture() as s:
        side.wait_stream(s)
        ais.delay(5 * MS, stream=side)  # running when the fault lands: aborted
        ais.delay(MS, stream=s)  # fails
        for _ in range(4):
            ais.delay(MS, stream=s)  # never made
        s.wait_stream(side)
    r = ais.Stream()
    ais.virtual.fail_next(stream=r, engine="compute", message="ECC error")
    done = g.replay(r)
    assert ais.virtual.stats().operations == 6
    with pytest.raises(ais.DeviceError, match="ECC error"):
        await done
    assert ais.virtual.stats().operations == 0
    ops = ais.virtual.timeline()
    aborted = "aborted: the device had failed"
    assert [(op.stream, op.error) for op in ops] == [
        (side.stream_id, aborted),  # started with the failing node, on the forked stream
        (r.stream_id, "ECC error"),
        (r.stream_id, aborted),  # ready as the failure landed: ends at once
    ]
    assert ops[2].start == ops[2].end == ops[1].end
    ais.virtual.reset()
