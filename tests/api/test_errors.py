"""aiostream's errors: named as users import them (``aiostream.DeviceError``, in tracebacks
too), and pickled by that name with their attributes, whole, across processes."""

from __future__ import annotations

import pickle
import traceback

import pytest

import aiostream as ais

ERRORS = [
    ais.AiostreamError,
    ais.DeviceError,
    ais.CudaError,
    ais.BackendUnavailableError,
    ais.NotReadyError,
    ais.StaleHandleError,
    ais.CaptureError,
    ais.GraphUpdateError,
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


@pytest.mark.parametrize(
    "error",
    [
        ais.AiostreamError("plain"),
        ais.DeviceError("ECC error", device="virtual:0"),
        ais.CudaError("launch failed", device="cuda:0", code=719, name="CUDA_ERROR_LAUNCH_FAILED"),
        ais.BackendUnavailableError("cuda", "no driver"),
        ais.NotReadyError("not yet"),
        ais.StaleHandleError("gone"),
        ais.GraphUpdateError("another topology", reason="topology"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_cross_processes_whole(error: ais.AiostreamError) -> None:
    """Errors pickle with their attributes (multiprocessing and Ray ship them to the caller)."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)
