"""Graphs on a GPU: aiostream beside PyTorch's graph capture, its own graphs replayed, and
whether its host functions slow other streams' kernels.

1. Coexistence: while 100 aiostream waits pend on 10 streams, a second thread captures a graph
   with ``torch.cuda.graph`` (its default mode, global) for about 0.3 s, then replays it; for
   each wait strategy. Without PyTorch (the stand-in driver of the tests), the second thread
   captures with raw driver calls in global mode instead. Prints whether the capture made a
   graph that ran and how many waits completed (goal: a graph, and 100 of 100).
2. An aiostream graph (a copy in, a kernel, a copy out) captured, replayed 1,000 times and
   awaited, the data checked.
3. Beside pending waits: two streams each running 50 kernels of 1 ms, their span by the
   device's clock and their await by the host's, while 1,000 waits pend on 4 and on 32 other
   streams (fewer and more than the device's 8 queues) behind 0.5 s of work: none, events
   recorded by the driver alone (no mark), recorded with their marks and not awaited, and
   awaited with each strategy; how late the kernels started (held), their span and their
   awaits. On an H100 (driver 580) the awaits of such kernels took 9.45 s instead of 51 ms
   beside ``callback`` waits pending on 10 streams (and long kernels of an earlier pass):
   the rows say whether host functions, marks or shared queues hold the kernels or only
   their wake-ups. (``bench_cuda.py`` section 7: the same
   with 100 other streams, ``hybrid`` and ``quiet``.)

Usage: python benchmarks/gpu_graphs.py [--device cuda:0]
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import anyio
from cuda_waits import print_beside

import aiostream as ais
from aiostream._waiting import STRATEGIES  # the default first


class TorchCapture:
    """A thread that captures with ``torch.cuda.graph`` (global mode) for the block's time."""

    def __init__(self) -> None:
        self.ok = False
        self.error = ""
        self._begun, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TorchCapture:
        self._thread.start()
        self._begun.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        import torch

        try:
            x = torch.ones(1 << 20, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up outside the capture, as PyTorch asks
                y = x * 2
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # capture_error_mode="global", PyTorch's default
                y = x * 2
                self._begun.set()
                while not self._stop.wait(0.01):
                    y = y + 1
            g.replay()
            torch.cuda.synchronize()
            self.ok = bool(y.sum().item() > 0)
        except BaseException as exc:  # noqa: BLE001 - reported
            self.error = f"{type(exc).__name__}: {exc}"
            self._begun.set()


class RawCapture:
    """The same with raw driver calls (no PyTorch): a copy node captured every 10 ms."""

    def __init__(self) -> None:
        self.ok = False
        self.error = ""
        self._begun, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    __enter__ = TorchCapture.__enter__
    __exit__ = TorchCapture.__exit__

    def _run(self) -> None:
        from cuda.bindings import driver as cu

        dev = cu.cuDeviceGet(0)[1]
        ctx = cu.cuDevicePrimaryCtxRetain(dev)[1]
        cu.cuCtxPushCurrent(ctx)
        try:
            stream = cu.cuStreamCreate(1)[1]
            src, dst = cu.cuMemAlloc(4096)[1], cu.cuMemAlloc(4096)[1]
            cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode(0))
            self._begun.set()
            while not self._stop.wait(0.01):
                cu.cuMemcpyDtoDAsync(dst, src, 4096, stream)
            err, graph = cu.cuStreamEndCapture(stream)
            if int(err) == 0:
                exe = cu.cuGraphInstantiate(graph, 0)[1]
                self.ok = int(cu.cuGraphLaunch(exe, stream)[0]) == 0
                cu.cuStreamSynchronize(stream)
                cu.cuGraphExecDestroy(exe)
                cu.cuGraphDestroy(graph)
            else:
                self.error = f"cuStreamEndCapture: {err!r}"
            cu.cuMemFree(src)
            cu.cuMemFree(dst)
            cu.cuStreamDestroy(stream)
        except BaseException as exc:  # noqa: BLE001 - reported
            self.error = f"{type(exc).__name__}: {exc}"
            self._begun.set()
        finally:
            cu.cuCtxPopCurrent()
            cu.cuDevicePrimaryCtxRelease(dev)


def capture_beside(device: str) -> Any:
    try:
        import torch

        if torch.cuda.is_available():
            return TorchCapture, "torch.cuda.graph"
    except ImportError:
        pass
    return RawCapture, "raw driver calls (no PyTorch)"


async def coexistence(device: str, strategy: str) -> tuple[bool, int, str]:
    ais.set_wait_strategy(strategy)
    streams = [ais.Stream(device) for _ in range(10)]
    events = []
    for s in streams:
        for _ in range(10):
            ais.delay(0.04, stream=s)
            events.append(s.record_event())
    done = 0

    async def wait(e: ais.Event) -> None:
        nonlocal done
        try:
            await e
            done += 1
        except ais.AiostreamError:
            pass

    kind, _ = capture_beside(device)
    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(wait, e)
        await anyio.sleep(0.01)
        with kind() as capture:
            await anyio.sleep(0.3)
    ais.set_wait_strategy(None)
    return capture.ok, done, capture.error


async def replays(device: str, n: int) -> tuple[float, bool]:
    src, dst = ais.HostBuffer(1 << 16, device=device), ais.HostBuffer(1 << 16, device=device)
    buf = ais.DeviceBuffer(1 << 16, device)
    g = ais.Graph(device, name="pipeline")
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        ais.delay(0.0001, stream=s)
        ais.copy_async(dst, buf, stream=s)
    r = ais.Stream(device)
    src.numpy()[:] = 7
    t = time.perf_counter()
    for _ in range(n):
        last = g.replay(r)
    await last
    took = time.perf_counter() - t
    ok = bool((dst.numpy() == 7).all())
    g.close()
    return took, ok


async def main(device: str) -> None:
    _, how = capture_beside(device)
    print(f"1. A graph captured on a second thread by {how}, beside 100 pending waits:")
    for strategy in STRATEGIES:
        ok, done, error = await coexistence(device, strategy)
        verdict = "met" if ok and done == 100 else "MISSED"
        print(f"   {strategy:9} graph ran: {ok}; waits completed: {done}/100 ({verdict}) {error}")
    took, ok = await replays(device, 1000)
    print(f"2. 1,000 replays of a 3-node graph: {took * 1e3:.1f} ms, data right: {ok}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    anyio.run(main, args.device)
    print(
        "3. two streams x 50 kernels of 1 ms beside 1,000 waits pending on 4 and on 32 other "
        "streams behind 0.5 s of work (x: over no waits)"
    )
    print_beside((4, 32), device=args.device)
