"""Arbitrary values thrown at a hand-written list of public calls (CALLS), which pairs odd
values with valid ones where a call needs both: each succeeds or raises a documented error
(``tests/helpers/fuzzing.py`` says which); and specific bad values some calls refuse.
``tests/api/test_every_public_name.py`` fuzzes every public name, found by introspection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings

import aiostream as ais
from tests.helpers import lanes
from tests.helpers.fuzzing import DOCUMENTED, ODD, memory_cap, reset_globals


def _calls() -> dict[str, Callable[..., Any]]:
    def stream() -> ais.Stream:
        return ais.Stream("virtual:0")

    def host() -> ais.HostBuffer:
        return ais.HostBuffer(16, device="virtual:0")

    def dev() -> ais.DeviceBuffer:
        return ais.DeviceBuffer(16, "virtual:0")

    return {
        "device": lambda a, b, c: ais.device(a),
        "is_available": lambda a, b, c: ais.is_available(a),
        "device_count": lambda a, b, c: ais.device_count(a),
        "Stream": lambda a, b, c: ais.Stream(a, priority=b),
        "Event": lambda a, b, c: ais.Event(a, enable_timing=b, interprocess=c),
        "delay": lambda a, b, c: ais.delay(a, stream=b if isinstance(b, ais.Stream) else None),
        "delay stream": lambda a, b, c: ais.delay(0.0, stream=a),
        "HostBuffer": lambda a, b, c: ais.HostBuffer(a, pinned=b, device="virtual:0"),
        "DeviceBuffer": lambda a, b, c: ais.DeviceBuffer(a, "virtual:0"),
        "HostBuffer.numpy": lambda a, b, c: host().numpy(a, b),
        "DeviceBuffer.view": lambda a, b, c: dev().view(a, b),
        "copy_async": lambda a, b, c: ais.copy_async(a, b, stream=c),
        "copy_async dst": lambda a, b, c: ais.copy_async(a, host()),
        "copy_async stream": lambda a, b, c: ais.copy_async(dev(), host(), stream=a),
        "DataLoader": lambda a, b, c: ais.DataLoader(
            [], transform=None, prefetch=a, workers=b, to_thread=c
        ),
        "DataLoader source": lambda a, b, c: ais.DataLoader(a),
        "set_wait_strategy": lambda a, b, c: ais.set_wait_strategy(a),
        "set_debug": lambda a, b, c: ais.set_debug(a),
        "set_watchdog": lambda a, b, c: ais.set_watchdog(a),
        "record_function": lambda a, b, c: ais.record_function(a, stream=b),
        # on a virtual device: an int never reaches a driver, which may crash on a made-up
        # handle (foreign handles must be live ones)
        "as_stream": lambda a, b, c: ais.as_stream(a, "virtual:0"),
        "as_event": lambda a, b, c: ais.as_event(a, "virtual:0"),
        "Event.from_ipc_handle": lambda a, b, c: ais.Event.from_ipc_handle(a, b),
        "Stream.wait_event": lambda a, b, c: stream().wait_event(a),
        "Stream.wait_stream": lambda a, b, c: stream().wait_stream(a),
        "Event.record": lambda a, b, c: ais.Event("virtual:0").record(a),
        "Event.elapsed_time": lambda a, b, c: ais.Event("virtual:0").elapsed_time(a),
        "virtual.reset devices": lambda a, b, c: ais.virtual.reset(devices=a),
        "virtual.reset slots": lambda a, b, c: ais.virtual.reset(compute_slots=a, h2d_slots=b),
        "virtual.reset rates": lambda a, b, c: ais.virtual.reset(bandwidth=a, latency=b),
        "virtual.reset memory": lambda a, b, c: ais.virtual.reset(memory=a),
        "virtual.fail_next": lambda a, b, c: ais.virtual.fail_next(a, engine=b, message=c),
        "virtual.slow_next": lambda a, b, c: ais.virtual.slow_next(a, b),
        "virtual.submit": lambda a, b, c: ais.virtual.submit(stream(), a, engine=b),
        "virtual.stall": lambda a, b, c: ais.virtual.stall(a),
    }


CALLS = _calls()


@pytest.mark.parametrize("name", sorted(CALLS))
@settings(max_examples=lanes.examples(60), deadline=None, derandomize=True, database=None)
@given(a=ODD, b=ODD, c=ODD)
def test_a_public_call_succeeds_or_raises_a_documented_error(
    name: str, a: Any, b: Any, c: Any
) -> None:
    """On the suite's own virtual backend (conftest.py's, the default device), reset after each
    call: the plugin's virtual_device would look for leaks at each reset, which takes long."""
    raised: BaseException | None = None
    try:
        with memory_cap():
            CALLS[name](a, b, c)
    except BaseException as exc:  # noqa: BLE001 - judged just below
        raised = exc
    finally:
        reset_globals()
    assert raised is None or isinstance(raised, DOCUMENTED), (
        f"{name}({a!r}, {b!r}, {c!r}) raised {type(raised).__name__}: {raised}"
    )


@pytest.mark.parametrize("call", [ais.as_stream, ais.as_event, ais.ExternalStream])
@pytest.mark.parametrize("handle", [1 << 64, 1 << 70, -1])
def test_foreign_handles_outside_the_pointer_range_are_refused(call: Any, handle: int) -> None:
    """Before any device is looked up: no OverflowError from the bindings, on any machine."""
    if handle < 0 and call is ais.as_event:
        with pytest.raises(ValueError, match="has no CUDA event yet"):
            call(handle)
        return
    with pytest.raises(ValueError, match=r"must be a pointer, 0 to 2\*\*64 - 1"):
        call(handle)
