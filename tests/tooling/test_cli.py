"""The command line (``python -m aiostream``: info, the demos, bench, usage and help), and the
smoke runs of the benchmarks and the examples. How bench judges its goals and draws its
progress lines is tested inside, in ``tests/internals/api/test_cli_internals.py``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

import pytest

import aiostream as ais
from aiostream.__main__ import main
from tests.helpers import stand_in
from tests.helpers.process import ROOT, run_python


def test_info_lists_backends_devices_versions_and_loops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("aiostream ")
    assert "anyio: " in out and "cuda-bindings: " in out
    try:  # the version of the bindings the backend imports, wherever they came from
        bindings = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        bindings = "not installed"
    assert f"  cuda-bindings: {bindings}\n" in out
    assert "loops: asyncio" in out and "uvloop" in out and "trio" in out
    assert "virtual  available, 1 device: virtual:0" in out
    assert "cuda     " in out
    assert "default device: " in out


@pytest.mark.parametrize(
    "command",
    [
        ["info"],
        ["demo", "--batches", "8", "--host-ms", "1", "--compute-ms", "1"],
        ["streams", "--duration-ms", "5"],
    ],
    ids=["info", "demo", "streams"],
)
@pytest.mark.parametrize("columns", [60, 80, 200])
def test_the_commands_fit_the_terminal(command: list[str], columns: int) -> None:
    """Every line of info, demo and streams fits the terminal's width ($COLUMNS; 80 where
    the output is no terminal), wrapped at spaces; a wide terminal gets the full chart."""
    proc = run_python("-m", "aiostream", *command, COLUMNS=str(columns))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns, "\n".join(lines)
    if command[0] == "streams":
        bars = [line for line in lines if line.startswith("  task 0 stream")]
        bar = bars[0].split("|")[1]
        assert len(bar) == (50 if columns == 200 else columns - 44), bars
    if columns == 200:  # nothing wrapped that fits
        assert not any(line.startswith("    ") and command[0] == "demo" for line in lines)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_streams_demo_runs_on_every_loop(loop: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "streams",
                "--device",
                "virtual:0",
                "--tasks",
                "3",
                "--duration-ms",
                "5",
                "--loop",
                loop,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for i in range(3):
        assert f"task {i}: resumed at" in out
    assert "device timeline on virtual:0" in out
    assert out.count("|") == 6  # one bar per task


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_pipeline_demo_checks_its_results_and_reports(
    loop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "demo",
                "--device",
                "virtual:0",
                "--batches",
                "12",
                "--batch-kb",
                "64",
                "--host-ms",
                "1",
                "--compute-ms",
                "1",
                "--loop",
                loop,
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    out = captured.out.replace("\n  ", " ")  # lines the terminal's width wrapped, joined
    assert "pipelined:  12 batches" in out and "sequential: 12 batches" in out
    assert out.count("(checksum ok)") == 2
    assert "efficiency against the bound: " in out and "speed-up over sequential: " in out
    assert "stages per item (measured in the sequential run): host " in out
    assert "ms per batch with 2 workers)" in out  # the host stage, shared by the workers
    assert "bottleneck: " in out and "event loop CPU per batch (pipelined run): " in out
    assert re.search(r"^machine: \d+ CPUs(, load average [\d.]+)?$", out, re.M), out
    assert "12/12 batches" in captured.err  # the progress bar
    assert (
        main(
            [
                "demo",
                "--device",
                "virtual:0",
                "--batches",
                "4",
                "--batch-kb",
                "16",
                "--workers",
                "1",
                "--loop",
                loop,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prefetch 2, workers 1" in out and "per batch with" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--device", "virtual:x"], "--device virtual:x: device spec 'virtual:x' is not"),
        (["demo", "--device", "gpu"], "not valid"),
        (["demo", "--batches", "0"], "--batches must be > 0"),
        (["demo", "--host-ms", "x"], "--host-ms must be a number"),
        (["demo", "--workers", "3", "--prefetch", "2"], "--prefetch 2 must be >= --workers 3"),
        (["streams", "--tasks", "0"], "--tasks must be > 0"),
        (["streams", "--duration-ms", "-1"], "--duration-ms must be > 0"),
        (["demo", "--host-ms", "inf"], "--host-ms must be at most 60000, got inf"),
        (["demo", "--host-ms", "1e300"], "--host-ms must be at most 60000, got 1e300"),
        (["demo", "--compute-ms", "nan"], "--compute-ms must be > 0, got nan"),
        (["demo", "--batch-kb", "99999999999"], "--batch-kb must be at most 65536"),
        (["demo", "--batch-kb", "1048576"], "--batch-kb must be at most 65536, got 1048576"),
        (["demo", "--batches", "\u0661\u0662"], "--batches must be a number, got '\u0661\u0662'"),
        (["demo", "--host-ms", "\u0661"], "--host-ms must be a number, got '\u0661'"),
        (["streams", "--tasks", "\uff11"], "--tasks must be a number, got '\uff11'"),
        (
            ["streams", "--tasks", "10000"],
            "--tasks 10000 with --duration-ms 40: the device work would take up to 2,000,200 s "
            "(23 days)",
        ),
        (["streams", "--tasks", "200", "--duration-ms", "30"], "up to 603 s (duration x tasks"),
        (["demo", "--prefetch", "100000000000"], "--prefetch must be at most 1024"),
        (["streams", "--duration-ms", "1e300"], "--duration-ms must be at most 60000"),
        (["demo", "--device", "virtual:\u00b2"], "device spec 'virtual:\u00b2' is not valid"),
        (["demo", "--device", "virtual:99999999999"], "devices must be at most 1024"),
        (["demo", "--trace", "/nonexistent/t.json"], "/nonexistent is not a folder this user"),
        (["demo", "--svg", "/nonexistent/t.svg"], "--svg /nonexistent/t.svg: /nonexistent is"),
        (["nonsense"], "invalid choice"),
        (["bench", "--loops", "curio"], "'curio' is not one of asyncio, uvloop, trio"),
        (["bench", "--sections", "core,gpu"], "'gpu' is not one of core, scale, loader, cuda"),
        (["bench", "--loops", ""], "--loops: '' is not one of asyncio, uvloop, trio"),
        (["bench", "--sections", ""], "--sections: '' is not one of core, scale, loader, cuda"),
        (["demo", "--trace", "/"], "--trace /: names a folder; name a file (in it)"),
        (["demo", "--svg", "nosuch/"], "--svg nosuch/: names a folder"),
        (["demo", "--trace", "nosuch/../t.json"], "nosuch/.. is not a folder this user can"),
        (["demo", "--trace", "/proc/t.json"], "--trace /proc/t.json: cannot write it: "),
        (["calibrate", "--out", "/"], "--out /: names a folder"),
    ],
)
def test_bad_arguments_exit_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if argv[0] in ("demo", "streams", "bench"):  # the subcommand's usage, not the top level's
        assert err.startswith(f"usage: python -m aiostream {argv[0]} ")


def test_a_bad_wait_strategy_in_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIOSTREAM_WAIT_STRATEGY", "bogus")
    with pytest.raises(SystemExit) as info:
        main(["demo", "--batches", "2"])
    assert info.value.code == 2
    assert "AIOSTREAM_WAIT_STRATEGY='bogus' is not a wait strategy" in capsys.readouterr().err


def test_a_virtual_device_named_on_the_command_line_is_made(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["streams", "--device", "virtual:2", "--tasks", "2", "--duration-ms", "1"]
    assert main(argv) == 0
    assert "device timeline on virtual:2" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == (
        f"aiostream {ais.__version__} (distribution aiostream-cuda)\n"
    )


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [
        ("/venv/bin/aiostream", "aiostream"),
        ("/src/aiostream/__main__.py", "python -m aiostream"),
        ("", "python -m aiostream"),
    ],
)
def test_usage_names_the_command_the_user_ran(
    argv0: str, prog: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", [argv0])
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: {prog} [-h]")


@pytest.mark.parametrize(
    ("command", "defaults"),
    [
        (["demo"], ["(default 100)", "(default asyncio)", "(default 2)", "$AIOSTREAM_DEVICE"]),
        (["streams"], ["(default 4)", "(default asyncio)", "(default 40)"]),
        (["bench"], ["(default: every installed", "Exit status: 0 when every row"]),
    ],
)
def test_help_shows_the_defaults(
    command: list[str], defaults: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in defaults:
        assert text in out


@pytest.mark.parametrize("command", [[], ["info"], ["demo"], ["streams"], ["bench"], ["calibrate"]])
def test_help_reads_as_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m aiostream")
    for markup in ("``", ":func:", ":class:", ":meth:", "%%"):
        assert markup not in out, f"markup {markup!r} in --help"


def test_calibrate_without_a_driver_gives_no_advice_it_would_refuse(tmp_path: Path) -> None:
    """Where no driver loads, calibrate says so, and not to use virtual:0 (which it refuses:
    a virtual device's figures are the ones it was given)."""
    from tests.helpers.fake_cuda import run_on

    proc = run_on(tmp_path, "-m", "aiostream", "calibrate", timeout=30)  # no driver there
    assert proc.returncode == 2, proc.stderr
    err = " ".join(proc.stderr.split())
    assert "no CUDA device to measure: no NVIDIA driver library" in err
    assert "install the NVIDIA driver" in err and "virtual" not in err.split("error:")[1]


@pytest.mark.slow
def test_bench_prints_one_table_of_ratios_with_the_machine() -> None:
    proc = run_python(
        *("-m", "aiostream", "bench", "--quick", "--sections", "core,loader,cuda"),
        *("--loops", "trio"),
        COLUMNS="80",
    )
    # a goal missed on a loaded machine exits 1 and says so; anything else is a failure
    assert proc.returncode in (0, 1), proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), "the table must fit an 80-column terminal"
    gpus = next(i for i, line in enumerate(lines) if line.startswith("GPUs: "))
    head = " ".join(" ".join(lines[:gpus]).split())  # the wrapped head, joined
    assert head.startswith("aiostream bench (quick): ")
    assert re.search(r" \d+ CPUs(, load average [\d.]+)?; aiostream ", head), head
    assert all(f"{dist} " in head for dist in ("python", "anyio", "numpy", "trio"))
    assert "real time" in proc.stdout
    measures = [i for i, line in enumerate(lines) if line.startswith(("core:", "loader:"))]
    assert len(measures) == 3 + 2
    figures = [lines[i + 1] for i in measures]
    assert all(row.startswith("  trio ") for row in figures)
    misses = sum(row.endswith(" MISS") for row in figures)
    assert sum(row.endswith(" ok") for row in figures) + misses == 5
    assert proc.returncode == (1 if misses else 0)
    verdict = lines.index(f"{misses} of 5 goals missed" if misses else "every goal met")
    busy = " ".join(lines[verdict + 1 :])  # where the load exceeded the CPUs: said last
    assert busy == "" or busy.startswith("this machine was busy: load average "), busy
    # one progress line per step (stderr is not a terminal here), and a last one
    assert proc.stderr.count(" steps, ") == 2 + 1 + (1 if ais.is_available("cuda") else 0)
    if not ais.is_available("cuda"):
        assert "not run: cuda: " in proc.stdout


@pytest.mark.slow
def test_bench_json_is_one_object_for_machines() -> None:
    proc = run_python(
        "-m", "aiostream", "bench", "--quick", "--json", "--sections", "scale", "--loops", "asyncio"
    )
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert report["machine"]["versions"]["aiostream"] == ais.__version__
    sizes = [(r["what"].split(" / ")[0], r["size"]) for r in report["rows"]]
    assert sizes == [
        ("CPU per wait", "1,000 streams"),
        ("wake lateness, median", "1,000 streams"),
        ("CPU per wait", "10,000 streams"),
        ("wake lateness, median", "10,000 streams"),
        ("memory per pending wait", "10,000 waits"),
    ]
    for r in report["rows"]:
        assert r["ours"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"])


@pytest.mark.slow
def test_python_dash_m_entry_point() -> None:
    proc = run_python("-m", "aiostream", "info")
    assert proc.returncode == 0, proc.stderr
    assert "backends:" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "examples/loader.py",
            "32 batches; at most 4 of the loader's 4 slots in use, whose 8 device buffers (an "
            "image and a label per slot) were each allocated once;",
        ),
        ("examples/overlap_two_streams.py", "8 chunks of 4 MiB copied and computed"),
        ("examples/wait_strategies.py", "default strategy is now 'thread'"),
    ],
)
def test_examples_run(script: str, expected: str) -> None:
    proc = run_python(script)
    assert proc.returncode == 0, proc.stderr
    assert expected in " ".join(proc.stdout.split())
    assert all(len(line) <= 100 for line in proc.stdout.splitlines()), proc.stdout


def test_the_quickstart_example_is_the_readmes_quick_start() -> None:
    """README says the file is its quick start: the same code, but for the output line."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quick start\n\n```python\n") + len("## Quick start\n\n```python\n")
    block = readme[start : readme.index("```", start)]
    code = "".join(
        line for line in block.splitlines(keepends=True) if not line.strip().startswith("#>")
    )
    example = (ROOT / "examples/quickstart.py").read_text()
    assert example.split('"""', 2)[2].lstrip("\n") == code


@pytest.mark.slow
def test_quickstart_example_prints_the_elapsed_time() -> None:
    proc = run_python("examples/quickstart.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(" ms")
    # 20 ms of device work, timed by device events; the host submitting the end event late (a
    # loaded machine) only adds to it: the bound catches seconds or microseconds reported
    assert 19.5 <= float(proc.stdout.split()[0]) <= 1000.0


@pytest.mark.slow
def test_core_benchmark_smoke_run() -> None:
    """The benchmark script runs end to end (tiny sizes; its figures are not judged here)."""
    proc = run_python("benchmarks/bench_core.py", "--quick", "--loops", "asyncio,trio")
    assert proc.returncode == 0, proc.stderr
    for heading in ("1. await on a complete event", "2. wake lateness", "3. CPU while"):
        assert heading in proc.stdout
    assert proc.stdout.count("ratio") >= 6
    # each of the 2 loops' 3 rows judged against its goal, and the verdict counted
    assert len(re.findall(r"  (ok|MISS)$", proc.stdout, re.MULTILINE)) == 6, proc.stdout
    assert all(len(line) <= 100 for line in proc.stdout.splitlines()), proc.stdout
    assert re.search(r"^(\d of 6 goals missed|every goal met \(6\))$", proc.stdout, re.M)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a minute idle; child processes, rounds of 10,000 waits, under load
def test_telemetry_benchmark_smoke_run() -> None:
    """The telemetry benchmark runs end to end: off against the revision before the hooks
    (where this clone has it), tracing and metrics on against off; each row judged."""
    proc = run_python("benchmarks/bench_telemetry.py", "--quick", "--rounds", "1", timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1. telemetry off" in out and "2. telemetry on" in out
    off = len(re.findall(r"^(await of complete work|a pending wait) .*(ok|MISS)$", out, re.M))
    assert off == 4 or "is not in this clone's history" in out, out
    assert len(re.findall(r"^(tracing|metrics): .*  (ok|MISS)$", out, re.M)) == 8, out
    assert re.search(r"^\d+ goal\(s\) missed$", out, re.M)


@pytest.mark.slow
def test_import_benchmark_smoke_run() -> None:
    """The import benchmark runs end to end (one interpreter per figure; not judged here)."""
    proc = run_python("benchmarks/bench_import.py", "--runs", "1")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^ +[\d.]+ ms +\(import anyio .* (ok|MISS)$", proc.stdout, re.M)
    stream = r"a stream on virtual:0, a delay awaited +[\d.]+ ms +no numpy +ok"
    assert re.search(stream, proc.stdout)
    assert re.search(r"a HostBuffer's numpy view +[\d.]+ ms +loads numpy +ok", proc.stdout)
    bad = run_python("benchmarks/bench_import.py", "--runs", "0")
    assert bad.returncode == 2 and "--runs must be at least 1" in bad.stderr


@pytest.mark.slow
def test_scale_benchmark_smoke_run(tmp_path: Path) -> None:
    """The scale benchmark runs end to end and draws its curves (small sizes; not judged)."""
    svg = tmp_path / "scaling.svg"
    proc = run_python(
        "benchmarks/bench_scale.py", "--quick", "--loops", "asyncio,trio", "--svg", str(svg)
    )
    assert proc.returncode == 0, proc.stderr
    for heading in ("1. waits, real time", "2. memory per pending wait", "3. the simulator"):
        assert heading in proc.stdout
    try:
        import simpy  # noqa: F401
    except ImportError:  # the comparison says what to install, and ours still runs
        assert "SimPy is not installed" in proc.stdout
        assert proc.stdout.count("us/op") == 2
    else:
        assert proc.stdout.count("us/op") == 4  # two sizes, ours and SimPy's
    assert svg.read_text().startswith("<svg ")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_cuda", "bench_torch_loader"])
def test_gpu_benchmarks_say_why_they_skip_without_a_gpu(script: str) -> None:
    if stand_in.OK:
        pytest.skip("a CUDA device works here: the benchmark runs instead of skipping")
    proc = run_python(f"benchmarks/{script}.py", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert f"{script}: skipped, no CUDA device here: {stand_in.REASON}" in proc.stdout


@pytest.mark.slow
def test_loader_benchmark_smoke_run() -> None:
    """The loader benchmark runs end to end (a few batches; its figures are not judged here)."""
    proc = run_python("benchmarks/bench_loader.py", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" ok\n") == 9 + 8  # real-time rows, virtual-time rows
    # the workers rows: peak buffers in use of the pool, for 1, 2 and 4 workers
    assert len(re.findall(r" 2 ms .* [1-4]/4 [1-6]/6 (?:[1-9]|10)/10\n", proc.stdout)) == 3


def test_demo_writes_a_trace_and_an_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, svg = tmp_path / "out.json", tmp_path / "out.svg"
    assert (
        main(
            [
                "demo",
                "--device",
                "virtual:0",
                "--batches",
                "6",
                "--batch-kb",
                "64",
                "--host-ms",
                "1",
                "--compute-ms",
                "1",
                "--trace",
                str(trace),
                "--svg",
                str(svg),
            ]
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())  # lines the terminal's width wrapped, joined
    assert "profile of the pipelined run:" in out and "host/device overlap: " in out
    assert f"wrote the trace (open in https://ui.perfetto.dev or chrome://tracing): {trace}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "B"} >= {
        "transform",
        "model",
        "delay",
        "copy h2d",
    }
    assert svg.read_text().startswith("<svg ")
    # tracks named for people: the pipeline's task, and what a stream's second lane holds
    tracks = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert "pipelined run" in tracks and not any("_run_demo" in t for t in tracks), tracks
    for track in tracks:
        assert not re.search(r"\) \(\d+\)$", track), track
        if "overlapping spans" in track:
            assert re.fullmatch(r".+, overlapping spans \(\d+\)", track), track


@pytest.mark.slow
def test_profiler_benchmark_smoke_run() -> None:
    proc = run_python("benchmarks/bench_profiler.py", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ns") >= 6


@pytest.mark.slow
def test_graph_benchmark_smoke_run() -> None:
    """bench_graph.py runs end to end (its figures are not judged here)."""
    proc = run_python("benchmarks/bench_graph.py", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["nodes"] for r in report["rows"]] == [1, 10, 100, 1000]
    assert all(r["replay_us"] > 0 and r["one_by_one_us"] > 0 for r in report["rows"])
    assert set(report["goals"]) == {
        "replay of 100 nodes <= 0.2x one by one",
        "await of a replay <= 1.0x a plain await",
        "replay at 10,000 in flight <= 50 us",
    }


def test_a_file_to_write_is_checked_without_touching_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--trace and --svg are opened for appending before any work: a file already there keeps
    its bytes, one made by the check is removed again."""
    kept, new = tmp_path / "kept.json", tmp_path / "new.svg"
    kept.write_text("before")
    argv = ["demo", "--trace", str(kept), "--svg", str(new), "--workers", "3", "--prefetch", "2"]
    with pytest.raises(SystemExit) as info:
        main(argv)  # refused after the files' check: --prefetch below --workers
    assert info.value.code == 2
    assert "--prefetch 2 must be >= --workers 3" in capsys.readouterr().err
    assert kept.read_text() == "before"
    assert not new.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("flag", ["--trace", "--svg"])
def test_a_file_that_cannot_be_written_at_the_end_is_one_line(flag: str) -> None:
    """/dev/full opens, and refuses the bytes: the run says so in one line, exit status 1."""
    proc = run_python(
        *("-m", "aiostream", "demo", "--device", "virtual:0", "--batches", "4"),
        *("--host-ms", "1", "--compute-ms", "1", flag, "/dev/full"),
        COLUMNS="200",
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last == (
        f"python -m aiostream demo: error: {flag} /dev/full: cannot write it: No space left on "
        "device"
    )
    assert "(checksum ok)" in proc.stdout  # the run itself went through


@pytest.mark.parametrize(
    ("argv", "memory", "said"),
    [
        (
            ["--batch-kb", "65536", "--workers", "256", "--prefetch", "1024"],
            16 << 30,
            "--batch-kb 65536 with --prefetch 1024 and --workers 256: the demo would hold up to "
            "5383 buffers of 65536 KiB (336.4 GiB), more than half of this machine's 16.0 GiB",
        ),
        (
            ["--batch-kb", "65536", "--workers", "8"],  # the default prefetch: 2 x workers
            8 << 30,
            "--batch-kb 65536 with --prefetch 16 and --workers 8: the demo would hold up to 95 "
            "buffers of 65536 KiB (5.9 GiB), more than half of this machine's 8.0 GiB",
        ),
        (
            ["--batch-kb", "65536", "--workers", "8"],
            None,
            "(5.9 GiB), more than 4 GiB (this machine does not say how much it has)",
        ),
    ],
)
def test_demo_refuses_buffers_past_the_machines_memory(
    argv: list[str],
    memory: int | None,
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The limits together: prefetch + 2 loader slots and prefetch + 1 outputs (a host and a
    device buffer each), the items in flight and the transforms' arrays, each a batch."""
    import aiostream.__main__ as cli

    monkeypatch.setattr(cli, "_physical_memory", lambda: memory)
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert said in err
    assert err.endswith("lower --batch-kb, --prefetch or --workers")


def test_a_device_out_of_memory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A virtual device of 4 MiB cannot hold the demo's buffers of 1 MiB: one line, exit 1."""
    ais.virtual.reset(memory=4 << 20)
    assert main(["demo", "--batches", "4", "--host-ms", "1", "--compute-ms", "1"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "python -m aiostream demo: error: virtual:0 is out of memory: " in err
    assert err.endswith(
        "(the demo holds up to 29 buffers of 1024 KiB: lower --batch-kb, --prefetch or --workers)"
    )


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="an address-space limit as Linux sets it")
def test_the_host_out_of_memory_is_one_line() -> None:
    """Memory the process cannot have (an address-space limit of 1 GiB, below the 29 batches
    of 64 MiB): one line saying so, exit status 1, no traceback."""
    code = (
        "import resource, runpy, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "sys.argv = ['aiostream', 'demo', '--device', 'virtual:0', '--batch-kb', '65536', "
        "'--batches', '20']\n"
        "runpy.run_module('aiostream', run_name='__main__', alter_sys=True)\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    err = " ".join(proc.stderr.split())
    assert "python -m aiostream demo: error: " in err
    assert err.endswith(
        "(the demo holds up to 29 buffers of 65536 KiB: lower --batch-kb, --prefetch or --workers)"
    )


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["bench", "--quick", "--sections", "core"], "bench: error: "),
        (["calibrate", "--quick"], "calibrate: error: "),
        (["streams", "--tasks", "1"], "streams: error: "),
    ],
)
def test_every_waiting_command_checks_the_wait_strategy_first(
    command: list[str], said: str
) -> None:
    proc = run_python("-m", "aiostream", *command, AIOSTREAM_WAIT_STRATEGY="bogus")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"python -m aiostream {said}AIOSTREAM_WAIT_STRATEGY='bogus' is not a wait strategy; use "
        "one of quiet, hybrid, poll, thread, callback"
    )


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ("virtual:x", "AIOSTREAM_DEVICE=virtual:x: device spec 'virtual:x' is not valid"),
        ("gpu", "AIOSTREAM_DEVICE=gpu: device spec 'gpu' is not valid"),
        ("virtual:99999999999", "AIOSTREAM_DEVICE=virtual:99999999999: "),
    ],
)
def test_a_bad_device_in_the_environment_is_named_as_such(
    env: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIOSTREAM_DEVICE", env)
    with pytest.raises(SystemExit) as info:
        main(["streams", "--tasks", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "--device None" not in err


def test_a_virtual_device_named_in_the_environment_is_made(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As with --device: AIOSTREAM_DEVICE=virtual:3 makes the simulator's fourth device."""
    monkeypatch.setenv("AIOSTREAM_DEVICE", "virtual:3")
    assert main(["streams", "--tasks", "2", "--duration-ms", "1"]) == 0
    assert "device timeline on virtual:3" in capsys.readouterr().out


@pytest.mark.parametrize("columns", [60, 80])
def test_the_streams_chart_lines_up_with_wide_labels(columns: int) -> None:
    """Task numbers of two digits: every row of the chart as long as the others, its bars'
    edges in the same columns, within the terminal."""
    proc = run_python(
        "-m", "aiostream", "streams", "--tasks", "12", "--duration-ms", "1", COLUMNS=str(columns)
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("  task ") and "|" in line]
    assert len(rows) == 12, proc.stdout
    assert len({len(row) for row in rows}) == 1, rows
    assert len({(row.index("|"), row.rindex("|")) for row in rows}) == 1, rows
    assert all(len(row) <= columns and row.endswith(" ms") for row in rows), rows


@pytest.mark.parametrize("columns", [60, 80])
def test_demo_fits_its_profile_and_file_lines(columns: int, tmp_path: Path) -> None:
    """The profile's summary and the "wrote the ..." lines fit the terminal too, but for a word
    longer than a line (a long path), which stays whole."""
    trace, svg = tmp_path / "out.json", tmp_path / "out.svg"
    proc = run_python(
        *("-m", "aiostream", "demo", "--device", "virtual:0", "--batches", "6"),
        *("--host-ms", "1", "--compute-ms", "1", "--trace", str(trace), "--svg", str(svg)),
        COLUMNS=str(columns),
    )
    assert proc.returncode == 0, proc.stderr
    long = [line for line in proc.stdout.splitlines() if len(line) > columns]
    assert all(" " not in line.strip() for line in long), long
    out = " ".join(proc.stdout.split())
    assert f"wrote the trace (open in https://ui.perfetto.dev or chrome://tracing): {trace}" in out
    assert f"wrote the timeline picture: {svg}" in out


def test_calibrate_checks_its_out_file_before_measuring(tmp_path: Path) -> None:
    """A folder given as --out is refused before any CUDA device is looked for."""
    proc = run_python("-m", "aiostream", "calibrate", "--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert f"--out {tmp_path}: names a folder" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_calibrate_says_in_one_line_when_its_profile_cannot_be_written(
    stand_in_folder: Path,
) -> None:
    from tests.helpers.fake_cuda import run_on

    proc = run_on(stand_in_folder, "-m", "aiostream", "calibrate", "--quick", "--out", "/dev/full")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert " ".join(proc.stderr.split()).endswith(
        "calibrate: error: --out /dev/full: cannot write it: No space left on device"
    )


@pytest.mark.timeout(120)
def test_a_profile_in_the_environment_that_is_not_one_is_named_in_one_line(
    tmp_path: Path,
) -> None:
    """info says the virtual backend is unavailable and why; demo, on the default device (no
    driver: virtual:0), is a usage error naming the variable; neither blocks on a FIFO, nor
    ends in a traceback."""
    from tests.helpers.fake_cuda import run_on

    fifo, deep = tmp_path / "fifo.json", tmp_path / "deep.json"
    os.mkfifo(fifo)
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path in (fifo, deep):
        said = f"AIOSTREAM_VIRTUAL_PROFILE: {path}: not a profile"
        env = {"AIOSTREAM_VIRTUAL_PROFILE": str(path), "COLUMNS": "500"}
        info = run_on(tmp_path, "-m", "aiostream", "info", timeout=30, **env)
        assert info.returncode == 0 and "Traceback" not in info.stderr, info.stderr
        assert f"virtual  unavailable: {said}" in info.stdout, info.stdout
        demo = run_on(tmp_path, "-m", "aiostream", "demo", "--batches", "2", timeout=30, **env)
        assert demo.returncode == 2 and "Traceback" not in demo.stderr, demo.stderr
        assert f"demo: error: {said}" in demo.stderr and "--device None" not in demo.stderr
