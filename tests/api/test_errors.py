"""What a newcomer reads: errors named as they are imported, debug listings that show the
user's own frames."""

from __future__ import annotations

import os
import pickle
import traceback

import anyio
import pytest

import aiostream as ais

pytestmark = pytest.mark.anyio

ERRORS = [
    ais.AiostreamError,
    ais.DeviceError,
    ais.CudaError,
    ais.BackendUnavailableError,
    ais.NotReadyError,
    ais.StaleHandleError,
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
def test_errors_are_named_as_users_import_them(error: type[Exception]) -> None:
    assert error.__module__ == "aiostream"
    assert getattr(ais, error.__name__) is error
    try:
        raise ais.NotReadyError("not yet")
    except ais.NotReadyError as exc:
        last = traceback.format_exception(exc)[-1]
    assert last == "aiostream.NotReadyError: not yet\n"


def test_errors_pickle_by_their_public_name() -> None:
    exc = ais.DeviceError("boom", device="virtual:0")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is ais.DeviceError and str(again) == "boom"


async def test_debug_listings_show_the_users_frames_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ais._diagnostics, "debug", True)
    s = ais.Stream()
    ais.delay(0.3, stream=s)

    async def waiter() -> None:
        await s

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.05)
        (wait,) = ais.pending_waits()
    assert wait.started_at is not None and wait.recorded_at is not None
    machinery = [
        os.sep + os.path.join(name, "") for name in ("asyncio", "anyio", "trio", "aiostream")
    ]
    for listing in (wait.started_at, wait.recorded_at):
        frames = listing.splitlines()
        assert not [f for f in frames if any(m in f for m in machinery)], listing
    assert wait.started_at.splitlines()[-1].endswith(", in waiter")
    assert wait.recorded_at.splitlines()[-1].endswith(
        ", in test_debug_listings_show_the_users_frames_only"
    )


def test_cuda_skips_say_why_once(pytester: pytest.Pytester) -> None:
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
    reason = ais._backends.probe("cuda")[1]
    assert out.count(reason) == 1  # the detail, once
    result.stdout.fnmatch_lines(
        [
            f"aiostream: the cuda:0 tests skipped: {reason}",
            '*SKIPPED [[]*]*needs a CUDA GPU (why none works here: the "aiostream:" line above)',
        ]
    )
