"""What a person reads in a profile: named streams, readable task names, device time of a
``record_function(..., stream=s)`` range, and a summary whose figures line up."""

from __future__ import annotations

import json
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("task", "label"),
    [
        ("__main__._run_demo.<locals>.run", "_run_demo.run"),
        ("aiostream.loader.DataLoader._produce", "DataLoader._produce"),
        ("tests.test_x.worker", "test_x.worker"),
        ("worker", "worker"),
        ("Task-3", "Task-3"),
        ("a.b", "a.b"),
    ],
)
def test_task_labels_read_as_their_function(
    virtual_device: ais.Device, tmp_path: Path, task: str, label: str
) -> None:
    """A trace's track of host spans is named for their task (anyio names a task by its
    function's qualified name): the last two parts, without ``<locals>``. Outside a loop the
    task is the thread, which here bears the task's name."""

    def step() -> None:
        with ais.record_function("step"):
            pass

    with ais.profile() as prof:
        thread = threading.Thread(target=step, name=task)
        thread.start()
        thread.join(10)
    assert not thread.is_alive(), "the thread's step did not end within 10 s"
    prof.export_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    tracks = [e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 1]
    assert tracks == [label]


def test_a_stream_carries_its_name() -> None:
    s = ais.Stream(name="compute")
    assert s.name == "compute"
    assert repr(s).endswith(" name='compute'>")
    assert ais.Stream().name is None
    with pytest.raises(TypeError, match="name must be a str or None, got 3"):
        ais.Stream(name=3)  # type: ignore[arg-type]


async def _profiled() -> ais.Profiler:
    compute = ais.Stream(name="compute")
    copies = ais.Stream(name="h2d copies")
    with ais.profile() as prof:
        ais.delay(0.002, stream=copies)
        with ais.record_function("model", stream=compute):
            ais.delay(0.003, stream=compute)
        await compute
        await copies
    return prof


async def test_a_device_range_shows_its_device_time(virtual_time: VirtualTime) -> None:
    summary = (await _profiled()).summary()
    assert summary.spans["model (device)"] == (1, 0.003)  # the work on the stream, exactly
    assert summary.spans["model"] == (1, 0.0)  # the host's side: submitting it took no time


async def test_traces_and_timelines_name_the_streams(
    virtual_time: VirtualTime, tmp_path: Path
) -> None:
    prof = await _profiled()
    prof.export_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    streams = {t for t in threads if t.startswith("virtual:0 stream ")}
    assert {t.split(" (")[1] for t in streams} == {"compute)", "h2d copies)"}
    root = ET.fromstring(prof.to_svg())
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert sum(1 for t in labels if t and t.endswith(("(compute)", "(h2d copies)"))) == 2


async def test_a_loaders_copies_are_on_a_stream_named_for_them(
    virtual_time: VirtualTime, tmp_path: Path
) -> None:
    """A DataLoader's host-to-device copies run on a stream of its own, which traces name."""
    with ais.profile() as prof:
        async for _ in ais.DataLoader(np.zeros(4, np.float32) for _ in range(2)):
            pass
        await ais.current_stream().synchronize()
    prof.export_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert [t for t in threads if "(" in t] == ["virtual:0 stream 1 (DataLoader h2d copies)"]


async def test_summary_figures_line_up(virtual_time: VirtualTime) -> None:
    text = str((await _profiled()).summary())
    lines = text.splitlines()
    header = lines[0]
    total_end = header.index("total ms") + len("total ms")
    figures = [line for line in lines[1:] if line and not line.startswith("host/device")]
    assert len(figures) == 3 + 1 + 3  # spans; the compute engine; any engine, host, wall
    for line in figures:  # every total ends in the "total ms" column
        assert line[total_end - 1].isdigit() and line[total_end - 4] == ".", line
        assert len(line) == total_end or line[total_end] == " ", line
    assert lines[-1].startswith("host/device overlap: ")
    assert "overlap efficiency" not in text


async def test_a_stream_gone_before_the_profile_ends_keeps_its_name(
    virtual_time: VirtualTime,
) -> None:
    async def work() -> None:
        s = ais.Stream(name="short-lived")
        ais.delay(0.001, stream=s)
        await s

    with ais.profile() as prof:
        await work()  # the stream is collected before the profile ends
    root = ET.fromstring(prof.to_svg())
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert sum(1 for t in labels if t and t.endswith("(short-lived)")) == 1
