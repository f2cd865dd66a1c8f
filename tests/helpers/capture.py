"""Another library's stream capture, as a serving engine makes one beside aiostream: a thread
of its own, with the device's primary context current, captures work on a stream of its own
in the mode it is given (GLOBAL, as ``torch.cuda.graph`` does by default), for as long as the
test keeps the ``with`` block open, then ends the capture, instantiates the graph and launches
it once. Raw driver calls through cuda-python only: it runs on the stand-in and on a GPU.
"""

from __future__ import annotations

import threading
from typing import Any

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2  # CUstreamCaptureMode
MODES = {"global": GLOBAL, "thread_local": THREAD_LOCAL, "relaxed": RELAXED}
NBYTES = 4096


class ForeignCapture:
    """``with ForeignCapture("global") as cap:`` the capture is under way inside the block
    (a copy node captured every ``every_s``); after it, ``cap.end_code`` is what
    ``cuStreamEndCapture`` answered (0: a graph), ``cap.nodes`` how many nodes the graph has,
    ``cap.captured`` how many copies were captured (``cap.refused``: the code of the first
    refused), and ``cap.launched`` whether the instantiated graph ran to its end."""

    def __init__(self, mode: str = "global", device: int = 0, every_s: float = 0.01) -> None:
        self.mode, self.device, self.every_s = MODES[mode], device, every_s
        self.end_code: int | None = None
        self.nodes = self.captured = 0
        self.launched = False
        self.refused = 0  # the first code a captured copy got, once the capture was broken
        self.error: BaseException | None = None
        self._begun, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-capture", daemon=True)

    def __enter__(self) -> ForeignCapture:
        self._thread.start()
        if not self._begun.wait(30):
            raise TimeoutError("the foreign capture did not begin within 30 s")
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._thread.is_alive():
            raise TimeoutError("the foreign capture's thread did not end within 30 s")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        from cuda.bindings import driver as cu

        def ok(result: tuple[Any, ...]) -> Any:
            if int(result[0]) != 0:
                raise RuntimeError(f"driver call failed: {result[0]!r}")
            return result[1] if len(result) == 2 else result[1:]

        dev = ok(cu.cuDeviceGet(self.device))
        ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
        stream = src = dst = None
        capturing = False
        try:
            ok(cu.cuCtxPushCurrent(ctx))
            stream = ok(cu.cuStreamCreate(1))  # CU_STREAM_NON_BLOCKING, as PyTorch's are
            # stream-ordered, before the capture: cuMemFree would wait for the whole device,
            # whose other streams the test holds until this thread has ended
            src, dst = (
                ok(cu.cuMemAllocAsync(NBYTES, stream)),
                ok(cu.cuMemAllocAsync(NBYTES, stream)),
            )
            ok(cu.cuStreamSynchronize(stream))
            ok(cu.cuStreamBeginCapture(stream, self.mode))
            capturing = True
            self._begun.set()
            while True:  # the capture goes on while the test's block runs
                code = int(cu.cuMemcpyDtoDAsync(dst, src, NBYTES, stream)[0])
                if code == 0:
                    self.captured += 1
                else:  # invalidated by someone: the capture still has to be ended
                    self.refused = self.refused or code
                if self._stop.wait(self.every_s):
                    break
            result = cu.cuStreamEndCapture(stream)
            capturing = False
            self.end_code = int(result[0])
            if self.end_code == 0:
                graph = result[1]
                self.nodes = int(ok(cu.cuGraphGetNodes(graph))[1])
                exe = ok(cu.cuGraphInstantiate(graph, 0))
                ok(cu.cuGraphLaunch(exe, stream))
                ok(cu.cuStreamSynchronize(stream))
                self.launched = True
                ok(cu.cuGraphExecDestroy(exe))
                ok(cu.cuGraphDestroy(graph))
        except BaseException as exc:  # handed to the test at the block's end
            self.error = exc
            self._begun.set()
        finally:
            if capturing:  # ended before the frees, which a capture would take in
                ended = cu.cuStreamEndCapture(stream)
                if int(ended[0]) == 0 and ended[1] is not None:
                    cu.cuGraphDestroy(ended[1])
            if stream is not None:
                for ptr in (src, dst):
                    if ptr is not None:
                        cu.cuMemFreeAsync(ptr, stream)
                cu.cuStreamSynchronize(stream)
                cu.cuStreamDestroy(stream)
            cu.cuCtxPopCurrent()
            cu.cuDevicePrimaryCtxRelease(dev)
