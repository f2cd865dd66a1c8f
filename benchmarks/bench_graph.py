"""What a graph's replay costs against submitting the same operations one by one, and what
awaiting a replay costs against awaiting a plain event.

For graphs of 1, 10, 100 and 1,000 kernel nodes (``ais.delay``), in one run with interleaved
rounds (the best round of each kept, as noise only adds):

- submit: the host CPU of one ``g.replay()`` (which returns its Event) against submitting the
  same n kernels (1 ms each) one by one and recording an Event after them. On a virtual device
  the clock is a manual one that does not move while this is timed, so only the submission is
  counted: the simulation of the kernels, which a virtual device does as its clock reaches
  them (a graph's nodes become items only then), is the device's work, as it is on a GPU.
  Goal at 100 nodes: at most 0.2x.
- in flight: the host time of one ``g.replay()`` (median of 200) once 10, 1,000 and 10,000
  replays of a 1 ms graph are still in flight on its stream, against the same replay with
  none in flight, in one run. Goal: flat, at most 50 us at 10,000 (the replays in flight are
  never all queried).
- await: what awaiting a replay's Event adds to the replay (the wall time of
  ``await g.replay()`` less that of ``g.replay()`` alone), against what awaiting an Event
  adds to submitting the same work one by one (a zero-length kernel and a record). Goal: at
  most 1x (no more than a plain await).

Usage: python benchmarks/bench_graph.py [--device virtual:0|cuda:0] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import anyio

import aiostream as ais

SIZES = (1, 10, 100, 1000)
GOAL_SUBMIT = 0.2  # at 100 nodes
GOAL_AWAIT = 1.0
KERNEL_S = 0.001


def best(fn: Any, reps: int, rounds: int) -> float:
    """The best of ``rounds`` rounds of ``reps`` calls of ``fn``: CPU seconds per call."""
    out = []
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(reps):
            fn()
        out.append((time.process_time() - t) / reps)
    return min(out)


def submit_costs(device: str, n: int, rounds: int) -> tuple[float, float]:
    """(one by one, replay): CPU seconds per submission of n kernels."""
    if device.startswith("virtual"):
        ais.virtual.reset(clock=ais.virtual.VirtualClock())  # nothing completes meanwhile
    s, r = ais.Stream(device), ais.Stream(device)
    g = ais.Graph(device, name=f"{n} nodes")
    with g.capture() as cs:
        for _ in range(n):
            ais.delay(KERNEL_S, stream=cs)
    reps = max(3, 2000 // n)

    def one_by_one() -> None:
        for _ in range(n):
            ais.delay(KERNEL_S, stream=s)
        s.record_event()

    def replay() -> None:
        g.replay(r)

    ones, replays = [], []
    for _ in range(rounds):  # interleaved: both see the same machine
        ones.append(best(one_by_one, reps, 1))
        replays.append(best(replay, reps, 1))
    g.close()
    if device.startswith("virtual"):
        ais.virtual.reset()
    return min(ones), min(replays)


IN_FLIGHT = (10, 1_000, 10_000)
GOAL_IN_FLIGHT_US = 50.0


def replay_in_flight(device: str, pending: int, reps: int = 200) -> float:
    """Median host seconds of one ``g.replay()`` (its Event dropped) with ``pending`` replays
    of a 1 ms graph still in flight on the same stream."""
    if device.startswith("virtual"):
        ais.virtual.reset(clock=ais.virtual.VirtualClock())  # nothing completes meanwhile
    g = ais.Graph(device, name="in flight")
    with g.capture() as cs:
        ais.delay(KERNEL_S, stream=cs)
    s = ais.Stream(device)
    ais.delay(5.0, stream=s)  # nothing completes meanwhile (the stand-in: hurried after)
    for _ in range(max(0, pending - reps // 2)):
        g.replay(s)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        g.replay(s)
        times.append(time.perf_counter() - t)
    g.close()
    if device.startswith("virtual"):
        ais.virtual.reset()
    else:
        _finish_cuda_work()
    return sorted(times)[len(times) // 2]


def _finish_cuda_work() -> None:
    """End the lead kernel and the replays behind it at once on the stand-in driver (a test
    hook), so that later rows do not queue behind them; a GPU runs them out (seconds)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.fake_cuda_hurry()
    except (OSError, AttributeError):
        pass


async def await_costs(device: str, rounds: int) -> tuple[float, float]:
    """(plain, replay): wall seconds an await adds to submitting the same work, a zero-length
    kernel: one by one then an Event recorded after it, or as a one-node graph's replay."""
    g = ais.Graph(device)
    with g.capture() as cs:
        ais.delay(0.0, stream=cs)
    s = ais.Stream(device)

    def plain() -> ais.Event:
        ais.delay(0.0, stream=s)
        return s.record_event()

    def replay() -> ais.Event:
        return g.replay(s)

    async def added(submit: Any, reps: int) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            submit()
        alone = (time.perf_counter() - t) / reps
        await s
        t = time.perf_counter()
        for _ in range(reps):
            await submit()
        return (time.perf_counter() - t) / reps - alone

    plain_t, replay_t = [], []
    for _ in range(rounds):  # interleaved
        await replay()  # warm
        plain_t.append(await added(plain, 200))
        replay_t.append(await added(replay, 200))
    g.close()
    return max(min(plain_t), 1e-9), max(min(replay_t), 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="virtual:0")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rounds = 2 if args.quick else 7
    rows = []
    for n in SIZES:
        one, rep = submit_costs(args.device, n, rounds)
        rows.append(
            {"nodes": n, "one_by_one_us": one * 1e6, "replay_us": rep * 1e6, "ratio": rep / one}
        )
    flight = {n: replay_in_flight(args.device, n) for n in (0, *IN_FLIGHT)}
    plain, replay = anyio.run(await_costs, args.device, rounds)
    at_100 = next(r for r in rows if r["nodes"] == 100)["ratio"]
    report = {
        "device": args.device,
        "python": platform.python_version(),
        "rows": rows,
        "await_plain_us": plain * 1e6,
        "await_replay_us": replay * 1e6,
        "await_ratio": replay / plain,
        "replay_in_flight_us": {str(n): t * 1e6 for n, t in flight.items()},
        "goals": {
            f"replay at 10,000 in flight <= {GOAL_IN_FLIGHT_US:g} us": flight[10_000] * 1e6
            <= GOAL_IN_FLIGHT_US,
            f"replay of 100 nodes <= {GOAL_SUBMIT}x one by one": at_100 <= GOAL_SUBMIT,
            f"await of a replay <= {GOAL_AWAIT}x a plain await": replay / plain <= GOAL_AWAIT,
        },
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"aiostream {ais.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {args.device}; best of {rounds} interleaved rounds\n"
    )
    print(f"{'nodes':>6} {'one by one':>12} {'replay':>10} {'ratio':>7}   (goal at 100: <= 0.2)")
    for r in rows:
        print(
            f"{r['nodes']:>6} {r['one_by_one_us']:>9.1f} us {r['replay_us']:>7.1f} us "
            f"{r['ratio']:>7.3f}"
        )
    print("\none replay's host time with replays in flight (median):")
    for n, t in flight.items():
        print(f"{n:>8,} in flight {t * 1e6:8.1f} us  {t / flight[0]:5.2f}x none")
    print(
        f"\nwhat an await adds (a zero-length kernel): to one by one {plain * 1e6:.1f} us, to a "
        f"replay {replay * 1e6:.1f} us: {replay / plain:.2f}x (goal <= 1)"
    )
    for goal, met in report["goals"].items():
        print(f"goal {'met' if met else 'MISSED'}: {goal}")


if __name__ == "__main__":
    main()
