"""Debug mode from the environment (README: "When a pipeline hangs"): ``AIOSTREAM_DEBUG=1``
is ``set_debug(True)`` from the start, and pending waits then say where they started and
where their work was submitted. (``pending_waits()`` itself, and ``set_debug``, are tested
with the profiler's listings: tests/profiler/test_profiler.py.)
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.process import run_python

DEBUG_PROBE = textwrap.dedent(
    """
    import anyio, aiostream as ais

    async def main():
        s = ais.Stream()
        ais.delay(10.0, stream=s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.synchronize)
            await anyio.wait_all_tasks_blocked()
            (wait,) = ais.pending_waits()
            print("started", wait.started_at is not None)
            print("recorded", wait.recorded_at is not None)
            tg.cancel_scope.cancel()

    anyio.run(main)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False), (None, False)])
def test_aiostream_debug_in_the_environment_turns_debug_mode_on(
    value: str | None, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AIOSTREAM_DEBUG=1`` is ``set_debug(True)`` from the start: pending waits say where
    they started and where their work was submitted."""
    monkeypatch.delenv("AIOSTREAM_DEBUG", raising=False)
    env = {} if value is None else {"AIOSTREAM_DEBUG": value}
    result = run_python("-c", DEBUG_PROBE, timeout=120, **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["started", str(on), "recorded", str(on)]
