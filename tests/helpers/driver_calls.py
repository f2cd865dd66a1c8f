"""Calls to the CUDA driver through cuda-python's bindings, without aiostream, for the tests of
the stand-in driver itself: a result's checks, a retained primary context, the sleep kernel,
libc's semaphore functions (C functions the driver can call as host functions), a word of
mapped memory for stream memory operations, and the refusals a test provokes on purpose.

These tests check the driver API's documented contract, which a GPU's driver keeps as the
stand-in does: they run on every driver. What differs:

- the stand-in's hook reads (its violation counts, live handles, ...) are extras, where the
  hooks are (``FAKE is not None``);
- a refusal the stand-in counts as a violation: with the hooks, :func:`violations` takes it;
  on a GPU nothing counts it; on the stand-in built without its hooks nothing could take it
  and the process would fail at exit (status 70). A test that provokes one on purpose is
  decorated :func:`provokes_violations`: there it runs in a child process (with the other
  such tests of its module, one child per module) that prints each violation as it happens
  (``FAKE_CUDA_TRACE=1``, its stderr a file it reads back), and the test in the parent passes
  where it passed in the child and the child's exit report counts what its tests took;
- what only the stand-in models (its sleep kernel's time, its exit report, its least
  forgiving reading where the documentation leaves a case open): :func:`stand_in_only`
  skips elsewhere, on either build of the stand-in it runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.helpers.process import ROOT
from tests.helpers.stand_in import FAKE, SLEEP_PTX, on_the_stand_in, take_violations

libc = ctypes.CDLL(None)
libc.sem_post.argtypes = libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

PORTABLE_DEVICEMAP = 1 | 2  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ


def ok(result: tuple[Any, ...]) -> Any:
    """A binding's result whose code must be CUDA_SUCCESS: its value(s)."""
    assert int(result[0]) == 0, result
    return result[1] if len(result) == 2 else result[1:]


def code(result: tuple[Any, ...]) -> int:
    """A binding's result code."""
    return int(result[0])


def devices() -> int:
    """How many CUDA devices the driver has."""
    from cuda.bindings import driver as cu

    return int(ok(cu.cuDeviceGetCount()))


class Context:
    """A device's primary context, retained for a test and pushed on demand."""

    def __init__(self, index: int) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.index = index
        self.ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(index))))
        # the sleep kernel's module, loaded now, before any work: loading a module waits for
        # the device's work (an H100's cuModuleLoadData waited behind a held stream)
        with self:
            self.module: Any = ok(cu.cuModuleLoadData(SLEEP_PTX))

    def __enter__(self) -> Context:
        ok(self.cu.cuCtxPushCurrent(self.ctx))
        return self

    def __exit__(self, *exc: object) -> None:
        ok(self.cu.cuCtxPopCurrent())

    def release(self) -> None:
        if self.module is not None:
            with self:
                ok(self.cu.cuModuleUnload(self.module))
        ok(self.cu.cuDevicePrimaryCtxRelease(ok(self.cu.cuDeviceGet(self.index))))

    def sleep(self, stream: Any, seconds: float) -> int:
        """The sleep kernel on ``stream`` (context pushed by the caller); its result code.

        It sleeps on the stand-in only: on a GPU it is a kernel that returns at once (its PTX
        is ``ret``). Hold work on any driver with a :class:`Word` instead."""
        cu = self.cu
        fn = ok(cu.cuModuleGetFunction(self.module, b"aiostream_sleep"))
        args = ((round(seconds * 1e9),), (ctypes.c_uint64,))
        return code(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, args, 0))


class Word:
    """Pinned host memory mapped for the device (the current context's, portable), ``nbytes``
    long and zeroed: a word for stream memory operations (``width`` 4 or 8 bytes), read and
    written by the host as ``value``; ``hold(stream)`` makes it a gate of a raw stream.

    A word not freed when its test ends is opened by the test's raw context fixture
    (``release_open_words``, before the context goes: the word's memory goes with it): work it
    still held would hold every later test of the process, whose module loads and frees wait
    for all the device's work."""

    opens = 1  #: the value that lets the work it holds go on (a test's own condition: set it)

    def __init__(self, width: int = 4, nbytes: int = 8) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.width = width
        self.host = int(ok(cu.cuMemHostAlloc(nbytes, PORTABLE_DEVICEMAP)))
        ctypes.memset(self.host, 0, nbytes)
        self.address = int(ok(cu.cuMemHostGetDevicePointer(self.host, 0)))
        _open[id(self)] = self

    @property
    def _view(self) -> Any:
        kind = ctypes.c_uint64 if self.width == 8 else ctypes.c_uint32
        return kind.from_address(self.host)

    @property
    def value(self) -> int:
        return int(self._view.value)

    @value.setter
    def value(self, v: int) -> None:
        self._view.value = v

    def hold(self, stream: Any) -> Word:
        """Hold the work submitted to ``stream`` from now on until :meth:`release` (a wait for
        the word to reach 1; context current); the word, for chaining."""
        ok(self.cu.cuStreamWaitValue32(stream, self.address, 1, GEQ))
        return self

    def release(self) -> None:
        self.value = 1

    def free(self) -> None:
        _open.pop(id(self), None)
        ok(self.cu.cuMemFreeHost(self.host))


_open: dict[int, Word] = {}  # the words not freed yet


def release_open_words() -> int:
    """Write each word not freed its opening value (the memory stays: the device may still
    read it), and give the device a moment to pass the waits on them before the caller lets
    the context, and the words' memory with it, go; how many there were."""
    words = list(_open.values())
    _open.clear()
    for word in words:
        word.value = word.opens
    if words:  # (a test failed): a GPU passes them in microseconds, the stand-in in a poll
        time.sleep(0.05)
    return len(words)


class Counter:
    """A host function that is a C function (``sem_post``, launched through the driver's own
    ``cuLaunchHostFunc``, not cuda-python's Python wrapper), and how often it ran."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.sem = ctypes.create_string_buffer(64)
        libc.sem_init(self.sem, 0, 0)
        pfn = ok(cu.cuGetProcAddress(b"cuLaunchHostFunc", 10000, 0))[0]
        self._launch = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
        )(pfn)

    def launch(self, stream: Any) -> int:
        post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
        return int(self._launch(int(stream), post, ctypes.addressof(self.sem)))

    @property
    def runs(self) -> int:
        value = ctypes.c_int()
        libc.sem_getvalue(self.sem, ctypes.byref(value))
        return value.value


class Worker:
    """A thread of its own, with a context current, that runs what it is given in order: a
    capture begun there is that thread's (the tests of stream capture)."""

    def __init__(self, ctx: Context) -> None:
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(ctx.ctx,), daemon=True)
        self.thread.start()

    def _run(self, ctx: Any) -> None:
        from cuda.bindings import driver as cu

        ok(cu.cuCtxPushCurrent(ctx))
        while (job := self.jobs.get()) is not None:
            fn, box = job
            try:
                box.put((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.put((False, exc))
        ok(cu.cuCtxPopCurrent())

    def __call__(self, fn: Callable[[], Any]) -> Any:
        box: queue.Queue[Any] = queue.Queue()
        self.jobs.put((fn, box))
        done, value = box.get(timeout=30)
        if not done:
            raise value
        return value

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(30)


def soon(done: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    """``done()`` comes true within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"waited {seconds} s in vain for {what}"
        time.sleep(0.0005)


# ---------------------------------------------------------------------- which driver


@functools.cache
def bare_stand_in() -> bool:
    """Whether the driver is the stand-in built without its hooks (``--no-hooks``)."""
    return FAKE is None and on_the_stand_in()


def stand_in_only(why: str) -> None:
    """Skip the test (or the rest of it) where the driver is not the stand-in: ``why`` says
    what of the stand-in's own it checks, which no GPU's driver promises."""
    if not on_the_stand_in():
        pytest.skip(f"the stand-in's own model, not the driver API's contract: {why}")


# ---------------------------------------------------------------------- violations

#: set in the child process that runs the tests decorated ``provokes_violations`` on the
#: bare stand-in: the file its stderr goes to (the stand-in's trace of violations), and the
#: file each test's take is appended to
TRACE_ENV = "AIOSTREAM_TESTS_VIOLATION_TRACE"
TAKEN_ENV = "AIOSTREAM_TESTS_VIOLATIONS_TAKEN"
_TRACED = b"fake_cuda: violation: "
_trace_offset = 0


def in_the_child() -> bool:
    return TRACE_ENV in os.environ


def take() -> tuple[int, str]:
    """How many violations the stand-in counted since the last take, and what they say
    (``(0, "")`` on a GPU). Hooks: ``fake_cuda_take_violations``; in the child process on the
    bare stand-in: the violations it traced on its stderr since; elsewhere on the bare stand-in
    nothing can take them (``(0, "")``)."""
    global _trace_offset
    if FAKE is not None:
        return take_violations()
    if not in_the_child():
        return 0, ""
    with open(os.environ[TRACE_ENV], "rb") as trace:
        trace.seek(_trace_offset)
        text = trace.read()
    # a line still being written is read at the next take
    text = text[: text.rfind(b"\n") + 1]
    _trace_offset += len(text)
    seen = [
        line[len(_TRACED) :].decode(errors="replace")
        for line in text.splitlines()
        if line.startswith(_TRACED)
    ]
    with open(os.environ[TAKEN_ENV], "a") as taken:
        taken.write(f"{len(seen)}\n")
    return len(seen), "\n".join(seen)


def violations(n: int, *phrases: str) -> None:
    """The stand-in counted ``n`` violations since the last take, saying each of ``phrases``
    (taken); nothing on a GPU, which counts none. On the bare stand-in outside the child
    process, none is expected (any would fail the process at its exit)."""
    if FAKE is None and not in_the_child():
        if n and bare_stand_in():
            raise AssertionError(
                "a test that provokes violations on the bare stand-in runs in a child process: "
                "decorate it with tests.helpers.driver_calls.provokes_violations"
            )
        return
    got, log = take()
    assert got == n, f"{got} violation(s), {n} expected:\n{log}"
    for phrase in phrases:
        assert phrase in log, log


F = TypeVar("F", bound=Callable[..., Any])
#: the tests decorated ``provokes_violations``, by module file (relative to the checkout)
_PROVOKING: dict[str, list[str]] = {}
_children: dict[str, _Child] = {}


def provokes_violations(test: F) -> F:
    """Decorate a test that makes the driver refuse calls the stand-in counts as violations
    (and takes them with :func:`violations`). On a GPU and on the stand-in with hooks it runs
    as it is; on the stand-in without hooks, where nothing could take them, it runs in a child
    process with the module's other such tests, and passes, fails or skips as it did there
    (see the module's docstring)."""
    path = str(Path(sys.modules[test.__module__].__file__ or "").resolve().relative_to(ROOT))
    _PROVOKING.setdefault(path, []).append(test.__name__)

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not bare_stand_in() or in_the_child():
            return test(*args, **kwargs)
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
        child = _children.get(path) or _children.setdefault(path, _Child(path))
        child.verdict(nodeid)
        return None

    return run  # type: ignore[return-value]


class _Child:
    """The module's tests decorated ``provokes_violations``, run once in a child pytest on the
    bare stand-in: each test's outcome, and the exit report's check."""

    def __init__(self, path: str) -> None:
        ids = [f"{path}::{name}" for name in _PROVOKING[path]]
        with tempfile.TemporaryDirectory() as folder:
            trace, taken, junit = (Path(folder) / n for n in ("stderr", "taken", "junit.xml"))
            taken.write_text("")
            env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKE_CUDA_TRACE": "1"}
            env |= {TRACE_ENV: str(trace), TAKEN_ENV: str(taken)}
            env.pop("PYTEST_CURRENT_TEST", None)
            env.pop("PYTEST_ADDOPTS", None)
            args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "--run-slow"]
            with open(trace, "wb") as stderr:
                self.proc = subprocess.run(
                    [sys.executable, *args, f"--junitxml={junit}", *ids],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    timeout=600,
                    cwd=ROOT,
                    env=env,
                )
            self.stderr = trace.read_bytes().decode(errors="replace")
            self.taken = sum(int(n) for n in taken.read_text().split())
            self.cases: dict[str, Any] = {}
            if junit.exists():
                for case in ElementTree.parse(junit).iter("testcase"):
                    self.cases[case.get("name", "")] = case
        reported = re.search(r"fake_cuda: at exit: (\d+) violation\(s\)", self.stderr)
        self.reported = int(reported.group(1)) if reported else 0

    def _tail(self) -> str:
        lines = [ln for ln in self.stderr.splitlines() if "symbol" not in ln]
        return "\n".join(lines[-40:]) + "\n--- stdout ---\n" + self.proc.stdout[-4000:]

    def verdict(self, nodeid: str) -> None:
        name = nodeid.split("::", 1)[1]
        case = self.cases.get(name)
        if case is None:
            pytest.fail(f"the child process on the bare stand-in ran no {name}:\n{self._tail()}")
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                pytest.fail(
                    f"in the child process on the bare stand-in, {name} had a {kind}: "
                    f"{bad.get('message')}\n{bad.text}",
                    pytrace=False,
                )
        skipped = case.find("skipped")
        if skipped is not None:
            pytest.skip(str(skipped.get("message", "skipped in the child process")))
        # every test of the child passed or skipped: its exit report counts what they took
        if all(c.find("failure") is None and c.find("error") is None for c in self.cases.values()):
            assert self.reported == self.taken, (
                f"the child's exit report counts {self.reported} violation(s), its tests took "
                f"{self.taken}:\n{self._tail()}"
            )
            assert self.proc.returncode == (70 if self.taken else 0), self._tail()
