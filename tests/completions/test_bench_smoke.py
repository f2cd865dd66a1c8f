"""benchmarks/bench_completions.py runs end to end (its figures are the benchmark's, not a
test's: benchmarks/RESULTS.md)."""

from __future__ import annotations

import pytest

from tests.helpers.process import run_python


@pytest.mark.slow
def test_the_completions_benchmark_runs() -> None:
    proc = run_python(
        "benchmarks/bench_completions.py", "--sizes", "100", "--loops", "asyncio", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "| asyncio | 100 |" in proc.stdout
    # section 2: the real kinds beside the loop's own floor under the same load
    assert "- asyncio: done() " in proc.stdout and ", timer " in proc.stdout
    assert ", all " in proc.stdout  # every handle's lateness together: what the goals are of
    assert "0 listed" in proc.stdout and "0 left" in proc.stdout
