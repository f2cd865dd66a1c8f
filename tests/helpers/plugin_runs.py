"""Running an inner pytest session with the plugin (pytester), as its tests do."""

from __future__ import annotations

import pytest


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest(
        "-p", "no:cacheprovider", "-o", "asyncio_default_fixture_loop_scope=function", *args
    )
