"""The pytest plugin's leak checks (aiostream.testing), tested with pytest's own pytester:
what a test leaves behind fails it, with a listing; what it does not own does not."""

from __future__ import annotations

# Imported before any pytester run, which would drop them from sys.modules after importing
# them for its inner tests: numpy's extension loads once per process, and aiostream's modules
# imported again would be a second copy beside the one aiostream's namespace keeps.
import numpy  # noqa: F401
import pytest

import aiostream as ais
import aiostream.tracing  # noqa: F401
from tests.helpers.plugin_runs import ANYIO_LOOPS, run

# the modules behind these names, imported now (see above)
_IMPORTED = (ais.HostBuffer, ais.Profiler, ais.record_function)


def test_objects_a_thread_lets_go_of_soon_after_the_test_are_no_leak(
    pytester: pytest.Pytester,
) -> None:
    """A thread (anyio's pooled one that ran the test's last call, here a thread of the test's
    own) holding a stream a moment past the test's end: no leak. Held for longer than the
    half second the check allows: a leak."""
    result = run(
        pytester,
        """
import threading
import time

import aiostream as ais

released = threading.Event()

def hold(box, seconds):
    time.sleep(seconds)
    box.clear()
    released.set()

def test_let_go_soon(virtual_device):
    threading.Thread(target=hold, args=([ais.Stream()], 0.1)).start()

def test_kept(virtual_device):
    released.clear()
    threading.Thread(target=hold, args=([ais.Stream()], 2.0)).start()

def test_after(virtual_device):
    assert released.wait(5)
""",
    )
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_kept*", "*live stream virtual:0 stream 1 (priority 0)"]
    )


def test_objects_fixture_values_hold_are_no_leak_their_pending_work_is(
    pytester: pytest.Pytester,
) -> None:
    """pytest holds fixture values until the test's teardown has ended, after the leak
    check: a Stream, an Event and buffers a fixture returns (in a dict, in a list, in an
    object) are not the test's leak, on every loop. Work still pending on them is."""
    pytester.makeconftest(ANYIO_LOOPS)
    result = run(
        pytester,
        """
import aiostream as ais
import pytest

class Kit:
    def __init__(self):
        self.stream = ais.Stream()
        self.buffers = {"dev": ais.DeviceBuffer(64), "host": [ais.HostBuffer(64)]}

@pytest.fixture
def kit(virtual_device):
    return Kit()

@pytest.fixture
def done(virtual_device):
    s = ais.Stream()
    yield s, s.record_event()

@pytest.mark.anyio
async def test_uses_them(kit, done):
    ais.copy_async(kit.buffers["dev"], kit.buffers["host"][0], stream=kit.stream)
    await kit.stream
    await done[1]

def test_pending_work_in_a_fixture_is_still_a_leak(kit):
    ais.virtual.submit(kit.stream, 5.0, name="forgotten")
""",
    )
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_pending_work_in_a_fixture_is_still_a_leak*",
            "*the test leaked 1 thing(s) on the virtual backend:",
            "*pending operation 'forgotten' on virtual:0 stream 1, engine compute*",
        ]
    )


def test_tracing_left_on_across_tests_is_no_leak_of_theirs(pytester: pytest.Pytester) -> None:
    """aiostream.tracing, instrumented for a whole module, keeps an anchor event per device
    for the regions it times on a stream: that event is tracing's, not a leak of each test."""
    pytester.makeconftest(ANYIO_LOOPS)
    result = run(
        pytester,
        """
import aiostream as ais
import aiostream.tracing
import pytest

@pytest.fixture(scope="module", autouse=True)
def tracing():
    with aiostream.tracing.instrument():
        yield

@pytest.mark.anyio
@pytest.mark.parametrize("step", ["first", "second"])
async def test_a_timed_region(virtual_device, step):
    s = ais.Stream()
    with ais.record_function(step, stream=s):
        ais.delay(0.001, stream=s)
    await s
""",
    )
    result.assert_outcomes(passed=6)


def test_leaks_fail_the_test_with_a_listing(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import aiostream as ais
import pytest

kept = []

def test_leaky(virtual_device):
    s = ais.Stream()
    ais.virtual.submit(s, 5.0, name="forgotten")
    kept.append(s)
    kept.append(s.record_event())

@pytest.mark.aiostream(check_leaks=False)
def test_allowed(virtual_device):
    kept.append(ais.Stream())

def test_failing_tests_are_not_also_blamed_for_leaks(virtual_device):
    kept.append(ais.Stream())
    assert False, "the real failure"
""",
    )
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaky*",
            "*the test leaked 3 thing(s) on the virtual backend:",
            "*pending operation 'forgotten' on virtual:0 stream 1, engine compute*",
            "*live stream virtual:0 stream 1 (priority 0)",
            "*live event virtual:0 event 1",
            "*Await the work you submit*",
        ]
    )
    assert "test_allowed" not in "\n".join(line for line in result.outlines if "ERROR" in line)
