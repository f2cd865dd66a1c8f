"""The CUDA backend's driver layer, white-box: loading the driver and the reasons it gives
when it cannot (``load_driver``, called afresh: the public path caches its first answer for
the process), errors of codes the bindings cannot name, and the layout of a shared buffer's
handle (which a test forges to check the sizes of its parts).
"""

from __future__ import annotations

import re
import sys

import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# ---------------------------------------------------- loading the driver


@pytest.mark.parametrize(
    ("init", "count", "reason"),
    [
        (100, 1, "the NVIDIA driver found no CUDA device"),  # CUDA_ERROR_NO_DEVICE
        (0, 0, "the NVIDIA driver found no CUDA device"),  # cuInit works, but no device
        (
            34,  # CUDA_ERROR_STUB_LIBRARY
            1,
            "libcuda.so.1 is the CUDA toolkit's stub library, not a driver: put the real "
            "driver's library first on the library path",
        ),
        # any other failure: named as the driver names it (its message varies by driver)
        (3, 1, "cuInit failed: CUDA_ERROR_NOT_INITIALIZED (3)"),
    ],
    ids=["no-device", "no-device-counted", "stub", "other"],
)
def test_why_the_driver_cannot_be_used_is_said_exactly(
    monkeypatch: pytest.MonkeyPatch, init: int, count: int, reason: str
) -> None:
    """What cuInit and cuDeviceGetCount answer becomes the reason the backend gives, word for
    word, up to the driver's own message of any other code (the bindings' calls are replaced
    here, the driver itself is left as it is)."""
    from cuda.bindings import driver

    from aiostream._backends.cuda.driver import load_driver

    monkeypatch.setattr(driver, "cuInit", lambda flags: (driver.CUresult(init),))
    monkeypatch.setattr(driver, "cuDeviceGetCount", lambda: (driver.CUresult.CUDA_SUCCESS, count))
    with pytest.raises(ais.BackendUnavailableError) as info:
        load_driver()
    said = info.value.reason
    assert info.value.kind == "cuda" and (said == reason or said.startswith(f"{reason}: ")), said
    assert str(info.value) == f"the 'cuda' backend is unavailable: {said}"


def test_without_cuda_python_the_reason_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No bindings to import: the cuda backend is unavailable, and says what to install or
    use instead."""
    from aiostream._backends.cuda import driver
    from aiostream._backends.cuda.driver import load_driver

    monkeypatch.setattr(driver, "_no_driver_library", lambda: None)  # a driver is installed
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as if never installed
    with pytest.raises(ais.BackendUnavailableError) as info:
        load_driver()
    assert info.value.kind == "cuda"
    assert re.fullmatch(
        r"cuda-python is not installed \(.+\); run 'pip install cuda-python', or use a "
        r"virtual device \('virtual:0'\)",
        info.value.reason,
    ), info.value.reason


def test_without_a_driver_library_the_reason_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bindings import but find no ``libcuda.so.1`` (cuda.pathfinder raises a
    RuntimeError from the first call): the cuda backend is unavailable, and says which
    library is missing and what to install or use instead, word for word."""
    from cuda.bindings import driver

    from aiostream._backends.cuda import driver as ours
    from aiostream._backends.cuda.driver import load_driver

    def no_library(flags: int) -> None:
        raise RuntimeError("libcuda.so.1 not found")

    monkeypatch.setattr(ours, "_no_driver_library", lambda: None)  # the dlopen found one
    monkeypatch.setattr(driver, "cuInit", no_library)
    with pytest.raises(ais.BackendUnavailableError) as info:
        load_driver()
    assert info.value.kind == "cuda"
    assert info.value.reason == (
        "no NVIDIA driver library (libcuda.so.1) could be loaded (libcuda.so.1 not found); "
        "install the NVIDIA driver, or use a virtual device ('virtual:0')"
    )


def test_a_code_the_bindings_do_not_know_is_kept_unnamed() -> None:
    """A code the installed bindings cannot name (a newer driver's) keeps its number; its
    name is empty rather than a guess."""
    from cuda.bindings import driver as cu

    from aiostream._backends.cuda.driver import Driver

    err = Driver(cu).error(54321, 0, "cuStreamQuery")
    assert (err.code, err.name, err.device) == (54321, "", DEV)
    assert str(err) == "cuStreamQuery failed on cuda:0: CUresult 54321"
    known = Driver(cu).error(cu.CUresult.CUDA_ERROR_NOT_READY, None, "cuEventQuery")
    assert (known.code, known.name, known.device) == (600, "CUDA_ERROR_NOT_READY", "cuda")
    assert str(known).startswith("cuEventQuery failed on cuda: CUDA_ERROR_NOT_READY (600): ")


# ----------------------------------------------- shared buffers' handles


@pytest.mark.parametrize("part", ["memory", "event"])
def test_a_shared_buffer_handle_of_the_wrong_size_says_what_to_pass(part: str) -> None:
    """A handle whose header is aiostream's but whose memory or event part is not the CUDA
    backend's size is refused before any driver call, saying what to pass."""
    import struct

    from aiostream.data.buffers import _IPC_HEADER

    handle = ais.DeviceBuffer(N, DEV, interprocess=True).ipc_handle()
    at = struct.calcsize(_IPC_HEADER)
    magic, nbytes, mem_len, event_len = struct.unpack_from(_IPC_HEADER, handle)
    memory, event = handle[at : at + mem_len], handle[at + mem_len :]
    if part == "memory":
        memory += b"\0"
    else:
        event = event[:-1]
    header = struct.pack(_IPC_HEADER, magic, nbytes, len(memory), len(event))
    with pytest.raises(ValueError) as info:
        ais.DeviceBuffer.from_ipc_handle(DEV, header + memory + event)
    assert str(info.value) == (
        "not an IPC handle of CUDA device memory: pass the bytes that DeviceBuffer.ipc_handle() "
        "returned in the exporting process"
    )
