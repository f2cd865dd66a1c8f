#!/usr/bin/env python3
"""Mutation testing of the core modules, with mutmut: how many small changes to the code the
tests catch, per module, and the list of those they miss.

    python tools/mutation.py                      # every module below, in this order
    python tools/mutation.py event stream         # some of them
    python tools/mutation.py aiostream/_backends/cuda/waits.py   # one file, its module's tests
    python tools/mutation.py loader --mutant 'aiostream.data.loader.xǁDataLoaderǁ*'   # some mutants
    python tools/mutation.py --sample 60 --report build/mutation   # 60 per module, at random

Each module runs in a scratch copy of the last commit (``--working-tree``: of the checkout as
it is, edits included; either way the checkout is never touched): mutmut copies
``aiostream/`` with every mutant compiled in beside the original, runs the module's test
files once to learn which tests call each function, then runs each mutant against those
tests only (a function only one test called gets every test that called the module: code
run once per process is called by the first test only), stopping at the first failure. A
mutant is *killed* when a test fails (or the run times out, or crashes); it *survives* when
they all pass, and has *no tests* when none calls its function. The score is killed / all mutants.

Every module runs with the stand-in CUDA driver (tests/fake_cuda/fake_cuda.c, built here
with the C compiler) as ``libcuda.so.1``, two devices (a mutant that names device 0 where
the code names its device passes with one): the CUDA test files and the conformance suite's
``cuda:0`` runs take part, as in CI's fake-driver run, and a session
that leaves a contract violation counted on the stand-in fails (its exit check, which the
mutants' test runs never reach). Without a C compiler only the CUDA module is refused.

The survivors known to be equivalent (no test can kill them) are data, KNOWN below: the
report leaves them out, and lists the survivors to look at and the entries of KNOWN that no
longer match a survivor (stale: the code changed, or a test kills the mutant now).

Needs mutmut 3 (``pip install 'mutmut>=3.8,<4'``; not a dependency of the package). Run it
niced on a shared machine. It prints the score of each module and the survivors to look at,
and with ``--report DIR`` writes them to ``DIR/<module>.txt``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import functools
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Module:
    """What to mutate (globs under the checkout) and the test files that can catch it."""

    mutate: tuple[str, ...]
    tests: tuple[str, ...]


# The test files of each module, as folders or files: its own area, the white-box tests of
# it, the conformance suite (every backend keeps the semantics), and the CUDA tests where its
# code has a CUDA side. Each must pass as it is. The fuzzers of every public call
# (tests/api/test_every_public_name.py, test_bad_input.py) reach every module and are left
# out: each would run for every mutant. So are the slow tests (not collected without
# --run-slow): whole programs in subprocesses, which mutmut does not follow.
_API = (
    "tests/api/test_stream.py",
    "tests/api/test_event.py",
    "tests/api/test_device.py",
    "tests/api/test_await.py",
    "tests/api/test_conformance.py",
    "tests/api/test_backend_protocol.py",
)
_CUDA = ("tests/cuda", "tests/internals/cuda")
MODULES: dict[str, Module] = {
    "_objects": Module(
        ("aiostream/_objects.py",),
        (*_API, "tests/data/test_buffers.py", "tests/virtual", "tests/waiting", "tests/profiler")
        + _CUDA,
    ),
    "event": Module(
        ("aiostream/event.py",),
        (*_API, "tests/virtual", "tests/waiting", "tests/profiler", *_CUDA)
        + ("tests/interop/test_interop_peers.py",),
    ),
    "stream": Module(
        ("aiostream/stream.py",),
        (*_API, "tests/virtual", "tests/waiting", "tests/profiler", *_CUDA)
        + ("tests/interop/test_interop_peers.py",),
    ),
    "buffers": Module(
        ("aiostream/data/buffers.py", "aiostream/data/_dlpack.py"),
        ("tests/data", "tests/internals/data", "tests/api/test_conformance.py", "tests/virtual")
        + ("tests/profiler", "tests/interop/test_dlpack.py", "tests/interop/test_interop_peers.py")
        + _CUDA,
    ),
    "_waiting": Module(
        tuple(f"aiostream/_waiting/{name}.py" for name in ("__init__", "waiters", "loops")),
        ("tests/waiting", "tests/internals/waiting", *_API, "tests/virtual", "tests/profiler")
        + ("tests/data", *_CUDA),
    ),
    "loader": Module(
        ("aiostream/data/loader.py", "aiostream/data/_staging.py"),
        ("tests/data", "tests/internals/data", "tests/profiler/test_profiler_output.py")
        + ("tests/cuda/test_cuda.py", "tests/cuda/test_memory.py")
        + ("tests/cuda/test_close_and_exit.py",),
    ),
    "virtual": Module(
        ("aiostream/_backends/virtual/*.py",),
        ("tests/virtual", "tests/internals/virtual", "tests/internals/api", *_API)
        + ("tests/data/test_buffers.py", "tests/waiting", "tests/internals/waiting")
        + ("tests/profiler", "tests/interop/test_interop_peers.py", "tests/interop/test_dlpack.py"),
    ),
    "cuda": Module(
        ("aiostream/_backends/cuda/*.py",),
        (*_CUDA, "tests/api/test_conformance.py", "tests/api/test_backend_protocol.py")
        + ("tests/internals/api", "tests/interop/test_dlpack.py")
        + ("tests/interop/test_interop_peers.py",),
    ),
}

# Tests whose verdict depends on the machine's load, not on the code: a mutant must not be
# "killed" by them, and the runs that must pass (mutmut's first, instrumented one and the
# clean one) must not fail by them.
DESELECT: tuple[str, ...] = (
    # 5 ms differences in real time
    "tests/cuda/test_cuda.py::test_waits_on_many_streams_complete_in_any_order",
    # 5000 waits within 10 s of real time: not under mutmut's instrumentation on a busy machine
    "tests/cuda/test_scale.py::test_flag_memory_grows_with_pending_waits_and_shrinks_when_idle",
    # check that a race report ends at the test's own line: mutmut's trampolines (a frame of
    # mutmut's between the package's) end it there instead
    "tests/data/test_buffers.py::test_a_race_report_ends_at_the_read",
    "tests/data/test_buffers.py::test_assert_no_races_lists_where",
    "tests/interop/test_dlpack.py::test_reading_an_export_while_a_copy_lands_is_a_race",
)

# Imported once by mutmut's fork server, before it forks a process per mutant. Nothing here
# may start a thread or load the driver (each test session does that, in its own process),
# nor be or import a pytest plugin (anyio, hypothesis, aiostream: pytest could no longer
# rewrite their asserts, and its warning is an error here).
PRELOAD = ("pytest", "trio", "uvloop", "numpy")

# A pytest plugin for the mutants' test runs: the stand-in driver fails its process at exit
# on a contract violation or a leak, but mutmut ends each run with os._exit, so the session
# checks the same counts itself. And a mutant that breaks the import of a test module (code
# that runs at import: the stand-in's probe makes the backend) fails its collection; pytest,
# given that module's tests by name, then finds none of them and says "usage error", which
# mutmut takes for a broken test command: the session ends at the failed collection, saying
# "tests failed".
CHECK_PLUGIN = '''\
"""Fail the session on contract violations the stand-in driver counted, and on collection
errors (see tools/mutation.py)."""

import ctypes
import os

import pytest


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:  # a test module failed to import
        pytest.exit(f"collecting {report.nodeid} failed", pytest.ExitCode.TESTS_FAILED)


def pytest_sessionfinish(session: pytest.Session) -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return  # the driver was never loaded
    if not hasattr(lib, "fake_cuda_violations"):
        return
    lib.fake_cuda_violations.restype = ctypes.c_long
    lib.fake_cuda_take_leaks.restype = ctypes.c_long
    if lib.fake_cuda_violations() or lib.fake_cuda_take_leaks():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
'''

# Functions whose code the tests run in child processes only, past what this process runs of
# them (mutmut sees only the calls made in the test's own process), and the tests (node id
# prefixes) whose children run it: a child inherits the mutant under test.
IN_CHILDREN = {
    # finalizers at exit: a program whose earlier atexit handler reads a buffer's view
    "aiostream._objects.x__finalizer": (
        "tests/cuda/test_close_and_exit.py::test_after_the_close_at_exit",
    ),
    # opening another process's shared memory: the exporter must be another, living process
    "aiostream._backends.cuda.sharing.xǁSharingǁipc_open": (
        "tests/interop/test_interop_peers.py::test_cuda_a_",
        "tests/cuda/test_unseen_work.py::test_a_buffer_opened_after_an_announced_wait",
    ),
    "aiostream._backends.cuda.sharing.xǁSharingǁ_close": (
        "tests/interop/test_interop_peers.py::test_cuda_a_",
    ),
    "aiostream._backends.cuda.backend.xǁCudaBackendǁmemory_from_ipc_handle": (
        "tests/interop/test_interop_peers.py::test_cuda_a_",
        "tests/cuda/test_unseen_work.py::test_a_buffer_opened_after_an_announced_wait",
    ),
    # a watcher with no POSIX semaphores: a program that has none from the start
    "aiostream._backends.cuda.watcher.xǁWatcherǁ_run": (
        "tests/internals/cuda/test_watcher.py::test_without_posix_semaphores",
    ),
    "aiostream._backends.cuda.watcher.xǁWatcherǁ__init__": (
        "tests/internals/cuda/test_watcher.py::test_without_posix_semaphores",
    ),
    # what a program's exit does with work still pending: programs of the tests' own
    "aiostream._backends.cuda.devices.xǁDeviceǁdestroy_stream": (
        "tests/cuda/test_close_and_exit.py::test_exit_",
    ),
    "aiostream._backends.cuda.devices.xǁDeviceǁbusy": (
        "tests/cuda/test_close_and_exit.py::test_exit_",
    ),
    "aiostream._backends.cuda.devices.xǁDeviceǁrelease_all": (
        "tests/cuda/test_close_and_exit.py::test_exit_",
    ),
    "aiostream._backends.cuda.memory.xǁMemoriesǁreap": (
        "tests/cuda/test_close_and_exit.py::test_exit_",
    ),
}

# mutmut, run with two changes: a function that only one test called while mutmut learned
# which tests call what is then given every test that called the module. Code that runs
# once per process (the CUDA backend, its devices and watchers are made on first use and
# kept) is called by the first test to use it only, and that test alone could not kill it.
# And the functions of IN_CHILDREN get the tests whose child processes run them.
MUTMUT = """
import sys

import mutmut.__main__ as main
from mutmut.state import state

collect = main.run_stats_collection
IN_CHILDREN = {IN_CHILDREN}


def run_stats_collection(runner, tests=None):
    collect(runner, tests)
    by_function = state().tests_by_mangled_function_name
    everyone = set().union(*by_function.values())
    for name, tests_of in by_function.items():
        if len(tests_of) == 1:
            by_function[name] = set(everyone)
    # some run in children only: none seen here, and a test that runs all its code in a
    # child calls nothing here, so the tests to pick from are all those that ran
    ran = set(state().duration_by_test)
    for name, prefixes in IN_CHILDREN.items():
        by_function.setdefault(name, set()).update(t for t in ran if t.startswith(prefixes))
    main.save_stats()


main.run_stats_collection = run_stats_collection
sys.argv[0] = "mutmut"
main.cli()
"""

KILLED = {"killed", "timeout", "segfault", "caught by type check"}


@dataclass(frozen=True)
class Known:
    """A survivor known to be equivalent: no program can tell it from the original (it changes
    no result, no exception, no timeline), so no test can kill it.

    ``path`` and ``function`` (``Class.method`` or ``function``) say where; ``code`` is a piece
    of the original code the mutant changes (enough to tell it from other lines of the
    function that take the same change); ``change`` is what the mutant does to it, ``"old ->
    new"`` (only the tokens that differ: ``"False -> None"``, ``"1 -> 2"``, ``"strict = True ->
    "`` for a dropped argument). Spaces and comments do not count, nor line numbers or mutmut's
    numbering, which change with every edit; an entry whose code changed matches nothing and
    the report lists it as stale."""

    path: str
    function: str
    code: str
    change: str
    reason: str
    #: a piece of the lines just above the change, where the function has the same line twice
    above: str = ""


@dataclass(frozen=True)
class Mutant:
    """One mutant of a run: mutmut's name, where, the changed lines before and after (the
    lines of its diff), and its status (mutmut's word: killed, survived, no tests, ...)."""

    name: str
    path: str
    function: str
    line: int
    before: str
    after: str
    status: str
    above: str = ""  # the diff's lines of context above the change


@dataclass(frozen=True)
class Verdict:
    """A run's mutants against KNOWN: the survivors to look at, those explained, and the
    entries that no longer hold (with why)."""

    unexplained: list[Mutant]
    explained: list[tuple[Mutant, Known]]
    stale: list[tuple[Known, str]]


_TOKEN = re.compile(
    r"""[rRbBuUfF]{0,2}(?:"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')"""  # a string
    r"|\d[\w.]*(?:[eE][-+]?\d+)?"  # a number
    r"|\w+"
    r"|\*\*=?|//=?|->|<<=?|>>=?|:=|[-+*/%&|^<>=!@]=|#"
    r"|\S"
)


def tokens(code: str) -> list[str]:
    """The tokens of ``code``, comments dropped."""
    out: list[str] = []
    for text in code.splitlines() or [""]:
        for token in _TOKEN.findall(text):
            if token == "#":
                break
            out.append(token)
    return out


def describe(before: str, after: str) -> str:
    """What a mutant changes, ``"old -> new"``: the tokens between the parts the two share."""
    old, new = tokens(before), tokens(after)
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start]:
        start += 1
    end = 0
    while end < min(len(old), len(new)) - start and old[-1 - end] == new[-1 - end]:
        end += 1
    return f"{' '.join(old[start : len(old) - end])} -> {' '.join(new[start : len(new) - end])}"


def matches(known: Known, mutant: Mutant) -> bool:
    """Whether ``known`` names ``mutant``: the same file and function, and the mutant is the
    original with ``known.change`` made inside ``known.code`` (tokens compared)."""
    if known.path != mutant.path or known.function != mutant.function:
        return False
    if known.above and f" {' '.join(tokens(known.above))} " not in (
        f" {' '.join(tokens(mutant.above))} "
    ):
        return False
    code = tokens(known.code)
    old_side, _, new_side = known.change.partition("->")
    old, new = tokens(old_side), tokens(new_side)
    at = next((i for i in range(len(code) - len(old) + 1) if code[i : i + len(old)] == old), -1)
    if at < 0:
        return False  # the change is not in the code: an entry that can match nothing
    changed = code[:at] + new + code[at + len(old) :]
    before, after = tokens(mutant.before), tokens(mutant.after)
    return any(
        before[i : i + len(code)] == code
        and before[:i] + changed + before[i + len(code) :] == after
        for i in range(len(before) - len(code) + 1)
    )


def subtract(
    mutants: list[Mutant],
    known: tuple[Known, ...] | list[Known],
    paths: set[str] | None = None,
) -> Verdict:
    """Take the known equivalent survivors out of a run's mutants.

    ``mutants`` holds the run's mutants not killed, and every mutant (whatever its status,
    "not checked" included) of each function an entry of ``known`` names; ``paths``, the files
    mutated in the run (by default those of ``mutants``). An entry is stale when its file was
    mutated and it names no mutant (the code changed), or only killed ones (a test kills it
    now: not equivalent after all, or no longer)."""
    unexplained: list[Mutant] = []
    explained: list[tuple[Mutant, Known]] = []
    for mutant in mutants:
        if mutant.status in KILLED or mutant.status in ("not checked", "error"):
            continue
        entry = next((k for k in known if matches(k, mutant)), None)
        if entry is None:
            unexplained.append(mutant)
        else:
            explained.append((mutant, entry))
    if paths is None:
        paths = {m.path for m in mutants}
    stale: list[tuple[Known, str]] = []
    for entry in known:
        if entry.path not in paths:
            continue  # not mutated in this run
        named = [m for m in mutants if matches(entry, m)]
        if not named:
            stale.append((entry, "matches no mutant: the code changed"))
        elif all(m.status in KILLED for m in named):
            stale.append((entry, "killed: " + ", ".join(m.name for m in named)))
    return Verdict(unexplained, explained, stale)


def split_diff(body: list[str]) -> tuple[str, str, str]:
    """The lines a unified diff's hunk removes, those it adds, and its context above them."""
    changed = [i for i, t in enumerate(body) if t.startswith(("-", "+"))]
    first = changed[0] if changed else len(body)
    above = "\n".join(t[1:] for t in body[:first] if t.startswith(" "))
    before = "\n".join(t[1:] for t in body if t.startswith("-"))
    after = "\n".join(t[1:] for t in body if t.startswith("+"))
    return before, after, above


def _k(path: str, function: str, code: str, change: str, reason: str, above: str = "") -> Known:
    return Known(f"aiostream/{path}", function, code, change, reason, above)


# The known equivalent survivors (see Known; docs/mutation-testing.md says when a mutant is
# equivalent). A line whose every mutant is equivalent is marked in the code instead,
# ``# pragma: no mutate (equivalent: <why>)``, and makes no mutant.
_NONE_FLAG = "None for False: read only as a truth value"
_ORDERS = "ops is only compared with its own earlier values: any increase orders alike"
_STRICT = "strict= is a check only: the lengths always agree"
_INF = 'float() reads "inf" in any case'
_W = functools.partial(_k, "_waiting/waiters.py")
# fmt: off
KNOWN: tuple[Known, ...] = (
    _k("event.py", "foreign_event", "True, False, False", "False , False -> True , False",
       "a foreign event never creates its handle, so its blocking flag is never read"),
    _W("Entry.__init__", "self.finished = False", "False -> None", _NONE_FLAG),
    _W("Entry.__init__", "self.dead = False", "False -> None", _NONE_FLAG),
    _W("Waiter.__init__", "self._running = False", "False -> None", _NONE_FLAG),
    _W("Waiter._watch", "self._kicked = False", "False -> None", _NONE_FLAG),
    _W("Waiter._run", "not self._pending and self._registry", "and -> or",
       "both halves always hold when the task ends"),
    _k("data/loader.py", "_Here.__init__", "self._exhausted = False", "False -> None", _NONE_FLAG),
    _k("data/loader.py", "_Iteration.__init__", "self._closed = False", "False -> None",
       _NONE_FLAG),
    _k("data/loader.py", "_Ahead._hand_out", "job.slot is not None and job.result", "and -> or",
       "both are always set for a job done without an error"),
    _k("data/loader.py", "_Iteration.close_after", "_cancelled(error)", "error -> None",
       "where error is the loop's cancellation, it or exc is raised: a cancellation either way, "
       "caught alike"),
    _k("data/_staging.py", "flatten", "strict=True", "True -> False", _STRICT),
    _k("data/_staging.py", "flatten", "strict=True", "True -> None", _STRICT),
    _k("data/_staging.py", "flatten", "strict=True", "strict = True -> ", _STRICT),
    _k("data/_staging.py", "Staging.enqueue", "slot.device, strict=True", "True -> False", _STRICT),
    _k("data/_staging.py", "Staging.enqueue", "slot.device, strict=True", "True -> None", _STRICT),
    _k("data/_staging.py", "Staging.enqueue", "slot.device, strict=True", "strict = True -> ",
       _STRICT),
    _k("data/buffers.py", "from_dlpack", "imported.nbytes", "imported . nbytes -> None",
       "the size of device memory made elsewhere is never read"),
    _k("_backends/virtual/model.py", "Engine.__init__", "self.dirty = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/virtual/simulation.py", "Simulation.__init__", "self.closed = False",
       "False -> None",
       _NONE_FLAG),
    _k("_backends/virtual/simulation.py", "Simulation.wake_hint", "/ 1e9", "1e9 -> 1000000001.0",
       "a wake-up 1 ns per second early only means one more look"),
    _k("_backends/virtual/clock.py", "resolve_clock", "type(value)", "value -> None",
       "readings sent down the slow path get the same result"),
    _k("_backends/virtual/backend.py", "VirtualBackend.event_record", "stream, 0, None", "0 -> 1",
       "a marker's duration is never read"),
    _k("_backends/virtual/backend.py", "VirtualBackend.event_record", "stream, 0, None",
       "0 -> None",
       "a marker's duration is never read"),
    _k("_backends/virtual/backend.py", "VirtualBackend.event_target", "now, 0, None", "0 -> 1",
       "this complete item is never submitted: its duration is never read"),
    _k("_backends/virtual/backend.py", "VirtualBackend.event_target", "now, 0, None", "0 -> None",
       "this complete item is never submitted: its duration is never read"),
    _k("_backends/virtual/backend.py", "VirtualBackend.races", "clear: bool = False",
       "False -> True",
       "the callers that take the default read a backend being discarded"),
    _k("_backends/virtual/scheduler.py", "Scheduler.__init__", "itertools.count(1)", "1 -> 2",
       "sequence numbers only order items among themselves"),
    _k("_backends/virtual/scheduler.py", "Scheduler._reopen", "worst.token += 1", "1 -> 2",
       "any increase makes the item's old completion entries stale"),
    _k("_backends/virtual/memory.py", "Memories.host_alloc", "self.sim.devices[index]",
       "self.sim.devices[index] -> None",
       "host memory's device is never read"),
    _k("_backends/virtual/memory.py", "Memories.opened", "False", "False -> True",
       "only the leak listing reads host, and it never lists an alias", "device,"),
    _k("_backends/virtual/ipc.py", "IpcTable.handle", '"<IQI"', '"<IQI" -> "<iqi"',
       "signed or unsigned, these small values pack the same"),
    _k("_backends/cuda/devices.py", "Device.wait_for", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/devices.py", "Device.release_all", "event.alive = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/devices.py", "Device.release_all", "stream.alive = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/devices.py", "Devices.__init__", "self.closed = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/devices.py", "Device.busy", '"stream"', '"stream" -> "XXstreamXX"',
       "leaves the internal streams out: their work waits on streams busy() asks anyway"),
    _k("_backends/cuda/devices.py", "Device.busy", '"stream"', '"stream" -> "STREAM"',
       "leaves the internal streams out: their work waits on streams busy() asks anyway"),
    _k("_backends/cuda/sharing.py", "Sharing.order", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/sharing.py", "Sharing.wrap", "nbytes, ptr", "nbytes -> None",
       "its size is never read: its releaser settles freeing and export"),
    _k("_backends/cuda/sharing.py", "Sharing.wrap", "device=True", "True -> None",
       "its device flag is never read: its releaser settles freeing and export"),
    _k("_backends/cuda/sharing.py", "Sharing.wrap", "device=True", "True -> False",
       "its device flag is never read: its releaser settles freeing and export"),
    _k("_backends/cuda/memory.py", "Memories.host_alloc", "max(nbytes, 1)", "1 -> 2",
       "the byte more is never read or written"),
    _k("_backends/cuda/memory.py", "Memories.device_alloc", "cuMemAllocAsync(max(nbytes, 1)",
       "1 -> 2",
       "the byte more is never read or written"),
    _k("_backends/cuda/memory.py", "Memories.device_alloc", "dev.pools = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/memory.py", "Memories.device_alloc", "nbytes, int(ptr)", "nbytes -> None",
       "pooled memory's size is never read", '"cuMemAllocAsync"'),
    _k("_backends/cuda/memory.py", "Memories.device_alloc", "device=True", "True -> None",
       "pooled memory's device flag is never read", '"cuMemAllocAsync"'),
    _k("_backends/cuda/memory.py", "Memories.device_alloc", "device=True", "True -> False",
       "pooled memory's device flag is never read", '"cuMemAllocAsync"'),
    _k("_backends/cuda/memory.py", "Memories.device_alloc", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/memory.py", "Memories.use", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/memory.py", "Memories.copy", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/memory.py", "Memories.release", "streams[0].ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/handles.py", "Stream.__init__", "self.ops = 0", "0 -> 1", _ORDERS),
    _k("_backends/cuda/handles.py", "Stream.__init__", "self.doomed = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/handles.py", "Memory.__init__", "self.pooled = False", "False -> None",
       _NONE_FLAG),
    _k("_objects.py", "_finalizer", "finalizer.atexit = False", "False -> None", _NONE_FLAG),
    _k("_backends/cuda/watcher.py", "Target.__init__", "self.complete = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/watcher.py", "Flags.free", "mark.slot, -1", "1 -> 2",
       "a slot is only compared with 0: any negative means none"),
    _k("_backends/cuda/watcher.py", "Watcher.__init__", "self.chase_until = 0.0", "0.0 -> 1.0",
       "monotonic() is long past 1.0"),
    _k("_backends/cuda/watcher.py", "Watcher.__init__", "is not None else 0", "0 -> 1",
       "no semaphore to post without semaphores: sem is never read"),
    _k("_backends/cuda/watcher.py", "Watcher.unhold", 'float("inf") and', '"inf" -> "INF"', _INF),
    _k("_backends/cuda/watcher.py", "Watcher.watch", "self.sleeping_until > now", "> -> >=",
       "at equal times the thread wakes then anyway"),
    _k("_backends/cuda/watcher.py", "Watcher._sweep", "failed = False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/watcher.py", "_plan_sleep", 'float("inf")', '"inf" -> "INF"', _INF),
    _k("_backends/cuda/waits.py", "Waits.event_target", '("event", event.id), 0',
       '"event" -> "XXeventXX"', "an event's lane is apart from every stream's whatever the label"),
    _k("_backends/cuda/waits.py", "Waits.event_target", '("event", event.id), 0',
       '"event" -> "EVENT"', "an event's lane is apart from every stream's whatever the label"),
    _k("_backends/cuda/waits.py", "Waits.event_target", '("event", event.id), 0', "0 -> 1",
       "the waits on an event's lane all take the same seq"),
    _k("_backends/cuda/waits.py", "Waits.event_target", '("event", event.id), 0', "0 -> None",
       "the waits on an event's lane all take the same seq"),
    _k("_backends/cuda/backend.py", "CudaBackend.device_name", "cuDeviceGetName(256",
       "256 -> 257", "the driver's names are far shorter"),
    _k("_backends/cuda/backend.py", "CudaBackend.device_name", 'split(b"\\0", 1)', "1 -> 2",
       "the name has one NUL"),
    _k("_backends/cuda/backend.py", "CudaBackend.device_name", 'split(b"\\0", 1)', "1 -> ",
       "the name has one NUL"),
    _k("_backends/cuda/backend.py", "CudaBackend.device_name", 'split(b"\\0", 1)',
       "split -> rsplit", "the name has one NUL"),
    _k("_backends/cuda/backend.py", "CudaBackend.stream_default", "owned=False", "False -> None",
       _NONE_FLAG),
    _k("_backends/cuda/backend.py", "CudaBackend.stream_native", "stream.private = False",
       "False -> None", _NONE_FLAG),
    _k("_backends/cuda/backend.py", "CudaBackend.delay", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/backend.py", "CudaBackend.wait_blocking", "woken.wait(0.25)",
       "0.25 -> 1.25", "only woken ends the loop"),
    _k("_backends/cuda/backend.py", "CudaBackend.wait_blocking", "woken.wait(0.25)",
       "0.25 -> None", "only woken ends the loop"),
    _k("_backends/cuda/graphs.py", "Capturing.launch", "stream.ops += 1", "1 -> 2", _ORDERS),
    _k("_backends/cuda/wakes.py", "Semaphores.__init__", ".value or 0", "0 -> 1",
       "a libc function's address is never null: the or never runs"),
    _k("_backends/cuda/wakes.py", "Semaphores.new", "c_void_p(sem), 0", "0 -> 1",
       "a process-shared semaphore works the same within one process"),
    _k("_backends/cuda/wakes.py", "Semaphores.new", "c_void_p(sem), 0", "0 -> None",
       "ctypes passes None as 0"),
    _k("_backends/cuda/wakes.py", "Semaphores.new", "0) != 0", "0 -> None",
       "ctypes passes None as 0"),
    _k("_backends/cuda/wakes.py", "driver_launch_host_func", "10000, 0", "0 -> None",
       "the bindings take None as 0"),
    _k("_backends/cuda/wakes.py", "driver_launch_host_func", "10000, 0", "10000 -> 10001",
       "the function has one version, of CUDA 10.0"),
)
# fmt: on


def module_of(arg: str) -> tuple[str, Module]:
    """The module named ``arg``, or the module that owns the file ``arg`` (only it mutated)."""
    if arg in MODULES:
        return arg, MODULES[arg]
    path = Path(arg).resolve()
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else arg
    for name, module in MODULES.items():
        if any(fnmatch.fnmatch(rel, pattern) for pattern in module.mutate):
            return f"{name}:{Path(rel).stem}", Module((rel,), module.tests)
    raise SystemExit(f"{arg}: neither a module ({', '.join(MODULES)}) nor a file of one")


def toml_list(items: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def build_stand_in(workdir: Path) -> Path | None:
    """Build the stand-in driver into ``workdir``; None (and why, on stderr) if it fails."""
    folder = workdir / "fake_cuda"
    folder.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "gcc")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-o", str(folder / "libcuda.so.1")]
    cmd += [str(ROOT / "tests/fake_cuda/fake_cuda.c"), "-lpthread", "-ldl"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"the stand-in driver did not build ({exc}); CUDA tests will skip", file=sys.stderr)
        return None
    return folder


def prepare(workdir: Path, module: Module, args: argparse.Namespace) -> None:
    """A fresh scratch copy of the checkout, configured for ``module``."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    if args.working_tree:
        ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")
        shutil.copytree(ROOT / "aiostream", workdir / "aiostream", ignore=ignore)
        shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    else:  # the last commit: edits in progress in the checkout never reach the measurement
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD", "aiostream", "tests"],
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(workdir, filter="data")
    (workdir / "mutation_checks.py").write_text(CHECK_PLUGIN)
    (workdir / "preload.txt").write_text("\n".join(PRELOAD) + "\n")
    # a hang fails its test after --test-timeout seconds (mutmut's own limit, on the whole
    # run, comes later)
    pytest_args = ["-p", "no:cacheprovider", "-p", "mutation_checks"]
    pytest_args += [f"--timeout={args.test_timeout:g}"]
    for test in DESELECT:
        pytest_args += ["--deselect", test]
    config = (ROOT / "pyproject.toml").read_text()
    config += f"""
[tool.mutmut]
source_paths = ["aiostream"]
only_mutate = {toml_list(module.mutate)}
also_copy = ["mutation_checks.py"]
pytest_add_cli_args_test_selection = {toml_list(module.tests)}
pytest_add_cli_args = {toml_list(pytest_args)}
timeout_multiplier = {args.timeout_multiplier}
timeout_constant = {args.timeout_constant}
process_isolation = "forkserver"
forkserver_warmup = "import"
preload_modules_file = "preload.txt"
use_git_change_detection = false
debug = {"true" if args.debug else "false"}
"""
    (workdir / "pyproject.toml").write_text(config)


def line_of(source: str, function: str, cls: str | None) -> int:
    """The first line (decorators included) of ``cls.function`` or ``function`` in ``source``."""
    tree = ast.parse(source)
    scope: list[ast.stmt] = tree.body
    if cls is not None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                scope = node.body
                break
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return 0


def mutants_of(workdir: Path, files: list[Path]) -> tuple[dict[str, int], list[Mutant]]:
    """Counts per status, and the mutants to weigh against KNOWN (see subtract), from mutmut's
    data."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.format_utils import orig_function_and_class_names_from_key

    counts: dict[str, int] = {}
    mutants: list[Mutant] = []
    cwd = os.getcwd()
    os.chdir(workdir)
    reset_config()
    try:
        for path in files:
            meta = Path("mutants") / f"{path}.meta"
            if not meta.exists():
                continue
            source = path.read_text()
            named = {k.function for k in KNOWN if k.path == path.as_posix()}
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            for name, code in codes.items():
                # mutmut reads a test run that raised (exit status -1) as a timeout: here it is
                # an error of the set-up, never a kill
                status = "error" if code in (-1, 255) else status_by_exit_code[code]
                counts[status] = counts.get(status, 0) + 1
                function, cls = orig_function_and_class_names_from_key(name)
                qualified = f"{cls}.{function}" if cls else function
                if (status in KILLED or status == "not checked") and qualified not in named:
                    continue
                start = line_of(source, function, cls)
                diff = get_diff_for_mutant(name, path=path).splitlines()
                offset, line = 0, start
                for text in diff:
                    if text.startswith("@@"):
                        offset = int(text.split()[1].lstrip("-").split(",")[0])
                    elif text.startswith(("-", "+")) and not text.startswith(("---", "+++")):
                        line = start + offset - 1
                        break
                    elif offset:
                        offset += 1
                body = [t for t in diff if not t.startswith(("---", "+++"))]
                before, after, above = split_diff(body)
                mutants.append(
                    Mutant(name, path.as_posix(), qualified, line, before, after, status, above)
                )
    finally:
        os.chdir(cwd)
        reset_config()
    return counts, mutants


def check_known(workdir: Path) -> int:
    """Match KNOWN against the mutants mutmut makes of the checkout as it is (no test run):
    print the entries that match no mutant or more than one; 1 if any."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.diff_apply import generated_function_names
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name, orig_function_and_class_names_from_key

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / "aiostream").symlink_to(ROOT / "aiostream")
    (workdir / "pyproject.toml").write_text('[tool.mutmut]\nsource_paths = ["aiostream"]\n')
    mutants: list[Mutant] = []
    cwd = os.getcwd()
    os.chdir(workdir)
    reset_config()
    try:
        for name in sorted({k.path for k in KNOWN}):
            path = Path(name)
            named = {k.function for k in KNOWN if k.path == name}
            mutated = mutate_file_contents(name, path.read_text())
            lines = mutated.code.splitlines()
            for method in mutated.mutant_names:
                mutant = get_mutant_name(path, method)
                function, cls = orig_function_and_class_names_from_key(mutant)
                qualified = f"{cls}.{function}" if cls else function
                if qualified not in named:
                    continue
                # the two generated functions, named alike, compared line by line (mutmut's
                # own diff parses the whole mutated file for each mutant)
                texts = []
                for generated in generated_function_names(mutant):
                    span = mutated.line_span_by_function_name[generated]
                    text = "\n".join(lines[span.start - 1 : span.end])
                    texts.append(text.replace(generated, "f").splitlines())
                diff = difflib.unified_diff(*texts, lineterm="")
                body = [t for t in diff if not t.startswith(("---", "+++"))]
                before, after, above = split_diff(body)
                mutants.append(Mutant(mutant, name, qualified, 0, before, after, "survived", above))
    finally:
        os.chdir(cwd)
        reset_config()
    verdict = subtract(mutants, KNOWN, {k.path for k in KNOWN})
    for k, why in verdict.stale:
        print(f"stale: {k.path}  {k.function}: {k.code!r}, {k.change!r}: {why}")
    # one entry per mutant: an entry that names two would explain a survivor nobody weighed
    ambiguous = [(k, n) for k in KNOWN if (n := sum(matches(k, m) for m in mutants)) > 1]
    for k, n in ambiguous:
        print(f"ambiguous: {k.path}  {k.function}: {k.code!r}, {k.change!r}: {n} mutants")
    exact = len(KNOWN) - len(verdict.stale) - len(ambiguous)
    print(f"{exact}/{len(KNOWN)} entries of KNOWN match exactly one mutant")
    return 1 if verdict.stale or ambiguous else 0


def report_lines(verdict: Verdict) -> list[str]:
    """The survivors to look at (status, file:line, mutmut's name, the changed lines), then
    the stale entries of KNOWN."""
    lines: list[str] = []
    for m in verdict.unexplained:
        lines.append(f"{m.status:<9} {m.path}:{m.line}  {m.name}")
        lines.append(f"    {m.function}: {describe(m.before, m.after)!r}")
        lines += [f"    -{t}" for t in m.before.splitlines()]
        lines += [f"    +{t}" for t in m.after.splitlines()]
    for k, why in verdict.stale:
        lines.append(f"stale     {k.path}  {k.function}: {k.code!r}, {k.change!r}: {why}")
    return lines


def mutated_files(workdir: Path, module: Module) -> list[Path]:
    """The files of ``module`` (relative to ``workdir``) that mutmut mutates."""
    return sorted(
        p.relative_to(workdir)
        for pattern in module.mutate
        for p in workdir.glob(pattern)
        if p.is_file()
    )


def sample(workdir: Path, files: list[Path], size: int, seed: int) -> list[str]:
    """``size`` of the mutants of ``files``, drawn at random (the same for the same code and
    seed), by mutmut's names."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    cwd = os.getcwd()
    os.chdir(workdir)
    reset_config()
    try:
        names = [
            get_mutant_name(path, mutant)
            for path in files
            for mutant in mutate_file_contents(str(path), path.read_text()).mutant_names
        ]
    finally:
        os.chdir(cwd)
        reset_config()
    if size >= len(names):
        return names
    return sorted(random.Random(seed).sample(names, size))


def run_module(name: str, module: Module, args: argparse.Namespace, driver: Path | None) -> dict:
    workdir = args.workdir / name.replace(":", "-")
    prepare(workdir, module, args)
    env = dict(os.environ)
    env.pop("AIOSTREAM_DEVICE", None)
    env.pop("PYTHONPATH", None)
    if driver is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(driver), *filter(None, [env.get("LD_LIBRARY_PATH")])]
        )
        env["FAKE_CUDA_DEVICES"] = "2"
    files = mutated_files(workdir, module)
    chosen = list(args.mutant)
    if args.sample and not chosen:
        chosen = sample(workdir, files, args.sample, args.seed)
    shim = MUTMUT.replace("{IN_CHILDREN}", repr(IN_CHILDREN))
    cmd = [sys.executable, "-c", shim, "run", "--max-children", str(args.jobs), *chosen]
    print(f"== {name}: mutating {', '.join(module.mutate)}", flush=True)
    print(f"   tests: {' '.join(Path(t).name for t in module.tests)}", flush=True)
    start = time.monotonic()
    with open(workdir / "mutmut.log", "w") as log:
        rc = subprocess.run(
            cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    seconds = time.monotonic() - start
    counts, mutants = mutants_of(workdir, files)
    verdict = subtract(mutants, KNOWN, {f.as_posix() for f in files})
    lines = report_lines(verdict)
    total = sum(n for status, n in counts.items() if status != "not checked")
    killed = sum(n for status, n in counts.items() if status in KILLED)
    known = len(verdict.explained)
    if counts.get("error"):
        rc = rc or 1  # a test run that raised: the set-up is broken, the score means nothing
    if rc != 0 or total == 0:
        tail = (workdir / "mutmut.log").read_text().replace("\r", "\n").splitlines()[-30:]
        print("\n".join(tail))
        print(f"   mutmut failed (exit status {rc}); its log: {workdir / 'mutmut.log'}")
        if not args.debug:
            print("   (--debug puts the output of mutmut's test runs in that log)")
    score = 100.0 * killed / total if total else 0.0
    detail = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    summary = (
        f"{name}: {killed}/{total} killed ({score:.1f}%) in {seconds / 60:.1f} min [{detail}]; "
        f"{known} known equivalent, {len(verdict.unexplained)} to look at, "
        f"{len(verdict.stale)} stale entries"
    )
    print(f"   {summary}")
    for text in lines:
        print(f"   {text}")
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        header = [
            f"# {summary}",
            f"# mutated: {', '.join(module.mutate)}",
            f"# tests: {' '.join(module.tests)}",
            "# each mutant not killed and not in KNOWN (tools/mutation.py): status, file:line,",
            "# mutmut's name, the change; then the entries of KNOWN that match no survivor",
            "",
        ]
        report = args.report / f"{name.replace(':', '-')}.txt"
        report.write_text("\n".join(header + lines) + "\n")
    return {
        "module": name,
        "killed": killed,
        "known": known,
        "total": total,
        "score": score,
        "seconds": seconds,
        "ok": rc == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"modules ({', '.join(MODULES)}) or files")
    parser.add_argument(
        "--mutant",
        action="append",
        default=[],
        metavar="NAME",
        help="run only these mutants (mutmut names, * allowed); repeatable",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "aiostream-mutation",
        help="scratch copies, one per module (default: %(default)s)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write each module's score and survivors to DIR/<module>.txt",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=0,
        metavar="N",
        help="run N mutants of each module drawn at random, not all of them",
    )
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (0)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (1)")
    parser.add_argument(
        "--timeout-multiplier",
        type=float,
        default=3.0,
        help="a mutant's time limit: (its tests' time + constant) x this (3)",
    )
    parser.add_argument(
        "--timeout-constant",
        type=float,
        default=10.0,
        help="seconds added to a mutant's tests' time before that (10)",
    )
    parser.add_argument(
        "--test-timeout",
        type=float,
        default=30.0,
        help="seconds one test may take before it fails (30; the slowest here take ~5)",
    )
    parser.add_argument(
        "--working-tree",
        action="store_true",
        help="measure the checkout as it is, uncommitted edits included (default: HEAD)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="mutmut writes each test run's command and output to the module's mutmut.log "
        "(to see which test failed when it says 'failed to collect stats')",
    )
    parser.add_argument(
        "--with-tests",
        action="append",
        default=[],
        metavar="FILE",
        help="a test file to add to each module's (to see a survivor killed elsewhere)",
    )
    parser.add_argument(
        "--check-known",
        action="store_true",
        help="only check that each entry of KNOWN matches a mutant of the checkout (no tests run)",
    )
    args = parser.parse_args(argv)
    args.workdir = args.workdir.resolve()
    if args.check_known:
        return check_known(args.workdir / "check-known")
    if args.report is not None:
        args.report = args.report.resolve()
    chosen = [module_of(arg) for arg in args.modules] or list(MODULES.items())
    if args.with_tests:
        more = tuple(args.with_tests)
        chosen = [(name, Module(m.mutate, m.tests + more)) for name, m in chosen]
    driver = build_stand_in(args.workdir)
    if driver is None and any(name.startswith("cuda") for name, _ in chosen):
        print("the CUDA module needs the stand-in driver", file=sys.stderr)
        return 2
    results = [run_module(name, module, args, driver) for name, module in chosen]
    print("\nmodule                          killed/total  known      score   minutes")
    for r in results:
        flag = "" if r["ok"] else "   (mutmut failed: see above)"
        print(
            f"{r['module']:<30}  {r['killed']:>5}/{r['total']:<5}  {r['known']:>5}  "
            f"{r['score']:>7.1f}%  {r['seconds'] / 60:>7.1f}{flag}"
        )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
