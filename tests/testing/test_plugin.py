"""The pytest plugin (aiostream.testing), tested with pytest's own pytester."""

from __future__ import annotations

# Imported before any pytester run, which would drop them from sys.modules after importing
# them for its inner tests: numpy's extension loads once per process, and aiostream's modules
# imported again would be a second copy beside the one aiostream's namespace keeps.
import numpy  # noqa: F401
import pytest

import aiostream as ais
import aiostream.tracing  # noqa: F401
from aiostream.testing import format_timeline
from tests.helpers import protocol
from tests.helpers.plugin_runs import ANYIO_LOOPS, run
from tests.helpers.stand_in import REASON

# the modules behind these names, imported now (see above)
_IMPORTED = (ais.HostBuffer, ais.Profiler, ais.record_function)


def test_the_plugin_is_registered_through_its_entry_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--trace-config", "--co", "-q", "-o", "asyncio_default_fixture_loop_scope=function"
    )
    result.stdout.fnmatch_lines(["*aiostream*aiostream/testing*"])


def test_virtual_device_is_fresh_configurable_and_restores_the_previous_backend(
    pytester: pytest.Pytester,
) -> None:
    before = protocol.backend("virtual")
    result = run(
        pytester,
        """
import aiostream as ais
import pytest

@pytest.mark.aiostream(devices=2, compute_slots=2)
def test_configured(virtual_device):
    assert virtual_device == ais.Device("virtual", 0)
    assert ais.device_count("virtual") == 2
    a, b = ais.Stream(), ais.Stream("virtual:1")
    assert ais.virtual.stats() == ais.virtual.VirtualStats(2, 0, 0, 0)
    del a, b

def test_fresh(virtual_device):
    assert ais.device_count("virtual") == 1
    assert ais.virtual.stats().streams == 0
""",
    )
    result.assert_outcomes(passed=2)
    assert protocol.backend("virtual") is before


def test_markers_at_several_levels_merge_the_closest_winning_each_option(
    pytester: pytest.Pytester,
) -> None:
    """A module's devices=2 holds for a class's and a test's own markers on other options;
    an option given at several levels takes the closest one's value."""
    result = run(
        pytester,
        """
import aiostream as ais
import pytest

pytestmark = pytest.mark.aiostream(devices=2, compute_slots=2)

kept = []

@pytest.mark.aiostream(check_leaks=False)
def test_own_marker(virtual_device):
    assert ais.device_count("virtual") == 2
    kept.append(ais.Stream())  # no leak: check_leaks=False is the test's

@pytest.mark.aiostream(devices=3)
class TestClass:
    @pytest.mark.aiostream(devices=4)
    def test_closest_wins(self, virtual_device):
        assert ais.device_count("virtual") == 4

    def test_class_over_module(self, virtual_device):
        assert ais.device_count("virtual") == 3
""",
    )
    result.assert_outcomes(passed=3)


def test_bad_marker_options_are_reported(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import pytest

@pytest.mark.aiostream(device=2)
def test_typo(virtual_device):
    pass

@pytest.mark.aiostream(2)
def test_positional(virtual_device):
    pass
""",
    )
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            "*unknown option(s) device; accepted: devices, compute_slots*",
            "*takes keyword arguments only*",
        ]
    )


TEN_SECONDS = """
import time
import anyio
import pytest
import aiostream as ais

async def ten_seconds(virtual_time, clock):
    wall = time.perf_counter()
    t0 = clock()
    s = ais.Stream()
    ais.delay(10.0, stream=s)
    await s.synchronize()
    assert clock() - t0 == 10.0          # the loop's clock moved by exactly 10 s
    assert virtual_time.now() == 10.0
    assert ais.virtual.now() == 10.0     # and so did the device's
    await anyio.sleep(2.5)               # loop timers share the clock
    assert ais.virtual.now() == 12.5
    assert time.perf_counter() - wall < 6.0  # not the 12.5 s the clock moved: a wide margin
"""


def test_virtual_time_with_anyio_on_asyncio_and_trio(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        ANYIO_LOOPS
        + TEN_SECONDS
        + """
@pytest.mark.anyio
async def test_ten(virtual_time):
    await ten_seconds(virtual_time, anyio.current_time)
""",
        "-v",
        "-rs",
    )
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*test_ten?asyncio? PASSED*",
            "*test_ten?trio? PASSED*",
            "*SKIPPED*virtual_time cannot fake the clock of uvloop.Loop*"
            "asyncio's default loop or on trio",
        ]
    )


def test_virtual_time_with_pytest_asyncio_strict_and_uvloop_factories(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest("""
import asyncio
import uvloop

def pytest_asyncio_loop_factories(config, item):
    return {"default": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
""")
    result = run(
        pytester,
        TEN_SECONDS
        + """
import asyncio

@pytest.mark.asyncio
async def test_ten(virtual_time):
    await ten_seconds(virtual_time, asyncio.get_running_loop().time)
""",
        "-o",
        "asyncio_mode=strict",
        "-v",
        "-rs",
    )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*virtual_time cannot fake the clock of uvloop.Loop*"])


def test_both_plugins_side_by_side_in_strict_mode(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import anyio
import pytest
import aiostream as ais

@pytest.mark.asyncio
async def test_with_pytest_asyncio(virtual_time):
    s = ais.Stream()
    ais.delay(3.0, stream=s)
    await s.synchronize()
    assert virtual_time.now() == 3.0

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_with_anyio(virtual_time, anyio_backend):
    s = ais.Stream()
    ais.delay(3.0, stream=s)
    await s.synchronize()
    assert virtual_time.now() == 3.0
""",
        "-o",
        "asyncio_mode=strict",
        "-o",
        "anyio_mode=strict",
    )
    result.assert_outcomes(passed=3)


def test_virtual_time_needs_an_async_test(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
def test_sync(virtual_time):
    pass
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*virtual_time needs an async test function*"])


def test_aiostream_device_covers_every_backend(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import aiostream as ais

def test_device(aiostream_device):
    s = ais.Stream(aiostream_device)
    assert s.device == aiostream_device
""",
        "-v",
        "-rs",
    )
    if ais.is_available("cuda"):
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(
            ["*test_device?virtual:0? PASSED*", "*SKIPPED*needs a CUDA GPU*"]
        )


def test_timelines_are_identical_over_50_runs_on_asyncio_and_trio(
    pytester: pytest.Pytester,
) -> None:
    out = pytester.path / "timelines"
    result = run(
        pytester,
        """
import anyio
import pytest
import aiostream as ais

@pytest.mark.anyio
@pytest.mark.aiostream(compute_slots=2)
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("repeat", range(50))
async def test_pipeline(virtual_time, anyio_backend, repeat):
    streams = [ais.Stream(priority=-i) for i in range(3)]

    async def stage(i):
        s = streams[i]
        for k in range(4):
            ais.virtual.submit(s, 0.010 * (i + 1), engine="h2d", name=f"copy{i}.{k}")
            ais.virtual.submit(s, 0.020, name=f"kernel{i}.{k}")
            # apart: no two tasks touch a stream at once
            await anyio.sleep((0.007, 0.011, 0.013)[i])
            if k == 2:
                streams[(i + 1) % 3].wait_stream(s)
        await s.synchronize()

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(stage, i)
""",
        f"--aiostream-timelines={out}",
        "-q",
    )
    result.assert_outcomes(passed=100)
    texts = {path.read_bytes() for path in out.iterdir()}
    assert len(list(out.iterdir())) == 100
    assert len(texts) == 1
    (text,) = texts
    assert text.count(b"\n") == 1 + 24


def test_format_timeline_is_canonical() -> None:
    record = ais.virtual.OpRecord("k", 0, 3, "compute", 0.0, 0.5, 1.25, None)
    assert format_timeline([record]) == (
        "# device stream engine start end name error\n"
        "virtual:0 3 compute 0.500000000 1.250000000 'k' None\n"
    )


def test_virtual_device_is_the_default_device_whatever_the_environment_says(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOSTREAM_DEVICE", "cuda:0")  # as on a machine set up for its GPU
    result = run(
        pytester,
        """
import os
import aiostream as ais

def test_default(virtual_device):
    assert ais.device() == virtual_device
    assert ais.Stream().device == virtual_device

def test_restored_after():
    assert os.environ["AIOSTREAM_DEVICE"] == "cuda:0"
""",
    )
    result.assert_outcomes(passed=2)


# ---------------------------------------------------------------------- misuse of the plugin


def test_a_reset_inside_the_fixture_keeps_its_leak_checks_and_clock(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
import anyio
import pytest
import aiostream as ais

kept = []

def test_hides_a_leak(virtual_device):
    s = ais.Stream()
    ais.virtual.submit(s, 3600.0, name="an hour")
    kept.append(s)
    ais.virtual.reset()

def test_a_clean_reset_passes(virtual_device):
    s = ais.Stream()
    ais.delay(0.0, stream=s)
    del s
    ais.virtual.reset(devices=2)
    assert ais.device_count("virtual") == 2

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_virtual_time_survives_a_reset(virtual_time, anyio_backend):
    ais.virtual.reset(devices=2)
    s = ais.Stream("virtual:1")
    ais.delay(0.3, stream=s)
    await s.synchronize()
    assert ais.virtual.now() == 0.3   # the test's clock, not the monotonic one
    assert virtual_time.now() == 0.3

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_another_clock_under_virtual_time_is_refused(virtual_time, anyio_backend):
    with pytest.raises(ValueError, match="leave clock out"):
        ais.virtual.reset(clock=ais.virtual.VirtualClock())
""",
    )
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_hides_a_leak*",
            "*pending operation 'an hour' on virtual:0 stream 1*(before aiostream.virtual.reset())",
        ]
    )


def test_marker_flags_must_be_booleans(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import pytest
import aiostream as ais

kept = []

@pytest.mark.aiostream(check_leaks="no")
def test_string(virtual_device):
    kept.append(ais.Stream())

@pytest.mark.aiostream(check_races=1.5)
def test_float(virtual_device):
    pass

@pytest.mark.aiostream(devices=0)
def test_no_devices(virtual_device):
    pass
""",
    )
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines_random(
        [
            "*aiostream(check_leaks=...) takes True or False, got 'no'*",
            "*aiostream(check_races=...) takes True or False, got 1.5*",
            "*@pytest.mark.aiostream(...): devices must be*",
        ]
    )


def test_the_marker_needs_the_fixture(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import pytest
import aiostream as ais

@pytest.mark.aiostream(devices=2)
def test_without_the_fixture():
    ais.Stream("virtual:1")
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*configures the virtual_device fixture, which this test*"])
    assert "reset(devices=N)" not in result.stdout.str()


def test_every_test_s_timeline_has_a_file_of_its_own(pytester: pytest.Pytester) -> None:
    """Ids that differ only in characters a file name cannot hold (in the parameters or in
    the path: ``test_a/test_b.py`` and ``test_a_test_b.py``), or only in case, and an id longer
    than a file name may be, each get a file of their own, named for the id; the tests
    pass."""
    out = pytester.path / "timelines"
    body = """
import pytest
import aiostream as ais

@pytest.mark.parametrize("case", ["a/b", "a:b", "a b", "A b", "x" * 300])
def test_one(virtual_device, case):
    ais.Stream().synchronize_blocking()

def test_plain(virtual_device):
    pass
"""
    pytester.makepyfile(**{"test_a/test_b": "def test_x(virtual_device):\n    pass\n"})
    pytester.makepyfile(test_a_test_b="def test_x(virtual_device):\n    pass\n")
    result = run(pytester, body, f"--aiostream-timelines={out}", "-q")
    result.assert_outcomes(passed=8)
    names = sorted(path.name for path in out.iterdir())
    assert len({name.lower() for name in names}) == 8, names
    assert any(name.startswith("test_inner.py_test_plain-") for name in names), names
    assert all(len(name) <= 200 for name in names), names


def test_a_timeline_that_cannot_be_written_is_a_warning_and_the_checks_run(
    pytester: pytest.Pytester,
) -> None:
    """The timelines' folder removed during the run: the tests' outcomes and their leak
    checks stand, and the end of the run says which timelines are missing (a warning would
    be an error where warnings are, and skip the checks after it)."""
    out = pytester.path / "timelines"
    result = run(
        pytester,
        f"""
import shutil
import aiostream as ais

def test_removes_the_folder(virtual_device):
    shutil.rmtree({str(out)!r})

def test_leaks(virtual_device):
    ais.delay(10.0)
""",
        f"--aiostream-timelines={out}",
        "-q",
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*the test leaked 1 thing(s)*"])
    result.stdout.fnmatch_lines(
        [
            "aiostream: 2 timeline(s) could not be written; the first: "
            "test_inner.py::test_removes_the_folder: *No such file or directory*"
        ]
    )


def test_a_timelines_option_naming_a_file_is_a_usage_error(pytester: pytest.Pytester) -> None:
    target = pytester.path / "not-a-folder"
    target.write_text("")
    result = run(
        pytester,
        """
def test_one(virtual_device):
    pass
""",
        f"--aiostream-timelines={target}",
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--aiostream-timelines=*not-a-folder: that is a file*"])


def test_a_race_fails_the_test_with_where_it_happened(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import aiostream as ais
import pytest

def racy_read():
    dev, host = ais.DeviceBuffer(64), ais.HostBuffer(64)
    with ais.virtual.stall("d2h"):     # the copy stays in flight while the stall is held
        ais.copy_async(host, dev)
        host.numpy()                   # read before the copy landed: a race
    ais.current_stream().synchronize_blocking()

def test_racy(virtual_device):
    racy_read()

@pytest.mark.aiostream(check_races=False)
def test_racy_allowed(virtual_device):
    racy_read()

def test_racy_before_a_reset(virtual_device):
    racy_read()
    ais.virtual.reset()

def test_synchronised(virtual_device):
    dev, host = ais.DeviceBuffer(64), ais.HostBuffer(64)
    ais.copy_async(host, dev)
    ais.current_stream().synchronize_blocking()
    host.numpy()
""",
    )
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_racy*",
            "*the test touched 1 host buffer(s) while a copy into them was in flight; await the"
            " copy's event or stream first:",
            "*host access to a 64-byte buffer while *",
            "*in racy_read*",
            "*check_races=False*",
            "*ERROR at teardown of test_racy_before_a_reset*",
            "*the test touched 1 host buffer(s)*",
        ]
    )
    errors = [line for line in result.outlines if line.startswith("ERROR")]
    assert len(errors) == 2 and not any("allowed" in e or "synchronised" in e for e in errors)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_in_virtual_time_takes_the_backend_s_options_and_restores_the_previous(
    backend: str,
) -> None:
    """Outside pytest: a fresh backend with the given options, on a fake clock, replaced by
    the one that was there before once the function returns (or raises)."""
    from aiostream.testing import run_in_virtual_time

    before = protocol.backend("virtual")

    async def two_kernels_at_once() -> tuple[float, int]:
        a, b = ais.Stream(), ais.Stream()
        ais.delay(1.0, stream=a)
        ais.delay(1.0, stream=b)
        await a.synchronize()
        await b.synchronize()
        return ais.virtual.now(), ais.device_count("virtual")

    assert run_in_virtual_time(two_kernels_at_once, backend=backend) == (2.0, 1)  # one slot
    assert run_in_virtual_time(
        two_kernels_at_once, backend=backend, compute_slots=2, devices=3
    ) == (1.0, 3)
    assert protocol.backend("virtual") is before

    async def fails() -> None:
        ais.delay(1.0)
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        run_in_virtual_time(fails, backend=backend)
    assert protocol.backend("virtual") is before


def test_run_in_virtual_time_refuses_what_it_cannot_do() -> None:
    from aiostream.testing import run_in_virtual_time

    async def nothing() -> None:
        pass

    with pytest.raises(ValueError, match="backend must be 'asyncio' or 'trio', got 'uvloop'"):
        run_in_virtual_time(nothing, backend="uvloop")
    with pytest.raises(TypeError, match="unknown virtual backend option.*'clock'"):
        run_in_virtual_time(nothing, clock=lambda: 0.0)
    with pytest.raises(ValueError, match="compute_slots must be >= 1"):
        run_in_virtual_time(nothing, compute_slots=0)


def test_leaked_buffers_and_waits_are_listed_too(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import threading, time
import aiostream as ais

kept = []

def wait_quietly(stream):
    try:
        stream.synchronize_blocking()
    except ais.StaleHandleError:  # the fixture retires the backend at teardown
        pass

def test_leaky(virtual_device):
    kept.append(ais.DeviceBuffer(128))
    s = ais.Stream()
    ais.virtual.submit(s, 5.0, name="long")
    thread = threading.Thread(target=wait_quietly, args=(s,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while ais.virtual.stats().waits == 0:
        assert time.monotonic() < deadline, "the thread's wait did not begin within 10 s"
        time.sleep(0.001)
    kept.append((s, thread))
""",
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*the test leaked 4 thing(s) on the virtual backend:",
            "*pending wait on virtual:0 stream 1 (for the work up to its 'long', submitted at t=*",
            "*pending operation 'long' on virtual:0 stream 1, engine compute*running until*",
            "*live stream virtual:0 stream 1 (priority 0)",
            "*live buffer of 128 bytes on virtual:0",
        ]
    )


def test_cuda_skips_say_why_once(pytester: pytest.Pytester) -> None:
    """Where CUDA does not work, the plugin says why once, in the header, and each skipped
    ``cuda:0`` case points there."""
    if ais.is_available("cuda"):
        pytest.skip("CUDA works here: nothing is skipped for want of it")
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.anyio

        @pytest.mark.parametrize("n", range(5))
        async def test_device(aiostream_device, n):
            assert aiostream_device.type == "virtual"
        """
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes["passed"] == outcomes["skipped"] >= 5  # each loop: virtual runs, cuda skips
    out = result.stdout.str()
    assert out.count(REASON) == 1  # the detail, once
    result.stdout.fnmatch_lines(
        [
            f"aiostream: the cuda:0 tests skipped: {REASON}",
            '*SKIPPED [[]*]*needs a CUDA GPU (why none works here: the "aiostream:" line above)',
        ]
    )


def test_the_marker_takes_numpy_integers(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import numpy as np
import pytest

import aiostream as ais

@pytest.mark.aiostream(devices=np.int64(2), compute_slots=np.int32(2))
def test_two(virtual_device):
    assert ais.device_count("virtual") == 2
""",
    )
    result.assert_outcomes(passed=1)
