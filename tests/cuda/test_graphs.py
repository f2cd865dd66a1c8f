"""aiostream's graphs on CUDA, as the driver sees them: the graph holds the user's
work only and each launch runs it; aiostream's own capture in global mode breaks no wait of
another thread; memory freed during a capture waits for its end; executable graphs are
released at close and at the graph's; graphs stay on their device. The rules every backend
keeps are in ``tests/api/test_graphs.py``."""

from __future__ import annotations

import gc
import threading
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.capture import ForeignCapture
from tests.helpers.cuda import DEV, N, device_finishes, primary_context, ptr, two_devices
from tests.helpers.deadlines import until
from tests.helpers.faults import calls, succeeded
from tests.helpers.protocol import STRATEGIES
from tests.helpers.stand_in import FAKE, skip_on_a_stand_in_without_hooks, take_violations

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]

DEVICE_MEMORY = 4  # the stand-in's kind of live handle for device memory (fake_cuda_live)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_each_launch_runs_the_users_nodes_and_nothing_of_aiostreams(
    anyio_backend: object, strategy: str
) -> None:
    """Three captured operations, replayed and awaited four times with each wait strategy:
    the graph the driver made has three nodes (no mark, flag write or host function of
    aiostream's went into it), each launch runs them (the data goes round), and the graph
    and its executable graph live on until the graph is closed (the graph for its
    description, its handle and updates). The stand-in also counts the nodes run (twelve, no
    more) and the captures invalidated (none)."""
    ais.set_wait_strategy(strategy)
    if FAKE is not None:
        FAKE.fake_cuda_graph_nodes_run()  # only this test's count (reading resets them): other
        FAKE.fake_cuda_captures_invalidated()  # tests invalidate captures on purpose
    src, dst = ais.HostBuffer(N, device=DEV), ais.HostBuffer(N, device=DEV)
    buf = ais.DeviceBuffer(N, DEV)
    g = ais.Graph(DEV)
    with calls("cuGraphInstantiate", "cuGraphDestroy", "cuGraphExecDestroy") as made:
        with g.capture() as s:
            ais.copy_async(buf, src, stream=s)
            ais.delay(0.005, stream=s)
            ais.copy_async(dst, buf, stream=s)
            s.record_event()  # a captured event: an edge, no node, no mark
        assert g.nodes == 3  # the driver's count (cuGraphGetNodes)
        assert [succeeded(made[name]) for name in made] == [1, 0, 0]  # the graph made stays
        if FAKE is not None:
            assert (FAKE.fake_cuda_graphs_live(0), FAKE.fake_cuda_graphs_live(1)) == (1, 1)
        r = ais.Stream(DEV)
        for fill in range(1, 5):
            src.numpy()[:] = fill
            await g.replay(r)
            assert (dst.numpy() == fill).all()
        if FAKE is not None:
            assert FAKE.fake_cuda_graph_nodes_run() == 12
        g.close()
        assert [succeeded(made[name]) for name in made] == [1, 1, 1]
    if FAKE is not None:
        assert (FAKE.fake_cuda_graphs_live(0), FAKE.fake_cuda_graphs_live(1)) == (0, 0)
        assert FAKE.fake_cuda_captures_invalidated() == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_aiostreams_own_global_capture_breaks_no_wait_of_another_thread(
    anyio_backend: object, strategy: str
) -> None:
    """While this thread captures in global mode (as torch.cuda.graph does), a thread of the
    program's that waits, queries and allocates through aiostream breaks nothing: its calls
    are relaxed, and so are the watcher's."""
    ais.set_wait_strategy(strategy)
    errors: list[BaseException] = []
    started, finish = threading.Event(), threading.Event()

    def other_thread() -> None:
        try:
            t = ais.Stream(DEV)
            started.set()
            while not finish.is_set():
                ais.delay(0.002, stream=t)
                e = t.record_event()
                e.synchronize_blocking()
                t.query()
                del_me = ais.DeviceBuffer(N, DEV)
                del del_me
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        assert started.wait(30)
        g = ais.Graph(DEV)
        with g.capture(capture_error_mode="global") as s:
            for _ in range(10):
                ais.delay(0.001, stream=s)
                await anyio.sleep(0.005)  # the other thread works meanwhile
        await g.replay()
    finally:
        finish.set()
        worker.join(30)
    assert errors == [] and g.nodes == 10


async def test_memory_freed_during_a_capture_is_freed_after_it(anyio_backend: object) -> None:
    """A buffer used on the capturing stream before the capture, dropped during it: no mark
    can go on that stream, so its free waits for the capture's end; then it is freed (the
    frees aiostream asks the driver for say so; the stand-in's count of live memory too)."""
    s = ais.Stream(DEV)
    buf = ais.DeviceBuffer(N, DEV)
    address = ptr(buf)
    host = ais.HostBuffer(N, device=DEV)
    ais.copy_async(buf, host, stream=s)
    await s
    held = FAKE.fake_cuda_live(DEVICE_MEMORY) if FAKE is not None else 0

    def freed() -> int:
        return sum(
            1
            for name in frees
            for args, result in frees[name]
            if int(args[0]) == address and int(result[0]) == 0
        )

    with calls("cuMemFree", "cuMemFreeAsync") as frees:
        g = ais.Graph(DEV)
        with g.capture(s):
            ais.delay(0.001, stream=s)
            del buf
            gc.collect()
            assert freed() == 0  # not while the stream captures
            if FAKE is not None:
                assert FAKE.fake_cuda_live(DEVICE_MEMORY) == held
        await until(
            lambda: freed() == 1,
            "the buffer dropped during the capture to be freed once it ended",
        )
    if FAKE is not None:
        await until(
            lambda: FAKE.fake_cuda_live(DEVICE_MEMORY) == held - 1,
            "the stand-in to count the buffer freed",
        )
    await g.replay(s)
    g.close()


def test_the_backend_releases_open_graphs_at_close(own_backend: Any) -> None:
    g = ais.Graph(DEV)
    s = ais.Stream(DEV)
    with g.capture(s):
        ais.delay(0.001, stream=s)
    assert FAKE is None or (FAKE.fake_cuda_graphs_live(0), FAKE.fake_cuda_graphs_live(1)) == (1, 1)
    device_finishes()  # an idle device: the close unloads the kernel's module too
    own_backend.close()
    assert FAKE is None or (FAKE.fake_cuda_graphs_live(0), FAKE.fake_cuda_graphs_live(1)) == (0, 0)
    g.close()  # after the backend's close: nothing left to release, and no error


async def test_a_foreign_capture_and_ours_go_on_side_by_side(anyio_backend: object) -> None:
    """Another library captures on a thread of its own while aiostream captures on this one
    (both thread-local): both make their graphs."""
    with ForeignCapture("thread_local") as theirs:
        g = ais.Graph(DEV)
        with g.capture() as s:
            ais.delay(0.001, stream=s)
            await anyio.sleep(0.02)
        await g.replay()
    assert theirs.end_code == 0 and theirs.launched and g.nodes == 1


async def test_a_graph_stays_on_its_device(anyio_backend: object) -> None:
    two_devices()
    g = ais.Graph("cuda:0")
    with g.capture() as s:
        ais.delay(0.001, stream=s)
    with pytest.raises(ValueError, match="replay it on a stream of its own device"):
        g.replay(ais.Stream("cuda:1"))
    await g.replay()


async def test_a_capture_broken_outside_aiostream_says_so_and_makes_no_graph(
    anyio_backend: object,
) -> None:
    """A prohibited call made outside aiostream (the program's own cuStreamSynchronize of the
    capturing stream) breaks the capture: its end raises a CaptureError that says so, no
    graph is made, and the stream is usable after."""
    skip_on_a_stand_in_without_hooks()  # the driver refuses the call: a violation there
    g = ais.Graph(DEV, name="broken")
    with pytest.raises(ais.CaptureError, match="was broken by a call the driver prohibits"):
        with g.capture() as s:
            ais.delay(0.001, stream=s)
            with primary_context() as cu:
                handle = cu.CUstream(s.__cuda_stream__()[1])
                assert int(cu.cuStreamSynchronize(handle)[0]) != 0  # refused, and it breaks
    if FAKE is not None:
        count, log = take_violations()  # the program's own breach, which the stand-in counted
        assert count == 1 and "capture" in log, log
    with pytest.raises(ais.AiostreamError, match="the capture of graph 'broken' failed"):
        g.replay()
    ais.delay(0.001, stream=s)
    await s
