"""The backends' classes against the Backend protocol (``aiostream/_backends/base.py``): each
implements it and exactly the capabilities it declares, seen at run time too; a capture of an
event never recorded, as the virtual backend lists the wait it holds; the CUDA backend loading
the stand-in driver. Behaviour through the user objects and the protocol's methods is tested in
``tests/api/test_backend_protocol.py``.

mypy checks the signatures (both backends subclass the protocols explicitly, so a missing or
mistyped method fails ``mypy --strict`` in CI); these tests check the same at run time.
"""

from __future__ import annotations

import inspect

import pytest

import aiostream as ais
from aiostream._backends.base import Backend, Interop, Timeline
from aiostream._backends.cuda import CudaBackend
from aiostream._backends.virtual import VirtualBackend


def _members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return names | set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize(
    ("cls", "capabilities"),
    [(VirtualBackend, {Timeline}), (CudaBackend, {Interop})],
    ids=["virtual", "cuda"],
)
def test_each_backend_implements_the_protocol_and_its_capabilities(
    cls: type, capabilities: set[type]
) -> None:
    assert Backend in cls.__mro__  # explicit: mypy checks every method against the protocol
    for protocol in (Backend, Interop, Timeline):
        declared = protocol in cls.__mro__
        assert declared == (protocol is Backend or protocol in capabilities), protocol
        if not declared:
            continue
        for name in _members(protocol):
            own = inspect.getattr_static(cls, name)
            assert own is not inspect.getattr_static(protocol, name, None), (
                f"{cls.__name__}.{name} is the protocol's stub, not an implementation"
            )
    assert not inspect.isabstract(cls)


def test_capabilities_are_seen_at_run_time() -> None:
    backend = VirtualBackend()
    try:
        assert isinstance(backend, Timeline)
        assert not isinstance(backend, Interop)
    finally:
        backend.close()


@pytest.mark.parametrize("device", ["virtual:0", "cuda:0"])
def test_a_capture_of_an_event_never_recorded_is_complete(device: str) -> None:
    """``event_target`` of an event whose handle exists but that was never recorded (an
    interprocess event handed out first) captures no work: its target is done, a watch is
    called at once, and the release is idempotent. The user objects ask ``query()`` first, so
    only a backend's direct callers reach it."""
    from aiostream import _backends

    if device.startswith("cuda") and not _backends.probe("cuda")[0]:
        pytest.skip("needs a CUDA device (python -m aiostream info says why)")
    if device.startswith("virtual"):
        clock = ais.virtual.VirtualClock()
        ais.virtual.reset(clock=clock)
        clock.advance(1.5)
    e = ais.Event(device, interprocess=True)
    e.ipc_handle()  # the handle is made now, with nothing recorded
    called: list[bool] = []
    for wake in (False, True):
        target = e._backend.event_target(e._handle, wake)
        assert target.done() is True
        if device.startswith("virtual"):  # a wait held until released, on work done now
            assert e._backend.leaks()[0] == (
                "pending wait on virtual:0 stream 0 (for the work up to its 'sync', "
                "submitted at t=1.500000000s)"
            )
        target.watch(lambda wake=wake: called.append(wake))  # type: ignore[misc]
        target.release()
        target.release()
    assert called == [False, True]  # each watch at once


def test_the_stand_in_driver_loads_where_it_has_devices() -> None:
    """Where ``libcuda.so.1`` is the tests' stand-in with devices, the CUDA backend loads it.
    The CUDA suites skip where no driver loads, so a loader that refused a working driver
    would only make them skip; this test runs whether it loads or not."""
    import ctypes
    import os

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no libcuda.so.1 here (CI's CUDA lane runs this with the stand-in)")
    if not hasattr(lib, "fake_cuda_live"):
        pytest.skip("libcuda.so.1 is a real driver: the CUDA suites say whether it loads")
    if os.environ.get("FAKE_CUDA_DEVICES") == "0" or os.environ.get("FAKE_CUDA_STUB") == "1":
        pytest.skip("the stand-in is set to have no usable device")
    driver = pytest.importorskip("cuda.bindings.driver")
    from aiostream._backends.cuda.driver import load_driver

    assert load_driver() is driver
