"""The backend protocol as the user objects reach it (``tests/helpers/protocol.py``): a backend
used directly refuses what the user objects refuse first; a stream is destroyed once and a
default stream never; objects of a backend without interop refuse interop. The backends'
classes against the protocol are checked in ``tests/internals/api/test_backend_classes.py``.
"""

from __future__ import annotations

import pytest

import aiostream as ais
from tests.helpers.protocol import backend, backend_of, handle_of
from tests.helpers.stand_in import OK


def test_the_virtual_backend_checks_what_the_user_objects_check_first(
    clock: ais.virtual.VirtualClock,
) -> None:
    """The user objects refuse bad calls before they reach a backend; the virtual backend,
    used directly, refuses them too (its own tests and tools call it so). Its clock stands
    still: the work submitted here stays pending."""
    virtual = backend("virtual")
    start, end = (
        virtual.event_create(0, timing=True, blocking=False, interprocess=False) for _ in range(2)
    )
    with pytest.raises(ValueError) as never:
        virtual.event_elapsed_ms(start, end)
    assert str(never.value) == "elapsed_time() needs two recorded events"
    s = virtual.stream_create(0, 0)
    with pytest.raises(ValueError) as negative:
        virtual.delay(s, -1.0)
    assert str(negative.value) == "seconds must be >= 0 seconds, got -1.0"
    virtual.event_record(start, s)
    virtual.delay(s, 1.0)
    virtual.event_record(end, s)
    with pytest.raises(ais.NotReadyError) as busy:
        virtual.event_elapsed_ms(start, end)
    assert str(busy.value) == (
        "elapsed_time() needs both events complete; await synchronize() on the later one first"
    )
    assert virtual.device_name(0) == "simulated"  # as `python -m aiostream info` says


@pytest.mark.parametrize("device", ["virtual:0", "cuda:0"])
def test_a_stream_is_destroyed_once_and_a_default_stream_never(device: str) -> None:
    """``stream_destroy`` runs in finalizers: it never raises, a second call does nothing, and
    a device's default stream (which the backend does not own) stays usable."""
    if device.startswith("cuda") and not OK:
        pytest.skip("needs a CUDA device (python -m aiostream info says why)")
    s, default = ais.Stream(device), ais.default_stream(device)
    owner = backend_of(s)
    live = ais.virtual.stats().streams if device.startswith("virtual") else None
    for _ in range(2):
        owner.stream_destroy(handle_of(default))
        owner.stream_destroy(handle_of(s))
    if live is not None:
        assert ais.virtual.stats().streams == live - 1
    ais.delay(0.001, stream=default)
    default.synchronize_blocking()
    assert default.query()


def test_objects_of_a_backend_without_interop_refuse_interop() -> None:
    s = ais.Stream("virtual:0")
    with pytest.raises(TypeError, match="not a CUDA stream"):
        s.__cuda_stream__()
