"""How to test an async GPU pipeline with aiostream's pytest plugin, with no GPU.

Run it with ``pytest examples/test_example_app.py``. The plugin comes with aiostream; anyio's
plugin runs the async tests (pytest-asyncio works too, in strict mode).
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import aiostream as ais

pytestmark = pytest.mark.anyio


# --- the application under test ------------------------------------------------------------


async def scale_all(chunks: list[np.ndarray], factor: float) -> list[np.ndarray]:
    """Upload each chunk, 'compute' on the device, download the results."""
    stream = ais.Stream()
    results = []
    for chunk in chunks:
        host = ais.HostBuffer(chunk.nbytes)
        host.numpy(chunk.dtype)[:] = chunk * factor  # the host does the math here
        dev = ais.DeviceBuffer(chunk.nbytes)
        ais.copy_async(dev, host, stream=stream)
        ais.delay(2.0, stream=stream)  # a slow kernel: two seconds per chunk
        out = ais.HostBuffer(chunk.nbytes)
        ais.copy_async(out, dev, stream=stream)
        results.append(out)
    await stream.synchronize()  # comment this out and the race detector fails the test
    return [r.numpy(np.float32).copy() for r in results]


# --- the tests -----------------------------------------------------------------------------


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Virtual time works on asyncio's default loop and on trio."""
    return request.param


async def test_results_are_right_and_fast(virtual_time):
    chunks = [np.full(4, i, np.float32) for i in range(3)]
    results = await scale_all(chunks, 2.0)
    assert [r.tolist() for r in results] == [[0.0] * 4, [2.0] * 4, [4.0] * 4]
    # six simulated seconds of kernels, and the test took microseconds of them
    assert virtual_time.now() == pytest.approx(6.0, abs=1e-3)


async def test_a_device_fault_surfaces_as_device_error(virtual_time):
    ais.virtual.fail_next(engine="compute", message="ECC error")
    with pytest.raises(ais.DeviceError, match="ECC error"):
        await scale_all([np.ones(4, np.float32)], 1.0)


async def test_a_stalled_copy_engine_delays_the_results(virtual_time):
    async with anyio.create_task_group() as tg:
        stall = ais.virtual.stall("d2h")
        tg.start_soon(scale_all, [np.ones(4, np.float32)], 1.0)
        await anyio.sleep(10.0)  # the app is stuck on the download meanwhile
        stall.release()
    assert virtual_time.now() >= 10.0


@pytest.mark.aiostream(compute_slots=2)
async def test_timeline_shows_what_ran_where(virtual_time):
    await scale_all([np.ones(4, np.float32)], 1.0)
    engines = [op.engine for op in ais.virtual.timeline()]
    assert engines == ["h2d", "compute", "d2h"]
