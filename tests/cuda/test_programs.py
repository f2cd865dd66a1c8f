"""The CUDA backend in whole programs on the stand-in driver, each in a process of its own:
detection and its reasons, releasing everything at interpreter exit, NVTX where installed.

A process finds its driver when it starts, so each test runs Python in a subprocess whose
``LD_LIBRARY_PATH`` names the stand-in's folder (the ``stand_in_folder`` fixture builds it) or
one without a driver.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import fake_cuda
from tests.helpers.fake_cuda import run_on

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or importlib.util.find_spec("cuda.bindings") is None,
        reason="the stand-in driver is a Linux shared library used through cuda-python",
    ),
]


DETECT = """
import aiostream as ais
print("available", ais.is_available("cuda"))
print("default", ais.device())
try:
    ais.Stream("cuda:0")
except ais.BackendUnavailableError as exc:
    print("refused", exc)
"""


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"FAKE_CUDA_DEVICES": "0"}, "the NVIDIA driver found no CUDA device"),
        ({"FAKE_CUDA_STUB": "1"}, "stub library, not a driver"),
    ],
    ids=["no-device", "stub-driver"],
)
def test_detection_falls_back_to_virtual_and_says_why(
    stand_in_folder: Path, env: dict[str, str], reason: str
) -> None:
    proc = run_on(stand_in_folder, "-c", DETECT, **env)
    assert proc.returncode == 0, proc.stderr
    assert "available False" in proc.stdout
    assert "default virtual:0" in proc.stdout
    assert "refused the 'cuda' backend is unavailable: " in proc.stdout
    assert reason in proc.stdout
    info = run_on(stand_in_folder, "-m", "aiostream", "info", **env)
    assert info.returncode == 0, info.stderr
    said = info.stdout.replace("\n    ", " ")  # the reason as the terminal's width wrapped it
    assert re.search(r"cuda +unavailable: .*" + re.escape(reason), said), info.stdout


def test_a_working_driver_is_the_default_device(stand_in_folder: Path) -> None:
    proc = run_on(stand_in_folder, "-c", DETECT)
    assert proc.returncode == 0, proc.stderr
    assert "available True\ndefault cuda:0\n" in proc.stdout
    info = run_on(stand_in_folder, "-m", "aiostream", "info")
    assert re.search(r"cuda +available, 1 device: cuda:0", info.stdout), info.stdout


def test_no_driver_library_is_reported(tmp_path: Path) -> None:
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library, so its absence cannot be shown")
    proc = run_on(tmp_path, "-c", DETECT)
    assert proc.returncode == 0, proc.stderr
    assert "default virtual:0" in proc.stdout
    assert "no NVIDIA driver library (libcuda.so.1) could be loaded" in proc.stdout


def test_missing_cuda_python_is_reported(stand_in_folder: Path) -> None:
    """A driver library, but no bindings: the reason says which package to install (with no
    driver library either, the driver is what it names: see above)."""
    code = "import sys; sys.modules['cuda.bindings'] = None\n" + DETECT
    proc = run_on(stand_in_folder, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert (
        "cuda-python is not installed" in proc.stdout and "pip install cuda-python" in proc.stdout
    )


AT_EXIT = """
import atexit, ctypes, gc, sys, threading
lib = ctypes.CDLL("libcuda.so.1")
lib.fake_cuda_live.restype = lib.fake_cuda_violations.restype = ctypes.c_long

def report():  # registered first, so it runs last, after aiostream's own clean-up
    live = [lib.fake_cuda_live(kind) for kind in range(6)]
    print("live", live, "violations", lib.fake_cuda_violations(), flush=True)

atexit.register(report)
import anyio
import aiostream as ais

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(0.01, stream=s)
    await s.record_event().synchronize(strategy="thread")
    return s

kept = [anyio.run(main), ais.Event("cuda:0", enable_timing=True),
        ais.HostBuffer(64, device="cuda:0")]
kept[1].record(kept[0])
view = kept[2].numpy()
ais.delay(0.01, stream=kept[0])
dropped = [ais.Stream("cuda:0") for _ in range(5)] + [ais.HostBuffer(64, device="cuda:0")]
worker = threading.Thread(target=lambda: (dropped.clear(), gc.collect()))
worker.start(); worker.join()
# nothing pending at exit: work still pending leaves its context to the exit, by design
# (tests/cuda/test_close_and_exit.py); here every handle must be released
kept[0].synchronize_blocking()
if sys.argv[1] == "dropped":
    del kept[2], view
    gc.collect()
print("ok", flush=True)
"""


@pytest.mark.parametrize("buffer", ["held", "dropped"])
def test_everything_is_released_once_at_interpreter_exit(
    stand_in_folder: Path, buffer: str
) -> None:
    """Each with its context current (the module too), from any thread, and the stand-in's own
    exit report is clean (it fails the process on a violation, leak or live handle). A host
    buffer the program still holds at exit (a view of it, which a later atexit handler may
    read) is not freed: it keeps its context, which the process's end frees."""
    proc = run_on(stand_in_folder, "-c", AT_EXIT, buffer)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout
    # Streams, events, contexts, pinned host buffers, device buffers and modules: every handle
    # released, the contexts last (a handle released after them counts as a violation), and
    # nothing twice.
    live = "0, 0, 1, 1" if buffer == "held" else "0, 0, 0, 0"
    assert f"live [{live}, 0, 0] violations 0" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr


NVTX = """
import sys, types
ranges = []
nvtx = types.ModuleType("nvtx")  # the nvtx package, noting the ranges started and ended
nvtx.start_range = lambda message, domain: ranges.append(("start", domain, message)) or message
nvtx.end_range = lambda range_id: ranges.append(("end", range_id))
sys.modules["nvtx"] = nvtx
import aiostream as ais
ais.Stream("virtual:0")
with ais.record_function("on virtual"):
    pass
print("virtual", ranges)
ais.Stream("cuda:0")
with ais.record_function("on cuda"):
    pass
print("cuda", ranges)
"""


def test_the_cuda_backend_turns_nvtx_on_where_installed(stand_in_folder: Path) -> None:
    """``record_function`` is an NVTX range once a CUDA backend is in use, where the ``nvtx``
    package is installed; not before, on a virtual device alone."""
    proc = run_on(stand_in_folder, "-c", NVTX)
    assert proc.returncode == 0, proc.stderr
    expected = "cuda [('start', 'aiostream', 'on cuda'), ('end', 'on cuda')]\n"
    assert "virtual []\n" + expected in proc.stdout, proc.stdout


#: the stand-in's test hooks, as its source defines them
#: the hooks the stand-in's sources define (its sections are files of their own)
HOOKS = [
    hook
    for part in sorted(fake_cuda.SOURCE.parent.glob("*.c"))
    for hook in re.findall(r"^HOOK \w+ (fake_cuda_\w+)\(", part.read_text(), re.M)
]

AS_ON_A_GPU = """
import ctypes, sys, threading, time
lib = ctypes.CDLL("libcuda.so.1")
print("hooks", sorted(name for name in sys.argv[1].split(",") if hasattr(lib, name)))
from tests.helpers import stand_in
print("driver", stand_in.OK, "stand-in", stand_in.FAKE is not None)
import aiostream as ais
from tests.helpers.gate import gated
s = ais.Stream("cuda:0")
with gated(s) as release:
    ais.delay(0.001, stream=s)
    e = s.record_event()
    time.sleep(0.05)
    print("held", not e.query())
    release()
    e.synchronize_blocking()
print("released", e.query(), flush=True)
from cuda.bindings import driver as cu
threading.Thread(target=lambda: cu.cuStreamCreate(1)).start()  # no context current there
"""


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no-hooks"])
def test_built_without_its_hooks_the_stand_in_is_seen_as_a_gpus_driver(
    stand_in_folder: Path, tmp_path: Path, hooks: bool
) -> None:
    """``build(folder, hooks=False)`` exports the driver API only: the tests see a CUDA
    driver and no stand-in (those that need its hooks skip, as on a GPU), gates hold work
    through the driver API all the same, and the report at exit, no hook, still fails the
    process on a violation."""
    assert len(HOOKS) > 20
    folder = stand_in_folder if hooks else fake_cuda.build(tmp_path, hooks=False)
    proc = run_on(folder, "-c", AS_ON_A_GPU, ",".join(HOOKS))
    assert f"hooks {sorted(HOOKS) if hooks else []}\n" in proc.stdout, proc.stdout + proc.stderr
    assert f"driver True stand-in {hooks}\nheld True\nreleased True\n" in proc.stdout, proc.stdout
    assert proc.returncode == 70, proc.stderr
    assert "fake_cuda: at exit: 1 violation(s)" in proc.stderr, proc.stderr
    assert "cuStreamCreateWithPriority with no current context" in proc.stderr
