"""A virtual device made from a device profile (``python -m aiostream calibrate``'s file):
each copy's latency and bandwidth by direction and host memory, the kernels' launch overhead,
each engine's concurrency; timelines still exact and repeatable. Profiles that are not one are
refused with the file and the field named."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream.testing import run_in_virtual_time
from aiostream.virtual import DeviceProfile, VirtualClock

MiB = 1 << 20

# Figures chosen so that every one shows in a timeline: each copy kind its own speed
FIGURES: dict[str, float] = {
    "h2d_pinned_latency_s": 10e-6,
    "h2d_pinned_bandwidth": 20e9,
    "h2d_pageable_latency_s": 30e-6,
    "h2d_pageable_bandwidth": 5e9,
    "d2h_pinned_latency_s": 12e-6,
    "d2h_pinned_bandwidth": 25e9,
    "d2h_pageable_latency_s": 40e-6,
    "d2h_pageable_bandwidth": 4e9,
    "d2d_latency_s": 2e-6,
    "d2d_bandwidth": 1e12,
    "launch_s": 8e-6,
    "gap_s": 1e-6,
    "compute_slots": 4,
    "h2d_slots": 1,
    "d2h_slots": 2,
    "host_fn_s": 20e-6,
    "event_record_s": 2e-6,
}


def profile_dict(**changes: Any) -> dict[str, Any]:
    figures = {}
    for name, value in FIGURES.items():
        figures[name] = {"value": value, "spread": 0.0}
        if name.endswith("_latency_s"):
            figures[name.replace("latency_s", "fit_error")] = {"value": 0.01, "spread": 0.0}
    data = {
        "format": "aiostream-device-profile",
        "version": 1,
        "device": {
            "name": "Test GPU",
            "driver": "13.0",
            "date": "2026-11-27T00:00:00Z",
            "measured_on": "cuda:0",
        },
        "figures": figures,
    }
    for path, value in changes.items():
        *outer, last = path.split("__")
        target = data
        for key in outer:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
    return data


_DELETE = object()


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(profile_dict()))
    return path


def ms(seconds: float) -> int:
    return round(seconds * 1e9)


def run_ops(clock: VirtualClock) -> dict[str, tuple[int, int]]:
    """Each operation of the timeline: (start, end) in nanoseconds."""
    clock.advance(10.0)
    return {op.name: (ms(op.start), ms(op.end)) for op in ais.virtual.timeline()}


# ---------------------------------------------------------------------- the model


def test_each_copy_takes_its_kinds_latency_and_bandwidth(profile_file: Path) -> None:
    """Host to device and back, from pinned and from pageable memory, and device to device:
    each copy takes ``latency + bytes / bandwidth`` of its own kind."""
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, profile=profile_file)
    dev = ais.DeviceBuffer(MiB)
    other = ais.DeviceBuffer(MiB)
    pinned, pageable = ais.HostBuffer(MiB), ais.HostBuffer(MiB, pinned=False)
    took = {}
    for name, dst, src in (
        ("h2d_pinned", dev, pinned),
        ("h2d_pageable", dev, pageable),
        ("d2h_pinned", pinned, dev),
        ("d2h_pageable", pageable, dev),
        ("d2d", other, dev),
    ):
        s = ais.Stream()
        ais.copy_async(dst, src, stream=s)
        clock.advance(1.0)
        (op,) = [op for op in ais.virtual.timeline() if op.stream == s.stream_id]
        took[name] = ms(op.end - op.start)
    for name, value in took.items():
        expected = FIGURES[f"{name}_latency_s"] + MiB / FIGURES[f"{name}_bandwidth"]
        assert abs(value - expected * 1e9) <= 1, (name, value, expected)
    assert len(set(took.values())) == 5


def test_a_kernel_starts_after_the_launch_overhead_and_queued_ones_after_the_gap(
    profile_file: Path,
) -> None:
    """On an idle stream a kernel starts ``launch_s`` after its submission; behind another,
    ``gap_s`` after that one's end; a kernel submitted late starts at its own launch."""
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, profile=profile_file)
    s = ais.Stream()
    ais.virtual.submit(s, 0.001, name="first")
    ais.virtual.submit(s, 0.001, name="queued")
    clock.advance(0.0105)
    ais.virtual.submit(s, 0.001, name="late")  # the stream idle since 2.017 ms
    ops = run_ops(clock)
    launch, gap = ms(FIGURES["launch_s"]), ms(FIGURES["gap_s"])
    assert ops["first"] == (launch, launch + ms(0.001))
    assert ops["queued"] == (launch + ms(0.001) + gap, launch + ms(0.002) + gap)
    late = ms(0.0105) + launch
    assert ops["late"] == (late, late + ms(0.001))


def test_the_engines_run_as_many_at_once_as_the_profile_says(profile_file: Path) -> None:
    """compute_slots 4: four kernels on four streams run together, the fifth after; one
    host-to-device copy at a time, two device-to-host ones."""
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, profile=profile_file)
    streams = [ais.Stream() for _ in range(5)]
    for i, s in enumerate(streams):
        ais.virtual.submit(s, 0.001, name=f"k{i}")
    ops = run_ops(clock)
    starts = sorted(start for name, (start, _) in ops.items())
    assert starts[:4] == [ms(FIGURES["launch_s"])] * 4
    assert starts[4] > ms(0.001)
    assert ais.virtual.stats is not None
    ais.virtual.reset(clock=(clock := VirtualClock()), profile=profile_file)
    dev = [ais.DeviceBuffer(MiB) for _ in range(3)]
    host = [ais.HostBuffer(MiB) for _ in range(3)]
    for d, h in zip(dev, host, strict=True):
        ais.copy_async(d, h, stream=ais.Stream())
        ais.copy_async(h, d, stream=ais.Stream())
    clock.advance(1.0)
    by_engine: dict[str, list[int]] = {"h2d": [], "d2h": []}
    for op in ais.virtual.timeline():
        by_engine[op.engine].append(ms(op.start))
    assert len(set(by_engine["h2d"])) == 3  # one after another
    assert len(set(by_engine["d2h"])) == 2  # two, then the third


async def pipeline() -> list[tuple[str, int, float, float]]:
    """Copies in, kernels on two streams, copies out, with host work between: the timeline."""
    s_in, s_out, computes = ais.Stream(), ais.Stream(), [ais.Stream(), ais.Stream()]
    dev, host = ais.DeviceBuffer(MiB), ais.HostBuffer(MiB, pinned=False)
    for i in range(6):
        await anyio.sleep(0.0005)
        ais.copy_async(dev, host, stream=s_in)
        c = computes[i % 2]
        c.wait_event(s_in.record_event())
        ais.delay(0.002, stream=c)
        s_out.wait_event(c.record_event())
        ais.copy_async(host, dev, stream=s_out)
    await s_out.synchronize()
    return [(op.name, op.stream, op.start, op.end) for op in ais.virtual.timeline()]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_profiled_timeline_is_exact_and_repeatable(backend: str, profile_file: Path) -> None:
    """One pipeline twice on a profile's virtual device, on each loop: the same timeline to
    the nanosecond, and not the default device's."""
    first = run_in_virtual_time(pipeline, backend=backend, profile=profile_file)
    again = run_in_virtual_time(pipeline, profile=profile_file)
    default = run_in_virtual_time(pipeline, profile=False)
    assert first == again
    assert [op[:2] for op in first] != [op[:2] for op in default] or first != default
    assert max(op[3] for op in first) != max(op[3] for op in default)


# ---------------------------------------------------------------------- choosing a profile


def test_the_environment_names_a_profile_for_every_backend_made_without_one(
    profile_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AIOSTREAM_VIRTUAL_PROFILE: reset() and the backends tests make take it; profile=False
    leaves it out; the device says whose figures it simulates."""
    monkeypatch.setenv("AIOSTREAM_VIRTUAL_PROFILE", str(profile_file))
    ais.virtual.reset(clock=VirtualClock())
    assert "simulated from a profile of Test GPU (driver 13.0, cuda:0" in _name()
    with ais.profile() as prof:
        pass
    assert prof.device_name() == _name()
    ais.virtual.reset(clock=VirtualClock(), profile=False)
    assert _name() == "simulated"
    monkeypatch.setenv("AIOSTREAM_VIRTUAL_PROFILE", str(profile_file.parent / "missing.json"))
    with pytest.raises(ValueError, match="missing.json: not a profile: the file cannot be read"):
        ais.virtual.reset()


def test_options_given_explicitly_win_over_the_environment_s_profile(
    profile_file: Path, monkeypatch: pytest.MonkeyPatch, pytester: pytest.Pytester
) -> None:
    """AIOSTREAM_VIRTUAL_PROFILE is a default: reset() or the marker with an option the
    profile sets gets its own model, without the profile (no "given beside a profile")."""
    from tests.helpers.plugin_runs import run

    monkeypatch.setenv("AIOSTREAM_VIRTUAL_PROFILE", str(profile_file))
    ais.virtual.reset(clock=VirtualClock(), compute_slots=2)
    assert _name() == "simulated"
    ais.virtual.reset(clock=VirtualClock())
    assert "simulated from a profile of Test GPU" in _name()
    result = run(
        pytester,
        """
import aiostream as ais
import pytest

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.aiostream(compute_slots=2)
async def test_two_at_once(virtual_time, anyio_backend):
    streams = [ais.Stream(), ais.Stream()]
    for s in streams:
        ais.delay(1.0, stream=s)
    for s in streams:
        await s
    assert ais.virtual.now() == 1.0  # no launch overhead: not the profile's model
""",
    )
    result.assert_outcomes(passed=2)


def _name() -> str:
    return ais.profile("virtual:0").device_name()


def test_a_profile_and_the_options_it_sets_are_not_both_given(profile_file: Path) -> None:
    with pytest.raises(ValueError, match="bandwidth, compute_slots|compute_slots, bandwidth"):
        ais.virtual.reset(profile=profile_file, compute_slots=2, bandwidth=1e9)
    with pytest.raises(TypeError, match="profile must be a DeviceProfile or a file's path"):
        ais.virtual.reset(profile=3)  # type: ignore[arg-type]
    ais.virtual.reset(profile=DeviceProfile.load(profile_file), memory=1 << 30, devices=2)
    assert ais.device_count("virtual") == 2


def test_a_copy_too_long_for_the_clock_names_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    path.write_text(
        json.dumps(
            profile_dict(
                figures__h2d_pinned_latency_s={"value": 9.19e9},
                figures__h2d_pinned_bandwidth={"value": 1},
            )
        )
    )
    ais.virtual.reset(profile=path)
    with pytest.raises(ValueError, match="h2d copy of 16777216 bytes .* the profile's figures"):
        ais.copy_async(ais.DeviceBuffer(16 * MiB), ais.HostBuffer(16 * MiB))


# ---------------------------------------------------------------------- bad profiles


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"version": 2}, "version: 2 is not a version"),
        ({"format": "other"}, "format: not an aiostream device profile"),
        ({"figures__launch_s": _DELETE}, "figures.launch_s is missing"),
        ({"figures__warp_s": {"value": 1}}, "figures.warp_s is not a figure"),
        ({"figures__gap_s": {"value": -1e-6}}, "figures.gap_s.value must be a finite number"),
        ({"figures__gap_s": {"value": math.inf}}, "figures.gap_s.value must be a finite"),
        ({"figures__gap_s": {"value": math.nan}}, "figures.gap_s.value must be a finite"),
        ({"figures__gap_s": {"value": "1"}}, "figures.gap_s.value must be a number"),
        ({"figures__gap_s": {"value": True}}, "figures.gap_s.value must be a number"),
        ({"figures__gap_s": {"value": 0, "spread": -1}}, "figures.gap_s.spread must be"),
        ({"figures__gap_s": 3}, "figures.gap_s must be an object with a value"),
        ({"figures__compute_slots": {"value": 2.5}}, "figures.compute_slots.value must be a whole"),
        ({"figures__h2d_slots": {"value": 0}}, "figures.h2d_slots.value must be a whole"),
        ({"figures__d2d_bandwidth": {"value": 0.5}}, "figures.d2d_bandwidth.value must be >= 1"),
        ({"device__name": _DELETE}, "device.name must be a non-empty string"),
        ({"device": "GPU"}, "device is missing"),
        ({"figures": []}, "figures is missing"),
        ({"version": True}, "version: True is not a version"),
        ({"figures__launch_s": {"value": 1e300}}, "figures.launch_s.value must be at most 9.2e"),
        ({"figures__gap_s": {"value": 10**400}}, "figures.gap_s.value must be a finite"),
        ({"figures__gap_s": {"value": 0, "spread": 10**400}}, "figures.gap_s.spread must be"),
        ({"figures__compute_slots": {"value": 1e300}}, "figures.compute_slots.value must be a"),
        ({"device__name": "GPU\n\x1b[2J"}, "device.name must be printable text"),
        ({"device__name": "G" * 10_000}, "device.name must be printable text of at most 200"),
    ],
)
def test_a_profile_that_is_not_one_names_the_file_and_the_field(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile_dict(**changes)))
    with pytest.raises(ValueError, match="bad.json: " + field.replace(".", r"\.")):
        ais.virtual.reset(profile=path)
    with pytest.raises(ValueError, match="bad.json"):
        DeviceProfile.load(path)


def test_a_file_that_does_not_parse_says_so(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{figures: 1")
    with pytest.raises(ValueError, match="broken.json: not a profile: the JSON does not parse"):
        ais.virtual.reset(profile=str(path))


def test_a_file_nested_too_deep_is_not_a_profile(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep.json: not a profile: .* \(nested too deep\)"):
        DeviceProfile.load(path)


@pytest.mark.timeout(20)
def test_only_a_regular_file_of_a_profile_s_size_is_read(tmp_path: Path) -> None:
    """A FIFO (which would block the reader forever), a device such as /dev/zero (which
    never ends), a folder, or a file past MAX_BYTES: refused without reading them whole."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MiB + 1))  # a profile holds at most 1 MiB
    for path, said in (
        (fifo, "not a regular file"),
        (Path("/dev/zero"), "not a regular file"),
        (tmp_path, "not a regular file"),
        (big, "over the 1048576"),
    ):
        with pytest.raises(ValueError, match=f"{re.escape(str(path))}: not a profile: .*{said}"):
            ais.virtual.reset(profile=path)


def test_a_profile_is_made_of_figures_or_numbers_and_read_by_name(profile_file: Path) -> None:
    p = DeviceProfile.load(profile_file)
    numbers = {name: figure.value for name, figure in p.figures.items()}
    plain = DeviceProfile(
        name="GPU", driver="1", date="2026", measured_on="cuda:0", figures=numbers
    )
    assert plain.value("launch_s") == FIGURES["launch_s"]
    assert plain.figures["launch_s"].spread == 0.0
    ais.virtual.reset(profile=plain)
    with pytest.raises(ValueError, match="'nope' is not a figure of version 1 profiles"):
        p.value("nope")
    with pytest.raises(ValueError, match=r"figures\.launch_s must be a Figure or a number"):
        DeviceProfile(
            name="GPU", driver="1", date="2026", measured_on="cuda:0", figures={"launch_s": "1"}
        )


def test_a_profile_is_written_to_and_read_from_paths_never_file_descriptors(
    profile_file: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    p = DeviceProfile.load(profile_file)
    for fd in (1, 0):
        with pytest.raises(TypeError, match="path must be a str or an os.PathLike"):
            p.dump(fd)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="path must be a str or an os.PathLike"):
            DeviceProfile.load(fd)  # type: ignore[arg-type]
    print("stdout still open")
    assert "stdout still open" in capfd.readouterr().out


def test_a_written_profile_reads_back_the_same(profile_file: Path, tmp_path: Path) -> None:
    p = DeviceProfile.load(profile_file)
    p.dump(tmp_path / "again.json")
    again = DeviceProfile.load(tmp_path / "again.json")
    assert again.figures == p.figures and again.describe() == p.describe()
    data = json.loads((tmp_path / "again.json").read_text())
    assert data["figures"]["h2d_pinned_bandwidth"]["unit"] == "bytes/s"


def test_the_marker_and_run_in_virtual_time_take_a_profile(
    pytester: pytest.Pytester, profile_file: Path
) -> None:
    """@pytest.mark.aiostream(profile=...) gives the test's virtual device the profile's model,
    under virtual_time exactly: 1 MiB from pageable memory at 5 GB/s after 30 µs."""
    from tests.helpers.plugin_runs import run

    result = run(
        pytester,
        f"""
import aiostream as ais
import pytest

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.aiostream(profile={str(profile_file)!r})
async def test_pageable(virtual_time, anyio_backend):
    dev, host = ais.DeviceBuffer(1 << 20), ais.HostBuffer(1 << 20, pinned=False)
    ais.copy_async(dev, host)
    await ais.current_stream().synchronize()
    assert virtual_time.now() == pytest.approx(30e-6 + (1 << 20) / 5e9, abs=1e-9)
""",
    )
    result.assert_outcomes(passed=2)


def test_the_marker_says_in_one_line_that_the_environment_s_profile_is_not_one(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers.plugin_runs import run

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    monkeypatch.setenv("AIOSTREAM_VIRTUAL_PROFILE", str(deep))
    result = run(pytester, "def test_device(virtual_device):\n    pass\n")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert f"AIOSTREAM_VIRTUAL_PROFILE: {deep}: not a profile" in out
    assert "RecursionError" not in out
