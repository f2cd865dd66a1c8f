"""The CLI's insides (``aiostream._bench``, ``aiostream._bench.demo``): how ``bench`` judges a row
against its goal and reports a missed one (its run replaced by a report made here), and the
live progress lines of ``bench`` and ``demo``, which a terminal redraws in place. The commands
themselves run in ``tests/tooling/test_cli.py``."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from aiostream.__main__ import main


def _row(ratio: float, goal: str, ours: float = 1.0, unit: str = "") -> dict[str, object]:
    return {
        "section": "core", "what": "a measure / its baseline", "loop": "asyncio",
        "size": "1,000 waits", "ours": ours, "baseline": 1.0, "ratio": ratio, "unit": unit,
        "goal": goal,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (_row(1.5, "<= 1.5"), True),
        (_row(1.51, "<= 1.5"), False),
        (_row(0.9, ">= 0.90"), True),
        (_row(0.89, ">= 0.90"), False),
        (_row(0.05, "< 0.05"), False),
        (_row(3.0, "<= 2 or < 2 ms", ours=1.9, unit="ms"), True),  # the absolute alternative
        (_row(2.5, "<= 2 or < 2 ms", ours=2.0, unit="ms"), False),
        (_row(1.0, "< 2 KiB", ours=2047.0, unit="B"), True),
        (_row(9.0, "< 2 KiB", ours=2048.0, unit="B"), False),
        (_row(9.0, "-"), None),
    ],
)
def test_bench_goals_are_judged(row: dict[str, object], expected: bool | None) -> None:
    from aiostream._bench import suite

    assert suite.met(row) is expected


def test_bench_marks_a_missed_goal_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiostream._bench import suite

    report = {
        "machine": {
            "platform": "Linux-x86_64", "cpus": 2, "versions": {"aiostream": "0"}, "gpus": [],
            "cuda": "unavailable: none",
        },
        "quick": True, "seconds": 1.0, "clock": "real time", "skipped": [],
        "rows": [_row(0.89, ">= 0.90"), _row(1.2, "<= 1.5"), _row(3.0, "-")],
    }  # fmt: skip
    monkeypatch.setattr(suite, "run", lambda *args: report)
    assert main(["bench", "--loops", "asyncio"]) == 1
    lines = capsys.readouterr().out.splitlines()
    figures = [line for line in lines if line.startswith("  asyncio ")]
    assert [row.split()[-1] for row in figures] == ["MISS", "ok", "-"]
    assert lines[-1] == "1 of 2 goals missed"
    report["rows"] = report["rows"][1:]  # type: ignore[index]
    assert main(["bench", "--loops", "asyncio"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "every goal met"


@pytest.mark.parametrize(("load", "busy"), [(1.5, False), (3.25, True), (None, False)])
def test_the_bench_table_says_the_load_beside_the_cpus_and_when_it_exceeds_them(
    load: float | None,
    busy: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from aiostream._bench import suite

    report = {
        "machine": {
            "platform": "Linux-x86_64", "cpus": 2, "load": load, "versions": {"aiostream": "0"},
            "gpus": [], "cuda": "unavailable: none",
        },
        "quick": True, "seconds": 1.0, "clock": "real time", "skipped": [],
        "rows": [_row(1.6, "<= 1.5")],
    }  # fmt: skip
    monkeypatch.setattr(suite, "run", lambda *args: report)
    assert main(["bench", "--loops", "asyncio"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    said = "2 CPUs" if load is None else f"2 CPUs, load average {load:.2f}"
    assert f"Linux-x86_64, {said}; aiostream 0" in " ".join(lines[:2])
    assert ("this machine was busy: load average 3.25 over its 2 CPUs" in out) == busy
    assert "1 of 1 goals missed" in lines


def test_demo_says_the_load_when_it_exceeds_the_cpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    argv = ["demo", "--device", "virtual:0", "--batches", "2", "--batch-kb", "16"]
    assert main([*argv, "--host-ms", "1", "--compute-ms", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"machine: {os.cpu_count()} CPUs, load average 64.00" in out
    assert f"this machine was busy: load average 64.00 over its {os.cpu_count()} CPUs" in out


def test_the_bench_table_fits_80_columns_with_long_sizes_and_many_gpus() -> None:
    """A size wider than its column (the CUDA rows') goes with its measure; a long list of
    GPUs wraps."""
    from aiostream._bench import suite

    long = dict(_row(0.9, "<= 2"), section="cuda", size="1,000 waits, 100 streams")
    report = {
        "machine": {
            "platform": "Linux-x86_64", "cpus": 16, "versions": {"aiostream": "0"},
            "gpus": ["NVIDIA H200 (143771 MiB, driver 580.159.04)"] * 2, "cuda": "available",
        },
        "quick": False, "seconds": 1.0, "clock": "real time", "skipped": [],
        "rows": [_row(1.2, "<= 1.5"), long],
    }  # fmt: skip
    lines = suite.table(report, 80).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert any(line.endswith("(1,000 waits, 100 streams)") for line in lines), lines
    gpus = lines.index(next(line for line in lines if line.startswith("GPUs: ")))
    assert lines[gpus + 1].startswith("  ")  # wrapped, both named
    assert " ".join(lines[gpus : gpus + 2]).count("NVIDIA H200") == 2


@pytest.mark.parametrize("columns", [40, 60, 80, 200])
def test_a_live_progress_line_never_wraps(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redrawn in place, a line must fit the terminal: a wrapped one leaves stale lines."""
    from aiostream import _bench
    from aiostream._bench import demo

    monkeypatch.setattr("shutil.get_terminal_size", lambda *a: os.terminal_size((columns, 24)))
    seen: list[str] = []
    demo.progress_bar(100, seen.append, live=True)(37)
    bar = _bench.suite.Progress([_bench.suite.Step("core (asyncio)", 1.0, list)] * 3, _Tty())
    bar.show(1)
    for text in [*seen, bar.out.written]:
        assert text.startswith("\r") and text.endswith("\x1b[K")
        assert len(text) - len("\r\x1b[K") <= columns - 1


def test_the_bar_moves_while_a_long_step_runs_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of a minute must not leave the bar still: on a terminal it is redrawn while the
    step runs, each time further on, never past the step's share; not on a pipe."""
    from aiostream import _bench

    monkeypatch.setattr(_bench.suite.Progress, "TICK", 0.02)
    step = _bench.suite.Step("scale (10,000 streams)", 0.4, list)
    tty = _Tty()
    bar = _bench.suite.Progress([step, step], tty)
    with bar.running(0):
        time.sleep(0.5)  # past the step's expected 0.4 s
    frames = [f for f in tty.written.split("\r") if f]
    filled = [f.split("]")[0].count("#") for f in frames]
    assert len(frames) >= 5, frames  # redrawn while the step ran
    assert filled == sorted(filled) and filled[0] < filled[-1], filled
    assert max(filled) <= round(30 * 0.95 * 0.4 / 0.8), filled  # at most its share
    assert bar.done == 0.4  # the step counted once done
    pipe = io.StringIO()
    quiet = _bench.suite.Progress([step, step], pipe)
    with quiet.running(0):
        time.sleep(0.1)
    assert pipe.getvalue().count("\n") == 1  # a line per step, nothing meanwhile


def test_the_progress_ticker_is_not_counted_as_aiostreams_thread() -> None:
    """The cuda step counts the threads named "aiostream ..." as aiostream's own: the bar's
    ticker, running beside it on a terminal, must not be one of them."""
    from aiostream import _bench

    before = _bench.cuda.aiostream_threads()
    step = _bench.suite.Step("cuda (cuda:0)", 1.0, list)
    with _bench.suite.Progress([step], _Tty()).running(0):
        assert any(t.name == "bench progress" for t in threading.enumerate())
        assert _bench.cuda.aiostream_threads() == before


def test_the_memory_steps_weight_is_its_time() -> None:
    """The bar's weight of the memory step (the seconds it is expected to take) is its time
    within a factor of 4 either way, as the other steps' are (--quick: 10,000 waits)."""
    from aiostream._bench import suite

    (step,) = (s for s in suite.steps(["asyncio"], ["scale"], True) if s.label.startswith("mem"))
    started = time.perf_counter()
    step.run()
    took = time.perf_counter() - started
    assert step.seconds / 4 <= took <= step.seconds * 4, (step.seconds, took)


@pytest.mark.parametrize("columns", [60, 80, 200])
def test_the_streams_chart_fits_labels_of_any_width(
    columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 tasks of up to 12 s (in virtual time): task numbers of two digits and times of five,
    every row as long as the others, its bars' edges in the same columns, in the terminal."""
    import aiostream as ais
    from aiostream.__main__ import streams_demo
    from aiostream.testing import run_in_virtual_time

    monkeypatch.setattr("shutil.get_terminal_size", lambda *a: os.terminal_size((columns, 24)))
    out: list[str] = []
    run_in_virtual_time(streams_demo, ais.Device("virtual", 0), 12, 1000.0, out)
    rows = [line for line in out if line.startswith("  task ") and "|" in line]
    assert len(rows) == 12, out
    assert rows[-1].endswith(".. 78000.00 ms"), rows
    assert len({len(row) for row in rows}) == 1, rows
    assert len({(row.index("|"), row.rindex("|")) for row in rows}) == 1, rows
    bar = rows[0].split("|")[1]
    assert len(bar) == max(10, min(50, columns - len(rows[0]) + len(bar))), rows
    assert len(rows[0]) <= columns or len(bar) == 10, rows


class _Tty:
    written = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.written += text

    def flush(self) -> None:
        pass
