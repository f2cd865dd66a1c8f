"""What peers' graph APIs have beside capture and replay, on every backend (virtual devices and
CUDA, on the stand-in driver in CI) and every loop: whether a stream is capturing, a warning
for a capture that recorded nothing, a DOT description, the raw handles, and an executable
graph updated in place from a new capture of the same topology."""

from __future__ import annotations

import functools
import gc
import weakref
from pathlib import Path

import pytest

import aiostream as ais
from tests.helpers import dot
from tests.helpers.deadlines import until
from tests.helpers.races import closed_while_called

pytestmark = pytest.mark.anyio

N = 1024
LONG = 0.3  # seconds of device work that is still pending after a few quick calls


def pipeline(dev: ais.Device) -> tuple[ais.HostBuffer, ais.HostBuffer, ais.DeviceBuffer]:
    return ais.HostBuffer(N, device=dev), ais.HostBuffer(N, device=dev), ais.DeviceBuffer(N, dev)


def echo(dev: ais.Device, name: str, seconds: float = 0.001) -> tuple[ais.Graph, ...]:
    """A graph that copies a host buffer to the device, runs a kernel and copies it back: the
    graph, and its source and destination."""
    src, dst, buf = pipeline(dev)
    g = ais.Graph(dev, name=name)
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        ais.delay(seconds, stream=s)
        ais.copy_async(dst, buf, stream=s)
    return g, src, dst  # type: ignore[return-value]


async def test_a_stream_says_whether_it_is_capturing(aiostream_device: ais.Device) -> None:
    """The capturing stream and the streams it forked to are capturing until the capture
    ends; no other is (the default stream included), and the current stream inside the block
    is the capturing one, as ``torch.cuda.is_current_stream_capturing()`` says."""
    dev = aiostream_device
    other, bystander = ais.Stream(dev), ais.Stream(dev)
    assert not ais.is_current_stream_capturing() and not ais.is_current_stream_capturing(dev)
    g = ais.Graph(dev)
    with g.capture() as s:
        assert s.is_capturing()
        assert ais.is_current_stream_capturing() and ais.is_current_stream_capturing(dev)
        assert not other.is_capturing() and not ais.default_stream(dev).is_capturing()
        ais.delay(0.001, stream=s)
        other.wait_stream(s)  # a fork: other joins the capture
        assert other.is_capturing() and not bystander.is_capturing()
        ais.delay(0.001, stream=other)
        s.wait_stream(other)
        with ais.use_stream(bystander):
            assert not ais.is_current_stream_capturing(dev)
    assert not s.is_capturing() and not other.is_capturing()
    assert not ais.is_current_stream_capturing()
    await g.replay()
    g.close()


async def test_a_capture_that_recorded_nothing_warns(aiostream_device: ais.Device) -> None:
    """The usual mistake: the block's work went to another stream than the capturing one. The
    warning points at the with statement; the graph is made, and its replay does nothing."""
    dev = aiostream_device
    elsewhere = ais.Stream(dev)
    g = ais.Graph(dev, name="hollow")
    with pytest.warns(UserWarning) as caught:
        with g.capture():
            ais.delay(0.001, stream=elsewhere)  # not the capturing stream: it runs now
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "the capture of graph 'hollow' recorded no work, so its replays do nothing: was the "
        "work submitted to another stream than the capturing one (the with block's, current "
        "inside it), or to another device, instead of to it?"
    )
    assert caught[0].filename == __file__
    assert g.nodes == 0
    await g.replay()
    await elsewhere
    g.close()


async def test_debug_dump_writes_one_node_per_operation_and_an_edge_per_dependency(
    aiostream_device: ais.Device, tmp_path: Path
) -> None:
    """A copy in, a kernel, a fork to a kernel on another stream, joined back into a copy out:
    four nodes and four edges (the copy out waits for both kernels)."""
    dev = aiostream_device
    src, dst, buf = pipeline(dev)
    other = ais.Stream(dev)
    g = ais.Graph(dev, name="forked")
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        ais.delay(0.001, stream=s)
        other.wait_stream(s)
        ais.delay(0.001, stream=other)
        s.wait_stream(other)
        ais.copy_async(dst, buf, stream=s)
    for verbose in (False, True):
        path = tmp_path / f"graph-{verbose}.dot"
        assert g.debug_dump(path, verbose=verbose) is None
        text = path.read_text()
        assert text.lstrip().startswith("digraph")
        nodes, edges = dot.parse(text)
        assert len(nodes) == len(set(nodes)) == g.nodes == 4
        assert len(edges) == len(set(edges)) == 4
        assert {end for edge in edges for end in edge} == set(nodes)
        into = {n: sum(1 for _, to in edges if to == n) for n in nodes}
        assert sorted(into.values()) == [0, 1, 1, 2]  # one root; the copy out joins the fork
        assert "KERNEL" in text and "MEMCPY" in text
    g.debug_dump(str(tmp_path / "again.dot"))  # a str names a file too
    g.close()


async def test_debug_dump_and_the_handles_need_a_graph_ready(
    aiostream_device: ais.Device, tmp_path: Path
) -> None:
    dev = aiostream_device
    path = tmp_path / "g.dot"
    g = ais.Graph(dev, name="g")
    for ask in (lambda: g.debug_dump(path), lambda: g.raw_graph, lambda: g.raw_exec):
        with pytest.raises(ais.AiostreamError, match="has not been captured"):
            ask()
    with g.capture() as s:
        with pytest.raises(ais.CaptureError) as caught:
            g.debug_dump(path)
        assert str(caught.value) == (
            "graph 'g' is being captured: leave its capture's with block before describing it"
        )
        with pytest.raises(ais.CaptureError, match="before asking for its handles"):
            g.raw_exec  # noqa: B018 - the property's refusal is the test
        ais.delay(0.001, stream=s)
    assert not path.exists()
    with pytest.raises(TypeError, match="path must be a str or an os.PathLike"):
        g.debug_dump(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verbose must be a bool"):
        g.debug_dump(path, verbose=1)  # type: ignore[arg-type]
    with pytest.raises(OSError):
        g.debug_dump(tmp_path / "missing" / "g.dot")
    g.close()
    with pytest.raises(ais.AiostreamError) as caught:
        g.debug_dump(path)
    assert str(caught.value) == "graph 'g' was closed: it can no longer be described"
    with pytest.raises(ais.AiostreamError, match="can no longer be asked for its handles"):
        g.raw_graph  # noqa: B018
    assert not path.exists()


async def test_the_raw_handles_are_ints_distinct_between_graphs(
    aiostream_device: ais.Device,
) -> None:
    dev = aiostream_device
    g, *_ = echo(dev, "one")
    h, *_ = echo(dev, "two")
    handles = [g.raw_graph, g.raw_exec, h.raw_graph, h.raw_exec]
    assert all(type(x) is int and x > 0 for x in handles)
    assert len(set(handles)) == 4
    assert (g.raw_graph, g.raw_exec) == (handles[0], handles[1])  # stable
    await g.replay()
    g.close()
    h.close()


async def test_an_update_makes_the_replays_run_the_new_captures_work(
    aiostream_device: ais.Device,
) -> None:
    """The new capture's buffers and kernel duration, in the old executable graph: replays
    move the new buffers' bytes; the graph keeps them alive once the new one is closed and
    the program dropped them; its executable handle stays, its graph is the new one's."""
    dev = aiostream_device
    g, old_src, old_dst = echo(dev, "step", 0.001)
    h, src, dst = echo(dev, "step v2", 0.002)
    exe, new_graph = g.raw_exec, h.raw_graph
    assert g.update(h) is None
    assert (g.raw_exec, g.raw_graph, g.nodes) == (exe, new_graph, 3)
    refs = [weakref.ref(b) for b in (src, dst)]
    old_src.numpy()[:] = 1
    for fill in (4, 5):
        src.numpy()[:] = fill
        await g.replay()
        assert (dst.numpy() == fill).all()
    assert not old_dst.numpy().any()  # the old buffers are no longer copied
    h.close()
    del src, dst
    gc.collect()
    assert all(r() is not None for r in refs)  # the updated graph copies them
    await g.replay()
    g.close()
    await until(
        lambda: (gc.collect(), all(r() is None for r in refs))[1],
        "the buffers to go once both graphs were closed",
    )


async def test_a_replay_enqueued_before_an_update_runs_the_old_work(
    aiostream_device: ais.Device,
) -> None:
    dev = aiostream_device
    g, old_src, old_dst = echo(dev, "a")
    h, src, dst = echo(dev, "b")
    old_src.numpy()[:] = 7
    src.numpy()[:] = 8
    r = ais.Stream(dev)
    ais.delay(LONG, stream=r)
    pending = g.replay(r)  # behind the long kernel
    g.update(h)
    after = g.replay(r)
    await pending
    assert (old_dst.numpy() == 7).all()
    await after
    assert (dst.numpy() == 8).all()
    g.close()
    h.close()


async def test_updates_in_a_row_let_go_of_the_buffers_they_replaced(
    aiostream_device: ais.Device,
) -> None:
    """The usual loop (capture the next step, update, close it): a graph keeps only the
    buffers its replays now copy. Those it replaced go at once when no replay is in flight,
    else once the replays enqueued before the update, which may still copy them, completed."""
    dev = aiostream_device
    g, src, dst = echo(dev, "step")
    replaced = [weakref.ref(b) for b in (src, dst)]
    del src, dst
    for _ in range(3):  # no replay in flight
        h, src, dst = echo(dev, "next step")
        g.update(h)
        h.close()
        gc.collect()
        assert all(ref() is None for ref in replaced), "replaced buffers kept"
        replaced = [weakref.ref(b) for b in (src, dst)]
        del src, dst
    r = ais.Stream(dev)
    ais.delay(LONG, stream=r)
    pending = g.replay(r)  # behind the long kernel: it still copies the current buffers
    h, src, dst = echo(dev, "last step")
    g.update(h)
    h.close()
    current = [weakref.ref(b) for b in (src, dst)]
    del src, dst
    gc.collect()
    assert all(ref() is not None for ref in replaced)  # the pending replay copies them
    await pending
    await until(
        lambda: (gc.collect(), all(ref() is None for ref in replaced))[1],
        "the replaced buffers to go once the replay before the update completed",
    )
    assert all(ref() is not None for ref in current)  # what the graph copies now
    await g.replay()
    g.close()


def words_of(graph: str, source: str, reason: str) -> str:
    return (
        f"graph {graph!r} cannot be updated from graph {source!r}: {reason}. Graph {graph!r} "
        f"is unchanged and still replays its own work; to run the new work, replay graph "
        f"{source!r} itself (or capture it into a new Graph): an update takes a capture of the "
        "same operations, of the same kinds, with the same dependencies"
    )


TOPOLOGY = "its topology differs (another number of operations, or other dependencies between them)"


async def test_an_update_from_another_topology_is_refused_and_changes_nothing(
    aiostream_device: ais.Device,
) -> None:
    """Another count of operations, the same count with other dependencies, a copy where the
    kernel was, a copy in the other direction: each a GraphUpdateError with the same words on
    every backend; the graph, and the one it was refused, still replay their own work."""
    dev = aiostream_device
    src, dst, buf = pipeline(dev)
    g = ais.Graph(dev, name="chain")
    with g.capture() as s:  # a kernel, then a copy out
        ais.delay(0.001, stream=s)
        ais.copy_async(dst, buf, stream=s)
    longer = ais.Graph(dev, name="longer")
    with longer.capture() as s:
        ais.delay(0.001, stream=s)
        ais.copy_async(dst, buf, stream=s)
        ais.delay(0.001, stream=s)
    side_by_side = ais.Graph(dev, name="side by side")
    other = ais.Stream(dev)
    with side_by_side.capture() as s:  # the same two nodes, neither waiting for the other
        other.wait_event(s.record_event())
        ais.delay(0.001, stream=s)
        ais.copy_async(dst, buf, stream=other)
        s.wait_stream(other)
    swapped = ais.Graph(dev, name="swapped")
    with swapped.capture() as s:  # a copy where the kernel was, and the reverse
        ais.copy_async(dst, buf, stream=s)
        ais.delay(0.001, stream=s)
    reversed_copy = ais.Graph(dev, name="reversed")
    with reversed_copy.capture() as s:  # the copy the other way
        ais.delay(0.001, stream=s)
        ais.copy_async(buf, src, stream=s)
    node_type = "an operation is of another kind (a kernel where a copy was, or the reverse)"
    parameters = (
        "an operation's parameters changed in a way an executable graph cannot take (a "
        "copy's direction, or its memory's device)"
    )
    cases = [
        (longer, "topology", TOPOLOGY),
        (side_by_side, "topology", TOPOLOGY),
        (swapped, "node type", node_type),
        (reversed_copy, "parameters", parameters),
    ]
    handles = (g.raw_graph, g.raw_exec)
    r = ais.Stream(dev)
    for fill, (source, reason, words) in enumerate(cases, 1):
        with pytest.raises(ais.GraphUpdateError) as caught:
            g.update(source)
        assert isinstance(caught.value, ais.CaptureError)
        assert caught.value.reason == reason
        assert str(caught.value) == words_of("chain", source.name, words)
        assert (g.raw_graph, g.raw_exec) == handles
        src.numpy()[:] = fill
        ais.copy_async(buf, src, stream=r)
        await g.replay(r)  # its own kernel and copy out
        assert (dst.numpy() == fill).all()
        await source.replay(r)  # the source is whole too
    for graph in (g, longer, side_by_side, swapped, reversed_copy):
        graph.close()


async def test_an_update_pairs_each_dependency(aiostream_device: ais.Device) -> None:
    """Three kernels in a chain, and three where the last waits for the first instead of the
    second: as many nodes, each with as many dependencies, yet another topology."""
    dev = aiostream_device
    chain, fan = ais.Graph(dev, name="chain"), ais.Graph(dev, name="fan")
    with chain.capture() as s:
        for _ in range(3):
            ais.delay(0.001, stream=s)
    other = ais.Stream(dev)
    with fan.capture() as s:
        ais.delay(0.001, stream=s)
        other.wait_stream(s)
        ais.delay(0.001, stream=s)
        ais.delay(0.001, stream=other)
        s.wait_stream(other)
    with pytest.raises(ais.GraphUpdateError) as caught:
        chain.update(fan)
    assert caught.value.reason == "topology"
    await chain.replay()
    chain.close()
    fan.close()


async def test_what_an_update_refuses_before_asking_the_driver(
    aiostream_device: ais.Device,
) -> None:
    dev = aiostream_device
    g, *_ = echo(dev, "g")
    h, *_ = echo(dev, "h")
    with pytest.raises(TypeError, match="other must be an aiostream.Graph"):
        g.update("h")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be updated from itself"):
        g.update(g)
    fresh = ais.Graph(dev, name="fresh")
    with pytest.raises(ais.AiostreamError, match="graph 'fresh' has not been captured"):
        g.update(fresh)
    with pytest.raises(ais.AiostreamError, match="graph 'fresh' has not been captured"):
        fresh.update(g)
    with fresh.capture() as s:
        with pytest.raises(ais.CaptureError) as caught:
            g.update(fresh)
        assert str(caught.value) == (
            "graph 'fresh' is being captured: leave its capture's with block before updating "
            "it or another from it"
        )
        ais.delay(0.001, stream=s)
    h.close()
    with pytest.raises(ais.AiostreamError) as caught:
        g.update(h)
    assert str(caught.value) == (
        "graph 'h' was closed: it can no longer be updated or update another"
    )
    await g.replay()  # the refusals left it whole
    g.close()
    fresh.close()


async def test_close_racing_updates_on_another_thread(aiostream_device: ais.Device) -> None:
    """Each update is made whole or refused as closed, never a destroyed handle's error; the
    close waits for an update under way."""
    dev = aiostream_device
    for trial in range(10):
        g, *_ = echo(dev, f"raced {trial}")
        h, *_ = echo(dev, "source")
        raised = closed_while_called(g, functools.partial(g.update, h))
        assert [str(e) for e in raised] == [
            f"graph 'raced {trial}' was closed: it can no longer be updated or update another"
        ]
        await h.replay()
        h.close()


async def test_an_update_across_devices_or_backends_is_refused() -> None:
    ais.virtual.reset(devices=2)
    g, *_ = echo(ais.device("virtual:0"), "zero")
    h, *_ = echo(ais.device("virtual:1"), "one")
    with pytest.raises(ValueError) as caught:
        g.update(h)
    assert str(caught.value) == (
        "graph 'zero' is on virtual:0 and cannot be updated from graph 'one', captured on "
        "virtual:1: update it from a capture of its own device"
    )
    ais.virtual.reset()
    fresh, *_ = echo(ais.device("virtual:0"), "fresh")
    with pytest.raises(ais.StaleHandleError):
        g.update(fresh)
    with pytest.raises(ais.StaleHandleError):
        g.raw_graph  # noqa: B018
    fresh.close()
