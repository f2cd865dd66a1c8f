"""Stream memory operations as the driver API reference documents them (cuStreamWaitValue32
and 64, cuStreamWriteValue64), and the gates of ``tests/helpers/gate.py`` built on them: work
submitted to a stream after a wait is held on the device until the wait's word satisfies its
condition, and so is the work of the streams that wait for a record among it.

These reach the driver through cuda-python's bindings and aiostream's public names; only the
tests marked ``stand_in`` use the stand-in's hooks. The others run on a GPU as on the stand-in,
checking the stand-in against the driver it imitates (a violation the stand-in counts for a
refused call is taken where the stand-in is the driver: on its build without hooks, in a child
process, ``tests/helpers/driver_calls.py``); what only the stand-in models runs on either
build of it.
"""

from __future__ import annotations

import ctypes
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N, primary_context
from tests.helpers.driver_calls import (
    Context,
    Word,
    code,
    libc,
    ok,
    provokes_violations,
    release_open_words,
    stand_in_only,
    violations,
)
from tests.helpers.gate import gate, gated
from tests.helpers.process import run_python
from tests.helpers.protocol import STRATEGIES
from tests.helpers.stand_in import FAKE, OK

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]

if OK:  # a CUDA driver works: the stand-in's or a GPU's
    from cuda.bindings import driver as cu

GEQ, EQ, AND, NOR, FLUSH = 0, 1, 2, 3, 1 << 30  # CUstreamWaitValue_flags
INVALID_VALUE, NOT_READY, LAUNCH_FAILED = 1, 600, 719
RELAXED = 2
# CUdevice_attribute
CAN_FLUSH_REMOTE_WRITES, CAN_USE_64_BIT_STREAM_MEM_OPS, CAN_USE_STREAM_WAIT_VALUE_NOR = 98, 122, 123
HELD_FOR = 0.03  # seconds a held state is watched for
DEADLINE = 5.0  # seconds a release has to take effect


@pytest.fixture
def ctx0() -> Iterator[Context]:
    c = Context(0)
    yield c
    release_open_words()  # before the module's unload, which waits for all the device's work
    c.release()


def needs_attribute(attribute: int, what: str) -> None:
    device = ok(cu.cuDeviceGet(0))
    if not ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute(attribute), device)):
        pytest.skip(f"cuda:0 does not support {what}")


def held_for(pending: Callable[[], bool], seconds: float = HELD_FOR) -> None:
    """``pending()`` stays true for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert pending(), "held work went on before its release"
        time.sleep(0.002)


def soon(done: Callable[[], bool], what: str) -> None:
    """``done()`` comes true within DEADLINE (a release takes effect)."""
    deadline = time.monotonic() + DEADLINE
    while not done():
        assert time.monotonic() < deadline, f"waited {DEADLINE} s in vain for {what}"
        time.sleep(0.0005)


def pending(event: Any) -> bool:
    return code(cu.cuEventQuery(event)) == NOT_READY


# ---------------------------------------------------------------------- the driver API


CONDITIONS = [
    # width, flags, value, words that hold, the word that releases
    pytest.param(4, GEQ, 0xFFFF_FFF0, [0xFFFF_FFE0, 0x7FFF_FFF0], 5, id="geq32-cyclic"),
    pytest.param(4, GEQ | FLUSH, 10, [9, 0x8000_000A], 10, id="geq32-flush"),
    pytest.param(4, EQ, 7, [6, 8], 7, id="eq32"),
    pytest.param(4, AND, 0b1010, [0b0101, 0], 0b1000, id="and32"),
    pytest.param(4, NOR, 0xFFFF_0000, [0x0000_FFFF], 0x0000_FF00, id="nor32"),
    pytest.param(8, GEQ, 2**64 - 16, [2**64 - 32, 2**63 - 16], 5, id="geq64-cyclic"),
    pytest.param(8, EQ, 1 << 40, [0, (1 << 40) + 1], 1 << 40, id="eq64"),
    pytest.param(8, AND, 1 << 40, [0xFFFF_FFFF], (1 << 40) | 1, id="and64"),
    pytest.param(8, NOR, 0xFFFF_FFFF << 32, [0xFFFF_FFFF], 0xFFFF_0000, id="nor64"),
]


@pytest.mark.parametrize(("width", "flags", "value", "holding", "releasing"), CONDITIONS)
def test_a_wait_holds_the_work_after_it_until_its_condition_holds(
    ctx0: Context, width: int, flags: int, value: int, holding: list[int], releasing: int
) -> None:
    """GEQ is cyclic, ``(int32_t)(*addr - value) >= 0`` (int64_t for 64 bits): 5 is past
    0xFFFFFFF0, 0x7FFFFFF0 is not; EQ, AND (``(*addr & value) != 0``) and NOR
    (``~(*addr | value) != 0``) read the whole word. A record after the wait stays pending
    while the word holds it, and completes once it is released."""
    if width == 8:
        needs_attribute(CAN_USE_64_BIT_STREAM_MEM_OPS, "64-bit stream memory operations")
    if flags & ~FLUSH == NOR:
        needs_attribute(CAN_USE_STREAM_WAIT_VALUE_NOR, "CU_STREAM_WAIT_VALUE_NOR")
    if flags & FLUSH:
        needs_attribute(CAN_FLUSH_REMOTE_WRITES, "CU_STREAM_WAIT_VALUE_FLUSH")
    wait = cu.cuStreamWaitValue64 if width == 8 else cu.cuStreamWaitValue32
    with ctx0:
        stream, event = ok(cu.cuStreamCreate(1)), ok(cu.cuEventCreate(2))
        word = Word(width)
        word.value, word.opens = holding[0], releasing
        ok(wait(stream, word.address, value, flags))
        ok(cu.cuEventRecord(event, stream))
        for v in holding:
            word.value = v
            held_for(lambda: pending(event))
        assert code(cu.cuStreamQuery(stream)) == NOT_READY
        word.value = releasing
        soon(lambda: not pending(event), "the record after the wait")
        ok(cu.cuStreamSynchronize(stream))
        word.free()
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))


def test_waits_in_a_row_hold_until_each_is_released(ctx0: Context) -> None:
    """The later wait is reached only once the earlier is over: releasing it first holds."""
    with ctx0:
        stream, event = ok(cu.cuStreamCreate(1)), ok(cu.cuEventCreate(2))
        first, second = Word(), Word()
        ok(cu.cuStreamWaitValue32(stream, first.address, 1, GEQ))
        ok(cu.cuStreamWaitValue32(stream, second.address, 1, GEQ))
        ok(cu.cuEventRecord(event, stream))
        second.value = 1
        held_for(lambda: pending(event))
        first.value = 1
        soon(lambda: not pending(event), "the record after both waits")
        ok(cu.cuStreamSynchronize(stream))
        first.free()
        second.free()
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))


def test_a_64_bit_write_lands_when_its_stream_reaches_it(ctx0: Context) -> None:
    """cuStreamWriteValue64 writes all 8 bytes, after the work before it (here: a wait)."""
    needs_attribute(CAN_USE_64_BIT_STREAM_MEM_OPS, "64-bit stream memory operations")
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        gate_word, target = Word(), Word(8)
        ok(cu.cuStreamWaitValue32(stream, gate_word.address, 1, GEQ))
        for value in (3, 4):  # CU_STREAM_WRITE_VALUE_DEFAULT: the v2 API takes no other flag
            ok(cu.cuStreamWriteValue64(stream, target.address, (1 << 40) | value, 0))
        held_for(lambda: target.value == 0)
        gate_word.value = 1
        soon(lambda: target.value == (1 << 40) | 4, "the writes")
        ok(cu.cuStreamSynchronize(stream))
        gate_word.free()
        target.free()
        ok(cu.cuStreamDestroy(stream))


@pytest.mark.parametrize(
    "call", ["cuStreamWaitValue32", "cuStreamWaitValue64", "cuStreamWriteValue64"]
)
@provokes_violations
def test_an_unaligned_word_is_refused(ctx0: Context, call: str) -> None:
    if call.endswith("64"):
        needs_attribute(CAN_USE_64_BIT_STREAM_MEM_OPS, "64-bit stream memory operations")
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        word = Word(nbytes=16)
        offset = 4 if call.endswith("64") else 2
        assert code(getattr(cu, call)(stream, word.address + offset, 1, 0)) == INVALID_VALUE
        violations(1, "not aligned to")
        ok(cu.cuStreamSynchronize(stream))
        word.free()
        ok(cu.cuStreamDestroy(stream))


@pytest.mark.parametrize(
    ("call", "flags"),
    [
        ("cuStreamWaitValue32", 4),
        ("cuStreamWaitValue32", 1 << 29),
        ("cuStreamWaitValue64", 4 | FLUSH),
        ("cuStreamWriteValue64", 1),  # NO_MEMORY_BARRIER: "not supported in the v2 API"
        ("cuStreamWriteValue64", 2),
    ],
)
@provokes_violations
def test_unknown_flags_are_refused(ctx0: Context, call: str, flags: int) -> None:
    if call.endswith("64"):
        needs_attribute(CAN_USE_64_BIT_STREAM_MEM_OPS, "64-bit stream memory operations")
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        word = Word(8)
        assert code(getattr(cu, call)(stream, word.address, 1, flags)) == INVALID_VALUE
        violations(1, f"{call} with flags {flags:#x}")
        ok(cu.cuStreamSynchronize(stream))
        word.free()
        ok(cu.cuStreamDestroy(stream))


@pytest.mark.parametrize("memory", ["pageable", "pinned-unmapped", "freed-device"])
@pytest.mark.parametrize(
    "call", ["cuStreamWaitValue32", "cuStreamWaitValue64", "cuStreamWriteValue64"]
)
@provokes_violations
def test_a_word_in_no_live_device_memory_is_refused(ctx0: Context, call: str, memory: str) -> None:
    # on a GPU such a word may fault the device (a sticky error, for the rest of the process)
    stand_in_only("a word in no live device-accessible memory refused, not faulting the device")
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        pageable = ctypes.create_string_buffer(16)
        address, free = ctypes.addressof(pageable) // 8 * 8 + 8, None
        if memory == "pinned-unmapped":
            address = int(ok(cu.cuMemHostAlloc(16, 0)))
            free = cu.cuMemFreeHost
        elif memory == "freed-device":
            address = int(ok(cu.cuMemAlloc(16)))
            ok(cu.cuMemFree(address))
        assert code(getattr(cu, call)(stream, address, 1, 0)) == INVALID_VALUE
        violations(1, "which is no live device-accessible memory")
        if free is not None:
            ok(free(address))
        ok(cu.cuStreamDestroy(stream))


def test_a_wait_captured_in_a_graph_holds_each_launch_at_its_node(ctx0: Context) -> None:
    """In a capture the wait is a memory operation node: each launch of the graph runs the
    nodes after it only once its word is released, and the launch's stream, with what comes
    after the launch, is held until then."""
    with ctx0:
        capturing, launching = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
        gate_word, ran = Word(), Word()
        ok(cu.cuStreamBeginCapture(capturing, RELAXED))
        ok(cu.cuStreamWaitValue32(capturing, gate_word.address, 1, GEQ))
        ok(cu.cuStreamWriteValue32(capturing, ran.address, 1, 0))
        graph = ok(cu.cuStreamEndCapture(capturing))
        exec_ = ok(cu.cuGraphInstantiate(graph, 0))
        for _ in range(2):
            gate_word.value = ran.value = 0
            ok(cu.cuGraphLaunch(exec_, launching))
            ok(cu.cuEventRecord(event, launching))
            held_for(lambda: ran.value == 0 and pending(event))
            gate_word.value = 1
            soon(lambda: ran.value == 1 and not pending(event), "the launch's nodes")
        ok(cu.cuStreamSynchronize(launching))
        ok(cu.cuGraphExecDestroy(exec_))
        ok(cu.cuGraphDestroy(graph))
        gate_word.free()
        ran.free()
        ok(cu.cuEventDestroy(event))
        for s in (capturing, launching):
            ok(cu.cuStreamDestroy(s))


def test_a_graph_launched_behind_a_wait_is_held(ctx0: Context) -> None:
    with ctx0:
        capturing, launching = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        gate_word, ran = Word(), Word()
        ok(cu.cuStreamBeginCapture(capturing, RELAXED))
        ok(cu.cuStreamWriteValue32(capturing, ran.address, 1, 0))
        graph = ok(cu.cuStreamEndCapture(capturing))
        exec_ = ok(cu.cuGraphInstantiate(graph, 0))
        ok(cu.cuStreamWaitValue32(launching, gate_word.address, 1, GEQ))
        ok(cu.cuGraphLaunch(exec_, launching))
        held_for(lambda: ran.value == 0)
        gate_word.value = 1
        soon(lambda: ran.value == 1, "the graph's write")
        ok(cu.cuStreamSynchronize(launching))
        ok(cu.cuGraphExecDestroy(exec_))
        ok(cu.cuGraphDestroy(graph))
        gate_word.free()
        ran.free()
        for s in (capturing, launching):
            ok(cu.cuStreamDestroy(s))


# ---------------------------------------------------------------------- the stand-in's own


@pytest.mark.stand_in("its hook fake_cuda_hurry, tested itself: it ends no held work")
def test_hurrying_ends_the_work_before_a_wait_not_the_work_it_holds(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        before, after = ok(cu.cuEventCreate(2)), ok(cu.cuEventCreate(2))
        word = Word()
        assert ctx0.sleep(stream, 60) == 0
        ok(cu.cuEventRecord(before, stream))
        ok(cu.cuStreamWaitValue32(stream, word.address, 1, GEQ))
        assert ctx0.sleep(stream, 0.001) == 0
        ok(cu.cuEventRecord(after, stream))
        FAKE.fake_cuda_hurry()
        soon(lambda: not pending(before), "the hurried kernel")
        held_for(lambda: pending(after))
        assert FAKE.fake_cuda_pending() >= 3  # the wait, the kernel and the record it holds
        word.value = 1
        ok(cu.cuEventSynchronize(after))
        ok(cu.cuStreamSynchronize(stream))
        word.free()
        for e in (before, after):
            ok(cu.cuEventDestroy(e))
        ok(cu.cuStreamDestroy(stream))


@pytest.mark.stand_in(
    "fault injection: a kernel failing on the device (fake_cuda_fail_next_launch), its held "
    "work dropped (fake_cuda_pending), the sticky error cleared (fake_cuda_clear_error)"
)
def test_a_fault_of_its_context_drops_held_work(ctx0: Context) -> None:
    """A sticky error ends the wait, and the work it held takes no effect."""
    with ctx0:
        held, other = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        word, ran = Word(), Word()
        ok(cu.cuStreamWaitValue32(held, word.address, 1, GEQ))
        ok(cu.cuStreamWriteValue32(held, ran.address, 1, 0))
        FAKE.fake_cuda_fail_next_launch(LAUNCH_FAILED)
        assert ctx0.sleep(other, 0.001) == 0
        assert code(cu.cuStreamSynchronize(held)) == LAUNCH_FAILED
        soon(lambda: FAKE.fake_cuda_pending() == 0, "the held work to be dropped")
        FAKE.fake_cuda_clear_error()
        assert ran.value == 0
        ok(cu.cuStreamSynchronize(held))
        word.free()
        ran.free()
        for s in (held, other):
            ok(cu.cuStreamDestroy(s))


HELD_AT_THE_END = """
import ctypes
from cuda.bindings import driver as cu
cu.cuInit(0)
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
cu.cuCtxPushCurrent(ctx)
stream = cu.cuStreamCreate(1)[1]
event = cu.cuEventCreate(2)[1]
word = cu.cuMemHostAlloc(4, 3)[1]
ctypes.memset(word, 0, 4)
address = cu.cuMemHostGetDevicePointer(word, 0)[1]
assert int(cu.cuStreamWaitValue32(stream, address, 1, 0)[0]) == 0
cu.cuEventRecord(event, stream)
if END == "reset":  # its handles go first; the memory the held work uses goes with the context
    cu.cuEventDestroy(event)
    cu.cuStreamDestroy(stream)
    cu.cuCtxPopCurrent()
    cu.cuDevicePrimaryCtxRelease(cu.cuDeviceGet(0)[1])
print("done", flush=True)
"""


@pytest.mark.parametrize("end", ["exit", "reset"])
def test_held_work_is_pending_work_at_exit_and_at_a_reset(end: str) -> None:
    """Held at the exit or at the context's reset, it is work left pending: no leak, no
    violation of its own."""
    stand_in_only("its exit report of work left held")
    proc = run_python("-c", f"END = {end!r}\n" + textwrap.dedent(HELD_AT_THE_END))
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert proc.stderr == ""


# ---------------------------------------------------------------------- gates


def test_a_kernel_after_a_gate_waits_for_its_release() -> None:
    s = ais.Stream(DEV)
    ais.delay(0.001, stream=s)  # what is queued before runs as usual
    before = s.record_event()
    with gated(s) as release:
        ais.delay(0.001, stream=s)
        soon(before.query, "the work before the gate")
        held_for(lambda: not s.query())
        release()
        s.synchronize_blocking()
    assert s.query()


def test_a_copy_after_a_gate_moves_nothing_before_its_release() -> None:
    s = ais.Stream(DEV)
    up, down = ais.HostBuffer(N, device=DEV), ais.HostBuffer(N, device=DEV)
    dev = ais.DeviceBuffer(N, DEV)
    up.numpy()[:] = 7
    down.numpy()[:] = 0
    with gated(s) as release:
        ais.copy_async(dev, up, stream=s)
        ais.copy_async(down, dev, stream=s)
        held_for(lambda: not down.numpy().any())
        release()
        s.synchronize_blocking()
    assert (down.numpy() == 7).all()


def test_a_record_after_a_gate_holds_the_streams_that_wait_for_it() -> None:
    a, b, c = ais.Stream(DEV), ais.Stream(DEV), ais.Stream(DEV)
    with gated(a) as release:
        e = a.record_event()
        b.wait_event(e)
        ais.delay(0.001, stream=b)
        c.wait_stream(b)  # and the streams that wait for those, transitively
        last = c.record_event()
        held_for(lambda: not (e.query() or b.query() or c.query() or last.query()))
        release()
        last.synchronize_blocking()
    assert e.query() and a.query() and b.query() and c.query()


def test_a_host_function_after_a_gate_runs_after_its_release() -> None:
    """A C host function (libc's ``sem_post``) through the driver's own cuLaunchHostFunc."""
    s = ais.Stream(DEV)
    sem = ctypes.create_string_buffer(64)
    libc.sem_init(sem, 0, 0)
    runs = ctypes.c_int()

    def ran() -> int:
        libc.sem_getvalue(sem, ctypes.byref(runs))
        return runs.value

    with gated(s) as release:
        with primary_context() as driver:
            pfn = ok(driver.cuGetProcAddress(b"cuLaunchHostFunc", 10000, 0))[0]
            launch = ctypes.CFUNCTYPE(
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
            )(int(pfn))
            post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
            assert launch(s.stream_id, post, ctypes.addressof(sem)) == 0
        held_for(lambda: ran() == 0)
        release()
        s.synchronize_blocking()
    assert ran() == 1


def test_a_gate_is_released_once_and_on_a_failure() -> None:
    s = ais.Stream(DEV)
    with pytest.raises(KeyError), gated(s):
        ais.delay(0.001, stream=s)
        raise KeyError("the test failed")
    s.synchronize_blocking()  # released: the work went on
    release = gate(s)
    release()
    release()  # idempotent
    ais.delay(0.001, stream=s)
    s.synchronize_blocking()


def test_a_gate_refuses_the_default_stream_and_virtual_devices() -> None:
    with pytest.raises(ValueError, match="not the legacy default stream"):
        gate(ais.default_stream(DEV))
    with pytest.raises(TypeError, match="virtual device's own means"):
        gate(ais.Stream("virtual:0"))


@pytest.mark.parametrize("releaser", ["task", "thread"])
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_an_await_ends_only_after_the_release(
    anyio_backend: object, releaser: str, strategy: str
) -> None:
    ais.set_wait_strategy(strategy)
    s = ais.Stream(DEV)
    released = threading.Event()
    with gated(s) as release:
        ais.delay(0.001, stream=s)
        e = s.record_event()

        def let_go() -> None:
            released.set()
            release()

        if releaser == "thread":
            timer = threading.Timer(HELD_FOR, let_go)
            timer.start()
            await e.synchronize()
            timer.join()
        else:
            async with anyio.create_task_group() as tg:

                async def later() -> None:
                    await anyio.sleep(HELD_FOR)
                    let_go()

                tg.start_soon(later)
                await e.synchronize()
        assert released.is_set()
        assert e.query()
    await s
