"""``python -m aiostream calibrate`` on the stand-in driver, whose time model is known (a copy
takes 5 µs + bytes / 10 GB/s whatever its direction, a kernel runs exactly its duration, every
stream runs at once): the profile it writes, the agreement ``--check`` prints, and the usage
errors (exit status 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import aiostream as ais
from tests.helpers.fake_cuda import run_on

pytestmark = pytest.mark.slow  # whole programs, on the stand-in driver


@pytest.fixture(scope="module")
def measured(stand_in_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibrate") / "fake.json"
    proc = run_on(stand_in_folder, "-m", "aiostream", "calibrate", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"written to {out}" in " ".join(proc.stdout.split())
    assert "7/7 steps" in proc.stderr  # the progress bar
    return out


def test_calibrate_writes_the_stand_ins_figures(measured: Path) -> None:
    """The profile names the device and holds the stand-in's own model within what a busy
    machine's timings allow: 10 GB/s copies, no gap between queued kernels, every kernel and
    copy tried at once running at once."""
    profile = ais.virtual.DeviceProfile.load(measured)
    assert profile.name == "aiostream fake GPU 0" and profile.measured_on == "cuda:0"
    assert profile.driver == "13.0"
    for kind in ("h2d_pinned", "d2h_pinned", "d2d"):
        assert 3e9 < profile.value(f"{kind}_bandwidth") < 30e9, kind
    assert profile.value("gap_s") < 100e-6
    # --quick tries up to 16 kernels and 4 copies at once: the stand-in runs them all
    assert profile.value("compute_slots") == 16
    assert profile.value("h2d_slots") == profile.value("d2h_slots") == 4


def test_check_compares_the_device_with_both_virtual_devices(
    measured: Path, stand_in_folder: Path
) -> None:
    """--check: the device's end-to-end time, each virtual device's and its error, the goal's
    verdict, and every operation's start and end on both; exit 0 when met, 1 when missed (on
    a busy machine the stand-in's real-time run may miss it: the figures are what counts)."""
    args = ("-m", "aiostream", "calibrate", "--check", str(measured), "--quick")
    proc = run_on(stand_in_folder, *args, COLUMNS="200")  # whole lines, whatever the terminal
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^  device cuda:0 +[\d.]+ ms$", out, re.M), out
    assert re.search(r"^  virtual, this profile +[\d.]+ ms +[+-][\d.]+% +[\d.]+% of", out, re.M)
    assert re.search(r"^  virtual, default +[\d.]+ ms", out, re.M)
    verdict = re.search(r"^goal \(this profile\): .*: (met|MISS)$", out, re.M)
    assert verdict is not None and (verdict.group(1) == "met") == (proc.returncode == 0)
    assert len(re.findall(r"^  (h2d|kernel|d2d|d2h) \d+ +start", out, re.M)) == 32


def test_calibrate_refuses_what_it_cannot_measure(stand_in_folder: Path, tmp_path: Path) -> None:
    """A virtual device, no CUDA at all, a profile that is not one, a folder that is not
    there: a message that says so, exit status 2, no traceback."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "aiostream-device-profile", "version": 7}))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = [
        (stand_in_folder, ["--device", "virtual:0"], "calibrate measures a CUDA device"),
        (tmp_path, [], "no CUDA device to measure"),  # a folder without a driver
        (stand_in_folder, ["--check", str(bad)], "bad.json: version: 7 is not a version"),
        (stand_in_folder, ["--check", str(tmp_path / "none.json")], "none.json"),
        (stand_in_folder, ["--check", str(deep)], "deep.json: not a profile"),
        (stand_in_folder, ["--out", str(tmp_path / "no" / "p.json")], "is not a folder"),
        (stand_in_folder, ["--device", "cuda:5"], "--device cuda:5"),
    ]
    for folder, args, said in cases:
        proc = run_on(folder, "-m", "aiostream", "calibrate", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert said in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
