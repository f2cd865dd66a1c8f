"""What ``await ais.wait(handle)`` costs for foreign handles, from 100 to 10,000 pending, against
the two ways programs wait for them today, measured in the same run.

1. Lateness and CPU: N handles that can only be asked (``done()``), completing at random
   moments over a 1 s window, one task per handle awaiting it; lateness is the wake time minus
   the completion time; CPU is the process's CPU time from starting the tasks to the last
   wake, per 1,000 completions. Baselines: (a) a polling task per handle
   (``while not h.done(): await anyio.sleep(POLL_S)``, the 1-10 ms sleeps of serving engines'
   transfer loops) and (b) ``anyio.to_thread.run_sync(h.wait)``, a thread per wait (anyio's
   default limit of 40 threads). Goals: median lateness at most 1 ms, p99 at most 5 ms, at
   most 0.15 CPU-s per 1,000 completions. The floor, for reference: a task per handle
   sleeping on the loop's own timer until its moment (what no waiter can beat).
2. Real kinds, where installed: 1,000 handles, a quarter each of synthetic ``done()`` handles,
   ``concurrent.futures`` futures resolved by a timer thread, gloo ``all_reduce`` work of two
   ranks in this process (the second rank joins each collective at its moment) and Dask futures
   of tasks on an in-process cluster (each ends at its moment); lateness against the moment the
   work was completed (the future resolved, the rank joined, the task returned), and for gloo
   and Dask also against their own done-callback (what aiostream adds), and of all of them
   together, both ways (the goals: median at most 1 ms, p99 at most 5 ms); beside them, 250
   tasks sleeping on the loop's timer until moments of their own: the floor that the same load
   leaves the loop. A Dask task's value (when it returned) is fetched once the run is over:
   ``result()`` in the loop's thread would hold the loop. What the setup made is frozen out of
   the garbage collector's sweeps (``gc.freeze()``, as serving engines do after start-up).
3. Idle: CPU while 1,000 handles that never complete sit pending, over 2 s once the poller
   has reached its idle pace (goal: under 1 % of a core), against the same poller held at its
   busy cap (``CAP_S`` throughout: the pace before the idle one), the polling tasks, and one
   task waking at the idle pace and doing nothing (this machine's floor for that pace).
4. 10,000 waits cancelled: none is listed by ``pending_waits()`` afterwards, and every
   handle is let go once its work is done (a polled handle is kept alive until then): none is
   left 1 s after (ten of the poller's idle paces).

Last, the goals of the run, each met or missed (section 1 at 1,000 handles, where measured;
section 2 from the library's own word; sections 3 and 4); the exit status is 1 when one is
missed: figures from a busy machine, to be read beside the floor rows, not a failure of the code.

Usage: python benchmarks/bench_completions.py [--loops asyncio,uvloop,trio]
       [--sizes 100,1000,10000] [--sections 1234] [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import platform
import random
import statistics
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

import aiostream as ais

WINDOW_S = 1.0  # completions spread over this
INF = float("inf")
POLL_S = 0.005  # the polling baseline's sleep
LET_GO_S = 1.0  # section 4 looks for cancelled waits' handles this long after their work
OPTIONS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


class Handle:
    """Done at ``at`` (monotonic clock); ``wait()`` blocks until then (the thread baseline)."""

    __slots__ = ("__weakref__", "at")

    def __init__(self, at: float) -> None:
        self.at = at

    def done(self) -> bool:
        return time.monotonic() >= self.at

    def wait(self) -> None:
        while self.at == INF:  # not given its moment yet (the run is starting its waits)
            time.sleep(0.001)
        left = self.at - time.monotonic()
        if left > 0:
            time.sleep(left)


def run(loop: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    backend, options = OPTIONS[loop]
    return anyio.run(fn, backend=backend, backend_options=options)


def moments(n: int, start: float, seed: int = 1) -> list[float]:
    """N random moments over the window, which opens just after ``start``."""
    rng = random.Random(seed)
    opens = start + 0.005 + n * 5e-6
    return [opens + rng.random() * WINDOW_S for _ in range(n)]


async def ours(h: Handle) -> None:
    await ais.wait(h)


async def polling(h: Handle) -> None:
    while not h.done():
        await anyio.sleep(POLL_S)


GO: list[anyio.Event] = []  # set once every handle has its moment


async def timer(h: Handle) -> None:
    """The floor: a task sleeping on the loop's own timer until the moment (again, if the
    timer fires early, as uvloop's may)."""
    await GO[0].wait()
    while (left := h.at - time.monotonic()) > 0:
        await anyio.sleep(left)


async def threaded(h: Handle) -> None:
    await anyio.to_thread.run_sync(h.wait)


def lateness_run(loop: str, n: int, method: Callable[[Handle], Awaitable[None]]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        # Every wait begins first, then the handles get their moments: the window measures
        # steady completions, not a poller that backed off while 10,000 tasks started (the
        # first completion after an idle stretch is at most CAP_S late, IDLE_CAP_S after a
        # second of it: see RESULTS.md)
        handles = [Handle(INF) for _ in range(n)]
        late: list[float] = []
        began = 0
        GO[:] = [anyio.Event()]

        async def one(h: Handle) -> None:
            nonlocal began
            began += 1
            await method(h)
            late.append(time.monotonic() - h.at)

        cpu = time.process_time()
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(one, h)
            while began < n:
                await anyio.sleep(0)
            await anyio.sleep(0)
            for h, at in zip(handles, moments(n, time.monotonic()), strict=True):
                h.at = at
            GO[0].set()
        cpu = time.process_time() - cpu
        return summary(late) | {"cpu_per_1000": cpu / n * 1000}

    gc.collect()
    return run(loop, main)


def summary(late: list[float]) -> dict[str, float]:
    late = sorted(late)
    return {
        "median_ms": statistics.median(late) * 1e3,
        "p99_ms": late[min(len(late) - 1, int(len(late) * 0.99))] * 1e3,
    }


def idle_run(
    loop: str, method: Callable[[Handle], Awaitable[None]], n: int = 1000, settle: float = 0.3
) -> float:
    """Percent of a core over 2 s while ``n`` handles that never complete are pending, from
    ``settle`` seconds after their waits began."""

    async def main() -> float:
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(method, Handle(float("inf")))
            await anyio.sleep(settle)  # past the poller's fast first moments
            cpu, wall = time.process_time(), time.monotonic()
            await anyio.sleep(2.0)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            tg.cancel_scope.cancel()
        return cpu / wall * 100

    return run(loop, main)


def idle_ours(loop: str, busy_cap: bool = False) -> float:
    """The poller, from when it has reached its idle pace; with ``busy_cap``, held at
    ``CAP_S`` instead (the pace it had before there was an idle one)."""
    from aiostream.completions import waits

    idle_cap = waits.IDLE_CAP_S
    if busy_cap:
        waits.IDLE_CAP_S = waits.CAP_S
    try:
        return idle_run(loop, ours, settle=waits.IDLE_AFTER_S + 0.2)
    finally:
        waits.IDLE_CAP_S = idle_cap


def idle_floor(loop: str) -> float:
    """Percent of a core of one task waking every ``IDLE_CAP_S`` (the poller's idle pace) and
    doing nothing: this machine's floor for that pace."""
    from aiostream.completions.waits import IDLE_CAP_S

    async def ticking(_: Handle) -> None:
        while True:
            await anyio.sleep(IDLE_CAP_S)

    return idle_run(loop, ticking, n=1)


def cancelled_run(loop: str, n: int = 10_000) -> tuple[int, int, int]:
    """(listed after the cancel, handles kept right after it, handles kept once done: looked
    at ``LET_GO_S`` after, ten of the poller's idle paces, the pace at which it asks them: a
    look two paces after once counted 2,073 of 10,000 on trio in a full run, and none in 14
    runs since, 4 of them after section 2; two paces leave no room for a stalled loop)."""

    async def main() -> tuple[int, int, int]:
        end = time.monotonic() + 2.0
        handles = [Handle(end) for _ in range(n)]
        refs = [weakref.ref(h) for h in handles]
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(ours, h)
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
        del handles, h
        listed = len(ais.pending_waits())
        gc.collect()
        kept = sum(r() is not None for r in refs)
        await anyio.sleep(max(0.0, end - time.monotonic()) + LET_GO_S)
        gc.collect()
        return listed, kept, sum(r() is not None for r in refs)

    return run(loop, main)


def _until(at: float) -> float:
    """A Dask task: it ends at ``at`` (monotonic) and says when it did (its value is fetched
    once the run is over: ``result()`` in the loop's thread would hold the loop)."""
    time.sleep(max(0.0, at - time.monotonic()))
    return time.monotonic()


def real_kinds_run(loop: str, n: int = 1000) -> dict[str, dict[str, float]]:
    """A quarter each of synthetic handles, futures, gloo work and Dask futures; lateness by
    kind, and of as many tasks sleeping on the loop's timer meanwhile (the loop's own floor under
    the same load)."""
    try:
        import datetime

        import torch
        import torch.distributed as dist
    except ImportError:
        torch = None
    try:
        import distributed
    except ImportError:
        distributed = None
    third = n // 4  # (a share of each kind)

    groups: list[Any] = [None, None]
    if torch is not None:
        store = dist.HashStore()

        def make(rank: int) -> None:
            groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

        makers = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        for t in makers:
            t.start()
        for t in makers:
            t.join()

    client = None
    if distributed is not None:  # tasks on 8 threads of one in-process worker, in order
        client = distributed.Client(
            processes=False, n_workers=1, threads_per_worker=8, dashboard_address=None
        )

    async def main() -> dict[str, dict[str, float]]:
        late: dict[str, list[float]] = {
            "done()": [],
            "concurrent.futures": [],
            "gloo": [],
            "dask": [],
            "timer": [],  # tasks sleeping on the loop's timer until moments of their own
        }
        told: dict[str, list[float]] = {"gloo": [], "dask": []}  # after the library said so
        synthetic = [Handle(INF) for _ in range(third)]
        futures = [concurrent.futures.Future() for _ in range(third)]
        gloo = [] if torch is None else [groups[0].allreduce([torch.ones(16)]) for _ in futures]
        # Dask's moments are set as the tasks are submitted: after the other waits have begun
        dask_start = time.monotonic() + 0.5
        dask = (
            []
            if client is None
            else [
                client.submit(_until, at, pure=False)
                for at in sorted(moments(third, dask_start, seed=5))
            ]
        )
        woke: dict[int, float] = {}
        moments_of: dict[str, list[float]] = {}
        done_at: dict[int, float] = {}  # when the work was completed: resolved, or joined
        said_at: dict[int, float] = {}  # when the library said so (its own callback ran)

        def saying(h: Any) -> Callable[[Any], None]:
            def said(_: Any) -> None:
                said_at[id(h)] = time.monotonic()

            return said

        for w in gloo:
            w.get_future().add_done_callback(saying(w))
        for d in dask:
            d.add_done_callback(saying(d))

        def resolver() -> None:
            for at, future in zip(moments_of["futures"], futures, strict=True):
                time.sleep(max(0.0, at - time.monotonic()))
                done_at[id(future)] = time.monotonic()
                future.set_result(None)

        def other_rank() -> None:
            for at, work in zip(moments_of["gloo"], gloo, strict=True):
                time.sleep(max(0.0, at - time.monotonic()))
                done_at[id(work)] = time.monotonic()
                groups[1].allreduce([torch.ones(16)])  # the collective completes on both

        began = 0

        async def sleeper(at: float) -> None:
            await anyio.sleep(max(0.0, at - time.monotonic()))
            late["timer"].append(time.monotonic() - at)

        async def one(kind: str, h: Any) -> None:
            nonlocal began
            began += 1
            await ais.wait(h)
            now = time.monotonic()
            if kind == "dask":
                woke[id(h)] = now  # its lateness once the run is over
            else:
                late[kind].append(now - (h.at if kind == "done()" else done_at[id(h)]))
            if kind in ("gloo", "dask"):
                await anyio.sleep(0.01)  # its own callback may run after the wait's hop
                said = said_at.get(id(h))
                if said is not None:  # else its callback was later still: counted as unsaid
                    told[kind].append(now - said)

        async with anyio.create_task_group() as tg:
            for h in synthetic:
                tg.start_soon(one, "done()", h)
            for f in futures:
                tg.start_soon(one, "concurrent.futures", f)
            for w in gloo:
                tg.start_soon(one, "gloo", w)
            for d in dask:
                tg.start_soon(one, "dask", d)
            while began < len(synthetic) + len(futures) + len(gloo) + len(dask):
                await anyio.sleep(0)
            start = time.monotonic()
            for h, at in zip(synthetic, moments(third, start, seed=2), strict=True):
                h.at = at
            moments_of["futures"] = sorted(moments(third, start, seed=3))
            moments_of["gloo"] = sorted(moments(third, start, seed=4))
            for at in moments(third, start, seed=6):  # the floor, under the same load
                tg.start_soon(sleeper, at)
            threads = [threading.Thread(target=resolver)]
            if gloo:
                threads.append(threading.Thread(target=other_rank))
            for t in threads:
                t.start()
        for t in threads:
            t.join()
        if dask:  # when each task returned
            returned = await anyio.to_thread.run_sync(client.gather, dask)
            late["dask"] = [woke[id(d)] - at for d, at in zip(dask, returned, strict=True)]
        every = [x for kind, values in late.items() if kind != "timer" for x in values]
        # what aiostream adds: gloo's and Dask's from their own callbacks
        share = late["done()"] + late["concurrent.futures"] + told["gloo"] + told["dask"]
        return (
            {kind: summary(values) for kind, values in late.items() if values}
            | {f"all {len(every):,}": summary(every)}
            | {f"all {len(share):,} after the library said so": summary(share)}
            | {
                f"{kind} after its own callback": summary(values)
                for kind, values in told.items()
                if values
            }
        )

    # What the setup made (PyTorch's, Dask's) is kept out of the collector's sweeps, as serving
    # engines do after start-up (gc.freeze()): full collections during the setup took 25-114
    # ms each (seen through gc.callbacks), growing with the heap; one in the window would hold
    # the loop as long
    gc.collect()
    gc.freeze()
    try:
        return run(loop, main)
    finally:
        gc.unfreeze()
        if client is not None:
            client.close()


GOALS_MS = (1.0, 5.0)  # median and p99 lateness, at most
GOAL_CPU = 0.15  # CPU-s per 1,000 completions, at most (section 1, at 1,000 handles)
GOAL_IDLE = 1.0  # % of a core while 1,000 handles pend, under


class Goals:
    """The goals a run measured, each met or missed, printed last."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, bool]] = []

    def judge(self, name: str, said: str, met: bool) -> None:
        self.rows.append((name, said, met))

    def at_most(self, name: str, value: float, goal: float, unit: str) -> None:
        self.judge(name, f"{value:.3g} {unit} (at most {goal:g})", value <= goal)

    def lateness(self, name: str, figures: dict[str, float]) -> None:
        self.at_most(f"{name}, median", figures["median_ms"], GOALS_MS[0], "ms")
        self.at_most(f"{name}, p99", figures["p99_ms"], GOALS_MS[1], "ms")

    def print(self) -> int:
        """Print the verdicts; return the exit status (1: a goal missed)."""
        if not self.rows:
            return 0
        print("\ngoals")
        for name, said, met in self.rows:
            print(f"goal {name}: {said}: {'met' if met else 'MISS'}")
        misses = sum(not met for _, _, met in self.rows)
        print(f"{misses} of {len(self.rows)} goals missed" if misses else "all goals met")
        return 1 if misses else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--sections", default="1234", help="which sections, such as 12")
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 handles only")
    args = parser.parse_args()
    loops = args.loops.split(",")
    unknown = [loop for loop in loops if loop not in OPTIONS]
    if unknown:
        parser.error(
            f"--loops: no loop named {', '.join(unknown)}; choose from {', '.join(OPTIONS)}"
        )
    if not args.sections or set(args.sections) - set("1234"):
        parser.error(f"--sections takes digits 1 to 4, such as 12, not {args.sections!r}")
    sizes = [100, 1000] if args.quick else [int(s) for s in args.sizes.split(",")]
    goals = Goals()
    print(f"# {platform.python_implementation()} {platform.python_version()}, {time.ctime()}")
    if "1" in args.sections:
        print("\n1. lateness (ms) and CPU-s per 1,000 completions, completions over 1 s")
        print(
            "| loop | N | ours median | p99 | CPU | timer median | p99 | CPU "
            "| poll task median | p99 | CPU | to_thread median | p99 | CPU |"
        )
        print("|---|---|" + "---|" * 12)
        for loop in loops:
            for n in sizes:
                row = [loop, f"{n:,}"]
                for method in (ours, timer, polling, threaded):
                    r = lateness_run(loop, n, method)
                    row += [
                        f"{r['median_ms']:.2f}",
                        f"{r['p99_ms']:.2f}",
                        f"{r['cpu_per_1000']:.3f}",
                    ]
                    if method is ours and n == 1000:
                        goals.lateness(f"{loop}, 1,000 done() handles", r)
                        goals.at_most(
                            f"{loop}, 1,000 done() handles, CPU per 1,000 completions",
                            r["cpu_per_1000"],
                            GOAL_CPU,
                            "CPU-s",
                        )
                print("| " + " | ".join(row) + " |", flush=True)
    if "2" in args.sections:
        print(
            "\n2. real kinds, 1,000 handles (a quarter each): lateness median / p99 (ms); timer: "
            "250 tasks sleeping until moments of their own meanwhile, the loop's floor"
        )
        for loop in loops:
            by_kind = real_kinds_run(loop)
            cells = ", ".join(
                f"{k} {v['median_ms']:.2f} / {v['p99_ms']:.2f}" for k, v in by_kind.items()
            )
            print(f"- {loop}: {cells}", flush=True)
            share = [k for k in by_kind if k.endswith("after the library said so")]
            for key in share:  # what aiostream adds (gloo's and Dask's own delivery apart)
                goals.lateness(f"{loop}, real kinds, {key}", by_kind[key])
    if "3" in args.sections:
        print(
            "\n3. % of a core while 1,000 never-done handles pend, over 2 s (ours at its idle "
            "pace, ours held at its busy cap, polling tasks; the floor: one task waking at the "
            "idle pace)"
        )
        for loop in loops:
            idle = [
                idle_ours(loop),
                idle_ours(loop, busy_cap=True),
                idle_run(loop, polling),
                idle_floor(loop),
            ]
            print(f"- {loop}: " + ", ".join(f"{c:.2f} %" for c in idle), flush=True)
            goals.judge(
                f"{loop}, 1,000 handles pending, % of a core",
                f"{idle[0]:.2f} % (under {GOAL_IDLE:g})",
                idle[0] < GOAL_IDLE,
            )
    if "4" in args.sections:
        print(
            "\n4. 10,000 waits cancelled: listed after, handles kept right after, kept "
            f"{LET_GO_S:g} s after their work was done (leaked)"
        )
        for loop in loops:
            listed, kept, left = cancelled_run(loop)
            print(f"- {loop}: {listed} listed, {kept:,} kept until done, {left} left", flush=True)
            goals.judge(
                f"{loop}, 10,000 cancelled waits, listed and left",
                f"{listed} listed, {left} left (0 and 0)",
                listed == 0 and left == 0,
            )
    return goals.print()


if __name__ == "__main__":
    raise SystemExit(main())
