"""Other libraries' streams and events (``as_stream``, ``as_event``) and device buffers shared
across processes (``DeviceBuffer.ipc_handle`` / ``from_ipc_handle``).

Each peer object is a stand-in that exposes only the attributes its library documents (PyTorch,
CuPy and cuda.core themselves run in the GPU suite); the handles behind them are live ones,
made by aiostream on a CUDA device (a GPU or the stand-in driver). Buffers shared between two
processes are tested on CUDA with a child process; the virtual device shares them within one
process, as its events, and refuses another process with the reason.
"""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import textwrap
import time
import types
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers.cuda import primary_context
from tests.helpers.deadlines import until
from tests.helpers.gate import gate, gated
from tests.helpers.process import ROOT, in_spawned_process, run_python
from tests.helpers.stand_in import take_violations

needs_cuda = pytest.mark.cuda
DEV = "cuda:0"


# ---------------------------------------------------------------------- the stand-ins


class TorchDevice:
    """``torch.device``: ``type`` and ``index``."""

    def __init__(self, kind: str, index: int | None) -> None:
        self.type, self.index = kind, index


class TorchEvent:
    """``torch.Event`` (device-generic): ``event_id`` (the CUevent, 0 until the first record)
    and ``device``."""

    def __init__(self, event_id: int, device: TorchDevice) -> None:
        self.event_id, self.device = event_id, device


class TorchStream:
    """``torch.Stream``: ``stream_id`` (PyTorch's own number), ``device_index`` and
    ``device_type`` (1: CUDA)."""

    def __init__(self, stream_id: int, device_index: int, device_type: int = 1) -> None:
        self.stream_id, self.device_index, self.device_type = stream_id, device_index, device_type


class CupyEvent:
    """``cupy.cuda.Event``: ``ptr`` only."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class CUevent:
    """``cuda.bindings.driver.CUevent``: an object that ``int()`` reads."""

    def __init__(self, address: int) -> None:
        self.address = address

    def __int__(self) -> int:
        return self.address


class CoreDevice:
    """``cuda.core.Device``: ``device_id``."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id


class CoreEvent:
    """``cuda.core.Event``: ``handle`` (a CUevent) and ``device``."""

    def __init__(self, handle: int, device_id: int) -> None:
        self.handle, self.device = CUevent(handle), CoreDevice(device_id)


class CoreStream:
    """``cuda.core.Stream``: ``__cuda_stream__()`` gives ``(0, address)``; ``device``."""

    def __init__(self, handle: int, device_id: int) -> None:
        self._handle, self.device = handle, CoreDevice(device_id)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def torch_module(streams: dict[int, int]) -> types.ModuleType:
    """A stand-in ``torch`` module whose ``torch.cuda.Stream(stream_id=, device_index=,
    device_type=)`` gives the stream PyTorch numbers ``stream_id`` (``streams``: its handle)."""

    class CudaStream:
        def __init__(self, *, stream_id: int, device_index: int, device_type: int) -> None:
            assert device_type == 1
            self.cuda_stream = streams[stream_id]

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(Stream=CudaStream)  # type: ignore[attr-defined]
    return torch


def two_devices() -> bool:
    return ais.device_count("cuda") >= 2


# ---------------------------------------------------------------------- events


@needs_cuda
async def test_cuda_every_peer_event_is_awaited_without_being_owned(anyio_backend: Any) -> None:
    s = ais.Stream(DEV)
    owner = ais.Event(DEV)
    owner.record(s)
    handle = owner.event_id
    peers = {
        "torch.Event": TorchEvent(handle, TorchDevice("cuda", 0)),
        "cupy.cuda.Event": CupyEvent(handle),
        "cuda.core Event": CoreEvent(handle, 0),
    }
    for name, peer in peers.items():
        wrapped = ais.as_event(peer)
        assert wrapped.event_id == handle and wrapped.device == ais.Device("cuda", 0), name
        with gated(s) as release:  # the owner's record is held until the test says
            owner.record(s)  # the peer's event, recorded by its owner (not through the wrapper)
            async with anyio.create_task_group() as tg:
                tg.start_soon(wrapped.synchronize)
                await until(ais.pending_waits, "the wait on the wrapped event to begin")
                # named by its handle alone: no record of aiostream's yet
                assert [w.subject for w in ais.pending_waits()] == [f"event {handle}"], name
                release()  # the owner's record completes now: so does the wait
        with gated(s):
            wrapped.record(s)  # records the peer's own event
            assert not owner.query(), name
        await wrapped.synchronize()
        assert owner.query(), name
        # its flags are unknown: not shareable, and named by its handle alone
        assert repr(wrapped).endswith(f"id={handle} timing=True interprocess=False>"), name
        with pytest.raises(ValueError, match="needs an interprocess event"):
            wrapped.ipc_handle()
        del wrapped
    assert owner.query()  # alive: no wrapper destroyed it


@needs_cuda
def test_cuda_peer_events_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="record it first"):
        ais.as_event(TorchEvent(0, TorchDevice("cuda", 0)))  # PyTorch creates it lazily
    with pytest.raises(ValueError, match="PyTorch's 'xpu' device, not a CUDA event"):
        ais.as_event(TorchEvent(0x1000, TorchDevice("xpu", 0)))
    with pytest.raises(TypeError, match="a cuda.core Event"):
        ais.as_event(types.SimpleNamespace(handle="not a handle"))
    with pytest.raises(TypeError, match="as_event"):
        ais.as_event(types.SimpleNamespace(ptr=1.5))


@needs_cuda
def test_cuda_a_peer_event_says_its_device() -> None:
    if not two_devices():
        pytest.skip("needs two CUDA devices")
    owner = ais.Event("cuda:1")
    owner.record(ais.Stream("cuda:1"))
    for peer in (TorchEvent(owner.event_id, TorchDevice("cuda", 1)), CoreEvent(owner.event_id, 1)):
        assert ais.as_event(peer).device == ais.Device("cuda", 1)
    assert ais.as_event(CupyEvent(owner.event_id), "cuda:1").device == ais.Device("cuda", 1)


def test_peer_objects_on_a_virtual_device_are_refused() -> None:
    """Only CUDA events are shared between libraries (no handle reaches a driver here)."""
    for peer in (TorchEvent(16, TorchDevice("cuda", 0)), CupyEvent(16), CoreEvent(16, 0)):
        with pytest.raises(ValueError, match="device must be cuda:N"):
            ais.as_event(peer, "virtual:0")
    with pytest.raises(ValueError, match="ExternalStream wraps CUDA streams"):
        ais.as_stream(CoreStream(16, 0), "virtual:0")


# ---------------------------------------------------------------------- streams


@needs_cuda
async def test_cuda_a_cuda_core_stream_is_awaited(anyio_backend: Any) -> None:
    s = ais.Stream(DEV)
    peer = CoreStream(s.stream_id, 0)
    wrapped = ais.as_stream(peer)
    assert wrapped == s and wrapped.device == ais.Device("cuda", 0)
    ais.delay(0.05, stream=s)
    before = s.record_event()
    await wrapped.synchronize()
    assert before.query()  # the stream's work so far has completed


@needs_cuda
async def test_cuda_a_torch_stream_becomes_its_cuda_stream_through_pytorch(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = ais.Stream(DEV)
    pool_id = 35  # an odd number: PyTorch's id of a stream of its pool, no CUstream
    monkeypatch.setitem(sys.modules, "torch", torch_module({pool_id: s.stream_id}))
    wrapped = ais.as_stream(TorchStream(pool_id, 0))
    assert wrapped == s and wrapped.device == ais.Device("cuda", 0)
    ais.delay(0.05, stream=s)
    before = s.record_event()
    await wrapped.synchronize()
    assert before.query()  # the stream's work so far has completed


def test_a_torch_stream_needs_pytorch_and_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    with pytest.raises(TypeError, match="stream_id is PyTorch's own number"):
        ais.as_stream(TorchStream(35, 0))
    monkeypatch.setitem(sys.modules, "torch", torch_module({}))
    with pytest.raises(ValueError, match="PyTorch device type 0, not a CUDA stream"):
        ais.as_stream(TorchStream(0, 0, device_type=0))


@needs_cuda
def test_cuda_a_peer_stream_says_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    if not two_devices():
        pytest.skip("needs two CUDA devices")
    s = ais.Stream("cuda:1")
    assert ais.as_stream(CoreStream(s.stream_id, 1)) == s
    monkeypatch.setitem(sys.modules, "torch", torch_module({3: s.stream_id}))
    assert ais.as_stream(TorchStream(3, 1)).device == ais.Device("cuda", 1)


# ---------------------------------------------------------------------- buffers across processes


@pytest.mark.aiostream(bandwidth=16.0)  # 16 bytes take a second
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # uvloop's clock is its own
async def test_a_shared_virtual_buffer_opens_in_stream_order(
    anyio_backend: Any, virtual_time: VirtualTime
) -> None:
    host = ais.HostBuffer(16)
    host.numpy(np.float32)[:] = [1, 2, 3, 4]
    shared = ais.DeviceBuffer(16, interprocess=True)
    producer = ais.Stream()
    ais.delay(1.0, stream=producer)
    ais.copy_async(shared, host, stream=producer)  # lands at t = 2 s (and 10 us)
    handle = shared.ipc_handle()
    consumer = ais.Stream()
    with ais.use_stream(consumer):
        opened = ais.DeviceBuffer.from_ipc_handle(None, handle)
    assert (opened.nbytes, opened.dtype, opened.device) == (16, np.uint8, shared.device)
    out = ais.HostBuffer(16)
    ais.copy_async(out, opened.view(np.float32), stream=consumer)  # waits for the producer
    await consumer.synchronize()
    assert out.numpy(np.float32).tolist() == [1, 2, 3, 4]
    first, second = (r for r in ais.virtual.timeline() if r.name.startswith("copy"))
    assert second.start == first.end and second.end == pytest.approx(3.00002, abs=1e-9)
    ais.virtual.assert_no_races()


@pytest.mark.aiostream(bandwidth=16.0, devices=2)  # 16 bytes take a second
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # uvloop's clock is its own
async def test_a_shared_buffer_opens_on_the_device_named_in_its_current_stream_order(
    anyio_backend: Any, virtual_time: VirtualTime
) -> None:
    """Opened on a device other than the default, the buffer is that device's, and that
    device's current stream is the one that waits for the exporter's work."""
    assert ais.device() == ais.Device("virtual", 0)
    host = ais.HostBuffer(16, device="virtual:1")
    host.numpy(np.float32)[:] = [1, 2, 3, 4]
    shared = ais.DeviceBuffer(16, "virtual:1", interprocess=True)
    producer = ais.Stream("virtual:1")
    ais.delay(1.0, stream=producer)
    ais.copy_async(shared, host, stream=producer)  # lands at t = 2 s (and 10 us)
    handle = shared.ipc_handle()
    consumer = ais.Stream("virtual:1")
    with ais.use_stream(consumer):  # the current stream of virtual:1, not of the default device
        opened = ais.DeviceBuffer.from_ipc_handle("virtual:1", handle)
    assert opened.device == ais.Device("virtual", 1)
    assert not consumer.query()  # it waits for the producer's copy
    await consumer.synchronize()
    assert ais.virtual.now() == pytest.approx(2.00001, abs=1e-9)
    out = ais.HostBuffer(16, device="virtual:1")
    ais.copy_async(out, opened.view(np.float32), stream=consumer)
    await consumer.synchronize()
    assert out.numpy(np.float32).tolist() == [1, 2, 3, 4]
    ais.virtual.assert_no_races()


def test_the_docs_of_opening_a_buffer_say_a_handle_opens_in_its_own_process() -> None:
    """What the tests above do (a handle opened where it was made) is what the docstring says,
    not that it is refused."""
    doc = " ".join((ais.DeviceBuffer.from_ipc_handle.__doc__ or "").split())
    assert "In the process that made the handle (where the driver opens nothing) it gives " in doc
    assert "or was made in this process" not in doc


def test_a_freed_shared_virtual_buffer_keeps_no_bytes_alive() -> None:
    """Sharing a buffer keeps it openable only while it lives: once freed, its bytes go (the
    memory Python traced for them is given back)."""
    import gc
    import tracemalloc

    nbytes = 8 << 20
    ours = not tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        buf = ais.DeviceBuffer(nbytes, interprocess=True)
        buf.ipc_handle()
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - before >= nbytes
        del buf
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        if ours:
            tracemalloc.stop()
    assert left < 1 << 20, f"{left} bytes still held: the shared buffer's bytes live on"


def test_ipc_handles_of_virtual_buffers_are_checked() -> None:
    with pytest.raises(ValueError, match=r"interprocess=True"):
        ais.DeviceBuffer(8).ipc_handle()
    with pytest.raises(TypeError, match="handle must be bytes"):
        ais.DeviceBuffer.from_ipc_handle(None, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a DeviceBuffer IPC handle"):
        ais.DeviceBuffer.from_ipc_handle(None, bytes(100))
    with pytest.raises(TypeError, match="interprocess must be True or False"):
        ais.DeviceBuffer(8, interprocess=1)  # type: ignore[arg-type]
    buf = ais.DeviceBuffer(8, interprocess=True)
    handle = buf.ipc_handle()
    spoiled = bytearray(handle)
    spoiled[20:36] = bytes(16)  # the memory handle's magic, after the 20-byte header
    with pytest.raises(ValueError, match="not an IPC handle of a virtual device buffer"):
        ais.DeviceBuffer.from_ipc_handle(None, bytes(spoiled))
    resized = bytearray(handle)
    resized[8:16] = (16).to_bytes(8, "little")  # the header's size: 16 bytes, not 8
    with pytest.raises(ValueError) as wrong:
        ais.DeviceBuffer.from_ipc_handle(None, bytes(resized))
    assert str(wrong.value) == (
        "the IPC handle says 16 bytes, but the buffer behind it has 8: pass the handle unchanged"
    )
    del buf
    with pytest.raises(ValueError) as gone:
        ais.DeviceBuffer.from_ipc_handle(None, handle)
    assert str(gone.value) == (
        "the buffer behind this IPC handle no longer exists: keep the exported DeviceBuffer "
        "alive until the other side has opened it and is done with it"
    )
    handle = ais.DeviceBuffer(8, interprocess=True).ipc_handle()
    ais.virtual.reset()
    with pytest.raises(ais.StaleHandleError, match=r"virtual.reset\(\) replaced"):
        ais.DeviceBuffer.from_ipc_handle(None, handle)


def _open_in_child(what: str, handle: bytes, out: Any) -> None:
    """Open a virtual ``what`` ("buffer" or "event") from ``handle``; put what happened."""
    opener = ais.DeviceBuffer if what == "buffer" else ais.Event
    try:
        opener.from_ipc_handle("virtual:0", handle)
    except BaseException as exc:  # reported to the parent, which judges it
        out.put((type(exc).__name__, str(exc)))
    else:
        out.put(("opened", ""))


@pytest.mark.slow
@pytest.mark.parametrize("start", ["spawn", "fork"])
@pytest.mark.parametrize("what", ["buffer", "event"])
def test_a_virtual_handle_in_another_process_is_refused_with_the_reason(
    start: str, what: str
) -> None:
    """Another process, spawned or forked (a fork holds a copy of the simulation, which never
    sees this process's later work), refuses a virtual device's buffer or event handle."""
    if what == "buffer":
        handle = ais.DeviceBuffer(8, interprocess=True).ipc_handle()
    else:
        handle = ais.Event(interprocess=True, enable_timing=False).ipc_handle()
    child, (kind, message) = in_spawned_process(_open_in_child, what, handle, start=start)
    assert kind == "StaleHandleError", message
    assert f"of process {os.getpid()}, and this is process {child}" in message, message
    assert "within one process" in message and "CUDA" in message


CHILD = """
import sys, anyio, numpy as np, aiostream as ais

async def main():
    print("ready", flush=True)
    buf = ais.DeviceBuffer.from_ipc_handle("cuda:0", bytes.fromhex(sys.argv[1]))
    out = ais.HostBuffer(buf.nbytes, device="cuda:0")
    ais.copy_async(out, buf.view(np.float32))  # on the stream that waited for the exporter
    other = ais.Stream("cuda:0")
    twice = ais.HostBuffer(buf.nbytes, device="cuda:0")
    ais.copy_async(twice, buf, stream=other)  # another stream, after the opening
    await ais.current_stream("cuda:0").synchronize()
    await other.synchronize()
    print(out.numpy(np.float32).tolist(), twice.numpy(np.float32).tolist(), flush=True)

loop = sys.argv[2]
if loop == "uvloop":
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
else:
    anyio.run(main, backend=loop)
"""


@needs_cuda
@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_cuda_a_buffer_handed_to_another_process_in_stream_order(loop: str) -> None:
    """The exporter's copy is held on its stream; the child opens the buffer meanwhile and
    reads the data only once the copy has landed: its stream waited for the exporter's event
    (a gate holds it until the child is under way). The exported buffer
    lives until the child is done, and the child leaves nothing open."""
    pytest.importorskip(loop if loop != "asyncio" else "anyio")
    s = ais.Stream(DEV)
    host = ais.HostBuffer(16, device=DEV)
    host.numpy(np.float32)[:] = [1, 2, 3, 4]
    shared = ais.DeviceBuffer(16, DEV, interprocess=True)
    release = gate(s)  # the exporter's copy is held until the child is under way
    ais.copy_async(shared, host, stream=s)
    handle = shared.ipc_handle()
    assert not s.query()  # no host wait
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), handle.hex(), loop],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        time.sleep(0.5)  # the child opens the buffer and copies from it meanwhile
        release()  # the exporter's copy lands
        out, err = child.communicate(timeout=120)
    finally:
        release()
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err[-3000:]
    assert out.split("\n")[0] == "[1.0, 2.0, 3.0, 4.0] [1.0, 2.0, 3.0, 4.0]"
    assert "fake_cuda: at exit" not in err, err  # nothing left open
    s.synchronize_blocking()


#: a child's watch on what it opens of another process's (memory, the exporter's event) and
#: closes again, seen at the bindings on any driver (tests/helpers/faults.py); and the
#: stand-in's count of live device buffers, where it is the driver
OPENS_WATCHED = """
import gc, sys
import aiostream as ais
from tests.helpers.faults import calls, failing, left_open
from tests.helpers.stand_in import DEVICE_BUFFERS, FAKE

IPC = ("cuIpcOpenMemHandle", "cuIpcCloseMemHandle", "cuIpcOpenEventHandle", "cuEventDestroy")


def say_left_open(seen):
    memory = left_open(seen["cuIpcOpenMemHandle"], seen["cuIpcCloseMemHandle"])
    event = left_open(seen["cuIpcOpenEventHandle"], seen["cuEventDestroy"])
    print(*memory, *event, flush=True)  # opened, then left open: memory's, the event's
"""

FAILED_WAIT_CHILD = """
with calls(*IPC) as seen:
    try:
        with failing("cuStreamWaitEvent"):
            ais.DeviceBuffer.from_ipc_handle("cuda:0", bytes.fromhex(sys.argv[1]))
    except ais.CudaError as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
    gc.collect()
    ais.current_stream("cuda:0").synchronize_blocking()  # the opened memory waits for its stream
    ais.DeviceBuffer(16, "cuda:0")  # an allocation frees what waited for work now over
    gc.collect()
say_left_open(seen)
assert FAKE is None or FAKE.fake_cuda_live(DEVICE_BUFFERS) == 0
"""


@needs_cuda
def test_cuda_a_shared_buffer_whose_stream_cannot_wait_is_closed_again() -> None:
    """Opening another process's buffer ends with the opening stream waiting for the
    exporter's event; when that ``cuStreamWaitEvent`` fails, the error names the call and the
    device, and what was opened (the memory, the exporter's event) is closed again: the child
    leaves nothing open at exit. The exporter (this process) stays alive meanwhile, as the
    driver needs."""
    shared = ais.DeviceBuffer(16, DEV, interprocess=True)
    child = run_python("-c", OPENS_WATCHED + FAILED_WAIT_CHILD, shared.ipc_handle().hex())
    assert child.returncode == 0, child.stderr[-3000:]
    said, after = child.stdout.splitlines()
    assert said.startswith(
        "CudaError: cuStreamWaitEvent failed on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error"
    )
    # both opened, both closed (the stand-in counts a close under pending work a violation)
    assert after == "1 0 1 0"
    assert "fake_cuda: at exit" not in child.stderr, child.stderr
    del shared


LYING_SIZE_CHILD = """
with calls(*IPC) as seen:
    try:
        ais.DeviceBuffer.from_ipc_handle("cuda:0", bytes.fromhex(sys.argv[1]))
    except ValueError as exc:
        print(f"ValueError: {exc}", flush=True)
    gc.collect()
    ais.current_stream("cuda:0").synchronize_blocking()
say_left_open(seen)
assert FAKE is None or FAKE.fake_cuda_live(DEVICE_BUFFERS) == 0
"""


@needs_cuda
def test_cuda_a_handle_that_claims_more_than_its_memory_holds_is_refused() -> None:
    """The size in a buffer's handle is the exporter's word: a handle changed to claim 1 MiB
    for 4 KiB of memory is refused where it opens (the driver says how large the allocation
    is), and the memory opened is closed again, rather than a buffer that copies read past."""
    shared = ais.DeviceBuffer(4096, DEV, interprocess=True)
    handle = bytearray(shared.ipc_handle())
    struct.pack_into("<Q", handle, 8, 1 << 20)  # the header's nbytes, after its magic
    child = run_python("-c", OPENS_WATCHED + LYING_SIZE_CHILD, bytes(handle).hex())
    assert child.returncode == 0, child.stderr[-3000:]
    said, left = child.stdout.splitlines()
    assert said == (
        "ValueError: this IPC handle claims 1048576 bytes, but the memory it opens holds "
        "4096: pass the bytes that DeviceBuffer.ipc_handle() returned, unchanged"
    )
    assert left.startswith("1 0 ")  # the memory opened, closed again
    assert "fake_cuda: at exit" not in child.stderr, child.stderr
    del shared


FAILED_CLOSE_CHILD = """
import logging
from cuda.bindings import driver as cu
from tests.helpers.cuda import primary_context

logging.basicConfig(level=logging.WARNING, format="%(message)s")
with calls(*IPC) as seen:
    buf = ais.DeviceBuffer.from_ipc_handle("cuda:0", bytes.fromhex(sys.argv[1]))
    address = buf.__cuda_array_interface__["data"][0]
    ais.current_stream("cuda:0").synchronize_blocking()
    with failing("cuIpcCloseMemHandle") as fault:
        del buf
        gc.collect()
        ais.DeviceBuffer(16, "cuda:0")  # an allocation frees what waited for work now over
        gc.collect()
    assert fault.failed
say_left_open(seen)  # the memory left open by the failed call
assert FAKE is None or FAKE.fake_cuda_live(DEVICE_BUFFERS) == 1
with primary_context():  # closed as a user would
    print(int(cu.cuIpcCloseMemHandle(cu.CUdeviceptr(address))[0]), flush=True)
"""


@needs_cuda
def test_cuda_a_shared_buffer_that_cannot_be_closed_is_said_at_exit() -> None:
    """Another process's buffer, dropped, is closed (``cuIpcCloseMemHandle``) once its work
    is over; a close that fails never raises (it runs in a finalizer) and is said once at
    exit, with its call, device and code. The handle is left as it was, for the driver."""
    shared = ais.DeviceBuffer(16, DEV, interprocess=True)
    child = run_python("-c", OPENS_WATCHED + FAILED_CLOSE_CHILD, shared.ipc_handle().hex())
    assert child.returncode == 0, child.stderr[-3000:]
    left, closed = child.stdout.splitlines()
    assert left.startswith("1 1 ")  # the memory open after the failure
    assert closed == "0"  # and closed by hand
    assert child.stderr.splitlines() == [
        "aiostream could not release 1 CUDA handle(s) (the first: cuIpcCloseMemHandle failed "
        "on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error); the driver reclaims them "
        "with the context"
    ]
    del shared


@needs_cuda
def test_cuda_ipc_handles_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"interprocess=True"):
        ais.DeviceBuffer(16, DEV).ipc_handle()
    handle = ais.DeviceBuffer(16, DEV, interprocess=True).ipc_handle()
    gc.collect()  # the exported buffer is gone
    with pytest.raises(ValueError) as info:
        ais.DeviceBuffer.from_ipc_handle(DEV, handle)
    assert str(info.value) == (
        "the buffer behind this IPC handle, made in this process, no longer exists"
    )


@needs_cuda
async def test_cuda_a_buffer_handle_opened_in_its_own_process_shares_the_buffer(
    anyio_backend: object,
) -> None:
    """The driver opens a memory IPC handle in other processes only: in the process that made
    it, a handle gives a buffer over the same memory (no driver open), its stream ordered
    after the exporter's work as in another process, the memory freed once both buffers are
    dropped (the stand-in counts a free under a user as a violation)."""
    s = ais.Stream(DEV)
    host = ais.HostBuffer(16, device=DEV)
    host.numpy(np.float32)[:] = [1, 2, 3, 4]
    shared = ais.DeviceBuffer(16, DEV, interprocess=True)
    ais.delay(0.05, stream=s)
    ais.copy_async(shared, host, stream=s)
    handle = shared.ipc_handle()
    opened = ais.DeviceBuffer.from_ipc_handle(DEV, handle)
    assert opened.__cuda_array_interface__["data"][0] == shared.__cuda_array_interface__["data"][0]
    out = ais.HostBuffer(16, device=DEV)
    ais.copy_async(out, opened)  # on the current stream, which waited for the exporter
    with anyio.fail_after(5):
        await ais.current_stream(DEV).synchronize()
    assert out.numpy(np.float32).tolist() == [1.0, 2.0, 3.0, 4.0]
    del shared
    gc.collect()
    ais.copy_async(out, opened)  # still there: the opened buffer shares it
    with anyio.fail_after(5):
        await ais.current_stream(DEV).synchronize()
    del opened
    gc.collect()


@pytest.mark.stand_in("the stand-in's own checks of the driver's IPC rules")
def test_cuda_the_stand_in_keeps_the_drivers_ipc_rules() -> None:
    """What the driver's documentation says of IPC memory, which aiostream's checks spare it:
    cuMemAlloc's memory only, opened in another process only, with the one flag."""
    from cuda.bindings import driver as cu

    pooled = ais.DeviceBuffer(16, DEV)
    shared = ais.DeviceBuffer(16, DEV, interprocess=True)
    take_violations()
    with primary_context():
        address = pooled.__cuda_array_interface__["data"][0]
        assert int(cu.cuIpcGetMemHandle(cu.CUdeviceptr(address))[0]) == 1  # INVALID_VALUE
        address = shared.__cuda_array_interface__["data"][0]
        err, handle = cu.cuIpcGetMemHandle(cu.CUdeviceptr(address))
        assert int(err) == 0
        assert int(cu.cuIpcOpenMemHandle(handle, 1)[0]) == 201  # INVALID_CONTEXT
        assert int(cu.cuIpcOpenMemHandle(handle, 0)[0]) == 1
    count, log = take_violations()
    assert count == 3, log
    assert "only cuMemAlloc's is exported" in log and "other processes only" in log
    assert "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS" in log
