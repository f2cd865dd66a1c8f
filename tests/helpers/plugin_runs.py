"""Running an inner pytest session with the plugin (pytester), as its tests do."""

from __future__ import annotations

import pytest

#: an inner session's conftest: its async tests on asyncio, trio and uvloop
ANYIO_LOOPS = """
import pytest

@pytest.fixture(params=["asyncio", "trio",
                        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
def anyio_backend(request):
    return request.param
"""


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest(
        "-p", "no:cacheprovider", "-o", "asyncio_default_fixture_loop_scope=function", *args
    )
