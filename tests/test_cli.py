"""The command line and the examples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import aiostream as ais
from aiostream.__main__ import main

from .conftest import run_python


def test_info_lists_backends_devices_versions_and_loops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("aiostream ")
    assert "anyio: " in out and "cuda-python: " in out
    assert "loops: asyncio" in out and "uvloop" in out and "trio" in out
    assert "virtual  available, 1 device: virtual:0" in out
    assert "cuda     " in out
    assert "default device: " in out


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
    out = captured.out
    assert "pipelined:  12 batches" in out and "sequential: 12 batches" in out
    assert out.count("(checksum ok)") == 2
    assert "overlap efficiency: " in out and "speed-up over sequential: " in out
    assert "stages per item (measured in the sequential run): host " in out
    assert "ms per batch with 2 workers)" in out  # the host stage, shared by the workers
    assert "bottleneck: " in out and "event loop CPU per batch (pipelined run): " in out
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
        (["demo", "--device", "virtual:9"], "does not exist"),
        (["demo", "--device", "gpu"], "not valid"),
        (["demo", "--batches", "0"], "--batches must be > 0"),
        (["demo", "--host-ms", "x"], "--host-ms must be a number"),
        (["demo", "--workers", "3", "--prefetch", "2"], "--prefetch 2 must be >= --workers 3"),
        (["streams", "--tasks", "0"], "--tasks must be > 0"),
        (["streams", "--duration-ms", "-1"], "--duration-ms must be > 0"),
        (["nonsense"], "invalid choice"),
        (["bench", "--loops", "curio"], "'curio' is not one of asyncio, uvloop, trio"),
        (["bench", "--sections", "core,gpu"], "'gpu' is not one of core, scale, loader, cuda"),
    ],
)
def test_bad_arguments_exit_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["info"], ["demo"], ["streams"], ["bench"]])
def test_help_reads_as_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m aiostream")
    for markup in ("``", ":func:", ":class:", ":meth:"):
        assert markup not in out, f"reST markup {markup!r} in --help"


def test_bench_prints_one_table_of_ratios_with_the_machine() -> None:
    proc = run_python(
        "-m", "aiostream", "bench", "--quick", "--sections", "core,loader,cuda", "--loops", "trio"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("aiostream bench (quick): ") and "CPUs; aiostream " in lines[0]
    assert all(f"{dist} " in lines[0] for dist in ("python", "anyio", "numpy", "trio"))
    assert "real time" in proc.stdout
    rows = [line for line in lines if line.startswith("| core:") or line.startswith("| loader:")]
    assert len(rows) == 3 + 2 and all("| trio |" in row for row in rows)
    # one progress line per step (stderr is not a terminal here), and a last one
    assert proc.stderr.count(" steps, ") == 2 + 1 + (1 if ais.is_available("cuda") else 0)
    if not ais.is_available("cuda"):
        assert "not run: cuda: " in proc.stdout


def test_bench_json_is_one_object_for_machines() -> None:
    proc = run_python(
        "-m", "aiostream", "bench", "--quick", "--json", "--sections", "scale", "--loops", "asyncio"
    )
    assert proc.returncode == 0, proc.stderr
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


def test_python_dash_m_entry_point() -> None:
    proc = run_python("-m", "aiostream", "info")
    assert proc.returncode == 0, proc.stderr
    assert "backends:" in proc.stdout


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("examples/loader.py", "32 batches, 8 device buffers allocated"),
        ("examples/overlap_two_streams.py", "8 chunks of 4 MiB copied and computed"),
        ("examples/wait_strategies.py", "default strategy is now 'thread'"),
    ],
)
def test_examples_run(script: str, expected: str) -> None:
    proc = run_python(script)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout


def test_quickstart_example_prints_the_elapsed_time() -> None:
    proc = run_python("examples/quickstart.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(" ms")
    assert 19.5 <= float(proc.stdout.split()[0]) <= 30.0


def test_core_benchmark_smoke_run() -> None:
    """The benchmark script runs end to end (tiny sizes; its figures are not judged here)."""
    proc = run_python("benchmarks/bench_core.py", "--quick", "--loops", "asyncio,trio")
    assert proc.returncode == 0, proc.stderr
    for heading in ("1. await on a complete event", "2. wake lateness", "3. CPU while"):
        assert heading in proc.stdout
    assert proc.stdout.count("ratio") >= 6


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


@pytest.mark.parametrize("script", ["bench_cuda", "bench_torch_loader"])
def test_gpu_benchmarks_say_why_they_skip_without_a_gpu(script: str) -> None:
    ok, reason = ais._backends.probe("cuda")
    if ok:
        pytest.skip("a CUDA device works here: test_fake_driver.py and the GPU run cover it")
    proc = run_python(f"benchmarks/{script}.py", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert f"{script}: skipped, no CUDA device here: {reason}" in proc.stdout


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
    out = capsys.readouterr().out
    assert "profile of the pipelined run:" in out and "overlap (host and device busy" in out
    assert f"wrote the trace (open in https://ui.perfetto.dev or chrome://tracing): {trace}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "B"} >= {
        "transform",
        "model",
        "delay",
        "copy h2d",
    }
    assert svg.read_text().startswith("<svg ")


def test_profiler_benchmark_smoke_run() -> None:
    proc = run_python("benchmarks/bench_profiler.py", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ns") >= 6
