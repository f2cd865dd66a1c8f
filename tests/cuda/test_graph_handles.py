"""A graph's raw handles on CUDA are the driver's, and an update shares its source's graph:
another library counts the nodes through the ``CUgraph`` and launches the ``CUgraphExec``
itself; each graph is destroyed once no executable graph runs its work; a driver call that
fails is raised, and the graph goes on as it was. The rules every backend keeps are in
``tests/api/test_graph_tools.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N, primary_context
from tests.helpers.faults import calls, failing, succeeded
from tests.helpers.stand_in import FAKE

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


def echo(name: str) -> tuple[ais.Graph, ais.HostBuffer, ais.HostBuffer]:
    src, dst = ais.HostBuffer(N, device=DEV), ais.HostBuffer(N, device=DEV)
    buf = ais.DeviceBuffer(N, DEV)
    g = ais.Graph(DEV, name=name)
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        ais.delay(0.001, stream=s)
        ais.copy_async(dst, buf, stream=s)
    return g, src, dst


async def test_the_raw_handles_are_the_drivers(anyio_backend: object) -> None:
    """``raw_graph`` is a ``CUgraph`` whose nodes the driver counts; ``raw_exec`` a
    ``CUgraphExec`` another library launches on a stream of its own choosing."""
    g, src, dst = echo("shared")
    s = ais.Stream(DEV)
    await g.replay(s)  # a launch of another's is not ordered after the buffers' allocation
    src.numpy()[:] = 6
    with primary_context() as cu:
        err, _, count = cu.cuGraphGetNodes(cu.CUgraph(g.raw_graph))
        assert (int(err), count) == (0, g.nodes)
        (err,) = cu.cuGraphLaunch(cu.CUgraphExec(g.raw_exec), cu.CUstream(s.__cuda_stream__()[1]))
        assert int(err) == 0
    await s
    assert (dst.numpy() == 6).all()
    g.close()


async def test_each_graph_goes_once_no_executable_graph_runs_its_work(
    anyio_backend: object,
) -> None:
    """Updated, a graph lets its own capture's graph go and shares its source's, which
    outlives the source's close until the updated graph is closed too."""
    with calls("cuGraphDestroy", "cuGraphExecDestroy", "cuGraphExecUpdate") as made:
        g, *_ = echo("g")
        h, *_ = echo("h")
        g.update(h)
        assert [succeeded(made[name]) for name in made] == [1, 0, 1]  # g's capture's went
        if FAKE is not None:
            assert (FAKE.fake_cuda_graphs_live(0), FAKE.fake_cuda_graphs_live(1)) == (1, 2)
        h.close()
        assert [succeeded(made[name]) for name in made] == [1, 1, 1]  # g still runs its work
        await g.replay()
        g.close()
        assert [succeeded(made[name]) for name in made] == [2, 2, 1]
    if FAKE is not None:
        assert (FAKE.fake_cuda_graphs_live(0), FAKE.fake_cuda_graphs_live(1)) == (0, 0)


async def test_a_failing_driver_call_is_raised_and_the_graph_goes_on(
    anyio_backend: object, tmp_path: Path
) -> None:
    g, src, dst = echo("g")
    h, *_ = echo("h")
    handles = (g.raw_graph, g.raw_exec)
    with failing("cuGraphExecUpdate", code=1) as fault:
        with pytest.raises(ais.CudaError, match="cuGraphExecUpdate failed on cuda:0") as caught:
            g.update(h)
    assert fault.failed and caught.value.code == 1
    assert (g.raw_graph, g.raw_exec) == handles
    with failing("cuGraphDebugDotPrint", code=1):
        with pytest.raises(ais.CudaError, match="cuGraphDebugDotPrint failed on cuda:0"):
            g.debug_dump(tmp_path / "g.dot")
    src.numpy()[:] = 2
    await g.replay()
    assert (dst.numpy() == 2).all()
    g.close()
    h.close()
