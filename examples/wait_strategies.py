"""Choosing how a wait is watched: globally, or for one await.

On CUDA devices the strategy decides how the loop learns that work completed (docs/cuda.md's
"Waiting strategies" has the details and costs): ``quiet`` (the default) has the loop read
the work's completion mark on its turns for a short check budget (at most 500 us, adapted to
the recent waits), then hands the wait to the device's watcher thread, which polls the
marks, backing off to 2 ms and, as waits age, to 1 % of their age (at most 10 ms, or 10 %
and 50 ms where its wake-ups cost much CPU); ``hybrid`` is ``quiet`` with the watcher woken
by a host function instead; ``poll`` has the loop alone read the mark, backing off to 2 ms;
``thread`` has the watcher alone poll the marks; ``callback`` has the watcher alone, woken by
the host function. A virtual device knows when its work completes, so there every strategy
sleeps until that moment.

Run it with ``python examples/wait_strategies.py``: on ``cuda:0`` where a GPU works, else on
``virtual:0``.
"""

import time

import anyio

import aiostream as ais


async def main() -> None:
    device = ais.device()
    s = ais.Stream(device)
    for strategy in ("quiet", "hybrid", "poll", "thread", "callback"):
        ais.delay(0.02, stream=s)
        done = s.record_event()
        t0 = time.perf_counter()
        await done.synchronize(strategy=strategy)  # this await only
        print(f"{strategy:8} resumed after {(time.perf_counter() - t0) * 1000:5.1f} ms on {device}")
    ais.set_wait_strategy("thread")  # every await from now on (or AIOSTREAM_WAIT_STRATEGY)
    try:
        ais.delay(0.02, stream=s)
        await s.synchronize()
        print(f"default strategy is now {ais.get_wait_strategy()!r}")
    finally:
        ais.set_wait_strategy(None)


if __name__ == "__main__":
    anyio.run(main)
